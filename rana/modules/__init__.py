"""nn.Modules that replace dense projections; each keeps ordinary nn.Linear children."""
from .cats import CatsActivation
from .common import MacMeter, column_major_linear
from .experts import InputSparseExperts
from .groups import DecodeGroup, link_decode_groups, link_layer, relink
from .neuron_linear import InputSparseHead, InputSparseLinear, NeuronThresholdLinear, SparseLowRankLinear
from .rank_linear import RankAdapterLinear, RankSliceLinear, SharedRankCode
from .rotation import RotatedInput

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
    "column_major_linear",
    "link_decode_groups",
    "link_layer",
    "relink",
]
