"""nn.Modules that replace dense projections; each keeps ordinary nn.Linear children.

Every adapter kind registers itself (`rana.modules.registry`); importing this package imports every module
in it, so a new `rana/modules/<kind>.py` registers by existing. The re-exports below come first and fix the
registration order of the kinds rana has always had (rank adapters, masked linears, CATS, the rotation, the
experts); other modules follow in name order.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .rank_linear import RankAdapterLinear, RankSliceLinear, SharedRankCode
from .neuron_linear import InputSparseHead, InputSparseLinear, NeuronThresholdLinear, SparseLowRankLinear
from .cats import CatsActivation
from .rotation import RotatedInput
from .experts import InputSparseExperts
from .common import MacMeter, column_major_linear
from .groups import DecodeGroup, link_decode_groups, link_layer, relink
from .registry import adapter_class, adapter_classes, register_adapter

for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")

__all__ = [
    "CatsActivation",
    "DecodeGroup",
    "InputSparseExperts",
    "InputSparseHead",
    "InputSparseLinear",
    "MacMeter",
    "NeuronThresholdLinear",
    "RankAdapterLinear",
    "RankSliceLinear",
    "RotatedInput",
    "SharedRankCode",
    "SparseLowRankLinear",
    "adapter_class",
    "adapter_classes",
    "column_major_linear",
    "link_decode_groups",
    "link_layer",
    "register_adapter",
    "relink",
]
