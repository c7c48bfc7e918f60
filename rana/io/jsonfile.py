"""Reading a JSON file a user can hand rana (a recipe, a folder's rana_config.json, a manifest, a
checkpoint's trainer state) with bounds, so that a hostile or broken file costs one clear line and not
the process: the size is checked before the file is read (a 125 MB manifest is not parsed whole), the
nesting depth before it is parsed (the stdlib parser recurses: 100,000 nested brackets end in
RecursionError).

A leaf of rana.io: only the standard library and rana.errors. Stdlib-only on purpose: it ships flat with
every export (beside `loadchecks`), so the remote code reads rana_config.json with the same bounds.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path
from ..errors import UserError

MAX_BYTES = 16 * 2**20  # far above any file rana writes (a 70B model's rana_config.json is < 1 MB)
MAX_DEPTH = 64  # rana's own files nest at most 5 deep

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")


class JsonFileError(UserError):
    """A JSON file that is unreadable, too large, too deep or not JSON (user-facing)."""


def nesting_depth(text: str) -> int:
    """The deepest bracket nesting of JSON `text`, brackets inside strings not counted (linear time,
    no recursion)."""
    depth = deepest = 0
    for b in _BRACKET.findall(_STRING.sub("", text)):
        if b in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def read_json(path: str | os.PathLike, what: str = "", *, max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH):
    """The parsed content of JSON file `path`; one JsonFileError (naming `what`, else the path) when it
    cannot be read, exceeds `max_bytes` or `max_depth`, or is not JSON."""
    path = Path(path)
    name = what or f"'{path}'"
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)  # a special file (a pipe) has no size to stat: read at most the bound
    except OSError as e:
        raise JsonFileError(f"cannot read {name}: {e.strerror or e}") from None
    if len(data) > max_bytes:
        raise JsonFileError(f"{name} is larger than {max_bytes // 2**20} MiB: not a file rana wrote or reads "
                            "(nothing was changed)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise JsonFileError(f"{name} is not UTF-8 text") from None
    depth = nesting_depth(text)
    if depth > max_depth:
        raise JsonFileError(f"{name} nests {depth} levels deep, over the {max_depth} rana reads: not a file rana "
                            "wrote or reads")
    try:
        return json.loads(text)
    except ValueError as e:
        raise JsonFileError(f"{name} is not valid JSON ({e})") from None


__all__ = ["JsonFileError", "MAX_BYTES", "MAX_DEPTH", "nesting_depth", "read_json"]
