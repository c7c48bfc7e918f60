"""nn.Modules that replace dense projections; each keeps ordinary nn.Linear children."""
from .cats import CatsActivation
from .common import MacMeter, column_major_linear
from .neuron_linear import InputSparseLinear, NeuronThresholdLinear, SparseLowRankLinear
from .rank_linear import RankAdapterLinear, RankSliceLinear, SharedRankCode

__all__ = [
    "CatsActivation",
    "InputSparseLinear",
    "MacMeter",
    "NeuronThresholdLinear",
    "RankAdapterLinear",
    "RankSliceLinear",
    "SharedRankCode",
    "SparseLowRankLinear",
    "column_major_linear",
]
