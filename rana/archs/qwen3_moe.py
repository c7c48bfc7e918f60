"""Qwen3-MoE: Qwen3's attention (q/k norms per head) with a mixture-of-experts MLP in every layer:
`mlp.gate` routes each token to `num_experts_per_tok` of `num_experts` experts stacked in
`mlp.experts` (gate_up_proj [E, 2I, H], down_proj [E, H, I], I = `moe_intermediate_size`).
Checkpoints with dense MLP layers (`mlp_only_layers`, `decoder_sparse_step` > 1) are refused by the
FLOP accounting (rana.accounting.layer_dims)."""
from .base import ArchSpec, register

QWEN3_MOE = register(ArchSpec(
    model_types=("qwen3_moe",), up=None, gate=None, experts="experts", router="gate",
    num_experts_config="num_experts", expert_intermediate_config="moe_intermediate_size",
    notes="mixture of experts: stacked 3-D experts, dense top-k router; q/k norms per head"))
