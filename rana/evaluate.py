"""Quality and speed measurements: perplexity, lm-evaluation-harness tasks, decode latency.

Perplexity follows the common GPTQ/SparseGPT protocol so numbers compare across papers:
the documents of a held-out set joined into one stream, cut into non-overlapping windows
(incomplete tail dropped), mean NLL over every token of each window except the first.
"""
from __future__ import annotations

import atexit
import json
import re
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rana.data import DataError, eval_windows

TASKS_DIR = Path(__file__).parent / "tasks"
LOCAL_TASKS = ("hellaswag_local", "lambada_openai_local")
DEFAULT_PROMPT = "The history of the Python programming language begins in the late 1980s, when"
_DATA_DIR_RE = re.compile(r"__DATA_DIR__/(\S+)")


# --------------------------------------------------------------------------- helpers


def _device(model: torch.nn.Module) -> torch.device:
    """Where inputs must go: the device of the model's first parameter (input embeddings)."""
    return next(model.parameters()).device


@contextmanager
def _eval_mode(model: torch.nn.Module):
    """Run in eval mode (no dropout) and restore the caller's train/eval state afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)


# --------------------------------------------------------------------------- perplexity


def window_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed NLL of tokens 1.. of each window given (B, T, V) logits; float32 log-softmax."""
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for row_logits, row_ids in zip(logits, input_ids):  # one row at a time bounds float32 memory
        total += F.cross_entropy(row_logits[:-1].float(), row_ids[1:], reduction="sum").double()
    return total


def perplexity(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    *,
    seq_len: int = 512,
    batch_size: int = 4,
    progress: bool = True,
    on_batch: Callable[[torch.Tensor], None] | None = None,
) -> dict[str, Any]:
    """Perplexity of any HF causal LM on a 1-D token stream (see module docstring).

    `on_batch(input_ids)` is called after each forward pass, e.g. to tally FLOPs or
    tokens; any hooks or meters the caller has enabled on the model stay active.
    """
    windows = eval_windows(tokens, seq_len)
    device = _device(model)
    total_nll = 0.0
    from rich.progress import Progress

    with _eval_mode(model), torch.inference_mode(), Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task(f"perplexity ({len(windows)}×{seq_len})", total=len(windows))
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits
            total_nll += float(window_nll(logits, batch))
            if on_batch is not None:
                on_batch(batch)
            bar.advance(job, len(batch))
    n_pred = len(windows) * (seq_len - 1)
    nll = total_nll / n_pred
    return {
        "ppl": float(torch.tensor(nll).exp()),
        "nll": nll,
        "tokens": n_pred,
        "windows": len(windows),
        "seq_len": seq_len,
        "protocol": (
            f"non-overlapping {seq_len}-token windows of the joined stream (tail dropped); "
            f"mean NLL over all tokens but the first of each window"
        ),
    }


# --------------------------------------------------------------------------- lm-eval


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

    with _eval_mode(model):
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


_MANAGERS: dict[tuple, Any] = {}


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
        if key + ("dir",) not in _MANAGERS:
            tmp = tempfile.mkdtemp(prefix="rana_tasks_")
            atexit.register(shutil.rmtree, tmp, True)
            _MANAGERS[key + ("dir",)] = str(write_local_tasks(tmp, data_dir))
        paths.append(_MANAGERS[key + ("dir",)])
    if paths and (key, False) not in _MANAGERS:
        _MANAGERS[(key, False)] = TaskManager(include_path=paths, include_defaults=False)
    if paths and all(t in _MANAGERS[(key, False)].all_tasks for t in tasks):
        return _MANAGERS[(key, False)]
    if (key, True) not in _MANAGERS:
        _MANAGERS[(key, True)] = TaskManager(include_path=paths or None)
    return _MANAGERS[(key, True)]


def check_tasks(tasks: Sequence[str], *, include_path: str | Path | None = None,
                data_dir: str | Path | None = None) -> None:
    """Before any model is loaded: every task is known to lm-eval, and (offline) its data is at hand."""
    import difflib
    import os

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
    import datasets

    try:
        datasets.load_dataset_builder(path, name)
        return True
    except Exception:  # noqa: BLE001 - offline and not cached (datasets raises several types)
        return False


# --------------------------------------------------------------------------- latency


def _prompt_ids(tokenizer_or_ids, prompt: str) -> torch.Tensor:
    """A (1, T) prompt, from token ids or by tokenising `prompt`."""
    if isinstance(tokenizer_or_ids, torch.Tensor):
        ids = tokenizer_or_ids
    else:
        ids = tokenizer_or_ids(prompt, return_tensors="pt")["input_ids"]
    return ids.reshape(1, -1).long()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


LATENCY_MODES = ("eager", "compiled")


def default_latency_mode(device: torch.device | str) -> str:
    """compiled (static cache + torch.compile: the fast path transformers gives users) on CUDA, else eager."""
    return "compiled" if torch.device(device).type == "cuda" else "eager"


def _generation_config(model: torch.nn.Module, new_tokens: int, mode: str, device: torch.device):
    from transformers import CompileConfig, GenerationConfig

    base = model.generation_config
    eos = base.eos_token_id
    config = GenerationConfig(
        do_sample=False,
        use_cache=True,
        min_new_tokens=new_tokens,  # with max, forces a fixed length (EOS is suppressed)
        max_new_tokens=new_tokens,
        eos_token_id=eos,
        pad_token_id=base.pad_token_id if base.pad_token_id is not None else (eos if isinstance(eos, int) else 0),
    )
    if mode == "compiled":
        # transformers compiles the single-token decode step when the cache is static; fullgraph: a graph
        # break in a masked module would be a bug, not a slower run. CUDA graphs on CUDA ("reduce-overhead").
        compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else "default")
        compile_config._compile_all_devices = device.type != "cuda"  # transformers compiles on CUDA only, by default
        config.compile_config = compile_config
    else:
        config.disable_compile = True
    return config


