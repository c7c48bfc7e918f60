"""Sweep figures (matplotlib, Agg; no display needed), after the RaNA paper's Figs. 1–3.

All functions take the plain dicts a sweep stores (`results.json` points) and write one PNG;
they use `matplotlib.figure.Figure` directly, so no pyplot state or GUI backend is involved.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

from ..methods import METHODS, get_method

DENSE_STYLE = dict(color="black", marker="*")


def _style(method: str) -> dict:
    """The dense baseline's style, or the one the method declares (`Method.style`)."""
    return DENSE_STYLE if method == "dense" else dict(get_method(method).style) if method in METHODS else dict(marker="x")


def _figure(nrows: int, ncols: int, *, width: float = 4.6, height: float = 3.6):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width * ncols, height * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def _ok(points: Sequence[dict]) -> list[dict]:
    return [p for p in points if p.get("status", "ok") == "ok"]


def plot_ppl_vs_flops(points: Sequence[dict], texts: Sequence[str], path: Path, *, title: str = "") -> Path:
    """Fig. 1: perplexity vs measured FLOP fraction, one line per method, one panel per text."""
    points = _ok(points)
    fig, axes = _figure(1, max(1, len(texts)))
    methods = list(dict.fromkeys(p["method"] for p in points))
    for ax, text in zip(axes, texts):
        for m in methods:
            pts = sorted((p["flops"]["fraction"], p["ppl"][text]["ppl"]) for p in points
                         if p["method"] == m and text in p.get("ppl", {}) and p.get("flops"))
            if not pts:
                continue
            xs, ys = zip(*pts)
            if m == "dense":
                ax.axhline(ys[0], color="black", lw=0.8, ls="--")
                ax.plot(xs, ys, ls="none", markersize=11, label="dense", **_style(m))
            else:
                ax.plot(xs, ys, label=m, **_style(m))
        ax.set_title(text)
        ax.set_xlabel("measured FLOPs (fraction of dense)")
        ax.set_ylabel("perplexity")
        finite = [p["ppl"][text]["ppl"] for p in points if text in p.get("ppl", {})]
        finite = [v for v in finite if math.isfinite(v) and v > 0]
        if finite and max(finite) / min(finite) > 20:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_layer_errors(points: Sequence[dict], budget: float, path: Path, *, title: str = "") -> Path:
    """Fig. 3: per-layer relative output error (plan.json heldout_error) of QKV and MLP blocks
    for each method at one budget."""
    chosen = [p for p in _ok(points) if p["method"] != "dense" and _close(p["target_flops"], budget) and p.get("layers")]
    fig, axes = _figure(1, 2)
    for ax, part, label in ((axes[0], "attention", "QKV (attention)"), (axes[1], "mlp", "MLP")):
        for p in chosen:
            rows = [(r["layer"], r[f"{part}_error"]) for r in p["layers"] if r.get(f"{part}_error") is not None]
            if rows:
                xs, ys = zip(*rows)
                ax.plot(xs, ys, label=p["method"], **_style(p["method"]))
        ax.set_title(f"{label} @ target {budget:g}")
        ax.set_xlabel("layer")
        _integer_x(ax)
        ax.set_ylabel("‖y − y_dense‖² / ‖y_dense‖²  (held-aside)")
        vals = [y for line in ax.lines for y in line.get_ydata() if y > 0]
        if vals and max(vals) / min(vals) > 100:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def plot_rank_contributions(hists: dict[str, dict], path: Path, *, title: str = "") -> Path:
    """Fig. 2: histograms (log–log) of per-token normalised rank contributions (Bx)_j² / ‖Bx‖²."""
    names = list(hists)
    fig, axes = _figure(1, max(1, len(names)))
    for ax, name in zip(axes, names):
        h = hists[name]
        edges, counts = h["bin_edges"], h["counts"]
        total = max(sum(counts), 1)
        widths = [b - a for a, b in zip(edges[:-1], edges[1:])]
        ax.bar(edges[:-1], [c / total for c in counts], width=widths, align="edge", color="tab:orange", edgecolor="none")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("(Bx)_j² / ‖Bx‖²  per token")
        ax.set_ylabel("share of (token, rank) pairs")
        ax.set_title(f"{name.split('layers.')[-1]}  r={h['rank']}\n"
                     f"kept ranks {h['mean_kept_fraction']:.0%}, energy kept {h['mean_energy_kept']:.1%}", fontsize=9)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def layer_budget_varies(points: Sequence[dict], budget: float, tol: float = 0.02) -> bool:
    """Whether any method's plan spends different FLOP fractions in different layers."""
    for p in _ok(points):
        if p["method"] == "dense" or not _close(p["target_flops"], budget):
            continue
        for part in ("attention", "mlp"):
            vals = [r[f"{part}_fraction"] for r in p.get("layers", []) if r.get(f"{part}_fraction") is not None]
            if vals and max(vals) - min(vals) > tol:
                return True
    return False


def plot_layer_budget(points: Sequence[dict], budget: float, path: Path, *, title: str = "") -> Path:
    """Per-layer FLOP fraction each method's plan chose (measured where metered, else expected)."""
    chosen = [p for p in _ok(points) if p["method"] != "dense" and _close(p["target_flops"], budget) and p.get("layers")]
    fig, axes = _figure(1, 2)
    for ax, part in zip(axes, ("attention", "mlp")):
        for p in chosen:
            rows = [(r["layer"], r[f"{part}_fraction"]) for r in p["layers"] if r.get(f"{part}_fraction") is not None]
            if rows:
                xs, ys = zip(*rows)
                ax.plot(xs, ys, label=p["method"], **_style(p["method"]))
        ax.set_title(f"{part}: FLOP fraction per layer @ target {budget:g}")
        ax.set_xlabel("layer")
        _integer_x(ax)
        ax.set_ylabel("fraction of the block's dense MACs")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _save(fig, path)


def _integer_x(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _close(a: float | None, b: float | None) -> bool:
    return a is not None and b is not None and abs(float(a) - float(b)) < 1e-9
