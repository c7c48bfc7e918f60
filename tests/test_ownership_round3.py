"""What rana touches, it owns (issue 39, causes 1 and 8).

One ownership rule (rana.io.paths) for every folder rana writes into or deletes from: an --out it
replaces, an --offload-dir, a --checkpoint-dir. Each is new, empty, or proven rana's (its manifest
lists every file with its sha256; a checkpoint folder by rana's own checkpoint records), checked before
any work, whatever path names it ('.' included); the refusal is one line naming the first foreign
file. Manifests and trainer states are read with a size and depth bound. Every test checks that the
user's files are byte-identical afterwards.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import rana.io as rio
from helpers import byte_tokenizer, tiny_model, tiny_model_dir
from rana.cli.app import app
from rana.io.paths import MANIFEST, UnsafeOutputError, check_output, read_manifest

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

runner = CliRunner()
COMPRESS = ["--flops", "0.8", "--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4"]
FINETUNE = ["--full", "--tokens", "512", "--seq-len", "32", "--batch-size", "4", "--eval-tokens", "128",
            "--eval-every", "2", "--save-every", "1", "--keep-checkpoints", "1"]


def one_line_error(res, *needles: str) -> str:
    """The command failed with a single `error:` line (no traceback) containing every needle."""
    assert res.exit_code not in (0, None), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in res.output, res.output
    text = " ".join(res.output.split())  # rich wraps long lines
    for needle in needles:
        assert needle in text, text
    return text


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `folder`."""
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A tiny dense model folder, a rana folder of it (no adapters: ownership is what is tested) and text."""
    from rana.data import BUNDLED_CORPUS

    root = tmp_path_factory.mktemp("own3")
    tiny_model_dir(root / "tiny")
    rio.save(tiny_model(vocab_size=257), byte_tokenizer(), root / "rana")
    (root / "calib.txt").write_text(BUNDLED_CORPUS.read_text()[:20000])
    return root


def users_folder(path: Path, *entries: str) -> Path:
    """A folder of the user's holding `entries` (a name ending in '/' is a folder, with a file in it)."""
    path.mkdir(parents=True, exist_ok=True)
    for e in entries:
        if e.endswith("/"):
            (path / e).mkdir(parents=True, exist_ok=True)
            (path / e / "mine.bin").write_bytes(b"the user's own bytes " + e.encode())
        else:
            (path / e).parent.mkdir(parents=True, exist_ok=True)
            (path / e).write_text(f"the user's {e}\n")
    return path


# ------------------------------------------------------------------ --offload-dir


@pytest.mark.parametrize("where", ["folder", "cwd"])
def test_offload_dir_of_the_users_is_refused_before_any_work(work, tmp_path, monkeypatch, where):
    """It used to lose `activations/` (removed when the run ends) and have `layers/` written into."""
    mine = users_folder(tmp_path / "mine", "activations/", "layers/layer-00000.safetensors", "notes.txt")
    before = snapshot(mine)
    if where == "cwd":  # what `--offload-dir ''` came to
        monkeypatch.chdir(mine)
    option = str(mine) if where == "folder" else "."
    res = runner.invoke(app, ["compress", str(work / "tiny"), "--out", str(tmp_path / "out"), "--offload-dir", option,
                              "--dataset", str(work / "calib.txt"), *COMPRESS])
    one_line_error(res, "--offload-dir", "activations/", "which rana did not write")
    assert snapshot(mine) == before and not (tmp_path / "out").exists()


def test_offload_dir_rana_wrote_is_claimed_and_reused(work, tmp_path):
    off = tmp_path / "off"
    for i in range(2):  # the second run reuses the folder the first one claimed
        res = runner.invoke(app, ["compress", str(work / "tiny"), "--out", str(tmp_path / f"out{i}"), "--offload-dir",
                                  str(off), "--dataset", str(work / "calib.txt"), *COMPRESS])
        assert res.exit_code == 0, res.output
        manifest = json.loads((off / MANIFEST).read_text())
        assert manifest["kind"] == "offload folder" and not (off / "activations").exists()
        layers = sorted(p.relative_to(off).as_posix() for p in (off / "layers").iterdir())
        assert sorted(manifest["files"]) == layers and layers
        assert all(manifest["files"][f]["sha256"] == hashlib.sha256((off / f).read_bytes()).hexdigest() for f in layers)
    # a file put there afterwards is the user's: the next run leaves it alone (and says so)
    (off / "layers" / "notes.txt").write_text("mine")
    res = runner.invoke(app, ["compress", str(work / "tiny"), "--out", str(tmp_path / "out2"), "--offload-dir",
                              str(off), "--dataset", str(work / "calib.txt"), *COMPRESS])
    one_line_error(res, "layers/notes.txt")
    assert (off / "layers" / "notes.txt").read_text() == "mine"


