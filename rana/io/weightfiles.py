"""Checks on a checkpoint folder's safetensors files before anything reads them.

A `model.safetensors.index.json` may only name plain files inside its folder (no absolute
paths, no `..`), and every safetensors file must have a readable header whose tensors exactly
cover the file (a truncated download or a file cut short by a full disk fails here, with one
line naming the file, instead of as a traceback deep inside a loader). Only headers are read.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path

from .format import WEIGHTS, WEIGHTS_INDEX
from ..errors import UserError

_MAX_HEADER = 100 * 2**20  # safetensors' own limit


class WeightFileError(UserError):
    """A checkpoint's weight files are unusable (user-facing)."""


def index_shards(folder: Path, error: type[Exception] = WeightFileError) -> dict[str, str]:
    """{tensor name: shard file name} from the folder's index, each shard checked to lie inside it."""
    index = Path(folder) / WEIGHTS_INDEX
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise TypeError("weight_map must map tensor names to file names")
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        detail = f"no key {e}" if isinstance(e, KeyError) else str(e).splitlines()[0] if str(e) else type(e).__name__
        raise error(f"'{index}' is not a valid safetensors index ({detail}); re-save the model") from None
    for name in sorted(set(weight_map.values())):
        parts = Path(name).parts
        if not name or os.path.isabs(name) or ".." in parts or len(parts) != 1:
            raise error(f"'{index}' names the weight file '{name}', which is not a plain file inside '{folder}'; "
                        "refusing to read outside the model folder")
        if not (Path(folder) / name).is_file():
            raise error(f"'{index}' names the weight file '{name}', which is missing from '{folder}'")
    return weight_map


def check_safetensors_file(path: Path, error: type[Exception] = WeightFileError) -> None:
    """Raise `error` (naming the file) unless its header is valid and its tensors cover the file."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError("header length beyond the end of the file (truncated?)")
            header = json.loads(f.read(n).decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
        end = 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, stop = info["data_offsets"]
            if not (isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop):
                raise ValueError(f"bad offsets for '{name}'")
            end = max(end, stop)
        if end != size - 8 - n:
            raise ValueError(f"tensors cover {end} bytes but the file holds {size - 8 - n} (truncated or padded)")
    except OSError as e:
        raise error(f"cannot read '{path}': {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise error(f"'{path}' is not a valid safetensors file ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                    "it is truncated or corrupt: re-save or re-download it") from None


def weight_files(folder: Path, error: type[Exception] = WeightFileError) -> list[Path]:
    """The safetensors files a folder's model loads from (index shards, else model.safetensors)."""
    folder = Path(folder)
    if (folder / WEIGHTS_INDEX).exists():
        return [folder / name for name in sorted(set(index_shards(folder, error).values()))]
    return [folder / WEIGHTS] if (folder / WEIGHTS).exists() else []


def check_safetensors_folder(folder: Path, error: type[Exception] = WeightFileError) -> list[Path]:
    """Check the index and every safetensors file a folder's model loads from; return the files."""
    files = weight_files(folder, error)
    for f in files:
        check_safetensors_file(f, error)
    return files


__all__ = ["WeightFileError", "index_shards", "check_safetensors_file", "weight_files", "check_safetensors_folder"]
