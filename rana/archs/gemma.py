"""Gemma (1): Llama layout with a GeGLU MLP (`act_fn` is GELU-tanh from `config.hidden_act`), embeddings
scaled by sqrt(hidden) inside `embed_tokens` (so the captured layer-0 inputs already carry the
scale) and a `head_dim` that may differ from hidden/heads (7B: 3072/16 = 192 vs 256; the FLOP
accounting reads `config.head_dim`). LM head tied to the embedding."""
from .base import ArchSpec, register

GEMMA = register(ArchSpec(model_types=("gemma",), notes="GeGLU, scaled embeddings, head_dim from config"))
