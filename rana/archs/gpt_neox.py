"""GPT-NeoX / Pythia: non-gated GELU MLP (`dense_h_to_4h` → `act` → `dense_4h_to_h`), fused
`query_key_value` (rows interleaved per head; adapted as one stacked matrix, so the layout does
not matter there, but methods that pick k's or v's rows read `qkv_interleaved`), `dense` as the
output projection, LayerNorm (with a mean) rather than RMSNorm, and a parallel residual
`x + attn(ln1 x) + mlp(ln2 x)` when `config.use_parallel_residual` (Pythia: always).

The checkpoints call the LM head `embed_out`; transformers ≥ 5 renames it to `lm_head` on load
(and back on save), so the module path is `lm_head`."""
from .base import ArchSpec, register

GPT_NEOX = register(ArchSpec(
    model_types=("gpt_neox",),
    layers="gpt_neox.layers",
    embed="gpt_neox.embed_in",
    final_norm="gpt_neox.final_layer_norm",
    lm_head="lm_head",
    attn="attention",
    q=None,
    k=None,
    v=None,
    qkv_fused="query_key_value",
    qkv_interleaved=True,
    o="dense",
    up="dense_h_to_4h",
    gate=None,
    down="dense_4h_to_h",
    act="act",
    norm_type="layer",
    attn_norm="input_layernorm",
    mlp_norm="post_attention_layernorm",
    parallel_residual=True,
    parallel_residual_config="use_parallel_residual",
    notes="non-gated GELU MLP, fused interleaved QKV, parallel residual",
))
