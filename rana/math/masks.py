"""Masks and the thresholds that make them meet a budget (pure tensor functions)."""
from __future__ import annotations

import math

import torch


def b_mask(z: torch.Tensor, threshold: torch.Tensor | float) -> torch.Tensor:
    """Keep rank j iff z_j² ≥ t (Eq. 9). With orthonormal A, z_j² is rank j's share of ‖y‖²."""
    return z * z >= threshold


def neuron_scores(h: torch.Tensor, column_norms: torch.Tensor) -> torch.Tensor:
    """|h_i|·‖W[:, i]‖: neuron i's exact contribution norm to the down projection's output."""
    return h.abs() * column_norms


def threshold_for_keep_fraction(scores: torch.Tensor, keep_fraction: float) -> float:
    """Threshold t with mean(scores ≥ t) ≈ keep_fraction over all entries of `scores`.

    Returns -inf (keep all) for fractions ≥ 1 and +inf (keep none) for fractions ≤ 0.
    """
    if keep_fraction >= 1.0:
        return -math.inf
    if keep_fraction <= 0.0:
        return math.inf
    flat = scores.reshape(-1).float()
    n = flat.numel()
    n_keep = int(round(keep_fraction * n))
    if n_keep <= 0:
        return math.inf
    if n_keep >= n:
        return -math.inf
    # the n_keep-th largest value is the (n - n_keep + 1)-th smallest
    return float(torch.kthvalue(flat, n - n_keep + 1).values)


def subsample_rows(x: torch.Tensor, max_rows: int, seed: int = 0) -> torch.Tensor:
    """A deterministic random subset of rows (for quantile estimation on fewer tokens)."""
    if x.shape[0] <= max_rows:
        return x
    g = torch.Generator().manual_seed(seed)
    idx = torch.randperm(x.shape[0], generator=g)[:max_rows].sort().values
    return x[idx.to(x.device)]
