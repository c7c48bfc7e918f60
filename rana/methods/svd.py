"""Static SVD baseline: each adapted projection (q/k/v stacked, up, gate, down) becomes the
Theorem-1 rank-r factorisation of its calibration inputs, with no mask: r (i + o) = the budget."""
from __future__ import annotations

import math

from ..math.decompose import decompose
from ..math.search import RankChoice
from .base import (InputStats, LayerContext, MemoryNeed, Method, Step, install_choice, install_stacked_qkv,
                   qkv_modules, register, stacked_weight, summary)


def static_choice(fraction: float, out_features: int, in_features: int) -> RankChoice:
    """The rank whose unmasked cost r (i + o) meets `fraction` of o·i MACs (dense when it cannot save)."""
    o, i = out_features, in_features
    rank = max(1, int(round(fraction * o * i / (i + o))))
    if rank * (i + o) >= o * i:
        return RankChoice(rank=0, threshold=-math.inf, expected_active=float(min(i, o)), macs=float(o * i), error=0.0,
                          kind="dense")
    return RankChoice(rank=rank, threshold=-math.inf, expected_active=float(rank), macs=float(rank * (i + o)), error=0.0)


def attention(ctx: LayerContext, stats: dict[str, InputStats]) -> dict:
    mods = qkv_modules(ctx)
    W, bias = stacked_weight([m for _, m in mods])
    s = stats["qkv_in"]
    choice = static_choice(ctx.fraction, *W.shape)
    dec = None if choice.dense else s.cached(("dec", tuple(id(m.weight) for _, m in mods)), lambda: decompose(W, s.moment))
    return summary({"qkv": install_stacked_qkv(ctx, choice, dec, W, bias)})


def mlp(ctx: LayerContext, stats: dict[str, InputStats]) -> dict:
    entries = {}
    for name, path in ctx.spec.mlp_paths().items():
        lin = ctx.module(path)
        choice = static_choice(ctx.fraction, *lin.weight.shape)
        moment = stats["down" if name == "down" else "mlp_in"].moment
        dec = None if choice.dense else decompose(lin.weight, moment)
        entries[name] = install_choice(ctx, path, lin, choice, dec=dec)
    return summary(entries)


register(Method(
    "svd", ("q", "k", "v", "up", "gate", "down"),
    (Step(("qkv_in",), "qkv_in", ("qkv_in",), attention),
     Step(("mlp_in", "down"), "down", ("mlp_in", "down"), mlp, "mlp")),
    min_fraction=0.01, description="static Theorem-1 factorisation, no masks",
    memory=MemoryNeed(stacked_gate_up=False, decomposes_down=True, wide_sample_rows=True),
    style=dict(color="tab:green", marker="v")))
