"""lm-evaluation-harness on an in-memory model: the bundled offline task templates, the task
index (built once per process), the checks made before any model loads, and the run itself.

lm-eval is an optional extra (`pip install 'rana[eval]'`), so it is imported where it is used.
"""
from __future__ import annotations

import atexit
import difflib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..data import DataError
from .common import eval_mode

TASKS_DIR = Path(__file__).resolve().parents[1] / "tasks"  # rana/tasks/, installed as package data
LOCAL_TASKS = ("hellaswag_local", "lambada_openai_local")
_DATA_DIR_RE = re.compile(r"__DATA_DIR__/(\S+)")

# TaskManagers by (include_path, data_dir) setting: indexing lm-eval's task YAMLs is slow, so each
# setting is indexed once per process (tests replace this dict to start from an empty cache)
TASK_MANAGERS: dict[tuple, Any] = {}


def write_local_tasks(dest_dir: str | Path, data_dir: str | Path) -> Path:
    """Render the bundled task templates into `dest_dir` with absolute data-file paths.

    lm-eval resolves `data_files` against the working directory, not the YAML, so the
    templates in `rana/tasks/` carry a `__DATA_DIR__` placeholder that this fills in
    (`data_dir` is a folder holding `eval/hellaswag_validation.jsonl` etc.). Returns
    `dest_dir`, ready for `TaskManager(include_path=...)`.
    """
    data_dir = Path(data_dir).expanduser().resolve()
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    missing: list[str] = []

    def fill(match: re.Match) -> str:
        path = data_dir / match.group(1)
        if not path.is_file():
            missing.append(str(path))
        return json.dumps(str(path))  # a JSON string is a valid YAML scalar, whatever the path

    for template in sorted(TASKS_DIR.glob("*.yaml")):
        (dest / template.name).write_text(_DATA_DIR_RE.sub(fill, template.read_text()))
    if missing:
        raise DataError(f"evaluation data not found: {', '.join(missing)}; pass the folder that holds eval/")
    return dest


def _clean_metrics(task_results: dict[str, Any]) -> dict[str, float]:
    """lm-eval's {'acc,none': x, 'alias': ...} → {'acc': x}; non-default filters keep their suffix."""
    out: dict[str, float] = {}
    for key, value in task_results.items():
        if key == "alias" or not isinstance(value, (int, float)):
            continue
        out[key.removesuffix(",none")] = float(value)
    return out


def lm_eval_tasks(
    model: torch.nn.Module,
    tokenizer,
    tasks: Sequence[str],
    *,
    include_path: str | Path | None = None,
    data_dir: str | Path | None = None,
    limit: int | float | None = None,
    batch_size: int = 1,
    num_fewshot: int = 0,
    bootstrap_iters: int = 1000,
) -> dict[str, dict[str, float]]:
    """Run lm-evaluation-harness tasks on an in-memory model; returns task → metrics.

    `data_dir` renders the bundled `*_local` tasks (see `write_local_tasks`) so they run
    offline; `include_path` adds any other folder of task YAMLs. `bootstrap_iters` only
    sets the precision of the reported stderr (lm-eval's CLI default, 100000, is slow for
    perplexity metrics and changes no score).
    """
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
    except ImportError as exc:  # lm-eval is an optional extra
        raise ImportError("lm-eval is not installed; pip install 'rana[eval]'") from exc

    with eval_mode(model):
        manager = task_manager(tasks, include_path=include_path, data_dir=data_dir)
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
        )
    return {task: _clean_metrics(metrics) for task, metrics in results["results"].items()}


def task_manager(tasks: Sequence[str], *, include_path: str | Path | None = None, data_dir: str | Path | None = None):
    """An lm-eval TaskManager that knows `tasks` (built once per process and setting).

    Indexing lm-eval's own ~15k task YAMLs takes half a minute, so the bundled `*_local` tasks and
    `include_path` are tried alone first; the full index is built only for a task found in neither."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as exc:  # lm-eval is an optional extra
        raise DataError("--tasks needs lm-eval, which is not installed: pip install 'rana[eval]'") from exc
    if include_path is not None and not Path(include_path).expanduser().is_dir():
        raise DataError(f"--include-path '{include_path}' is not a folder of task YAMLs")
    key = (str(include_path) if include_path else None, str(Path(data_dir).resolve()) if data_dir else None)
    paths = [str(Path(include_path).expanduser())] if include_path is not None else []
    if data_dir is not None:
        if key + ("dir",) not in TASK_MANAGERS:
            tmp = tempfile.mkdtemp(prefix="rana_tasks_")
            atexit.register(shutil.rmtree, tmp, True)
            TASK_MANAGERS[key + ("dir",)] = str(write_local_tasks(tmp, data_dir))
        paths.append(TASK_MANAGERS[key + ("dir",)])
    if paths and (key, False) not in TASK_MANAGERS:
        TASK_MANAGERS[(key, False)] = TaskManager(include_path=paths, include_defaults=False)
    if paths and all(t in TASK_MANAGERS[(key, False)].all_tasks for t in tasks):
        return TASK_MANAGERS[(key, False)]
    if (key, True) not in TASK_MANAGERS:
        TASK_MANAGERS[(key, True)] = TaskManager(include_path=paths or None)
    return TASK_MANAGERS[(key, True)]


def check_tasks(tasks: Sequence[str], *, include_path: str | Path | None = None,
                data_dir: str | Path | None = None) -> None:
    """Before any model is loaded: every task is known to lm-eval, and (offline) its data is at hand."""
    local = [t for t in tasks if t in LOCAL_TASKS]
    if local and data_dir is None and include_path is None:
        raise DataError(f"task(s) {', '.join(local)} read local data: pass --task-data FOLDER (the folder holding "
                        "eval/hellaswag_validation.jsonl etc.)")
    manager = task_manager(tasks, include_path=include_path, data_dir=data_dir)
    known = set(manager.all_tasks)
    for task in tasks:
        if task not in known:
            close = difflib.get_close_matches(task, known, n=3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise DataError(f"unknown lm-eval task '{task}': {hint}(offline: hellaswag_local, lambada_openai_local "
                            "with --task-data; `lm-eval ls tasks` lists the rest)")
    offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes") for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
    if not offline:
        return
    for task in tasks:
        cfg = getattr(manager.task_index.get(task), "cfg", None) or {}
        path = cfg.get("dataset_path")
        if not path or path in ("json", "csv", "parquet", "text", "arrow") or Path(str(path)).exists():
            continue
        if not _hub_dataset_cached(path, cfg.get("dataset_name")):
            local = f"{task}_local"
            instead = f"use {local} with --task-data FOLDER" if local in LOCAL_TASKS else "run it once online"
            raise DataError(f"lm-eval task '{task}' reads the hub dataset '{path}', which is not cached, and offline "
                            f"mode is set (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE): {instead}")


def _hub_dataset_cached(path: str, name: str | None) -> bool:
    # imported on use: datasets is slow to import and reads HF_*_OFFLINE once, when first imported
    import datasets

    try:
        datasets.load_dataset_builder(path, name)
        return True
    except Exception:  # noqa: BLE001 - offline and not cached (datasets raises several types)
        return False
