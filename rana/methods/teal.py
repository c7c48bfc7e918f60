"""TEAL (training-free activation sparsity): every projection keeps the inputs with the largest
magnitude |x_j|, at one threshold per projection set from the fit tokens for the layer's fraction."""
from __future__ import annotations

import torch

from ..math.masks import subsample_rows, threshold_for_keep_fraction
from . import moe
from .base import (InputStats, LayerContext, MemoryNeed, Method, install_choice, per_role_steps, register, sparse_choice,
                   summary)


def _sparsify(ctx: LayerContext, stats: dict[str, InputStats], role: str, paths: dict[str, str]) -> dict:
    x_fit = subsample_rows(stats[role].fit, ctx.fit_sample_tokens)
    keep = min(1.0, ctx.fraction)
    return summary({name: _threshold(ctx, path, x_fit, keep) for name, path in paths.items()})


def _threshold(ctx: LayerContext, path: str, x_fit: torch.Tensor, keep: float) -> dict:
    lin = ctx.module(path)
    o, i = lin.weight.shape
    t = threshold_for_keep_fraction(x_fit.abs(), keep)
    return install_choice(ctx, path, lin, sparse_choice(t, keep * i, o * keep * i), score="magnitude")


def qkv(ctx: LayerContext, stats: dict[str, InputStats]) -> dict:
    return _sparsify(ctx, stats, "qkv_in", {p.rsplit(".", 1)[-1]: p for p in ctx.spec.qkv_paths().values()})


def o_projection(ctx: LayerContext, stats: dict[str, InputStats]) -> dict:
    return _sparsify(ctx, stats, "o", {"o": ctx.spec.o_path()})


def up_gate(ctx: LayerContext, stats: dict[str, InputStats]) -> dict:
    return _sparsify(ctx, stats, "mlp_in", {n: p for n, p in ctx.spec.mlp_paths().items() if n != "down"})


def down(ctx: LayerContext, stats: dict[str, InputStats]) -> dict:
    return _sparsify(ctx, stats, "down", {"down": ctx.spec.role_path("down")})


register(Method(
    "teal", ("q", "k", "v", "o", "up", "gate", "down"),
    per_role_steps(qkv_in=qkv, o=o_projection, mlp_in=up_gate, down=down),
    min_fraction=0.0, description="TEAL: magnitude sparsity of every projection's input",
    memory=MemoryNeed(decomposes=False, wide_sample_rows=True), style=dict(color="tab:purple", marker="D"),
    moe_steps=(moe.STEP,)))
