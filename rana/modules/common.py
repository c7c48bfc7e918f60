"""Pieces shared by every adapter module: column-major linears, the one-token decode gate and the MAC meter."""
from __future__ import annotations

import torch
import torch.nn as nn

# rana.kernels is the repository's top-level kernels/ folder, installed inside the package
# (pyproject.toml package-dir); exports ship both folders' files flat beside each other
from ..kernels.ops import DEFAULT_SPARSITY_BIN, decode_masked_linear, sparsity_bin
from .int8 import Int8Linear, decode_int8


def column_major_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An ordinary nn.Linear whose weight (o × i) is stored transposed (i × o row-major).

    Each *column* of W is then contiguous, the layout the masked-GEMV kernels read (skipping an
    inactive rank/neuron skips one contiguous row of `weight.t()`). F.linear, peft and
    load_state_dict all work unchanged: copy_ keeps the destination strides.
    """
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    storage = weight.detach().t().contiguous()
    layer.weight = nn.Parameter(storage.t())
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone())
    return layer


def row_major_linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An ordinary nn.Linear holding a contiguous copy of `weight` (o × i, row-major): the layout of a
    matrix that is always read whole (the rank adapters' B), which cuBLAS and the grouped dense GEMV
    read as one contiguous stream per output."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach().contiguous().clone())
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone())
    return layer


def restore_layouts(module: nn.Module) -> None:
    """Put an adapter's weights back in the layouts its decode path reads: the linear children its kind
    declares (`linear_children`, rana.modules.registry) column-major, those named in `row_major_children`
    row-major, int8 codes row-major, and stacked expert weights (its own 3-D [E, out, in] parameters)
    input-major. (A loader or a LoRA merge may hand back either.) An input-sparse LM head's own weight
    is left to its kind's `restore`, which knows whether it is tied (`InputSparseHead.column_major_`)."""
    row_major = getattr(module, "row_major_children", ())
    children = module._modules
    for name in module.linear_children:
        child = children.get(name)
        if type(child) is Int8Linear:  # int8 codes: always the transposed (in × out) row-major layout
            q = child._buffers["qweight"]
            if q.device.type != "meta" and not q.is_contiguous():
                child._buffers["qweight"] = q.contiguous()
            continue
        if type(child) is not nn.Linear:
            continue
        w = child.weight  # .data keeps the Parameter (and anything holding it)
        if name in row_major:
            if not w.is_contiguous():
                w.data = w.data.contiguous()
        elif not w.t().is_contiguous():
            w.data = w.data.t().contiguous().t()
    _input_major_stacks(module)


def _input_major_stacks(module: nn.Module) -> None:
    """`module`'s own 3-D parameters (InputSparseExperts' gate_up_proj / down_proj, [E, out, in]) stored as
    contiguous [E, in, out]: the expert-indexed masked GEMV skips one contiguous row per inactive input."""
    for p in module._parameters.values():
        if p is not None and p.dim() == 3 and p.device.type != "meta" and not p.transpose(1, 2).is_contiguous():
            p.data = p.data.transpose(1, 2).contiguous().transpose(1, 2)


class MaskedDecode:
    """The decode gate every masked adapter shares, written once.

    In eval mode with its meter off, one token goes through the adapter's sibling group (one grouped
    launch, `rana.modules.groups`) or the masked-GEMV kernels (`decode_linear`), with the kind's own
    mask mode (`decode_mode`, declared once per class); training, metering, several tokens, gradients
    and a peft-wrapped child take the module's torch path (the calls return None). A module whose meter
    lives elsewhere (a q/k/v slice: its shared code's) passes it as `meter`.
    """

    decode_mode: str | None  # declared by every adapter kind (rana.modules.registry)
    _decode_group = None  # the sibling group (rana.modules.groups.DecodeGroup) this adapter decodes in, and its slot
    _decode_slot: int = 0

    def decode_open(self, meter=None) -> bool:
        """The gate: eval mode and the meter off (a metered token must run the torch path that counts it)."""
        return not self.training and not (self if meter is None else meter).meter_on

    # the two below run per projection per token: `decode_open` is spelled out in them (no extra call)
    def decode_grouped(self, x: torch.Tensor) -> torch.Tensor | None:
        """This adapter's output for `x` from its sibling group's one launch, or None."""
        group = self._decode_group
        if group is None or self.training or self.meter_on:
            return None
        return group.decode(x, self._decode_slot)

    def decode_masked(self, layer: nn.Module, v: torch.Tensor, threshold: torch.Tensor,
                      scale: torch.Tensor | None = None, meter=None) -> torch.Tensor | None:
        """`layer(m ⊙ v)` for one decode token through the masked-GEMV kernels, or None (`decode_linear`)."""
        meter = self if meter is None else meter
        if self.training or meter.meter_on:
            return None
        return decode_linear(layer, v, threshold, self.decode_mode, scale, meter.decode_bin)


