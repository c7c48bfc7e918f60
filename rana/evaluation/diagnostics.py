"""Where a compressed model's error comes from: each layer's QKV / o / MLP output error against
the dense model on the same inputs (`layer_errors`), and how the rank adapters' codes spread
their energy over the ranks (`rank_contributions`, the RaNA paper's Fig. 2)."""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn as nn

from ..archs import decoder_layers, get_arch
from ..data import eval_windows
from ..errors import UserError
from ..modules.registry import declared
from .common import model_device


def _windows(tokens: torch.Tensor, seq_len: int, max_tokens: int | None) -> torch.Tensor:
    """(n, T) windows from a 1-D stream (cut into `seq_len` windows) or as given, capped at ~max_tokens."""
    if tokens.dim() == 1:
        tokens = tokens[:max_tokens] if max_tokens else tokens
        return eval_windows(tokens, min(seq_len, tokens.numel())).long()
    if max_tokens:
        tokens = tokens[: max(1, max_tokens // tokens.shape[1])]
    return tokens.long()


def _changed(module: nn.Module, dense: nn.Module) -> bool:
    """True when a block's module tree differs in type from the dense one (an adapter was swapped in)."""
    return [type(m) for m in module.modules()] != [type(m) for m in dense.modules()]


@torch.no_grad()
def layer_errors(model: nn.Module, dense_model: nn.Module, tokens: torch.Tensor, *, seq_len: int = 512,
                 batch_size: int = 4, max_tokens: int | None = 8192) -> list[dict]:
    """Relative output error of each layer's QKV block, o_proj and MLP on given tokens.

    `model` runs on `tokens` (a 1-D stream cut into `seq_len` windows, or (n, T) windows); at
    every adapted block the *same* input is also fed to the corresponding block of
    `dense_model`, and `‖y − y_dense‖² / ‖y_dense‖²` is accumulated over all tokens — the
    measure plan.json's `heldout_error` reports for the held-aside calibration tokens (there
    the inputs come from the compressed model's own earlier layers too). QKV is q, k and v
    stacked. Blocks left dense report 0.0 with `*_adapted: False`.
    """
    spec = get_arch(model.config)
    layers, dense_layers = decoder_layers(model, spec), decoder_layers(dense_model, spec)
    if dense_model is model:  # the dense model against itself
        return [{"layer": i, **{k: v for part in ("attention", "o", "mlp") for k, v in ((part, 0.0), (f"{part}_adapted", False))}}
                for i in range(len(layers))]
    if len(layers) != len(dense_layers):
        raise UserError(f"model has {len(layers)} layers, dense model {len(dense_layers)}: not the same architecture")
    dense_device = model_device(dense_model)
    acc: dict[tuple[int, str], list[float]] = {}
    adapted: dict[tuple[int, str], bool] = {}
    handles = []

    def add(key, y, ref):
        a = acc.setdefault(key, [0.0, 0.0])
        a[0] += float((y.double().to(ref.device) - ref.double()).pow(2).sum())
        a[1] += float(ref.double().pow(2).sum())

    def hook_for(key, dense_module):
        def hook(_m, args, output):
            x = args[0]
            add(key, output, dense_module(x.to(dense_device)))
        return hook

    for idx, (layer, dlayer) in enumerate(zip(layers, dense_layers)):
        qkv = list(spec.qkv_paths().values())
        mods = [layer.get_submodule(path) for path in qkv]
        adapted[(idx, "attention")] = any(_changed(m, dlayer.get_submodule(path)) for path, m in zip(qkv, mods))
        for path, m in zip(qkv, mods):
            handles.append(m.register_forward_hook(hook_for((idx, "attention"), dlayer.get_submodule(path))))
        o = layer.get_submodule(spec.o_path())
        adapted[(idx, "o")] = _changed(o, dlayer.get_submodule(spec.o_path()))
        handles.append(o.register_forward_hook(hook_for((idx, "o"), dlayer.get_submodule(spec.o_path()))))
        mlp = layer.get_submodule(spec.mlp)
        adapted[(idx, "mlp")] = _changed(mlp, dlayer.get_submodule(spec.mlp))
        handles.append(mlp.register_forward_hook(hook_for((idx, "mlp"), dlayer.get_submodule(spec.mlp))))
    windows = _windows(tokens, seq_len, max_tokens)
    device = model_device(model)
    was = model.training, dense_model.training
    model.eval()
    dense_model.eval()
    try:
        for start in range(0, len(windows), batch_size):
            model(input_ids=windows[start:start + batch_size].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was[0])
        dense_model.train(was[1])
    out = []
    for idx in range(len(layers)):
        row = {"layer": idx}
        for part in ("attention", "o", "mlp"):
            num, den = acc.get((idx, part), (0.0, 0.0))
            row[part] = num / den if den > 0 else 0.0
            row[f"{part}_adapted"] = adapted[(idx, part)]
        out.append(row)
    return out


# --------------------------------------------------------------------------- rank contributions (Fig. 2)


def rank_adapters(model: nn.Module) -> dict[str, nn.Module]:
    """Modules that compute a rank code `z = B x` (their kind's `rank_code`: RankAdapterLinear, SharedRankCode)."""
    return {n: m for n, m in model.named_modules() if declared(m, "rank_code")}


@torch.no_grad()
def rank_contributions(model: nn.Module, tokens: torch.Tensor, *, layers: Sequence[int] | None = None,
                       seq_len: int = 512, batch_size: int = 4, max_tokens: int = 2048,
                       bins: Sequence[float] | None = None) -> dict[str, dict]:
    """Histogram of per-token normalised rank contributions `z_j² / Σ_k z_k²` (z = B x) of the
    rank adapters in `layers` (default: the middle decoder layer), captured by forward hooks on
    their `B` child while the model runs on `tokens`. Since A's columns are orthonormal, z_j² is
    rank j's share of ‖y‖² (before masking). Also reports the mean share of ranks the mask
    keeps and the mean share of energy they carry."""
    adapters = rank_adapters(model)
    if not adapters:
        return {}
    spec = get_arch(model.config)
    n_layers = len(decoder_layers(model, spec))
    wanted = set(layers) if layers is not None else {n_layers // 2}
    prefix = spec.layers + "."
    chosen = {n: m for n, m in adapters.items()
              if n.startswith(prefix) and int(n[len(prefix):].split(".")[0]) in wanted}
    edges = np.asarray(bins if bins is not None else np.logspace(-10, 0, 61), dtype=np.float64)
    stats = {n: {"counts": np.zeros(len(edges) - 1, dtype=np.int64), "tokens": 0, "kept": 0.0, "energy_kept": 0.0,
                 "rank": int(m.rank), "threshold": float(m.threshold)} for n, m in chosen.items()}

    def hook_for(name, module):
        def hook(_m, _args, z):
            z2 = z.detach().double().reshape(-1, z.shape[-1]).pow(2)
            total = z2.sum(-1, keepdim=True).clamp_min(1e-300)
            share = (z2 / total).clamp(float(edges[0]), float(edges[-1]))
            s = stats[name]
            s["counts"] += np.histogram(share.cpu().numpy().ravel(), bins=edges)[0]
            mask = z2 >= float(module.threshold)
            s["kept"] += float(mask.double().mean(-1).sum())
            s["energy_kept"] += float(((z2 * mask).sum(-1) / total.squeeze(-1)).sum())
            s["tokens"] += z2.shape[0]
        return hook

    handles = [m.B.register_forward_hook(hook_for(n, m)) for n, m in chosen.items()]
    windows = _windows(tokens, seq_len, max_tokens)
    device = model_device(model)
    was = model.training
    model.eval()
    try:
        for start in range(0, len(windows), batch_size):
            model(input_ids=windows[start:start + batch_size].to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train(was)
    out = {}
    for n, s in stats.items():
        t = max(s["tokens"], 1)
        out[n] = {"bin_edges": edges.tolist(), "counts": s["counts"].tolist(), "tokens": s["tokens"], "rank": s["rank"],
                  "threshold": None if math.isinf(s["threshold"]) else s["threshold"],
                  "mean_kept_fraction": s["kept"] / t, "mean_energy_kept": s["energy_kept"] / t}
    return out
