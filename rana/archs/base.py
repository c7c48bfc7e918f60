"""Declarative description of where things live inside a decoder architecture.

The compression, LAuReL and export code never hard-codes attribute names: they ask the
`ArchSpec` of the model's `config.model_type`. Adding an architecture is one small file
that builds an `ArchSpec` and calls `register`.

One vocabulary throughout: a decoder layer has two **blocks** (attention, mlp) made of
**projections** (q, k, v, o; up, gate, down — or the fused qkv, gate_up); a **role** names the
input a group of projections reads: qkv_in (q, k, v), o, mlp_in (up, gate) and down.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch.nn as nn

from ..errors import UserError

BLOCKS = ("attention", "mlp")
ROLES = ("qkv_in", "o", "mlp_in", "down")
NORM_TYPES = ("rms", "layer")  # ArchSpec.norm_type: RMSNorm, LayerNorm


@dataclass(frozen=True)
class ArchSpec:
    """Dotted attribute paths, relative to the model / a decoder layer / its sub-blocks."""

    model_types: tuple[str, ...]
    # model-level paths (relative to the *CausalLM model)
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    # layer-level paths (relative to one decoder layer)
    attn: str = "self_attn"
    mlp: str = "mlp"
    # attention projections, relative to `attn`; `qkv_fused` replaces q/k/v when set
    q: str | None = "q_proj"
    k: str | None = "k_proj"
    v: str | None = "v_proj"
    qkv_fused: str | None = None
    # how a fused qkv's rows are laid out: False stacks [all q; all k; all v] (Phi-3), True interleaves
    # them per head, [q, k, v] of head 0, then of head 1, ... (GPT-NeoX): v's rows are then not one block
    qkv_interleaved: bool = False
    o: str = "o_proj"
    # MLP projections, relative to `mlp`; `gate` is None for non-gated MLPs
    up: str | None = "up_proj"  # None when `gate_up_fused` holds both
    gate: str | None = "gate_proj"
    down: str = "down_proj"
    gate_up_fused: str | None = None
    act: str = "act_fn"
    # Mixture of experts (transformers 5): `experts`, relative to `mlp`, holds every expert's weights as
    # 3-D parameters (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and `router` the dense top-k router
    # reading the same input; None for a dense MLP. The config attributes name E and I (top-k is
    # `num_experts_per_tok` in all of them).
    experts: str | None = None
    router: str | None = None
    num_experts_config: str = "num_experts"
    expert_intermediate_config: str = "intermediate_size"
    # what every norm of the model computes: "rms" (RMSNorm, x / rms(x) times a scale; Gemma's `1 + w`
    # scale too) or "layer" (LayerNorm, which subtracts the mean first: GPT-NeoX). A rotation folded
    # through a norm needs "rms": subtracting the mean does not commute with it.
    norm_type: str = "rms"
    # Residual structure. `attn_norm` is the attention's pre-norm: the module that receives the
    # residual stream the attention output is added back to (likewise `mlp_norm` for the MLP).
    # None: the block has no pre-norm and reads the residual stream itself (OLMo 2 normalises only
    # the block outputs); `residual_input` names whichever receives it. Optional post-norms are
    # applied to the block output before the add (Gemma 2/3, OLMo 2).
    attn_norm: str | None = "input_layernorm"
    mlp_norm: str | None = "post_attention_layernorm"
    attn_post_norm: str | None = None
    mlp_post_norm: str | None = None
    # config attribute m scaling each block's output before the residual add, x + m·block(x)
    # (Granite's `residual_multiplier`); None: m = 1. Whatever rewrites the residual add (LAuReL)
    # reads it through `residual_scale`.
    residual_multiplier_config: str | None = None
    parallel_residual: bool = False
    # config attribute that switches the parallel residual on/off per model (GPT-NeoX's
    # `use_parallel_residual`); `get_arch(config)` then returns the spec with it applied
    parallel_residual_config: str | None = None
    notes: str = field(default="", compare=False)

    def __post_init__(self):
        if self.norm_type not in NORM_TYPES:  # a misspelt kind would pass every `== "layer"` test unnoticed
            raise ValueError(f"ArchSpec.norm_type must be one of {NORM_TYPES}, got {self.norm_type!r}")

    @property
    def gated(self) -> bool:
        return self.gate is not None or self.gate_up_fused is not None or self.experts is not None

    @property
    def moe(self) -> bool:
        return self.experts is not None

    def experts_path(self) -> str:
        """The stacked experts of a mixture-of-experts MLP (what both MLP roles read into)."""
        return f"{self.mlp}.{self.experts}"

    def router_path(self) -> str:
        return f"{self.mlp}.{self.router}"

    # Layer-relative paths, derived here once so no other module re-derives them.

    def qkv_paths(self) -> dict[str, str]:
        """The projections reading the attention input, by name: q, k, v — or qkv when fused."""
        if self.qkv_fused:
            return {"qkv": f"{self.attn}.{self.qkv_fused}"}
        return {"q": f"{self.attn}.{self.q}", "k": f"{self.attn}.{self.k}", "v": f"{self.attn}.{self.v}"}

    def o_path(self) -> str:
        return f"{self.attn}.{self.o}"

    def mlp_paths(self) -> dict[str, str]:
        """The MLP's projections by name, in the order up, gate (or the fused gate_up), down."""
        if self.moe:  # no nn.Linear per projection: the stacked experts (experts_path) hold them all
            return {}
        names = {"up": self.up, "gate": self.gate, "gate_up": self.gate_up_fused, "down": self.down}
        return {name: f"{self.mlp}.{attr}" for name, attr in names.items() if attr}

    def act_path(self) -> str:
        """The MLP's activation (applied to gate, or to up in a non-gated MLP)."""
        return f"{self.mlp}.{self.act}"

    def role_path(self, role: str) -> str:
        """Path of the (first) projection whose *input* a role denotes."""
        if role == "qkv_in":
            return next(iter(self.qkv_paths().values()))
        if role == "o":
            return self.o_path()
        if role in ("mlp_in", "down") and self.moe:
            return self.experts_path()  # the experts' input; their down projections' inputs are inside
        if role == "mlp_in":
            return f"{self.mlp}.{self.gate_up_fused or self.gate or self.up}"
        if role == "down":
            return f"{self.mlp}.{self.down}"
        raise KeyError(f"unknown role '{role}' (roles: {', '.join(ROLES)})")

    def pre_norm(self, block: str) -> str | None:
        """The pre-norm of "attention" or "mlp" (None when the block reads the raw residual stream)."""
        return {"attention": self.attn_norm, "mlp": self.mlp_norm}[block]

    def residual_input(self, block: str) -> str:
        """Layer-relative path of the module whose (first) input is the residual stream that
        `block`'s output is added back to: its pre-norm, or the block itself when it has none."""
        return self.pre_norm(block) or {"attention": self.attn, "mlp": self.mlp}[block]

    def residual_scale(self, config) -> float:
        """m in x + m·block(x) for a model of `config` (1.0 unless `residual_multiplier_config`)."""
        if not self.residual_multiplier_config:
            return 1.0
        value = getattr(text_config(config), self.residual_multiplier_config, None)
        return 1.0 if value is None else float(value)

    def block_of(self, module_name: str) -> str | None:
        """"attention" or "mlp" for a module inside that block (a model- or layer-relative
        dotted name), None for anything else (embeddings, norms, the LM head)."""
        dotted = f".{module_name}."
        if f".{self.attn}." in dotted:
            return "attention"
        if f".{self.mlp}." in dotted:
            return "mlp"
        return None


