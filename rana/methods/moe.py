"""The MLP step of a mixture of experts: input sparsity per expert (TEAL-style |x| thresholds).

Each expert's gate/up input and down input get their own threshold, fitted on the calibration
tokens the (dense, unchanged) router sends to that expert, keeping the layer's fraction of the
entries; an expert that saw fewer than MIN_EXPERT_TOKENS tokens gets the layer's shared threshold.
Expected cost: the fraction of the routed experts' dense cost (top-k of E). rana (the default) and
teal both use this step on MoE layers; the default's up/gate/down split search is not run there
(the same fraction on both inputs of every expert), and the methods that rank-decompose, score by
column norms or rotate refuse MoE models (`Method.unsupported_reason`)."""
from __future__ import annotations

import math

import torch

from ..archs import set_submodule
from ..math.masks import subsample_rows
from ..math.moe import per_expert_thresholds, routed_tokens
from ..modules.experts import InputSparseExperts, activation_name
from .base import InputStats, LayerContext, Step, adapter_entry, summary

# Fewer routed calibration tokens than this and an expert's own threshold is noise: the layer's shared
# one is used (a quantile of a few dozen rows of |x| moves by more than the budget's tolerance).
MIN_EXPERT_TOKENS = 32


def _json_threshold(t: float) -> float | None:
    return None if math.isinf(t) and t < 0 else t


@torch.no_grad()
def expert_sparsity(ctx: LayerContext, stats: dict[str, InputStats]) -> dict:
    """Replace the layer's stacked experts by InputSparseExperts fitted per expert; the plan entry."""
    spec = ctx.spec
    experts, router = ctx.module(spec.experts_path()), ctx.module(spec.router_path())
    w = experts.gate_up_proj
    x = stats["mlp_in"].fit.to(device=w.device, dtype=w.dtype)
    _, _, top_k_index = router(x)  # the dense router on the dense input: the routing inference will see
    E, top_k, keep = w.shape[0], top_k_index.shape[1], min(1.0, ctx.fraction)
    routed = routed_tokens(top_k_index, E)
    xs = [subsample_rows(x[t], ctx.fit_sample_tokens) for t in routed]
    t_in, shared_in, fell_back = per_expert_thresholds([r.abs() for r in xs], keep, MIN_EXPERT_TOKENS)
    module = InputSparseExperts(experts.gate_up_proj, experts.down_proj, activation_name(experts.act_fn),
                                torch.tensor(t_in), torch.full((E,), -math.inf), top_k)
    module.to(device=w.device).train(experts.training)  # a new module starts in training mode
    # the down inputs of each expert as the masked gate/up make them (sequential within the expert)
    hs = [module.expert_hidden(r, e)[0] for e, r in enumerate(xs)]
    t_down, shared_down, _ = per_expert_thresholds([h.abs() for h in hs], keep, MIN_EXPERT_TOKENS)
    module.down_threshold.copy_(torch.tensor(t_down))
    module.set_active_fraction(keep)
    set_submodule(ctx.layer, spec.experts_path(), module)
    H, I = module.hidden_dim, module.intermediate_dim
    per_expert = [{"expert": e, "calibration_tokens": int(len(routed[e])), "threshold_source": "shared" if fb else "own",
                   "in_threshold": _json_threshold(a), "down_threshold": _json_threshold(b)}
                  for e, (a, b, fb) in enumerate(zip(t_in, t_down, fell_back))]
    entry = adapter_entry("moe_input_sparse", spec.experts_path(), H, H, threshold=shared_in,
                          expected_active=keep * H, expected_macs=keep * module.macs_dense, dense_macs=module.macs_dense)
    entry.update(num_experts=E, top_k=top_k, intermediate=I, min_expert_tokens=MIN_EXPERT_TOKENS,
                 shared_in_threshold=_json_threshold(shared_in), shared_down_threshold=_json_threshold(shared_down),
                 experts_on_shared_threshold=sum(fell_back), experts=per_expert)
    return summary({"experts": entry})


STEP = Step(("mlp_in",), "mlp_in", (), expert_sparsity, "mlp")

__all__ = ["MIN_EXPERT_TOKENS", "STEP", "expert_sparsity"]
