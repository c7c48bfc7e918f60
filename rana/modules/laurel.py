"""LAuReL: Learned Augmented Residual Layers for Hugging Face decoder models.

A residual connection ``x_{l+1} = x_l + f(x_l)`` (``f`` = attention or MLP, including its pre-norm and,
where the architecture has one, its post-norm) becomes

    x_{l+1} = alpha * f(x_l) + beta * (x_l + g_l)

    g_l = h( sum_{j<k} gamma_j * x_{l-j} )      with  h = B A  (low rank)  or  h = identity

where the pieces present depend on the variant (components joined with ``+``, in any order):

=========  =======================================================================================
``rw``     alpha = 2*sigmoid(a), beta = 2*sigmoid(b): learned, bounded in (0, 2), exactly 1 at a=b=0
``skip``   beta = lambda, one unbounded learned skip weight (alpha = 1) -- "adaptive skip weights";
           ``init="skip_schedule"`` initialises lambda to 1.0, 0.5, 0.0, 0.0, ... by layer depth
``lr``     h = B A with A: D->r, B: r->D (2rD parameters); without ``pa``: g = B A x_l
``pa``     previous activations: g = h(sum_{j<k} gamma_j x_{l-j}) over the last k residual-stream
           inputs (j = 0 is the current one); h = B A with ``lr`` (the paper's RW+LR+PA, eq. 6, with
           one shared h per residual as in eq. 4: 2rD + k parameters), h = identity without it
=========  =======================================================================================

so ``rw`` = alpha f + beta x, ``lr`` = f + x + BAx, ``pa`` = f + x + sum_j gamma_j x_{l-j},
``rw+lr`` = alpha f + beta (x + BAx), ``rw+lr+pa`` = alpha f + beta (x + BA sum_j gamma_j x_{l-j}),
``skip`` = f + lambda x. ``rw`` and ``skip`` are mutually exclusive. With ``per_dim=True`` alpha/beta
(and lambda) are vectors of length D instead of scalars.

Identity initialisation (``init="identity"``, the default, for pretrained models): a = b = 0 (so
alpha = beta = 1.0 exactly), lambda = 1, B = 0 and A column-orthogonal (A_ji = 1/sqrt(rD) if
i mod r == j, the paper's init), gamma = 0 when h is the identity, gamma = 1 when h = B A (B = 0
already makes the term vanish; gamma = 0 *and* B = 0 would be a saddle where neither ever gets a
gradient). The model's logits are then bit-for-bit unchanged.

Mechanism (works for any architecture described by an :class:`rana.archs.ArchSpec`, without rewriting
the decoder layer's forward): the module at ``spec.residual_input("attention")`` (the pre-norm, or the
attention itself when it has none, as in OLMo 2) receives exactly the residual stream x that the
attention branch is added back to. A forward *pre*-hook on that module records x; a forward hook on
the branch output (``spec.attn``, or ``spec.attn_post_norm`` when set) replaces f by

    f' = alpha f + (beta - 1) x + beta g

so the layer's own ``residual + f'`` yields the LAuReL form. At identity init f' == f bit for bit
(1.0*f + (0.0*x + 1.0*0)). The same holds for the MLP. Where the layer scales the branch before the
add, ``residual + m f'`` (Granite's ``residual_multiplier``, ``spec.residual_scale``), the skip terms
are divided by m (``f' = alpha f + ((beta - 1) x + beta g) / m``) so that the sum is still
``alpha m f + beta (x + g)``: alpha weights the branch as the layer adds it, beta the plain skip.
No module is replaced, so the base model's state_dict keys do not change; the parameters live in
new submodules ``<layer>.laurel_attn`` / ``<layer>.laurel_mlp`` (:class:`LaurelResidual`).

Parallel residual (GPT-NeoX/Pythia: ``x + attn(ln1 x) + mlp(ln2 x)``): both branches share one
residual x, so the beta / g terms are applied once, on the first targeted branch (attention if
targeted), and the other branch gets only its own alpha (``rw``)::

    x_{l+1} = alpha_a attn(ln1 x) + alpha_m mlp(ln2 x) + beta (x + g)

The PA history is one residual input per layer there (one per residual add in sequential models:
attn input, mlp input, next attn input, ...).

PA history is per forward pass: positions are numbered in execution order and each pass starts at the
smallest position, which discards the previous pass's history, so KV-cache generation (each step is
one pass over the layers, PA mixes the same token's earlier residual inputs) is consistent with a full
forward. With HF gradient checkpointing enabled and the model in training mode the whole pass's
history is kept (references only) until the next pass so the backward recompute sees the same
tensors; otherwise only the last k-1 entries are kept. With ``use_reentrant=False`` (the HF default)
gradients are exact; with reentrant checkpointing the gradient along the cross-layer PA path is
truncated (a warning is emitted).

Caveats: apply LAuReL *after* any module surgery (a replaced attention/MLP module loses the hook; a
warning is emitted when a recorded residual is never consumed); other forward hooks registered later
on the same branch module see f', not f; nn.DataParallel (threads sharing one model) is unsupported
(use DDP); the hooks keep per-call Python state, so torch.compile will graph-break around them.

The core ``nn.Module`` (:class:`LaurelResidual`) depends only on torch, so an export step can copy it
into a standalone modeling file: there, a decoder layer computes
``h = residual + self.laurel_attn(attn_out, residual, prev)`` with ``prev`` the previous residual
inputs, most recent first.
"""
from __future__ import annotations

