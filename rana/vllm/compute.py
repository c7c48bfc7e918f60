"""One vLLM layer's rana computation, and the op vLLM's traced graph calls (no vLLM import).

vLLM traces a linear method's ``apply`` once (compiled mode) and replays the graph for every batch, so nothing
in ``apply`` may branch on the number of tokens. ``apply`` therefore calls one registered op,
``rana::vllm_linear``, with a fake implementation; the op's body runs eagerly at every step and picks the path:

- one token: every projection's masked GEMV through rana's kernels, with operands built once after loading: on
  CPU in fp32 one native call per input the layer's projections read (cpu_gemv.NativeGroup: each projection
  into its columns of one output row), elsewhere rana's decode route (rana.kernels.route: the Triton kernels
  on CUDA, the native or torch path on CPU), exactly as `rana.load` decodes;
- several tokens (prefill, batches): each token's own mask on its own input row, then the dense GEMM vLLM would
  use (its prepacked CPU GEMM, cuBLAS), projections that share input, mode and threshold in one GEMM; int8
  weights as `rana.load` multiplies several tokens (the dequantized weights, W8A8 inputs quantized), from a
  dequantized copy made once at load.

A layer's state is found by the address of its anchor (a one-element buffer of the layer that the graph takes
as an input), so a graph traced for one model never reads another model's state.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..kernels.cpu_gemv import A8_BLOCK_UNRECORDED, NativeGroup
from ..kernels.route import decode_masked, decode_masked_grouped, sparsity_bin
from ..kernels.torch_gemv import quantize_activations
from ..kernels.weights import FloatWeight, Int8Weight

MAX_GROUP = 3  # the decode route's grouped launch takes up to three projections
_UNBOUND = object()  # LayerState.native_groups: not bound yet for this bias


@dataclass
class Matrix:
    """One stored matrix on this rank: float `weight` (out, in) in any layout, or int8 codes `q_t` (in, out)
    row-major with fp32 `qscale` (out,) and the activation format of rana's int8 modules."""
    weight: Optional[torch.Tensor] = None
    q_t: Optional[torch.Tensor] = None
    qscale: Optional[torch.Tensor] = None
    activations: str = "float"
    block: int = A8_BLOCK_UNRECORDED  # int8 activations: the inputs quantized per scale

    @property
    def int8(self) -> bool:
        return self.q_t is not None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """(out, in) in `dtype`, as rana.modules.int8.Int8Linear.dequantized computes it."""
        return (self.q_t.t().float() * self.qscale[:, None]).to(dtype)

    def fp32(self) -> torch.Tensor:
        return self.dequantized(torch.float32) if self.int8 else self.weight.float()

    def operand(self, bias: Optional[torch.Tensor] = None):
        """The decode route's operand (weights in the masked kernels' layout: one input, one contiguous row)."""
        if self.int8:
            return Int8Weight(self.q_t, self.qscale, bias, self.activations, self.block)
        return FloatWeight(self.weight, bias)


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """`weight` (out, in) stored so that `weight.t()` is contiguous: one input's column is one row."""
    return weight.t().contiguous().t()


@dataclass
class Code:
    """A dense rank code z = B x (a rank adapter's B, or the stacked q/k/v code), computed as rana does."""
    matrix: Matrix
    operand: object = None
    dequantized: dict = field(default_factory=dict)  # int8 B: dtype -> its dequantized copy (several tokens)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = self.matrix
        if not m.int8:
            return F.linear(x, m.weight)
        if x.shape[0] == 1:  # Int8Linear's one-token path: the int8 GEMV through the decode route, mode "none"
            if self.operand is None:
                self.operand = m.operand()
            return decode_masked(self.operand, x, None, "none")
        w = self.dequantized.get(x.dtype)
        if w is None:
            w = self.dequantized[x.dtype] = m.dequantized(x.dtype)
        if m.activations == "int8":
            x = quantize_activations(x, block=m.block).to(x.dtype)
        return F.linear(x, w)


@dataclass
class Part:
    """One projection's masked matrix on this rank: its rows of the layer's output, its mask (mode, fp32
    threshold, column norms), and the input it masks (the layer's input, or code `code`'s output)."""
    path: str
    rows: int
    offset: int
    matrix: Matrix
    mode: str
    threshold: Optional[torch.Tensor]  # None with mode "none" (a dense int8 projection: no mask)
    scale: Optional[torch.Tensor] = None
    code: Optional[int] = None
    sbin: int = 2
    operands: dict = field(default_factory=dict)  # bias address (0: none) -> the decode route's operand

    def operand(self, bias: Optional[torch.Tensor]):
        key = 0 if bias is None else bias.data_ptr()
        w = self.operands.get(key)
        if w is None:
            if len(self.operands) > 2:  # a bias tensor replaced: forget the operands of the old ones
                self.operands.clear()
            w = self.operands[key] = self.matrix.operand(bias)
        return w

    def masked(self, v: torch.Tensor) -> torch.Tensor:
        """`v` with each row's mask applied, by the expressions of rana's adapters' torch paths (their dtype
        promotion included)."""
        if self.mode == "none":
            return v
        if self.mode == "abs":
            return v * (v.abs() >= self.threshold)
        if self.mode == "abs_scaled":
            return v * (v.abs() * self.scale >= self.threshold)
        return v * (v * v >= self.threshold)  # "square"


