"""Qwen2: Llama layout with biases on q/k/v (carried into the stacked adapter's A)."""
from .base import ArchSpec, register

QWEN2 = register(ArchSpec(model_types=("qwen2",)))
