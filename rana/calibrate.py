"""Sequential (layer-by-layer) calibration: capture decoder-layer inputs, run one layer at a
time, and collect input statistics of its projections with forward pre-hooks.

Only the layer being processed needs to be on the compute device; the calibration hidden
states live on `offload` between layers. No tracing: the model's own forward is used once to
capture the first layer's inputs, then each layer is called directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .archs import ArchSpec, decoder_layers


class CalibrationError(ValueError):
    """Bad calibration data or activations (user-facing)."""


class _Stop(Exception):
    pass


@dataclass
class LayerInputs:
    """Hidden states entering the current layer, per batch, and the keyword arguments the
    model passes every layer (rotary embeddings, masks, positions)."""

    hidden: list[torch.Tensor]
    kwargs: list[dict]

    @property
    def tokens(self) -> int:
        return sum(h.shape[0] * h.shape[1] for h in self.hidden)


def _to(obj, device):
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@torch.no_grad()
def capture_first_layer_inputs(model: nn.Module, spec: ArchSpec, sequences: torch.Tensor, *, batch_size: int,
                               device: torch.device, offload: torch.device) -> LayerInputs:
    """Run the model's embedding stage and stop at decoder layer 0, keeping its inputs."""
    layer0 = decoder_layers(model, spec)[0]
    captured: dict = {}

    def grab(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("past_key_values", "past_key_value", "use_cache")}
        captured["hidden"] = hidden.to(offload)
        captured["kwargs"] = _to(kwargs, offload)
        raise _Stop

    handle = layer0.register_forward_pre_hook(grab, with_kwargs=True)
    hidden, kwargs = [], []
    try:
        for start in range(0, sequences.shape[0], batch_size):
            batch = sequences[start:start + batch_size].to(device)
            try:
                model(input_ids=batch, use_cache=False)
            except _Stop:
                pass
            hidden.append(captured["hidden"])
            kwargs.append(captured["kwargs"])
    finally:
        handle.remove()
    return LayerInputs(hidden=hidden, kwargs=kwargs)


def _layer_output(out):
    return out[0] if isinstance(out, (tuple, list)) else out


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: LayerInputs, *, device: torch.device, offload: torch.device) -> LayerInputs:
    """Push the hidden states through one (possibly compressed) layer."""
    out = []
    for h, kw in zip(inputs.hidden, inputs.kwargs):
        y = _layer_output(layer(h.to(device), **_to(kw, device)))
        out.append(y.to(offload))
    return LayerInputs(hidden=out, kwargs=inputs.kwargs)


@dataclass
class InputStats:
    """What the searches need of one projection's inputs: C = Σ x xᵀ (float64) over the fit
    tokens, a sample of *other* fit tokens for thresholds (tokens the decomposition never saw,
    so mask rates are not biased by its fit to C), and the held-aside inputs (for errors)."""

    moment: torch.Tensor | None = None
    count: int = 0
    fit_rows: list[torch.Tensor] = field(default_factory=list)
    eval_rows: list[torch.Tensor] = field(default_factory=list)
    cache: dict = field(default_factory=dict, repr=False)  # derived results reused across searches

    def cached(self, key, compute):
        """Memoise work derived from these statistics (decompositions, codes), e.g. when the
        budget allocator searches the same block at several budgets."""
        if key not in self.cache:
            self.cache[key] = compute()
        return self.cache[key]

    @property
    def fit(self) -> torch.Tensor:
        return torch.cat(self.fit_rows)

    @property
    def eval(self) -> torch.Tensor:
        return torch.cat(self.eval_rows)


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
    fit_sample_tokens: int = 4096,
    threshold_fraction: float = 0.15,
    layer_index: int = 0,
) -> dict[str, InputStats]:
    """Run `layer` on fit and held-aside tokens, recording the inputs of each target module.

    `stop_at`: abort each forward as soon as this module's input is recorded (nothing after
    it is needed), which skips e.g. the MLP when only attention inputs are wanted.
    """
    stats = {name: InputStats() for name in targets}
    phase = {"eval": False, "moment": True, "sample": True}

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
                s.eval_rows.append(x2.float().cpu())
            else:
                if phase["moment"] and name in second_moment:
                    xd = x2.float()
                    c = (xd.T @ xd).double()
                    s.moment = c if s.moment is None else s.moment + c
                    s.count += x2.shape[0]
                if phase["sample"]:
                    s.fit_rows.append(x2.float().cpu())
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
                try:
                    layer(h.to(device), **_to(kw, device))
                except _Stop:
                    pass
    finally:
        for hd in handles:
            hd.remove()
    return stats
