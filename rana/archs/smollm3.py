"""SmolLM3: the Llama layout where some layers skip RoPE (`config.no_rope_layers[i] == 0`, every
4th layer by default). Every layer receives the same rotary embeddings and its attention decides
from its own config whether to apply them, so neither the adapters nor the layer-by-layer
calibration (which calls each layer's own forward) need anything; the optional sliding-window
layers come with per-layer masks, as Gemma 2's."""
from .base import ArchSpec, register

SMOLLM3 = register(ArchSpec(model_types=("smollm3",), notes="NoPE layers (no RoPE on every 4th layer)"))
