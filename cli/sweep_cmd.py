"""`rana sweep MODEL --methods rana,cats,svd,teal --flops 0.85,0.7,0.58 --ppl-data A --ppl-data B --out DIR`."""
from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from rana.methods import names
from rana.sweep import SweepConfig

from rana.checks import check_inputs

from .common import LazyProgress, console, fail, friendly, print_wide
from .common import out as stdout


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--flops takes comma-separated numbers like 0.85,0.7,0.58, got '{text}'") from None


def results_table(results: dict) -> Table:
    """One row per point: method, target, measured FLOPs (eval tokens), parts, ppl per text."""
    from rana.sweep import DENSE

    texts = results["texts"]
    t = Table(title=f"sweep: {results['model']} (FLOPs measured on the evaluation tokens)")
    for col in ("method", "target", "measured FLOPs", "GFLOPs/tok", "attn", "mlp", "held-aside", *[f"ppl {x}" for x in texts]):
        t.add_column(col, justify="left" if col == "method" else "right")
    for p in results["points"]:
        target = "dense" if p["method"] == DENSE else f"{p['target_flops']:g}"
        if p.get("status") != "ok":
            t.add_row(p["method"], target, f"[yellow]{p.get('status')}[/]", *[""] * (4 + len(texts)))
            continue
        fl = p["flops"]
        held = p.get("heldout_flops")
        t.add_row(p["method"], target, f"{fl['fraction']:.4f}", f"{fl['gflops_per_token']:.4g}",
                  f"{fl['by_part']['attention']['fraction_of_part']:.3f}", f"{fl['by_part']['mlp']['fraction_of_part']:.3f}",
                  "-" if held is None else f"{held:.4f}",
                  *[f"{p['ppl'][x]['ppl']:.3f}" if x in p["ppl"] else "-" for x in texts])
    return t


def register(app: typer.Typer) -> None:
    @app.command("sweep")
    @friendly
    def sweep(
        model: str = typer.Argument(..., help="dense model: alias (smollm2-135m, …), hub id, local folder or .gguf file"),
        out: Path = typer.Option(..., "--out", "-o", help="output folder (re-running with it resumes: finished points are skipped)"),
        ppl_data: List[str] = typer.Option(..., "--ppl-data", help="evaluation text (repeatable): local .txt/.raw/.jsonl/.parquet or hub name[:config[:split]]"),
        methods: str = typer.Option("rana,cats,svd,teal", help=f"comma list of: dense, {', '.join(names())}"),
        flops: str = typer.Option("0.85,0.7,0.58", help="comma list of FLOP budgets (fractions of dense)"),
        dense: bool = typer.Option(SweepConfig.dense, "--dense/--no-dense", help="also evaluate the dense model (the baseline row)"),
        dataset: Optional[str] = typer.Option(None, help="calibration text: hub dataset or local file/folder (default: bundled corpus)"),
        dataset_config: Optional[str] = typer.Option(None, help="hub dataset config name"),
        split: str = typer.Option(SweepConfig.split, help="hub dataset split (calibration)"),
        text_column: str = typer.Option(SweepConfig.text_column, help="text column for json/parquet/hub data"),
        calib_tokens: int = typer.Option(SweepConfig.calib_tokens, help="calibration tokens (computed once, shared by all points)"),
        eval_tokens: Optional[int] = typer.Option(None, help="cap on the tokens of each evaluation text (default: all)"),
        ppl_protocol: str = typer.Option(SweepConfig.ppl_protocol, help="perplexity preset: rana (--seq-len windows) | gptq | teal (as `rana eval --ppl-protocol`)"),
        seq_len: int = typer.Option(SweepConfig.seq_len, help="calibration and perplexity window length"),
        batch_size: int = typer.Option(SweepConfig.batch_size, help="sequences per calibration forward"),
        eval_batch_size: int = typer.Option(SweepConfig.eval_batch_size, help="windows per perplexity forward"),
        figure_flops: Optional[float] = typer.Option(None, help="budget for the per-layer figures (default: the smallest)"),
        dtype: str = typer.Option(SweepConfig.dtype, help="float32 | bfloat16 | float16"),
        device: str = typer.Option(SweepConfig.device, help="compute device (cpu, cuda, …)"),
        grid_step: float = typer.Option(SweepConfig.grid_step, help="MLP budget-split grid step"),
        allocation: str = typer.Option(SweepConfig.allocation, help="FLOP allocation across layers: uniform (paper) | global (by measured sensitivity)"),
        lm_head: str = typer.Option(SweepConfig.lm_head, "--lm-head", help="auto (each method's own) | dense | sparse: the LM head adapted like every projection (as `rana compress --lm-head`)"),
        seed: int = typer.Option(SweepConfig.seed),
        save_models: bool = typer.Option(SweepConfig.save_models, "--save-models", help="also save each compressed model under OUT/models/"),
    ) -> None:
        """Compress with several methods at several budgets; evaluate, tabulate and plot (resumable)."""
        from rana.data import check_source
        from rana.io.models import resolve
        from rana.sweep import run_sweep

        config = SweepConfig(model=model, out=out, ppl_data=list(ppl_data), methods=methods.split(","), flops=_floats(flops),
                             dense=dense, dataset=dataset, dataset_config=dataset_config, split=split,
                             text_column=text_column, calib_tokens=calib_tokens, seq_len=seq_len, eval_tokens=eval_tokens,
                             ppl_protocol=ppl_protocol,
                             batch_size=batch_size, eval_batch_size=eval_batch_size, figure_flops=figure_flops,
                             dtype=dtype, device=device, grid_step=grid_step, allocation=allocation, lm_head=lm_head,
                             seed=seed, save_models=save_models)
        config.validate()
        resolve(model, dense=True)  # fail fast on an unknown model (or a rana folder)
        from rana.io.models import model_inputs
        from rana.io.paths import SWEEP_KIND, check_output, local_inputs

        check_output(out, model_inputs(model) + local_inputs(dataset, *ppl_data), resumable=(SWEEP_KIND,))
        check_inputs(model, seq_len=max(seq_len, config.eval_protocol().window), out=out, out_inside=True,
                     data=list(ppl_data))  # fail fast
        check_source(dataset, "--dataset")
        try:
            with LazyProgress("sweep") as progress:
                results = run_sweep(config, progress=progress, log=lambda msg: console.print(msg, highlight=False))
        except KeyboardInterrupt:
            fail(f"interrupted; finished points are kept in {out}/points/ — re-run the same command to resume", 130)
        print_wide(stdout, results_table(results))
        stdout.print(f"protocol: {results['protocol']}", highlight=False)
        figs = ", ".join(results.get("figures", {}).values())
        stdout.print(f"wrote {out}/results.json, results.md{', ' + figs if figs else ''} and points/", highlight=False)
