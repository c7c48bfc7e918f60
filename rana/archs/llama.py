"""Llama family (Llama 1/2/3, SmolLM, TinyLlama): SwiGLU MLP, separate q/k/v."""
from .base import ArchSpec, register

LLAMA = register(ArchSpec(model_types=("llama",)))
