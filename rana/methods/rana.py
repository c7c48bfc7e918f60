"""RaNA and the variants built on its machinery: sequential calibration, B-masker thresholds,
the per-projection line search and the per-MLP grid search over the FLOP split (paper Sect. 4.2).

The variants differ only in their `Candidates`: what each projection may become (a B-masked
Theorem-1 rank adapter, input sparsity — a rank adapter with B = I —, or the better of the
two), how sparse inputs are scored, and whether the MLP's split is searched.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn as nn

from ..math.decompose import decompose
from ..math.search import (MlpComponent, RankChoice, code_stats, grid_search_mlp, input_sparse_choice, line_search_rank,
                           side_path_choice)
from ..math.sparse_lowrank import Svd
from . import moe
from .base import (SCORES, InputStats, LayerContext, MemoryNeed, Method, Step, fit_eval_rows, install_choice,
                   install_stacked_qkv, qkv_modules, register, sparse_choice, stacked_weight, summary)


@dataclass(frozen=True)
class Candidates:
    """What RaNA's searches may pick for each projection."""

    rank: bool  # B-masked rank adapters (q/k/v stacked as one; needs the inputs' second moments)
    sparse: bool  # input sparsity; it also adapts o_proj, where a rank adapter's dense B x costs too much
    score: str = "contribution"  # sparse inputs and down's neurons: |x_j|·‖W[:, j]‖, or "magnitude" |x_j|
    split: str = "grid"  # the MLP budget's split between its projections: "grid" search or "equal" shares
    side: bool = False  # sparse inputs may buy a low-rank path for the inputs they drop (R-Sparse's mix)

    def __post_init__(self):
        if not (self.rank or self.sparse):
            raise ValueError("Candidates: allow rank adapters, input sparsity or both")
        if self.side and (not self.sparse or self.score != "magnitude"):
            raise ValueError("Candidates: a side path for dropped inputs needs input sparsity scored by magnitude")
        if self.score not in SCORES:
            raise ValueError(f"Candidates: score must be one of {', '.join(SCORES)}, got '{self.score}'")
        if self.split not in ("grid", "equal"):
            raise ValueError(f"Candidates: split must be 'grid' or 'equal', got '{self.split}'")

    @property
    def contribution(self) -> bool:
        return self.score == "contribution"


# ---------------------------------------------------------------------------- attention


def _sparse_qkv(mods: list[tuple[str, nn.Linear]], x_fit: torch.Tensor, x_eval: torch.Tensor, fraction: float,
                candidates: Candidates) -> tuple[float, list]:
    """Per-projection input sparsity for q, k, v at `fraction`: the stacked relative error
    and each projection's pick."""
    picks = []
    for path, m in mods:
        picks.append((path, m, *_sparse_pick(m, x_fit, x_eval, fraction * m.weight.numel(), candidates)))
    ref = torch.cat([x_eval.float() @ m.weight.float().T for _, m, _, _ in picks], -1)
    err_energy = sum(c.error * float((x_eval.float() @ m.weight.float().T).pow(2).sum()) for _, m, c, _ in picks)
    return err_energy / float(ref.pow(2).sum().clamp_min(1e-30)), picks


def _sparse_pick(linear: nn.Linear, x_fit: torch.Tensor, x_eval: torch.Tensor, budget: float,
                 candidates: Candidates) -> tuple[RankChoice, Svd | None]:
    """Input sparsity for one projection at `budget`, with a side path for the dropped inputs when
    the candidates allow it and it errs less; the choice and the SVD its side path is cut from."""
    W = linear.weight.detach()
    if candidates.side:
        svd = Svd.of(W)
        return side_path_choice(x_fit, x_eval, W, budget, svd), svd
    return input_sparse_choice(x_fit, x_eval, W, budget, weighted=candidates.contribution), None


def attention(ctx: LayerContext, stats: dict[str, InputStats], candidates: Candidates) -> dict:
    """q, k, v: per-projection input sparsity, one stacked B-masked rank adapter, or (both
    allowed) whichever errs less on held-aside tokens at the same FLOPs."""
    s = stats["qkv_in"]
    mods = qkv_modules(ctx)
    x_fit, x_eval = fit_eval_rows(ctx, s)
    if not candidates.rank:  # no decomposition needed
        sparse_err, picks = _sparse_qkv(mods, x_fit, x_eval, ctx.fraction, candidates)
        return summary(_install_sparse_qkv(ctx, picks, candidates), choice={"qkv": "sparse", "sparse_error": sparse_err})
    W, bias = stacked_weight([m for _, m in mods])
    o, i = W.shape
    key = tuple(id(m.weight) for _, m in mods)
    dec = s.cached(("dec", key), lambda: decompose(W, s.moment))
    cs = s.cached(("codes", key), lambda: code_stats(x_fit, x_eval, W, dec.U.T @ W.double()))
    choice = line_search_rank(cs, ctx.fraction * o * i)
    if candidates.sparse:
        sparse_err, picks = _sparse_qkv(mods, x_fit, x_eval, ctx.fraction, candidates)
        if sparse_err < choice.error:
            return summary(_install_sparse_qkv(ctx, picks, candidates),
                           choice={"qkv": "sparse", "sparse_error": sparse_err, "rank_error": choice.error})
    return summary({"qkv": install_stacked_qkv(ctx, choice, dec, W, bias)})


