"""The contract every compression method follows, the registry, and the one way to install.

A method adapts some projections of each decoder layer in `Step`s (attention, then MLP, so the
MLP is calibrated on the output of the already-compressed attention). A step names the roles
whose inputs it needs (`targets`, see `rana.archs`), where the layer's forward can stop once
they are recorded, which need second moments, and an `apply` that swaps modules in place
(through `install_choice` / `install_stacked_qkv`) and returns plan entries. All budgets are
MACs per token (docs/method.md §3 "What `--flops F` means").

Adding a method is one file in this package that ends with `register(Method(...))`, imported
in `rana/methods/__init__.py` (as adding an architecture is in `rana/archs/`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
import torch.nn as nn

from ..archs import ArchSpec, set_submodule
from ..math.decompose import Decomposition
from ..math.masks import subsample_rows
from ..math.search import RankChoice
from ..math.sparse_lowrank import Svd
from ..modules import (InputSparseLinear, NeuronThresholdLinear, RankAdapterLinear, RankSliceLinear, SharedRankCode,
                       SparseLowRankLinear, link_layer)
from ..errors import UserError

# ---------------------------------------------------------------------------- what a step sees


@dataclass
class InputStats:
    """What the searches need of one projection's inputs: C = Σ x xᵀ (float64) over the fit
    tokens, a sample of *other* fit tokens for thresholds (tokens the decomposition never saw,
    so mask rates are not biased by its fit to C), and the held-aside inputs (for errors)."""

    moment: torch.Tensor | None = None
    count: int = 0
    fit_rows: list[torch.Tensor] = field(default_factory=list)
    eval_rows: list[torch.Tensor] = field(default_factory=list)
    cache: dict = field(default_factory=dict, repr=False)  # derived results reused across searches

    def cached(self, key, compute):
        """Memoise work derived from these statistics (decompositions, codes), e.g. when the
        budget allocator searches the same block at several budgets."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    @property
    def fit(self) -> torch.Tensor:
        return torch.cat(self.fit_rows)

    @property
    def eval(self) -> torch.Tensor:
        return torch.cat(self.eval_rows)


@dataclass
class LayerContext:
    index: int
    layer: nn.Module
    spec: ArchSpec
    fraction: float  # share of its dense cost each adapted component of this layer may spend
    fit_sample_tokens: int
    search_tokens: int
    grid_step: float
    dtype: torch.dtype = torch.float32

    def module(self, path: str) -> nn.Module:
        return self.layer.get_submodule(path)


# ---------------------------------------------------------------------------- what a method is


# what a step runs: swaps the layer's modules in place and returns plan entries
Apply = Callable[[LayerContext, dict[str, InputStats]], dict]


@dataclass(frozen=True)
class Step:
    """One calibrate-then-swap round inside a layer. Steps run in order, each calibrated on
    the output of the ones before (e.g. o_proj's inputs come from the compressed q/k/v);
    steps with the same `block` ("attention" or "mlp") report as one plan entry."""

    targets: tuple[str, ...]
    stop: str
    moments: tuple[str, ...]
    apply: Apply
    block: str = "attention"


def per_role_steps(*, qkv_in: Apply, o: Apply, mlp_in: Apply, down: Apply) -> tuple[Step, ...]:
    """One step per role, for a method that adapts each projection on its own input (teal, rsparse,
    larosa): q/k/v, then o (calibrated on the adapted q/k/v's output), then up/gate, then down (on the
    adapted up/gate's output). No step needs second moments."""
    return (Step(("qkv_in",), "qkv_in", (), qkv_in), Step(("o",), "o", (), o),
            Step(("mlp_in",), "mlp_in", (), mlp_in, "mlp"), Step(("down",), "down", (), down, "mlp"))


@dataclass(frozen=True)
class MemoryNeed:
    """What one layer's compression holds beyond weights and activations (read by the memory
    estimate instead of the method's name)."""

    decomposes: bool = True        # float64 eigen/SVD workspace + input second moments (False: teal, cats)
    stacked_gate_up: bool = True   # gate and up decomposed as one stacked matrix where the arch fuses them (svd: False)
    decomposes_down: bool = False  # down projection decomposed too: its input moment is inter x inter (svd)
    grid_search: bool = False      # per-MLP FLOP-split grid search buffers (the rana family, rana-paper)
    wide_sample_rows: bool = False  # sample rows as wide as the MLP's hidden layer (svd, teal)