_REGISTRY: dict[str, ArchSpec] = {}


class UnsupportedArchitectureError(UserError):
    """Raised for a model_type with no registry entry."""


def register(spec: ArchSpec) -> ArchSpec:
    for model_type in spec.model_types:
        _REGISTRY[model_type] = spec
    return spec


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


def get_arch(config_or_model_type) -> ArchSpec:
    """Look up the spec for a HF config (or a model_type string)."""
    model_type = config_or_model_type if isinstance(config_or_model_type, str) else getattr(
        config_or_model_type, "model_type", None
    )
    try:
        spec = _REGISTRY[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture '{model_type}' is not supported (supported: {', '.join(supported_model_types())}); "
            "to add one, write a small file in rana/archs/ that registers an ArchSpec (see rana/archs/llama.py, "
            "gpt_neox.py or phi3.py for the layouts) and import it in rana/archs/__init__.py"
        ) from None
    if spec.parallel_residual_config and not isinstance(config_or_model_type, str):
        flag = getattr(config_or_model_type, spec.parallel_residual_config, None)
        if flag is not None and bool(flag) != spec.parallel_residual:
            spec = replace(spec, parallel_residual=bool(flag))
    return spec


def text_config(config):
    """The config of the language model itself: a multimodal wrapper's text config (Gemma 3 keeps the
    decoder's dimensions in `config.text_config`), any other config as it is."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def decoder_layers(model: nn.Module, spec: ArchSpec) -> nn.ModuleList:
    return model.get_submodule(spec.layers)


# a decoder layer's keyword arguments that belong to a cache, not to the layer's own computation
CACHE_KWARGS = ("past_key_values", "past_key_value", "layer_past", "use_cache")


class _AfterLastLayer(Exception):
    """Raised by the last stubbed layer: nothing after the decoder layers needs to run."""


@contextmanager
def stubbed_decoder_layers(model: nn.Module, spec: ArchSpec):
    """Inside the block the model's decoder layers only record their inputs: the yielded
    `run(input_ids)` runs the embedding stage and returns (hidden states entering layer 0, [each
    layer's keyword arguments, cache arguments left out]). No layer computes, so their weights may
    be anywhere (an offload device, or not loaded at all); nothing after the last layer runs."""
    layers = decoder_layers(model, spec)
    n = len(layers)
    record: dict = {}

    def stub(i: int):
        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs.pop("hidden_states")
            if i == 0:
                record["hidden"] = hidden
            record[i] = {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS}
            if i == n - 1:
                raise _AfterLastLayer
            return hidden
        return forward

    def run(input_ids):
        record.clear()
        try:
            model(input_ids=input_ids, use_cache=False)
        except _AfterLastLayer:
            pass
        return record["hidden"], [record[i] for i in range(n)]

    for i, layer in enumerate(layers):
        layer.forward = stub(i)
    try:
        yield run
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