import copy
import math
import warnings
from dataclasses import asdict, dataclass, field, fields
from itertools import islice
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import UserError

__all__ = [
    "LaurelConfig",
    "LaurelReport",
    "LaurelResidual",
    "LaurelSite",
    "VARIANT_COMPONENTS",
    "SKIP_SCHEDULE",
    "apply_laurel",
    "get_laurel_config",
    "is_laurel_applied",
    "laurel_parameters",
    "parse_variant",
    "remove_laurel",
    "skip_schedule_value",
]

VARIANT_COMPONENTS = ("rw", "skip", "lr", "pa")
INITS = ("identity", "skip_schedule")
TARGETS = ("attn", "mlp")
# Adaptive skip weights (from-scratch training): lambda by layer depth; later layers get 0.0.
SKIP_SCHEDULE = (1.0, 0.5)
MODULE_PREFIX = "laurel_"


def skip_schedule_value(layer_idx: int) -> float:
    """Initial skip weight lambda of decoder layer ``layer_idx``: 1.0, 0.5, 0.0, 0.0, ..."""
    return SKIP_SCHEDULE[layer_idx] if layer_idx < len(SKIP_SCHEDULE) else 0.0


def parse_variant(variant: str) -> tuple[str, ...]:
    """Canonical components of a variant string, e.g. ``"LR+rw"`` -> ``("rw", "lr")``."""
    if not isinstance(variant, str) or not variant.strip():
        raise UserError(f"LAuReL variant must be a non-empty string, got {variant!r}")
    parts = [p.strip().lower() for p in variant.split("+")]
    unknown = [p for p in parts if p not in VARIANT_COMPONENTS]
    if unknown or len(set(parts)) != len(parts):
        raise UserError(
            f"unknown LAuReL variant {variant!r}: expected '+'-joined distinct components of "
            f"{', '.join(VARIANT_COMPONENTS)} (e.g. 'rw', 'lr', 'pa', 'rw+lr', 'rw+lr+pa', 'skip')"
        )
    if "rw" in parts and "skip" in parts:
        raise UserError(
            f"LAuReL variant {variant!r}: 'rw' and 'skip' both weight the skip path; use one of them"
        )
    return tuple(c for c in VARIANT_COMPONENTS if c in parts)


# --------------------------------------------------------------------------------------------------
# Core module (torch only: safe to copy into a standalone modeling file)
# --------------------------------------------------------------------------------------------------


