"""A RaNA-compressed model written by `rana export` (template rendered at export time).

The class is the stock ``*ForCausalLM`` of the source architecture. Its ``__init__`` builds the
stock model, then swaps in empty RaNA adapters of the shapes recorded in ``config.rana_adapters``
at the recorded module paths (and adds LAuReL residuals when ``config.rana_laurel`` is set), so
``from_pretrained`` loads every weight, threshold and LAuReL parameter by its ordinary state-dict
key. The adapter modules (``rank_linear.py``, ``neuron_linear.py``, ``cats.py``, ``common.py``; ``groups.py``
links q/k/v and gate/up adapters for one grouped decode launch),
the masked-GEMV kernels and their torch.library ops (``masked_gemv.py``, ``triton_gemv.py``,
``ops.py``; ``cpu_gemv.py``, whose C source is compiled on first
CPU decode when a C compiler exists, else torch ops run) and LAuReL (``laurel.py``) are copies of
the `rana` package's own sources, shipped next to this file.

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
from transformers import PretrainedConfig
from transformers import PreTrainedModel as _StockForCausalLM  # rana:stock-model-import

from .archspec import SPEC, set_submodule
from .cats import CatsActivation
from .common import restore_layouts
from .configuration_rana import RanaConfig
from .groups import link_decode_groups
from .laurel import LaurelConfig, apply_laurel
from .int8 import Int8Linear
from .neuron_linear import (InputSparseHead, InputSparseLinear, Int8InputSparseHead, NeuronThresholdLinear,
                            SparseLowRankLinear)
from .rank_linear import RankAdapterLinear, RankSliceLinear, SharedRankCode
from .registry import ADAPTER_CLASSES, ADAPTER_KINDS, build_adapter, build_order, install_int8
from .rotation import RotatedInput

RANA_CONFIG = "config.json (rana_adapters)"  # named in install_empty_adapters' error message

# rana:install-empty-adapters

def _from_quantizer_format(config):
    """A quantizer-format config.json (`rana export --format quantizer`: the adapters in
    quantization_config, quant_method "rana") read the remote-code way: the adapters and LAuReL moved
    to rana_adapters / rana_laurel, the quantization_config dropped (this class builds the adapters
    itself) and the weights guard meant for plain transformers without rana forgotten."""
    qc = getattr(config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    if not isinstance(qc, dict) or qc.get("quant_method") != "rana":
        return config
    config = copy.deepcopy(config)
    config.rana_adapters, config.rana_laurel = list(qc.get("adapters") or []), qc.get("laurel")
    config.rana_weights, config.rana_int8 = qc.get("weights") or "none", qc.get("int8")
    del config.quantization_config
    if hasattr(config, "transformers_weights"):
        del config.transformers_weights
    return config


# every registered adapter kind: restore_layouts puts each one's weights in its decode layouts (the stacked
# experts input-major included), so a kind added to the registry needs no entry here
_ADAPTERS_WITH_LINEARS = ADAPTER_CLASSES


class RanaForCausalLM(_StockForCausalLM):
    config_class = RanaConfig

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        ref = next(self.parameters())
        install_empty_adapters(self, list(config.rana_adapters or []), ref.dtype)
        if getattr(config, "rana_weights", None) == "int8":  # int8 weights (int8.py): empty, before the weights load
            install_int8(self, list((getattr(config, "rana_int8", None) or {}).get("modules") or []))
        if config.rana_laurel:
            apply_laurel(self, LaurelConfig.from_dict(dict(config.rana_laurel)), spec=SPEC)
        link_decode_groups(self, SPEC)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        if isinstance(kwargs.get("config"), PretrainedConfig):
            kwargs["config"] = _from_quantizer_format(kwargs["config"])
        loaded = super().from_pretrained(*args, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded).rana_finalize()
        return loaded

    @torch.no_grad()
    def rana_finalize(self):
        """After loading weights: adapter weights back in their decode layouts and column norms refreshed.

        The loader may replace parameters by row-major tensors; the batch-1 masked GEMV reads
        ``weight.t()`` row by row, so masked weights are made column-major here once instead of on every
        call (the rank adapters' B, always read whole, stays row-major). Thresholds are kept in float32,
        whatever dtype the model was loaded in.
        """
        for module in self.modules():
            if isinstance(module, _ADAPTERS_WITH_LINEARS):
                restore_layouts(module)
            for name, buf in list(module.named_buffers(recurse=False)):
                if name in ("threshold", "column_norms", "weight_scale") and buf is not None and buf.dtype != torch.float32:
                    setattr(module, name, buf.float())
            if isinstance(module, (Int8Linear, Int8InputSparseHead)):
                module._buffers["qweight"] = module._buffers["qweight"].contiguous()  # the int8 rows the kernels read
            if isinstance(module, NeuronThresholdLinear):
                module.refresh_norms()
            elif (isinstance(module, InputSparseHead) and not isinstance(module, Int8InputSparseHead)
                  and module.weight is not self.get_input_embeddings().weight):
                module.column_major_()  # an untied head's own weight (a tied one stays the embedding's)
        return self


__all__ = ["RanaForCausalLM"]