@dataclass(frozen=True)
class Method:
    """A compression method: its steps in each decoder layer and what it declares about itself
    (read by compress, the memory estimate, the CLI help and the sweep figures)."""

    name: str
    adapted_parts: tuple[str, ...]  # keys of math.flops.dense_layer_macs this method may shrink
    steps: tuple[Step, ...] = ()
    min_fraction: float = 0.0  # below this share of the adapted parts' dense cost it cannot go
    description: str = ""
    memory: MemoryNeed = MemoryNeed()
    ablation: bool = False  # listed after the main methods (CLI help, `names()`)
    style: Mapping[str, str] = field(default_factory=lambda: {"marker": "x"})  # its curves in sweep figures
    unsupported: Callable[[ArchSpec], str | None] | None = None  # why it cannot run on an architecture
    # a model-level transform before the layer loop (e.g. larosa's folded rotations):
    # prepare(model, spec, fit_sequences, batch_size=, streamed=) -> what it did, for the plan
    prepare: Callable[..., dict] | None = None
    # what `--lm-head auto` does: "sparse" adapts the LM head like every projection (rana.compress.lm_head)
    lm_head: str = "dense"
    # per-token MACs the method adds that the dense model does not spend (wina-ortho's explicit
    # rotations), from the model config: the budget takes them from the adapted parts
    runtime_macs: Callable[..., float] | None = None
    # the MLP steps on a mixture-of-experts layer (rana.methods.moe.STEP); empty: the method refuses MoE models
    moe_steps: tuple[Step, ...] = ()

    def unsupported_reason(self, spec: ArchSpec) -> str | None:
        if spec.moe and not self.moe_steps:
            return (f"method '{self.name}' cannot compress mixture-of-experts MLPs ({spec.model_types[0]}: stacked "
                    "experts); use --method rana or teal (input sparsity per expert)")
        return self.unsupported(spec) if self.unsupported is not None else None

    def layer_steps(self, spec: ArchSpec) -> tuple[Step, ...]:
        """The steps run in each decoder layer of `spec`: on a mixture of experts the MLP steps are
        `moe_steps` (the attention steps are the dense models')."""
        if not spec.moe:
            return self.steps
        return tuple(s for s in self.steps if s.block != "mlp") + self.moe_steps


# ---------------------------------------------------------------------------- registry

_REGISTRY: dict[str, Method] = {}


def register(method: Method) -> Method:
    _REGISTRY[method.name] = method
    return method


def unregister(name: str) -> Method:
    """Remove a method (e.g. one a test or a notebook registered); returns it."""
    return _REGISTRY.pop(name)


RENAMED = {"rana-wina": "wina"}  # old name -> new name, for the one-line error an old command gets


def renamed_hint(name: str) -> str | None:
    """The hint an old method name's error carries ("renamed 'NEW'"), else None."""
    return f"renamed '{RENAMED[name]}'" if name in RENAMED else None


def get_method(name: str) -> Method:
    try:
        return _REGISTRY[name]
    except KeyError:
        hint = renamed_hint(name)
        raise UserError(f"unknown method '{name}'{f' ({hint})' if hint else ''}") from None


def names(*, ablations: bool | None = None) -> tuple[str, ...]:
    """Registered method names in registration order, the main methods before the ablations
    (`ablations=False`: the main ones only, `True`: the ablations only)."""
    main = tuple(n for n, m in _REGISTRY.items() if not m.ablation)
    extra = tuple(n for n, m in _REGISTRY.items() if m.ablation)
    if ablations is None:
        return main + extra
    return extra if ablations else main


class RegisteredNames(Sequence):
    """`names()` as a sequence that stays current: a method registered later is in it."""

    def __getitem__(self, index):
        return names()[index]

    def __len__(self) -> int:
        return len(_REGISTRY)

    def __repr__(self) -> str:
        return repr(names())


METHODS = RegisteredNames()


def unsupported_reason(method_name: str, spec: ArchSpec) -> str | None:
    """Why `method_name` cannot run on an architecture (None when it can, or is not registered)."""
    method = _REGISTRY.get(method_name)
    return method.unsupported_reason(spec) if method is not None else None


# ---------------------------------------------------------------------------- inputs and errors


