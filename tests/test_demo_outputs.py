"""The demo goes through the same output checks as every command (issue 27, root cause 3).

Each case is refused before the compression starts (the compression is replaced by a failure), in
one line, leaving what was there untouched; a failed save leaves no folder behind.
"""
from __future__ import annotations

import errno
import json
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import tiny_model_dir


@pytest.fixture
def no_compression(monkeypatch):
    """Any case that reaches the compression has skipped the up-front checks."""
    import rana.compress

    monkeypatch.setattr(rana.compress, "compress_model", lambda *a, **k: pytest.fail("the compression started"))
    monkeypatch.setattr(rana.compress, "calibration_data", lambda *a, **k: None)


def run_demo(model: Path, out: Path, *extra: str) -> int:
    from rana.cli import demo

    return demo.main(["--model", str(model), "--out", str(out), "--seq-len", "64", "--calib-tokens", "512", *extra])


def one_line(capsys, needle: str) -> None:
    err = capsys.readouterr().err  # the demo's own stage lines, then one error line
    assert [line.startswith("error:") for line in err.splitlines() if line.strip()][-1:] == [True], err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    assert needle in " ".join(err.split()), err


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["model", "inside"])
def test_demo_out_never_the_model_folder(tmp_path, capsys, no_compression, where):
    model = tiny_model_dir(tmp_path / "tiny")
    before = snapshot(model)
    out = model if where == "model" else model / "demo"
    assert run_demo(model, out, "--overwrite") == 2
    one_line(capsys, "input")
    assert snapshot(model) == before


def test_demo_never_overwrites_a_users_results(tmp_path, capsys, no_compression):
    model = tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "results.json").write_text('{"my": "results"}')
    assert run_demo(model, out) == 2
    one_line(capsys, "--overwrite")
    assert run_demo(model, out, "--overwrite") == 2  # and --overwrite replaces only rana's own folders
    one_line(capsys, "not written by rana")
    assert json.loads((out / "results.json").read_text()) == {"my": "results"}


def test_demo_finds_a_read_only_out_before_the_work(tmp_path, capsys, monkeypatch, no_compression):
    model = tiny_model_dir(tmp_path / "tiny")
    ro = tmp_path / "ro"
    ro.mkdir()
    real = tempfile.mkdtemp

    def read_only(*a, dir=None, **k):  # a read-only mount, even for root
        if dir is not None and Path(dir) == ro:
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkdtemp", read_only)
    assert run_demo(model, ro / "demo") == 2
    one_line(capsys, "read-only")


def test_demo_on_a_full_disk_leaves_no_folder(tmp_path, capsys, monkeypatch):
    import rana
    import rana.compress

    model = tiny_model_dir(tmp_path / "tiny")
    done = SimpleNamespace(model=None, tokenizer=None, plan={}, offloaded=None)
    monkeypatch.setattr(rana.compress, "calibration_data", lambda *a, **k: None)
    monkeypatch.setattr(rana.compress, "compress_model", lambda *a, **k: done)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(rana, "save", full)
    out = tmp_path / "demo"
    assert run_demo(model, out) == 2
    one_line(capsys, "no space left")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # neither the folder nor its temp folder


def test_demo_out_name_too_long_fails_before_the_work(tmp_path, capsys, no_compression):
    model = tiny_model_dir(tmp_path / "tiny")
    assert run_demo(model, tmp_path / ("d" * 240)) == 2
    one_line(capsys, "too long")
