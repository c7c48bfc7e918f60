"""The self-guided start (docs/method.md §7): training begins at the dense model and hands over to the
adapted one, ``o = α·dense(x) + (1−α)·adapted(x)`` with α going from 1 to 0."""
from __future__ import annotations

import gc
import math
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..modules.registry import adapter_class, adapter_classes, declared
from .config import FinetuneError
from .source import load_dense


# The adapters SelfGuidance hooks: those whose kind declares a dense twin of the same shape to blend with
# (`self_guided`, rana.modules.registry): "dense", a rank adapter's original weight; "unmasked", a masked
# linear's own weight without the mask. The other registered kinds are not hooked (an activation, a rotated
# norm, the head, stacked experts, a sparse + low-rank pair); a model holding none of the hooked kinds would
# train with no guidance at all, so `check_guided` refuses it.
def guided_kinds() -> tuple[type, ...]:
    """The adapter classes SelfGuidance hooks, in registration order."""
    return tuple(cls for cls in adapter_classes() if cls.self_guided is not None)


def guided_sites(model: nn.Module) -> list[str]:
    """Names of the modules of `model` SelfGuidance hooks (every rank adapter has its dense weight:
    `dense_weights` loads all of them or fails)."""
    return [name for name, m in model.named_modules() if declared(m, "self_guided") is not None]


def check_guided(model: nn.Module, source: str) -> None:
    """FinetuneError, in one line, when `model` (the folder `source`) holds nothing SelfGuidance hooks."""
    if guided_sites(model):
        return
    held = Counter(type(m).__name__ for m in model.modules() if adapter_class(m) is not None)
    if not held:
        raise FinetuneError(f"--self-guided-frac needs RaNA adapters (a rana folder); '{source}' has none")
    holds = ", ".join(f"{n} ×{k}" for n, k in sorted(held.items()))
    needs = ", ".join(c.__name__ for c in guided_kinds())
    raise FinetuneError(
        f"--self-guided-frac: '{source}' holds only adapters the self-guided start cannot blend with a dense "
        f"path ({holds}); it needs at least one of {needs}; pass --self-guided-frac 0")


class SelfGuidance:
    """``o = α·dense(x) + (1−α)·adapted(x)`` on every adapted projection, α: 1 → 0 on a cosine over
    the first ``phase_steps`` steps, then the hooks and the dense weights are dropped.

    The dense path of a rank adapter (RankAdapterLinear, one q/k/v RankSliceLinear) is the original
    dense weight (frozen, not a parameter, never checkpointed); that of a masked linear
    (NeuronThresholdLinear, InputSparseLinear) is its own weight without the mask. Implemented as
    forward hooks, so module names, peft targets and state_dict keys are unchanged.
    """

    def __init__(self, model: nn.Module, dense: dict[str, tuple[torch.Tensor, torch.Tensor | None]], phase_steps: int):
        self.phase_steps = int(phase_steps)
        self.alpha = 1.0
        self.dense = dense
        self.handles = []
        self.sites = 0
        for name, m in model.named_modules():
            kind = declared(m, "self_guided")
            if kind == "dense" and name in dense:
                self.handles.append(m.register_forward_hook(self._rank_hook(name)))
                self.sites += 1
            elif kind == "unmasked":
                self.handles.append(m.register_forward_hook(self._masked_hook))
                self.sites += 1

    def alpha_at(self, step: int) -> float:
        if step >= self.phase_steps:
            return 0.0
        return 0.5 * (1.0 + math.cos(math.pi * step / self.phase_steps))

    def set_step(self, step: int) -> float:
        self.alpha = self.alpha_at(step)
        return self.alpha

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def _mix(self, dense_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        a = self.alpha
        return a * dense_out.to(out.dtype) + (1.0 - a) * out

    def _rank_hook(self, name):
        def hook(module, args, out):
            if self.alpha <= 0.0:
                return None
            w, b = self.dense[name]
            x = args[0]
            return self._mix(F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype)), out)

        return hook

    def _masked_hook(self, module, args, out):
        if self.alpha <= 0.0:
            return None
        return self._mix(module.unmasked(args[0]), out)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.dense.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def dense_weights(model: nn.Module, reference: str, device, dtype) -> dict:
    """The original dense weights of every rank-adapted projection, from the model `reference`."""
    wanted = {n: m for n, m in model.named_modules() if declared(m, "self_guided") == "dense"}
    if not wanted:
        return {}
    try:
        dense, _ = load_dense(reference, "float32")
    except Exception as e:  # noqa: BLE001 - any load failure is reported the same way
        raise FinetuneError(
            f"the self-guided start needs the dense weights of the original model {reference!r}, which could not "
            f"be loaded ({str(e).splitlines()[0] if str(e) else type(e).__name__}); pass --dense-model PATH or "
            "--self-guided-frac 0") from None
    out = {}
    for name, m in wanted.items():
        try:
            d = dense.get_submodule(name)
        except AttributeError:
            d = None
        shape = (m.out_features, m.in_features)
        if not isinstance(d, nn.Linear) or tuple(d.weight.shape) != shape:
            raise FinetuneError(f"--dense-model {reference!r} does not match this model: {name} should be a "
                                f"{shape[0]}×{shape[1]} linear there")
        out[name] = (d.weight.detach().to(device=device, dtype=dtype).clone(),
                     None if d.bias is None else d.bias.detach().to(device=device, dtype=dtype).clone())
    del dense
    gc.collect()
    return out