def decode_linear(layer: nn.Module, x: torch.Tensor, threshold: torch.Tensor, mode: str,
                  scale: torch.Tensor | None = None, sparsity_bin: int = DEFAULT_SPARSITY_BIN) -> torch.Tensor | None:
    """`layer(m ⊙ x)` for one decode token through the masked-GEMV ops, or None (use the torch path).

    None for several tokens (prefill, batch > 1: the dense masked product is faster there), for a
    peft-wrapped layer (so LoRA is never skipped) and when gradients are wanted (the ops have no
    backward). Eagerly this is the native CPU kernel / Triton launch itself; under torch.compile the
    registered ops (kernels/ops.py), so the decode step traces without a graph break. The adapters call
    it through `MaskedDecode.decode_masked` (which checks training and the meter first) and pass
    `self._modules[...]` / `self._buffers[...]`: this runs per projection per token, and
    Module.__getattr__ costs ~0.6 µs.
    `sparsity_bin` (a Python int: a Triton tuning key, constant under compile) is the module's
    `decode_bin`. An Int8Linear child (int8 weights, rana.modules.int8) takes the int8 masked GEMV.
    """
    if type(layer) is not nn.Linear or x.numel() != x.shape[-1]:
        if type(layer) is Int8Linear and x.numel() == x.shape[-1]:
            bias = layer._parameters["bias"]
            if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
                return None
            return decode_int8(layer, x, threshold, mode, scale, sparsity_bin)
        return None
    params = layer._parameters
    weight = params["weight"]
    if torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad):
        return None
    return decode_masked_linear(weight, x, threshold, mode, scale, params["bias"], sparsity_bin)


def decode_weight(layer: nn.Module):
    """A plain child's weight operand in a grouped decode launch: `w_t` (K × N) of an nn.Linear, `(q_t, qscale)`
    of an Int8Linear (int8 codes K × N, fp32 scales), None for anything else (a peft wrapper: LoRA must run)."""
    kind = type(layer)
    if kind is nn.Linear:
        return layer._parameters["weight"].t()
    if kind is Int8Linear:
        buffers = layer._buffers
        return buffers["qweight"], buffers["weight_scale"]
    return None


class MacMeter:
    """Counts, while switched on, how many ranks / neurons / inputs a module really used.

    `macs_dense` is what the replaced dense computation costs per token; `measured_macs()`
    is what this module spent per token on the tokens seen since the last reset.

    Listed before nn.Module in the adapters' bases so that its `_apply` runs: thresholds (and
    the column norms they are compared with) stay float32 when the model is cast with
    `model.to(torch.bfloat16)` / `.half()`; a threshold rounded to bf16 would move every mask.
    """

    macs_dense: float = 0.0
    _float32_buffers = ("threshold", "column_norms")
    # The expected fraction of ranks / inputs a decode token keeps (from the plan's expected_active),
    # None when unknown; `decode_bin` is its sparsity bin, the Triton kernels' tuning key, kept as a
    # plain int so it is a constant under torch.compile. Set both with `set_active_fraction`.
    active_fraction: float | None = None
    decode_bin: int = DEFAULT_SPARSITY_BIN

    def set_active_fraction(self, fraction: float | None) -> None:
        if fraction is None or not 0.0 <= float(fraction) <= 1.0:
            self.active_fraction, self.decode_bin = None, DEFAULT_SPARSITY_BIN
        else:
            self.active_fraction, self.decode_bin = float(fraction), sparsity_bin(fraction)

    def _apply(self, fn, recurse=True):
        kept = {n: b for n in self._float32_buffers if (b := self._buffers.get(n)) is not None}
        super()._apply(fn, recurse)
        for name, value in kept.items():
            self._buffers[name] = value.to(device=self._buffers[name].device, dtype=torch.float32)
        return self

    def _init_meter(self) -> None:
        self.meter_on = False
        self.reset_meter()

    def reset_meter(self) -> None:
        self._active_sum = torch.zeros((), dtype=torch.float64)
        self._tokens = 0

    def _record(self, mask: torch.Tensor) -> None:
        if self.meter_on:
            self._active_sum = self._active_sum.to(mask.device) + mask.sum(dtype=torch.float64)
            self._tokens += mask.numel() // max(mask.shape[-1], 1)

    def mean_active(self) -> float:
        return float(self._active_sum) / self._tokens if self._tokens else float("nan")

    def measured_macs(self) -> float:  # pragma: no cover - overridden
        raise NotImplementedError
