"""OLMo 2: no pre-norms. Each block reads the raw residual stream and RMSNorms its *output* before
the add, x + post_norm(block(x)), with `post_attention_layernorm` the attention's post-norm (not the
MLP's pre-norm as in Llama) and `post_feedforward_layernorm` the MLP's. q and k are RMSNormed over
the whole projection (all heads at once) after q_proj / k_proj, which leaves the adapters on their
shared input alone. Without a pre-norm nothing folds a rotation or a scale into the block inputs:
larosa (post-norms) and wina-ortho (no normalised input to rotate) refuse."""
from .base import ArchSpec, register

OLMO2 = register(ArchSpec(
    model_types=("olmo2",),
    attn_norm=None,
    mlp_norm=None,
    attn_post_norm="post_attention_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
    notes="no pre-norms: post-norms on both blocks, q/k norms over the whole projection",
))
