"""`rana eval MODEL_OR_DIR [--compare DIR2 …] --ppl-data FILE --tasks … --latency --json OUT.json`.

The options are `rana.evaluation.EvalConfig`'s fields; the checks before any work are
`rana.evaluation.preflight`. This module parses and prints: the table, the per-layer errors, the JSON."""
from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from rana.evaluation import EvalConfig

from .common import LazyProgress, console, print_wide
from .common import out as stdout
from .options import settings_command


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


def register(app: typer.Typer) -> None:
    @settings_command(app, "eval", EvalConfig)
    def evaluate(config: EvalConfig) -> None:
        """Perplexity, measured FLOPs, lm-eval tasks and decode latency of compressed and dense models."""
        from rana.evaluation import evaluate_models, preflight
        from rana.evaluation.serving import SERVE_MODE

        preflight(config)
        export_folder = None
        if config.latency and config.latency_mode == SERVE_MODE:
            from rana.export import export as export_folder  # the exporter the serve mode serves rana folders with
        with LazyProgress("eval") as progress:
            results = evaluate_models(config.references, config, progress=progress, export=export_folder,
                                      log=lambda msg: console.print(msg, highlight=False))
        print_results(results, config)


def print_results(results: dict, config: EvalConfig) -> None:
    """The table, the protocol, each model's per-layer errors; the JSON file with --json."""
    from rana.io.format import write_json

    print_wide(stdout, eval_table(results))
    if config.ppl_data:
        stdout.print(f"protocol: {results['protocol']}", highlight=False)
        stdout.print("FLOPs: average per-token FLOPs the masks actually took on the evaluation tokens, as a fraction "
                     "of the dense model (attn/mlp/other: fraction of each part's dense cost)", highlight=False)
    for r in results["models"]:
        if r.get("layer_errors"):
            print_wide(stdout, layer_error_table(r))
    if config.json_out is not None:
        config.json_out.parent.mkdir(parents=True, exist_ok=True)
        write_json(config.json_out, results)  # atomic: a full disk leaves no half file
        stdout.print(f"wrote {config.json_out}", highlight=False)


def layer_error_table(row: dict) -> Table:
    t = Table(title=f"{_short(row['name'])}: relative output error vs dense ({row.get('layer_errors_on', '')})")
    for c in ("layer", "qkv", "o", "mlp"):
        t.add_column(c, justify="right")
    for e in row["layer_errors"]:
        cell = lambda part: f"{e[part]:.4f}" if e[f"{part}_adapted"] else "dense"  # noqa: E731
        t.add_row(str(e["layer"]), cell("attention"), cell("o"), cell("mlp"))
    return t
