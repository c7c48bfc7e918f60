"""LaRoSA-style rotated activation sparsity (Liu et al. 2025, "Layerwise Rotated Sparse
Activation"), under this project's accounting: only rotations that fold into the weights.

Where each rotation lives and what it costs:

- **Residual stream, one model-wide rotation Q** (PCA of the RMS-normalised inputs of every
  attention and MLP block on the fit tokens, eigenvectors of their pooled second moment, largest
  first). Computational invariance (as in SliceGPT): every RMSNorm's scale is folded into the
  projections that read it (q/k/v, up/gate, the LM head) and set to identity, then the embeddings
  and the block writers (o, down) are rotated on their output side, the readers on their input
  side. Free at run time (0 MACs). The rotated q/k/v and up/gate then read Qᵀx directly, where
  magnitude thresholds act. The paper rotates each layer's inputs with its own Q_l; with a
  different Q per block the skip path needs Q_lᵀQ_{l+1} (d² MACs per token per block) or each
  block an explicit d × d rotation of its input — on SmolLM2 (d = 576) one such rotation costs
  60 % of q/k/v's own MACs, more than q/k/v may spend at --flops 0.58; so here Q is shared.
- **o_proj's input, one head_dim × head_dim rotation per KV head** (PCA of o_proj's inputs, the
  query heads of a GQA group pooled): folded into v_proj's output rows (and bias) and o_proj's
  input columns — attention mixes tokens, not dimensions, so this is exact and free.
- **down_proj's input** (after the nonlinearity) is not rotated: nothing upstream is linear in it.
  It is thresholded by magnitude as TEAL does.

Stored bytes: the rotated weights replace the dense ones in the folder (a rana folder stores every
weight), so the only extra storage is an untied LM head (vocab × hidden) when the model ties its
embeddings: the head absorbs the final norm's scale and no longer equals the rotated embedding.

Thresholds: one magnitude threshold per projection at the layer's fraction, set on fit tokens of
the rotated model (as `teal`). Needs invariance: RMSNorm (a Gemma-style `1 + w` scale too) on a
sequential pre-norm residual; post-norms (Gemma 2/3, OLMo 2, which has no pre-norms at all),
LayerNorm (`ArchSpec.norm_type`) and a parallel residual (GPT-NeoX has both) are refused. Scalar
multipliers on the embeddings, the residual adds and the logits (Granite) commute with the rotation.
`larosa-heads` (o's input only) needs none of this and runs wherever v's rows per KV head are
contiguous (not a fused qkv interleaved per head, `ArchSpec.qkv_interleaved`). The rotation is fitted
on the dense model before the layer loop (all of it in memory: not with layers streamed from disk).
"""
from __future__ import annotations

import time
from dataclasses import replace
from functools import partial

import torch
import torch.nn as nn

from ..archs import ArchSpec, decoder_layers, text_config
from ..archs.base import UnsupportedArchitectureError
from .base import MemoryNeed, Method, function_preserving, per_role_steps, register
from .rana import Candidates, rana_method
from .teal import down, o_projection, qkv, up_gate
from ..errors import UserError


def unsupported(spec: ArchSpec) -> str | None:
    if spec.attn_post_norm or spec.mlp_post_norm:
        return ("method 'larosa' needs a rotation-invariant residual stream: this architecture normalises each "
                "block's output before the residual add (post-norms), which a folded rotation cannot pass through; "
                "use teal or rana")
    if spec.attn_norm is None or spec.mlp_norm is None:
        return ("method 'larosa' folds its rotation through each block's pre-norm: this architecture has none "
                "(its blocks read the raw residual stream); use teal or rana")
    if spec.norm_type != "rms" or spec.parallel_residual:
        obstacle = ("this architecture's LayerNorm subtracts the mean, which a folded rotation cannot pass through"
                    if spec.norm_type == "layer" else "this architecture adds its blocks to the residual in parallel")
        return f"method 'larosa' needs RMSNorm on a sequential residual: {obstacle}; use teal or rana"
    return None


def _heads_unsupported(spec: ArchSpec) -> str | None:
    if spec.qkv_interleaved:
        return ("method 'larosa-heads' needs v's rows per KV head in one block: this architecture interleaves q, k "
                f"and v per head in its fused {spec.qkv_fused}; use teal or rana")
    return None


# ---------------------------------------------------------------------------- pure math


