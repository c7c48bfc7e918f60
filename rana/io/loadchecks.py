"""What every loader of a rana model checks before it trusts a file: written once, run by `rana.load`
(rana.io.folder), the transformers quantizer (rana.quantizer) and the remote code of an export alike.

* `check_record`: the schema of the record the rebuild reads (rana_config.json's ``adapters``, ``weights``,
  ``int8``, ``laurel``, ``format_version``; an export's config.json carries the same as ``rana_*`` fields
  or as its quantization_config): types, ranges, known values, a format no newer than this reader.
* `check_tensors`: the tensors the weight files hold (read from their safetensors headers, no data) against
  those the rebuilt model expects: none missing (a missing one would keep its random init), none extra (an
  extra one is a tensor the record does not describe: ``"adapters": []`` over an adapted checkpoint), int8
  codes stored as int8 (a float32 or uint8 copy is cast on load without a word), floating tensors floating,
  every shape as the record makes it.
* `check_loaded`: after the weights load, every int8 scale a finite positive number and every threshold the
  one the record holds.

Failures are `ModelLoadError`s (a `UserError`, so a `ValueError`): one line saying what is wrong and what to do.
This file ships with exports (copied flat beside modeling_rana.py, rana.export.render): it imports only the
standard library, torch and rana modules that ship too.
"""
from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ..archs.base import text_config
from ..errors import UserError
from ..modules.int8 import A8_BLOCK_MAX, ACTIVATIONS, holds_int8
from ..modules.rebuild import failed_stage, install_rana
from ..modules.registry import ADAPTER_KINDS
from .jsonfile import nesting_depth, read_json
from .version import FORMAT_VERSION

Check = Callable[[Any, str], None]
# `weights` in a record: "none" (full precision; what a record without the field holds) or "int8" (symmetric
# per-output-channel int8 codes + fp32 scales, rana.modules.int8)
WEIGHT_FORMATS = ("none", "int8")
# what the rebuild reads of a record (rana.modules.rebuild.install_rana), in the order a message lists them
RECORD_FIELDS = ("format_version", "adapters", "weights", "int8", "laurel")
WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
_MISSING = object()


class ModelLoadError(UserError):
    """A model reference or folder that cannot be resolved or loaded (user-facing)."""


class FieldError(UserError):
    """A field of a JSON record that is absent, of the wrong type or out of range."""


# ---------------------------------------------------------------------------------------------- schema combinators
# A check is a function ``(value, field)`` that raises `FieldError`; the combinators below build them.

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


# ---------------------------------------------------------------------------------------------- the record
def threshold_from_json(t) -> float:
    """The threshold a record's adapter entry holds (null: -inf, "inf": +inf); ValueError otherwise."""
    if t is None:
        return -math.inf
    if t == "inf":
        return math.inf
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ValueError(f"threshold {t!r} is not a finite number (null means -inf, \"inf\" means +inf)")
    return float(t)


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
    cls = ADAPTER_KINDS.get(a.get("type")) if isinstance(a.get("type"), str) else None
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


def _check_block(v, field: str) -> None:
    integer(1, f"an integer from 1 to {A8_BLOCK_MAX}")(v, field)
    if v > A8_BLOCK_MAX:
        _fail(field, f"an integer from 1 to {A8_BLOCK_MAX}", v)


def _check_int8(v, field: str) -> None:
    # activations: how the int8 modules multiply their tokens (absent: "float", what folders recorded before);
    # activation_block: int8 activations' inputs per scale (absent: 64, what every W8A8 folder held before)
    record({"modules": list_of(text()), "activations": optional(text(ACTIVATIONS)),
            "activation_block": optional(_check_block)}, required=("modules",))(v, field)
    if len(set(v["modules"])) != len(v["modules"]):
        raise FieldError(f"'{field}.modules' names a path twice")


_RECORD = record({
    "format_version": _check_version, "adapters": _check_adapters,
    "laurel": optional(mapping(anything)),  # LaurelConfig.from_dict checks its settings when it is built
    # int8 weights (absent: full precision): the paths of the modules rebuilt as int8 before the weights load
    "weights": optional(text(WEIGHT_FORMATS)), "int8": optional(_check_int8),
}, required=("adapters",))


