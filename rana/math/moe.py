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


__all__ = ["routed_tokens", "per_expert_thresholds"]