@dataclass
class Group:
    """Projections whose several-token product is one GEMM: same input, mode, threshold and weight format (int8
    weights through their dequantized copy)."""
    parts: list
    dense: Callable  # (masked input, bias or None) -> (tokens, rows)

    @property
    def rows(self) -> tuple[int, int]:
        return self.parts[0].offset, sum(p.rows for p in self.parts)


class LayerState:
    """A layer's projections on this rank, ready for tokens (see the module docstring)."""

    def __init__(self, name: str, parts: list[Part], codes: list[Code], dense_for: Callable,
                 dtype: torch.dtype = torch.float32):
        self.name, self.parts, self.codes, self.dtype = name, parts, codes, dtype
        self.out_features = sum(p.rows for p in parts)
        self.groups = self._groups(dense_for)
        self.native_groups: dict = {}  # bias address (0: none) -> [(NativeGroup, input: None or a code)] or None
        # the decode route's grouped calls: projections of one mode, up to three at a time
        self.decode_groups = []
        for p in parts:
            last = self.decode_groups[-1] if self.decode_groups else None
            if last and last[0].mode == p.mode and len(last) < MAX_GROUP and last[0].matrix.int8 == p.matrix.int8:
                last.append(p)
            else:
                self.decode_groups.append([p])

    def _groups(self, dense_for) -> list:
        groups, run = [], []
        for p in self.parts:
            same = run and (p.code, p.mode, p.matrix.int8, p.matrix.activations, p.matrix.block) == \
                (run[0].code, run[0].mode, run[0].matrix.int8, run[0].matrix.activations, run[0].matrix.block) \
                and p.scale is None and run[0].scale is None and _same(p.threshold, run[0].threshold)
            if same:
                run.append(p)
            else:
                if run:
                    groups.append(run)
                run = [p]
        groups.append(run)
        out = []
        for run in groups:
            # int8 weights: one dequantized copy in the model's dtype, packed for the GEMM once (dequantizing per
            # call cost 4x dense's time per step at batch 8); the int8 codes stay for one-token decoding
            mats = [p.matrix.dequantized(self.dtype) if p.matrix.int8 else p.matrix.weight for p in run]
            rows = torch.cat(mats) if len(mats) > 1 else mats[0]
            out.append(Group(run, dense_for(rows)))
        return out

    def __call__(self, x: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        if x.numel() == x.shape[-1] and x.dtype is torch.float32 and x.is_cpu:  # one fp32 CPU token: native calls
            groups = self.native_groups.get(0 if bias is None else bias.data_ptr(), _UNBOUND)
            if groups is _UNBOUND:
                groups = self._native(bias)
            if groups is not None:
                y = self._native_token(groups, x if x.is_contiguous() else x.contiguous())
                if y is not None:
                    return y if x.dim() == 2 else y.view(*x.shape[:-1], self.out_features)
        lead = x.shape[:-1]
        x = x.reshape(-1, x.shape[-1])
        zs = [code(x) for code in self.codes]
        if x.shape[0] == 1:
            y = self._one_token(x, zs, bias)
        else:
            y = self._several(x, zs, bias)
        return y.reshape(*lead, self.out_features)

    def _native_token(self, groups: list, x: torch.Tensor) -> Optional[torch.Tensor]:
        """One fp32 CPU token (contiguous) through the layer's native calls, codes first (their outputs are
        inputs); None where a call could not grow its scratch (the decode route then serves the token)."""
        y = torch.empty(1, self.out_features, dtype=torch.float32)
        threads = torch.get_num_threads()
        if not self.codes:
            for group, _ in groups:
                if not group.run(x.data_ptr(), y.data_ptr(), threads):
                    return None
            return y
        zs = [code(x.view(1, -1)).contiguous() for code in self.codes]
        for group, code in groups:
            if not group.run((x if code is None else zs[code]).data_ptr(), y.data_ptr(), threads):
                return None
        return y

    def _native(self, bias) -> Optional[list]:
        """The layer's one-token native calls for `bias`, one per input its projections read (bound on first use;
        None where a projection's operand is not the native kernel's: the decode route serves it)."""
        key = 0 if bias is None else bias.data_ptr()
        if len(self.native_groups) > 2:  # a bias tensor replaced: forget the calls of the old ones
            self.native_groups.clear()
        groups, by_input = [], {}
        for p in self.parts:
            w = p.operand(None if bias is None else bias.narrow(0, p.offset, p.rows))
            call = w.native(p.mode, p.scale) if w.backend == "native" else None
            if call is None or not call.usable:
                groups = None
                break
            t = float("-inf") if p.threshold is None else float(p.threshold)
            by_input.setdefault(p.code, []).append((call, t, p.offset))
        if groups is not None:
            for code, members in by_input.items():
                calls, ts, offsets = zip(*members)
                group = NativeGroup.bind(calls, ts, offsets, self.out_features)
                if group is None:
                    groups = None
                    break
                groups.append((group, code))
        self.native_groups[key] = groups
        return groups

    def _input(self, p: Part, x, zs):
        return x if p.code is None else zs[p.code]

    def _one_token(self, x, zs, bias) -> torch.Tensor:
        ys = []
        for group in self.decode_groups:
            ws = [p.operand(None if bias is None else bias.narrow(0, p.offset, p.rows)) for p in group]
            vs = [self._input(p, x, zs) for p in group]
            if len(group) == 1:
                p = group[0]
                ys.append(decode_masked(ws[0], vs[0], p.threshold, p.mode, p.scale, p.sbin).reshape(-1))
            else:
                ys.extend(decode_masked_grouped(ws, vs, [p.threshold for p in group], group[0].mode,
                                                [p.scale for p in group], group[0].sbin))
        return (ys[0] if len(ys) == 1 else torch.cat(ys)).view(1, -1)

    def _several(self, x, zs, bias) -> torch.Tensor:
        ys = []
        for group in self.groups:
            first = group.parts[0]
            v = first.masked(self._input(first, x, zs))
            if first.matrix.int8 and first.matrix.activations == "int8":
                # W8A8: each token's kept inputs as the kernels take them
                v = quantize_activations(v, block=first.matrix.block).to(v.dtype)
            offset, rows = group.rows
            ys.append(group.dense(v, None if bias is None else bias.narrow(0, offset, rows)))
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)


