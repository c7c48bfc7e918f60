"""Mistral: Llama layout with sliding-window attention (irrelevant to the projections)."""
from .base import ArchSpec, register

MISTRAL = register(ArchSpec(model_types=("mistral",)))
