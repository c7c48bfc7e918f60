"""Configuration of a RaNA-compressed model written by `rana export` (template rendered at export time).

It is the stock configuration of the source architecture plus what rebuilds the adapters:

* ``rana_adapters``: one dict per adapter module (dotted ``path``, ``type`` — one of the registered
  adapter kinds, `registry.py` —, shapes, ``rank``, ``threshold``; a threshold of ``null`` means -inf,
  i.e. every rank / neuron / input stays active);
* ``rana_laurel``: the LAuReL settings (``LaurelConfig.to_dict()``) or ``null``;
* ``rana_format_version`` / ``rana_version``: the rana folder format and package version the export
  was made from.

Loading needs ``trust_remote_code=True`` and only torch + transformers (the ``rana`` package is not
needed; triton is used for batch-1 decoding on CUDA when it is importable, and on CPU a small C
kernel is compiled once with the system compiler when one exists).
"""
from transformers import PretrainedConfig as _StockConfig  # rana:stock-config-import


class RanaConfig(_StockConfig):
    model_type = "rana"  # rana:model-type

    rana_adapters: list | None = None
    rana_laurel: dict | None = None
    rana_format_version: int | None = None
    rana_version: str | None = None

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """A quantizer-format config.json (quant_method "rana") read the remote-code way from the start: its
        adapters and LAuReL settings become rana_adapters / rana_laurel, and neither the quantization_config
        (rana's quantizer, absent here, would be needed to parse it: lm-eval parses it before loading) nor
        the weights guard meant for plain transformers without rana is kept."""
        qc = config_dict.get("quantization_config")
        if isinstance(qc, dict) and qc.get("quant_method") == "rana":
            dropped = ("quantization_config", "transformers_weights")
            config_dict = {k: v for k, v in config_dict.items() if k not in dropped}
            config_dict["rana_adapters"] = list(qc.get("adapters") or [])
            config_dict["rana_laurel"] = qc.get("laurel")
            config_dict.setdefault("rana_format_version", qc.get("format_version"))
            config_dict.setdefault("rana_version", qc.get("rana_version"))
        return super().from_dict(config_dict, **kwargs)


__all__ = ["RanaConfig"]
