"""Model-level FLOP accounting: analytic dense cost from the config, measured cost from meters."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch.nn as nn

from .archs import ArchSpec, UnsupportedArchitectureError, get_arch, text_config
from .math.flops import LayerDims, dense_layer_macs, dense_model_macs
from .modules.common import MacMeter

ATTENTION_PARTS = ("q", "k", "v", "o", "attn_products")
MLP_PARTS = ("up", "gate", "down", "router")  # router: mixtures of experts only


def layer_dims(config, spec: ArchSpec | None = None) -> list[LayerDims]:
    """Per-layer dimensions read from a HF config (sliding-window layers included)."""
    spec = spec or get_arch(config)
    text = text_config(config)
    n_heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
    n_kv = getattr(text, "num_key_value_heads", None) or n_heads
    inter = getattr(text, "intermediate_size", None) or 4 * text.hidden_size
    experts, top_k = _moe_dims(text, spec)
    if experts:
        inter = getattr(text, spec.expert_intermediate_config)
    layer_types = getattr(text, "layer_types", None)
    window = getattr(text, "sliding_window", None)
    if getattr(text, "use_sliding_window", True) is False:
        window = None
    dims = []
    for idx in range(text.num_hidden_layers):
        sliding = window
        if layer_types is not None:
            sliding = window if layer_types[idx] == "sliding_attention" else None
        dims.append(LayerDims(hidden=text.hidden_size, q_out=n_heads * head_dim, kv_out=n_kv * head_dim,
                              intermediate=inter, gated=spec.gated, n_heads=n_heads, head_dim=head_dim,
                              sliding_window=sliding, experts=experts, top_k=top_k))
    return dims


def _moe_dims(text, spec: ArchSpec) -> tuple[int, int]:
    """(experts, top-k) of a mixture-of-experts config, (0, 0) for a dense MLP. Qwen3-MoE may keep
    dense MLPs in some layers; rana's MoE path assumes every layer routes, so those are refused."""
    if not spec.moe:
        return 0, 0
    if getattr(text, "mlp_only_layers", None) or (getattr(text, "decoder_sparse_step", 1) or 1) != 1:
        raise UnsupportedArchitectureError(
            f"{text.model_type} with dense MLP layers (mlp_only_layers / decoder_sparse_step > 1) is not supported: "
            "rana compresses mixture-of-experts models whose every layer routes")
    return int(getattr(text, spec.num_experts_config)), int(text.num_experts_per_tok)


def dense_macs(config, seq_len: int = 512) -> dict[str, float]:
    text = text_config(config)
    return dense_model_macs(layer_dims(config), text.vocab_size, seq_len)


def dense_macs_per_layer(config, seq_len: int = 512) -> list[dict[str, float]]:
    return [dense_layer_macs(d, seq_len) for d in layer_dims(config)]


def metered_modules(model: nn.Module) -> dict[str, MacMeter]:
    return {name: m for name, m in model.named_modules() if isinstance(m, MacMeter)}


@contextmanager
def metering(model: nn.Module) -> Iterator[dict[str, MacMeter]]:
    """Switch every meter on (reset) for the duration of the block."""
    meters = metered_modules(model)
    for m in meters.values():
        m.reset_meter()
        m.meter_on = True
    try:
        yield meters
    finally:
        for m in meters.values():
            m.meter_on = False


def measured_macs(model: nn.Module, seq_len: int = 512) -> dict:
    """Per-token MACs the model spent on the tokens seen while metering, vs dense.

    Dense parts are counted analytically; each metered module replaces its dense cost by the
    cost of what its masks actually kept.
    """
    config = model.config
    spec = get_arch(config)
    dense = dense_macs(config, seq_len)
    parts = {
        "attention": sum(dense[k] for k in ATTENTION_PARTS),
        "mlp": sum(dense.get(k, 0.0) for k in MLP_PARTS),
        "other": dense["lm_head"],  # the LM head: dense, or `--lm-head sparse`'s meter below (block_of: None)
    }
    measured = dict(parts)
    modules = {}
    for name, m in metered_modules(model).items():
        if not m._tokens:
            continue
        saved = m.macs_dense - m.measured_macs()
        # a meter outside both blocks may say whose cost it is (wina-ortho's rotation of a block's input)
        measured[getattr(m, "block", None) or spec.block_of(name) or "other"] -= saved
        modules[name] = {"dense_macs": m.macs_dense, "measured_macs": m.measured_macs(), "mean_active": m.mean_active()}
    total = sum(measured.values())
    return {
        "dense_macs": dense["total"],
        "measured_macs": total,
        "fraction": total / dense["total"],
        "gflops_per_token": 2 * total / 1e9,
        "dense_gflops_per_token": 2 * dense["total"] / 1e9,
        "by_part": {k: {"measured_macs": measured[k], "dense_macs": parts[k],
                        "fraction_of_part": measured[k] / parts[k] if parts[k] else 1.0} for k in parts},
        "modules": modules,
        "seq_len_for_attention": seq_len,
    }
