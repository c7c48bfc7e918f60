"""Mixtral: the Mistral layout with a mixture-of-experts MLP: `mlp.gate` routes each token to
`num_experts_per_tok` of `num_local_experts` experts stacked in `mlp.experts` (gate_up_proj
[E, 2I, H], down_proj [E, H, I], I = `intermediate_size`); the top-k weights are renormalised."""
from .base import ArchSpec, register

MIXTRAL = register(ArchSpec(
    model_types=("mixtral",), up=None, gate=None, experts="experts", router="gate",
    num_experts_config="num_local_experts", expert_intermediate_config="intermediate_size",
    notes="mixture of experts: stacked 3-D experts, dense top-k router"))
