"""The paper's searches (Sect. 4.2), as batched tensor work on held-aside tokens.

* `line_search_rank`: for one rank adapter and a MAC budget, try ranks r and set the B-mask
  threshold so `r·i + o·E[k]` meets the budget; keep the r with the lowest output error.
* `grid_search_mlp`: split an MLP's budget between up', gate' and down' over a grid (each
  rank adapter runs its own line search for its share) and keep the split with the lowest
  relative MLP output error.

Because A has orthonormal columns that span W's column space, the output error of a mask
is exactly the energy of the dropped code entries: ‖Wx − A(m⊙z)‖² = ‖Wx‖² − Σ_kept z_j².
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import torch

from .masks import b_mask, neuron_scores, threshold_for_keep_fraction
from .sparse_lowrank import Svd, sparse_lowrank_choice, sparse_lowrank_output


@dataclass(frozen=True)
class RankChoice:
    """How one projection spends its budget. `kind`: "rank" (B-masked rank adapter),
    "sparse" (input sparsity scored by |x_j|·‖W[:, j]‖, i.e. a rank adapter with B = I),
    "sparse_lowrank" (magnitude sparsity plus a rank-`rank` SVD path for the dropped inputs,
    R-Sparse) or "dense" (`rank == 0`)."""

    rank: int
    threshold: float
    expected_active: float  # E[k] on the fit tokens (ranks, or inputs for "sparse")
    macs: float
    error: float  # relative output error on the held-aside tokens
    kind: str = "rank"

    @property
    def dense(self) -> bool:
        return self.kind == "dense"


@dataclass
class CodeStats:
    """Squared codes z² = (B_full x)² on fit and held-aside tokens, plus ‖Wx‖² of the latter."""

    z2_fit: torch.Tensor  # N_fit × n
    z2_eval: torch.Tensor  # N_eval × n
    energy_eval: float  # Σ_tokens ‖W x‖²
    in_features: int
    out_features: int


def rank_candidates(budget: float, in_features: int, out_features: int, max_rank: int, count: int = 24) -> list[int]:
    """Ranks worth trying: from the static-SVD rank (E[k] = r) up to the largest r with E[k] > 0."""
    r_static = max(1, int(budget // (in_features + out_features)))
    r_max = min(max_rank, int(math.ceil(budget / in_features)) - 1)
    if r_max < 1:
        return []
    r_static = min(r_static, r_max)
    grid = torch.linspace(r_static, r_max, steps=min(count, r_max - r_static + 1))
    return sorted({int(round(float(r))) for r in grid})


def evaluate_rank(stats: CodeStats, rank: int, budget: float) -> RankChoice:
    """Threshold rank `rank`'s B-mask to meet `budget` and measure its error."""
    i, o = stats.in_features, stats.out_features
    expected = min(float(rank), (budget - rank * i) / o)
    keep = expected / rank
    t = threshold_for_keep_fraction(stats.z2_fit[:, :rank], keep)
    if t == -math.inf:
        kept = stats.z2_eval[:, :rank].sum()
    else:
        z2e = stats.z2_eval[:, :rank]
        kept = (z2e * (z2e >= t)).sum()
    error = max(0.0, (stats.energy_eval - float(kept)) / max(stats.energy_eval, 1e-30))
    active = keep * rank  # exact on the fit sample, by construction of the quantile
    return RankChoice(rank=rank, threshold=t, expected_active=active, macs=rank * i + o * active, error=error)


def line_search_rank(stats: CodeStats, budget: float, *, count: int = 12) -> RankChoice:
    """Best (rank, threshold) for a MAC budget; the dense layer when the budget allows it."""
    i, o = stats.in_features, stats.out_features
    if budget >= i * o:
        return RankChoice(rank=0, threshold=-math.inf, expected_active=float(min(i, o)), macs=float(i * o), error=0.0,
                          kind="dense")
    candidates = rank_candidates(budget, i, o, stats.z2_fit.shape[1], count)
    if not candidates:
        raise ValueError(f"budget {budget:.0f} MACs is below one rank ({i + o} MACs) for a {o}×{i} layer")
    return min((evaluate_rank(stats, r, budget) for r in candidates), key=lambda c: c.error)


