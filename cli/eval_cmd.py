"""`rana eval MODEL_OR_DIR [--compare DIR2 …] --ppl-data FILE --tasks … --latency --json OUT.json`."""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from rana.evaluation import evaluate_models
from rana.evaluation.perplexity import PPL_PRESET_HELP

from rana.checks import check_inputs

from .common import LazyProgress, console, friendly, print_wide
from .common import out as stdout


# one source of defaults: the library function the command calls
EVAL_DEFAULTS = {name: p.default for name, p in inspect.signature(evaluate_models).parameters.items()}


def _task_metric(metrics: dict) -> tuple[str, float] | None:
    for key in ("acc_norm", "acc", "exact_match", "perplexity", "word_perplexity"):
        if key in metrics:
            return key, metrics[key]
    return None


def eval_table(results: dict) -> Table:
    """One row per model: FLOPs measured on the evaluation tokens, ppl per text, tasks, latency."""
    rows = results["models"]
    texts = list(dict.fromkeys(t for r in rows for t in r.get("ppl", {})))
    tasks = list(dict.fromkeys(t for r in rows for t in r.get("tasks", {}) or {}))
    preset = results.get("ppl_protocol") if results.get("protocol") else None
    t = Table(title="rana eval" + (f" ({preset} perplexity protocol)" if preset else ""))
    cols = ["model", "method", "target", "FLOPs", "GFLOPs/tok", "attn", "mlp", "other"] + [f"ppl {x}" for x in texts]
    for task in tasks:
        m = next((_task_metric(r["tasks"][task]) for r in rows if task in (r.get("tasks") or {})), None)
        cols.append(f"{task} {m[0] if m else ''}".strip())
    if any(r.get("latency") for r in rows):
        cols += ["tok/s", "latency vs dense", "speed-up", "limit 1/F"]
    served = any("ttft_seconds" in (r.get("latency") or {}) for r in rows)
    if served:
        cols += ["TTFT ms", "dense TTFT ms"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("model", "method") else "right")
    for r in rows:
        fl = r.get("flops")
        cells = [_short(r["name"]), r.get("method") or r.get("kind", ""),
                 "-" if r.get("target_flops") is None else f"{r['target_flops']:g}"]
        if fl:
            cells += [f"{fl['fraction']:.4f}", f"{fl['gflops_per_token']:.4g}"]
            cells += [f"{fl['by_part'][p]['fraction_of_part']:.3f}" for p in ("attention", "mlp", "other")]
        else:
            cells += ["-"] * 5
        cells += [f"{r['ppl'][x]['ppl']:.3f}" if x in r.get("ppl", {}) else "-" for x in texts]
        for task in tasks:
            m = _task_metric((r.get("tasks") or {}).get(task, {}))
            cells.append(f"{m[1]:.4f}" if m else "-")
        if "tok/s" in cols:
            lat = r.get("latency") or {}
            ratio = lat.get("latency_ratio")
            limit = lat.get("speedup_limit")
            cells += [f"{lat['tokens_per_s']:.1f}" if lat else "-", f"{ratio:.3f}" if ratio is not None else "-",
                      f"{1 / ratio:.2f}x" if ratio else "-", f"{limit:.2f}x" if limit else "-"]
        if served:
            lat = r.get("latency") or {}
            cells += [f"{lat[k] * 1e3:.1f}" if lat.get(k) is not None else "-"
                      for k in ("ttft_seconds", "dense_ttft_seconds")]
        t.add_row(*cells)
    paths = [x for x in dict.fromkeys((r.get("latency") or {}).get("decode_path") for r in rows) if x]
    harness = [x for x in dict.fromkeys((r.get("latency") or {}).get("mode") for r in rows) if x]
    if harness:
        paths.append(f"{' / '.join(harness)} harness, dense timed the same way")
    if paths:
        t.caption = "decode path: " + "; ".join(paths)
    return t


def _short(name: str) -> str:
    """A path's last component (folders get long); aliases and hub ids as they are."""
    p = Path(name)
    return p.name if p.exists() and p.name else name


def _limit(value: Optional[float]):
    if value is None:
        return None
    if value <= 0:
        raise ValueError(f"--limit must be positive, got {value}")
    return int(value) if value >= 1 and float(value).is_integer() else value


