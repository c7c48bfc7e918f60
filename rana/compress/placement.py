"""Where each tensor of a compression run lives, and in which dtype (the one contract every
method and both allocations follow).

* Weights and adapters: the model dtype, on the compute device while their layer is processed
  (`rana.compress.residency.Residency` moves the layer there and back).
* Calibration activations between layers (hidden states and the per-layer keyword arguments):
  on the offload device, in the model dtype. They cross between the offload and the compute
  device only through `to_compute` / `to_offload` below, so a test can watch that one place.
* Statistics, thresholds and search buffers: float32 (`STAT_DTYPE`) rows and float64
  (`MOMENT_DTYPE`) second moments, on the compute device: the searches multiply them with the
  weights there, and a bf16 row would put bf16 rounding into every threshold. Thresholds are
  stored as float32 buffers whatever the model dtype.
* Block inputs fed back to a compressed module (errors measured on held-aside rows) are cast
  to the module's own dtype with `as_module_input`.
"""
from __future__ import annotations

import torch

STAT_DTYPE = torch.float32
MOMENT_DTYPE = torch.float64


def _move(obj, device: torch.device):
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_move(o, device) for o in obj)
    if isinstance(obj, list):
        return [_move(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    return obj


def to_compute(obj, device: torch.device):
    """Activations (a tensor, or nested tuples / lists / dicts of them) onto the compute device."""
    return _move(obj, device)


def to_offload(obj, offload: torch.device):
    """Activations (a tensor, or nested tuples / lists / dicts of them) onto the offload device."""
    return _move(obj, offload)


def stat_rows(x: torch.Tensor) -> torch.Tensor:
    """A projection input (any dtype, on the compute device) as float32 statistic rows there."""
    return x.detach().reshape(-1, x.shape[-1]).to(STAT_DTYPE)


def second_moment(x: torch.Tensor) -> torch.Tensor:
    """Σ x xᵀ over the rows of one batch, on x's device: the product in float32 (one batch is a
    few thousand tokens), returned in float64 so that the sum over batches, which feeds an
    eigendecomposition, does not lose the small directions."""
    xf = x.to(STAT_DTYPE)
    return (xf.T @ xf).to(MOMENT_DTYPE)


def as_module_input(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    """Rows kept in float32 as input to `module`, in the dtype and on the device of its weights."""
    p = next((p for p in module.parameters() if p.is_floating_point()), None)
    return x if p is None else x.to(device=p.device, dtype=p.dtype)

