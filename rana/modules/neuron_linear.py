"""Input-masked linears: neuron thresholding for down projections, magnitude sparsity (TEAL), and the
LM head with magnitude sparsity on its input."""
from __future__ import annotations

import torch
import torch.nn as nn

from ..kernels.weights import FloatWeight
from .common import Adapter, MacMeter, MaskedDecode, column_major_linear, restore_layouts
from .int8 import Int8Linear, own_int8_weight, quantize_input
from .operands import keep_operand, kept_operand
from .registry import register_adapter


class ThresholdedLinearSpec:
    """What an adapter that is one thresholded `linear` declares alike (its `spec_type` and the rest are the
    class's own): the rana_config.json entry (in, out, bias, threshold, and the empty module of those
    shapes), its linear child, its threshold refit on its own input (|x|); no int8 form of its own (its child
    is quantized: the Adapter default)."""

    spec_fields = {"in": "size", "out": "size", "bias": "flag", "threshold": "threshold"}
    linear_children = ("linear",)
    refit = "own"

    def to_spec(self, root: nn.Module) -> dict:
        return {"in": self.in_features, "out": self.out_features, "bias": self.linear.bias is not None,
                "threshold": float(self.threshold)}

    @classmethod
    def from_spec(cls, s: dict, zeros, threshold: float, **_):
        return cls(zeros(s["out"], s["in"]), zeros(s["out"]) if s["bias"] else None, threshold)

    def unmasked(self, x: torch.Tensor) -> torch.Tensor:
        """Its own weight without the mask (the self-guided start's dense path)."""
        return self.linear(x)

    def mask_width(self) -> int:
        return self.in_features

    def refit_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().abs()


@register_adapter
class NeuronThresholdLinear(ThresholdedLinearSpec, MaskedDecode, MacMeter, Adapter, nn.Module):
    """`W (m ⊙ h)` with `m_i = 1{|h_i|·‖W[:, i]‖ ≥ t}` (RaNA's down projection, Eq. 12)."""

    spec_type = "neuron"
    decode_mode = "abs_scaled"
    groupable = True
    self_guided = "unmasked"
    norms_child = "linear"  # the mask reads ‖W[:, i]‖: refreshed whenever W changes

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float):
        super().__init__()
        self.linear = column_major_linear(weight, bias)
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.register_buffer("column_norms", torch.zeros(weight.shape[1], dtype=torch.float32))
        self.refresh_norms()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.macs_dense = float(self.in_features * self.out_features)
        self._init_meter()

    @torch.no_grad()
    def refresh_norms(self, weight: torch.Tensor | None = None) -> None:
        """Recompute ‖W[:, i]‖ (after LoRA merges or weight loading), in fp32 from the weights multiplied
        with (an int8 child's dequantized in fp32, not in the compute dtype: a bf16 load gets the norms a
        float32 load gets). `weight`: the (out, in) weight to take them from instead (while LoRA trains:
        the effective `W + ΔW`)."""
        if weight is None:
            linear = self.linear
            weight = linear.dequantized(torch.float32) if hasattr(linear, "dequantized") else linear.weight.float()
        self.column_norms.copy_(weight.float().norm(dim=0))

    def restore(self, root: nn.Module) -> None:
        restore_layouts(self)
        self.refresh_norms()

    def refit_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().abs() * self.column_norms

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        y = self.decode_grouped(h)
        if y is None:
            y = self.decode_masked(self._modules["linear"], h, self._buffers["threshold"], self._buffers["column_norms"])
        if y is not None:
            return y
        mask = h.abs() * self.column_norms >= self.threshold
        self._record(mask)
        return self.linear(h * mask)

    def decode_operands(self, h: torch.Tensor, code=None):
        """(input, its linear's operand, threshold, scale) in a grouped decode launch, or None (peft-wrapped)."""
        weight = self.decode_weight(self._modules["linear"])
        if weight is None:
            return None
        return h, weight, self._buffers["threshold"], self._buffers["column_norms"]

    def measured_macs(self) -> float:
        return self.out_features * self.mean_active()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, threshold={float(self.threshold):.4g}"


