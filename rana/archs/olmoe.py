"""OLMoE: pre-norm layers (unlike OLMo 2) with q/k RMSNorms over the whole projection and a
mixture-of-experts MLP: `mlp.gate` routes each token to `num_experts_per_tok` of `num_experts`
experts stacked in `mlp.experts` (gate_up_proj [E, 2I, H], down_proj [E, H, I])."""
from .base import ArchSpec, register

OLMOE = register(ArchSpec(
    model_types=("olmoe",), up=None, gate=None, experts="experts", router="gate",
    num_experts_config="num_experts", expert_intermediate_config="intermediate_size",
    notes="mixture of experts: stacked 3-D experts, dense top-k router; q/k norms over the whole projection"))
