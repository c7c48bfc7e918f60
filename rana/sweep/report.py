"""What a sweep writes: point names, the per-layer summary of a plan, `results.md`, the figures
and `results.json`."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..io.format import write_json
from ..methods import METHODS
from . import plots

DENSE = "dense"
FIGURE_FILES = {
    "ppl_vs_flops": "ppl_vs_flops.png",
    "layer_errors": "layer_errors.png",
    "rank_contributions": "rank_contributions.png",
    "layer_budget": "layer_budget.png",
}


def point_name(method: str, flops: float | None = None) -> str:
    return DENSE if method == DENSE else f"{method}_{flops:g}"


def layer_summary(plan: dict) -> list[dict]:
    """Per layer: held-aside relative error of the attention (QKV) and MLP blocks and the FLOP
    fraction the plan expected each block to spend (expected MACs / dense MACs of its parts).
    A block the plan left dense spends 1.0; its error is 0.0 if the method adapts that part
    elsewhere (a per-layer allocation kept it dense) and None if the method never adapts it."""
    layers = plan.get("layers", [])
    alloc = (plan.get("allocation") or {}).get("fractions") or []
    adapted = {part for e in layers for part in ("attention", "mlp") if e.get(part)}
    adapted |= {part for f in alloc if isinstance(f, dict) for part in f if part in ("attention", "mlp")}
    rows = []
    for entry in layers:
        row: dict[str, Any] = {"layer": entry["layer"]}
        for part in ("attention", "mlp"):
            blk = entry.get(part)
            if not blk:
                row[f"{part}_error"] = 0.0 if part in adapted else None
                row[f"{part}_fraction"] = 1.0
                continue
            comps = list(blk.get("components", {}).values())
            dense = sum(c.get("dense_macs") or 0.0 for c in comps)
            expected = sum(c.get("expected_macs") or 0.0 for c in comps)
            row[f"{part}_error"] = blk.get("heldout_error")
            row[f"{part}_fraction"] = expected / dense if dense else None
        rows.append(row)
    return rows


def describe_point(p: dict, texts: list[str]) -> str:
    name = point_name(p["method"], p.get("target_flops") if p["method"] != DENSE else None)
    if p.get("status") != "ok":
        return f"{name}: {p.get('status')}: {p.get('error', '')}"
    ppl = ", ".join(f"{t} {p['ppl'][t]['ppl']:.3f}" for t in texts if t in p["ppl"])
    return f"{name}: measured FLOPs {p['flops']['fraction']:.4f} of dense; ppl {ppl}"


def _fmt(x, spec: str = ".3f") -> str:
    if x is None:
        return "—"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return format(x, spec)


def results_markdown(results: dict) -> str:
    texts = results["texts"]
    cfg = results["config"]
    lines = [f"# Sweep: {results['model']}", ""]
    cal = results["calibration"]
    lines += [f"- calibration: {cal['dataset']}, {cal['tokens']} tokens in {cal['seq_len']}-token windows "
              f"(the held-aside part gives the `held-aside FLOPs` column)",
              "- evaluation texts: " + ", ".join(f"{t} ({results['text_sources'][t]}, {results['eval_tokens_used'].get(t, '?')} tokens)"
                                             for t in texts),
              f"- protocol: {results['protocol']}",
              "- `measured FLOPs` is the average per-token FLOPs the masks actually took on all evaluation tokens, "
              "as a fraction of the dense model; `attn`/`mlp` are fractions of those parts' dense cost", ""]
    head = ["method", "target", "measured FLOPs", "GFLOPs/tok", "attn", "mlp", "held-aside FLOPs"] + [f"ppl {t}" for t in texts]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in results["points"]:
        target = "dense" if p["method"] == DENSE else _fmt(p["target_flops"], "g")
        if p.get("status") != "ok":
            row = [p["method"], target, f"{p.get('status')}: {p.get('error', '').splitlines()[0] if p.get('error') else ''}"]
            row += [""] * (len(head) - len(row))
        else:
            fl = p["flops"]
            row = [p["method"], target, _fmt(fl["fraction"], ".4f"), _fmt(fl["gflops_per_token"], ".4g"),
                   _fmt(fl["by_part"]["attention"]["fraction_of_part"]), _fmt(fl["by_part"]["mlp"]["fraction_of_part"]),
                   _fmt(p.get("heldout_flops"), ".4f")]
            row += [_fmt(p["ppl"][t]["ppl"]) if t in p["ppl"] else "—" for t in texts]
        lines.append("| " + " | ".join(row) + " |")
    figs = results.get("figures") or {}
    if figs:
        lines += ["", "## Figures", ""]
        for key, f in figs.items():
            if f:
                lines.append(f"- {key}: [{f}]({f})")
        for key, why in (results.get("figures_skipped") or {}).items():
            lines.append(f"- {key}: not drawn ({why})")
    lines.append("")
    lines.append(f"Settings: `{json.dumps({k: cfg.get(k) for k in ('methods', 'flops', 'allocation', 'seq_len', 'eval_tokens', 'calib_tokens', 'seed')})}`")
    return "\n".join(lines) + "\n"


def write_figures(results: dict, out: Path) -> tuple[dict, dict]:
    """Draw the figures; returns ({figure: file name}, {figure: why skipped})."""
    out = Path(out)
    points, texts, budget = results["points"], results["texts"], results.get("figure_flops")
    figures, skipped = {}, {}
    ok = [p for p in points if p.get("status") == "ok"]
    title = results["model"]
    if ok:
        plots.plot_ppl_vs_flops(ok, texts, out / FIGURE_FILES["ppl_vs_flops"], title=title)
        figures["ppl_vs_flops"] = FIGURE_FILES["ppl_vs_flops"]
    at_budget = [p for p in ok if p["method"] != DENSE and budget is not None and abs(p["target_flops"] - budget) < 1e-9]
    if at_budget:
        plots.plot_layer_errors(at_budget, budget, out / FIGURE_FILES["layer_errors"], title=title)
        figures["layer_errors"] = FIGURE_FILES["layer_errors"]
    else:
        skipped["layer_errors"] = "no compressed point at the figure budget"
    hist_point = next((p for m in METHODS for p in at_budget
                       if p["method"] == m and p.get("rank_contributions")), None)
    if hist_point is not None:
        plots.plot_rank_contributions(hist_point["rank_contributions"], out / FIGURE_FILES["rank_contributions"],
                                      title=f"{title}: {hist_point['method']} @ {hist_point['target_flops']:g}, rank contributions")
        figures["rank_contributions"] = FIGURE_FILES["rank_contributions"]
    else:
        skipped["rank_contributions"] = "no rank-adapter method (rana-paper, rana, svd) at the figure budget"
    if at_budget and plots.layer_budget_varies(at_budget, budget):
        plots.plot_layer_budget(at_budget, budget, out / FIGURE_FILES["layer_budget"], title=title)
        figures["layer_budget"] = FIGURE_FILES["layer_budget"]
    elif at_budget:
        skipped["layer_budget"] = "every plan spends the same fraction in every layer"
    return figures, skipped


def write_outputs(results: dict, out: Path) -> None:
    """results.json (with the figures drawn or skipped), results.md and the figures in `out`."""
    out = Path(out)
    figures, skipped = write_figures(results, out)
    results["figures"], results["figures_skipped"] = figures, skipped
    write_json(out / "results.json", results)
    (out / "results.md").write_text(results_markdown(results))