@register_adapter
class InputSparseLinear(ThresholdedLinearSpec, MaskedDecode, MacMeter, Adapter, nn.Module):
    """`W (m ⊙ x)` with `m_j = 1{|x_j| ≥ t}`: TEAL's training-free magnitude sparsity."""

    spec_type = "input_sparse"
    decode_mode = "abs"
    groupable = True
    self_guided = "unmasked"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float):
        super().__init__()
        self.linear = column_major_linear(weight, bias)
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.macs_dense = float(self.in_features * self.out_features)
        self._init_meter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.decode_grouped(x)
        if y is None:
            y = self.decode_masked(self._modules["linear"], x, self._buffers["threshold"])
        if y is not None:
            return y
        mask = x.abs() >= self.threshold
        self._record(mask)
        return self.linear(x * mask)

    def decode_operands(self, x: torch.Tensor, code=None):
        """(input, its linear's operand, threshold, scale) in a grouped decode launch, or None (peft-wrapped)."""
        weight = self.decode_weight(self._modules["linear"])
        if weight is None:
            return None
        return x, weight, self._buffers["threshold"], None

    def measured_macs(self) -> float:
        return self.out_features * self.mean_active()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, threshold={float(self.threshold):.4g}"


@register_adapter
class SparseLowRankLinear(MaskedDecode, MacMeter, Adapter, nn.Module):
    """`W (m ⊙ x) + A B ((1 − m) ⊙ x)` with `m_j = 1{|x_j| ≥ t}` (R-Sparse).

    The inputs kept by the magnitude mask go through the full weight; the ones it drops are not
    lost but go through a rank-r approximation `A B ≈ W` (children `side_in`: B, i → r, and
    `side_out`: A, r → o). With nothing dropped the side path adds exactly zero; its cost
    `r·(i + o)` is paid on every token (B is applied to the whole complement, not gathered).
    """

    spec_type = "sparse_lowrank"
    # rank: the side path's (0 would be plain magnitude sparsity; counted, not refused)
    spec_fields = {"in": "size", "out": "size", "rank": "count", "bias": "flag", "threshold": "threshold"}
    linear_children = ("linear", "side_in", "side_out")  # LoRA skips a rank-0 side path's empty linears
    decode_mode = "abs"  # (not groupable: the side path runs beside the masked GEMV)
    refit = "own"  # (not blended by the self-guided start: no dense twin, the side path approximates what the
    #                mask drops)

    def to_spec(self, root: nn.Module) -> dict:
        return {"in": self.in_features, "out": self.out_features, "rank": self.rank,
                "bias": self.linear.bias is not None, "threshold": float(self.threshold)}

    @classmethod
    def from_spec(cls, s: dict, zeros, threshold: float, **_) -> "SparseLowRankLinear":
        return cls(zeros(s["out"], s["in"]), zeros(s["out"]) if s["bias"] else None, threshold,
                   zeros(s["out"], s["rank"]), zeros(s["rank"], s["in"]))

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float,
                 A: torch.Tensor, B: torch.Tensor):
        super().__init__()
        self.linear = column_major_linear(weight, bias)
        self.side_in = column_major_linear(B)
        self.side_out = column_major_linear(A)
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.in_features, self.out_features, self.rank = weight.shape[1], weight.shape[0], B.shape[0]
        self.macs_dense = float(self.in_features * self.out_features)
        self._init_meter()

    def mask_width(self) -> int:
        return self.in_features

    def refit_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().abs()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = x.abs() >= self.threshold
        kept = x * mask
        side = self.side_out(self.side_in(x - kept)) if self.rank else 0
        y = self.decode_masked(self._modules["linear"], x, self._buffers["threshold"])
        if y is not None:
            return y + side
        self._record(mask)
        return self.linear(kept) + side

    def measured_macs(self) -> float:
        return self.out_features * self.mean_active() + self.rank * (self.in_features + self.out_features)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, rank={self.rank}, "
                f"threshold={float(self.threshold):.4g}")


