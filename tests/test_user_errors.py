"""Every bad input a user can give gets one clear line, a non-zero exit and no traceback, before
the expensive work where it can be known before; runs stay bounded and can be run again.

One test (or parametrised group) per root cause of issue 17 (part B); tiny random models, CLI
through typer's CliRunner."""
from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from helpers import tiny_model_dir, one_line_error
from rana.cli.app import app

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

runner = CliRunner()
SMALL = ["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4"]
FT = ["--tokens", "1024", "--seq-len", "32", "--batch-size", "4", "--lora-r", "4", "--eval-tokens", "128",
      "--eval-every", "4", "--save-every", "2"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny dense model folder (max 256 positions), a rana folder compressed from it, clean text and
    a set of broken data files."""
    from rana.data import BUNDLED_CORPUS

    root = tmp_path_factory.mktemp("ue")
    model = tiny_model_dir(root / "tiny")
    text = BUNDLED_CORPUS.read_text()
    (root / "calib.txt").write_text(text[:20000])
    (root / "heldout.txt").write_text(text[20000:30000])
    bad = root / "bad"
    bad.mkdir()
    (bad / "binary.txt").write_bytes(bytes(range(256)) * 40)
    (bad / "latin1.txt").write_bytes("café au lait ".encode("latin-1") * 500)
    (bad / "nul.txt").write_bytes(b"plain ascii\x00with a NUL byte" * 50)
    (bad / "broken.jsonl").write_text('{"text": "fine"}\n{not json at all\n')
    (bad / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    (bad / "folder").mkdir()
    (bad / "folder" / "a.txt").write_text("good text " * 200)
    (bad / "folder" / "b.txt").write_bytes(b"\xff\xfe\xfa" * 100)
    (bad / "garbage.pt").write_bytes(b"not a torch file")
    res = runner.invoke(app, ["compress", str(model), "--flops", "0.8", "--out", str(root / "rana"),
                              "--dataset", str(root / "calib.txt"), *SMALL])
    assert res.exit_code == 0, res.output
    return root


@pytest.fixture
def readonly_dir(tmp_path):
    """A folder nothing can be created in: a read-only tmpfs as root (permissions do not stop root),
    else mode 0555."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() == 0:
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(d)], capture_output=True).returncode:
            pytest.skip("cannot mount a read-only tmpfs here")
        yield d
        _unmount(d)
    else:
        d.chmod(0o555)
        yield d
        d.chmod(0o755)


