"""Linear-layer rank adapters: `y = A (m(z) ⊙ z)`, `z = B x`, B-masker `m_j = 1{z_j² ≥ t}`.

`RankAdapterLinear` replaces one linear (up, gate, or a fused qkv). For separate q/k/v, which
share their input and are adapted as one stacked matrix, `SharedRankCode` computes the masked
code once per input and each of q/k/v becomes a `RankSliceLinear` holding its rows of A.
"""
from __future__ import annotations

import math
import weakref

import torch
import torch.nn as nn

from .common import Adapter, ByInput, MacMeter, MaskedDecode, column_major_linear, row_major_linear
from .groups import MAX_GROUP, DecodeGroup
from .int8 import Int8Linear
from .operands import layer_weight
from .registry import register_adapter


class RankCode:
    """What the two kinds computing a rank code ``z = B x`` (B row-major, the mask on ``z²``) share: the mask
    `rana quantize` refits."""

    def mask_width(self) -> int:
        return self.rank

    def refit_scores(self, x: torch.Tensor) -> torch.Tensor:
        return self.B(x).float().pow(2)


@register_adapter
class RankAdapterLinear(RankCode, MaskedDecode, MacMeter, Adapter, nn.Module):
    """Drop-in for an nn.Linear: children `B` (i → r) and `A` (r → o, carries the bias).

    B is read whole every token (row-major, nn.Linear's own layout); A is read by kept rank only
    (column-major, so a kept rank is one contiguous row of `A.weight.t()`)."""

    # what it declares as an adapter kind (rana.modules.registry: the entry in rana_config.json and the rest)
    spec_type = "rank"
    spec_fields = {"in": "size", "out": "size", "rank": "size", "bias": "flag", "threshold": "threshold"}
    linear_children = ("B", "A")
    row_major_children = ("B",)
    decode_mode = "square"
    groupable = True
    self_guided = "dense"  # blended with the original dense weight of the projection it replaced
    refit = "own"
    rank_code = True

    def to_spec(self, root: nn.Module) -> dict:
        return {"in": self.in_features, "out": self.out_features, "rank": self.rank,
                "bias": self.A.bias is not None, "threshold": float(self.threshold)}

    @classmethod
    def from_spec(cls, s: dict, zeros, threshold: float, **_) -> "RankAdapterLinear":
        return cls(zeros(s["out"], s["rank"]), zeros(s["rank"], s["in"]), zeros(s["out"]) if s["bias"] else None,
                   threshold)

    def __init__(self, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None, threshold: float):
        super().__init__()
        self.B = row_major_linear(B)
        self.A = column_major_linear(A, bias)
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.in_features, self.out_features, self.rank = B.shape[1], A.shape[0], B.shape[0]
        self.macs_dense = float(self.in_features * self.out_features)
        self._init_meter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.decode_grouped(x)
        if y is not None:
            return y
        z = self.B(x)
        y = self.decode_masked(self._modules["A"], z, self._buffers["threshold"])
        if y is not None:
            return y
        mask = z * z >= self.threshold
        self._record(mask)
        return self.A(z * mask)

    def decode_operands(self, x: torch.Tensor, code: torch.Tensor | None = None):
        """(code z = B x, A's operand, threshold, scale) in a grouped decode launch, or None (peft-wrapped).
        `code`: z already computed (the group's one launch for all its members' B)."""
        B = self._modules["B"]
        weight = self.decode_weight(self._modules["A"])
        if weight is None or type(B) not in (nn.Linear, Int8Linear):
            return None
        return B(x) if code is None else code, weight, self._buffers["threshold"], None

    def code_weight(self):
        """B's operand when a grouped launch may compute this adapter's code (a plain, unwrapped, bias-free B)."""
        B = self._modules["B"]
        if type(B) is not nn.Linear or B._parameters["bias"] is not None:
            return None
        return layer_weight(self, "code", B)

    def measured_macs(self) -> float:
        return self.rank * self.in_features + self.out_features * self.mean_active()

    def extra_repr(self) -> str:
        t = float(self.threshold)
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, threshold={t:.4g}" + (
            " (static)" if t == -math.inf else "")


