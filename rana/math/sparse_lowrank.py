"""R-Sparse's mix for one projection: input sparsity plus a low-rank path for the inputs it drops
(pure tensor functions).

    y ≈ W (m ⊙ x) + A B ((1 − m) ⊙ x),   m_j = 1{|x_j| ≥ t},   A B = rank-r truncated SVD of W

Per token this costs `o·E[k] + r·(i + o)` MACs (B is applied to the whole complement). For a
budget, `sparse_lowrank_choice` tries a few shares of it for the side path — share 0 is plain
magnitude sparsity (TEAL) —, sets t on fit tokens so the rest of the budget is met, and keeps
the mix whose output errs least on held-aside tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .masks import threshold_for_keep_fraction

SIDE_SHARES = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)  # fractions of a projection's budget tried for the side path


@dataclass(frozen=True)
class SparseLowRankChoice:
    rank: int  # of the side path; 0 = plain input sparsity
    threshold: float  # |x_j| ≥ t keeps input j on the full weight
    expected_active: float  # E[k] kept inputs on the fit tokens
    macs: float  # o·E[k] + r·(i + o)
    error: float  # relative output error on the held-aside tokens
    dense: bool = False


@dataclass(frozen=True)
class Svd:
    """W = U diag(S) Vh, float32."""

    U: torch.Tensor
    S: torch.Tensor
    Vh: torch.Tensor

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Svd":
        U, S, Vh = torch.linalg.svd(weight.double(), full_matrices=False)
        return cls(U.float(), S.float(), Vh.float())

    def factors(self, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) with A = U_r diag(S_r) (o × r) and B = V_rᵀ (r × i)."""
        return self.U[:, :rank] * self.S[:rank], self.Vh[:rank]


def side_rank(budget: float, share: float, in_features: int, out_features: int) -> int:
    """The largest rank whose side path `r·(i + o)` fits in `share` of the budget."""
    return min(int(share * budget // (in_features + out_features)), in_features, out_features)


def sparse_lowrank_output(x: torch.Tensor, weight: torch.Tensor, threshold: float, A: torch.Tensor | None,
                          B: torch.Tensor | None) -> torch.Tensor:
    """W (m ⊙ x) + A B ((1 − m) ⊙ x) for rows x (float32 work)."""
    x = x.float()
    kept = x * (x.abs() >= threshold)
    out = kept @ weight.float().T
    if A is not None and A.shape[1]:
        out = out + ((x - kept) @ B.float().T) @ A.float().T
    return out


def sparse_lowrank_choice(x_fit: torch.Tensor, x_eval: torch.Tensor, weight: torch.Tensor, budget: float, *,
                          svd: Svd | None = None, shares: tuple[float, ...] = SIDE_SHARES) -> SparseLowRankChoice:
    """The side-path rank and magnitude threshold that err least on `x_eval` at `budget` MACs."""
    o, i = weight.shape
    if budget >= o * i:
        return SparseLowRankChoice(0, -math.inf, float(i), float(o * i), 0.0, dense=True)
    svd = svd or Svd.of(weight)
    xe = x_eval.float()
    ref = xe @ weight.float().T
    energy = ref.pow(2).sum().clamp_min(1e-30)
    scores = x_fit.float().abs()
    best = None
    for share in sorted(set(shares)):
        r = side_rank(budget, share, i, o)
        if share > 0 and r == 0:
            continue
        keep = (budget - r * (i + o)) / (o * i)
        t = threshold_for_keep_fraction(scores, keep)
        A, B = svd.factors(r)
        err = float((sparse_lowrank_output(xe, weight, t, A, B) - ref).pow(2).sum() / energy)
        if best is None or err < best.error:
            active = max(0.0, min(1.0, keep)) * i
            best = SparseLowRankChoice(r, t, active, o * active + r * (i + o), err)
    return best