def _time_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, mode: str = "eager") -> float:
    """Seconds for one batch-1 greedy generate of exactly `new_tokens` tokens.

    compiled: a fresh StaticCache per run (it counts its length on every call, so one cannot be reused)."""
    device = ids.device
    config = _generation_config(model, new_tokens, mode, device)
    kwargs = {}
    if mode == "compiled":
        from transformers import StaticCache

        kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
    _sync(device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **kwargs)
    _sync(device)
    return time.perf_counter() - start


def _measure(models: Sequence[torch.nn.Module], ids: torch.Tensor, new_tokens: int, warmup: int, repeats: int,
             mode: str = "eager") -> list[dict[str, Any]]:
    """Interleave timings of several models so drift (clocks, thermals) hits all alike.

    compiled: one short eager generate per model first, so the Triton kernels take their tuning
    decisions outside compilation and CUDA-graph capture; the warmup runs then compile."""
    if mode not in LATENCY_MODES:
        raise ValueError(f"latency mode must be one of {LATENCY_MODES}, got {mode!r}")
    full: list[list[float]] = [[] for _ in models]
    prefill: list[list[float]] = [[] for _ in models]
    with torch.inference_mode():
        if mode == "compiled":
            for model in models:
                with _eval_mode(model):
                    _time_generate(model, ids.to(_device(model)), 2, "eager")
        for step in range(max(warmup, 1 if mode == "compiled" else 0) + repeats):
            for i, model in enumerate(models):
                model_ids = ids.to(_device(model))
                with _eval_mode(model):
                    t_full = _time_generate(model, model_ids, new_tokens, mode)
                    t_prefill = _time_generate(model, model_ids, 1, mode)
                if step >= max(warmup, 1 if mode == "compiled" else 0):
                    full[i].append(t_full)
                    prefill[i].append(t_prefill)
    return [{**_summary(f, p, new_tokens, ids.shape[1], _device(m)), "mode": mode}
            for f, p, m in zip(full, prefill, models)]


def _summary(
    full: list[float], prefill: list[float], new_tokens: int, prompt_tokens: int, device: torch.device
) -> dict[str, Any]:
    """Median timings → tokens/s overall and for the decode steps alone (prefill removed)."""
    t_full, t_prefill = statistics.median(full), statistics.median(prefill)
    decode = t_full - t_prefill
    return {
        "tokens_per_s": new_tokens / t_full,
        "decode_tokens_per_s": (new_tokens - 1) / decode if decode > 0 and new_tokens > 1 else float("nan"),
        "seconds": t_full,
        "prefill_seconds": t_prefill,
        "new_tokens": new_tokens,
        "prompt_tokens": int(prompt_tokens),
        "repeats": len(full),
        "device": str(device),
    }


def decode_latency(
    model: torch.nn.Module,
    tokenizer_or_prompt_ids,
    *,
    prompt: str = DEFAULT_PROMPT,
    new_tokens: int = 64,
    warmup: int = 2,
    repeats: int = 5,
    mode: str | None = None,
) -> dict[str, Any]:
    """Batch-1 greedy generation speed (median of `repeats` after `warmup` runs).

    `mode`: "eager" (generate, dynamic cache) or "compiled" (generate with a fresh StaticCache per run,
    transformers compiling the decode step); default :func:`default_latency_mode` of the model's device.

    `tokens_per_s` is end to end (prefill + `new_tokens` steps); `decode_tokens_per_s`
    subtracts a 1-token generate to isolate the per-token decode cost.
    """
    ids = _prompt_ids(tokenizer_or_prompt_ids, prompt)
    return _measure([model], ids, new_tokens, warmup, repeats, mode or default_latency_mode(_device(model)))[0]


def latency_ratio(
    model: torch.nn.Module,
    dense_model: torch.nn.Module,
    tokenizer_or_prompt_ids,
    *,
    prompt: str = DEFAULT_PROMPT,
    new_tokens: int = 64,
    warmup: int = 2,
    repeats: int = 5,
    mode: str | None = None,
) -> dict[str, Any]:
    """Compressed vs dense decode speed, timed interleaved in the same run under the same harness (`mode`,
    as in :func:`decode_latency`).

    `latency_ratio` = compressed / dense seconds per generated token (< 1 is faster);
    `speedup` is its inverse. The `decode_` variants exclude prefill.
    """
    ids = _prompt_ids(tokenizer_or_prompt_ids, prompt)
    mode = mode or default_latency_mode(_device(model))
    ours, dense = _measure([model, dense_model], ids, new_tokens, warmup, repeats, mode)
    ratio = dense["tokens_per_s"] / ours["tokens_per_s"]
    decode_ratio = dense["decode_tokens_per_s"] / ours["decode_tokens_per_s"]
    return {
        "tokens_per_s": ours["tokens_per_s"],
        "dense_tokens_per_s": dense["tokens_per_s"],
        "latency_ratio": ratio,
        "speedup": 1.0 / ratio,
        "decode_tokens_per_s": ours["decode_tokens_per_s"],
        "dense_decode_tokens_per_s": dense["decode_tokens_per_s"],
        "decode_latency_ratio": decode_ratio,
        "mode": mode,
        "model": ours,
        "dense": dense,
    }
