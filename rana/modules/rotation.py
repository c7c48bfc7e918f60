"""An explicit rotation of a block's normalised input, paid at run time (wina-ortho)."""
from __future__ import annotations

import torch
import torch.nn as nn

from .common import Adapter, MacMeter
from .registry import register_adapter


@register_adapter
class RotatedInput(MacMeter, Adapter, nn.Module):
    """`norm(x) R`: a decoder block's input norm followed by a d × d rotation of its output.

    The projections reading that output hold `W R` (so `(W R)(Rᵀ n) = W n` at full width and the
    rotation is exact); each token pays d² MACs for `n R`, which the dense model does not spend:
    `macs_dense` is 0 and `measured_macs()` d², so the accounting adds d² per token. `block` says
    which block's cost the rotation is ("attention" or "mlp"; the norm's path lies outside both).
    """

    spec_type = "rotated_input"  # wraps the norm found at its path; no threshold
    spec_fields = {"in": "size", "block": ("attention", "mlp")}
    spec_defaults = {"block": "attention"}  # what a folder without the field meant
    # no linear children (the projections reading it hold W R as plain linears), no weights (`rotation` is a
    # buffer), no threshold: every declaration is the Adapter default

    def to_spec(self, root: nn.Module) -> dict:
        return {"in": self.features, "block": self.block}

    @classmethod
    def from_spec(cls, s: dict, zeros, model: nn.Module, **_) -> "RotatedInput":
        return cls(model.get_submodule(s["path"]), zeros(s["in"], s["in"]), s.get("block", "attention"))

    def __init__(self, norm: nn.Module, rotation: torch.Tensor, block: str):
        super().__init__()
        self.norm = norm
        self.register_buffer("rotation", rotation.detach().clone().contiguous())
        self.features = rotation.shape[0]
        self.block = block
        self.macs_dense = 0.0
        self._init_meter()

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        y = self.norm(x, *args, **kwargs)
        if self.meter_on:
            self._tokens += y.numel() // self.features
        return y @ self._buffers["rotation"]

    def measured_macs(self) -> float:
        return float(self.features * self.features)

    def mean_active(self) -> float:
        return float(self.features) if self._tokens else float("nan")

    def extra_repr(self) -> str:
        return f"features={self.features}, block={self.block}"
