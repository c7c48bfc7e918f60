"""R-Sparse (Zhang et al., ICLR 2025): input sparsity whose dropped inputs are not lost but go
through a rank-r approximation of the weight, `W (m ⊙ x) + A B ((1 − m) ⊙ x)`.

Every projection (q, k, v, o, up, gate, down) spends the layer's fraction of its dense cost;
the split of that budget between the kept inputs and the side path (`r·(i + o)`, paid on every
token) is searched per projection on held-aside tokens (`rana.math.sparse_lowrank`). The paper
searches the mix per layer with an evolutionary search on the model's loss; this is its
layer-local, training-free counterpart under the same accounting as every other method.
"""
from __future__ import annotations

from typing import Callable

import torch

from ..math.search import side_path_choice
from ..math.sparse_lowrank import Svd
from .base import (InputStats, LayerContext, MemoryNeed, Method, fit_eval_rows, install_choice, per_role_steps, register,
                   summary)


def _adapt(ctx: LayerContext, path: str, x_fit: torch.Tensor, x_eval: torch.Tensor) -> dict:
    """The projection at `path`: magnitude sparsity, with a side path when one lowers the error
    (plain magnitude sparsity installs the ordinary input-sparse module)."""
    lin = ctx.module(path)
    W = lin.weight.detach()
    svd = Svd.of(W)
    c = side_path_choice(x_fit, x_eval, W, min(1.0, ctx.fraction) * W.numel(), svd)
    return install_choice(ctx, path, lin, c, score="magnitude", side=svd, search_error=c.error)


def _step(role: str, names: Callable):
    def apply(ctx: LayerContext, stats: dict[str, InputStats]) -> dict:
        x_fit, x_eval = fit_eval_rows(ctx, stats[role])
        return summary({name: _adapt(ctx, path, x_fit, x_eval) for name, path in names(ctx.spec).items()})
    return apply


_qkv = _step("qkv_in", lambda spec: {p.rsplit(".", 1)[-1]: p for p in spec.qkv_paths().values()})
_o = _step("o", lambda spec: {"o": spec.o_path()})
_up_gate = _step("mlp_in", lambda spec: {n: p for n, p in spec.mlp_paths().items() if n != "down"})
_down = _step("down", lambda spec: {"down": spec.role_path("down")})

register(Method(
    "rsparse", ("q", "k", "v", "o", "up", "gate", "down"),
    per_role_steps(qkv_in=_qkv, o=_o, mlp_in=_up_gate, down=_down),
    min_fraction=0.0,
    description="R-Sparse: magnitude sparsity of every projection's input plus a rank-r SVD path for "
                "the dropped inputs; rank and threshold searched per projection on held-aside tokens",
    memory=MemoryNeed(stacked_gate_up=False, decomposes_down=True, wide_sample_rows=True), style=dict(color="tab:brown", marker="v")))
