"""The MLP step of a mixture of experts: input sparsity per expert (TEAL-style |x| thresholds).

Each expert's gate/up input and down input get their own threshold, fitted on the calibration
tokens the (dense, unchanged) router sends to that expert, keeping the layer's fraction of the
entries; an expert that saw fewer than MIN_EXPERT_TOKENS tokens gets the layer's shared threshold.
Expected cost: the fraction of the routed experts' dense cost (top-k of E). teal uses the same
fraction on both inputs of every expert; rana (the default) searches each layer's split of the budget
between the experts' inputs and their down projections' inputs (SEARCHED_STEP), as it searches the
up/gate/down split of a dense MLP. The methods that rank-decompose, score by column norms or rotate
refuse MoE models (`Method.unsupported_reason`)."""
from __future__ import annotations

import math
from functools import partial

import torch

from ..archs import set_submodule
from ..math.masks import subsample_rows
from ..math.moe import per_expert_thresholds, routed_tokens, split_candidates
from ..modules.experts import InputSparseExperts, activation_name
from .base import InputStats, LayerContext, Step, adapter_entry, summary

# Fewer routed calibration tokens than this and an expert's own threshold is noise: the layer's shared
# one is used (a quantile of a few dozen rows of |x| moves by more than the budget's tolerance).
MIN_EXPERT_TOKENS = 32


def _json_threshold(t: float) -> float | None:
    return None if math.isinf(t) and t < 0 else t


def _fit_thresholds(module: InputSparseExperts, xs: list[torch.Tensor], keep_in: float, keep_down: float):
    """Per-expert thresholds keeping `keep_in` of each expert's inputs and `keep_down` of its hidden
    entries (the hidden state as the masked input makes it), set on `module`; what each was fit on."""
    t_in, shared_in, fell_back = per_expert_thresholds([r.abs() for r in xs], keep_in, MIN_EXPERT_TOKENS)
    module.in_threshold.copy_(torch.tensor(t_in))
    module.down_threshold.fill_(-math.inf)
    hs = [module.expert_hidden(r, e)[0] for e, r in enumerate(xs)]
    t_down, shared_down, _ = per_expert_thresholds([h.abs() for h in hs], keep_down, MIN_EXPERT_TOKENS)
    module.down_threshold.copy_(torch.tensor(t_down))
    return t_in, t_down, shared_in, shared_down, fell_back


def _relative_error(module: InputSparseExperts, dense_out: torch.Tensor, x, index, weights) -> float:
    diff = module._routed(x, index, weights).double() - dense_out
    return float(diff.pow(2).sum() / dense_out.pow(2).sum().clamp_min(1e-30))


@torch.no_grad()
def expert_sparsity(ctx: LayerContext, stats: dict[str, InputStats], split: str = "equal") -> dict:
    """Replace the layer's stacked experts by InputSparseExperts fitted per expert; the plan entry.

    split "equal": the layer's fraction on both inputs of every expert (TEAL). "grid" (the default
    method): the gate/up vs down split of the budget searched over `split_candidates`, each scored by
    the experts' output error on the held-aside tokens, routed as the dense router routes them."""
    spec = ctx.spec
    experts, router = ctx.module(spec.experts_path()), ctx.module(spec.router_path())
    w = experts.gate_up_proj
    x = stats["mlp_in"].fit.to(device=w.device, dtype=w.dtype)
    _, _, top_k_index = router(x)  # the dense router on the dense input: the routing inference will see
    E, top_k, keep = w.shape[0], top_k_index.shape[1], min(1.0, ctx.fraction)
    routed = routed_tokens(top_k_index, E)
    xs = [subsample_rows(x[t], ctx.fit_sample_tokens) for t in routed]
    module = InputSparseExperts(experts.gate_up_proj, experts.down_proj, activation_name(experts.act_fn),
                                torch.full((E,), -math.inf), torch.full((E,), -math.inf), top_k)
    module.to(device=w.device).train(experts.training)  # a new module starts in training mode
    pairs, searched = [(keep, keep)], []
    if split == "grid" and keep < 1.0:
        pairs = split_candidates(keep, steps=max(1, round(1 / ctx.grid_step)))
        held = stats["mlp_in"].eval_rows
        x_eval = torch.cat(held).to(device=w.device, dtype=w.dtype) if held else x
        _, w_eval, i_eval = router(x_eval)
        dense_out = experts(x_eval, i_eval, w_eval).double()
        for a, b in pairs:
            _fit_thresholds(module, xs, a, b)
            searched.append({"in_keep": a, "down_keep": b,
                             "error": _relative_error(module, dense_out, x_eval, i_eval, w_eval)})
        best = min(searched, key=lambda r: r["error"])
        pairs = [(best["in_keep"], best["down_keep"])]
    keep_in, keep_down = pairs[0]
    t_in, t_down, shared_in, shared_down, fell_back = _fit_thresholds(module, xs, keep_in, keep_down)
    module.set_active_fraction(keep_in)
    set_submodule(ctx.layer, spec.experts_path(), module)
    H, I = module.hidden_dim, module.intermediate_dim
    per_expert = [{"expert": e, "calibration_tokens": int(len(routed[e])), "threshold_source": "shared" if fb else "own",
                   "in_threshold": _json_threshold(a), "down_threshold": _json_threshold(b)}
                  for e, (a, b, fb) in enumerate(zip(t_in, t_down, fell_back))]
    expected = (2 * keep_in + keep_down) / 3
    entry = adapter_entry("moe_input_sparse", spec.experts_path(), H, H, threshold=shared_in,
                          expected_active=keep_in * H, expected_macs=expected * module.macs_dense,
                          dense_macs=module.macs_dense)
    entry.update(num_experts=E, top_k=top_k, intermediate=I, min_expert_tokens=MIN_EXPERT_TOKENS,
                 shared_in_threshold=_json_threshold(shared_in), shared_down_threshold=_json_threshold(shared_down),
                 split={"mode": split, "in_keep": keep_in, "down_keep": keep_down, "searched": searched},
                 experts_on_shared_threshold=sum(fell_back), experts=per_expert)
    return summary({"experts": entry})


STEP = Step(("mlp_in",), "mlp_in", (), expert_sparsity, "mlp")
# the default's step: the same, with the gate/up vs down split of each layer's budget searched
SEARCHED_STEP = Step(("mlp_in",), "mlp_in", (), partial(expert_sparsity, split="grid"), "mlp")

__all__ = ["MIN_EXPERT_TOKENS", "STEP", "SEARCHED_STEP", "expert_sparsity"]