def validate_record(doc, field: str = "") -> None:
    """Raise FieldError (one line naming the field) unless `doc` is a record the rebuild can read."""
    _RECORD(doc, field)
    if doc.get("weights", "none") == "int8" and not isinstance(doc.get("int8"), dict):
        raise FieldError("'weights' is \"int8\" but 'int8' (the int8 modules) is missing")


def record_of(get: Callable[[str], Any]) -> dict:
    """The record of a source that names its fields its own way (`get(field)`: the value, None when absent),
    e.g. an export's config.json (``rana_adapters``, ...) or the quantizer's quantization_config."""
    return {k: v for k in RECORD_FIELDS if (v := get(k)) is not None}


def check_record(doc, *, where: str, fix: str) -> None:
    """`validate_record`, its error as one ModelLoadError naming `where` (the file) and `fix`."""
    try:
        if not isinstance(doc, dict):
            raise FieldError("not a JSON object")
        validate_record(doc)
    except FieldError as e:
        raise ModelLoadError(f"{where} is invalid: {e}; {fix}") from None


def install_record(model: nn.Module, doc: dict, dtype: torch.dtype, *, where: str, record_name: str,
                   spec=None) -> None:
    """`rana.modules.rebuild.install_rana` of a checked record, a record that does not fit the model (a path it
    lacks, a shape it does not have) or LAuReL settings LaurelConfig refuses reported as one ModelLoadError."""
    try:
        install_rana(model, doc, dtype, record_name=record_name, spec=spec)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        stage = failed_stage(e)
        if stage == "adapters":
            raise ModelLoadError(f"{where} does not fit the model in config.json "
                                 f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
        if stage == "laurel settings":
            raise ModelLoadError(f"{where}: invalid 'laurel' settings ({e})") from None
        raise


# ---------------------------------------------------------------------------------------------- weight files
_MAX_HEADER = 100 * 2**20  # safetensors' own limit
_MAX_INDEX = 64 * 2**20  # the index of the largest published checkpoints (~100k tensors) is ~10 MB
# bytes per element of each safetensors dtype code (a code not listed is let through without the size check)
_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
             "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
FLOAT_CODES = frozenset({"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"})
_TORCH_CODES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                torch.bool: "BOOL"}
Specs = dict  # {tensor name: (safetensors dtype code, shape)}


def _tensor_entry(name: str, info) -> tuple[str, tuple[int, ...], int, int]:
    """(dtype code, shape, begin, end) of one header entry; ValueError naming the tensor otherwise."""
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"bad header entry for '{name}'") from None
    if not isinstance(dtype, str) or not isinstance(shape, list) \
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise ValueError(f"bad dtype or shape for '{name}'")
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
        raise ValueError(f"bad offsets for '{name}'")
    if dtype in _ITEMSIZE and end - begin != math.prod(shape) * _ITEMSIZE[dtype]:
        raise ValueError(f"'{name}' holds {end - begin} bytes, its dtype {dtype} and shape {shape} need "
                         f"{math.prod(shape) * _ITEMSIZE[dtype]}")
    return dtype, tuple(shape), begin, end


