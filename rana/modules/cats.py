"""CATS baseline: dense gate, threshold on |act(gate)|, only kept rows of up / columns of down."""
from __future__ import annotations

import torch
import torch.nn as nn

from .common import Adapter, MacMeter
from .registry import register_adapter


@register_adapter
class CatsActivation(MacMeter, Adapter, nn.Module):
    """`a ⊙ 1{|a| ≥ t}` with `a = act(gate x)`; owns the up/down cost of the kept neurons.

    Zeroed neurons make `a ⊙ up(x)` zero there, so up's rows and down's columns for them are
    never needed: this module meters `(hidden + hidden)·E[k]` MACs for up and down together.
    """

    spec_type = "cats"  # wraps the activation module found at its path (the projections around it stay plain
    #                     linears; it masks an activation: no GEMV of its own)
    spec_fields = {"hidden": "size", "intermediate": "size", "threshold": "threshold"}
    refit = "own"  # on |act(gate)|

    def to_spec(self, root: nn.Module) -> dict:
        return {"hidden": self.hidden, "intermediate": self.intermediate, "threshold": float(self.threshold)}

    @classmethod
    def from_spec(cls, s: dict, threshold: float, model: nn.Module, **_) -> "CatsActivation":
        return cls(model.get_submodule(s["path"]), threshold, s["hidden"], s["intermediate"])

    def __init__(self, act: nn.Module, threshold: float, hidden: int, intermediate: int):
        super().__init__()
        self.act = act
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.hidden, self.intermediate = hidden, intermediate
        self.macs_dense = float(2 * hidden * intermediate)
        self._init_meter()

    def mask_width(self) -> int:
        return self.intermediate

    def refit_scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(x).float().abs()

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        a = self.act(g)
        mask = a.abs() >= self.threshold
        self._record(mask)
        return a * mask

    def measured_macs(self) -> float:
        return 2 * self.hidden * self.mean_active()

    def extra_repr(self) -> str:
        return f"threshold={float(self.threshold):.4g}"
