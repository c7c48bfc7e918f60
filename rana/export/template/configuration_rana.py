"""Configuration of a RaNA-compressed model written by `rana export` (template rendered at export time).

It is the stock configuration of the source architecture plus what rebuilds the adapters:

* ``rana_adapters``: one dict per adapter module (dotted ``path``, ``type`` — rank / shared_code /
  rank_slice / neuron / input_sparse / cats —, shapes, ``rank``, ``threshold``; a threshold of
  ``null`` means -inf, i.e. every rank / neuron / input stays active);
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


__all__ = ["RanaConfig"]
