"""One schema for what rana reads back from a folder: ``rana_config.json`` and ``plan.json``.

Every field a reader uses is checked on load (type, range, known values), so a hand-edited or
damaged file is refused with one line naming the file and the field, before any command works on
it — not met later as a KeyError, or after a fine-tune as a crash in the model-card writer.
Fields no reader uses are let through (newer rana versions may add some). The adapter entries'
fields are the ones their classes declare (`rana.modules.registry`).

The part of rana_config.json the rebuild reads (the record) is checked by `rana.io.loadchecks`, the schema
the transformers quantizer and an export's remote code run too; this module adds the rest of the folder.
A check is a function ``(value, field)`` that raises `FieldError`; the combinators (loadchecks') build them.
"""
from __future__ import annotations

from .compress_settings import recorded_fields
# the record the rebuild reads (adapters, weights, int8, laurel, format_version) is checked by the one schema every
# loader runs, an export's remote code included (rana.io.loadchecks); the combinators are written there too
from .loadchecks import (Check, FieldError, WEIGHT_FORMATS, anything, flag, integer, list_of, mapping, number,
                         optional, record, text, validate_record)

DTYPE_NAMES = ("float32", "bfloat16", "float16")


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

# what rana_config.json holds beside the record (rana.io.loadchecks)
_RANA_CONFIG_FIELDS = record({
    "dtype": text(DTYPE_NAMES),
    "compress_config": optional(SETTINGS), "method": optional(text()), "finetune": optional(mapping(anything)),
})


def RANA_CONFIG_SCHEMA(v, field: str) -> None:  # noqa: N802 - a schema, named like the others
    validate_record(v, field)
    _RANA_CONFIG_FIELDS(v, field)


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