def safetensors_header(path: str | os.PathLike) -> Specs:
    """{tensor name: (dtype code, shape)} of a safetensors file, from its header alone (no tensor data is
    read). ValueError saying what is wrong for a file that is not one, truncated or padded; OSError when it
    cannot be read."""
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError("shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(_MAX_HEADER, size - 8):
            raise ValueError("header length beyond the end of the file (truncated?)")
        raw = f.read(n).decode("utf-8")
    if nesting_depth(raw) > 3:  # {name: {"shape": [..]}}: deeper is not a header (and would recurse in json)
        raise ValueError("header nests deeper than a safetensors header")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    specs, covered = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, _begin, end = _tensor_entry(name, info)
        specs[name] = (dtype, shape)
        covered = max(covered, end)
    if covered != size - 8 - n:
        raise ValueError(f"tensors cover {covered} bytes but the file holds {size - 8 - n} (truncated or padded)")
    return specs


def index_shards(folder: str | os.PathLike) -> dict[str, str]:
    """{tensor name: shard file name} from a folder's safetensors index, each shard a plain file inside the
    folder; ValueError (a UserError) saying what is wrong otherwise."""
    folder = Path(folder)
    index = folder / WEIGHTS_INDEX
    try:
        doc = read_json(index, "it", max_bytes=_MAX_INDEX)
        weight_map = doc["weight_map"] if isinstance(doc, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (ValueError, KeyError, TypeError) as e:
        detail = f"no key {e}" if isinstance(e, KeyError) else str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelLoadError(f"'{index}' is not a valid safetensors index ({detail}); re-save the model") from None
    for name in sorted(set(weight_map.values())):
        parts = Path(name).parts
        if not name or os.path.isabs(name) or ".." in parts or len(parts) != 1:
            raise ModelLoadError(f"'{index}' names the weight file '{name}', which is not a plain file inside "
                                 f"'{folder}'; refusing to read outside the model folder")
        if not (folder / name).is_file():
            raise ModelLoadError(f"'{index}' names the weight file '{name}', which is missing from '{folder}'")
    return weight_map


def local_weight_files(folder) -> list[Path] | None:
    """The safetensors files a local model folder loads from (its index's shards, else model.safetensors);
    None when `folder` is not a local folder or holds neither."""
    if not folder or not os.path.isdir(folder):
        return None
    folder = Path(folder)
    if (folder / WEIGHTS_INDEX).exists():
        return [folder / name for name in sorted(set(index_shards(folder).values()))]
    return [folder / WEIGHTS] if (folder / WEIGHTS).exists() else None


def weight_specs(files, *, where: str) -> Specs:
    """{tensor name: (dtype code, shape)} of every tensor the safetensors `files` hold, read from their headers;
    a file that is not safetensors, or a tensor held by two files, is one ModelLoadError."""
    specs: Specs = {}
    for f in files:
        if not str(f).endswith(".safetensors"):
            raise ModelLoadError(f"the weights of {where} are '{Path(f).name}', not safetensors; a rana model's weights "
                                 "are safetensors files: re-export it with `rana export`")
        try:
            found = safetensors_header(f)
        except OSError as e:
            raise ModelLoadError(f"cannot read '{f}': {e.strerror or e}") from None
        except ValueError as e:
            raise ModelLoadError(f"'{f}' is not a valid safetensors file ({str(e).splitlines()[0]}); it is truncated "
                                 "or corrupt: re-save or re-download it") from None
        twice = sorted(specs.keys() & found.keys())
        if twice:
            raise ModelLoadError(f"the weight files of {where} hold '{twice[0]}' twice; the folder was edited")
        specs.update(found)
    return specs


def tensor_specs(tensors) -> Specs:
    """{name: (dtype code, shape)} of a state dict's tensors (a model's, on any device, meta included)."""
    return {k: (_TORCH_CODES.get(t.dtype, str(t.dtype)), tuple(t.shape)) for k, t in tensors.items()}


def tied_keys(model: nn.Module) -> set[str]:
    """Parameter names that `tie_weights()` fills from the input embedding (e.g. lm_head.weight):
    no checkpoint needs to hold them."""
    if not getattr(text_config(model.config), "tie_word_embeddings", False):
        return set()
    out = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is out), None)
    return {f"{name}.weight"} if name is not None else set()


def may_be_absent(model: nn.Module) -> set[str]:
    """The tensors a checkpoint of `model` may leave out: those the loader ties (rana's rule, and transformers'
    own list where it keeps one)."""
    return tied_keys(model) | set(getattr(model, "all_tied_weights_keys", None) or ())


def _kind(code: str) -> str:
    return "floating point" if code in FLOAT_CODES else {"I8": "int8 (int8 codes)"}.get(code, code)


