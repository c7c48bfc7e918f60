"""Declarative description of where things live inside a decoder architecture.

The compression, LAuReL and export code never hard-codes attribute names: they ask the
`ArchSpec` of the model's `config.model_type`. Adding an architecture is one small file
that builds an `ArchSpec` and calls `register`.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch.nn as nn


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
    o: str = "o_proj"
    # MLP projections, relative to `mlp`; `gate` is None for non-gated MLPs
    up: str | None = "up_proj"  # None when `gate_up_fused` holds both
    gate: str | None = "gate_proj"
    down: str = "down_proj"
    gate_up_fused: str | None = None
    act: str = "act_fn"
    # Residual structure. The module named `attn_norm` receives the residual stream that the
    # attention output is added back to (likewise `mlp_norm` for the MLP). Optional post-norms
    # are applied to the block output before the add (Gemma 2/3).
    attn_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    attn_post_norm: str | None = None
    mlp_post_norm: str | None = None
    parallel_residual: bool = False
    # config attribute that switches the parallel residual on/off per model (GPT-NeoX's
    # `use_parallel_residual`); `get_arch(config)` then returns the spec with it applied
    parallel_residual_config: str | None = None
    notes: str = field(default="", compare=False)

    @property
    def gated(self) -> bool:
        return self.gate is not None or self.gate_up_fused is not None


_REGISTRY: dict[str, ArchSpec] = {}


class UnsupportedArchitectureError(ValueError):
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


def get_submodule(root: nn.Module, path: str | None) -> nn.Module | None:
    if path is None:
        return None
    return root.get_submodule(path)


def set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, name, module)


def decoder_layers(model: nn.Module, spec: ArchSpec) -> nn.ModuleList:
    return model.get_submodule(spec.layers)
