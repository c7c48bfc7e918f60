"""Which layers the decode kernels read, and the operand each one is read through (rana.kernels.weights).

A layer type registers how to make its operand and how to tell that an operand still describes the layer
(`register_layer_weight`): nn.Linear here (a FloatWeight of its weight and bias), Int8Linear in int8.py (an
Int8Weight of its codes, scales and bias). Anything else (a peft wrapper: LoRA must run) has no operand and
takes its module's torch path.

A module keeps the operands of the layers it decodes through (`layer_weight`), one per role ("masked": the
matrix its mask selects rows of; "code": a rank adapter's B), so the backend and the native call are chosen
once, not per token. An operand is remade when its layer or the layer's tensors are replaced (a load, a
`.data` swap is seen by the bound call itself), and dropped (`drop_operands`) when the module moves or is
restored after a load or a LoRA merge. A deep copy or pickle of the module carries no operand (an operand
reduces to None): the copy makes its own. Under torch.compile nothing is kept: a traced step makes its operands for the
trace (no cache to guard on or to mutate inside the graph), and their backend only picks the registered ops.

This file ships with exports (remote code).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from ..kernels.weights import FloatWeight, Weight

KEPT = "_decode_operand_"  # a module keeps the operand of `role` in its __dict__ under KEPT + role:
#                            (layer or None, operand, current or None); one key per role, no dict of its own to
#                            read per token
MASKED = "masked"  # the role of the matrix an adapter's mask selects rows of
MASKED_KEY = KEPT + MASKED

# layer type -> (make(layer) -> Weight, current(operand, layer) -> bool)
LAYER_WEIGHTS: dict[type, tuple[Callable, Callable]] = {}


def register_layer_weight(layer_type: type, make: Callable, current: Callable) -> None:
    """Decode `layer_type`'s weights through `make(layer)`'s operand while `current(operand, layer)` holds."""
    LAYER_WEIGHTS[layer_type] = (make, current)


def _linear_weight(layer: nn.Linear) -> FloatWeight:
    params = layer._parameters
    return FloatWeight(params["weight"], params["bias"])


def _linear_current(operand: FloatWeight, layer: nn.Linear) -> bool:
    params = layer._parameters
    return operand.weight is params["weight"] and operand.bias is params["bias"]


register_layer_weight(nn.Linear, _linear_weight, _linear_current)


def layer_weight(owner: nn.Module, role: str, layer: nn.Module) -> Weight | None:
    """`layer`'s operand, kept on `owner` under `role` while it describes the layer; None for a layer the
    kernels do not read (a peft wrapper). (Runs per projection per token.)"""
    if torch.compiler.is_compiling():
        kind = LAYER_WEIGHTS.get(type(layer))
        return None if kind is None else kind[0](layer)
    key = KEPT + role
    hit = owner.__dict__.get(key)
    if hit is not None and hit[0] is layer and hit[1] is not None and hit[2](hit[1], layer):
        return hit[1]
    kind = LAYER_WEIGHTS.get(type(layer))
    if kind is None:
        owner.__dict__.pop(key, None)
        return None
    operand = kind[0](layer)
    owner.__dict__[key] = (layer, operand, kind[1])
    return operand


def kept_operand(owner: nn.Module, role: str) -> Weight | None:
    """The operand `owner` keeps under `role` for weights of its own (the caller checks it still describes
    them), or None (always under torch.compile)."""
    if torch.compiler.is_compiling():
        return None
    hit = owner.__dict__.get(KEPT + role)
    return None if hit is None else hit[1]


def keep_operand(owner: nn.Module, role: str, operand: Weight) -> Weight:
    """Keep `operand`, made by `owner` of weights of its own, under `role` (not under torch.compile); returns it."""
    if torch.compiler.is_compiling():
        return operand
    owner.__dict__[KEPT + role] = (None, operand, None)  # not the owner itself: no reference cycle to keep it alive
    return operand


def drop_operands(module: nn.Module) -> None:
    """Forget `module`'s operands (its tensors moved, or were replaced): the next token makes them anew."""
    for key in [k for k in module.__dict__ if k.startswith(KEPT)]:
        del module.__dict__[key]


__all__ = ["KEPT", "MASKED", "MASKED_KEY", "LAYER_WEIGHTS", "register_layer_weight", "layer_weight", "kept_operand",
           "keep_operand", "drop_operands"]
