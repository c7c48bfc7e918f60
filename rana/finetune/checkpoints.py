"""Checkpoints of a fine-tuning run, and the checks that keep a resume exact and a re-run safe.

A checkpoint is an ``accelerator.save_state`` folder holding the trainable tensors only (the frozen
base comes from the source folder again) plus a ``trainer_state.json`` with rana's mark, the step, the
config hash, the log so far and a manifest (size + sha256) of every file, verified before it is resumed.
Checkpoints are written to a temporary name and renamed, so a kill mid-save leaves the previous one.

The checkpoint folder obeys rana's ownership rule (rana.io.paths): new, empty, or a fine-tune's of
rana's, checked before any work. A run claims it with a manifest (kind "checkpoint folder") that records
the train log and each save as rana writes them, so only checkpoints rana wrote are resumed, pruned or
replaced (a Hugging Face Trainer's `checkpoint-1/` has a trainer_state.json too), and a train log rana
did not write is never appended to or replaced.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Callable

from ..checks import check_writable_dir
from ..io import OutputExistsError
from ..io.models import model_inputs
from ..io.jsonfile import JsonFileError, read_json
from ..io.paths import (CHECKPOINT_KIND, MANIFEST, TRAINER_STATE_MAX_BYTES, check_output, check_replaceable,
                        check_temp_name, check_work_dir, checkpoints_problem, claim_folder, file_sha256, local_inputs,
                        rana_checkpoints, update_manifest)
from .config import FinetuneConfig, FinetuneError

CHECKPOINTS = ".checkpoints"
CKPT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"
TRAIN_LOG = "train_log.jsonl"
CHECKPOINT_MARK = "rana fine-tune checkpoint"  # trainer_state.json's "kind", beside "written_by": "rana"


class CheckpointFolder:
    """Where a run keeps its checkpoints and its train log (OUT/.checkpoints, or --checkpoint-dir; None
    when the run has neither) and the --out they belong to. Writes happen on the main process only."""

    def __init__(self, config: FinetuneConfig, accelerator, on_log: Callable[[dict], None] | None = None):
        self.config = config
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.on_log = on_log
        self.out = Path(os.path.expanduser(config.out)) if config.out else None
        self.created = False  # this run made the checkpoint folder (`prepare`)
        if config.checkpoint_dir:
            self.path = Path(os.path.expanduser(config.checkpoint_dir))
        elif self.out is not None:
            self.path = self.out / CHECKPOINTS
        else:
            self.path = None

    # ------------------------------------------------------------------ before the run
    def check(self) -> dict | None:
        """Validate --out / the checkpoint folder without touching them; return the trainer state to
        resume from (or None). Only a checkpoint that verifies counts: a folder with none (a run that
        failed on its inputs, or was killed before its first save) never blocks a fresh start."""
        cfg, out = self.config, self.out
        check_no_input_overlap(cfg, out, self.path)  # and the ownership of --out / --checkpoint-dir (rana.io.paths)
        if out is not None and out.exists():
            others = [p.name for p in out.iterdir() if p.name != CHECKPOINTS] if out.is_dir() else [out.name]
            if others and not cfg.overwrite:
                raise OutputExistsError(f"output folder '{out}' already exists; choose another --out or pass --overwrite")
        if out is not None:
            check_writable_dir(out, "--out")
        if self.path is not None and self.path != (out / CHECKPOINTS if out is not None else None):
            check_writable_dir(self.path, "--checkpoint-dir")
        default_dir = out is not None and self.path == out / CHECKPOINTS
        usable = None
        if self.path is not None and self.path.is_dir() and (cfg.resume or (default_dir and not cfg.overwrite)):
            usable = self._newest_usable()
        if not cfg.resume:
            if usable is not None:  # (an explicit --checkpoint-dir keeps what it holds; new checkpoints go beside)
                raise FinetuneError(f"'{self.path}' holds checkpoints of an unfinished run (newest: {usable[0].name}): "
                                    "pass --resume to continue it, or --overwrite to start over")
            return None
        if self.path is None or not self.path.is_dir():
            raise FinetuneError(f"--resume: no checkpoint folder at '{self.path}'; pass --checkpoint-dir (or the "
                                "--out of the run to continue)")
        if usable is None:
            raise FinetuneError(f"--resume: no usable checkpoint in '{self.path}' (the run saved none, or they are "
                                "damaged); start without --resume")
        latest, state = usable
        if state.get("config_hash") != cfg.config_hash():
            theirs = FinetuneConfig.from_dict(state["config"]).hashed_fields() if "config" in state else {}
            diff = sorted(k for k, v in cfg.hashed_fields().items() if theirs.get(k) != v)
            raise FinetuneError(
                f"--resume: the checkpoints in '{self.path}' were written by a different run (config hash "
                f"{state.get('config_hash')} vs {cfg.config_hash()}; differs in: {', '.join(diff) or 'unknown'}); "
                "resume with the same settings, or choose another --checkpoint-dir / --out")
        if state.get("num_processes") != self.accelerator.num_processes:
            raise FinetuneError(
                f"--resume: the checkpoint was written by {state.get('num_processes')} process(es), this run has "
                f"{self.accelerator.num_processes}; the data order and batch depend on it: launch with the same "
                "number of processes")
        state["path"] = str(latest)
        return state

    def _newest_usable(self) -> tuple[Path, dict] | None:
        """The newest checkpoint that verifies, warning (one line each) about damaged newer ones."""
        for path in reversed(list_checkpoints(self.path)):
            problem, state = verify_checkpoint(path)
            if problem is None:
                return path, state
            self._warn(f"checkpoint '{path}' is damaged ({problem}); trying the previous one")
        return None

    def _warn(self, message: str) -> None:
        if not self.is_main:
            return
        if self.on_log is not None:
            self.on_log({"warning": message})
        else:
            warnings.warn(message, stacklevel=3)

    def prepare(self, state: dict | None) -> bool:
        """Create (or clear) the checkpoint folder once the inputs have been checked, and claim it as a
        fine-tune's; True if this run created it (so a failure before the first checkpoint can take it
        away again). Everything removed here `check` proved rana's."""
        cfg = self.config
        self.accelerator.wait_for_everyone()  # every process has checked the folders before any is touched
        if self.is_main and self.path is not None:
            if cfg.overwrite and not cfg.resume and self.path.exists():
                for entry in self.path.iterdir():  # emptied, not removed: it may be the working directory
                    _remove(entry)
            self.created = not self.path.exists()
            self.path.mkdir(parents=True, exist_ok=True)
            stale = [p.name for p in self.path.glob(f".tmp-{CKPT_PREFIX}*")]
            for name in stale:
                shutil.rmtree(self.path / name, ignore_errors=True)
            old = []
            if state is None and self.out is not None and self.path == self.out / CHECKPOINTS:
                old = list_checkpoints(self.path)  # a fresh start in OUT: only damaged ones can be left here
                for p in old:
                    shutil.rmtree(p, ignore_errors=True)
            # the train log is rana's from here on, whatever it holds (it grows with every record)
            claim_folder(self.path, CHECKPOINT_KIND, dirs=[p.name for p in list_checkpoints(self.path)],
                         growing=[TRAIN_LOG])
            update_manifest(self.path, CHECKPOINT_KIND, forget=[*stale, *(p.name for p in old)])
            log_path = self.path / TRAIN_LOG
            if state is not None:
                log_path.write_text("".join(json.dumps(r) + "\n" for r in state.get("log", [])))
            elif log_path.exists():
                log_path.unlink()
        self.accelerator.wait_for_everyone()
        return self.created

    def discard_if_unused(self, out_existed: bool) -> None:
        """After a failure: take away what this run left in a checkpoint folder that holds no checkpoint
        (the folder itself if this run created it, and --out if it was made only to hold it), so the same
        command can simply be run again."""
        if not self.is_main or self.path is None or not self.path.is_dir() or list_checkpoints(self.path):
            return
        if checkpoints_problem(self.path) is not None:  # someone else's files (an existing --checkpoint-dir)
            return
        if self.created:
            shutil.rmtree(self.path, ignore_errors=True)
        else:  # a folder that was there (empty, or a run's without a checkpoint): emptied of rana's files only
            for entry in self.path.iterdir():
                if entry.name in (TRAIN_LOG, MANIFEST) or entry.name.startswith(f".tmp-{CKPT_PREFIX}"):
                    _remove(entry)
        if self.out is not None and not out_existed and self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()

    # ------------------------------------------------------------------ while training
    def append_log(self, record: dict) -> None:
        """One line of train_log.jsonl (the copy that survives a failed or stopped run)."""
        if self.is_main and self.path is not None:
            with open(self.path / TRAIN_LOG, "a") as f:
                f.write(json.dumps(record) + "\n")

    def save(self, step: int, *, lr: float, train_time: float, n_trainable: int, sweep: list | None,
             log: list[dict]) -> str:
        """Checkpoint after optimizer step `step` (every process takes part); returns its folder."""
        acc = self.accelerator
        final = self.path / f"{CKPT_PREFIX}{step:08d}"
        tmp = self.path / f".tmp-{CKPT_PREFIX}{step:08d}"
        if self.is_main:
            if tmp.exists():
                shutil.rmtree(tmp)
            update_manifest(self.path, CHECKPOINT_KIND, growing=[tmp.name])  # rana's, should a kill stop the save
        acc.wait_for_everyone()
        hook = acc.register_save_state_pre_hook(keep_trainable_only)
        try:
            acc.save_state(str(tmp))
        except Exception as e:
            full = device_full(self.path)  # torch.save reports a full disk only as a stream-position mismatch
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise OSError(errno.ENOSPC, "No space left on device", str(tmp)) from e
            raise
        finally:
            hook.remove()
        acc.wait_for_everyone()
        if self.is_main:
            state = {"written_by": "rana", "kind": CHECKPOINT_MARK, "step": step, "lr": lr,
                     "config_hash": self.config.config_hash(), "config": self.config.to_dict(),
                     "num_processes": acc.num_processes, "train_time_s": train_time, "trainable": n_trainable,
                     "sweep": sweep, "log": log, "files": manifest(tmp)}
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1, default=float))
            if final.exists():  # rana's (the folder was checked): a checkpoint of this step written before
                shutil.rmtree(final)
            update_manifest(self.path, CHECKPOINT_KIND, dirs=[final.name])  # recorded before it appears
            tmp.rename(final)
            old = list_checkpoints(self.path)[: -self.config.keep_checkpoints]
            for p in old:
                shutil.rmtree(p, ignore_errors=True)
            update_manifest(self.path, CHECKPOINT_KIND, forget=[tmp.name, *(p.name for p in old)])
        acc.wait_for_everyone()
        return str(final)


