"""Configuration of a RaNA-compressed model written by `rana export` (template rendered at export time).

It is the stock configuration of the source architecture plus what rebuilds the adapters:

* ``rana_adapters``: one dict per adapter module (dotted ``path``, ``type`` — one of the registered
  adapter kinds, `registry.py` —, shapes, ``rank``, ``threshold``; a threshold of ``null`` means -inf,
  i.e. every rank / neuron / input stays active);
* ``rana_laurel``: the LAuReL settings (``LaurelConfig.to_dict()``) or ``null``;
* ``rana_weights`` / ``rana_int8``: ``"int8"`` and the int8 modules (their paths, how they multiply) for int8
  weights, absent for full precision;
* ``rana_format_version`` / ``rana_version``: the rana folder format and package version the export
  was made from.

Loading needs ``trust_remote_code=True`` and only torch + transformers (the ``rana`` package is not
needed; triton is used for batch-1 decoding on CUDA when it is importable, and on CPU a small C
kernel is compiled once with the system compiler when one exists).
"""
from transformers import PretrainedConfig as _StockConfig  # rana:stock-config-import


def rana_fields(quantization_config: dict) -> dict:
    """The remote-code config fields of a quantizer-format quantization_config (quant_method "rana"): each field it
    records, as recorded, under its ``rana_`` name (adapters → rana_adapters, weights → rana_weights, int8 →
    rana_int8, ...), so none is dropped on the way; the model checks them when it is built (``loadchecks.py``)."""
    return {k if k.startswith("rana_") else f"rana_{k}": v for k, v in quantization_config.items()
            if k != "quant_method"}


class RanaConfig(_StockConfig):
    model_type = "rana"  # rana:model-type

    rana_adapters: list | None = None
    rana_laurel: dict | None = None
    rana_weights: str | None = None
    rana_int8: dict | None = None
    rana_format_version: int | None = None
    rana_version: str | None = None

    @classmethod
    def from_dict(cls, config_dict, **kwargs):
        """A quantizer-format config.json (quant_method "rana") read the remote-code way from the start: its
        record becomes the rana_* fields (`rana_fields`), and neither the quantization_config (rana's quantizer,
        absent here, would be needed to parse it: lm-eval parses it before loading) nor the weights guard meant
        for plain transformers without rana is kept."""
        qc = config_dict.get("quantization_config")
        if isinstance(qc, dict) and qc.get("quant_method") == "rana":
            dropped = ("quantization_config", "transformers_weights")
            config_dict = {k: v for k, v in config_dict.items() if k not in dropped}
            config_dict.update(rana_fields(qc))
        return super().from_dict(config_dict, **kwargs)


__all__ = ["RanaConfig", "rana_fields"]
