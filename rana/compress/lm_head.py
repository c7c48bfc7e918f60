"""The LM head in the FLOP budget (`--lm-head`).

The head is part of the model's per-token MACs (rana.math.flops), so when it stays dense the
decoder layers absorb the whole cut: on a model whose head is a large share of its FLOPs a
moderate `--flops` leaves the layers' projections little (a 270M model with a 262k vocabulary at
F = 0.70: ~25 % of their MACs, perplexity ×46). `budget_summary` says, from the same accounting
the compressor uses, what fraction the adapted projections and the decoder layers keep, and
`harsh_budget_warning` says so in one line when that fraction is below `HARSH_FRACTION`.

`--lm-head sparse` makes the head one more adapted projection: input sparsity `|x_j| ≥ t` on the
final normed hidden state (`rana.modules.InputSparseHead`), calibrated after every decoder layer
is compressed (its inputs come from the compressed model, as each layer's do from the compressed
layers before it). Budget rule: `F` applies uniformly to every adapted MAC, the head's included
(the head keeps the same fraction of its dense MACs as every adapted projection), so the head is
budgeted by the same `adapted_fraction` formula as the layers and nothing is tuned on the
calibration text. A tied head keeps the input embedding's Parameter: the embedding is unchanged
and the folder stores the matrix once (under the embedding's key, as for a dense tied head).
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..accounting import metering
from ..errors import UserError
from ..archs import ArchSpec, set_submodule
from ..math.masks import subsample_rows, threshold_for_keep_fraction
from ..methods.base import adapter_entry
from ..modules import InputSparseHead
from .calibrate import LayerInputs, collect_inputs
from .placement import as_module_input

# "auto": what the method does with the head (`Method.lm_head`; the default `rana` adapts it, the
# peers as published leave it dense), resolved before any work (`resolve_lm_head`) so plan.json and
# recipes record the concrete choice.
LM_HEAD_CHOICES = ("auto", "dense", "sparse")

# Below this share of their dense MACs the adapted projections degrade steeply. Measured with the
# default method on SmolLM2-135M (the sweep, benchmarks/results/README.md): at 0.80 of their MACs
# perplexity is ×1.00 of dense, at 0.60 ×1.2, at 0.43 ×2.1-2.7; the 270M model of issue 15 at
# ~0.25: ×46.
HARSH_FRACTION = 0.5
# A dense head worth adapting: above this share of the model's MACs, suggest `--lm-head sparse`
# (SmolLM2-135M: 0.20; Qwen2.5-0.5B: 0.27; Llama-2-7B: 0.02).
LARGE_HEAD_SHARE = 0.10


def check_lm_head(choice: str) -> None:
    if choice not in LM_HEAD_CHOICES:
        raise UserError(f"unknown --lm-head '{choice}' (choose {', '.join(LM_HEAD_CHOICES[:-1])} or {LM_HEAD_CHOICES[-1]})")


def resolve_lm_head(choice: str, method_default: str) -> str:
    """`--lm-head` as run: the method's own choice under "auto", else as given."""
    return method_default if choice == "auto" else choice


def budget_summary(dense: dict, layers_adapted: float, fraction: float, lm_head: str) -> dict:
    """What the budget gives each part: `fraction` is what every adapted projection keeps of its
    dense MACs; `layers_fraction` what the decoder layers keep as a whole (o_proj, attention
    products and anything else the method leaves dense included); the head keeps `fraction` when
    adapted, all of its MACs otherwise."""
    layers_dense = dense["total"] - dense["lm_head"]
    return {
        "lm_head": lm_head,
        "lm_head_share": dense["lm_head"] / dense["total"],
        "lm_head_fraction": fraction if lm_head == "sparse" else 1.0,
        "projections_fraction": fraction,
        "layers_fraction": (layers_dense - layers_adapted * (1.0 - fraction)) / layers_dense,
        "harsh": fraction < HARSH_FRACTION,
    }


