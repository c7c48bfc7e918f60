"""WINA with its column-orthogonalising transform (Chen et al. 2025, arXiv 2505.19427, Sect. 3.3),
as an explicit rotation whose run-time cost is counted.

WINA keeps the inputs with the largest |x_j|·‖W[:, j]‖; that criterion minimises the output error
when W's columns are orthogonal. With W = U Σ Vᵀ, W' = W V = U Σ has orthogonal columns and reads
x' = Vᵀ x: W' x' = W x. The paper does this for the key projection of every attention block and the
gate projection of every MLP and carries the rotated input to the block's other readers (q, v; up)
through computational invariance. Here:

- **Each block's normalised input, its own d × d rotation, paid at run time.** R_attn = V of the
  key projection's weight (k's rows of a fused qkv), R_mlp = V of the gate's (the gate rows of a
  fused gate_up; up / fc_in in a non-gated MLP). Every reader of that normed input gets W R (exact:
  W n = (W R)(Rᵀ n)); the norm is wrapped in `RotatedInput`, which outputs n R. Nothing is folded
  into the norm or the residual stream: with a different R per block the skip path would need
  R_lᵀ R_{l+1} anyway. Cost: d² MACs per token per rotated block input (2 per layer), metered and
  taken from the adapted projections' budget (`runtime_macs`), so they keep correspondingly less.
  Stored: one d × d matrix per block input.
- **o's input, per KV head, free.** V of o's column block of each KV group (the query heads of a
  GQA group stacked) is folded into v's output rows and o's input columns (as `larosa-heads`):
  o's columns become orthogonal within each head (within each group's stacked heads under GQA),
  at 0 MACs. Not where the fused qkv interleaves v's rows per head (`ArchSpec.qkv_interleaved`,
  GPT-NeoX): o is plain there.
- **down** keeps WINA's plain criterion (its input follows the nonlinearity).

Then WINA exactly as `wina` (|x_j|·‖W'[:, j]‖ on the rotated inputs, each projection at the
layer's fraction, sequential calibration), fitted on the rotated model. The rotation needs no
calibration data; it is applied to the whole model before the layer loop (not with layers streamed
from disk). It needs a pre-norm on each block to carry the rotation: OLMo 2, whose blocks read the raw
residual stream, is refused.
"""
from __future__ import annotations

import time
from dataclasses import replace

import torch
import torch.nn as nn

from ..accounting import layer_dims
from ..archs import ArchSpec, decoder_layers, set_submodule
from ..archs.base import UnsupportedArchitectureError
from ..modules import RotatedInput
from .base import function_preserving, register
from .larosa import _rotate_heads, _set, _value_rows
from .rana import Candidates, rana_method

# ---------------------------------------------------------------------------- pure math


def column_orthogonalising_rotation(weight: torch.Tensor) -> torch.Tensor:
    """V (float64, in × in, orthogonal) of W = U Σ Vᵀ: W V = U Σ has orthogonal columns, largest first
    (the columns past W's rank are zero)."""
    _, _, Vh = torch.linalg.svd(weight.detach().double(), full_matrices=True)
    return Vh.T.contiguous()