def input_sparse_choice(x_fit: torch.Tensor, x_eval: torch.Tensor, weight: torch.Tensor, budget: float,
                        ref_eval: torch.Tensor | None = None, weighted: bool = True) -> RankChoice:
    """Input sparsity for a budget: keep inputs with |x_j|·‖W[:, j]‖ ≥ t, cost o·E[k].

    The score is input j's exact contribution norm to the output (a neuron-thresholding mask on
    the input side; TEAL's plain |x_j| ignores how large W's column is). `weighted=False` scores
    by |x_j| alone (TEAL's score)."""
    o, i = weight.shape
    if budget >= i * o:
        return RankChoice(rank=0, threshold=-math.inf, expected_active=float(i), macs=float(i * o), error=0.0, kind="dense")
    W = weight.float()
    norms = W.norm(dim=0) if weighted else torch.ones(i, device=W.device)
    keep = budget / (o * i)
    t = threshold_for_keep_fraction(neuron_scores(x_fit.float(), norms), keep)
    xe = x_eval.float()
    ref = xe @ W.T if ref_eval is None else ref_eval
    out = (xe * (neuron_scores(xe, norms) >= t)) @ W.T
    error = float((out - ref).pow(2).sum() / ref.pow(2).sum().clamp_min(1e-30))
    active = keep * i
    return RankChoice(rank=0, threshold=t, expected_active=active, macs=o * active, error=error, kind="sparse")


def side_path_choice(x_fit: torch.Tensor, x_eval: torch.Tensor, weight: torch.Tensor, budget: float,
                     side: Svd) -> RankChoice:
    """R-Sparse's mix (rana.math.sparse_lowrank) as a RankChoice: "sparse_lowrank" with the side
    path's rank, or plain magnitude sparsity ("sparse") when no side path pays."""
    c = sparse_lowrank_choice(x_fit, x_eval, weight, budget, svd=side)
    kind = "dense" if c.dense else "sparse_lowrank" if c.rank else "sparse"
    return RankChoice(rank=c.rank, threshold=c.threshold, expected_active=c.expected_active, macs=c.macs,
                      error=c.error, kind=kind)


def code_stats(x_fit: torch.Tensor, x_eval: torch.Tensor, weight: torch.Tensor, B_full: torch.Tensor) -> CodeStats:
    """Codes of the full decomposition for fit and held-aside inputs (float32 work)."""
    Bf = B_full.to(torch.float32)
    z_fit = x_fit.float() @ Bf.T
    z_eval = x_eval.float() @ Bf.T
    energy = float((x_eval.float() @ weight.float().T).pow(2).sum())
    return CodeStats(z2_fit=z_fit.pow(2), z2_eval=z_eval.pow(2), energy_eval=energy,
                     in_features=weight.shape[1], out_features=weight.shape[0])


@dataclass
class MlpComponent:
    """What the grid search needs of one rank-adapted projection (up or gate)."""

    weight: torch.Tensor  # o × i
    U: torch.Tensor | None = None  # o × n orthonormal (Theorem 1); None when rank adapters are not candidates
    stats: CodeStats | None = field(default=None, repr=False)
    allow_sparse: bool = False  # also consider input sparsity and keep whichever errs less
    allow_rank: bool = True  # consider B-masked rank adapters (needs U and stats)
    weighted: bool = True  # input-sparsity score |x_j|·‖W[:, j]‖ (False: |x_j|, TEAL's)
    side: Svd | None = field(default=None, repr=False)  # also consider a low-rank path for the dropped inputs
    ref_eval: torch.Tensor | None = field(default=None, repr=False)  # W x on held-aside tokens (cache)