def _remove(entry: Path) -> None:
    """Remove a file, a link (never what it points to) or a folder with everything in it."""
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def keep_trainable_only(models, weights, output_dir) -> None:
    """accelerate save_state pre-hook: checkpoint only trainable tensors (the frozen base is reloaded
    from the source), stored contiguously for safetensors."""
    for model, sd in zip(models, weights):
        keep = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        for k in list(sd.keys()):
            if k not in keep:
                del sd[k]
            elif not sd[k].is_contiguous():
                sd[k] = sd[k].contiguous()


def list_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints rana wrote in `folder` (rana.io.paths.rana_checkpoints: never another
    program's `checkpoint-N`), oldest first (the last one is the latest)."""
    found = [p for p in rana_checkpoints(folder) if (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CKPT_PREFIX):]) if p.name[len(CKPT_PREFIX):].isdigit() else -1)


def device_full(folder: Path) -> bool:
    """Nearly no space left where `folder` lives (a failed write that filled it has left a partial file)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 2**20


def manifest(folder: Path) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file of a checkpoint (verified before it is resumed)."""
    return {p.relative_to(folder).as_posix(): [p.stat().st_size, file_sha256(p)]
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != TRAINER_STATE}


def verify_checkpoint(path: Path) -> tuple[str | None, dict | None]:
    """(None, trainer state) for a sound checkpoint, else (what is wrong, None): an unreadable state
    file, or a file missing, truncated or changed since it was written."""
    try:  # bounded (rana.io.jsonfile): a 100,000-deep or huge state file is damage, not a RecursionError
        state = read_json(path / TRAINER_STATE, TRAINER_STATE, max_bytes=TRAINER_STATE_MAX_BYTES)
    except JsonFileError as e:
        return f"unreadable {TRAINER_STATE}: {str(e).splitlines()[0]}", None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return f"{TRAINER_STATE} has no step", None
    files = state.get("files") or {}
    if not isinstance(files, dict) or not all(isinstance(v, list) and len(v) == 2 for v in files.values()):
        return f"{TRAINER_STATE} lists no files", None
    for name, (size, digest) in files.items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing", None
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, {size} were written", None
        if file_sha256(f) != digest:
            return f"{name} changed since it was written", None
    return None, state


