"""A transformers quantizer for rana folders: ``quantization_config = {"quant_method": "rana", ...}``.

An export in the quantizer format (`rana export --format quantizer`) keeps the stock ``model_type``
and ``architectures`` in config.json and records the adapters there the way AWQ / GPTQ checkpoints
record their quantization::

    "quantization_config": {"quant_method": "rana", "format_version": 1, "rana_version": "0.1.0",
                            "adapters": [...rana_config.json's adapters...], "laurel": {...} | null}

With this module registered (`rana.hf_hook` registers it when transformers' quantizer table is
imported, in any process where rana is installed), ``AutoModelForCausalLM.from_pretrained(folder)``
builds the stock class, and the quantizer swaps in empty adapters of the recorded shapes before
transformers loads every weight by its ordinary key; afterwards the decode layouts, column norms,
thresholds and decode groups are put right: the rebuild `rana.load` runs (`rana.modules.rebuild`). The
record, the tensors the files hold and the loaded int8 scales and thresholds are checked as `rana.load`
checks them, by the same code (`rana.io.loadchecks`, which the shipped remote code runs too).

Without rana, transformers only warns about an unknown quant_method and would load the stock model
with random projections. The export therefore also writes ``transformers_weights`` (the config
field that names the weight file) as a sentence saying to `pip install rana`: plain transformers
stops on it with one line, this quantizer clears it before the weights are looked up, and the
shipped remote code (the fallback with ``trust_remote_code=True``) clears it too.
"""
from __future__ import annotations

import importlib
import os

import torch
import torch.nn as nn
from transformers.quantizers.base import HfQuantizer
from transformers.utils.quantization_config import QuantizationConfigMixin

from .archs import get_arch
from .modules.rebuild import FP32_BUFFERS, finish_rana

QUANT_METHOD = "rana"
# what plain transformers prints (after "...neither a safetensors file ... nor an index file:") when rana is absent
WEIGHTS_GUARD = ("this model was compressed with rana: `pip install rana` to load it with its quantizer "
                 "(or pass trust_remote_code=True to run the code shipped in the folder)")
RE_EXPORT = "re-export the model with `rana export`"


class RanaQuantizationConfig(QuantizationConfigMixin):
    """What config.json's quantization_config records: the adapters, LAuReL and the format version, checked on
    construction by the schema every loader runs (`rana.io.loadchecks`): a record of the wrong shape or from a
    newer format is one line here, not an AttributeError while the model is rebuilt."""

    def __init__(self, adapters: list | None = None, laurel: dict | None = None, format_version: int | None = None,
                 rana_version: str | None = None, weights: str | None = None, int8: dict | None = None, **_ignored):
        from .io.loadchecks import check_record, record_of  # rana.io imports transformers' auto classes: not at import

        given = {"format_version": format_version, "adapters": adapters, "weights": weights, "int8": int8,
                 "laurel": laurel}
        check_record(record_of(given.get), where=f"the quantization_config ({QUANT_METHOD!r}) in config.json",
                     fix=RE_EXPORT)
        self.quant_method = QUANT_METHOD
        self.format_version = format_version
        self.rana_version = rana_version
        self.adapters = list(adapters)
        self.laurel = dict(laurel) if laurel else None
        # int8 weights (rana.modules.int8): "int8" and {"modules": [paths]}; absent for full-precision exports
        self.weights = weights if weights and weights != "none" else None
        self.int8 = dict(int8) if int8 else None

    def record(self) -> dict:
        """What the rebuild reads (rana.modules.rebuild.install_rana)."""
        from .io.loadchecks import record_of

        return record_of(lambda k: getattr(self, k, None))

    def to_dict(self) -> dict:
        out = {"quant_method": QUANT_METHOD, "format_version": self.format_version,
               "rana_version": self.rana_version, "adapters": self.adapters, "laurel": self.laurel}
        if self.weights:
            out.update({"weights": self.weights, "int8": self.int8})
        return out


def quantization_config_dict(meta: dict, rana_version: str | None) -> dict:
    """config.json's quantization_config for a rana folder's rana_config.json `meta`."""
    return RanaQuantizationConfig(meta.get("adapters"), meta.get("laurel") or None, meta.get("format_version"),
                                  rana_version, meta.get("weights"), meta.get("int8")).to_dict()


def drop_weights_guard(config):
    """Forget the guard file name (`WEIGHTS_GUARD`) so transformers finds the real weights."""
    if getattr(config, "transformers_weights", None) == WEIGHTS_GUARD:
        del config.transformers_weights
    return config


def _where(model: nn.Module) -> str:
    name = getattr(model.config, "name_or_path", "") or ""
    return f"'{name}'" if name else "the checkpoint"


