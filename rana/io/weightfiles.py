"""Checks on a checkpoint folder's safetensors files before anything reads them.

A `model.safetensors.index.json` may only name plain files inside its folder (no absolute
paths, no `..`), and every safetensors file must have a readable header whose tensors exactly
cover the file (a truncated download or a file cut short by a full disk fails here, with one
line naming the file, instead of as a traceback deep inside a loader). Only headers are read.
"""
from __future__ import annotations

from pathlib import Path

from . import loadchecks
from .format import WEIGHTS, WEIGHTS_INDEX
from ..errors import UserError


class WeightFileError(UserError):
    """A checkpoint's weight files are unusable (user-facing)."""


def index_shards(folder: Path, error: type[Exception] = WeightFileError) -> dict[str, str]:
    """{tensor name: shard file name} from the folder's index, each shard checked to lie inside it (the
    check every loader runs: `rana.io.loadchecks.index_shards`), its error raised as `error`."""
    try:
        return loadchecks.index_shards(folder)
    except ValueError as e:
        raise error(str(e)) from None


def check_safetensors_file(path: Path, error: type[Exception] = WeightFileError) -> None:
    """Raise `error` (naming the file) unless its header is valid and its tensors cover the file
    (`rana.io.loadchecks.safetensors_header`, which every loader reads)."""
    path = Path(path)
    try:
        loadchecks.safetensors_header(path)
    except OSError as e:
        raise error(f"cannot read '{path}': {e.strerror or e}") from None
    except ValueError as e:
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
