"""One schema for what rana reads back from a folder: ``rana_config.json`` and ``plan.json``.

Every field a reader uses is checked on load (type, range, known values), so a hand-edited or
damaged file is refused with one line naming the file and the field, before any command works on
it — not met later as a KeyError, or after a fine-tune as a crash in the model-card writer.
Fields no reader uses are let through (newer rana versions may add some). The adapter entries'
fields are the ones their classes declare (`rana.modules.registry`).

A check is a function ``(value, field)`` that raises `FieldError`; the combinators below build them.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from ..modules.registry import ADAPTER_KINDS
from .compress_settings import recorded_fields
from ..modules.int8 import ACTIVATIONS
from .format import FORMAT_VERSION, WEIGHT_FORMATS, threshold_from_json
from ..errors import UserError

Check = Callable[[Any, str], None]
DTYPE_NAMES = ("float32", "bfloat16", "float16")
_MISSING = object()


class FieldError(UserError):
    """A field of a folder's JSON file that is absent, of the wrong type or out of range."""


def _fail(field: str, what: str, value) -> None:
    got = "it is missing" if value is _MISSING else f"got {value!r}"
    raise FieldError(f"'{field}' must be {what}, {got}")


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def anything(value, field: str) -> None:
    """No check: a field only shown (e.g. in the card)."""


def number(lo: float | None = None, hi: float | None = None, *, finite: bool = False) -> Check:
    what = "a number" + (f" in [{lo:g}, {hi:g}]" if lo is not None and hi is not None
                         else f" >= {lo:g}" if lo is not None else "")
    def check(v, field):
        if not _is_number(v) or (finite and not math.isfinite(v)) or (lo is not None and not v >= lo) \
                or (hi is not None and not v <= hi):
            _fail(field, what, v)
    return check


def integer(lo: int | None = None, what: str | None = None) -> Check:
    what = what or ("an integer" + (f" >= {lo}" if lo is not None else ""))
    def check(v, field):
        if isinstance(v, bool) or not isinstance(v, int) or (lo is not None and v < lo):
            _fail(field, what, v)
    return check


def text(choices: tuple[str, ...] | None = None) -> Check:
    what = "one of " + ", ".join(repr(c) for c in choices) if choices else "a string"
    def check(v, field):
        if not isinstance(v, str) or (choices and v not in choices):
            _fail(field, what, v)
    return check


def flag(v, field: str) -> None:
    if not isinstance(v, bool):
        _fail(field, "true or false", v)


def optional(inner: Check) -> Check:
    """`inner`, or null / absent."""
    def check(v, field):
        if v is not None and v is not _MISSING:
            inner(v, field)
    return check


def list_of(item: Check) -> Check:
    def check(v, field):
        if not isinstance(v, list):
            _fail(field, "a list", v)
        for i, x in enumerate(v):
            item(x, f"{field}[{i}]")
    return check


def mapping(value: Check) -> Check:
    """A JSON object whose every value passes `value` (any keys)."""
    def check(v, field):
        if not isinstance(v, dict):
            _fail(field, "an object", v)
        for k, x in v.items():
            value(x, f"{field}.{k}")
    return check


def record(spec: dict[str, Check], *, required: tuple[str, ...] = ()) -> Check:
    """A JSON object: the named fields checked (absent ones only when `required`), the rest let through."""
    def check(v, field):
        if not isinstance(v, dict):
            _fail(field, "an object", v)
        for k, inner in spec.items():
            if k in v or k in required:
                inner(v.get(k, _MISSING), f"{field}.{k}" if field else k)
    return check


def _setting_check(annotation: str) -> Check:
    """The check of one CompressSettings field, from its annotation (a string: postponed annotations)."""
    base = {"str": text(), "float": number(), "int": integer()}
    if annotation.endswith(" | None"):
        return optional(base[annotation.removesuffix(" | None")])
    return base[annotation]


# settings recorded as plan.json's `config` and rana_config.json's `compress_config`: their types,
# and the values the card and the recipe build on
_SETTINGS_VALUES = {"flops": number(0.0, 1.0), "dtype": text(DTYPE_NAMES), "allocation": text(("uniform", "global")),
                    "lm_head": text(("auto", "dense", "sparse")), "calib_tokens": integer(1), "seq_len": integer(1),
                    "batch_size": integer(1), "format_version": integer(0), "weights": text(WEIGHT_FORMATS)}
SETTINGS = record({**{f.name: _setting_check(str(f.type)) for f in recorded_fields()},
                   **_SETTINGS_VALUES})


# ---------------------------------------------------------------------------- rana_config.json

def _threshold(head: bool) -> Check:
    def check(v, field):
        if v is _MISSING:
            _fail(field, "present (null means -inf, \"inf\" means +inf)", v)
        try:
            t = threshold_from_json(v)
        except ValueError as e:
            raise FieldError(f"'{field}': {e}") from None
        if head and t == math.inf:
            raise FieldError(f"'{field}' is \"inf\": the LM head would mask every input (each logit its bias)")
    return check


def _adapter_field(kind) -> Check:
    """The check of one declared adapter field kind (rana.modules.registry's FIELD_KINDS)."""
    if isinstance(kind, tuple):
        return text(kind)
    return {"size": integer(1, "a positive integer"), "count": integer(0, "a non-negative integer"), "flag": flag,
            "threshold": _threshold(False), "head_threshold": _threshold(True), "adapter": text()}[kind]