@register_adapter
class SharedRankCode(RankCode, MacMeter, Adapter, nn.Module):
    """B and its masker for stacked q/k/v: computes `m ⊙ (B x)` once per input tensor.

    The three projections are called with the *same* tensor in every supported attention
    forward, so the code is kept by identity and dropped after its last consumer (`ByInput`). For one decode
    token its consumers decode in one sibling group (rana.modules.groups.DecodeGroup, made once they are all
    linked): the first computes `B x` once and all of q/k/v in one grouped masked-GEMV call, and the others
    take their slice of it.
    """

    spec_type = "shared_code"
    spec_fields = {"in": "size", "out": "size", "rank": "size", "consumers": "size", "threshold": "threshold"}
    linear_children = ("B",)
    row_major_children = ("B",)
    decode_mode = "square"  # its consumers' A in one grouped launch (their DecodeGroup; not groupable itself)
    refit = "shared"  # never called itself: scored on its slices' input (its slices are blended, not it)
    rank_code = True

    def to_spec(self, root: nn.Module) -> dict:
        return {"in": self.in_features, "out": self.out_features, "rank": self.rank, "consumers": self.consumers,
                "threshold": float(self.threshold)}

    @classmethod
    def from_spec(cls, s: dict, zeros, threshold: float, **_) -> "SharedRankCode":
        return cls(zeros(s["rank"], s["in"]), threshold, s["out"], s["consumers"])

    def __init__(self, B: torch.Tensor, threshold: float, out_features: int, consumers: int = 3):
        super().__init__()
        self.B = row_major_linear(B)
        self.register_buffer("threshold", torch.tensor(float(threshold), dtype=torch.float32))
        self.in_features, self.rank, self.out_features = B.shape[1], B.shape[0], out_features
        self.consumers = consumers
        self.macs_dense = float(self.in_features * out_features)
        self._kept = ByInput()  # (z, mask) of the current input, for the consumers' torch path
        self._slices: list = []  # weak references to the consumers, in link order (q, k, v)
        self._init_meter()

    def code(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(z, mask) for x, computed once for the `consumers` projections that share x."""
        kept = self._kept.get(x)
        if kept is not None:
            return kept
        z = self.B(x)
        mask = z * z >= self.threshold
        self._record(mask)
        return self._kept.put(x, (z, mask), self.consumers)

    def link(self, consumer: "RankSliceLinear") -> None:
        """Record `consumer` as the next of its slices (q, k, v); once all are linked they decode in one group."""
        self._slices.append(weakref.ref(consumer))
        if len(self._slices) == self.consumers and 2 <= self.consumers <= MAX_GROUP:
            DecodeGroup([ref() for ref in self._slices], code=self)

    def relink_consumers(self, parent: nn.Module) -> int:
        """After ``copy.deepcopy``: link the q/k/v slices beside this code (children of `parent`) to it; 1, or 0
        when `parent` holds another shared code too (which one a slice reads is then unknown)."""
        if sum(isinstance(c, SharedRankCode) for c in parent.children()) != 1:
            return 0
        self._slices, self._kept = [], ByInput()
        for child in parent.children():
            if isinstance(child, RankSliceLinear):
                child.link(self)
        return 1

    def measured_macs(self) -> float:
        return self.rank * self.in_features + self.out_features * self.mean_active()

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, threshold={float(self.threshold):.4g}"


@register_adapter
class RankSliceLinear(MaskedDecode, Adapter, nn.Module):
    """One of q/k/v: its rows of the stacked A applied to the shared masked code."""

    spec_type = "rank_slice"  # no threshold of its own: its code's
    spec_fields = {"out": "size", "rank": "size", "bias": "flag", "code": "adapter"}
    linear_children = ("A",)
    decode_mode = "square"  # its code's mask (its code groups q/k/v: not groupable by the architecture)
    self_guided = "dense"
    refit = "owner"  # its input scores its code's threshold

    def to_spec(self, root: nn.Module) -> dict:
        code = next(n for n, c in root.named_modules() if c is self._code())
        return {"out": self.out_features, "rank": self.A.in_features, "bias": self.A.bias is not None, "code": code}

    @classmethod
    def from_spec(cls, s: dict, zeros, built: dict, **_) -> "RankSliceLinear":
        return cls(zeros(s["out"], s["rank"]), zeros(s["out"]) if s["bias"] else None, built[s["code"]])

    def __init__(self, A: torch.Tensor, bias: torch.Tensor | None, code: SharedRankCode):
        super().__init__()
        self.A = column_major_linear(A, bias)
        self.in_features, self.out_features = code.in_features, A.shape[0]
        self.link(code)

    def threshold_owner(self) -> SharedRankCode | None:
        return self._code()

    def link(self, code: SharedRankCode) -> None:
        # A weak, non-module reference: the code is registered once, on the attention block.
        self._code = weakref.ref(code)
        code.link(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        code = self._code()
        y = self.decode_grouped(x, meter=code)  # its code's group: B x once, q/k/v in one call
        if y is not None:
            return y
        z, mask = code.code(x)
        # one token outside the grouped call (a peft-wrapped sibling): its code's threshold, meter and sparsity bin
        y = self.decode_masked(self._modules["A"], z, code._buffers["threshold"], meter=code)
        if y is not None:
            return y
        return self.A(z * mask)

    def decode_operands(self, x: torch.Tensor, code: torch.Tensor):
        """(its code's z = B x, A's operand, the code's threshold, scale) in its code's grouped call, or None."""
        weight = self.decode_weight(self._modules["A"])
        if weight is None:
            return None
        return code, weight, self._code()._buffers["threshold"], None