def check_tensors(expected: Specs, found: Specs, *, absent_ok=(), where: str, record: str, fix: str) -> None:
    """The tensors the weight files hold (`found`) against those the rebuilt model expects (`expected`, its
    state dict before the weights load): the same names (but `absent_ok`, filled by a tie), integer tensors of
    the same dtype and floating ones floating (the loader casts between float widths), the same shapes.
    `where`: the model (messages); `record`: the file the model was rebuilt from; `fix`: what the user can do."""
    missing = sorted(expected.keys() - found.keys() - set(absent_ok))
    extra = sorted(found.keys() - expected.keys())
    if missing or extra:
        raise ModelLoadError(f"the weights of {where} do not match its {record}: {len(missing)} missing {missing[:3]}, "
                             f"{len(extra)} unexpected {extra[:3]}; the folder is incomplete or was edited: {fix}")
    for name in sorted(found):
        (have, shape), (want, want_shape) = found[name], expected[name]
        if have != want and not (have in FLOAT_CODES and want in FLOAT_CODES):
            raise ModelLoadError(f"'{name}' in the weights of {where} is stored as {have}; it must be {_kind(want)}: "
                                 f"the file was edited or is corrupt: {fix}")
        if shape != want_shape:
            raise ModelLoadError(f"'{name}' in the weights of {where} has shape {list(shape)}, its {record} makes it "
                                 f"{list(want_shape)}: {fix}")


# ---------------------------------------------------------------------------------------------- loaded values
def check_scales(model: nn.Module, *, where: str, fix: str) -> None:
    """Every int8 scale a finite positive number: a NaN or inf scale turns its whole row into NaN, a zero or
    negative one silences or flips it, and rana never writes one (an all-zero row gets scale 1)."""
    for name, m in model.named_modules():
        scale = m._buffers.get("weight_scale") if holds_int8(m) else None
        if scale is None or scale.device.type == "meta":  # (meta: offloaded by a device map, checked where it lives)
            continue
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            raise ModelLoadError(f"the int8 scales of '{name}' in the weights of {where} hold "
                                 f"{float(scale[bad][0])!r}: scales must be finite positive numbers; the file is "
                                 f"corrupt: {fix}")


def check_thresholds(model: nn.Module, specs: list[dict], *, where: str, record: str) -> None:
    """Every loaded threshold is a number and the one the record holds (a NaN masks nothing or everything
    without a word; a changed one is not the model that was measured)."""
    for s in specs:
        if "threshold" not in ADAPTER_KINDS[s["type"]].spec_fields:  # a slice of a shared code, a rotation
            continue
        buf = model.get_submodule(s["path"]).get_buffer("threshold")
        if buf.device.type == "meta":
            continue
        got, want = float(buf), threshold_from_json(s.get("threshold"))
        if math.isnan(got):
            raise ModelLoadError(f"the threshold of '{s['path']}' in the weights of {where} is NaN; the file is corrupt")
        same = got == want if math.isinf(got) or math.isinf(want) else math.isclose(got, want, rel_tol=1e-2, abs_tol=1e-6)
        if not same:
            raise ModelLoadError(f"the threshold of '{s['path']}' in the weights of {where} ({got:g}) differs from its "
                                 f"{record} ({want:g}); the folder was edited or is corrupt")


def check_loaded(model: nn.Module, doc: dict, *, where: str, record: str, fix: str) -> None:
    """After the weights load: the int8 scales (`check_scales`) and the thresholds against record `doc`
    (`check_thresholds`)."""
    check_scales(model, where=where, fix=fix)
    check_thresholds(model, list(doc.get("adapters") or []), where=where, record=record)


__all__ = ["ModelLoadError", "FieldError", "Check", "WEIGHT_FORMATS", "RECORD_FIELDS", "FLOAT_CODES", "anything",
           "number", "integer", "text", "flag", "optional", "list_of", "mapping", "record", "threshold_from_json",
           "validate_record", "record_of", "check_record", "install_record", "safetensors_header", "index_shards",
           "local_weight_files", "weight_specs", "tensor_specs", "tied_keys", "may_be_absent", "check_tensors",
           "check_scales", "check_thresholds", "check_loaded"]
