"""Granite (3.x dense): the Llama layout with four scalar multipliers from the config. Three act
inside the stock forward and need nothing from rana: `embedding_multiplier` (applied before layer 0,
so the captured layer-0 inputs carry it), `attention_multiplier` (the softmax scale, inside
attention) and `logits_scaling` (logits = lm_head(x) / s, after the head module: an adapted head is
swapped for the module and the division still follows; its errors are relative). The fourth scales
each block's output before the residual add, x + m·block(x) (`residual_multiplier`): calibration
runs the stock layer, but LAuReL rewrites that add and must divide its skip terms by m."""
from .base import ArchSpec, register

GRANITE = register(ArchSpec(
    model_types=("granite",),
    residual_multiplier_config="residual_multiplier",
    notes="embedding / residual / attention / logits multipliers",
))
