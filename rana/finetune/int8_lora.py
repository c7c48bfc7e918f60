"""LoRA on a frozen int8 base: the peft layer for `rana.modules.int8.Int8Linear` and the merge back by
requantizing.

While training, the base stays what the folder holds: int8 codes (`qweight`, in × out) and fp32 scales, no
full-precision copy resident. The forward dequantizes the weight for the call; with gradients wanted
(`_Int8Matmul`) autograd saves the int8 codes, not the dequantized matrix, and the backward dequantizes
again to pass the gradient to the input (the codes, scales and bias are frozen: no gradient of their own).
With int8 activations (W8A8) the base multiplies each token's inputs quantized per block, as it decodes; the
gradient passes straight through that rounding. The adapters `lora_A` / `lora_B` are ordinary linears in the base's
compute dtype, added on top of the base output exactly as peft's own `Linear` does.

Merging (`merge_and_unload`, the end of every run) requantizes per output channel:

    W' = dequant(q, s) + scaling · B A ,    (q', s') = quantize_int8(W')        (max-abs, no H)

Max-abs, not an activation-weighted scale: the base rows are already on the grid the calibration chose
(clipped where that paid), and `max|dequant(q, s)[n]| = 127 · s_n` (every row of `quantize_int8` reaches
the grid's end), so a row the adapter leaves (almost) unchanged keeps its scale and its codes, and the
calibrated clipping is kept; a fresh clip search would need the calibration H of the merged model's own
inputs, which a fine-tuning run does not collect. The error of the merged weight is then at most half a
step per weight, `s'_n / 2`.

Wrapped layers never reach the decode kernels with their base weight alone: an adapter decodes only through
the operand of an unwrapped `nn.Linear` / `Int8Linear` (rana.modules.operands registers those types exactly;
a peft wrapper has none), and the base layer's own one-token kernel path only computes the base output that
the LoRA term is added to.
"""
from __future__ import annotations

import warnings
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from peft.tuners.lora import LoraConfig, LoraLayer
from peft.tuners.tuners_utils import check_adapters_to_merge

from ..math.quantize import quantize_int8
from ..modules.int8 import Int8Linear, quantize_input


class _Int8Matmul(torch.autograd.Function):
    """`x @ dequant(q, s)ᵀ` whose graph keeps the int8 codes (not a dequantized copy) for the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(qweight, scale)
        ctx.x_dtype = x.dtype
        return F.linear(x, (qweight.t().float() * scale[:, None]).to(x.dtype))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if not ctx.needs_input_grad[0]:
            return None, None, None
        qweight, scale = ctx.saved_tensors
        w = (qweight.t().float() * scale[:, None]).to(grad.dtype)  # out × in
        return (grad @ w).to(ctx.x_dtype), None, None


def int8_base_forward(base: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The frozen int8 layer's output; with gradients wanted through x, by `_Int8Matmul`, on the input as the layer
    multiplies it (int8 activations: quantized per block, the gradient passed straight through the rounding), so
    training sees the numerics the model decodes with."""
    if not (torch.is_grad_enabled() and x.requires_grad):
        return base(x)
    if base.activations == "int8":
        x = x + (quantize_input(base, x.detach()) - x.detach())  # straight-through: forward quantized, grad identity
    y = _Int8Matmul.apply(x, base._buffers["qweight"], base._buffers["weight_scale"])
    bias = base._parameters["bias"]
    return y if bias is None else y + bias.to(y.dtype)


