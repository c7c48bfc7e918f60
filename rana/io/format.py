"""The rana folder format: file names, the format version, the adapter descriptions in
`rana_config.json` (enough to rebuild empty adapters of the recorded shapes) and the one JSON
writer every rana output uses (atomic: a file is complete or absent).

A rana folder holds the HF config + tokenizer, `model.safetensors` (or shards named by
`model.safetensors.index.json`, for models compressed from disk), `rana_config.json` (every
adapter's type, shape, rank, threshold) and `plan.json`.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.nn as nn

from ..modules import rebuild
from ..modules.int8 import activation_format_of
from ..modules.registry import adapter_class
from .compress_settings import CompressSettings  # re-exported: it moved to its own module
# the names every loader shares (rana.load, the quantizer, an export's remote code) are written once there
from .loadchecks import WEIGHT_FORMATS, WEIGHTS, WEIGHTS_INDEX, ModelLoadError, threshold_from_json, tied_keys
from .version import FORMAT_VERSION

# WEIGHTS: model.safetensors; WEIGHTS_INDEX: its index, the sharded layout written for models compressed from disk;
# WEIGHT_FORMATS: `weights` in rana_config.json / plan.json / the compress settings ("none" or "int8")
RANA_CONFIG = "rana_config.json"
PLAN = "plan.json"


def write_json(path: Path, obj) -> None:
    """`obj` as indented JSON (numbers rana keeps as tensors or numpy scalars as floats), written
    to a temp file beside `path` and renamed over it: the file is complete or absent, also when the
    disk fills up."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(json.dumps(obj, indent=2, default=float) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def threshold_to_json(x: float) -> float | str | None:
    """A threshold as JSON: null for -inf (everything active), "inf" for +inf (nothing active)."""
    if x == math.inf:
        return "inf"
    return None if math.isinf(x) else x


def adapter_specs(model: nn.Module, *, outside: str | None = None) -> list[dict]:
    """A JSON description of every adapter module, enough to rebuild empty ones (plus, when known, the
    expected active fraction that picks the decode kernels' sparsity bin). Each class writes its own
    fields (`rana.modules.registry`, the table the loader reads with). `outside`: only the adapters
    not under that module path (a streamed model's layers are on the meta device; their specs were
    written layer by layer)."""
    specs = []
    for name, m in model.named_modules():
        if outside is not None and (name == outside or name.startswith(outside + ".")):
            continue
        cls = adapter_class(m)
        if cls is None:
            continue
        spec = {"path": name, "type": cls.spec_type, **cls.to_spec(m, model)}
        if "threshold" in spec:
            spec["threshold"] = threshold_to_json(spec["threshold"])
        if getattr(m, "active_fraction", None) is not None:
            spec["active_fraction"] = m.active_fraction  # the decode kernels' sparsity bin (optional key)
        specs.append(spec)
    return specs


def install_empty_adapters(model: nn.Module, specs: list[dict], dtype: torch.dtype) -> None:
    """Swap in adapters of the recorded shapes (weights to be loaded afterwards), each rebuilt by
    its registered class: `rana.modules.rebuild.install_empty_adapters` (shipped with exports), the
    specs read from a folder's rana_config.json."""
    rebuild.install_empty_adapters(model, specs, dtype, RANA_CONFIG)


def weights_meta(model: nn.Module) -> dict:
    """rana_config.json's record of int8 weights: {"weights": "int8", "int8": {"modules": [paths], "activations":
    "float" | "int8", "activation_block": B (int8 activations)}} when the model holds int8 modules (every path's
    module is rebuilt as int8 before the weights load, decoding its tokens as the activation format says), else
    {}."""
    paths = rebuild.int8_paths(model)
    if not paths:
        return {}
    return {"weights": "int8", "int8": {"modules": paths, **activation_format_of(model)}}


__all__ = ["WEIGHT_FORMATS", "weights_meta", "FORMAT_VERSION", "WEIGHTS", "WEIGHTS_INDEX", "RANA_CONFIG", "PLAN", "ModelLoadError", "CompressSettings",
           "write_json",
           "threshold_to_json", "threshold_from_json", "adapter_specs", "install_empty_adapters", "tied_keys"]