def fit_eval_rows(ctx: LayerContext, s: InputStats) -> tuple[torch.Tensor, torch.Tensor]:
    """The fit-token sample (thresholds) and the held-aside search tokens (errors) of one role."""
    return s.cached(("rows", ctx.fit_sample_tokens, ctx.search_tokens),
                    lambda: (subsample_rows(s.fit, ctx.fit_sample_tokens), subsample_rows(s.eval, ctx.search_tokens)))


def qkv_modules(ctx: LayerContext) -> list[tuple[str, nn.Linear]]:
    """(path, module) of q, k, v — or the fused qkv — in this layer."""
    return [(path, ctx.module(path)) for path in ctx.spec.qkv_paths().values()]


def stacked_weight(mods: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[W_1; W_2; …] and the stacked bias (None when no module has one)."""
    W = torch.cat([m.weight.detach() for m in mods])
    biases = [m.bias for m in mods]
    if all(b is None for b in biases):
        return W, None
    return W, torch.cat([(b.detach() if b is not None else torch.zeros(m.out_features, dtype=W.dtype, device=W.device))
                         for b, m in zip(biases, mods)])


@torch.no_grad()
def function_preserving(model: nn.Module, probe: torch.Tensor, transform: Callable[[], dict]) -> tuple[dict, float, bool]:
    """Run a model-level `transform()` that must leave the model's function unchanged (a folded or
    explicit rotation): its result, the relative change of one probe sequence's logits, and whether
    that change is within rounding (1e-3 in float32, 5e-2 in half precision)."""
    dtype = next(model.parameters()).dtype
    probe = probe[:1].to(next(model.parameters()).device)
    before = model(probe, use_cache=False).logits.float()
    result = transform()
    change = float((model(probe, use_cache=False).logits.float() - before).norm() / before.norm().clamp_min(1e-30))
    return result, change, change < (1e-3 if dtype == torch.float32 else 5e-2)


def relative_error(ref: torch.Tensor, out: torch.Tensor) -> float:
    return float((out.float() - ref.float()).pow(2).sum() / ref.float().pow(2).sum().clamp_min(1e-30))


# ---------------------------------------------------------------------------- plan entries


def summary(entries: dict[str, dict], **extra) -> dict:
    """A step's result: its components' entries and their summed expected / dense MACs."""
    return {"components": entries, "expected_macs": sum(e["expected_macs"] for e in entries.values()),
            "dense_macs": sum(e["dense_macs"] for e in entries.values()), **extra}


def _entry(kind: str, **kw) -> dict:
    return {"kind": kind, **{k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in kw.items()}}


def dense_entry(out_features: int, in_features: int) -> dict:
    """A projection left dense."""
    dense = float(out_features * in_features)
    return _entry("dense", in_features=in_features, out_features=out_features, expected_macs=dense, dense_macs=dense)


def adapter_entry(kind: str, path: str, out_features: int, in_features: int, *, threshold: float,
                  expected_active: float, expected_macs: float, rank: int | None = None,
                  dense_macs: float | None = None, **errors) -> dict:
    """An installed adapter: what it is, where, its mask threshold (None when it keeps
    everything) and its expected cost; `errors` are the searches' errors (e.g. search_error)."""
    ranked = {} if rank is None else {"rank": rank}
    return _entry(kind, path=path, in_features=in_features, out_features=out_features, **ranked, threshold=threshold,
                  expected_active=expected_active, expected_macs=expected_macs,
                  dense_macs=float(out_features * in_features) if dense_macs is None else dense_macs, **errors)


# ---------------------------------------------------------------------------- installing

SCORES = ("magnitude", "contribution")


def sparse_module(weight: torch.Tensor, bias, threshold: float, score: str) -> nn.Module:
    """Input sparsity scored by magnitude |x_j| or by contribution |x_j|·‖W[:, j]‖ (neuron thresholding)."""
    return (NeuronThresholdLinear if score == "contribution" else InputSparseLinear)(weight, bias, threshold)


def sparse_choice(threshold: float, expected_active: float, macs: float) -> RankChoice:
    """Input sparsity at a threshold already chosen (installed even when it keeps everything)."""
    return RankChoice(rank=0, threshold=threshold, expected_active=expected_active, macs=macs, error=math.nan,
                      kind="sparse")


