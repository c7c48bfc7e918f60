"""nn.Modules that replace dense projections; each keeps ordinary nn.Linear children."""
from .cats import CatsActivation
from .common import MacMeter, column_major_linear
from .neuron_linear import InputSparseHead, InputSparseLinear, NeuronThresholdLinear
from .rank_linear import RankAdapterLinear, RankSliceLinear, SharedRankCode

__all__ = [
    "CatsActivation",
    "InputSparseHead",
    "InputSparseLinear",
    "MacMeter",
    "NeuronThresholdLinear",
    "RankAdapterLinear",
    "RankSliceLinear",
    "SharedRankCode",
    "column_major_linear",
]