def _install_sparse_qkv(ctx: LayerContext, picks, candidates: Candidates) -> dict:
    return {path.rsplit(".", 1)[-1]: install_choice(ctx, path, m, c, score=candidates.score, side=svd,
                                                    search_error=c.error)
            for path, m, c, svd in picks}


def o_projection(ctx: LayerContext, stats: dict[str, InputStats], candidates: Candidates) -> dict:
    """o_proj (square, so a rank adapter's dense `B x` is too costly): input sparsity."""
    path = ctx.spec.o_path()
    lin = ctx.module(path)
    o, i = lin.weight.shape
    x_fit, x_eval = fit_eval_rows(ctx, stats["o"])
    c, svd = _sparse_pick(lin, x_fit, x_eval, ctx.fraction * o * i, candidates)
    return summary({"o": install_choice(ctx, path, lin, c, score=candidates.score, side=svd, search_error=c.error)})


# ---------------------------------------------------------------------------- MLP


def fused_gate_up_act(act: Callable, inter: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """h = act(gate) * up from the fused [gate; up] output (Phi-3: `gate, up = y.chunk(2, -1)`)."""
    return lambda y: act(y[..., :inter]) * y[..., inter:]


def mlp(ctx: LayerContext, stats: dict[str, InputStats], candidates: Candidates) -> dict:
    """Up and gate each get their own search (a fused gate_up is ONE stacked matrix with one
    B-masker, as stacked QKV, with h = act(gate) ⊙ up read off its output); the down projection
    is neuron-thresholded; the grid search splits the MLP's budget between them."""
    spec = ctx.spec
    paths = spec.mlp_paths()
    down_path = paths.pop("down")
    linears = {name: ctx.module(path) for name, path in paths.items()}  # up, gate | up | gate_up
    down, act = ctx.module(down_path), ctx.module(spec.act_path())
    d_out, inter = down.weight.shape
    if "gate_up" in linears:
        o = linears["gate_up"].weight.shape[0]
        if o != 2 * inter:
            raise ValueError(f"fused '{spec.gate_up_fused}' has {o} outputs, expected 2 × {inter} (gate then up)")
        act = fused_gate_up_act(act, inter)
    s = stats["mlp_in"]
    x_fit, x_eval = fit_eval_rows(ctx, s)
    decs, comps = {}, {}
    for name, lin in linears.items():
        W = lin.weight.detach()
        if not candidates.rank:
            comps[name] = MlpComponent(weight=W, allow_sparse=True, allow_rank=False, weighted=candidates.contribution,
                                       side=Svd.of(W) if candidates.side else None)
            continue
        dec = decs[name] = s.cached(("dec", id(lin.weight)), lambda: decompose(W, s.moment))
        codes = s.cached(("codes", id(lin.weight)), lambda: code_stats(x_fit, x_eval, W, dec.U.T @ W.double()))
        comps[name] = MlpComponent(weight=W, U=dec.U, allow_sparse=candidates.sparse, stats=codes,
                                   weighted=candidates.contribution)
    first = "gate_up" if "gate_up" in comps else "up"
    budget = ctx.fraction * float(inter * d_out * (3 if spec.gated else 2))
    down_side = Svd.of(down.weight.detach()) if candidates.side else None
    choice = grid_search_mlp(x_fit, x_eval, comps[first], comps.get("gate"), down.weight.detach(), act, budget,
                             step=ctx.grid_step, uniform_only=candidates.split == "equal",
                             weighted_down=candidates.contribution, down_side=down_side)
    picked = {first: choice.up, "gate": choice.gate}
    entries = {name: install_choice(ctx, paths[name], lin, picked[name], score=candidates.score, dec=decs.get(name),
                                    side=comps[name].side, line_search_error=picked[name].error)
               for name, lin in linears.items()}
    down_choice = sparse_choice(choice.down_threshold, choice.down_active, choice.down_macs)
    if choice.down_rank:
        down_choice = RankChoice(rank=choice.down_rank, threshold=choice.down_threshold,
                                 expected_active=choice.down_active, macs=choice.down_macs, error=choice.error,
                                 kind="sparse_lowrank")
    entries["down"] = install_choice(ctx, down_path, down, down_choice, score=candidates.score, side=down_side)
    return summary(entries, shares=choice.shares, search_error=choice.error)


# ---------------------------------------------------------------------------- the family


def rana_method(name: str, candidates: Candidates, description: str, style: dict, *, ablation: bool = False,
                lm_head: str = "sparse") -> Method:
    """A RaNA-family method: attention, (with input sparsity) o_proj, then the MLP, all searched
    among `candidates`; under `--lm-head auto` the LM head is adapted too (`lm_head`)."""
    moments = (lambda role: (role,)) if candidates.rank else (lambda role: ())
    o_step = (Step(("o",), "o", (), partial(o_projection, candidates=candidates)),) if candidates.sparse else ()
    steps = (Step(("qkv_in",), "qkv_in", moments("qkv_in"), partial(attention, candidates=candidates)), *o_step,
             Step(("mlp_in",), "mlp_in", moments("mlp_in"), partial(mlp, candidates=candidates), "mlp"))
    parts = ("q", "k", "v") + (("o",) if candidates.sparse else ()) + ("up", "gate", "down")
    # mixtures of experts: magnitude-scored input sparsity per expert, the experts' input vs down split
    # searched where the MLP's is; the variants that rank-decompose, score by column norms or add a
    # low-rank path refuse them
    magnitude_only = candidates.score == "magnitude" and not candidates.rank and not candidates.side
    return Method(name, parts, steps, min_fraction=0.02, description=description,
                  memory=MemoryNeed(grid_search=True), ablation=ablation, style=style, lm_head=lm_head,
                  moe_steps=((moe.SEARCHED_STEP if candidates.split == "grid" else moe.STEP),) if magnitude_only else ())


# Why the default is input sparsity scored by |x_j| with the LM head adapted too, and not rank
# adapters, contribution scores, rotations or a low-rank path for the dropped inputs: the SmolLM2
# sweep (benchmarks/results/README.md "Methods at equal measured FLOPs" and "Ablations of the default",
# benchmarks/results/sweep_smollm2/). The ablations below each change one of these choices; the
# paper's method and WINA keep a dense head, as published.
register(rana_method(
    "rana", Candidates(rank=False, sparse=True, score="magnitude"),
    "rana (default): input sparsity |x_j| ≥ t (a B-masked rank adapter with B = I) on every projection "
    "incl. o_proj, down and the LM head; per-MLP grid search over the up/gate/down split; sequential calibration",
    dict(color="tab:red", marker="o")))
register(rana_method(
    "rana-paper", Candidates(rank=True, sparse=False),
    "RaNA (paper): stacked-QKV and up/gate rank adapters with B-maskers, "
    "neuron-thresholded down, per-linear line search, per-MLP grid search",
    dict(color="tab:orange", marker="s"), lm_head="dense"))
register(rana_method(
    "rana-dense-head", Candidates(rank=False, sparse=True, score="magnitude"),
    "ablation: as rana with the LM head left dense, the decoder layers absorbing the whole cut "
    "(the default before the head was adapted; = --method rana --lm-head dense)",
    dict(color="salmon", marker="o", ls="--"), ablation=True, lm_head="dense"))
register(rana_method(
    "rana-contrib", Candidates(rank=False, sparse=True),
    "ablation: as rana with inputs scored by their contribution |x_j|·‖W[:, j]‖ (neuron "
    "thresholding on every projection)",
    dict(color="tab:cyan", marker="P", ls="--"), ablation=True))
register(rana_method(
    "rana-mixed", Candidates(rank=True, sparse=True),
    "ablation: per projection the better of a B-masked Theorem-1 rank adapter and contribution-scored "
    "input sparsity, chosen by held-aside error at equal FLOPs; otherwise as rana-contrib",
    dict(color="tab:pink", marker="o", ls="--"), ablation=True))
register(rana_method(
    "rana-side", Candidates(rank=False, sparse=True, score="magnitude", side=True),
    "ablation: as rana, and each projection's budget may buy a rank-r SVD path for the inputs its mask "
    "drops (R-Sparse's mix), kept where it lowers the held-aside error",
    dict(color="tab:gray", marker="*", ls="--"), ablation=True))

# WINA (Chen et al. 2025) is this machinery with contribution scores and no split search: every
# projection, down included, keeps the inputs with the largest |x_j|·‖W[:, j]‖ at the layer's
# fraction. Not included: the paper's column-orthogonalising transform (it must be folded into the
# residual stream to cost nothing) and TEAL's greedy allocation (rana's `--allocation global` is the
# counterpart).
register(rana_method(
    "wina", Candidates(rank=False, sparse=True, split="equal"),
    "WINA: inputs scored by |x_j|·‖W[:, j]‖ on every projection incl. o_proj and down, each at the "
    "layer's fraction (no split search); sequential calibration",
    dict(color="tab:olive", marker="X"), lm_head="dense"))
