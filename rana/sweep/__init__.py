"""`rana sweep`: several methods × several FLOP budgets, each point compressed and evaluated.

    config.py  SweepConfig: the compress and eval settings it borrows, its own methods × budgets
    run.py     preflight, Sweep (resumable points), run_sweep
    report.py  point names, per-layer summaries, results.md / results.json, the figures
    plots.py   the matplotlib figures
"""
from .report import DENSE, FIGURE_FILES, describe_point, layer_summary, point_name, results_markdown, write_figures, write_outputs
from .config import SweepConfig
from .run import Sweep, preflight, run_sweep

__all__ = ["DENSE", "FIGURE_FILES", "describe_point", "layer_summary", "point_name", "results_markdown",
           "write_figures", "write_outputs", "Sweep", "SweepConfig", "preflight", "run_sweep"]