def _check_adapter(a, field: str) -> None:
    """One `adapters` entry, as its class declares it; errors name the adapter by its path."""
    if not isinstance(a, dict) or not isinstance(a.get("path"), str) or not a["path"]:
        raise FieldError(f"'{field}' has no 'path'")
    cls = ADAPTER_KINDS.get(a.get("type"))
    if cls is None:
        raise FieldError(f"adapter '{a['path']}' has unknown type {a.get('type')!r} "
                         f"(known: {', '.join(sorted(ADAPTER_KINDS))})")
    defaults = getattr(cls, "spec_defaults", {})
    checks = {k: _adapter_field(kind) for k, kind in cls.spec_fields.items()}
    checks["active_fraction"] = optional(number(0.0, 1.0))  # the decode kernels' sparsity bin; older folders lack it
    try:
        record(checks, required=tuple(k for k in cls.spec_fields if k not in defaults))(a, "")
    except FieldError as e:
        raise FieldError(f"adapter '{a['path']}': {e}") from None


def _check_adapters(v, field: str) -> None:
    list_of(_check_adapter)(v, field)
    paths = {a["path"]: a["type"] for a in v}
    if len(paths) != len(v):
        raise FieldError(f"'{field}' names a path twice")
    for a in v:
        for key, kind in ADAPTER_KINDS[a["type"]].spec_fields.items():
            if kind == "adapter" and a[key] not in paths:
                raise FieldError(f"adapter '{a['path']}': its '{key}' {a[key]!r} is not an adapter of this folder")


def _check_version(v, field: str) -> None:
    integer(0)(v, field)
    if v > FORMAT_VERSION:
        raise FieldError(f"'{field}' {v!r} is newer than this rana reads ({FORMAT_VERSION}); upgrade rana")


def _check_int8(v, field: str) -> None:
    # activations: how the int8 modules multiply their tokens (absent: "float", what folders recorded before)
    record({"modules": list_of(text()), "activations": optional(text(ACTIVATIONS))}, required=("modules",))(v, field)
    if len(set(v["modules"])) != len(v["modules"]):
        raise FieldError(f"'{field}.modules' names a path twice")


_RANA_CONFIG_FIELDS = record({
    "format_version": _check_version, "dtype": text(DTYPE_NAMES), "adapters": _check_adapters,
    "laurel": optional(mapping(anything)),  # LaurelConfig.from_dict checks its settings on load
    "compress_config": optional(SETTINGS), "method": optional(text()), "finetune": optional(mapping(anything)),
    # int8 weights (absent: full precision): the paths of the modules rebuilt as int8 before the weights load
    "weights": optional(text(WEIGHT_FORMATS)), "int8": optional(_check_int8),
}, required=("adapters",))


def RANA_CONFIG_SCHEMA(v, field: str) -> None:  # noqa: N802 - a schema, named like the others
    _RANA_CONFIG_FIELDS(v, field)
    if v.get("weights", "none") == "int8" and not isinstance(v.get("int8"), dict):
        raise FieldError("'weights' is \"int8\" but 'int8' (the int8 modules) is missing")


# ---------------------------------------------------------------------------- plan.json

_MEASURE = optional(number())  # an expected or measured quantity (NaN where nothing was measured)
_COMPONENT = record({"kind": text(), "path": text(), "in_features": integer(1), "out_features": integer(1),
                     "rank": optional(integer(0)), "threshold": optional(number()),
                     **{k: _MEASURE for k in ("expected_active", "expected_macs", "dense_macs", "measured_active",
                                              "measured_macs")}})
_STEP = record({"components": mapping(_COMPONENT), "expected_macs": _MEASURE, "dense_macs": _MEASURE,
                "budget_fraction": _MEASURE, "heldout_error": _MEASURE, "shares": optional(list_of(number()))})
_LAYER = record({"layer": integer(0), "attention": optional(_STEP), "mlp": optional(_STEP)})
_MEASURED = record({**{k: _MEASURE for k in ("dense_macs", "measured_macs", "fraction", "gflops_per_token",
                                              "dense_gflops_per_token")},
                    "by_part": optional(mapping(record({k: _MEASURE for k in ("measured_macs", "dense_macs",
                                                                               "fraction_of_part")}))),
                    "seq_len_for_attention": optional(integer(1))})

PLAN_SCHEMA = record({
    "method": optional(text()), "method_description": optional(text()), "model": optional(text()),
    "target_flops": optional(number(0.0, 1.0)), "measured_flops": _MEASURE, "adapted_fraction": _MEASURE,
    "measured_on": optional(text()), "wall_time_s": optional(number(0.0)),
    "allocation_profile_s": optional(number(0.0)),
    "measured": optional(_MEASURED), "budget": optional(mapping(anything)), "config": optional(SETTINGS),
    "allocation": optional(record({"kind": text(), "fraction": _MEASURE, "fractions": optional(list_of(number()))})),
    "layers": optional(list_of(_LAYER)), "lm_head": optional(mapping(anything)), "memory": optional(mapping(anything)),
    "weights": optional(text(WEIGHT_FORMATS)),
    "quantization": optional(record({"file_bytes": optional(integer(0)), "modules": optional(list_of(record(
        {"path": text(), "relative_error": _MEASURE}))), "refit": optional(mapping(anything))})),
})


def validate(doc, schema: Check) -> None:
    """Raise FieldError (one line naming the field) unless `doc` fits `schema`."""
    schema(doc, "")


__all__ = ["FieldError", "Check", "DTYPE_NAMES", "SETTINGS", "RANA_CONFIG_SCHEMA", "PLAN_SCHEMA", "validate",
           "number", "integer", "text", "flag", "optional", "list_of", "mapping", "record", "anything"]
