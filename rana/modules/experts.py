"""A mixture of experts' stacked experts with input sparsity, one threshold per expert.

transformers 5 stores every expert of a layer as 3-D parameters (``gate_up_proj`` [E, 2I, H],
``down_proj`` [E, H, I]) in one module that the MoE block calls as ``experts(x, top_k_index,
top_k_weights)`` after its (dense) router. This module replaces that one, with the same call, the
same parameter names and shapes (so checkpoints keep their keys), and masks

    gate/up input:  x_j kept when |x_j| ≥ t_in[e]       (the MLP input, as routed to expert e)
    down input:     h_i kept when |h_i| ≥ t_down[e]     (h = act(gate) ⊙ up of expert e)

Both weights are stored *transposed* (``gate_up_proj.transpose(1, 2)`` is a contiguous [E, H, 2I]):
an inactive input then skips one contiguous row of the expert's ``w_t`` (the masked-GEMV layout of
rana.modules.common.column_major_linear, per expert). One decode token runs only its routed experts
through the decode route's expert entry point (rana.kernels.route.decode_expert_masked: one native call on
CPU, one Triton launch on CUDA, rana::expert_masked_gemv under torch.compile), indexed into the stacked weights
(no loop over experts).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.activations import ACT2FN

from ..errors import UserError
from ..kernels.route import decode_expert_masked
from ..kernels.weights import FloatWeight
from .common import Adapter, MacMeter, MaskedDecode
from .operands import keep_operand, kept_operand
from .registry import register_adapter

# the activations MoE checkpoints use (config.hidden_act); a folder names one of these
ACTIVATIONS = ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "swish")


def _input_major(weight: torch.Tensor) -> nn.Parameter:
    """A Parameter of `weight`'s shape [E, out, in] whose storage is [E, in, out] contiguous."""
    return nn.Parameter(weight.detach().transpose(1, 2).contiguous().transpose(1, 2))


@register_adapter
class InputSparseExperts(MaskedDecode, MacMeter, Adapter, nn.Module):
    """Stacked experts with per-expert magnitude thresholds on their input and on their down
    projection's input (`in_threshold`, `down_threshold`: [E] float32 buffers, -inf keeps all)."""

    spec_type = "moe_input_sparse"
    spec_fields = {"experts": "size", "in": "size", "inter": "size", "top_k": "size", "act": ACTIVATIONS}
    bare_weights = True  # stacked 3-D [E, out, in] parameters: LoRA cannot wrap them, --full trains them
    # (no decode_mode: the expert-indexed masked GEMV takes none; no refit: per-expert thresholds, and int8 has no
    # form for stacked experts)
    _float32_buffers = ("in_threshold", "down_threshold")

    def to_spec(self, root: nn.Module) -> dict:
        return {"experts": self.num_experts, "in": self.hidden_dim, "inter": self.intermediate_dim,
                "top_k": self.top_k, "act": self.act}

    @classmethod
    def from_spec(cls, s: dict, zeros, **_) -> "InputSparseExperts":
        e, h, i = s["experts"], s["in"], s["inter"]
        return cls(zeros(e, 2 * i, h), zeros(e, h, i), s["act"], zeros(e), zeros(e), s["top_k"])

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, act: str, in_threshold: torch.Tensor,
                 down_threshold: torch.Tensor, top_k: int):
        super().__init__()
        self.num_experts, two_i, self.hidden_dim = gate_up.shape
        self.intermediate_dim, self.top_k, self.act = two_i // 2, int(top_k), act
        self.gate_up_proj = _input_major(gate_up)
        self.down_proj = _input_major(down)
        self.act_fn = ACT2FN[act]
        self.register_buffer("in_threshold", in_threshold.detach().to(torch.float32).clone())
        self.register_buffer("down_threshold", down_threshold.detach().to(torch.float32).clone())
        # what the top-k experts cost one token dense: gate and up (2I x H) and down (H x I) each
        self.macs_dense = float(self.top_k * 3 * self.intermediate_dim * self.hidden_dim)
        self._init_meter()

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if hidden_states.shape[0] == 1 and self.decode_open():
            weights = self.decode_weights()
            if not (torch.is_grad_enabled() and (hidden_states.requires_grad or any(w.requires_grad for w in weights))):
                return self._decode(weights, hidden_states, top_k_index, top_k_weights)
        return self._routed(hidden_states, top_k_index, top_k_weights)

    def decode_weights(self) -> tuple[FloatWeight, FloatWeight]:
        """The operands of its stacked gate/up and down weights (kept; remade when a parameter is replaced)."""
        params = self._parameters
        out = []
        for name in ("gate_up_proj", "down_proj"):
            operand = kept_operand(self, name)
            if operand is None or operand.weight is not params[name]:
                operand = keep_operand(self, name, FloatWeight(params[name]))
            out.append(operand)
        return tuple(out)

    def _decode(self, weights, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """One token: its k experts through the expert-indexed masked GEMV (gate/up, then down)."""
        buffers = self._buffers
        idx = top_k_index.reshape(-1)
        k = idx.shape[0]
        gate_up = decode_expert_masked(weights[0], x.expand(k, -1), idx, buffers["in_threshold"])
        gate, up = gate_up.chunk(2, dim=-1)
        y = decode_expert_masked(weights[1], self.act_fn(gate) * up, idx, buffers["down_threshold"])
        return (y * top_k_weights.reshape(k, 1)).sum(0, keepdim=True).to(x.dtype)

    def _routed(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """Several tokens (prefill, calibration, metering): each routed expert on its tokens, masked."""
        out = torch.zeros_like(x)
        for e in torch.unique(top_k_index).tolist():
            if e >= self.num_experts:  # transformers' expert-parallel sentinel: not this rank's expert
                continue
            token, slot = torch.where(top_k_index == e)
            h, m_in, m_h = self.expert_hidden(x[token], e)
            y = F.linear(h * m_h, self.down_proj[e]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
            self._record_expert(m_in, m_h)
        if self.meter_on:
            self._tokens += x.shape[0]
        return out

    def expert_hidden(self, x: torch.Tensor, e: int):
        """(h, input mask, h mask) of expert `e` on its tokens `x`: h = act(gate) ⊙ up of the masked input."""
        m_in = x.abs() >= self.in_threshold[e]
        gate, up = F.linear(x * m_in, self.gate_up_proj[e]).chunk(2, dim=-1)
        h = self.act_fn(gate) * up
        return h, m_in, h.abs() >= self.down_threshold[e]

    def _record_expert(self, m_in: torch.Tensor, m_h: torch.Tensor) -> None:
        """MACs spent (not active counts): 2I per kept input, H per kept neuron; tokens counted per call."""
        if self.meter_on:
            spent = 2 * self.intermediate_dim * m_in.sum(dtype=torch.float64) + self.hidden_dim * m_h.sum(dtype=torch.float64)
            self._active_sum = self._active_sum.to(spent.device) + spent

    def measured_macs(self) -> float:
        return float(self._active_sum) / self._tokens if self._tokens else float("nan")

    def mean_active(self) -> float:
        """The share of the routed experts' dense cost spent per token."""
        return self.measured_macs() / self.macs_dense

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, in={self.hidden_dim}, inter={self.intermediate_dim}, "
                f"act={self.act}")


def activation_name(fn: nn.Module) -> str:
    """The config name (one of ACTIVATIONS) of a transformers activation module, for the folder."""
    for name in ACTIVATIONS:
        if type(ACT2FN[name]) is type(fn):
            return name
    raise UserError(f"the experts' activation {type(fn).__name__} is not one rana rebuilds ({', '.join(ACTIVATIONS)})")
