"""Qwen3 (dense): the Llama layout with RMSNorms on q and k *per head*, applied after the
projections (as Gemma 3's), so the stacked-QKV adapter and input sparsity on q/k/v's shared input
are unaffected and a rotation folded into their inputs commutes with them. `head_dim` is set in the
config (128) and usually differs from hidden / heads (0.6B: 1024 / 16 = 64); the FLOP accounting
reads `config.head_dim`."""
from .base import ArchSpec, register

QWEN3 = register(ArchSpec(model_types=("qwen3",), notes="q/k norms per head, head_dim from config"))
