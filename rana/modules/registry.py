"""The adapter kinds: every adapter class registers itself here and describes everything a consumer needs
to know about it, so that adding a kind is one new module in `rana/modules/` (plus its test).

A kind registers with the class decorator `@register_adapter`; `rana/modules/__init__.py` imports every
module of the package, so a new `rana/modules/<kind>.py` registers by existing (an export imports the
shipped copies of the registered kinds' modules from its `modeling_rana.py`). Registration order is the
import order (deterministic: `rana/modules/__init__.py`), kept by `adapter_classes()` and `ADAPTER_KINDS`.
This file ships with exports (remote code) and names no adapter module.

What a kind declares (each checked at registration: a kind that forgets one fails at import). A kind derived
from `rana.modules.common.Adapter` takes each from there with the value most kinds share (no linear children,
no weights of its own, no masked decode, not grouped, not blended, no refit, no rank code, no column norms, no
int8 form; ``restore`` puts its weights back in their decode layouts), so it declares only what differs:

``spec_type`` / ``spec_fields`` / ``to_spec(root)`` / ``from_spec(spec, ...)``
    its entry in ``rana_config.json``: the entry's ``type``, its fields (field → kind, below), the
    fields it writes, and an empty module of the recorded shapes (weights loaded afterwards).
    Optional ``spec_defaults``: fields a folder may lack, and what their absence meant.
``linear_children``
    the names of its nn.Linear children, in registration order: what LoRA wraps (``--lora-targets
    adapters``) and what `rana.modules.common.restore_layouts` lays out again after a merge or a load
    (column-major, except those in the optional ``row_major_children``).
``bare_weights``
    True when its weights are parameters of its own, not linear children (the LM head's ``weight``,
    the stacked experts'): LoRA cannot wrap them, so naming it in ``--lora-targets`` is refused with a
    pointer to ``--full``.
``decode_mode``
    the mask mode of its one-token masked GEMV (``"square"``, ``"abs_scaled"``, ``"abs"``), or None when
    it has no masked-GEMV decode path (`rana.modules.common.MaskedDecode` passes it to the kernels).
``groupable``
    True when siblings of it that read one input decode in one grouped launch (`rana.modules.groups`);
    it then also defines ``decode_operands(x, code=None)``: (its input, the operand of the matrix it masks,
    threshold, scale) for the group's one call (`code`: its input when the group computed it).
``self_guided``
    how the self-guided start (`rana.finetune.guidance`) blends it with a dense path: ``"dense"`` (the
    original dense weight of its projection, loaded from the dense model), ``"unmasked"`` (its own
    weights without the mask: it defines ``unmasked(x)``), or None (not blended).
``refit``
    how `rana quantize` refits its threshold on the quantized model's activations: ``"own"`` (its
    threshold, scored on its own forward input), ``"shared"`` (its threshold, scored on the inputs of
    the modules that read its code: it is never called itself), ``"owner"`` (no threshold of its own:
    its forward input scores ``threshold_owner()``'s), or None. ``"own"`` and ``"shared"`` define
    ``mask_width()`` (entries of one token's mask) and ``refit_scores(x)`` (what the threshold is
    compared with, rows × mask width, float32).
``rank_code``
    True when it computes a rank code ``z = B x`` with a child ``B`` (the diagnostics' rank
    contributions).
``norms_child``
    the linear child whose column norms its mask reads, or None; such a kind defines
    ``refresh_norms(weight=None)`` (from its child's weight, or from the effective weight LoRA trains).
``restore(root)``
    what to do once its weights were replaced (a load, a LoRA merge): decode layouts, and whatever it
    derives from its weights (column norms). `rana.modules.rebuild.restore_adapters` calls it.
``int8_form``
    None, or a method ``int8_form(q=None, scale=None)`` returning its int8 replacement when the kind is
    itself quantized (not only its linear children): the input-sparse LM head.

Its FLOP meter is its own `rana.modules.common.MacMeter` (`rana.accounting` reads every meter).

Field kinds: ``"size"`` a positive integer, ``"count"`` a non-negative one, ``"flag"`` true or
false, ``"threshold"`` null (-inf: everything active), a finite number or ``"inf"`` (nothing
active), ``"head_threshold"`` the same without ``"inf"``, ``"adapter"`` the path of another
adapter of the folder (built first), a tuple: one of its strings.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from ..errors import UserError

FIELD_KINDS = ("size", "count", "flag", "threshold", "head_threshold", "adapter")
SELF_GUIDED = ("dense", "unmasked")
REFIT = ("own", "shared", "owner")

# spec_type → class, in registration order (filled by @register_adapter as the adapter modules import)
ADAPTER_KINDS: dict[str, type] = {}


def _contract_errors(cls: type) -> list[str]:
    """What `cls` fails to declare, or declares wrongly (see the module docstring)."""
    required = ("spec_type", "spec_fields", "to_spec", "from_spec", "linear_children", "bare_weights", "decode_mode",
                "groupable", "self_guided", "refit", "rank_code", "norms_child", "restore", "int8_form")
    missing = [name for name in required if not hasattr(cls, name)]
    if missing:
        return [f"declares no {', '.join(missing)}"]
    errors = []

    def needs(condition: bool, *methods: str) -> None:
        if condition:
            errors.extend(f"needs a method {m}" for m in methods if not callable(getattr(cls, m, None)))

    if not isinstance(cls.spec_type, str) or not cls.spec_type:
        errors.append("spec_type must be a non-empty string")
    if not isinstance(cls.spec_fields, dict) or any(
            not (kind in FIELD_KINDS or (isinstance(kind, tuple) and kind)) for kind in cls.spec_fields.values()):
        errors.append(f"spec_fields must map field names to one of {', '.join(FIELD_KINDS)} or a tuple of choices")
    children = cls.linear_children
    if not isinstance(children, tuple) or not all(isinstance(c, str) for c in children):
        errors.append("linear_children must be a tuple of child names")
    elif not set(getattr(cls, "row_major_children", ())) <= set(children):
        errors.append("row_major_children must be among linear_children")
    for flag in ("bare_weights", "groupable", "rank_code"):
        if not isinstance(getattr(cls, flag), bool):
            errors.append(f"{flag} must be True or False")
    if cls.decode_mode is not None and not isinstance(cls.decode_mode, str):
        errors.append("decode_mode must be a mask mode or None")
    needs(cls.groupable is True, "decode_operands")
    if cls.groupable is True and cls.decode_mode is None:
        errors.append("a groupable kind needs a decode_mode")
    if cls.self_guided not in (None, *SELF_GUIDED):
        errors.append(f"self_guided must be one of {', '.join(SELF_GUIDED)} or None")
    needs(cls.self_guided == "unmasked", "unmasked")
    if cls.refit not in (None, *REFIT):
        errors.append(f"refit must be one of {', '.join(REFIT)} or None")
    needs(cls.refit in ("own", "shared"), "mask_width", "refit_scores")
    needs(cls.refit == "owner", "threshold_owner")
    if cls.norms_child is not None and cls.norms_child not in (children if isinstance(children, tuple) else ()):
        errors.append("norms_child must be one of linear_children or None")
    needs(cls.norms_child is not None, "refresh_norms")
    needs(True, "to_spec", "from_spec", "restore")
    if cls.int8_form is not None and not callable(cls.int8_form):
        errors.append("int8_form must be a method or None")
    return errors


def register_adapter(cls: type) -> type:
    """Class decorator: record `cls` as the adapter kind `cls.spec_type`, after checking that it declares
    everything the module docstring lists (TypeError otherwise, at import)."""
    errors = _contract_errors(cls)
    if errors:
        raise TypeError(f"adapter kind {cls.__qualname__}: {'; '.join(errors)} (see rana.modules.registry)")
    known = ADAPTER_KINDS.get(cls.spec_type)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"adapter kind {cls.__qualname__}: spec_type {cls.spec_type!r} is {known.__qualname__}'s")
    ADAPTER_KINDS[cls.spec_type] = cls  # a module imported again replaces its own classes in place
    return cls


def adapter_classes() -> tuple[type, ...]:
    """Every registered adapter class, in registration order."""
    return tuple(ADAPTER_KINDS.values())


def __getattr__(name: str):
    # ADAPTER_CLASSES reads the registrations when it is asked for (the adapter modules register after
    # this module is imported)
    if name == "ADAPTER_CLASSES":
        return adapter_classes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def adapter_class(module: nn.Module) -> type | None:
    """The registered class `module` is an instance of (its own or a base: subclasses write as their base)."""
    for cls in type(module).__mro__:
        if ADAPTER_KINDS.get(getattr(cls, "spec_type", None)) is cls:
            return cls
    return None


def declared(module: nn.Module, name: str):
    """What the adapter kind of `module` declares as `name` (module docstring); None for a module that is
    not an adapter."""
    cls = adapter_class(module)
    return None if cls is None else getattr(cls, name)


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
            raise UserError(f"adapter '{path}': its '{key}' is {want}, the model's {type(old).__name__} has {have}")


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


__all__ = ["ADAPTER_KINDS", "FIELD_KINDS", "register_adapter", "adapter_classes", "adapter_class", "declared",
           "spec_threshold", "build_order", "build_adapter"]
