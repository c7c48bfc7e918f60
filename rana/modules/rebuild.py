"""Rebuilding a rana model from its record, written once for the three paths that load one: `rana.load`
(rana.io.folder), the export's remote code (`modeling_rana.py`) and the transformers quantizer
(rana.quantizer). So the three cannot drift.

The record is what a folder's rana_config.json holds (an export's config.json carries the same as
``rana_adapters`` / ``rana_weights`` / ``rana_int8`` / ``rana_laurel``, a quantizer-format one as its
quantization_config): ``adapters``, ``weights`` ("int8" or absent), ``int8`` ({"modules": [paths]}),
``laurel`` (LaurelConfig settings or absent).

1. `install_rana`, before the weights load: empty adapters of the recorded shapes (each rebuilt by its
   registered kind, rana.modules.registry), then the int8 modules, then the LAuReL residuals;
2. the caller loads the weights (and ties the embeddings);
3. `finish_rana`, after: thresholds (and int8 scales) float32, int8 codes in their row layout, every
   adapter restored by its kind (decode layouts, column norms of the loaded weights), meters reset, then
   the decode groups linked.

This file ships with exports (remote code): it imports only modules that ship.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn

from ..errors import UserError
from ..archs import set_submodule
from .groups import link_decode_groups
from ..kernels.cpu_gemv import A8_BLOCK_UNRECORDED
from .int8 import Int8Linear, holds_int8
from .laurel import LaurelConfig, apply_laurel
from .registry import ADAPTER_KINDS, adapter_class, build_adapter, build_order, declared

# masks compare against these, and int8 weights are scaled by weight_scale: never rounded to bf16 / fp16
FP32_BUFFERS = ("threshold", "column_norms", "weight_scale")


# ---------------------------------------------------------------------------------------------- adapters
def install_empty_adapters(model: nn.Module, specs: list[dict], dtype: torch.dtype, record: str) -> None:
    """Swap in adapters of the recorded shapes (weights to be loaded afterwards), each rebuilt by
    its registered class (`rana.modules.registry`). `record`: where the specs were read (error messages)."""
    built = {}
    for s in build_order(specs):  # codes before the slices that name them
        if s["type"] not in ADAPTER_KINDS:
            raise UserError(f"unknown adapter type '{s['type']}' in {record}")
        built[s["path"]] = m = build_adapter(model, s, dtype, built)
        set_submodule(model, s["path"], m)


# ---------------------------------------------------------------------------------------------- int8 weights
def int8_paths(model: nn.Module) -> list[str]:
    """The module paths whose weights are int8 (rana_config.json's `int8.modules`), in module order."""
    return [name for name, m in model.named_modules() if holds_int8(m)]


def int8_form(module: nn.Module, q: torch.Tensor | None = None, scale: torch.Tensor | None = None) -> nn.Module:
    """The int8 replacement of a linear layer or of an adapter whose kind has an int8 form of its own (the
    input-sparse LM head): from codes q (out × in, int8) and scales (out,), or empty (weights loaded afterwards)."""
    if declared(module, "int8_form") is not None:
        return module.int8_form(q, scale)
    if type(module) is nn.Linear:
        if q is None:
            return Int8Linear.empty_like(module)
        return Int8Linear.from_quantized(q, scale, module.bias, module.weight.dtype).to(module.weight.device)
    raise ValueError(f"a {type(module).__name__} has no int8 form (only linear layers and the input-sparse LM head)")


def install_int8(model: nn.Module, paths: list[str], activations: str = "float",
                 activation_block: int = A8_BLOCK_UNRECORDED) -> None:
    """Swap the modules at `paths` (a folder's `int8.modules`) for empty int8 ones of their shapes, after
    the adapters are installed and before the weights load; they multiply their tokens as `activations` (the
    folder's `int8.activations`) and `activation_block` (its `int8.activation_block`; absent in folders written
    when every block held 64) say."""
    for path in paths:
        m = model.get_submodule(path)
        if not holds_int8(m):
            try:
                m = int8_form(m)
            except ValueError as e:
                raise UserError(f"int8 weights recorded for '{path}': {e}") from None
            set_submodule(model, path, m)
        m.activations, m.activation_block = activations, activation_block


# ---------------------------------------------------------------------------------------------- the rebuild
@contextmanager
def _stage(name: str):
    """Marks an exception raised inside a stage of `install_rana` with the stage's name (`failed_stage`),
    so a caller can word its own messages per stage; the exception itself is raised unchanged."""
    try:
        yield
    except Exception as e:
        if getattr(e, "rana_stage", None) is None:
            e.rana_stage = name
        raise


def failed_stage(error: BaseException) -> str | None:
    """The `install_rana` stage an exception came from: "adapters" (the adapters and int8 modules the record
    describes do not fit the model), "laurel settings" (LaurelConfig refused the record's settings), or
    None (anything else, LAuReL's own installation included)."""
    return getattr(error, "rana_stage", None)


def install_rana(model: nn.Module, record: dict, dtype: torch.dtype, *, record_name: str, spec=None) -> None:
    """Step 1 of the rebuild (module docstring): empty adapters, int8 modules, LAuReL residuals, as `record`
    describes them, before the weights load. `record_name`: where the record was read (error messages);
    `spec`: the architecture (default: the one of `model.config`)."""
    with _stage("adapters"):
        install_empty_adapters(model, list(record.get("adapters") or []), dtype, record_name)
        if record.get("weights", "none") == "int8":  # int8 weights (rana.modules.int8): empty, before the weights
            int8 = record.get("int8") or {}
            install_int8(model, list(int8.get("modules") or []), int8.get("activations") or "float",
                         int8.get("activation_block") or A8_BLOCK_UNRECORDED)
    laurel = record.get("laurel")
    if laurel:
        with _stage("laurel settings"):
            config = LaurelConfig.from_dict(dict(laurel))
        apply_laurel(model, config, spec=spec)


def restore_adapters(model: nn.Module) -> None:
    """Every adapter as its kind wants it after its weights were replaced (a load, a LoRA merge): its
    `restore` (decode layouts, column norms of the weights it now holds)."""
    for module in model.modules():
        if adapter_class(module) is not None:
            module.restore(model)


@torch.no_grad()
def finish_rana(model: nn.Module, spec) -> None:
    """Step 3 of the rebuild (module docstring), after the weights load and the tie: what a loader may have
    handed back otherwise put right, then the q/k/v and gate/up adapters linked for one grouped decode launch.

    The column norms are those of the weights as loaded (bf16 / fp16 when asked for: the weights the model
    multiplies with), so every path gives the same masks, logits and tokens."""
    for module in model.modules():
        buffers = module._buffers
        for name in FP32_BUFFERS:
            buf = buffers.get(name)
            if buf is not None and buf.dtype != torch.float32:
                buffers[name] = buf.float()
        if holds_int8(module):  # the int8 rows the kernels read
            q = buffers["qweight"]
            if not q.is_contiguous():
                buffers["qweight"] = q.contiguous()
        if adapter_class(module) is not None:
            module.restore(model)  # after its buffers are float32: the norms it refreshes stay exact
            if hasattr(module, "reset_meter"):
                module.reset_meter()  # the meter's counters may have been made on the meta device
    link_decode_groups(model, spec)


__all__ = ["FP32_BUFFERS", "install_empty_adapters", "int8_paths", "int8_form", "install_int8", "install_rana",
           "failed_stage", "restore_adapters", "finish_rana"]
