"""`--allocation global`: measure how each block's error grows as its budget shrinks, then
split the model's budget across layers and between attention and MLP (rana.math.allocate).

Profiling runs the dense model layer by layer on part of the calibration fit tokens, and for
each block (attention incl. o_proj, MLP) runs the method's own search at a few budget fractions
(the MLP at its equal split only) on shallow copies of the layer that share its weights, and measures what
that block's compression alone does to the layer's output on held-aside tokens: the mean per-token
relative perturbation of the residual stream. That is the loss proxy the greedy allocator
spends the budget against. The sequential compression then runs as usual, each block
with its allocated fraction; the per-layer search of the paper stays inside each share.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..archs import ArchSpec, decoder_layers
from .calibrate import LayerInputs, call_layer, collect_inputs, run_layer
from ..math.allocate import ErrorCurve, allocate
from ..methods import LayerContext, Method

PROFILE_MULTIPLIERS = (0.5, 0.75, 1.0, 1.35)


@dataclass
class Allocation:
    fractions: list[dict[str, float]]  # per layer: step name → fraction of that block's dense cost
    curves: list[dict[str, dict]]  # per layer: step name → {"fractions", "errors", "weight"}
    uniform_fraction: float

    def to_dict(self) -> dict:
        return {"uniform_fraction": self.uniform_fraction, "fractions": self.fractions, "curves": self.curves}


def _shared_copy(layer: nn.Module) -> nn.Module:
    """A structural copy of `layer` whose parameters and buffers are the same tensors."""
    memo = {id(t): t for t in list(layer.parameters()) + list(layer.buffers())}
    return copy.deepcopy(layer, memo)


@torch.no_grad()
def _layer_outputs(layer: nn.Module, inputs: LayerInputs, device) -> list[torch.Tensor]:
    return [call_layer(layer, h, kw, device).float() for h, kw in zip(inputs.hidden, inputs.kwargs)]


def _per_token_perturbation(ref: list[torch.Tensor], out: list[torch.Tensor]) -> float:
    """Mean over tokens of ‖Δy_t‖² / ‖y_t‖² at the layer output (the residual stream).

    Per token, not a ratio of sums: the next layer normalises each token's residual on its own, so
    what an error does downstream is its size relative to *that token's* residual. A ratio of sums
    is dominated by the few tokens carrying massive activations (SmolLM2's layer-11 MLP writes
    ~98 % of the residual energy on them), which made every later block look insensitive."""
    total, tokens = 0.0, 0
    for r, o in zip(ref, out):
        num = (o - r).pow(2).sum(-1)
        den = r.pow(2).sum(-1).clamp_min(1e-30)
        total += float((num / den).sum())
        tokens += num.numel()
    return total / max(tokens, 1)


def profile_and_allocate(model: nn.Module, spec: ArchSpec, method: Method, fit: LayerInputs, held: LayerInputs,
                         uniform_fraction: float, dense_per_layer: list[dict], *,
                         fit_sample_tokens: int, search_tokens: int, device, offload, residency,
                         profile_share: float = 0.5, progress=None) -> Allocation:
    """Error curves for every block, then the greedy allocation of the same total budget."""
    layers = decoder_layers(model, spec)
    n_fit = max(1, int(round(len(fit.hidden) * profile_share)))
    fit = LayerInputs(fit.hidden[:n_fit], fit.kwargs[:n_fit], fit.spill)
    steps_of_layer = method.layer_steps(spec)
    roles = sorted({r for st in steps_of_layer for r in st.targets})
    moments = tuple(sorted({r for st in steps_of_layer for r in st.moments}))
    lo = method.min_fraction + 1e-3
    fractions = sorted({min(1.0, max(lo, uniform_fraction * m)) for m in PROFILE_MULTIPLIERS} - {1.0})
    curves, blocks, per_layer_curves = [], [], []
    for idx, layer in enumerate(layers):
        residency.bring(idx, layer)
        targets = {r: layer.get_submodule(spec.role_path(r)) for r in roles}
        stats = collect_inputs(layer, fit, held, targets, device=device, stop_at=None, second_moment=moments,
                               layer_index=idx)
        reference = _layer_outputs(layer, held, device)
        layer_curves = {}
        for name in dict.fromkeys(step.block for step in steps_of_layer):
            steps = [st for st in steps_of_layer if st.block == name]
            dense_cost = sum(dense_per_layer[idx][p] for p in method.adapted_parts if _part_step(p) == name)
            errors = []
            for f in fractions:  # this block alone compressed, the rest of the layer dense
                work = _shared_copy(layer)
                # grid_step 1: the MLP at its equal split only — the split search is most of a block's
                # cost and runs once, inside the block's final share; the curves only rank blocks
                ctx = LayerContext(index=idx, layer=work, spec=spec, fraction=f, fit_sample_tokens=fit_sample_tokens,
                                   search_tokens=search_tokens, grid_step=1.0)
                for st in steps:
                    st.apply(ctx, stats)
                errors.append(_per_token_perturbation(reference, _layer_outputs(work, held, device)))
            curves.append(ErrorCurve(tuple(fractions) + (1.0,), tuple(errors) + (0.0,), dense_cost))
            blocks.append((idx, name))
            layer_curves[name] = {"fractions": list(fractions) + [1.0], "errors": errors + [0.0]}
        fit = run_layer(layer, fit, device=device, offload=offload)
        held = run_layer(layer, held, device=device, offload=offload)
        residency.drop(idx, layer)  # profiling only measured it
        per_layer_curves.append(layer_curves)
        if progress:
            progress("profiling", idx + 1, len(layers))
    budget = uniform_fraction * sum(c.dense_macs for c in curves)
    chosen = allocate(curves, budget)
    per_layer = [dict() for _ in layers]
    for (idx, name), f in zip(blocks, chosen):
        per_layer[idx][name] = f
    return Allocation(fractions=per_layer, curves=per_layer_curves, uniform_fraction=uniform_fraction)


def _part_step(part: str) -> str:
    return "mlp" if part in ("up", "gate", "down") else "attention"