class LaurelResidual(nn.Module):
    """Learned augmentation of one residual connection.

    ``forward(f, x, prev)`` returns the *branch* term ``f' = alpha f + (beta - 1) x + beta g`` so that
    ``x + f'`` is the LAuReL residual ``alpha f + beta (x + g)``; ``prev`` holds the previous residual
    inputs ``x_{l-1}, x_{l-2}, ...`` (most recent first; only ``history - 1`` are used, missing ones are
    skipped). With ``alpha_only=True`` (second branch of a parallel residual) it returns ``alpha f``.

    Parameters (names all live under a ``laurel_*`` submodule of the decoder layer):
    ``alpha_logit``, ``beta_logit`` (rw; shape 1 or D), ``skip_weight`` (skip; 1 or D),
    ``down`` (A, r x D) and ``up`` (B, D x r) (lr), ``gamma`` (pa; k).
    """

    def __init__(
        self,
        dim: int,
        components: Sequence[str] = ("rw", "lr"),
        *,
        rank: int = 16,
        history: int = 2,
        per_dim: bool = False,
        alpha_only: bool = False,
        skip_init: float = 1.0,
        residual_scale: float = 1.0,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if not residual_scale:
            raise ValueError("LaurelResidual: residual_scale (the layer's branch multiplier) must be non-zero")
        # m of a layer computing x + m·f' (Granite): a plain attribute, not state, since the model's
        # config holds it and the state-dict keys stay those of the other architectures
        self.residual_scale = float(residual_scale)
        comps = tuple(components)
        self.dim = int(dim)
        self.use_rw = "rw" in comps
        self.use_skip = "skip" in comps
        self.alpha_only = bool(alpha_only)
        self.use_lr = "lr" in comps and not self.alpha_only
        self.use_pa = "pa" in comps and not self.alpha_only
        self.rank = int(rank) if self.use_lr else 0
        self.history = int(history) if self.use_pa else 0
        self.per_dim = bool(per_dim)
        self.skip_init = float(skip_init)
        self.components = tuple(c for c in comps if not (self.alpha_only and c != "rw"))
        kw = {"device": device, "dtype": dtype}
        width = self.dim if self.per_dim else 1
        self.alpha_logit = nn.Parameter(torch.empty(width, **kw)) if self.use_rw else None
        self.beta_logit = (
            nn.Parameter(torch.empty(width, **kw)) if self.use_rw and not self.alpha_only else None
        )
        self.skip_weight = (
            nn.Parameter(torch.empty(width, **kw)) if self.use_skip and not self.alpha_only else None
        )
        self.down = nn.Parameter(torch.empty(self.rank, self.dim, **kw)) if self.use_lr else None
        self.up = nn.Parameter(torch.empty(self.dim, self.rank, **kw)) if self.use_lr else None
        self.gamma = nn.Parameter(torch.empty(self.history, **kw)) if self.use_pa else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Identity init (skip weight from ``skip_init``): the branch term equals ``f`` exactly."""
        for p in (self.alpha_logit, self.beta_logit):
            if p is not None:
                p.zero_()  # 2 * sigmoid(0) == 1.0 exactly
        if self.skip_weight is not None:
            self.skip_weight.fill_(self.skip_init)
        if self.use_lr:
            # A (down, r x D): column-orthogonal, A_ji = 1/sqrt(rD) if i mod r == j; B (up) = 0.
            self.down.zero_()
            cols = torch.arange(self.dim, device=self.down.device)
            self.down[cols % self.rank, cols] = 1.0 / math.sqrt(self.rank * self.dim)
            self.up.zero_()
        if self.gamma is not None:
            # h = B A already vanishes through B = 0; gamma = 1 keeps both trainable. h = id: gamma = 0.
            self.gamma.fill_(1.0 if self.use_lr else 0.0)

    @property
    def variant(self) -> str:
        return "+".join(self.components)

    def alpha(self) -> torch.Tensor | None:
        return None if self.alpha_logit is None else 2.0 * torch.sigmoid(self.alpha_logit)

    def beta(self) -> torch.Tensor | None:
        if self.beta_logit is not None:
            return 2.0 * torch.sigmoid(self.beta_logit)
        return self.skip_weight

    def forward(
        self, f: torch.Tensor, x: torch.Tensor | None = None, prev: Sequence[torch.Tensor] = ()
    ) -> torch.Tensor:
        out = f
        alpha = self.alpha()
        if alpha is not None:
            out = alpha.to(f.dtype) * f
        if self.alpha_only:
            return out
        if x is None:
            raise ValueError("LaurelResidual needs the residual input x")
        dt = x.dtype
        g = None
        if self.use_pa:
            gamma = self.gamma.to(dt)
            g = gamma[0] * x
            for j, xp in enumerate(islice(prev, self.history - 1), start=1):
                if xp is not None and xp.shape == x.shape:
                    g = g + gamma[j] * xp
        elif self.use_lr:
            g = x
        if self.use_lr:
            g = F.linear(F.linear(g, self.down.to(dt)), self.up.to(dt))
        beta = self.beta()
        if beta is not None:
            beta = beta.to(dt)
            extra = (beta - 1.0) * x
            if g is not None:
                extra = extra + beta * g
        else:
            extra = g
        if extra is not None and self.residual_scale != 1.0:
            extra = extra / self.residual_scale  # the layer multiplies f' by m before the add
        return out if extra is None else out + extra

    def extra_repr(self) -> str:
        s = f"dim={self.dim}, variant={self.variant or 'none'}"
        if self.use_lr:
            s += f", rank={self.rank}"
        if self.use_pa:
            s += f", history={self.history}"
        if self.per_dim:
            s += ", per_dim=True"
        if self.alpha_only:
            s += ", alpha_only=True"
        if self.residual_scale != 1.0:
            s += f", residual_scale={self.residual_scale:g}"
        return s


# --------------------------------------------------------------------------------------------------
# Config / report
# --------------------------------------------------------------------------------------------------


@dataclass
class LaurelConfig:
    """What to add. ``variant``: '+'-joined components of rw, skip, lr, pa (see module docstring);
    ``rank``: r of the low-rank map (lr); ``history``: k previous residual inputs, current included
    (pa); ``per_dim``: vector alpha/beta/lambda; ``init``: "identity" (pretrained: exact at step 0) or
    "skip_schedule" (from scratch, needs ``skip``: lambda = 1.0, 0.5, 0.0, ... by depth);
    ``targets``: which residuals ("attn", "mlp")."""

    variant: str = "rw+lr"
    rank: int = 16
    history: int = 2
    per_dim: bool = False
    init: str = "identity"
    targets: tuple = ("attn", "mlp")

    def __post_init__(self):
        if isinstance(self.targets, str):
            self.targets = (self.targets,)
        self.targets = tuple(self.targets)
        self.validate()

    @property
    def components(self) -> tuple[str, ...]:
        return parse_variant(self.variant)

    def validate(self) -> tuple[str, ...]:
        comps = parse_variant(self.variant)
        if self.init not in INITS:
            raise UserError(f"unknown LAuReL init {self.init!r}; expected one of {INITS}")
        if self.init == "skip_schedule" and "skip" not in comps:
            raise UserError(
                "LAuReL init='skip_schedule' initialises the adaptive skip weight and needs a variant "
                f"with 'skip' (got {self.variant!r}); use init='identity' for the others"
            )
        targets = tuple(self.targets)
        if not targets or any(t not in TARGETS for t in targets) or len(set(targets)) != len(targets):
            raise UserError(f"LAuReL targets must be a non-empty subset of {TARGETS}, got {targets!r}")
        if "lr" in comps and (not isinstance(self.rank, int) or self.rank < 1):
            raise UserError(f"LAuReL rank must be a positive int, got {self.rank!r}")
        if "pa" in comps and (not isinstance(self.history, int) or self.history < 1):
            raise UserError(f"LAuReL history must be a positive int, got {self.history!r}")
        return comps

    def to_dict(self) -> dict:
        d = asdict(self)
        d["targets"] = list(self.targets)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "LaurelConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise UserError(f"unknown LaurelConfig keys: {sorted(unknown)}")
        d = dict(d)
        if "targets" in d:
            d["targets"] = tuple(d["targets"])
        return cls(**d)


@dataclass
class LaurelSite:
    layer: int
    target: str  # "attn" | "mlp"
    module: str  # dotted name of the LaurelResidual, e.g. "model.layers.0.laurel_attn"
    num_params: int
    role: str = "residual"  # "residual" (beta/g terms) or "alpha_only" (2nd branch, parallel residual)
    position: int | None = None  # index in the PA history order (None for alpha_only)
    tap: str | None = None  # module whose input is recorded as the residual x
    hook: str = ""  # module whose output f is replaced by f'
    skip_init: float | None = None


@dataclass
class LaurelReport:
    config: LaurelConfig
    num_params: int
    base_params: int
    num_layers: int
    hidden_size: int
    parallel_residual: bool
    sites: list[LaurelSite] = field(default_factory=list)

    @property
    def fraction(self) -> float:
        return self.num_params / max(self.base_params, 1)

    @property
    def per_layer(self) -> list[dict]:
        rows = []
        for i in range(self.num_layers):
            s = [site for site in self.sites if site.layer == i]
            rows.append({"layer": i, "params": sum(x.num_params for x in s), "targets": [x.target for x in s]})
        return rows

    def summary(self) -> str:
        return (
            f"LAuReL {self.config.variant} ({self.config.init}) on {len(self.sites)} residuals of "
            f"{self.num_layers} layers: +{self.num_params:,} params ({100 * self.fraction:.4f}% of "
            f"{self.base_params:,})"
        )

    __str__ = summary


# --------------------------------------------------------------------------------------------------
# Hook plumbing
# --------------------------------------------------------------------------------------------------


class _LaurelContext:
    """Per-model state shared by the hooks: the residual input recorded by the norm pre-hook for the
    branch hook that follows it, and the PA history of the current forward pass. Never deep-copied or
    pickled with tensors."""

    def __init__(self, config: LaurelConfig, layers: Sequence[nn.Module], k: int):
        self.config = config
        self.layers = list(layers)
        self.k = k  # history length incl. the current input; > 1 means PA needs earlier inputs
        self._clear()

    def _clear(self):
        self.slot = None  # (position, x, prev) between a norm pre-hook and its branch hook
        self.history: dict[int, torch.Tensor] = {}
        self.retain = False
        self.warned: set = set()

    def __deepcopy__(self, memo):
        new = self.__class__.__new__(self.__class__)
        memo[id(self)] = new
        new.config = copy.deepcopy(self.config, memo)
        new.layers = copy.deepcopy(self.layers, memo)
        new.k = self.k
        new._clear()
        return new

    def __getstate__(self):
        return {"config": self.config, "layers": self.layers, "k": self.k}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._clear()

    def _warn_once(self, key, msg):
        if key not in self.warned:
            self.warned.add(key)
            warnings.warn(msg, RuntimeWarning, stacklevel=3)

    def _checkpointing(self) -> bool:
        active = [
            layer
            for layer in self.layers
            if getattr(layer, "gradient_checkpointing", False) and layer.training
        ]
        for layer in active:
            fn = getattr(layer, "_gradient_checkpointing_func", None)
            if getattr(fn, "keywords", {}).get("use_reentrant", False):
                self._warn_once(
                    "reentrant",
                    "LAuReL-PA with reentrant gradient checkpointing: the gradient along the cross-layer "
                    "previous-activation path is truncated; use "
                    "gradient_checkpointing_kwargs={'use_reentrant': False} (the HF default)",
                )
                break
        return bool(active)

    def record(self, pos: int, x: torch.Tensor) -> None:
        if self.slot is not None and self.slot[0] != pos:
            self._warn_once(
                ("unconsumed", self.slot[0]),
                f"LAuReL: the branch hook of residual #{self.slot[0]} did not run after its norm; was the "
                "attention/MLP module replaced after apply_laurel? (apply LAuReL after module surgery)",
            )
        prev: tuple = ()
        if self.k > 1:
            h = self.history
            while h and next(reversed(h)) >= pos:  # entries of an earlier pass (or a recompute)
                h.popitem()
            if not h:  # a new forward pass starts
                self.retain = self._checkpointing()
            prev = tuple(h[q] for q in islice(reversed(h), self.k - 1))
            h[pos] = x
            if not self.retain:
                while len(h) > self.k - 1:
                    del h[next(iter(h))]
        self.slot = (pos, x, prev)

    def take(self, pos: int, where: str):
        slot = self.slot
        if slot is None or slot[0] != pos:
            raise RuntimeError(
                f"LAuReL: no residual input recorded for {where}; the block ran without its norm being "
                "called just before it (LAuReL hooks need the decoder layer's own forward)"
            )
        self.slot = None
        return slot[1], slot[2]


class _LaurelTap:
    """Forward pre-hook on a norm: records its input, the residual stream x of the branch."""

    def __init__(self, ctx: _LaurelContext, pos: int):
        self.ctx = ctx
        self.pos = pos

    def __call__(self, module, args, kwargs):
        x = args[0] if args else next(iter(kwargs.values()))
        self.ctx.record(self.pos, x)
        return None


class _LaurelBranch:
    """Forward hook on a branch output (attn / mlp / their post-norm): f -> f'."""

    def __init__(self, ctx: _LaurelContext, layer: nn.Module, attr: str, pos: int | None, where: str):
        self.ctx = ctx
        self.layer = layer  # looked up at call time so peft's modules_to_save wrapper is honoured
        self.attr = attr
        self.pos = pos
        self.where = where

    def __call__(self, module, args, output):
        laurel = getattr(self.layer, self.attr)
        is_seq = isinstance(output, (tuple, list))
        f = output[0] if is_seq else output
        if self.pos is None:
            new = laurel(f)
        else:
            x, prev = self.ctx.take(self.pos, self.where)
            new = laurel(f, x, prev)
        if is_seq:
            return (new, *output[1:]) if isinstance(output, tuple) else [new, *output[1:]]
        return new


_HOOK_TYPES = (_LaurelTap, _LaurelBranch)


# --------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------


def _unwrap(model: nn.Module) -> nn.Module:
    get_base = getattr(model, "get_base_model", None)  # peft PeftModel
    return get_base() if callable(get_base) else model


def apply_laurel(
    model: nn.Module,
    config: LaurelConfig | None = None,
    *,
    spec=None,
    dtype: torch.dtype | None = None,
) -> LaurelReport:
    """Add LAuReL to every decoder layer of ``model`` in place and return a :class:`LaurelReport`.

    ``spec``: an ``ArchSpec`` (default: ``rana.archs.get_arch(model.config)``). ``dtype``: dtype of
    the new parameters (default: that of the layer's parameters). Raises ``ValueError`` for an invalid
    config and ``RuntimeError`` when LAuReL is already applied.
    """
    from rana.archs import decoder_layers, get_arch

    config = LaurelConfig() if config is None else config
    comps = config.validate()
    model = _unwrap(model)
    if is_laurel_applied(model):
        raise RuntimeError("LAuReL is already applied to this model (remove_laurel first)")
    spec = get_arch(model.config) if spec is None else spec
    layers = decoder_layers(model, spec)
    base_params = sum(p.numel() for p in model.parameters())
    dim = getattr(model.config, "hidden_size", None)
    if dim is None:
        dim = layers[0].get_submodule(spec.attn_norm or spec.attn_post_norm).weight.shape[-1]
    if "lr" in comps and config.rank > dim:
        raise UserError(f"LAuReL rank {config.rank} exceeds the hidden size {dim}")
    k = config.history if "pa" in comps else 1
    ctx = _LaurelContext(config, layers, k)
    layers_name = spec.layers
    targets = [t for t in TARGETS if t in config.targets]
    # where x is recorded: the pre-norm, or the block itself when it reads the raw residual (OLMo 2)
    norms = {"attn": spec.residual_input("attention"), "mlp": spec.residual_input("mlp")}
    residual_scale = spec.residual_scale(model.config)
    outs = {"attn": spec.attn_post_norm or spec.attn, "mlp": spec.mlp_post_norm or spec.mlp}
    sites: list[LaurelSite] = []
    pos = 0
    for i, layer in enumerate(layers):
        ref = next(layer.parameters(), None)
        kw = {"device": ref.device if ref is not None else None,
              "dtype": dtype or (ref.dtype if ref is not None else None)}
        skip_init = skip_schedule_value(i) if config.init == "skip_schedule" else 1.0
        for n_t, target in enumerate(targets):
            alpha_only = spec.parallel_residual and n_t > 0
            if alpha_only and "rw" not in comps:
                continue  # nothing to learn on the second branch of a parallel residual
            attr = MODULE_PREFIX + target
            if hasattr(layer, attr):
                raise RuntimeError(f"decoder layer {i} already has an attribute {attr!r}")
            module = LaurelResidual(dim, comps, rank=config.rank, history=config.history, per_dim=config.per_dim,
                                    alpha_only=alpha_only, skip_init=skip_init, residual_scale=residual_scale, **kw)
            layer.add_module(attr, module)
            where = f"layer {i} {target}"
            if alpha_only:
                site_pos, tap = None, None
            else:
                site_pos, tap = pos, norms[target]
                layer.get_submodule(tap).register_forward_pre_hook(_LaurelTap(ctx, pos), with_kwargs=True)
                pos += 1
            layer.get_submodule(outs[target]).register_forward_hook(
                _LaurelBranch(ctx, layer, attr, site_pos, where)
            )
            sites.append(
                LaurelSite(
                    layer=i,
                    target=target,
                    module=f"{layers_name}.{i}.{attr}",
                    num_params=sum(p.numel() for p in module.parameters()),
                    role="alpha_only" if alpha_only else "residual",
                    position=site_pos,
                    tap=None if tap is None else f"{layers_name}.{i}.{tap}",
                    hook=f"{layers_name}.{i}.{outs[target]}",
                    skip_init=skip_init if "skip" in comps and not alpha_only else None,
                )
            )
    return LaurelReport(
        config=config,
        num_params=sum(s.num_params for s in sites),
        base_params=base_params,
        num_layers=len(layers),
        hidden_size=dim,
        parallel_residual=spec.parallel_residual,
        sites=sites,
    )


def is_laurel_applied(model: nn.Module) -> bool:
    return any(isinstance(m, LaurelResidual) for m in _unwrap(model).modules())


def laurel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """All LAuReL parameters (deduplicated), e.g. to set ``requires_grad`` or build an optimizer group."""
    seen, out = set(), []
    for m in model.modules():
        if isinstance(m, LaurelResidual):
            for p in m.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
    return out


def _contexts(model: nn.Module):
    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for h in hooks.values():
                if isinstance(h, _HOOK_TYPES):
                    yield h.ctx


def get_laurel_config(model: nn.Module) -> LaurelConfig | None:
    """The :class:`LaurelConfig` applied to ``model`` (None if none)."""
    return next((ctx.config for ctx in _contexts(_unwrap(model))), None)


def remove_laurel(model: nn.Module) -> int:
    """Detach LAuReL (hooks and ``laurel_*`` submodules) in place; returns the number of modules
    removed. The model then computes the plain residuals again (learned LAuReL weights are dropped)."""
    model = _unwrap(model)
    for m in model.modules():
        for hooks in (m._forward_pre_hooks, m._forward_hooks):
            for key in [k for k, h in hooks.items() if isinstance(h, _HOOK_TYPES)]:
                del hooks[key]
                for extra in ("_forward_pre_hooks_with_kwargs", "_forward_hooks_with_kwargs",
                              "_forward_hooks_always_called"):
                    getattr(m, extra, {}).pop(key, None)
    removed = 0
    for m in list(model.modules()):
        for name in [n for n in m._modules if n.startswith(MODULE_PREFIX)]:
            child = m._modules[name]
            if isinstance(child, LaurelResidual) or any(
                isinstance(c, LaurelResidual) for c in child.modules()
            ):
                del m._modules[name]
                removed += 1
    return removed
