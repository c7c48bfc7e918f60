"""Model-level FLOP allocation across blocks (pure): spend a total MAC budget where it
buys the most measured quality.

Every block b (a layer's attention projections, or its MLP) has a measured error curve
err_b(f) at a few budget fractions f (f = 1 → dense, error 0) — in rana, the perturbation it
causes at its layer's output — and a dense cost D_b. We minimise Σ err_b(f_b) subject to
Σ f_b·D_b = budget with f_b ∈ [f_min, 1]: greedily lower the block whose next step down on its
(piecewise-linear) curve costs the least error per MAC saved — TEAL's greedy block-wise allocation in
spirit — and stop exactly on budget by interpolating the last step.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ErrorCurve:
    fractions: tuple[float, ...]  # ascending, last one 1.0
    errors: tuple[float, ...]  # errors at those fractions (0 at 1.0)
    dense_macs: float

    def error_at(self, f: float) -> float:
        xs, ys = self.fractions, self.errors
        if f <= xs[0]:
            return ys[0]
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if f <= x1:
                return y0 + (y1 - y0) * (f - x0) / (x1 - x0)
        return ys[-1]


def allocate(curves: list[ErrorCurve], budget_macs: float) -> list[float]:
    """Per-block fractions with Σ f_b·D_b = budget (within float round-off), each in
    [its curve's lowest fraction, 1]."""
    floor = sum(c.fractions[0] * c.dense_macs for c in curves)
    ceiling = sum(c.dense_macs for c in curves)
    if budget_macs < floor - 1e-6 * ceiling:
        raise ValueError(f"budget {budget_macs:.0f} MACs is below the lowest point of the curves ({floor:.0f})")
    if budget_macs >= ceiling:
        return [1.0] * len(curves)
    position = [len(c.fractions) - 1 for c in curves]  # every block starts dense
    spend = ceiling
    while spend > budget_macs:
        best, best_slope = None, float("inf")
        for b, c in enumerate(curves):
            k = position[b]
            if k == 0:
                continue
            saved = (c.fractions[k] - c.fractions[k - 1]) * c.dense_macs
            slope = (c.errors[k - 1] - c.errors[k]) / max(saved, 1e-30)
            if slope < best_slope:
                best, best_slope = b, slope
        if best is None:
            break
        c, k = curves[best], position[best]
        saved = (c.fractions[k] - c.fractions[k - 1]) * c.dense_macs
        if spend - saved >= budget_macs:
            position[best] = k - 1
            spend -= saved
        else:  # the last, partial step lands exactly on budget
            over = spend - budget_macs
            frac = [cv.fractions[p] for cv, p in zip(curves, position)]
            frac[best] = c.fractions[k] - over / c.dense_macs
            return frac
    return [c.fractions[p] for c, p in zip(curves, position)]


def total_error(curves: list[ErrorCurve], fractions: list[float]) -> float:
    """The objective `allocate` minimises: the summed error of every component at its fraction."""
    return float(sum(c.error_at(f) for c, f in zip(curves, fractions)))