def describe_budget(info: dict) -> str:
    """One line: what the adapted projections, the layers and the head keep."""
    head = (f"the LM head ({info['lm_head_share']:.1%} of the model) keeps {info['lm_head_fraction']:.1%}"
            if info["lm_head"] == "sparse" else f"the LM head ({info['lm_head_share']:.1%} of the model) stays dense")
    return (f"budget: the adapted projections keep {info['projections_fraction']:.1%} of their dense MACs "
            f"(the decoder layers {info['layers_fraction']:.1%} of theirs); {head}")


def harsh_budget_warning(info: dict) -> str | None:
    """One line when the adapted projections keep less than HARSH_FRACTION of their MACs (None otherwise)."""
    if not info["harsh"]:
        return None
    hint = "raise --flops"
    if info["lm_head"] == "dense" and info["lm_head_share"] >= LARGE_HEAD_SHARE:
        hint += f", or pass --lm-head sparse so the head ({info['lm_head_share']:.0%} of the FLOPs) shares the cut"
    return (f"the adapted projections keep only {info['projections_fraction']:.1%} of their MACs, below "
            f"{HARSH_FRACTION:.0%}, where quality drops steeply (SmolLM2: perplexity ×1.2 at 60%, ×2-3 at 43%); {hint}")


class _HeadInput(nn.Module):
    """The final norm and the head, called like a decoder layer (its keyword arguments ignored)
    so that `collect_inputs` can record the head's inputs, stopping before the head computes."""

    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.head(self.norm(hidden))


@torch.no_grad()
def compress_lm_head(model: nn.Module, spec: ArchSpec, fit: LayerInputs, held: LayerInputs, fraction: float, *,
                     fit_sample_tokens: int, search_tokens: int, device: torch.device, layer_index: int,
                     chunk_rows: int = 256) -> dict:
    """Swap the head for input sparsity keeping `fraction` of its inputs, its threshold fit on the
    final normed hidden states of the fit tokens (`fit`, `held`: the last decoder layer's outputs);
    the meter of the new head measures it on the held-aside tokens. Returns its plan entry."""
    head = model.get_submodule(spec.lm_head)
    if type(head) is not nn.Linear:
        raise UserError(f"--lm-head sparse: '{spec.lm_head}' is a {type(head).__name__}, not a plain linear layer; "
                        "pass --lm-head dense")
    tied = head.weight is getattr(model.get_input_embeddings(), "weight", None)
    stats = collect_inputs(_HeadInput(model.get_submodule(spec.final_norm), head), fit, held, {spec.lm_head: head},
                           device=device, stop_at=head, layer_index=layer_index)[spec.lm_head]
    o, i = head.weight.shape
    keep = min(1.0, fraction)
    threshold = threshold_for_keep_fraction(subsample_rows(stats.fit, fit_sample_tokens).abs(), keep)
    # tied: the same Parameter, so the tie stays a tie; untied: its own column-major copy (the decode kernel's layout)
    sparse = InputSparseHead(head.weight if tied else head.weight.detach(), head.bias, threshold)
    set_submodule(model, spec.lm_head, sparse)
    x_held = as_module_input(stats.eval, sparse)
    with metering(sparse):
        for rows in x_held.split(chunk_rows):
            sparse(rows)
    # vocabulary-wide logits, a chunk of rows at a time (all at once they doubled SmolLM2's peak memory)
    err, ref_energy = 0.0, 0.0
    for rows in subsample_rows(x_held, search_tokens).split(chunk_rows):
        ref = nn.functional.linear(rows, sparse.weight, sparse.bias).float()
        err += float((sparse(rows).float() - ref).pow(2).sum())
        ref_energy += float(ref.pow(2).sum())
    return adapter_entry("input_sparse", spec.lm_head, o, i, threshold=threshold, expected_active=keep * i,
                         expected_macs=o * keep * i, tied=tied, heldout_error=err / max(ref_energy, 1e-30),
                         measured_active=sparse.mean_active(), measured_macs=sparse.measured_macs())


__all__ = ["LM_HEAD_CHOICES", "check_lm_head", "resolve_lm_head", "HARSH_FRACTION", "LARGE_HEAD_SHARE", "budget_summary", "describe_budget",
           "harsh_budget_warning", "compress_lm_head"]
