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

What it loads is checked as `rana.load` and rana's quantizer check it, by the same code (``loadchecks.py``, a copy
of rana.io.loadchecks): the record in config.json when the model is built, the tensors the weight files hold
(names, dtypes, shapes) before any loads, the int8 scales and thresholds once they have. A tensor missing or
extra, int8 codes stored as anything but int8, a record of the wrong shape or from a newer format, a NaN scale:
a ValueError saying what is wrong, never a model with random or garbage weights.

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
from .configuration_rana import RanaConfig, rana_fields
from .groups import link_decode_groups
from .loadchecks import (ModelLoadError, check_loaded, check_record, check_tensors, install_record, local_weight_files,
                         may_be_absent, record_of, tensor_specs, weight_specs)
from .rebuild import finish_rana

RANA_CONFIG = "config.json (rana_adapters)"  # where install_rana's error messages say the adapters were read
RE_EXPORT = "re-export the model with `rana export`"


def _from_quantizer_format(config):
    """A quantizer-format config.json (`rana export --format quantizer`: the record in quantization_config,
    quant_method "rana") read the remote-code way: the record moved to the rana_* fields (`rana_fields`), the
    quantization_config dropped (this class builds the adapters itself) and the weights guard meant for plain
    transformers without rana forgotten."""
    qc = getattr(config, "quantization_config", None)
    qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    if not isinstance(qc, dict) or qc.get("quant_method") != "rana":
        return config
    config = copy.deepcopy(config)
    for key, value in rana_fields(qc).items():
        setattr(config, key, value)
    del config.quantization_config
    if hasattr(config, "transformers_weights"):
        del config.transformers_weights
    return config


def _record(config) -> dict:
    """What the rebuild reads, from the config's rana_* fields."""
    return record_of(lambda key: getattr(config, f"rana_{key}", None))


def _where(model) -> str:
    name = getattr(model.config, "name_or_path", "") or ""
    return f"'{name}'" if name else "the checkpoint"


class RanaForCausalLM(_StockForCausalLM):
    config_class = RanaConfig

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        record = _record(config)
        # the schema rana.load and rana's quantizer run (loadchecks.py): a record of the wrong shape or from a newer
        # format is one ValueError saying what is wrong, not an AttributeError or a model with random weights
        check_record(record, where="the rana record in config.json", fix=RE_EXPORT)
        install_record(self, record, next(self.parameters()).dtype, where="the rana record in config.json",
                       record_name=RANA_CONFIG, spec=SPEC)
        link_decode_groups(self, SPEC)  # (a model built without from_pretrained decodes grouped too)
        # what the weight files must hold, taken before any weight loads (the loader may replace a tensor by the
        # file's, of another dtype): checked against the files by from_pretrained
        self._rana_tensors = tensor_specs(self.state_dict())

    @classmethod
    def _load_pretrained_model(cls, model, state_dict, checkpoint_files, *args, **kwargs):
        """transformers' loader, given the files it is about to read (the same leading arguments in transformers
        4.5x and 5.x): every tensor they hold checked against the model first (`_check_weights`)."""
        found = tensor_specs(state_dict) if state_dict is not None else weight_specs(checkpoint_files or [],
                                                                                     where=_where(model))
        _check_weights(model, found)
        model._rana_weights_checked = True
        return super()._load_pretrained_model(model, state_dict, checkpoint_files, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        if isinstance(kwargs.get("config"), PretrainedConfig):
            kwargs["config"] = _from_quantizer_format(kwargs["config"])
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        # a transformers that loads another way (and a model not loaded from files, e.g. from a state dict: nothing
        # to check) never reached the hook above: the files of its local folder checked here
        if not model.__dict__.pop("_rana_weights_checked", False) and model.config.name_or_path:
            files = local_weight_files(model.config.name_or_path)
            if not files:
                raise ModelLoadError(f"cannot find the weight files of {_where(model)} to check them; load it from "
                                     "its local folder")
            _check_weights(model, weight_specs(files, where=_where(model)))
        model.rana_finalize()
        check_loaded(model, _record(model.config), where=_where(model), record="config.json", fix=RE_EXPORT)
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


def _check_weights(model, found: dict) -> None:
    """The tensors the weight files hold (`found`) against those the model expects, as rana.load and rana's
    quantizer check them (loadchecks.py): none missing (it would keep its random init), none extra, int8 codes
    stored as int8, every shape as the record makes it. ValueError (ModelLoadError) otherwise."""
    check_tensors(model._rana_tensors, found, absent_ok=may_be_absent(model), where=_where(model), record="config.json",
                  fix=RE_EXPORT)


__all__ = ["RanaForCausalLM"]