@dataclass(frozen=True)
class MlpChoice:
    shares: tuple[float, ...]  # (up, gate, down) or (up, down) fractions of the MLP budget
    up: RankChoice
    gate: RankChoice | None
    down_threshold: float
    down_active: float
    down_macs: float
    error: float
    down_rank: int = 0  # rank of down's side path for its dropped inputs (0: none)


def simplex_grid(parts: int, step: float) -> list[tuple[float, ...]]:
    """All share vectors with positive multiples of `step` summing to 1."""
    n = int(round(1 / step))
    if parts == 2:
        return [(a * step, (n - a) * step) for a in range(1, n)]
    return [(a * step, b * step, (n - a - b) * step) for a in range(1, n) for b in range(1, n - a)]


def _adapted_output(comp: MlpComponent, choice: RankChoice, x: torch.Tensor) -> torch.Tensor:
    """up'(x) / gate'(x) for a choice, computed from the stored codes (dense when rank 0)."""
    if choice.dense:
        return x.float() @ comp.weight.float().T
    if choice.kind == "sparse_lowrank":
        return sparse_lowrank_output(x, comp.weight, choice.threshold, *comp.side.factors(choice.rank))
    if choice.kind == "sparse":
        W = comp.weight.float()
        norms = W.norm(dim=0) if comp.weighted else torch.ones(W.shape[1], device=W.device)
        return (x.float() * (neuron_scores(x.float(), norms) >= choice.threshold)) @ W.T
    B = comp.U[:, : choice.rank].T.float() @ comp.weight.float()
    z = x.float() @ B.T
    if choice.threshold != -math.inf:
        z = z * b_mask(z, choice.threshold)
    return z @ comp.U[:, : choice.rank].float().T


def _best_projection_choice(comp: MlpComponent, x_fit, x_eval, budget: float, line_count: int) -> RankChoice:
    options = []
    if comp.allow_rank:
        try:
            options.append(line_search_rank(comp.stats, budget, count=line_count))
        except ValueError:
            pass
    if comp.allow_sparse:
        if comp.ref_eval is None:
            comp.ref_eval = x_eval.float() @ comp.weight.float().T
        options.append(input_sparse_choice(x_fit, x_eval, comp.weight, budget, comp.ref_eval, weighted=comp.weighted))
    if comp.side is not None:
        options.append(side_path_choice(x_fit, x_eval, comp.weight, budget, comp.side))
    if not options:
        raise ValueError(f"budget {budget:.0f} MACs is too small for this projection")
    return min(options, key=lambda c: c.error)


