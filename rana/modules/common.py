"""Pieces shared by every adapter module: column-major linears, the one-token decode gate, the sibling cache
and the MAC meter."""
from __future__ import annotations

import torch
import torch.nn as nn

# rana.kernels is the repository's top-level kernels/ folder, installed inside the package
# (pyproject.toml package-dir); exports ship both folders' files flat beside each other
from ..kernels.route import DEFAULT_SPARSITY_BIN, decode_masked, sparsity_bin
from ..kernels.weights import Weight
from .int8 import Int8Linear
from .operands import MASKED, MASKED_KEY, drop_operands, layer_weight


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
    drop_operands(module)  # its layers' tensors were replaced: their operands are made anew
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


class Adapter:
    """The base of every adapter kind: each declaration rana.modules.registry lists, with the value most kinds
    share, so that a kind declares only what differs (as peft's tuner layers take theirs from BaseTunerLayer):
    no linear children, no weights of its own, no masked-GEMV decode, not grouped, not blended by the
    self-guided start, no threshold refit, no rank code, no column norms, no int8 form of its own; after a load
    or a LoRA merge its weights are put back in their decode layouts."""

    linear_children: tuple[str, ...] = ()
    bare_weights = False
    decode_mode: str | None = None
    groupable = False
    self_guided: str | None = None
    refit: str | None = None
    rank_code = False
    norms_child: str | None = None
    int8_form = None

    def restore(self, root: nn.Module) -> None:
        """Its weights were replaced (a load, a LoRA merge): their decode layouts again."""
        restore_layouts(self)


class MaskedDecode:
    """The decode gate every masked adapter shares, written once.

    In eval mode with its meter off, one token without gradients goes through the adapter's sibling group (one
    grouped launch, `rana.modules.groups`) or the decode route (rana.kernels.route) with the operand of the
    layer it masks (`decode_weight`: kept on the module, rana.modules.operands) and the kind's own mask mode
    (`decode_mode`, declared once per class); training, metering, several tokens, gradients and a peft-wrapped
    child take the module's torch path (the calls return None). A module whose meter lives elsewhere (a q/k/v
    slice: its shared code's) passes it as `meter`. Moving the module (`.to()`) drops its operands, so their
    backend is chosen again for where the tensors now are.
    """

    decode_mode: str | None  # its kind's mask mode (rana.modules.registry)
    _decode_group = None  # the sibling group (rana.modules.groups.DecodeGroup) this adapter decodes in, and its slot
    _decode_slot: int = 0

    def decode_open(self, meter=None) -> bool:
        """The gate: eval mode and the meter off (a metered token must run the torch path that counts it)."""
        return not self.training and not (self if meter is None else meter).meter_on

    def decode_weight(self, layer: nn.Module) -> Weight | None:
        """The operand of `layer`, the matrix this adapter's mask selects rows of (None: a peft wrapper), kept
        on this module under the role MASKED (rana.modules.operands). A kind decoding its own weights overrides
        this (and keeps them under another role)."""
        return layer_weight(self, MASKED, layer)

    # the two below run per projection per token: `decode_open` is spelled out in them (no extra call)
    def decode_grouped(self, x: torch.Tensor, meter=None) -> torch.Tensor | None:
        """This adapter's output for `x` from its sibling group's one launch, or None."""
        group = self._decode_group
        if group is None or self.training or (self if meter is None else meter).meter_on:
            return None
        return group.decode(x, self._decode_slot)

    def decode_masked(self, layer: nn.Module, v: torch.Tensor, threshold: torch.Tensor,
                      scale: torch.Tensor | None = None, meter=None) -> torch.Tensor | None:
        """`layer(m ⊙ v)` for one decode token through the decode route, or None (the torch path).

        None for several tokens (prefill, batch > 1: the dense masked product is faster there), for a
        peft-wrapped layer (so LoRA is never skipped) and when gradients are wanted (the kernels have no
        backward). Eagerly this is the native CPU kernel / Triton launch itself; under torch.compile the
        registered ops (rana.kernels.ops), so the decode step traces without a graph break. Adapters pass
        `self._modules[...]` / `self._buffers[...]`: this runs per projection per token, and
        Module.__getattr__ costs ~0.6 µs. The sparsity bin (the Triton tuning key, a constant under compile)
        is the meter's `decode_bin`."""
        meter = self if meter is None else meter
        if self.training or meter.meter_on or v.numel() != v.shape[-1]:
            return None
        w = None
        if not torch.compiler.is_compiling():  # decode_weight's check of a kept operand, spelled out
            hit = self.__dict__.get(MASKED_KEY)
            if hit is not None and hit[0] is layer and hit[1] is not None and hit[2](hit[1], layer):
                w = hit[1]
        if w is None:
            w = self.decode_weight(layer)
            if w is None:
                return None
        if torch.is_grad_enabled() and (v.requires_grad or w.requires_grad):
            return None
        return decode_masked(w, v, threshold, self.decode_mode, scale, meter.decode_bin)

    def _apply(self, fn, recurse=True):
        drop_operands(self)  # moved or cast: the operands' backend is chosen again
        return super()._apply(fn, recurse)


class ByInput:
    """A result computed once for one input tensor and handed to the `consumers` callers that share it (q/k/v,
    gate/up, a shared rank code's slices), kept by the input's identity until the last took its own. A call
    with another tensor starts anew: results are never mixed up, at worst computed twice."""

    __slots__ = ("_input", "_value", "_left")

    def __init__(self):
        self._input = self._value = None
        self._left = 0

    def get(self, x: torch.Tensor):
        """The result kept for `x` (counted as taken), or None."""
        if self._input is not x:
            return None
        value = self._value
        self._left -= 1
        if self._left <= 0:
            self.clear()
        return value

    def put(self, x: torch.Tensor, value, consumers: int):
        """Keep `value` for the other `consumers - 1` callers of `x`; returns it (taken once)."""
        if consumers > 1:
            self._input, self._value, self._left = x, value, consumers - 1
        else:
            self.clear()
        return value

    def clear(self) -> None:
        self._input = self._value = None
        self._left = 0

    def __bool__(self) -> bool:
        return self._input is not None


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