def prepare_model(model: nn.Module, qconfig: RanaQuantizationConfig, checkpoint_files: list | None = None) -> None:
    """Before the weights load (the model on the meta device): empty adapters of the recorded shapes,
    LAuReL residuals, and thresholds kept float32 whatever dtype the rest loads in; then the tensors the
    weight files hold checked against the rebuilt model, as `rana.load` checks them (rana.io.loadchecks): a
    tensor missing (which transformers would leave at its random init), one the record does not describe, int8
    codes not stored as int8 (cast on load) or a shape the record does not make is one line, before any loads.
    `checkpoint_files`: the files transformers is about to read (else those of the folder or downloaded hub
    snapshot the config was read from; none to check for a model built from its config)."""
    from .io import loadchecks  # rana.io imports transformers' auto classes: not at import
    from .io.format import RANA_CONFIG

    dtype = next(model.parameters()).dtype
    loadchecks.install_record(model, qconfig.record(), dtype, where=f"the quantization_config of {_where(model)}",
                              record_name=RANA_CONFIG)
    strict = list(getattr(model, "_keep_in_fp32_modules_strict", None) or [])
    model._keep_in_fp32_modules_strict = strict + [b for b in FP32_BUFFERS if b not in strict]
    name = getattr(model.config, "name_or_path", None)
    if not checkpoint_files and not name:  # a model built from its config, not loaded: no file to check
        return
    files = checkpoint_files or loadchecks.local_weight_files(name) or loadchecks.local_weight_files(_snapshot(name))
    if not files:
        raise loadchecks.ModelLoadError(f"cannot find the weight files of {_where(model)} to check them against its "
                                        f"quantization_config; load it from its local folder")
    found = loadchecks.weight_specs(files, where=_where(model))
    loadchecks.check_tensors(loadchecks.tensor_specs(model.state_dict()), found, absent_ok=loadchecks.may_be_absent(model),
                             where=_where(model), record="config.json", fix=RE_EXPORT)


def _snapshot(repo_id: str) -> str | None:
    """The local folder of a hub checkpoint transformers has downloaded (the weight files sit beside its config),
    for a transformers that does not hand the quantizer its checkpoint files; None when there is none."""
    from transformers.utils import cached_file

    try:
        config = cached_file(repo_id, "config.json", local_files_only=True, _raise_exceptions_for_missing_entries=False)
    except Exception:  # noqa: BLE001 - not a repository id, no cache: nothing to find
        return None
    return os.path.dirname(config) if config else None


@torch.no_grad()
def finalize_model(model: nn.Module, qconfig: RanaQuantizationConfig) -> nn.Module:
    """After the weights load: every adapter as `rana.load` leaves it (decode layouts, float32
    thresholds, fresh column norms and meters, decode groups), the int8 scales and thresholds checked
    as `rana.load` checks them (rana.io.loadchecks).

    The column norms are those of the weights as loaded (bf16 / fp16 when asked for: the weights the
    model multiplies with); `rana.load(folder, dtype=...)` builds in that dtype too and computes them
    the same way, so both paths give the same masks, logits and tokens."""
    from .io.loadchecks import check_loaded  # (see prepare_model)

    finish_rana(model, get_arch(model.config))
    check_loaded(model, qconfig.record(), where=_where(model), record="config.json", fix=RE_EXPORT)
    return model


class RanaHfQuantizer(HfQuantizer):
    """Loads rana exports into the stock model class (weights already compressed: nothing to calibrate)."""

    requires_calibration = True  # rana compresses with `rana compress`, not inside from_pretrained

    def update_attn_implementation(self, config):  # transformers >= 5.2x: sees the config before the weights
        return drop_weights_guard(config)

    def update_tp_plan(self, config):  # transformers 5.17: the same moment
        return drop_weights_guard(config)

    def _process_model_before_weight_loading(self, model, **kwargs):
        prepare_model(model, self.quantization_config, kwargs.get("checkpoint_files"))
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        return finalize_model(model, self.quantization_config)

    def is_serializable(self, *args, **kwargs) -> bool:
        return True

    @property
    def is_trainable(self) -> bool:
        return False


def register() -> None:
    """Add quant_method "rana" to transformers' tables (once; a second call changes nothing)."""
    # not `from transformers.quantizers import auto`: this runs right after that module executed, inside
    # transformers' own imports, before the package attribute is set
    auto = importlib.import_module("transformers.quantizers.auto")
    if QUANT_METHOD not in auto.AUTO_QUANTIZATION_CONFIG_MAPPING:
        auto.register_quantization_config(QUANT_METHOD)(RanaQuantizationConfig)
    if QUANT_METHOD not in auto.AUTO_QUANTIZER_MAPPING:
        auto.register_quantizer(QUANT_METHOD)(RanaHfQuantizer)


__all__ = ["QUANT_METHOD", "WEIGHTS_GUARD", "RanaQuantizationConfig", "RanaHfQuantizer", "quantization_config_dict",
           "drop_weights_guard", "prepare_model", "finalize_model", "register"]

# Importing this module registers it: rana.hf_hook's call can come while this module is itself half
# imported (its `transformers.quantizers.base` import runs transformers' quantizers/__init__ and so the hook).
register()