def install_choice(ctx: LayerContext, path: str, linear: nn.Linear, choice: RankChoice, *, score: str = "contribution",
                   dec: Decomposition | None = None, side: Svd | None = None, **errors) -> dict:
    """Swap the projection at `path` for what `choice` picked and return its plan entry:
    dense (left alone), input sparsity scored by `score`, magnitude sparsity with a low-rank path
    of `side` for the dropped inputs, or a B-masked rank adapter of `dec`."""
    o, i = linear.weight.shape
    if choice.dense:
        return dense_entry(o, i)
    if choice.kind == "sparse_lowrank":
        A, B = side.factors(choice.rank)
        dt = linear.weight.dtype
        module = SparseLowRankLinear(linear.weight.detach(), linear.bias, choice.threshold, A.to(dt), B.to(dt))
        module.set_active_fraction(choice.expected_active / i)
        set_submodule(ctx.layer, path, module)
        return adapter_entry("sparse_lowrank", path, o, i, rank=choice.rank, threshold=choice.threshold,
                             expected_active=choice.expected_active, expected_macs=choice.macs, **errors)
    if choice.kind == "sparse":
        module = sparse_module(linear.weight.detach(), linear.bias, choice.threshold, score)
        module.set_active_fraction(choice.expected_active / i)
        set_submodule(ctx.layer, path, module)
        link_layer(ctx.layer, ctx.spec)  # siblings reading one input decode in one launch
        # a contribution-scored down projection thresholds the MLP's neurons
        kind = "input_sparse" if score == "magnitude" else "neuron" if path == ctx.spec.role_path("down") else "sparse"
        return adapter_entry(kind, path, o, i, threshold=choice.threshold, expected_active=choice.expected_active,
                             expected_macs=choice.macs, **errors)
    A, B = dec.factors(linear.weight, choice.rank)
    dt = linear.weight.dtype
    module = RankAdapterLinear(A.to(dt), B.to(dt), linear.bias, choice.threshold)
    module.set_active_fraction(choice.expected_active / choice.rank)
    set_submodule(ctx.layer, path, module)
    link_layer(ctx.layer, ctx.spec)
    return adapter_entry("rank", path, o, i, rank=choice.rank, threshold=choice.threshold,
                         expected_active=choice.expected_active, expected_macs=choice.macs, **errors)


QKV_CODE = "qkv_code"  # the shared B-masker of separate q/k/v rank slices, inside the attention block


def install_rank_qkv(ctx: LayerContext, A: torch.Tensor, B: torch.Tensor, bias: torch.Tensor | None,
                     threshold: float) -> None:
    """Swap q/k/v (or a fused qkv) for a stacked rank adapter with one B-masker."""
    spec, mods = ctx.spec, qkv_modules(ctx)
    dt = mods[0][1].weight.dtype
    if spec.qkv_fused:
        set_submodule(ctx.layer, mods[0][0], RankAdapterLinear(A.to(dt), B.to(dt), None if bias is None else bias.to(dt), threshold))
        return
    code = SharedRankCode(B.to(dt), threshold, out_features=A.shape[0], consumers=len(mods))
    set_submodule(ctx.layer, f"{spec.attn}.{QKV_CODE}", code)
    row = 0
    for path, m in mods:
        rows = slice(row, row + m.out_features)
        b = None if bias is None else bias[rows].to(dt)
        set_submodule(ctx.layer, path, RankSliceLinear(A[rows].to(dt), b, code))
        row += m.out_features


def install_stacked_qkv(ctx: LayerContext, choice: RankChoice, dec: Decomposition, W: torch.Tensor,
                        bias: torch.Tensor | None) -> dict:
    """q/k/v as one stacked rank adapter of W = [W_q; W_k; W_v] (or left dense); its plan entry."""
    o, i = W.shape
    if choice.dense:
        return dense_entry(o, i)
    A, B = dec.factors(W, choice.rank)
    install_rank_qkv(ctx, A, B, bias, choice.threshold)
    path = ctx.spec.qkv_paths()["qkv"] if ctx.spec.qkv_fused else f"{ctx.spec.attn}.{QKV_CODE}"
    ctx.layer.get_submodule(path).set_active_fraction(choice.expected_active / choice.rank)
    return adapter_entry("rank", path, o, i, rank=choice.rank, threshold=choice.threshold,
                         expected_active=choice.expected_active,
                         expected_macs=choice.rank * i + o * choice.expected_active)