def grid_search_mlp(
    x_fit: torch.Tensor,
    x_eval: torch.Tensor,
    up: MlpComponent,
    gate: MlpComponent | None,
    down_weight: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    budget: float,
    *,
    step: float = 0.125,
    refine: bool = True,
    line_count: int = 12,
    uniform_only: bool = False,
    weighted_down: bool = True,
    down_side: Svd | None = None,
) -> MlpChoice:
    """Grid over the split of `budget` MACs between up', gate' and down' (Sect. 4.2).

    `uniform_only` scores only the equal split (every projection keeps the same fraction of its
    own cost; the wina method). `weighted_down=False` scores down's inputs by |h_i| alone
    (TEAL's score) instead of the contribution |h_i|·‖W_down[:, i]‖. `down_side` (with
    `weighted_down=False`): once the split is chosen, down's budget may also buy a low-rank path for
    the hidden units it drops (R-Sparse), kept when it lowers the MLP's error."""
    d_out, inter = down_weight.shape
    down_w = down_weight.float()
    col_norms = down_w.norm(dim=0) if weighted_down else torch.ones(inter, device=down_w.device)  # down's input score
    up_ref = x_eval.float() @ up.weight.float().T
    ref_eval = act(x_eval.float() @ gate.weight.float().T) * up_ref if gate is not None else act(up_ref)
    ref_out = ref_eval @ down_w.T
    ref_energy = float(ref_out.pow(2).sum())

    @lru_cache(maxsize=None)
    def component(which: str, comp_budget: float):
        comp = up if which == "up" else gate
        choice = _best_projection_choice(comp, x_fit, x_eval, comp_budget, line_count)
        return choice, _adapted_output(comp, choice, x_fit), _adapted_output(comp, choice, x_eval)

    def hidden(u, g):
        return act(g) * u if g is not None else act(u)

    def score(shares: tuple[float, ...]) -> MlpChoice | None:
        budgets = [s * budget for s in shares]
        down_budget = budgets[-1]
        try:
            u = component("up", budgets[0])
            g = component("gate", budgets[1]) if gate is not None else None
        except ValueError:
            return None
        h_fit = hidden(u[1], g[1] if g else None)
        h_eval = hidden(u[2], g[2] if g else None)
        keep = min(1.0, down_budget / (d_out * inter))
        t = threshold_for_keep_fraction(neuron_scores(h_fit, col_norms), keep)
        mask_eval = neuron_scores(h_eval, col_norms) >= t
        out = (h_eval * mask_eval) @ down_w.T
        err = float((out - ref_out).pow(2).sum()) / max(ref_energy, 1e-30)
        active = keep * inter
        return MlpChoice(shares=shares, up=u[0], gate=g[0] if g else None, down_threshold=t, down_active=active,
                         down_macs=d_out * active, error=err)

    parts = 3 if gate is not None else 2
    # the grid, plus the equal split: every projection keeps the same fraction of its own dense cost
    costs = [float(up.weight.numel())] + ([float(gate.weight.numel())] if gate is not None else []) + [float(d_out * inter)]
    uniform = [tuple(c / sum(costs) for c in costs)]
    candidates = uniform if uniform_only else simplex_grid(parts, step) + uniform
    results = [c for c in (score(s) for s in candidates) if c is not None]
    if not results:
        raise ValueError(f"MLP budget {budget:.0f} MACs is too small for any split")
    best = min(results, key=lambda c: c.error)
    if refine and not uniform_only:
        half = step / 2
        neighbours = []
        for i in range(parts):
            for j in range(parts):
                if i != j:
                    s = list(best.shares)
                    s[i] += half
                    s[j] -= half
                    if min(s) > 1e-9:
                        neighbours.append(tuple(s))
        for c in (score(s) for s in neighbours):
            if c is not None and c.error < best.error:
                best = c
    if down_side is not None and not weighted_down:
        # the chosen split's up'/gate' outputs are in component's cache (same budgets as in `score`)
        u = component("up", best.shares[0] * budget)
        g = component("gate", best.shares[1] * budget) if gate is not None else None
        h_fit, h_eval = hidden(u[1], g[1] if g else None), hidden(u[2], g[2] if g else None)
        best = _with_down_side(best, h_fit, h_eval, down_w, down_side, ref_out, ref_energy)
    return best


def _with_down_side(best: MlpChoice, h_fit: torch.Tensor, h_eval: torch.Tensor, down_w: torch.Tensor, down_side: Svd,
                    ref_out: torch.Tensor, ref_energy: float) -> MlpChoice:
    """Re-spend the chosen split's down budget (its hidden states h) on magnitude sparsity plus a side
    path (only the final split: searching it inside every split would multiply the grid's cost)."""
    c = sparse_lowrank_choice(h_fit, h_eval, down_w, best.down_macs, svd=down_side)
    if c.dense or c.rank == 0:
        return best
    out = sparse_lowrank_output(h_eval, down_w, c.threshold, *down_side.factors(c.rank))
    err = float((out - ref_out).pow(2).sum()) / max(ref_energy, 1e-30)
    if err >= best.error:
        return best
    return MlpChoice(shares=best.shares, up=best.up, gate=best.gate, down_threshold=c.threshold,
                     down_active=c.expected_active, down_macs=c.macs, error=err, down_rank=c.rank)
