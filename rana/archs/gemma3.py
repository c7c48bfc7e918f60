"""Gemma 3 multimodal checkpoints (`Gemma3ForConditionalGeneration`, model_type "gemma3"): the
Gemma 3 text decoder (see gemma3_text.py) under `model.language_model`, next to a SigLIP vision tower
and a projector that stay dense (nothing here names them, so no method touches them). The LM head
sits on the wrapper; the dimensions come from `config.text_config` (`get_text_config()`). Calibration
runs text only (no pixel values): the decoder sees what it sees between images."""
from dataclasses import replace

from .base import register
from .gemma3_text import GEMMA3_TEXT

GEMMA3 = register(replace(
    GEMMA3_TEXT,
    model_types=("gemma3",),
    layers="model.language_model.layers",
    embed="model.language_model.embed_tokens",
    final_norm="model.language_model.norm",
    notes="the text decoder of the multimodal wrapper; the vision tower stays dense",
))