def test_compress_model_checks_the_offload_dir_itself(tmp_path):
    """The library call, without the CLI's pre-flight, refuses too (before the layer loop)."""
    from helpers import tiny_calibration, tiny_compress_config
    from rana.compress import compress_model
    from rana.compress.streaming import load_lazy

    tiny_model().save_pretrained(tmp_path / "src")
    mine = users_folder(tmp_path / "mine", "activations/")
    before = snapshot(mine)
    lazy, _, weights = load_lazy(tmp_path / "src")
    with pytest.raises(UnsafeOutputError, match="activations/"):
        compress_model(lazy, None, tiny_compress_config(offload_dir=str(mine)), tiny_calibration(),
                       lazy_weights=weights)
    assert snapshot(mine) == before


# ------------------------------------------------------------------ --checkpoint-dir


@pytest.mark.parametrize("where", ["folder", "cwd"])
@pytest.mark.parametrize("entries", [("train_log.jsonl",), ("checkpoint-1/trainer_state.json",)],
                         ids=["train_log", "hf_checkpoint"])
def test_checkpoint_dir_of_the_users_is_refused_before_any_work(work, tmp_path, monkeypatch, where, entries):
    """It used to replace the train log and prune a Hugging Face Trainer's `checkpoint-1/` (it has a
    trainer_state.json too)."""
    mine = users_folder(tmp_path / "mine", *entries)
    if "checkpoint-1/trainer_state.json" in entries:
        (mine / "checkpoint-1" / "trainer_state.json").write_text(json.dumps({"global_step": 1, "log_history": []}))
    before = snapshot(mine)
    if where == "cwd":  # what `--checkpoint-dir ''` came to
        monkeypatch.chdir(mine)
    option = str(mine) if where == "folder" else "."
    res = runner.invoke(app, ["finetune", str(work / "tiny"), "--data", str(work / "calib.txt"), "--out",
                              str(tmp_path / "ft"), "--checkpoint-dir", option, *FINETUNE])
    one_line_error(res, "--checkpoint-dir", entries[0].split("/")[0], "which rana did not write")
    assert snapshot(mine) == before and not (tmp_path / "ft").exists()


def test_only_checkpoints_rana_wrote_are_resumed_or_pruned(tmp_path):
    """rana's own checkpoints are proven by their records; another program's `checkpoint-N` never is."""
    from rana.finetune.checkpoints import list_checkpoints, verify_checkpoint

    folder = users_folder(tmp_path / "ck", "checkpoint-1/trainer_state.json")
    hf = folder / "checkpoint-1" / "trainer_state.json"
    hf.write_text(json.dumps({"step": 1, "global_step": 1, "files": {}}))  # even one with a "step"
    assert list_checkpoints(folder) == []
    # a checkpoint of an older rana (no folder manifest): every file listed with its sha256
    ours = folder.parent / "ours"
    (ours / "checkpoint-00000002").mkdir(parents=True)
    (ours / "checkpoint-00000002" / "model.safetensors").write_bytes(b"w" * 8)
    state = {"step": 2, "config_hash": "h", "files": {"model.safetensors": [8, hashlib.sha256(b"w" * 8).hexdigest()]}}
    (ours / "checkpoint-00000002" / "trainer_state.json").write_text(json.dumps(state))
    assert [p.name for p in list_checkpoints(ours)] == ["checkpoint-00000002"]
    assert verify_checkpoint(ours / "checkpoint-00000002")[0] is None


# ------------------------------------------------------------------ --overwrite: content, not size


