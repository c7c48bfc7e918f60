"""What rana deletes, it wrote (issue 27, root causes 2 and 6).

`--overwrite` replaces a folder only when every file in it is listed, unchanged by content (size and
sha256, issue 39), in the manifest rana wrote into it (`.rana-manifest.json`); a file of rana's name (results.json) or an
empty `.checkpoints/` no longer makes a folder rana's. An `--out` whose temp folder's name is too
long for the file system fails before any work.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import rana.io as rio
from helpers import tiny_model, tiny_model_dir
from rana.io.paths import MANIFEST, UnsafeOutputError, check_output, temp_prefix

runner = CliRunner()


def one_line_error(res, needle: str) -> None:
    assert res.exit_code not in (0, None), res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in res.output, res.output
    assert needle in " ".join(res.output.split()), res.output


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A rana folder written by `rana.io.save` (a tiny model, no adapters: writing is what is tested)."""
    return rio.save(tiny_model(), None, tmp_path_factory.mktemp("saved") / "r")


def copy_of(saved: Path, dest: Path) -> Path:
    import shutil

    return Path(shutil.copytree(saved, dest))


# ------------------------------------------------------------------ root cause 2: the manifest


def test_every_folder_rana_writes_lists_its_files(saved):
    manifest = json.loads((saved / MANIFEST).read_text())
    on_disk = {str(p.relative_to(saved)): {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
               for p in saved.rglob("*") if p.is_file() and p.name != MANIFEST}
    assert manifest["files"] == on_disk and "rana_config.json" in on_disk
    rio.load(saved)  # the manifest does not disturb loading


def test_overwrite_refuses_a_users_file_in_a_rana_folder(saved, tmp_path):
    r = copy_of(saved, tmp_path / "r")
    (r / "notes.txt").write_text("my notes on this run")
    with pytest.raises(UnsafeOutputError, match="notes.txt"):
        check_output(r, overwrite=True)
    with pytest.raises(UnsafeOutputError, match="notes.txt"):
        rio.save(tiny_model(), None, r, overwrite=True)
    assert (r / "notes.txt").read_text() == "my notes on this run"


def test_overwrite_refuses_a_file_changed_since_rana_wrote_it(saved, tmp_path):
    r = copy_of(saved, tmp_path / "r")
    (r / "README.md").write_text("my own card, rewritten by hand")
    with pytest.raises(UnsafeOutputError, match="README.md"):
        check_output(r, overwrite=True)


def test_a_file_with_ranas_name_does_not_make_a_folder_ranas(tmp_path):
    for i, planted in enumerate(("results.json", ".checkpoints", "rana_config.json")):
        mine = tmp_path / f"mine{i}"
        mine.mkdir()
        (mine / "thesis.tex").write_text("years of work")
        (mine / planted).mkdir() if planted.startswith(".") else (mine / planted).write_text("{}")
        with pytest.raises(UnsafeOutputError, match="overwrite"):
            check_output(mine, overwrite=True)
        assert (mine / "thesis.tex").read_text() == "years of work"


def test_a_folder_of_an_older_rana_is_left_to_the_user(saved, tmp_path):
    old = copy_of(saved, tmp_path / "old")
    (old / MANIFEST).unlink()  # what rana wrote before the manifest existed
    with pytest.raises(UnsafeOutputError, match="delete it yourself"):
        check_output(old, overwrite=True)


def test_the_cli_refuses_in_one_line_and_keeps_the_file(saved, tmp_path):
    r = copy_of(saved, tmp_path / "r")
    (r / "notes.txt").write_text("keep me")
    model = tiny_model_dir(tmp_path / "model")
    res = runner.invoke(app(), ["compress", str(model), "--out", str(r), "--overwrite", "--seq-len", "64"])
    one_line_error(res, "notes.txt")
    assert (r / "notes.txt").read_text() == "keep me"


def test_a_rana_folder_is_replaced_and_an_unfinished_finetune_too(saved, tmp_path):
    r = copy_of(saved, tmp_path / "r")
    rio.save(tiny_model(seed=1), None, r, overwrite=True)
    rio.load(r)
    # --out of a fine-tune killed before it finished: only its checkpoint folder, each checkpoint proven by
    # its trainer state (every file listed with its sha256) in a folder of an older rana, without a manifest
    ft = tmp_path / "ft"
    ckpt = ft / ".checkpoints" / "checkpoint-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"x" * 10)
    digest = hashlib.sha256(b"x" * 10).hexdigest()
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 2, "config_hash": "c",
                                                         "files": {"model.safetensors": [10, digest]}}))
    (ft / ".checkpoints" / "train_log.jsonl").write_text("{}\n")
    check_output(ft, overwrite=True)
    (ckpt / "mine.txt").write_text("not a checkpoint file")
    with pytest.raises(UnsafeOutputError, match="mine.txt"):
        check_output(ft, overwrite=True)


def test_finetune_overwrite_never_clears_a_foreign_checkpoint_dir(tmp_path):
    from rana.finetune.checkpoints import CheckpointFolder
    from rana.finetune.config import FinetuneConfig

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "data.csv").write_text("a,b\n")
    acc = SimpleNamespace(is_main_process=True, num_processes=1, wait_for_everyone=lambda: None)
    folder = CheckpointFolder(FinetuneConfig(source=str(tmp_path / "src"), out=str(tmp_path / "o"), overwrite=True,
                                             checkpoint_dir=str(ck)), acc)
    with pytest.raises(UnsafeOutputError, match="data.csv"):
        folder.check()
    folder.discard_if_unused(out_existed=False)  # after a failed run: only a folder of rana's own goes
    assert (ck / "data.csv").is_file()


def test_a_sweep_resumes_only_into_its_own_folder(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "results.json").write_text('{"mine": true}')  # the user's, with the sweep's file name
    with pytest.raises(UnsafeOutputError, match="sweep folder"):
        check_output(mine, resumable=("sweep folder",))


# ------------------------------------------------------------------ root cause 6: the temp folder's name


def name_limit(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def test_an_out_name_near_the_limit_fails_before_any_work(tmp_path, monkeypatch):
    limit = name_limit(tmp_path)
    out = tmp_path / ("m" * (limit - 10))  # a legal name; its temp folder's is not
    assert len(temp_prefix(out)) > limit - 8
    with pytest.raises(UnsafeOutputError, match="temp folder"):
        check_output(out)
    import rana.compress

    monkeypatch.setattr(rana.compress, "compress", lambda *a, **k: pytest.fail("the compression started"))
    model = tiny_model_dir(tmp_path / "model")
    res = runner.invoke(app(), ["compress", str(model), "--out", str(out), "--seq-len", "64", "--calib-tokens", "512"])
    one_line_error(res, "temp folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    check_output(tmp_path / ("m" * (limit - 60)))  # a long name that fits is fine


def app():
    from rana.cli.app import app as typer_app

    return typer_app


def test_the_checkpoint_names_paths_knows_are_finetunes():
    from rana.finetune import checkpoints as ft
    from rana.io import paths

    assert (paths.CHECKPOINTS, paths.CKPT_PREFIX, paths.TRAINER_STATE, paths.TRAIN_LOG) == \
        (ft.CHECKPOINTS, ft.CKPT_PREFIX, ft.TRAINER_STATE, ft.TRAIN_LOG)
