"""Gemma 3 text models (`Gemma3ForCausalLM`, model_type "gemma3_text"): the Gemma 2 layout with
q/k norms inside attention (after q/k/v, so the stacked-QKV adapter is unaffected) and 5:1
sliding / global layers whose rotary embeddings differ by type (local vs global RoPE base):
calibration records every layer's own keyword arguments. The multimodal "gemma3" wrapper
(`Gemma3ForConditionalGeneration`) is this decoder at other paths (gemma3.py)."""
from .base import ArchSpec, register

GEMMA3_TEXT = register(ArchSpec(
    model_types=("gemma3_text",),
    attn_norm="input_layernorm",
    attn_post_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
    notes="pre/post norms, q/k norms, per-type RoPE and sliding windows",
))
