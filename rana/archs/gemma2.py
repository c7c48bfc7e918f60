"""Gemma 2: Gemma layout plus post-norms on both branches (`x + post_norm(block(pre_norm(x)))`),
so the MLP's pre-norm is `pre_feedforward_layernorm` and `post_attention_layernorm` is the
attention branch's *post*-norm. Layers alternate sliding-window / global attention
(`config.layer_types`, `config.sliding_window`): the FLOP accounting counts each layer's
attention products at its own window, and calibration passes each layer the mask of its type."""
from .base import ArchSpec, register

GEMMA2 = register(ArchSpec(
    model_types=("gemma2",),
    attn_norm="input_layernorm",
    attn_post_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
    notes="pre/post norms, alternating sliding-window layers",
))
