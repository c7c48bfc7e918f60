"""How much compute-device memory compressing one decoder layer needs, and the --max-memory check.

`--max-memory` (e.g. "2GB", "80GiB") bounds the compute device's memory: before any work the
peak need of one layer (weights, the adapters being built, float64 decomposition workspace,
second moments, one batch of activations) plus what stays resident (embeddings / LM head; on a CPU
device also the calibration activations and sample rows) is estimated from the config and the run
fails with a breakdown if it does not fit. On CUDA the cap is also enforced
(`torch.cuda.set_per_process_memory_fraction`, `rana.compress.residency`). The plan records the
estimate and the measured peak.
"""
from __future__ import annotations

import resource

import torch

from . import distributed
from ..accounting import layer_dims
from ..archs import get_arch, text_config
from ..methods import get_method
from ..units import dtype_bytes, fmt_bytes
from ..errors import UserError
from .resource_types import MemoryEstimate, Resources


class MemoryBudgetError(UserError):
    """--max-memory is too small for one layer of this model (user-facing)."""


def _largest_layer_bytes(dims, e: int) -> float:
    """Bytes of the largest of the layers `dims` (`layer_dims`) at `e` bytes per weight."""
    return max(e * (2 * d.q_out * d.hidden + 2 * d.kv_out * d.hidden + (3 if d.gated else 2) * d.intermediate * d.hidden
                   * d.stored_experts)
               for d in dims)


def layer_weight_bytes(model_config, dtype: str = "float32") -> float:
    """Bytes of the largest decoder layer's projection weights (norms and biases are negligible)."""
    return _largest_layer_bytes(layer_dims(model_config), dtype_bytes(dtype))


def model_weight_bytes(model_config, dtype: str = "float32") -> float:
    text = text_config(model_config)
    e = dtype_bytes(dtype)
    dims = layer_dims(model_config)
    embed = text.vocab_size * text.hidden_size * e * (1 if getattr(text, "tie_word_embeddings", False) else 2)
    return len(dims) * _largest_layer_bytes(dims, e) + embed


def estimate_memory(model_config, config, *, method: str | None = None, device: str | None = None,
                    streamed: bool = False) -> MemoryEstimate:
    """Peak bytes on the compute device while one layer is compressed (see the module docstring).

    Activations are counted for one calibration batch in float32 (the hooks' upcast), attention
    scores as materialised by eager attention (an upper bound for SDPA). The sample / held-aside
    rows the searches keep are on the compute device (rana.compress.placement); on a CPU device the
    calibration hidden states of all tokens (unless spilled to disk) are in the same memory too."""
    need = get_method(method or config.method).memory
    device = device or config.device
    text = text_config(model_config)
    dims = layer_dims(model_config)
    d = max(dims, key=lambda d: d.intermediate * d.hidden + d.q_out * d.hidden)
    e = dtype_bytes(config.dtype)
    h, inter, qkv = d.hidden, d.intermediate, d.q_out + 2 * d.kv_out
    w_layer = _largest_layer_bytes(dims, e)
    b, s = config.batch_size, config.seq_len
    # the largest matrix decomposed in float64 (W, U, B_full) and its input's moment (+ eigh workspace)
    up_rows = 2 * inter if get_arch(model_config).gate_up_fused else inter  # fused gate_up: one stacked matrix
    mats = [(qkv, h), (up_rows if need.stacked_gate_up else inter, h)]
    if need.decomposes_down:
        mats.append((h, inter))
    workspace = max(8 * (3 * o * i + 3 * i * i) for o, i in mats)
    moments = 8 * h * h * 2 if not need.decomposes_down else 8 * (2 * h * h + inter * inter)
    if not need.decomposes:
        workspace, moments = 4 * max(o * i for o, i in mats), 0.0
    acts = 4 * b * s * (4 * h + qkv + 3 * inter) + 4 * b * d.n_heads * s * s
    resident = text.vocab_size * h * e * (1 if getattr(text, "tie_word_embeddings", False) else 2)
    # grid search (the rana family): each projection's adapted outputs on the fit sample and the
    # search tokens, cached per budget share tried, plus h and its masks for down
    search = 0.0
    if need.grid_search:
        n_tok = config.fit_sample_tokens + config.search_tokens
        n_budgets = round(1 / config.grid_step) + 4
        search = 4 * n_tok * inter * ((2 if d.gated else 1) * n_budgets + 6) + 8 * n_tok * h
    parts = {"layer weights": w_layer, "adapters being built": w_layer, "decomposition workspace": workspace,
             "second moments": moments, "search buffers": search, "batch activations": acts,
             "embeddings/lm_head": resident}
    # the searches' sample / held-aside rows live on the compute device (rana.compress.placement)
    tokens = config.calib_tokens
    held = tokens * config.heldout_fraction
    fit_sample = tokens * (1 - config.heldout_fraction) * distributed.THRESHOLD_FRACTION
    widest_in = inter if need.wide_sample_rows else h
    parts["sample rows"] = 4 * (held + fit_sample) * (h + widest_in)
    if torch.device(device).type == "cpu":
        if streamed:  # the shard's pages, mapped while the layer is read
            parts["checkpoint pages"] = w_layer
        parts["calibration hidden states"] = 0.0 if streamed else 2 * tokens * h * e
    return MemoryEstimate(parts=parts, device=str(device))


def check_memory(model_config, config, resources: Resources, *, streamed: bool = False) -> MemoryEstimate | None:
    """Raise MemoryBudgetError when the cap (`resources.cap`, --max-memory) cannot hold one layer's
    compression; the estimate, or None without a cap."""
    if resources.cap is None:
        return None
    est = estimate_memory(model_config, config, streamed=streamed)
    if resources.device.type == "cpu" and not streamed:  # the other layers share the same RAM
        est.parts["rest of the model (in RAM)"] = max(0.0, model_weight_bytes(model_config, config.dtype)
                                                      - est.parts["layer weights"])
    if est.total > resources.cap:
        raise MemoryBudgetError(
            f"--max-memory {resources.max_memory} is too small: compressing one decoder layer of this model needs about "
            f"{fmt_bytes(est.total)} on {est.device} ({est.describe()}); raise --max-memory, lower --batch-size or "
            f"--seq-len (activations), use --dtype bfloat16 (weights), or --offload-dir to keep activations on disk")
    return est


def peak_memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: kB


__all__ = ["MemoryBudgetError", "MemoryEstimate", "layer_weight_bytes", "model_weight_bytes", "estimate_memory",
           "check_memory", "peak_memory_bytes"]
