"""`rana sweep`: several methods × several FLOP budgets, each point compressed and evaluated.

    run.py     SweepConfig, Sweep (resumable points), run_sweep
    report.py  point names, per-layer summaries, results.md / results.json, the figures
    plots.py   the matplotlib figures
"""
from .report import DENSE, FIGURE_FILES, describe_point, layer_summary, point_name, results_markdown, write_figures, write_outputs
from .run import Sweep, SweepConfig, run_sweep

__all__ = ["DENSE", "FIGURE_FILES", "describe_point", "layer_summary", "point_name", "results_markdown",
           "write_figures", "write_outputs", "Sweep", "SweepConfig", "run_sweep"]
