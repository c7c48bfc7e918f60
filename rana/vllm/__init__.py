"""rana's vLLM plugin: ``vllm serve`` / ``LLM(...)`` load a rana export (quantizer format) with no flag.

vLLM runs the ``vllm.general_plugins`` entry point ``rana = rana.vllm:register`` in each of its processes; it
registers quant_method "rana" (rana.vllm.config), which vLLM then finds in the folder's config.json. The plugin
serves the adapter kinds rana.vllm.layout.SERVED lists (the default method's input sparsity on q/k/v, o,
gate/up, down and the LM head, their int8 forms, and `rana-paper`'s rank adapters and neuron thresholds) and
refuses any other kind, LAuReL residuals and vLLM versions it was not written for, in one line, at load.
docs/serving.md says how to install and serve.
"""
from __future__ import annotations


def register() -> None:
    """vLLM's plugin hook: quant_method "rana" (once per process; registering again changes nothing)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    from .config import QUANT_METHOD, RanaVllmConfig

    if QUANT_METHOD in QUANTIZATION_METHODS:
        from vllm.model_executor.layers.quantization import get_quantization_config
        try:
            if get_quantization_config(QUANT_METHOD) is RanaVllmConfig:
                return
        except ValueError:
            pass
    register_quantization_config(QUANT_METHOD)(RanaVllmConfig)


__all__ = ["register"]
