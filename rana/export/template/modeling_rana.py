"""A RaNA-compressed model written by `rana export` (template rendered at export time).

The class is the stock ``*ForCausalLM`` of the source architecture. Its ``__init__`` builds the
stock model, then swaps in empty RaNA adapters of the shapes recorded in ``config.rana_adapters``
at the recorded module paths (int8 modules where ``config.rana_weights`` says so, and LAuReL residuals
when ``config.rana_laurel`` is set), so ``from_pretrained`` loads every weight, threshold and LAuReL
parameter by its ordinary state-dict key; ``rana_finalize`` then puts right what the loader may have
handed back otherwise. Both steps are ``rebuild.py``'s, the rebuild `rana.load` runs. The adapter
modules (one per registered adapter kind, imported below: each registers its kinds with
``registry.py``; ``common.py``; ``groups.py`` links q/k/v and gate/up adapters for one grouped decode
launch), the decode route and the masked-GEMV kernels (``route.py``, ``weights.py``, ``modes.py``,
``torch_gemv.py``, ``triton_gemv.py``, their torch.library ops ``ops.py``; ``cpu_gemv.py``, whose inlined C
source is compiled on first CPU decode when a C compiler exists, else torch ops run) and LAuReL (``laurel.py``) are copies of the `rana` package's own sources, shipped
next to this file.

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
"""
from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig
from transformers import PreTrainedModel as _StockForCausalLM  # rana:stock-model-import

# rana:adapter-modules
from .archspec import SPEC
from .configuration_rana import RanaConfig
from .groups import link_decode_groups
from .rebuild import finish_rana, install_rana

RANA_CONFIG = "config.json (rana_adapters)"  # where install_rana's error messages say the adapters were read


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


class RanaForCausalLM(_StockForCausalLM):
    config_class = RanaConfig

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        ref = next(self.parameters())
        record = {"adapters": config.rana_adapters, "weights": getattr(config, "rana_weights", None),
                  "int8": getattr(config, "rana_int8", None), "laurel": config.rana_laurel}
        install_rana(self, record, ref.dtype, record_name=RANA_CONFIG, spec=SPEC)
        link_decode_groups(self, SPEC)  # (a model built without from_pretrained decodes grouped too)

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
        whatever dtype the model was loaded in. (``finish_rana``, rebuild.py)
        """
        finish_rana(self, SPEC)
        return self


__all__ = ["RanaForCausalLM"]