@register_adapter
class InputSparseHead(MaskedDecode, MacMeter, Adapter, nn.Module):
    """The LM head as input sparsity: `W (m ⊙ x)`, `m_j = 1{|x_j| ≥ t}` on the final normed hidden state.

    Unlike InputSparseLinear, the weight is this module's own `weight` parameter (not a child
    linear's), so `lm_head.weight` keeps its name: transformers' `tie_weights()` shares it with the
    input embedding as it does for the dense head, and checkpoints hold a tied matrix once. Given a
    Parameter (a tied head's), the module keeps that very Parameter, in the embedding's row-major
    layout (transformers' `save_pretrained` cannot handle a shared tensor stored otherwise); a
    weight of its own is stored column-major, so that one decode token's masked GEMV skips one
    contiguous row of `weight.t()` per inactive input. A row-major (tied) head decodes one CPU token
    through a column-major copy of its weight (`decode_copy`, made on the first decode token, never
    saved; the head's size once more in memory); with `decode_copy = False`, under torch.compile and
    on other devices it decodes with the masked dense product: the same FLOPs counted, no kernel.
    """

    spec_type = "input_sparse_head"
    # "head_threshold": +inf would mask every input (each logit its bias); `tied`: the weight is the
    # input embedding's, stored once under the embedding's key (absent from older folders)
    spec_fields = {"in": "size", "out": "size", "bias": "flag", "threshold": "head_threshold", "tied": "flag"}
    spec_defaults = {"tied": False}
    bare_weights = True  # its own `weight` (maybe the embedding's): LoRA cannot wrap it, --full trains it
    decode_mode = "abs"
    refit = "own"

    def to_spec(self, root: nn.Module) -> dict:
        embeddings = root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
        return {"in": self.in_features, "out": self.out_features, "bias": self.bias is not None,
                "threshold": float(self.threshold), "tied": self.weight is getattr(embeddings, "weight", None)}

    @classmethod
    def from_spec(cls, s: dict, zeros, threshold: float, **_) -> "InputSparseHead":
        # a tied weight is the embedding's again after tie_weights()
        return cls(zeros(s["out"], s["in"]), zeros(s["out"]) if s["bias"] else None, threshold)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, threshold: float):
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight.detach().t().contiguous().t())
        self.register_parameter("bias", None if bias is None else nn.Parameter(bias.detach().clone()))
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.in_features, self.out_features = self.weight.shape[1], self.weight.shape[0]
        self.macs_dense = float(self.in_features * self.out_features)
        self._init_meter()

    @torch.no_grad()
    def column_major_(self) -> "InputSparseHead":
        """Store an untied weight column-major again (after a loader replaced it by a row-major tensor)."""
        w = self._parameters["weight"]
        if w.device.type != "meta" and not w.t().is_contiguous():
            w.data = w.data.t().contiguous().t()
        return self

    def restore(self, root: nn.Module) -> None:
        """An untied weight column-major again; a tied one is the embedding's Parameter and stays row-major
        (the embedding's layout, the only one save_pretrained stores a shared tensor in); an int8 head's
        codes are buffers (own weight: None), made contiguous again."""
        embeddings = root.get_input_embeddings() if hasattr(root, "get_input_embeddings") else None
        own = self._parameters.get("weight")
        if own is None or own is not getattr(embeddings, "weight", None):
            self.column_major_()

    def int8_form(self, q: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> "Int8InputSparseHead":
        """This head with int8 weights: codes q (out × in) and scales, or empty (weights loaded afterwards)."""
        return Int8InputSparseHead.from_head(self, q, scale)

    def mask_width(self) -> int:
        return self.in_features

    def refit_scores(self, x: torch.Tensor) -> torch.Tensor:
        return x.float().abs()

    # A tied (row-major) weight decodes on CPU through a column-major copy of it, made on the first decode token and
    # remade when the weight changes (a plain attribute: not in the state dict, not saved). It costs the head's
    # size once more in memory and saves reading the masked-out inputs' share of the head on every token (the
    # head is a fifth of SmolLM2-135M); False: the masked dense product, no copy.
    decode_copy: bool = True
    _decode_t: tuple | None = None

    def _column_major_weight(self, w: torch.Tensor) -> torch.Tensor | None:
        """`w` (N × K) with `w.t()` contiguous: w itself in that layout, else the decode copy (None when off)."""
        if w.t().is_contiguous():
            return w
        if not self.decode_copy or not w.is_cpu or torch.compiler.is_compiling():
            return None
        key = (w.data_ptr(), w._version, w.dtype, w.device, tuple(w.shape))
        cached = self._decode_t
        if cached is None or cached[0] != key:
            with torch.no_grad():
                copy = w.detach().t().contiguous().t()
            self._decode_t = cached = (key, copy)
        return cached[1]

    def decode_weight(self, layer: nn.Module) -> FloatWeight | None:
        """The operand of its own weight (`layer` is the head itself): the weight when it is column-major, else
        the decode copy of a tied head; None when there is neither, or when the weight wants gradients (the
        copy would not carry them)."""
        w = self._parameters["weight"]
        if torch.is_grad_enabled() and w.requires_grad:
            return None
        weight = self._column_major_weight(w)  # the masked GEMV reads weight.t() row by row
        if weight is None:
            return None
        bias = self._parameters["bias"]
        operand = kept_operand(self, "own")
        if operand is None or operand.weight is not weight or operand.bias is not bias:
            operand = keep_operand(self, "own", FloatWeight(weight, bias))
        return operand

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.decode_masked(self, x, self._buffers["threshold"])
        if y is not None:
            return y
        mask = x.abs() >= self.threshold
        self._record(mask)
        return nn.functional.linear(x * mask, self.weight, self.bias)

    def measured_macs(self) -> float:
        return self.out_features * self.mean_active()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, threshold={float(self.threshold):.4g}"


class Int8InputSparseHead(InputSparseHead):
    """The input-sparse LM head with int8 weights: the buffers of an Int8Linear held by the head itself
    (`qweight` int8 in × out row-major, `weight_scale` float32 (out,), optional `bias`), so one decode token
    reads only the int8 rows of the kept inputs. Written to rana_config.json as an InputSparseHead (never
    tied: the input embedding keeps its full-precision matrix for lookups); the folder's `int8` list
    says that its weights are int8 (`rana.modules.rebuild.install_int8`)."""

    _float32_buffers = ("threshold", "weight_scale")
    int8_weights = True  # its weights are int8 codes (rana.modules.int8.holds_int8)
    activations = "float"  # "int8": its tokens quantized as Int8Linear's are (Int8Linear.activations)
    activation_block = Int8Linear.activation_block

    def __init__(self, in_features: int, out_features: int, bias: bool, threshold: float, *,
                 dtype: torch.dtype = torch.float32, device=None):
        nn.Module.__init__(self)
        self.register_buffer("qweight", torch.zeros(in_features, out_features, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=device))
        self.register_parameter("bias", nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device))
                                if bias else None)
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32, device=device))
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.macs_dense = float(self.in_features * self.out_features)
        self.compute_dtype = dtype
        self._init_meter()

    @classmethod
    def from_head(cls, head: InputSparseHead, q: torch.Tensor | None = None,
                  scale: torch.Tensor | None = None) -> "Int8InputSparseHead":
        """`head` with int8 weights: codes q (out × in) and scales, or empty ones (weights loaded afterwards)."""
        ref = head.bias if head.bias is not None else head.threshold
        dtype = head.weight.dtype if not isinstance(head, Int8InputSparseHead) else head.compute_dtype
        m = cls(head.in_features, head.out_features, head.bias is not None, 0.0, dtype=dtype, device=ref.device)
        m.threshold = head.threshold.detach().clone()  # (on the meta device while a quantizer builds the model)
        if q is not None:
            m.qweight = q.detach().t().contiguous().to(torch.int8)
            m.weight_scale = scale.detach().to(torch.float32).contiguous()
        if head.bias is not None and head.bias.device.type != "meta":
            m.bias.data.copy_(head.bias.detach())
        m.set_active_fraction(head.active_fraction)
        return m

    def to_spec(self, root: nn.Module) -> dict:
        return {"in": self.in_features, "out": self.out_features, "bias": self.bias is not None,
                "threshold": float(self.threshold), "tied": False}

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized (out, in) weight in the compute dtype (a new tensor on every read)."""
        return (self.qweight.t().float() * self.weight_scale[:, None]).to(self.compute_dtype)

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)  # (drops its operand: MaskedDecode)
        probe = fn(torch.empty(0, dtype=self.compute_dtype))
        if probe.is_floating_point():
            self.compute_dtype = probe.dtype
        return self

    def column_major_(self) -> "Int8InputSparseHead":
        q = self._buffers["qweight"]
        if q.device.type != "meta" and not q.is_contiguous():
            self._buffers["qweight"] = q.contiguous()
        return self

    def decode_weight(self, layer: nn.Module):
        """The operand of its own int8 weights (`layer` is the head itself)."""
        return own_int8_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.decode_masked(self, x, self._buffers["threshold"])
        if y is not None:
            return y
        bias = self._parameters["bias"]
        mask = x.abs() >= self.threshold
        self._record(mask)
        w = (self.qweight.t().float() * self.weight_scale[:, None]).to(x.dtype)
        return nn.functional.linear(quantize_input(self, x * mask), w, None if bias is None else bias.to(x.dtype))

    def extra_repr(self) -> str:
        return super().extra_repr() + ", int8"