@pytest.fixture(scope="module")
def exported(work, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("exp") / "exp"
    res = runner.invoke(app, ["export", str(work / "rana"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    return out


def test_export_overwrite_keeps_a_model_card_edited_to_the_same_size(work, exported, tmp_path):
    import shutil

    out = Path(shutil.copytree(exported, tmp_path / "exp"))
    card = out / "README.md"
    text = card.read_text()
    edited = text.replace("a", "b", 1) if "a" in text else "b" + text[1:]
    assert len(edited.encode()) == len(text.encode()) and edited != text
    card.write_text(edited)
    before = snapshot(out)
    res = runner.invoke(app, ["export", str(work / "rana"), "--out", str(out), "--overwrite"])
    one_line_error(res, "README.md", "changed since rana wrote it")
    assert snapshot(out) == before


def test_a_manifest_of_sizes_only_is_read_but_never_trusted_to_replace(exported, tmp_path):
    import shutil

    out = Path(shutil.copytree(exported, tmp_path / "exp"))
    # what the previous rana wrote: each file with its size only
    sizes = {p.relative_to(out).as_posix(): p.stat().st_size for p in out.rglob("*")
             if p.is_file() and p.name != MANIFEST}
    dirs = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_dir())
    (out / MANIFEST).write_text(json.dumps({"kind": "rana output", "files": sizes, "dirs": dirs}))
    before = snapshot(out)
    assert read_manifest(out)["kind"] == "rana output"  # still read (a sweep resumes by its kind)
    with pytest.raises(UnsafeOutputError, match="older rana.*sizes and not contents"):
        check_output(out, overwrite=True)
    assert snapshot(out) == before


# ------------------------------------------------------------------ --out . is decided before any work


@pytest.mark.parametrize("command", ["quantize", "export"])
def test_out_dot_is_refused_before_any_work(work, tmp_path, monkeypatch, command):
    """`--out . --overwrite` in an empty folder used to run the whole job and be refused at the end, its
    own temp folder (inside '.') having made '.' non-empty."""
    import rana.export.run
    import rana.quantize.run

    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    first_work = {"quantize": (rana.quantize.run, "quantize_model"), "export": (rana.export.run, "render_sources")}
    monkeypatch.setattr(*first_work[command], lambda *a, **k: pytest.fail("the work started"))
    args = ["--weights", "int8", "--calib-tokens", "0"] if command == "quantize" else []
    res = runner.invoke(app, [command, str(work / "rana"), "--out", ".", "--overwrite", *args])
    one_line_error(res, "--out '.'", "working in")
    assert list(here.iterdir()) == []


# ------------------------------------------------------------------ bounded manifests and trainer states


def test_a_deep_manifest_is_not_rana_s_and_no_recursion_error(tmp_path):
    folder = users_folder(tmp_path / "f", "thesis.tex")
    (folder / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    before = snapshot(folder)
    with pytest.raises(UnsafeOutputError, match="nests 100000 levels"):
        check_output(folder, overwrite=True)
    assert read_manifest(folder) is None and snapshot(folder) == before


def test_a_huge_manifest_is_not_read_whole(tmp_path):
    import tracemalloc

    folder = users_folder(tmp_path / "f", "thesis.tex")
    with open(folder / MANIFEST, "w") as f:  # valid JSON, 48 MB
        f.write('{"kind": "rana output", "files": {}, "dirs": [], "pad": "')
        for _ in range(48):
            f.write("x" * 2**20)
        f.write('"}')
    tracemalloc.start()
    try:
        with pytest.raises(UnsafeOutputError, match="larger than"):
            check_output(folder, overwrite=True)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 40 * 2**20  # bytes: the bound (16 MiB) read, not the 48 MB file


def test_a_deep_trainer_state_is_damage_not_a_recursion_error(tmp_path):
    from rana.finetune.checkpoints import verify_checkpoint
    from rana.io.paths import checkpoints_problem

    ckpt = tmp_path / "ck" / "checkpoint-00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{\"a\": " * 100_000 + "1" + "}" * 100_000)
    problem, state = verify_checkpoint(ckpt)
    assert state is None and "nests" in problem
    assert "checkpoint-00000002/" in checkpoints_problem(tmp_path / "ck")  # not proven rana's (no folder manifest)
