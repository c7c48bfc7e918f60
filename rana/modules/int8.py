"""int8 weights: `Int8Linear`, a drop-in for nn.Linear holding symmetric per-output-channel int8 codes.

Storage (what a folder's safetensors hold under the module's path):

    qweight       int8 (in_features, out_features), row-major: the *transposed* codes, `qweight[k, n] = q[n, k]`,
                  so column k of W is the contiguous row `qweight[k]`, the layout the masked-GEMV kernels read
                  (an inactive input skips one contiguous int8 row)
    weight_scale  float32 (out_features,): W[n, k] ≈ weight_scale[n] · qweight[k, n]
    bias          optional Parameter in the compute dtype

`.weight` is the dequantized (out, in) weight in the compute dtype, computed on each read (for code
that reads weights: column norms, SVD, export); no full-precision copy is kept. `qweight` stays int8
and `weight_scale` float32 through `.to(dtype)` / `.half()` (only the bias and the compute dtype follow).

One decode token without gradients goes through the decode route with the layer's operand (an Int8Weight of
its codes, scales and bias, kept on the module until its tensors move or are replaced: rana.modules.operands),
mode "none": the dense int8 GEMV (on CPU the native call's operands are bound once). Several tokens go through
F.linear with the weight dequantized for that call. An adapter whose child is an Int8Linear decodes its masked
GEMV through the same operand type (registered below), with its mask.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.cpu_gemv import A8_BLOCK_MAX, A8_BLOCK_UNRECORDED, ACTIVATIONS
from ..kernels.route import decode_masked
from ..kernels.torch_gemv import quantize_activations
from ..kernels.weights import Int8Weight
from .operands import drop_operands, keep_operand, kept_operand, register_layer_weight


def int8_weight(owner: nn.Module) -> Int8Weight:
    """The operand of the int8 weights `owner` holds (an Int8Linear, the int8 LM head): its `qweight`,
    `weight_scale` and `bias`, and its activation format."""
    return Int8Weight(owner._buffers["qweight"], owner._buffers["weight_scale"], owner._parameters["bias"],
                      owner.activations, owner.activation_block)


def int8_weight_current(operand: Int8Weight, owner: nn.Module) -> bool:
    buffers = owner._buffers
    return operand.q_t is buffers["qweight"] and operand.qscale is buffers["weight_scale"] and \
        operand.bias is owner._parameters["bias"] and operand.activations == owner.activations and \
        operand.block == owner.activation_block


def quantize_input(owner: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`x` as `owner` (an int8 module) multiplies it on its torch path: unchanged for float activations, each
    token's nonzero inputs quantized per block of its `activation_block` and back (in x's dtype) for int8 ones, as
    the kernels do."""
    if owner.activations != "int8":
        return x
    return quantize_activations(x, block=owner.activation_block).to(x.dtype)


def activation_format(module: nn.Module) -> dict:
    """How an int8 module multiplies its tokens, as a folder's `int8` record says it: {"activations": "float"} or
    {"activations": "int8", "activation_block": B}."""
    if module.activations == "int8":
        return {"activations": "int8", "activation_block": int(module.activation_block)}
    return {"activations": module.activations}


def activation_format_of(model: nn.Module) -> dict | None:
    """The activation format (:func:`activation_format`) of `model`'s int8 modules (None: it holds none);
    ValueError if they differ."""
    found = {tuple(activation_format(m).items()) for m in model.modules() if holds_int8(m)}
    if len(found) > 1:
        raise ValueError(f"the int8 modules mix activation formats {sorted(dict(f) for f in found)}")
    return dict(found.pop()) if found else None


def own_int8_weight(owner: nn.Module) -> Int8Weight:
    """`owner`'s operand of its own int8 weights, kept on it (rana.modules.operands, role "own")."""
    operand = kept_operand(owner, "own")
    if operand is None or not int8_weight_current(operand, owner):
        operand = keep_operand(owner, "own", int8_weight(owner))
    return operand


class Int8Linear(nn.Module):
    """nn.Linear with int8 codes (see the module docstring for the layout)."""

    _float32_buffers = ("weight_scale",)
    int8_weights = True  # its weights are int8 codes (`holds_int8`)
    # how its tokens are multiplied: "float" (W8A16) or "int8" (W8A8, ACTIVATIONS); a folder's `int8.activations`,
    # set on load (rana.modules.rebuild.install_int8) and by `rana quantize`, never in the state dict; a kept operand
    # is checked against it (int8_weight_current)
    activations = "float"
    # int8 activations: the inputs quantized per scale (1..A8_BLOCK_MAX); a folder's `int8.activation_block`, set
    # as `activations` is; a folder that records none was written when every block held 64
    activation_block = A8_BLOCK_UNRECORDED

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, dtype: torch.dtype = torch.float32,
                 device=None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.register_buffer("qweight", torch.zeros(in_features, out_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_parameter("bias", nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
                                if bias else None)
        self.compute_dtype = dtype  # what `.weight` and a bias-less forward return; follows .to(dtype)

    @classmethod
    def from_quantized(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                       dtype: torch.dtype) -> "Int8Linear":
        """From codes q (out × in, int8) and scales (out,)."""
        out_f, in_f = q.shape
        m = cls(in_f, out_f, bias is not None, dtype=dtype, device="meta")
        m.qweight = q.detach().t().contiguous().to(torch.int8)
        m.weight_scale = scale.detach().to(torch.float32).contiguous()
        if bias is not None:
            m.bias = nn.Parameter(bias.detach().to(dtype).clone())
        return m

    @classmethod
    def empty_like(cls, layer: nn.Module) -> "Int8Linear":
        """An empty Int8Linear of `layer`'s shapes, device and dtype (weights to be loaded afterwards)."""
        w = layer.weight
        bias = getattr(layer, "bias", None)
        return cls(layer.in_features, layer.out_features, bias is not None, dtype=w.dtype, device=w.device)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized (out, in) weight in the compute dtype (a new tensor on every read)."""
        return self.dequantized(self.compute_dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The (out, in) weight in `dtype`, for one call (column-major: a view of the transposed codes)."""
        return (self.qweight.t().float() * self.weight_scale[:, None]).to(dtype)

    def _apply(self, fn, recurse=True):
        drop_operands(self)
        kept = {n: b for n in self._float32_buffers if (b := self._buffers.get(n)) is not None}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            self._buffers[name] = value.to(device=self._buffers[name].device, dtype=torch.float32)
        probe = fn(torch.empty(0, dtype=self.compute_dtype))
        if probe.is_floating_point():
            self.compute_dtype = probe.dtype
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self._parameters["bias"]
        if x.numel() == x.shape[-1] and not (torch.is_grad_enabled() and (
                x.requires_grad or (bias is not None and bias.requires_grad))):
            return decode_masked(own_int8_weight(self), x, None, "none")
        return F.linear(quantize_input(self, x), self.dequantized(x.dtype), None if bias is None else bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def is_int8(layer: nn.Module) -> bool:
    return type(layer) is Int8Linear


def holds_int8(module: nn.Module) -> bool:
    """True for a module whose weights are int8 codes (its class sets `int8_weights`: Int8Linear, the int8
    LM head): what a folder's `int8.modules` lists and a loader rebuilds as int8."""
    return getattr(type(module), "int8_weights", False) is True


register_layer_weight(Int8Linear, int8_weight, int8_weight_current)

__all__ = ["Int8Linear", "int8_weight", "int8_weight_current", "own_int8_weight", "is_int8", "holds_int8",
           "quantize_input", "activation_format", "activation_format_of", "ACTIVATIONS", "A8_BLOCK_MAX"]
