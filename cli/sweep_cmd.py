"""`rana sweep MODEL --methods rana,cats,svd,teal --flops 0.85,0.7,0.58 --ppl-data A --ppl-data B --out DIR`."""
from __future__ import annotations

import typer
from rich.table import Table

from rana.sweep import SweepConfig

from .common import LazyProgress, console, fail, print_wide
from .common import out as stdout
from .options import settings_command


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
    @settings_command(app, "sweep", SweepConfig)
    def sweep(config: SweepConfig) -> None:
        """Compress with several methods at several budgets; evaluate, tabulate and plot (resumable)."""
        from rana.sweep import preflight, run_sweep

        preflight(config)  # every check, before the model loads
        try:
            with LazyProgress("sweep") as progress:
                results = run_sweep(config, progress=progress, log=lambda msg: console.print(msg, highlight=False),
                                    checked=True)
        except KeyboardInterrupt:
            fail(f"interrupted; finished points are kept in {config.out}/points/ — re-run the same command to resume", 130)
        print_wide(stdout, results_table(results))
        stdout.print(f"protocol: {results['protocol']}", highlight=False)
        figs = ", ".join(results.get("figures", {}).values())
        stdout.print(f"wrote {config.out}/results.json, results.md{', ' + figs if figs else ''} and points/",
                     highlight=False)