def principal_basis(moment: torch.Tensor) -> torch.Tensor:
    """Orthogonal Q (float64) whose columns are the eigenvectors of a second moment, largest first."""
    C = moment.double()
    _, vecs = torch.linalg.eigh((C + C.T) / 2)
    return vecs.flip(-1).contiguous()


def head_block_moments(x: torch.Tensor, n_heads: int, n_kv: int) -> torch.Tensor:
    """Σ aᵀa per KV group (n_kv × head_dim × head_dim; float32 products, returned as float64) of
    o_proj's inputs `x` (tokens × n_heads·head_dim), the query heads sharing a KV head pooled."""
    a = x.reshape(-1, n_kv, n_heads // n_kv, x.shape[-1] // n_heads).float()
    return torch.einsum("tgqi,tgqj->gij", a, a).double()


def _normalised_moment(h: torch.Tensor) -> torch.Tensor:
    """Σ n nᵀ (float64) of the RMS-normalised rows n of `h`: one batch's products in float32 (a few
    thousand tokens: float64 here tripled the pass's time), accumulated across batches in float64."""
    h = h.reshape(-1, h.shape[-1]).float()
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True).clamp_min(1e-30))
    return (n.T @ n).double()


# ---------------------------------------------------------------------------- statistics


@torch.no_grad()
def rotation_statistics(model: nn.Module, spec: ArchSpec, sequences: torch.Tensor, *, batch_size: int) -> dict:
    """One forward pass over `sequences`: the pooled second moment of every block's normalised
    input (d × d) and, per layer, o_proj's input moments per KV head."""
    text = text_config(model.config)
    n_heads = text.num_attention_heads
    n_kv = getattr(text, "num_key_value_heads", None) or n_heads
    d = text.hidden_size
    residual = torch.zeros(d, d, dtype=torch.float64)
    heads: list[torch.Tensor | None] = []
    hooks = []

    def on_input(_m, args, kwargs):  # a block without a pre-norm (OLMo 2) gets its input by keyword
        residual.add_(_normalised_moment(args[0] if args else kwargs["hidden_states"]).cpu())

    def on_o(i):
        def hook(_m, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            m = head_block_moments(x, n_heads, n_kv).cpu()
            heads[i] = m if heads[i] is None else heads[i] + m
        return hook

    layers = decoder_layers(model, spec)
    for i, layer in enumerate(layers):
        heads.append(None)
        for block in ("attention", "mlp"):
            hooks.append(layer.get_submodule(spec.residual_input(block)).register_forward_pre_hook(on_input,
                                                                                                with_kwargs=True))
        hooks.append(layer.get_submodule(spec.o_path()).register_forward_pre_hook(on_o(i)))
    device = next(model.parameters()).device
    try:
        for start in range(0, sequences.shape[0], batch_size):
            model(sequences[start:start + batch_size].to(device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    if not torch.isfinite(residual).all():
        raise UserError("larosa: the calibration activations are not finite; cannot fit a rotation")
    return {"residual": residual, "heads": heads, "n_heads": n_heads, "n_kv": n_kv}


# ---------------------------------------------------------------------------- folding


def _norm_scale_to_identity(norm: nn.Module) -> torch.Tensor:
    """The norm's per-channel scale (float64), after which the norm is set to scale by one.
    Handles `w` (Llama) and `1 + w` (Gemma) parametrisations, told apart by probing."""
    w = norm.weight
    saved = w.detach().clone()
    w.data.zero_()
    offset = bool(norm(torch.ones(1, w.shape[0], dtype=w.dtype, device=w.device)).abs().max() > 0.5)
    scale = (saved.double() + 1.0) if offset else saved.double()
    w.data.fill_(0.0 if offset else 1.0)
    return scale


def _set(param: nn.Parameter, value: torch.Tensor) -> None:
    param.data = value.to(device=param.device, dtype=param.dtype).contiguous()


def _read_rotated(linear: nn.Linear, scale: torch.Tensor, Q: torch.Tensor) -> None:
    """W ← W diag(scale) Q: a reader of the normalised residual, norm scale folded in."""
    W = linear.weight.detach().double().cpu()
    _set(linear.weight, (W * scale) @ Q)


def _write_rotated(linear: nn.Linear, Q: torch.Tensor) -> None:
    """W ← Qᵀ W (and b ← Qᵀ b): a writer into the residual stream."""
    _set(linear.weight, Q.T @ linear.weight.detach().double().cpu())
    if linear.bias is not None:
        _set(linear.bias, Q.T @ linear.bias.detach().double().cpu())


def _rotate_heads(v_rows: tuple[nn.Linear, slice], o: nn.Linear, R: torch.Tensor, n_heads: int) -> None:
    """Per KV group g: v rows ← R_gᵀ v rows (bias too), o's input columns of every query head in
    the group ← · R_g."""
    n_kv, hd, _ = R.shape
    v, rows = v_rows
    Wv = v.weight.detach().double().cpu()
    block = Wv[rows].reshape(n_kv, hd, -1)
    Wv[rows] = torch.einsum("gji,gjk->gik", R, block).reshape(n_kv * hd, -1)
    _set(v.weight, Wv)
    if v.bias is not None:
        b = v.bias.detach().double().cpu()
        b[rows] = torch.einsum("gji,gj->gi", R, b[rows].reshape(n_kv, hd)).reshape(-1)
        _set(v.bias, b)
    Wo = o.weight.detach().double().cpu()
    cols = Wo.reshape(Wo.shape[0], n_kv, n_heads // n_kv, hd)
    _set(o.weight, torch.einsum("ogqi,gij->ogqj", cols, R).reshape(Wo.shape[0], -1))


def _value_rows(layer: nn.Module, spec: ArchSpec, q_out: int, kv_out: int) -> tuple[nn.Linear, slice]:
    paths = spec.qkv_paths()
    if "v" in paths:
        return layer.get_submodule(paths["v"]), slice(0, kv_out)
    return layer.get_submodule(paths["qkv"]), slice(q_out + kv_out, q_out + 2 * kv_out)  # rows q, k, v


def _untie_head(model: nn.Module, head: nn.Linear) -> bool:
    """Give the LM head its own tensor (it stops equalling the embedding); True when it was tied."""
    configs = {id(c): c for c in (model.config, text_config(model.config))}  # the wrapper and its text config
    tied = any(getattr(c, "tie_word_embeddings", False) for c in configs.values())
    emb = model.get_input_embeddings()
    if tied or head.weight is emb.weight:
        head.weight = nn.Parameter(head.weight.detach().clone())
        for c in configs.values():
            c.tie_word_embeddings = False
        keys = getattr(model, "all_tied_weights_keys", None)  # transformers >= 5: {target: source}
        if isinstance(keys, dict):  # (what an in-memory export would drop as a tied copy)
            name = next(n for n, m in model.named_modules() if m is head)
            model.all_tied_weights_keys = {k: v for k, v in keys.items() if k != f"{name}.weight"}
        return True
    return False


@torch.no_grad()
def rotate_model(model: nn.Module, spec: ArchSpec, stats: dict, *, residual: bool = True) -> dict:
    """Fold the residual rotation (unless `residual` is False) and the per-KV-head rotations into
    the weights (exact: the model computes the same function). Returns what was done, for the plan."""
    n_heads, n_kv = stats["n_heads"], stats["n_kv"]
    text = text_config(model.config)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
    q_out, kv_out = n_heads * head_dim, n_kv * head_dim
    if not residual:
        for i, layer in enumerate(decoder_layers(model, spec)):
            if stats["heads"][i] is not None:
                R = torch.stack([principal_basis(m) for m in stats["heads"][i]])
                _rotate_heads(_value_rows(layer, spec, q_out, kv_out), layer.get_submodule(spec.o_path()), R, n_heads)
        return {"kind": "larosa-heads", "residual_rotation": "none",
                "head_rotations": f"{n_kv} {head_dim}x{head_dim} rotations per layer folded into v_proj rows and "
                                  "o_proj columns: 0 MACs",
                "runtime_rotation_macs_per_token": 0, "lm_head_untied": False, "extra_stored_parameters": 0}
    Q = principal_basis(stats["residual"])
    head = model.get_output_embeddings()
    untied = _untie_head(model, head)
    emb = model.get_input_embeddings()
    _set(emb.weight, emb.weight.detach().double().cpu() @ Q)
    for i, layer in enumerate(decoder_layers(model, spec)):
        g = _norm_scale_to_identity(layer.get_submodule(spec.attn_norm))
        for path in spec.qkv_paths().values():
            _read_rotated(layer.get_submodule(path), g, Q)
        o = layer.get_submodule(spec.o_path())
        if stats["heads"][i] is not None:
            R = torch.stack([principal_basis(m) for m in stats["heads"][i]])
            _rotate_heads(_value_rows(layer, spec, q_out, kv_out), o, R, n_heads)
        _write_rotated(o, Q)
        g = _norm_scale_to_identity(layer.get_submodule(spec.mlp_norm))
        for name, path in spec.mlp_paths().items():
            if name != "down":
                _read_rotated(layer.get_submodule(path), g, Q)
        _write_rotated(layer.get_submodule(spec.role_path("down")), Q)
    g = _norm_scale_to_identity(model.get_submodule(spec.final_norm))
    _read_rotated(head, g, Q)
    vocab, d = head.weight.shape
    return {
        "kind": "larosa",
        "residual_rotation": f"one {d}x{d} PCA rotation of the residual stream, folded into the embeddings, "
                             "every block's readers (norm scales folded in) and writers, and the LM head: 0 MACs",
        "head_rotations": f"{n_kv} {head_dim}x{head_dim} rotations per layer folded into v_proj rows and "
                          "o_proj columns: 0 MACs",
        "down_input": "not rotated (after the nonlinearity): magnitude thresholds as teal",
        "runtime_rotation_macs_per_token": 0,
        "lm_head_untied": untied,
        "extra_stored_parameters": vocab * d if untied else 0,
    }


def prepare(model: nn.Module, spec: ArchSpec, sequences: torch.Tensor, *, batch_size: int, streamed: bool,
            residual: bool = True) -> dict:
    """The model-level step before the layer loop: fit the rotations on `sequences` and fold them in.
    The caller passes the fit batches that feed second moments, not those kept for thresholds:
    fitted on those too, the minor components' variance is biased low there and the held-out
    tokens keep more inputs than the budget (measured: +1 point of F on the tiny test models)."""
    if streamed:
        raise UnsupportedArchitectureError(
            "method 'larosa' rotates the whole model before compressing it and cannot stream decoder layers from "
            "disk (--offload-dir, or a model larger than memory); use teal or rana there")
    t0 = time.perf_counter()
    # the fold must be exact; a norm it does not know (e.g. LayerNorm) would not be
    done, change, exact = function_preserving(model, sequences, lambda: rotate_model(
        model, spec, rotation_statistics(model, spec, sequences, batch_size=batch_size), residual=residual))
    if not exact:
        raise UnsupportedArchitectureError(
            f"method 'larosa': folding the rotation changed this model's logits by {change:.3g} (relative); its "
            "normalisation or residual is not rotation-invariant; use teal or rana")
    return {**done, "fold_check_relative_change": change, "seconds": time.perf_counter() - t0}


# thresholds as teal's, on the rotated inputs
LAROSA = register(Method(
    "larosa", ("q", "k", "v", "o", "up", "gate", "down"),
    per_role_steps(qkv_in=qkv, o=o_projection, mlp_in=up_gate, down=down),
    min_fraction=0.0,
    description="LaRoSA: magnitude sparsity on PCA-rotated inputs (one residual rotation, per-KV-head rotations "
                "of o's input, all folded into the weights: 0 extra MACs; down as teal; untied LM head stored)",
    memory=MemoryNeed(decomposes=False, wide_sample_rows=True), style=dict(color="black", marker="h"),
    unsupported=unsupported, prepare=prepare))

register(replace(
    LAROSA, name="larosa-heads",
    description="ablation: larosa's per-KV-head rotations of o's input only (folded into v and o, 0 MACs, nothing "
                "extra stored); the residual stream is not rotated, every other input as teal",
    ablation=True, style=dict(color="darkkhaki", marker="H"), unsupported=_heads_unsupported,
    prepare=partial(prepare, residual=False)))

# rana with the one rotation that is free everywhere it applies: does the default gain from it?
register(replace(
    rana_method("rana-heads", Candidates(rank=False, sparse=True, score="magnitude"),
                "ablation: as rana, after larosa's per-KV-head rotations of o's input (folded into v and o, 0 MACs, "
                "nothing extra stored)", dict(color="dimgray", marker="H", ls=":"), ablation=True),
    unsupported=_heads_unsupported, prepare=partial(prepare, residual=False)))

__all__ = ["principal_basis", "head_block_moments", "rotation_statistics", "rotate_model", "prepare", "unsupported"]