class Int8LoraLinear(nn.Module, LoraLayer):
    """peft's LoRA around an `Int8Linear` (registered with `LoraConfig._register_custom_module`)."""

    def __init__(self, base_layer: nn.Module, adapter_name: str, config: LoraConfig, r: int = 0,
                 lora_alpha: int = 1, **kwargs) -> None:
        if config.lora_bias:
            raise ValueError(f"{type(self).__name__} does not support lora_bias")
        if config.use_dora:
            raise ValueError(f"{type(self).__name__} does not support DoRA")
        super().__init__()
        LoraLayer.__init__(self, base_layer)
        self.fan_in_fan_out = False
        self._active_adapter = adapter_name
        self.update_layer(adapter_name, r, lora_alpha=lora_alpha, config=config)

    # --------------------------------------------------------------- what peft asks of the base layer
    def _get_in_out_features(self, module: nn.Module):
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer):
        # the compute dtype, without dequantizing the weight to find it (peft reads `.weight`)
        return base_layer._buffers["qweight"].device, base_layer.compute_dtype

    def resolve_lora_variant(self, *, config: LoraConfig, **kwargs):
        return None

    @property
    def weight(self) -> torch.Tensor:
        """The base's dequantized (out, in) weight, as peft's `weight` of a wrapped nn.Linear is its base
        weight (peft's own property would hand out the transposed int8 codes)."""
        return self.get_base_layer().weight

    # --------------------------------------------------------------- merge / unmerge: requantize
    def get_delta_weight(self, adapter: str) -> torch.Tensor:
        """`scaling · B A` (out × in) in float32."""
        A, B = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        return (B.float() @ A.float()) * self.scaling[adapter]

    @torch.no_grad()
    def _requantize(self, weight: torch.Tensor) -> None:
        base = self.get_base_layer()
        q, s = quantize_int8(weight)
        base._buffers["qweight"] = q.t().contiguous().to(base._buffers["qweight"].device)
        base._buffers["weight_scale"] = s.to(base._buffers["weight_scale"].device)

    @torch.no_grad()
    def merge(self, safe_merge: bool = False, adapter_names: Optional[list[str]] = None) -> None:
        adapter_names = check_adapters_to_merge(self, adapter_names)
        if not adapter_names:
            return
        base = self.get_base_layer()
        w = base.dequantized(torch.float32)
        merged = []
        for name in adapter_names:
            if name in self.lora_A.keys():
                w = w + self.get_delta_weight(name).to(w.device)
                merged.append(name)
        if not merged:
            return
        if safe_merge and not torch.isfinite(w).all():
            raise ValueError(f"NaNs detected in the merged weights; the adapter {merged} seems to be broken")
        self._requantize(w)
        self.merged_adapters.extend(merged)

    @torch.no_grad()
    def unmerge(self) -> None:
        """Subtract the merged adapters and requantize again (not exact: each requantization rounds)."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.")
            return
        base = self.get_base_layer()
        w = base.dequantized(torch.float32)
        while self.merged_adapters:
            name = self.merged_adapters.pop()
            if name in self.lora_A.keys():
                w = w - self.get_delta_weight(name).to(w.device)
        self._requantize(w)

    # --------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._check_forward_args(x, *args, **kwargs)
        kwargs.pop("adapter_names", None)
        base = self.get_base_layer()
        if self.disable_adapters:
            if self.merged:
                self.unmerge()
            return int8_base_forward(base, x)
        result = int8_base_forward(base, x)
        if self.merged:
            return result
        out_dtype = result.dtype
        for name in self.active_adapters:
            if name not in self.lora_A.keys():
                continue
            lora_A, lora_B = self.lora_A[name], self.lora_B[name]
            h = self._cast_input_dtype(x, lora_A.weight.dtype) if not torch.is_autocast_enabled() else x
            result = result + lora_B(lora_A(self.lora_dropout[name](h))) * self.scaling[name]
        return result.to(out_dtype)

    def __repr__(self) -> str:
        return "lora." + super().__repr__()


def register_int8(lora_config: LoraConfig) -> LoraConfig:
    """`lora_config` with `Int8Linear` targets wrapped by `Int8LoraLinear`."""
    lora_config._register_custom_module({Int8Linear: Int8LoraLinear})
    return lora_config


def wrapped_int8(model: nn.Module) -> list[tuple[str, Int8LoraLinear]]:
    """(name, layer) of every LoRA-wrapped int8 layer of `model`."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, Int8LoraLinear)]


__all__ = ["Int8LoraLinear", "int8_base_forward", "register_int8", "wrapped_int8"]