def check_no_input_overlap(cfg: FinetuneConfig, out: Path | None, ckpt_dir: Path | None) -> None:
    """--out and --checkpoint-dir never overlap an input; --overwrite replaces only rana's own folders; the
    checkpoint folder is new, empty or a fine-tune's of rana's (rana.io.paths: all before any work)."""
    inputs = model_inputs(cfg.source) + local_inputs(cfg.data, cfg.eval_data) + model_inputs(cfg.tokenizer)
    inputs += model_inputs(cfg.dense_model)
    if out is not None and cfg.overwrite and not cfg.resume:
        check_output(out, inputs, overwrite=True)
    elif out is not None:  # an existing folder without --overwrite: CheckpointFolder.check says resume or overwrite
        check_work_dir(out, inputs, "--out")
    if out is not None:
        check_replaceable(out, "--out")  # replaced whole when the run finishes: never the working directory
        check_temp_name(out, "--out", depth=2)  # the model is saved inside the temp folder of --out
    if ckpt_dir is not None:
        # written into, pruned, cleared by --overwrite: new, empty or a fine-tune's of rana's (its default,
        # OUT/.checkpoints, under --out's name)
        option = "--checkpoint-dir" if cfg.checkpoint_dir else "--out"
        check_work_dir(ckpt_dir, inputs if cfg.checkpoint_dir else (), option, kind=CHECKPOINT_KIND)
