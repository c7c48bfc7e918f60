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

One decode token without gradients goes through the int8 masked-GEMV entry point of the kernels
(`decode_int8` → `decode_masked_int8_held`, mode "none": the dense int8 GEMV; on CPU the native call's
operands are bound once and kept on the module until its tensors move); several tokens through F.linear with
the weight dequantized for that call. The adapters call `decode_int8` with their masks (rana.modules.common).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..kernels.ops import BOUND_CALL, DEFAULT_SPARSITY_BIN, decode_masked_int8_grouped, decode_masked_int8_held

INT8_MODES = ("none", "square", "abs_scaled", "abs")


def decode_int8(owner: nn.Module, v: torch.Tensor, threshold: torch.Tensor | None, mode: str,
                scale: torch.Tensor | None = None, sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> torch.Tensor:
    """One decode token through the int8 weights `owner` holds (its `qweight`, `weight_scale` and `bias`): the
    kernels' `decode_masked_int8_held` (native on CPU, its operands bound once per module; Triton on CUDA).
    ``threshold`` None: mode "none" (the dense int8 GEMV)."""
    buffers = owner._buffers
    return decode_masked_int8_held(owner, buffers["qweight"], buffers["weight_scale"], v, threshold, mode, scale,
                                   owner._parameters["bias"], sparsity_bin)


def drop_bound_call(module: nn.Module) -> None:
    """Forget `module`'s bound native call (its tensors moved or changed type): the next token binds anew."""
    module.__dict__.pop(BOUND_CALL, None)


def decode_int8_grouped(vs, q_ts, qscales, thresholds, mode: str, scales, biases,
                        sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> list[torch.Tensor]:
    """Up to three one-token int8 masked GEMVs of sibling projections (one int8 Triton launch where it runs):
    the kernels' `decode_masked_int8_grouped`; 1-D outputs."""
    return decode_masked_int8_grouped(vs, q_ts, qscales, thresholds, mode, scales, biases, sparsity_bin)


class Int8Linear(nn.Module):
    """nn.Linear with int8 codes (see the module docstring for the layout)."""

    _float32_buffers = ("weight_scale",)
    int8_weights = True  # its weights are int8 codes (`holds_int8`)

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
        drop_bound_call(self)
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
            return decode_int8(self, x, None, "none")
        return F.linear(x, self.dequantized(x.dtype), None if bias is None else bias.to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def is_int8(layer: nn.Module) -> bool:
    return type(layer) is Int8Linear


def holds_int8(module: nn.Module) -> bool:
    """True for a module whose weights are int8 codes (its class sets `int8_weights`: Int8Linear, the int8
    LM head): what a folder's `int8.modules` lists and a loader rebuilds as int8."""
    return getattr(type(module), "int8_weights", False) is True


__all__ = ["Int8Linear", "INT8_MODES", "decode_int8", "drop_bound_call", "decode_int8_grouped", "is_int8", "holds_int8"]
