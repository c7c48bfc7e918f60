"""Units users type and read: memory sizes, token budgets, dtype names.

A leaf: it knows nothing of rana but `rana.errors` (what it refuses is a `UserError`), so every
layer of the package may use it.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any
import re

import torch

from .errors import UserError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


# `progress(what, done, total)`: how a long step reports itself; the CLI passes a rich bar, the library
# reports through it (total None: not known in advance)
Progress = Callable[[str, int, "int | None"], None]


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype name (`DTYPES` keys); unknown names count as float32."""
    return DTYPES[dtype].itemsize if dtype in DTYPES else 4


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12,
          "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
# the units huggingface_hub's safetensors sharding reads (`parse_size_to_int`): what --max-shard-size takes
_FILE_UNITS = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}


def parse_memory(text: str | int | float | None, option: str = "--max-memory") -> int | None:
    """'2GB' / '512MiB' / '1.5g' / 2e9 → bytes (decimal units for GB/MB, binary for GiB/MiB)."""
    if text is None:
        return None
    return _parse_size(text, option, _UNITS, "2GB, 512MB, 80GiB")


def parse_file_size(text: str | int, option: str) -> int:
    """'500MB' / '2GB' / 2_000_000_000 → bytes: a size as the safetensors writer splits shards at (KB, MB, GB,
    TB, decimal; no bare number of bytes as text, which the writer would refuse)."""
    return _parse_size(text, option, _FILE_UNITS, "500MB, 2GB")


def _parse_size(text: str | int | float, option: str, units: dict, examples: str) -> int:
    """A positive number of bytes, from a number or text in `units`; one UserError naming `option` otherwise."""
    if isinstance(text, bool) or isinstance(text, float) and not math.isfinite(text):
        raise UserError(f"{option} {text!r} is not a size; write e.g. {examples}")
    if isinstance(text, (int, float)):
        value = int(text)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
        if not m or m.group(2).lower() not in units:
            raise UserError(f"{option} '{text}' is not a {'memory ' if units is _UNITS else ''}size; write e.g. "
                            f"{examples}")
        value = int(float(m.group(1)) * units[m.group(2).lower()])
    if value <= 0:
        raise UserError(f"{option} must be positive, got '{text}'")
    return value


def fmt_bytes(n: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


MAX_TOKENS = 10**12  # far beyond any fine-tuning run; larger values are typos (1e30)
_TOKEN_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9, "t": 10**12}


def parse_tokens(value: Any) -> int:
    """A token budget: ``2M``, ``500k``, ``1.5e6``, ``2_000_000`` or a plain int."""
    if isinstance(value, bool):
        raise UserError(f"cannot parse token budget {value!r}")
    if isinstance(value, (int, float)):
        n = float(value)
    else:
        s = str(value).strip().lower().replace("_", "").replace(",", "")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([kmgbt]?)", s)
        if not m:
            raise UserError(f"cannot parse token budget {value!r}: use a number with an optional k/M/G suffix, "
                            "e.g. 2M, 500k, 1.5e6")
        n = float(m.group(1)) * _TOKEN_SUFFIX[m.group(2)]
    if not math.isfinite(n) or n < 1:
        raise UserError(f"--tokens: the token budget must be at least 1 token, got {value!r}")
    if n > MAX_TOKENS:
        raise UserError(f"--tokens {value}: a budget beyond {MAX_TOKENS:.0e} tokens is not a fine-tuning run (at "
                        "today's speeds it would never finish); pass e.g. 2M or 500M")
    return int(round(n))