def _check_counts(*, batch_size, eval_tokens, window, latency_tokens, latency_repeats, layer_error_tokens,
                  num_fewshot) -> None:
    for option, value in (("--batch-size", batch_size), ("--latency-tokens", latency_tokens),
                          ("--latency-repeats", latency_repeats)):
        if value < 1:
            raise ValueError(f"{option} must be a positive integer, got {value}")
    if eval_tokens is not None and eval_tokens < window:
        raise ValueError(f"--eval-tokens ({eval_tokens}) must be at least one perplexity window ({window} tokens)")
    if layer_error_tokens < 2:
        raise ValueError(f"--layer-error-tokens must be at least 2, got {layer_error_tokens}")
    if num_fewshot < 0:
        raise ValueError(f"--num-fewshot must be ≥ 0, got {num_fewshot}")


def register(app: typer.Typer) -> None:
    @app.command("eval")
    @friendly
    def evaluate(
        models: List[str] = typer.Argument(..., help="rana folder(s) or dense model(s): alias, hub id, local folder, .gguf"),
        compare: List[str] = typer.Option([], "--compare", help="more models for the same table (repeatable, or comma list)"),
        ppl_data: List[str] = typer.Option([], "--ppl-data", help="perplexity text (repeatable): local .txt/.raw/.jsonl/.parquet or hub name[:config[:split]]"),
        ppl_protocol: str = typer.Option(EVAL_DEFAULTS['ppl_protocol'], help=f"perplexity protocol preset: {PPL_PRESET_HELP}"),
        seq_len: Optional[int] = typer.Option(EVAL_DEFAULTS['seq_len'], help="perplexity window length, also the attention context for FLOPs (default: the --ppl-protocol preset's; for teal, the context before the 512 scored tokens)"),
        batch_size: int = typer.Option(EVAL_DEFAULTS['batch_size'], help="windows per perplexity forward"),
        eval_tokens: Optional[int] = typer.Option(None, help="score only the first N tokens of each text's stream (default: all, as every preset)"),
        text_column: str = typer.Option(EVAL_DEFAULTS['text_column'], help="text column for json/parquet/hub data"),
        tasks: Optional[str] = typer.Option(None, help="comma list of lm-eval tasks (hellaswag,lambada_openai; offline: hellaswag_local,lambada_openai_local with --task-data)"),
        include_path: Optional[Path] = typer.Option(None, help="folder of extra lm-eval task YAMLs"),
        task_data: Optional[Path] = typer.Option(None, help="data folder for the bundled *_local tasks (holds eval/…jsonl), e.g. ../shared/data"),
        limit: Optional[float] = typer.Option(None, help="lm-eval examples per task (a number, or a fraction < 1)"),
        num_fewshot: int = typer.Option(EVAL_DEFAULTS['num_fewshot'], help="lm-eval few-shot examples"),
        latency: bool = typer.Option(False, "--latency", help="batch-1 decode tokens/s, timed interleaved with the dense model"),
        dense: Optional[str] = typer.Option(None, "--dense", help="dense model for --latency / --layer-errors (default: plan.json's model)"),
        latency_tokens: int = typer.Option(EVAL_DEFAULTS['latency_new_tokens'], help="tokens generated per latency run"),
        latency_repeats: int = typer.Option(EVAL_DEFAULTS['latency_repeats'], help="timed latency runs (median)"),
        latency_mode: str = typer.Option("auto", help="latency harness: compiled (generate, static cache + torch.compile) | step (gpt-fast style: compiled one-token step, no generate overhead) | eager | serve (streamed completions through `transformers serve`, the rana folder exported, the dense model saved; TTFT too) | auto (compiled on CUDA, eager elsewhere)"),
        layer_errors: bool = typer.Option(False, "--layer-errors", help="per-layer relative output error of QKV/o/MLP vs the dense model on the first --ppl-data text"),
        layer_error_tokens: int = typer.Option(EVAL_DEFAULTS['layer_error_tokens'], help="tokens for --layer-errors"),
        json_out: Optional[Path] = typer.Option(None, "--json", help="write machine-readable results here"),
        dtype: str = typer.Option(EVAL_DEFAULTS['dtype'], help="float32 | bfloat16 | float16"),
        device: str = typer.Option(EVAL_DEFAULTS['device'], help="compute device (cpu, cuda, …)"),
    ) -> None:
        """Perplexity, measured FLOPs, lm-eval tasks and decode latency of compressed and dense models."""
        from rana.checks import check_device
        from rana.evaluation import check_request, check_tasks
        from rana.units import DTYPES

        refs = list(models) + [c.strip() for item in compare for c in item.split(",") if c.strip()]
        task_list = [t.strip() for t in (tasks or "").split(",") if t.strip()]
        check_request(ppl_sources=ppl_data, tasks=task_list, latency=latency, layer_errors=layer_errors)
        if latency_mode not in ("auto", "compiled", "step", "eager", "serve"):
            raise ValueError(f"--latency-mode must be auto, compiled, step, eager or serve, got {latency_mode!r}")
        if latency and latency_mode == "serve":
            from rana.evaluation import check_serving
            from rana.export import export as export_folder

            check_serving(refs, export_folder)  # `transformers serve` installed: one line before any work
        else:
            export_folder = None
        from rana.evaluation.perplexity import ppl_preset

        window = ppl_preset(ppl_protocol, seq_len).window  # a bad preset name or --seq-len: one line
        _check_counts(batch_size=batch_size, eval_tokens=eval_tokens, window=window, latency_tokens=latency_tokens,
                      latency_repeats=latency_repeats, layer_error_tokens=layer_error_tokens, num_fewshot=num_fewshot)
        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of float32, bfloat16, float16, got '{dtype}'")
        check_device(device)
        lim = _limit(limit)
        # every model, file and output is checked before the first model loads
        check_inputs(*refs, *([dense] if dense else []), seq_len=window if ppl_data else None, json_out=json_out,
                     data=list(ppl_data))
        if task_list:
            check_tasks(task_list, include_path=include_path,
                        data_dir=task_data if any(t.endswith("_local") for t in task_list) else None)
        from rana.io import check_folder, is_rana_dir
        from rana.io.models import model_inputs, resolve

        for r in refs:
            if not is_rana_dir(r):
                resolve(r)  # fail fast on an unknown model
            else:
                check_folder(r)  # a broken rana folder: one line before any work
        from rana.io.format import write_json
        from rana.io.paths import check_output_file, local_inputs

        check_output_file(json_out, [p for r in refs + ([dense] if dense else []) for p in model_inputs(r)]
                          + local_inputs(*ppl_data), "--json")

        with LazyProgress("eval") as progress:
            results = evaluate_models(refs, ppl_sources=list(ppl_data), ppl_protocol=ppl_protocol, seq_len=seq_len,
                                      batch_size=batch_size,
                                      max_tokens=eval_tokens, text_column=text_column, tasks=task_list,
                                      include_path=include_path, task_data=task_data, limit=lim,
                                      num_fewshot=num_fewshot, latency=latency, latency_new_tokens=latency_tokens,
                                      latency_repeats=latency_repeats,
                                      latency_mode=None if latency_mode == "auto" else latency_mode,
                                      layer_errors=layer_errors, layer_error_tokens=layer_error_tokens, dense=dense,
                                      dtype=dtype, device=device, progress=progress,
                                      log=lambda msg: console.print(msg, highlight=False), export=export_folder)
        print_wide(stdout, eval_table(results))
        if ppl_data:
            stdout.print(f"protocol: {results['protocol']}", highlight=False)
            stdout.print("FLOPs: average per-token FLOPs the masks actually took on the evaluation tokens, as a fraction "
                         "of the dense model (attn/mlp/other: fraction of each part's dense cost)", highlight=False)
        for r in results["models"]:
            if r.get("layer_errors"):
                print_wide(stdout, layer_error_table(r))
        if json_out is not None:
            json_out.parent.mkdir(parents=True, exist_ok=True)
            write_json(json_out, results)  # atomic: a full disk leaves no half file
            stdout.print(f"wrote {json_out}", highlight=False)


def layer_error_table(row: dict) -> Table:
    t = Table(title=f"{_short(row['name'])}: relative output error vs dense ({row.get('layer_errors_on', '')})")
    for c in ("layer", "qkv", "o", "mlp"):
        t.add_column(c, justify="right")
    for e in row["layer_errors"]:
        cell = lambda part: f"{e[part]:.4f}" if e[f"{part}_adapted"] else "dense"  # noqa: E731
        t.add_row(str(e["layer"]), cell("attention"), cell("o"), cell("mlp"))
    return t