def _unmount(path: Path) -> None:
    """Unmount a test tmpfs; a file handle a failed write left for the garbage collector keeps it busy."""
    import gc

    gc.collect()
    if subprocess.run(["umount", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)  # detach now, freed when released


# ------------------------------------------------------------------ data files


BAD_DATA = [("binary.txt", "not UTF-8 text"), ("latin1.txt", "not UTF-8 text"), ("nul.txt", "looks binary"),
            ("broken.jsonl", "could not read"), ("broken.parquet", "could not read"), ("folder", "b.txt")]


@pytest.mark.parametrize("name,needle", BAD_DATA)
def test_bad_data_file_is_named_before_the_model_loads(work, tmp_path, no_model_load, name, needle):
    path = work / "bad" / name
    res = runner.invoke(app, ["compress", str(work / "tiny"), "--out", str(tmp_path / "o"), "--dataset", str(path), *SMALL])
    line = one_line_error(res, needle)
    assert name in line  # the file (or the folder's bad file) is named
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name,needle", [BAD_DATA[0], BAD_DATA[3]])
def test_bad_ppl_data_in_eval(work, no_model_load, name, needle):
    res = runner.invoke(app, ["eval", str(work / "rana"), "--ppl-data", str(work / "bad" / name), "--seq-len", "64"])
    one_line_error(res, needle, name)


@pytest.mark.parametrize("name,needle", [("binary.txt", "not UTF-8 text"), ("broken.jsonl", "could not read"),
                                         ("garbage.pt", "could not read token ids")])
def test_bad_finetune_data_leaves_nothing_behind(work, tmp_path, name, needle):
    out = tmp_path / "ft"
    res = runner.invoke(app, ["finetune", str(work / "rana"), "--data", str(work / "bad" / name), "--out", str(out), *FT])
    one_line_error(res, needle, name)
    assert not out.exists()  # no checkpoint folder that would block the next run
    res = runner.invoke(app, ["finetune", str(work / "rana"), "--data", str(work / "calib.txt"),
                              "--eval-data", str(work / "bad" / name), "--out", str(out), *FT])
    one_line_error(res, needle, name)
    assert not out.exists()


# ------------------------------------------------------------------ outputs that cannot be written


def test_output_paths_that_cannot_be_written_fail_first(work, tmp_path, readonly_dir, no_model_load):
    a_file = work / "calib.txt"
    cases = [
        (["compress", str(work / "tiny"), "--out", str(readonly_dir / "o"), *SMALL], ["--out", "not writable"]),
        (["compress", str(work / "tiny"), "--out", str(a_file / "o"), *SMALL], ["--out", "is a file"]),
        (["compress", str(work / "tiny"), "--out", str(a_file), *SMALL, "--overwrite"], ["--out", "not a folder"]),
        (["eval", str(work / "rana"), "--ppl-data", str(work / "heldout.txt"), "--seq-len", "64", "--json", str(readonly_dir / "r.json")],
         ["--json", "not writable"]),
        (["eval", str(work / "rana"), "--ppl-data", str(work / "heldout.txt"), "--seq-len", "64", "--json", str(a_file / "r.json")],
         ["--json", "is a file"]),
        (["eval", str(work / "rana"), "--ppl-data", str(work / "heldout.txt"), "--seq-len", "64", "--json", str(tmp_path)],
         ["--json", "is a folder"]),
        (["sweep", str(work / "tiny"), "--out", str(readonly_dir / "s"), "--ppl-data", str(work / "heldout.txt"),
          "--methods", "teal", "--flops", "0.8", *SMALL], ["--out", "not writable"]),
        (["export", str(work / "rana"), "--out", str(readonly_dir / "e")], ["--out", "not writable"]),
        (["finetune", str(work / "rana"), "--data", str(work / "calib.txt"), "--out", str(readonly_dir / "f"), *FT],
         ["--out", "not writable"]),
    ]
    for args, needles in cases:
        one_line_error(runner.invoke(app, args), *needles)
    assert not list(readonly_dir.iterdir())


def test_full_disk_while_writing_weights_is_one_line_and_leaves_nothing(work, tmp_path, monkeypatch):
    """A real full file system (a 64 KiB tmpfs) where it can be mounted, else a write that raises ENOSPC."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True).returncode == 0
    if not mounted:
        import rana.io.folder

        def full(*a, **k):
            raise OSError(errno.ENOSPC, "No space left on device", str(disk / "o" / "model.safetensors"))

        monkeypatch.setattr(rana.io.folder, "save_file", full)
    try:
        res = runner.invoke(app, ["compress", str(work / "tiny"), "--flops", "0.8", "--out", str(disk / "o"),
                                  "--dataset", str(work / "calib.txt"), *SMALL])
        one_line_error(res, "no space left on device", "nothing was left half-written")
        assert list(disk.iterdir()) == []  # neither the output nor its temp folder
    finally:
        if mounted:
            _unmount(disk)


# ------------------------------------------------------------------ models and options


def test_unknown_compare_model_is_refused_before_the_first_model_runs(work, no_model_load):
    res = runner.invoke(app, ["eval", str(work / "rana"), "--ppl-data", str(work / "heldout.txt"), "--seq-len", "64",
                              "--compare", "no-such-owner/no-such-model"])
    one_line_error(res, "no-such-owner/no-such-model", "not in the Hugging Face cache")
    res = runner.invoke(app, ["eval", str(work / "rana"), "--ppl-data", str(work / "heldout.txt"), "--seq-len", "64",
                              "--compare", str(work / "missing-folder")])
    one_line_error(res, "missing-folder")


def test_seq_len_beyond_the_models_positions(work, tmp_path, no_model_load):
    one_line_error(runner.invoke(app, ["compress", str(work / "tiny"), "--out", str(tmp_path / "o"),
                                       "--calib-tokens", "2048", "--seq-len", "512"]), "--seq-len 512", "256 positions")
    one_line_error(runner.invoke(app, ["eval", str(work / "rana"), "--ppl-data", str(work / "heldout.txt"),
                                       "--seq-len", "1024"]), "--seq-len 1024", "256 positions")
    res = runner.invoke(app, ["finetune", str(work / "rana"), "--data", str(work / "calib.txt"), "--out",
                              str(tmp_path / "f"), "--seq-len", "300", "--tokens", "1024"])
    one_line_error(res, "--seq-len 300", "256 positions")
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("args,needles", [
    (["--calib-tokens", "16", "--seq-len", "8"], ["--calib-tokens 16", "too few"]),
    (["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "0"], ["--batch-size"]),
    (["--calib-tokens", "1024", "--seq-len", "64", "--grid-step", "0"], ["--grid-step"]),
    (["--calib-tokens", "1024", "--seq-len", "64", "--device", "warp-drive"], ["--device"]),
    (["--calib-tokens", "1000000000000", "--seq-len", "64"], ["--calib-tokens"]),
])
def test_compress_refuses_absurd_values(work, tmp_path, no_model_load, args, needles):
    one_line_error(runner.invoke(app, ["compress", str(work / "tiny"), "--out", str(tmp_path / "o"), *args]), *needles)


def test_fit_token_minimum_is_part_of_config_validation():
    from rana.compress.config import MIN_FIT_TOKENS, CompressConfig, min_calib_tokens

    with pytest.raises(ValueError, match="too few"):
        CompressConfig(model="m", calib_tokens=16, seq_len=8).validate()
    n = min_calib_tokens(64)
    CompressConfig(model="m", calib_tokens=n, seq_len=64).validate()
    with pytest.raises(ValueError, match="too few"):
        CompressConfig(model="m", calib_tokens=n - 64, seq_len=64).validate()
    assert MIN_FIT_TOKENS >= 256


@pytest.mark.parametrize("args,needles", [
    (["--batch-size", "0"], ["--batch-size"]),
    (["--eval-tokens", "-3"], ["--eval-tokens"]),
    (["--latency", "--latency-tokens", "0"], ["--latency-tokens"]),
    (["--latency", "--latency-repeats", "0"], ["--latency-repeats"]),
    (["--layer-errors", "--layer-error-tokens", "0"], ["--layer-error-tokens"]),
    (["--dtype", "float8"], ["--dtype"]),
    (["--device", "warp-drive"], ["--device"]),
])
def test_eval_refuses_absurd_values(work, no_model_load, args, needles):
    res = runner.invoke(app, ["eval", str(work / "rana"), "--ppl-data", str(work / "heldout.txt"), "--seq-len", "64",
                              *args])
    one_line_error(res, *needles)


def test_sweep_refuses_absurd_values(work, tmp_path, no_model_load):
    res = runner.invoke(app, ["sweep", str(work / "tiny"), "--out", str(tmp_path / "s"), "--ppl-data",
                              str(work / "heldout.txt"), "--methods", "teal", "--flops", "0.8", *SMALL,
                              "--eval-batch-size", "0"])
    one_line_error(res, "--eval-batch-size")


@pytest.mark.parametrize("args,needles", [
    (["--tokens", "1e30"], ["--tokens 1e30"]),
    (["--tokens", "0"], ["--tokens"]),
    (["--tokens", "lots"], ["cannot parse token budget"]),
    (["--lora-dropout", "2"], ["--lora-dropout"]),
    (["--lora-alpha", "-1"], ["--lora-alpha"]),
    (["--weight-decay", "-1"], ["--weight-decay"]),
    (["--max-grad-norm", "-1"], ["--max-grad-norm"]),
    (["--eval-every", "-1"], ["--eval-every"]),
    (["--lr-sweep", "--sweep-lrs", "abc"], ["--sweep-lrs"]),
])
def test_finetune_refuses_absurd_values_without_leaving_a_folder(work, tmp_path, args, needles):
    out = tmp_path / "ft"
    res = runner.invoke(app, ["finetune", str(work / "rana"), "--data", str(work / "calib.txt"), "--out", str(out),
                              "--seq-len", "32", *args])
    one_line_error(res, *needles)
    assert not out.exists()


# ------------------------------------------------------------------ lm-eval tasks


@pytest.fixture
def small_task_index(monkeypatch):
    """lm-eval indexes its ~15k task YAMLs in about 30 s; restrict it to the given folders so these
    tests stay fast (the checks themselves are unchanged)."""
    import lm_eval.tasks

    import rana.evaluation.harness

    real = lm_eval.tasks.TaskManager

    class Small(real):
        def __init__(self, *a, include_defaults=True, **k):
            super().__init__(*a, include_defaults=False, **k)

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", Small)
    monkeypatch.setattr(rana.evaluation.harness, "TASK_MANAGERS", {})


def test_unknown_and_offline_tasks_are_refused_before_loading(work, tmp_path, no_model_load, small_task_index):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "remote.yaml").write_text("task: remote_only\ndataset_path: nobody/not-a-cached-dataset\n"
                                       "output_type: loglikelihood\ntest_split: test\ndoc_to_text: '{{text}}'\n"
                                       "doc_to_target: '{{text}}'\n")
    base = ["eval", str(work / "rana"), "--include-path", str(tasks)]
    one_line_error(runner.invoke(app, base + ["--tasks", "remote_onyl"]), "unknown lm-eval task 'remote_onyl'",
                   "did you mean remote_only")
    one_line_error(runner.invoke(app, base + ["--tasks", "remote_only"]), "not cached", "offline")
    one_line_error(runner.invoke(app, ["eval", str(work / "rana"), "--tasks", "hellaswag_local"]), "--task-data")
    one_line_error(runner.invoke(app, ["eval", str(work / "rana"), "--tasks", "x", "--include-path",
                                       str(tmp_path / "nope")]), "--include-path")


# ------------------------------------------------------------------ bounded resources


def test_block_order_is_a_stream_independent_of_the_budget():
    import tracemalloc

    from rana.finetune.data import OrderedBlocks

    blocks = torch.arange(7 * 4).reshape(7, 4)
    small = OrderedBlocks(blocks, 30, seed=3)
    # the order a list built up front would give: one seeded permutation per epoch, cut to the budget
    upfront = torch.cat([torch.randperm(7, generator=torch.Generator().manual_seed(3 * 1_000_003 + e))
                         for e in range(5)])[:30]
    assert torch.equal(torch.stack([small[i] for i in range(30)]), blocks[upfront])
    tracemalloc.start()
    huge = OrderedBlocks(blocks, 10**12 // 4, seed=3)
    item = huge[len(huge) - 1]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(huge) == 10**12 // 4 and item.shape == (4,)
    assert peak < 1 << 20  # bytes: nothing proportional to the budget


# ------------------------------------------------------------------ re-runs and checkpoints


def _ft_config(work, out, **kw):
    from rana.finetune import FinetuneConfig

    base = dict(source=str(work / "rana"), data=str(work / "calib.txt"), out=str(out), tokens=8 * 4 * 32, seq_len=32,
                batch_size=4, lr=1e-3, lora_r=4, eval_tokens=128, eval_every=4, save_every=2)
    return FinetuneConfig(**{**base, **kw})


def test_checkpoint_folder_without_a_checkpoint_does_not_block_a_fresh_start(work, tmp_path):
    from rana.finetune import CHECKPOINTS, FinetuneError, finetune

    from rana.io.paths import CHECKPOINT_KIND, claim_folder

    out = tmp_path / "ft"
    # a kill during the first save: the run had claimed its checkpoint folder (train log, the save under way)
    claim_folder(out / CHECKPOINTS, CHECKPOINT_KIND, growing=["train_log.jsonl", ".tmp-checkpoint-00000002"])
    (out / CHECKPOINTS / ".tmp-checkpoint-00000002").mkdir(parents=True)
    (out / CHECKPOINTS / "train_log.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(FinetuneError, match="no usable checkpoint.*start without --resume"):
        finetune(_ft_config(work, out, resume=True))
    r = finetune(_ft_config(work, out, tokens=2 * 4 * 32))  # ... and without --resume it simply starts
    assert r.summary["status"] == "completed" and (out / "model.safetensors").is_file()


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(work, tmp_path):
    from rana.finetune import CHECKPOINTS, FinetuneError, finetune

    out = tmp_path / "ft"
    stopped = finetune(_ft_config(work, out, stop_after=5, keep_checkpoints=3))
    assert stopped.summary["status"] == "stopped"
    ckpts = sorted((out / CHECKPOINTS).glob("checkpoint-*"))
    assert [p.name for p in ckpts] == ["checkpoint-00000002", "checkpoint-00000004", "checkpoint-00000005"]
    weights = next(f for f in ckpts[-1].rglob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # truncated mid-write
    state = ckpts[-2] / "trainer_state.json"
    state.write_text(state.read_text()[:40])  # and the one before: an unreadable state file
    with pytest.raises(FinetuneError, match="unfinished run .*checkpoint-00000002"):
        finetune(_ft_config(work, out))  # the run is still resumable (from step 2)
    warnings = []
    resumed = finetune(_ft_config(work, out, resume=True),
                       on_log=lambda r: warnings.append(r["warning"]) if "warning" in r else None)
    assert resumed.summary["resumed_from_step"] == 2 and resumed.summary["status"] == "completed"
    assert len(warnings) == 2 and "checkpoint-00000005" in warnings[0] and "checkpoint-00000004" in warnings[1]
    assert all("damaged" in w for w in warnings)


def test_cli_resume_warning_is_one_line(work, tmp_path):
    from rana.finetune import CHECKPOINTS

    out = tmp_path / "ft"
    res = runner.invoke(app, ["finetune", str(work / "rana"), "--data", str(work / "calib.txt"), "--out", str(out),
                              *FT, "--stop-after", "4", "--keep-checkpoints", "2"])
    assert res.exit_code == 0, res.output
    newest = sorted((out / CHECKPOINTS).glob("checkpoint-*"))[-1]
    (newest / "trainer_state.json").write_text("{")
    res = runner.invoke(app, ["finetune", str(work / "rana"), "--data", str(work / "calib.txt"), "--out", str(out),
                              *FT, "--keep-checkpoints", "2", "--resume"])
    assert res.exit_code == 0, res.output
    assert "Traceback" not in res.output
    warning = [line for line in res.output.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and newest.name in res.output
    assert json.loads((out / "finetune.json").read_text())["resumed_from_step"] == 2


def test_full_disk_during_finetune_is_one_line_and_leaves_nothing(work, tmp_path):
    """Checkpoints (torch.save hides ENOSPC behind a stream-position error) and the final weights on a
    64 KiB tmpfs: one line, and no half-written folder to block the next run."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)],
                                           capture_output=True).returncode:
        pytest.skip("needs a tmpfs mount (root)")
    try:
        res = runner.invoke(app, ["finetune", str(work / "rana"), "--data", str(work / "calib.txt"),
                                  "--out", str(disk / "ft"), *FT])
        one_line_error(res, "no space left on device")
        assert list(disk.iterdir()) == []
    finally:
        _unmount(disk)
