"""Pure math of per-expert thresholds for a mixture of experts (no modules, no lifecycle).

A token reaches expert e only when the router picks it, so each expert's thresholds are fitted on
the calibration tokens routed to it; an expert that saw fewer than `min_tokens` of them gets the
layer's shared threshold, fitted on every routed (token, expert) pair at once."""
from __future__ import annotations

import math

import torch

from .masks import threshold_for_keep_fraction


def routed_tokens(top_k_index: torch.Tensor, num_experts: int) -> list[torch.Tensor]:
    """For each expert, the indices of the tokens (rows of `top_k_index`, [T, k]) routed to it."""
    token = torch.arange(top_k_index.shape[0], device=top_k_index.device).unsqueeze(1).expand_as(top_k_index)
    flat_e, flat_t = top_k_index.reshape(-1), token.reshape(-1)
    order = torch.argsort(flat_e, stable=True)
    counts = torch.bincount(flat_e, minlength=num_experts)[:num_experts].tolist()
    return list(torch.split(flat_t[order][: sum(counts)], counts))


def per_expert_thresholds(scores: list[torch.Tensor], keep: float, min_tokens: int) -> tuple[list[float], float, list[bool]]:
    """Thresholds keeping `keep` of each expert's input entries (`scores[e]`: |x| rows routed to e).

    Returns (thresholds, shared, fell_back): `shared` is fitted on all experts' rows pooled (each
    routed pair once, so it keeps `keep` of the layer's routed work); an expert with fewer than
    `min_tokens` rows gets it (fell_back[e] True)."""
    pooled = torch.cat([s for s in scores if s.numel()]) if any(s.numel() for s in scores) else None
    shared = -math.inf if pooled is None else threshold_for_keep_fraction(pooled, keep)
    if keep >= 1.0:
        shared = -math.inf
    thresholds, fell_back = [], []
    for s in scores:
        few = s.shape[0] < min_tokens
        fell_back.append(few)
        thresholds.append(shared if few or keep >= 1.0 else threshold_for_keep_fraction(s, keep))
    return thresholds, shared, fell_back


def split_candidates(fraction: float, steps: int = 8) -> list[tuple[float, float]]:
    """(gate/up keep, down keep) pairs that spend `fraction` of the experts' dense cost.

    An expert's gate and up read its input (2·I·H MACs at full input), its down the hidden state
    (I·H), so keeping a of the inputs and b of the hidden entries costs (2a + b)/3 of the dense
    expert: every pair here has 2a + b = 3·fraction with a, b in [0, 1]. `steps` + 1 values of a,
    evenly spaced over the feasible range, plus the equal split a = b = fraction."""
    if fraction >= 1.0:
        return [(1.0, 1.0)]
    lo, hi = max(0.0, (3 * fraction - 1) / 2), min(1.0, 1.5 * fraction)
    ins = sorted({round(lo + (hi - lo) * i / steps, 6) for i in range(steps + 1)} | {round(fraction, 6)})
    pairs = [(a, min(1.0, max(0.0, 3 * fraction - 2 * a))) for a in ins]
    return [(a, b) for a, b in pairs if a > 0.0 or b > 0.0]


__all__ = ["routed_tokens", "per_expert_thresholds", "split_candidates"]
