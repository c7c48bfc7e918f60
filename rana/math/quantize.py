"""Symmetric per-output-channel int8 weights (pure tensor functions).

Row n of a weight W (out × in) is stored as int8 codes `q[n] = clamp(round(W[n] / s_n), -127, 127)`
and one fp32 scale `s_n`; `W[n] ≈ s_n · q[n]`. The scale is `c · max|W[n]| / 127` for a clip ratio
`c` from a small grid (`CLIP_RATIOS`): without calibration data `c = 1` (plain max-abs); with the
second-moment matrix `H = Σ xᵀx` of the layer's inputs, per row the `c` whose output error

    err_n(c) = (W[n] − s_n q[n])ᵀ H (W[n] − s_n q[n])        (= Σ_x (W[n]·x − s_n q[n]·x)²)

is smallest. `c = 1` is in the grid and ties go to it, so on the calibration inputs the chosen
scale is never worse than max-abs. The codes use -127..127 (no -128): the grid is symmetric.
"""
from __future__ import annotations

import torch

QMAX = 127
# descending from 1.0 (max-abs), so that a tie keeps the larger (unclipped) scale
CLIP_RATIOS: tuple[float, ...] = tuple(round(1.0 - 0.025 * i, 4) for i in range(13))  # 1.0 … 0.70
CHUNK_ELEMENTS = 1 << 22  # rows per chunk × in_features: bounds the temporaries (a 151936 × 1536 head: 2730 rows)


def _codes(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(w / scale) clamped to ±QMAX, as float (scale: one per row)."""
    return torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX)


def _max_abs_scale(w: torch.Tensor) -> torch.Tensor:
    amax = w.abs().amax(dim=1)
    # an all-zero row: any scale is exact; 1 keeps the division finite
    return torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))


def row_errors(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, hessian: torch.Tensor | None) -> torch.Tensor:
    """Per-row output error of the int8 form: `(w − s q)ᵀ H (w − s q)`, or `‖w − s q‖²` without H (fp32)."""
    e = weight.float() - scale.float()[:, None] * q.float()
    if hessian is None:
        return (e * e).sum(dim=1)
    return ((e @ hessian.float()) * e).sum(dim=1)


@torch.no_grad()
def quantize_int8(weight: torch.Tensor, hessian: torch.Tensor | None = None, *,
                  clip_ratios: tuple[float, ...] = CLIP_RATIOS,
                  chunk_elements: int = CHUNK_ELEMENTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale fp32 [out]) of `weight` (out × in). `hessian`: `H = XᵀX` (in × in) of
    the layer's inputs (the scale per row minimises the output error on them), None for max-abs.
    Computed on the weight's device, `chunk_elements / in` rows at a time."""
    if weight.ndim != 2:
        raise ValueError(f"quantize_int8: expected a 2-D weight, got shape {tuple(weight.shape)}")
    out_f, in_f = weight.shape
    if hessian is not None and tuple(hessian.shape) != (in_f, in_f):
        raise ValueError(f"quantize_int8: H must be {in_f} × {in_f}, got {tuple(hessian.shape)}")
    device = weight.device
    q = torch.empty((out_f, in_f), dtype=torch.int8, device=device)
    scale = torch.empty(out_f, dtype=torch.float32, device=device)
    H = None if hessian is None else hessian.to(device=device, dtype=torch.float32)
    ratios = sorted({float(c) for c in clip_ratios} | {1.0}, reverse=True)
    rows = max(1, chunk_elements // max(in_f, 1))
    for start in range(0, out_f, rows):
        w = weight[start:start + rows].float()
        base = _max_abs_scale(w)
        best = base
        if H is not None and len(ratios) > 1:
            best_err = None
            for c in ratios:
                s = base * c
                err = row_errors(w, _codes(w, s), s, H)
                if best_err is None:
                    best_err, best = err, s
                else:
                    better = err < best_err
                    best_err = torch.where(better, err, best_err)
                    best = torch.where(better, s, best)
        q[start:start + rows] = _codes(w, best).to(torch.int8)
        scale[start:start + rows] = best
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`scale[n] · q[n]` (q: out × in, int8; scale: out), computed in fp32, returned in `dtype`."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def relative_output_error(weight: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                          hessian: torch.Tensor | None = None, *, chunk_elements: int = CHUNK_ELEMENTS) -> float:
    """Σ_n err_n / Σ_n w_nᵀ H w_n: the int8 layer's squared output error relative to the layer's output
    energy on the calibration inputs (H = None: the relative Frobenius error of the weights, squared)."""
    out_f, in_f = weight.shape
    rows = max(1, chunk_elements // max(in_f, 1))
    err = ref = 0.0
    for start in range(0, out_f, rows):
        w = weight[start:start + rows].float()
        err += float(row_errors(w, q[start:start + rows], scale[start:start + rows], hessian).double().sum())
        zero = torch.zeros_like(scale[start:start + rows])
        ref += float(row_errors(w, q[start:start + rows], zero, hessian).double().sum())
    return err / ref if ref > 0 else 0.0


__all__ = ["QMAX", "CLIP_RATIOS", "quantize_int8", "dequantize_int8", "row_errors", "relative_output_error"]