def head_rotations(o_weight: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """Per KV group g, V_g (float64, head_dim × head_dim) of o's input columns of the group's query
    heads stacked row-wise: Σ_h (W_o,h V_g)ᵀ (W_o,h V_g) is diagonal (each head's block alone when
    every query head has its own KV head)."""
    out_features, width = o_weight.shape
    hd = width // n_heads
    cols = o_weight.detach().double().reshape(out_features, n_kv, n_heads // n_kv, hd)
    stacked = cols.permute(1, 2, 0, 3).reshape(n_kv, (n_heads // n_kv) * out_features, hd)
    return torch.stack([column_orthogonalising_rotation(m) for m in stacked])


# ---------------------------------------------------------------------------- the model


def _dims(config) -> tuple[int, int, int, int, int]:
    """hidden, layers, query heads, KV heads, head_dim (from the accounting's reading of the config)."""
    dims = layer_dims(config)
    first = dims[0]
    return first.hidden, len(dims), first.n_heads, first.kv_out // first.head_dim, first.head_dim


def _key_weight(layer: nn.Module, spec: ArchSpec, n_heads: int, n_kv: int, hd: int) -> torch.Tensor:
    """k's rows: k_proj, or k's rows of a fused qkv ([q; k; v] as Phi-3, per head [q, k, v] as GPT-NeoX)."""
    paths = spec.qkv_paths()
    if "k" in paths:
        return layer.get_submodule(paths["k"]).weight
    W = layer.get_submodule(paths["qkv"]).weight
    if spec.qkv_interleaved:
        return W.reshape(n_heads, 3, hd, -1)[:, 1].reshape(n_heads * hd, -1)
    return W[n_heads * hd:(n_heads + n_kv) * hd]


def _gate_weight(layer: nn.Module, spec: ArchSpec) -> torch.Tensor:
    """The gate's rows (a fused gate_up holds [gate; up]), or up's in a non-gated MLP."""
    paths = spec.mlp_paths()
    if "gate_up" in paths:
        W = layer.get_submodule(paths["gate_up"]).weight
        return W[: W.shape[0] // 2]
    return layer.get_submodule(paths["gate"] if "gate" in paths else paths["up"]).weight


def _rotate_readers(layer: nn.Module, norm_path: str, readers: list[str], R: torch.Tensor, block: str) -> None:
    """Readers W ← W R (float64, then their dtype); the norm ← RotatedInput(norm, R)."""
    norm = layer.get_submodule(norm_path)
    for path in readers:
        lin = layer.get_submodule(path)
        W = lin.weight.detach()
        _set(lin.weight, (W.double() @ R.to(W.device)))
    ref = layer.get_submodule(readers[0]).weight
    set_submodule(layer, norm_path, RotatedInput(norm, R.to(device=ref.device, dtype=ref.dtype), block))


def unsupported(spec: ArchSpec) -> str | None:
    """The rotation is applied by wrapping each block's pre-norm; a block without one has nowhere to put it."""
    if spec.attn_norm is None or spec.mlp_norm is None:
        return ("method 'wina-ortho' rotates each block's normalised input at its pre-norm: this architecture has "
                "no pre-norms (its blocks read the raw residual stream, which the skip path needs unrotated); use wina")
    return None


def rotation_macs(config) -> float:
    """Per-token MACs of the explicit rotations: d² for each block input, two per layer."""
    d, n_layers, *_ = _dims(config)
    return float(2 * n_layers * d * d)


@torch.no_grad()
def rotate_model(model: nn.Module, spec: ArchSpec, *, heads: bool = True) -> dict:
    """Rotate every block's normalised input (k's / gate's V) and, unless `heads` is False or the
    arch interleaves v, o's input per KV head (o's V per group, folded into v and o). Exact."""
    d, n_layers, n_heads, n_kv, hd = _dims(model.config)
    fold_heads = heads and not spec.qkv_interleaved  # v's rows per KV head must be one block (`_value_rows`)
    no_heads_why = "this architecture interleaves v's rows per head" if spec.qkv_interleaved else "not asked for"
    mlp_readers = [p for name, p in spec.mlp_paths().items() if name != "down"]
    for layer in decoder_layers(model, spec):
        if isinstance(layer.get_submodule(spec.attn_norm), RotatedInput):
            raise ValueError("wina-ortho: this model's block inputs are already rotated")
        _rotate_readers(layer, spec.attn_norm, list(spec.qkv_paths().values()),
                        column_orthogonalising_rotation(_key_weight(layer, spec, n_heads, n_kv, hd)), "attention")
        _rotate_readers(layer, spec.mlp_norm, mlp_readers, column_orthogonalising_rotation(_gate_weight(layer, spec)),
                        "mlp")
        if fold_heads:
            o = layer.get_submodule(spec.o_path())
            R = head_rotations(o.weight, n_heads, n_kv).to(o.weight.device)
            _rotate_heads(_value_rows(layer, spec, n_heads * hd, n_kv * hd), o, R, n_heads)
    return {
        "kind": "wina-ortho",
        "block_rotations": f"per layer two explicit {d}x{d} rotations (V of k's and of the gate's weight) of the "
                           "attention's and the MLP's normalised input; their readers hold W V",
        "head_rotations": (f"{n_kv} {hd}x{hd} rotations per layer (V of o's columns per KV group) folded into v_proj "
                           "rows and o_proj columns: 0 MACs") if fold_heads else
                          f"none ({no_heads_why}): o's input is not rotated",
        "down_input": "not rotated: WINA's plain criterion",
        "runtime_rotation_macs_per_token": rotation_macs(model.config),
        "extra_stored_parameters": 2 * n_layers * d * d,
    }


@torch.no_grad()
def prepare(model: nn.Module, spec: ArchSpec, sequences: torch.Tensor, *, batch_size: int, streamed: bool) -> dict:
    """The model-level step before the layer loop: rotate (no calibration data needed; the fit
    sequences only check on one of them that the rotation left the function unchanged)."""
    if streamed:
        raise UnsupportedArchitectureError(
            "method 'wina-ortho' rotates the whole model before compressing it and cannot stream decoder layers "
            "from disk (--offload-dir, or a model larger than memory); use wina there")
    t0 = time.perf_counter()
    done, change, exact = function_preserving(model, sequences, lambda: rotate_model(model, spec))
    if not exact:
        raise UnsupportedArchitectureError(
            f"method 'wina-ortho': rotating the block inputs changed this model's logits by {change:.3g} (relative): "
            "something other than the registered projections reads a block's normalised input; use wina")
    return {**done, "rotation_check_relative_change": change, "seconds": time.perf_counter() - t0}


register(replace(
    rana_method("wina-ortho", Candidates(rank=False, sparse=True, split="equal"),
                "WINA with its column-orthogonalising transform: each block's normalised input rotated by V of "
                "k's / the gate's weight (W = U Σ Vᵀ; readers hold W V), an explicit rotation costing d² MACs "
                "per token per block input, counted and budgeted; o's input rotated per KV head for free (folded "
                "into v and o); then as wina",
                dict(color="darkolivegreen", marker="X", ls="--"), lm_head="dense"),
    prepare=prepare, runtime_macs=rotation_macs, unsupported=unsupported))

__all__ = ["column_orthogonalising_rotation", "head_rotations", "rotate_model", "rotation_macs", "prepare", "unsupported"]
