"""The adapter kinds a rana folder may hold: one table that writing and reading both use.

Each adapter class declares its entry in ``rana_config.json``: ``spec_type`` (the entry's ``type``),
``spec_fields`` (field → kind, below), ``spec_defaults`` (optional fields and their values),
``to_spec(root)`` (the fields it writes) and ``from_spec(spec, ...)`` (an empty module of the
recorded shapes, weights to be loaded afterwards). `rana.io.format` writes with the table and the
loader rebuilds with it, so a kind cannot be written without being readable. This file ships with
exports (remote code): it imports only the adapter modules.

Field kinds: ``"size"`` a positive integer, ``"count"`` a non-negative one, ``"flag"`` true or
false, ``"threshold"`` null (-inf: everything active), a finite number or ``"inf"`` (nothing
active), ``"head_threshold"`` the same without ``"inf"``, ``"adapter"`` the path of another
adapter of the folder (built first), a tuple: one of its strings.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from .cats import CatsActivation
from ..archs import set_submodule
from .experts import InputSparseExperts
from .int8 import Int8Linear
from .neuron_linear import (InputSparseHead, InputSparseLinear, Int8InputSparseHead, NeuronThresholdLinear,
                            SparseLowRankLinear)
from .rank_linear import RankAdapterLinear, RankSliceLinear, SharedRankCode
from .rotation import RotatedInput

ADAPTER_CLASSES = (RankAdapterLinear, SharedRankCode, RankSliceLinear, NeuronThresholdLinear, SparseLowRankLinear,
                   InputSparseHead, InputSparseLinear, CatsActivation, RotatedInput, InputSparseExperts)
ADAPTER_KINDS: dict[str, type] = {cls.spec_type: cls for cls in ADAPTER_CLASSES}
FIELD_KINDS = ("size", "count", "flag", "threshold", "head_threshold", "adapter")


def adapter_class(module: nn.Module) -> type | None:
    """The registered class `module` is an instance of (its own or a base: subclasses write as their base)."""
    for cls in type(module).__mro__:
        if ADAPTER_KINDS.get(getattr(cls, "spec_type", None)) is cls:
            return cls
    return None


def spec_threshold(value) -> float:
    """A recorded threshold as a float (null: -inf, "inf": +inf); the loader has checked its form."""
    return -math.inf if value is None else float(value)


def build_order(specs: list[dict]) -> list[dict]:
    """`specs` with the adapters others name (a shared code) first: those naming one are built after."""
    def names_another(s):
        cls = ADAPTER_KINDS.get(s.get("type"))
        return cls is not None and "adapter" in cls.spec_fields.values()
    return sorted(specs, key=names_another)


def _check_fits(model: nn.Module, path: str, new: nn.Module) -> None:
    """The recorded in/out of an adapter are those of the projection it replaces (a tied LM head's
    weight is not in the file: nothing else would catch a wrong shape, and the FLOPs counted by it)."""
    try:
        old = model.get_submodule(path)
    except AttributeError:
        return  # a module of its own (a shared code), or a path the caller refuses
    for attr, key in (("in_features", "in"), ("out_features", "out")):
        have, want = getattr(old, attr, None), getattr(new, attr, None)
        if isinstance(have, int) and isinstance(want, int) and have != want:
            raise ValueError(f"adapter '{path}': its '{key}' is {want}, the model's {type(old).__name__} has {have}")


def build_adapter(model: nn.Module, spec: dict, dtype: torch.dtype, built: dict) -> nn.Module:
    """An empty adapter of the kind and shapes `spec` records, checked against the module it replaces.
    `built`: the adapters already built, by path (what an "adapter" field names)."""
    cls = ADAPTER_KINDS[spec["type"]]
    zeros = lambda *shape: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    m = cls.from_spec(spec, zeros=zeros, threshold=spec_threshold(spec.get("threshold")), model=model, built=built)
    _check_fits(model, spec["path"], m)
    if spec.get("active_fraction") is not None and hasattr(m, "set_active_fraction"):  # absent in older folders
        m.set_active_fraction(float(spec["active_fraction"]))
    return m


# ---------------------------------------------------------------------------- int8 weights
INT8_CLASSES = (Int8Linear, Int8InputSparseHead)


def int8_paths(model: nn.Module) -> list[str]:
    """The module paths whose weights are int8 (rana_config.json's `int8.modules`), in module order."""
    return [name for name, m in model.named_modules() if type(m) in INT8_CLASSES]


def int8_form(module: nn.Module, q: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> nn.Module:
    """The int8 replacement of a linear layer or an input-sparse LM head: from codes q (out × in, int8) and
    scales (out,), or empty (weights to be loaded afterwards)."""
    if isinstance(module, InputSparseHead):
        return Int8InputSparseHead.from_head(module, q, scale)
    if type(module) is nn.Linear:
        if q is None:
            return Int8Linear.empty_like(module)
        return Int8Linear.from_quantized(q, scale, module.bias, module.weight.dtype).to(module.weight.device)
    raise ValueError(f"a {type(module).__name__} has no int8 form (only linear layers and the input-sparse LM head)")


def install_int8(model: nn.Module, paths: list[str]) -> None:
    """Swap the modules at `paths` (a folder's `int8.modules`) for empty int8 ones of their shapes, after
    the adapters are installed and before the weights load (rana.load, the quantizer, the remote code)."""
    for path in paths:
        m = model.get_submodule(path)
        if type(m) in INT8_CLASSES:
            continue
        try:
            new = int8_form(m)
        except ValueError as e:
            raise ValueError(f"int8 weights recorded for '{path}': {e}") from None
        set_submodule(model, path, new)


__all__ = ["INT8_CLASSES", "int8_paths", "int8_form", "install_int8", "ADAPTER_CLASSES", "ADAPTER_KINDS", "FIELD_KINDS", "adapter_class", "spec_threshold", "build_order",
           "build_adapter"]
