"""Sequential (layer-by-layer) calibration: capture decoder-layer inputs, run one layer at a
time, and collect input statistics of its projections with forward pre-hooks.

Only the layer being processed needs to be on the compute device; the calibration hidden
states live on `offload` between layers. No tracing: the model's own forward is used once to
capture the first layer's inputs, then each layer is called directly.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from . import distributed, placement
from ..archs import ArchSpec, stubbed_decoder_layers
from ..methods.base import InputStats
from ..errors import UserError


class CalibrationError(UserError):
    """Bad calibration data or activations (user-facing)."""


class _Stop(Exception):
    pass


@dataclass
class LayerInputs:
    """Hidden states entering the current layer, per batch, and the keyword arguments the
    model passes every layer (rotary embeddings, masks, positions)."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]
    # applied to each layer output kept between layers (e.g. spill it to a memory-mapped file)
    spill: Callable[[torch.Tensor], torch.Tensor] | None = None

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


class LayerKwargs(dict):
    """The keyword arguments the model passes the current decoder layer for one batch, knowing
    those of every layer: sliding-window and global layers get different masks (Gemma 2/3) and
    rotary embeddings (Gemma 3), so `advance()` gives the next layer's. Layers of one type share
    the same dict. `batch_id` / `role` place the batch in the global calibration set when it is
    split across processes (`rana.compress.distributed`; role None: single process)."""

    def __init__(self, per_layer: list[dict], layer: int = 0, batch_id: int | None = None, role: str | None = None):
        super().__init__(per_layer[layer])
        self.per_layer, self.layer, self.batch_id, self.role = per_layer, layer, batch_id, role

    def advance(self) -> "LayerKwargs":
        return LayerKwargs(self.per_layer, min(self.layer + 1, len(self.per_layer) - 1), self.batch_id, self.role)


def _same_value(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return a is b
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==
        return a is b


def _share_per_layer(raw: list[dict], offload: torch.device) -> list[dict]:
    """Move each layer's kwargs to `offload`, one copy per distinct set (layer type)."""
    unique: list[tuple[dict, dict]] = []
    out = []
    for kw in raw:
        for seen, moved in unique:
            if _same_value(seen, kw):
                out.append(moved)
                break
        else:
            moved = placement.to_offload(kw, offload)
            unique.append((kw, moved))
            out.append(moved)
    return out


@torch.no_grad()
def capture_first_layer_inputs(model: nn.Module, spec: ArchSpec, sequences: torch.Tensor, *, batch_size: int,
                               device: torch.device, offload: torch.device) -> LayerInputs:
    """Run the model's embedding stage with every decoder layer stubbed out (its forward only
    records its keyword arguments and passes the hidden states on; nothing after the last layer
    runs), keeping layer 0's inputs and every layer's kwargs. The decoder layers are never
    computed, so their weights may be anywhere (offload device, or not loaded at all).

    Under `rana.compress.distributed`, each process keeps only its share of the batches."""
    hidden, kwargs = [], []
    n_batches = (sequences.shape[0] + batch_size - 1) // batch_size
    with stubbed_decoder_layers(model, spec) as run:
        for b, role in distributed.local_batches(n_batches):
            first, per_layer = run(sequences[b * batch_size:(b + 1) * batch_size].to(device))
            hidden.append(placement.to_offload(first, offload))
            kwargs.append(LayerKwargs(_share_per_layer(per_layer, offload), 0, b, role))
    return LayerInputs(hidden=hidden, kwargs=kwargs)


def _layer_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def call_layer(layer: nn.Module, hidden: torch.Tensor, kwargs: dict, device: torch.device) -> torch.Tensor:
    """One layer on one batch of offloaded activations; its output stays on the compute device."""
    return _layer_output(layer(placement.to_compute(hidden, device), **placement.to_compute(dict(kwargs), device)))


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs, *, device: torch.device, offload: torch.device) -> LayerInputs:
    """Push the hidden states through one (possibly compressed) layer."""
    out = []
    for h, kw in zip(inputs.hidden, inputs.kwargs):
        y = placement.to_offload(call_layer(layer, h, kw, device), offload)
        out.append(inputs.spill(y) if inputs.spill is not None else y)
    nxt = [kw.advance() if isinstance(kw, LayerKwargs) else kw for kw in inputs.kwargs]
    return LayerInputs(hidden=out, kwargs=nxt, spill=inputs.spill)


@torch.no_grad()
def collect_inputs(
    layer: nn.Module,
    fit: LayerInputs,
    heldout: LayerInputs,
    targets: dict[str, nn.Module],
    *,
    device: torch.device,
    stop_at: nn.Module | None = None,
    second_moment: tuple[str, ...] = (),
    threshold_fraction: float = distributed.THRESHOLD_FRACTION,
    layer_index: int = 0,
) -> dict[str, InputStats]:
    """Run `layer` on fit and held-aside tokens, recording the inputs of each target module.

    `stop_at`: abort each forward as soon as this module's input is recorded (nothing after
    it is needed), which skips e.g. the MLP when only attention inputs are wanted.
    """
    stats = {name: InputStats() for name in targets}
    phase = {"eval": False, "moment": True, "sample": True, "batch": None}
    row_ids = {name: {"fit": [], "eval": []} for name in targets}  # global batch id of each row chunk

    def make_hook(name: str, module: nn.Module):
        def hook(_m, args, kwargs):
            x = args[0] if args else next(iter(kwargs.values()))
            x2 = x.reshape(-1, x.shape[-1])
            if not torch.isfinite(x2).all():
                raise CalibrationError(
                    f"non-finite activations (NaN/inf) at the input of '{name}' in layer {layer_index}; "
                    "the model overflows in this dtype: retry with --dtype float32")
            s = stats[name]
            if phase["eval"]:
                s.eval_rows.append(placement.stat_rows(x2))
                row_ids[name]["eval"].append(phase["batch"])
            else:
                if phase["moment"] and name in second_moment:
                    c = placement.second_moment(x2)
                    s.moment = c if s.moment is None else s.moment + c
                    s.count += x2.shape[0]
                if phase["sample"]:
                    s.fit_rows.append(placement.stat_rows(x2))
                    row_ids[name]["fit"].append(phase["batch"])
            if module is stop_at:
                raise _Stop
        return hook

    handles = [m.register_forward_pre_hook(make_hook(n, m), with_kwargs=True) for n, m in targets.items()]
    try:
        n_fit = len(fit.hidden)
        n_thr = max(1, round(n_fit * threshold_fraction)) if n_fit > 1 else 0
        for is_eval, inputs in ((False, fit), (True, heldout)):
            phase["eval"] = is_eval
            for b, (h, kw) in enumerate(zip(inputs.hidden, inputs.kwargs)):
                # the last n_thr fit batches feed thresholds only; the rest feed C
                phase["moment"] = n_thr == 0 or b < n_fit - n_thr
                phase["sample"] = n_thr == 0 or b >= n_fit - n_thr
                role = getattr(kw, "role", None)  # set when the batches are split across processes
                if role is not None:
                    phase["moment"], phase["sample"] = role in ("moment", "both"), role in ("sample", "both")
                phase["batch"] = getattr(kw, "batch_id", None)
                try:
                    call_layer(layer, h, kw, device)
                except _Stop:
                    pass
    finally:
        for hd in handles:
            hd.remove()
    if distributed.active():  # pool moments and sample / held-aside rows over processes
        dims = {n: getattr(m, "in_features", None) for n, m in targets.items()}
        distributed.reduce_stats(stats, row_ids, dims, second_moment, device)
    return stats