def _same(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and bool(torch.equal(a, b)))


def part_sparsity_bin(fraction) -> int:
    return 2 if fraction is None else sparsity_bin(float(fraction))


# --------------------------------------------------------------------------------------------
# the op
# --------------------------------------------------------------------------------------------
STATES: dict[int, weakref.ref] = {}


def register_state(anchor: torch.Tensor, state: LayerState) -> None:
    """`state` serves the layer whose anchor is `anchor` (the layer holds the state; this table only finds it)."""
    STATES[anchor.data_ptr()] = weakref.ref(state)


def state_of(anchor: torch.Tensor) -> LayerState:
    ref = STATES.get(anchor.data_ptr())
    state = None if ref is None else ref()
    if state is None:
        raise RuntimeError("rana::vllm_linear: no rana layer state for this anchor (weights not processed yet?)")
    return state


def _vllm_linear(x: torch.Tensor, anchor: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    return state_of(anchor)(x, bias)


def _vllm_linear_fake(x, anchor, bias, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def _registered(name: str) -> bool:
    try:
        getattr(torch.ops.rana, name)
    except (AttributeError, RuntimeError):
        return False
    return True


# Defined with torch.library's Library rather than custom_op: the op runs ~121 times per decode step, and
# custom_op's Python wrappers cost ~6 us more per call (9.6 against 3.5 us, inference mode, measured here).
# The implementation serves every device (CompositeExplicitAutograd); vLLM never differentiates it.
if not _registered("vllm_linear"):
    _LIBRARY = torch.library.Library("rana", "FRAGMENT")
    _LIBRARY.define("vllm_linear(Tensor x, Tensor anchor, Tensor? bias, int out_features) -> Tensor")
    _LIBRARY.impl("vllm_linear", _vllm_linear, "CompositeExplicitAutograd")
    torch.library.register_fake("rana::vllm_linear", _vllm_linear_fake, lib=_LIBRARY)


def vllm_linear(x: torch.Tensor, anchor: torch.Tensor, bias: Optional[torch.Tensor], out_features: int) -> torch.Tensor:
    return torch.ops.rana.vllm_linear(x, anchor, bias, out_features)


__all__ = ["Matrix", "Code", "Part", "Group", "LayerState", "column_major", "part_sparsity_bin", "register_state",
           "state_of", "vllm_linear", "STATES"]
