"""Decode speed: batch-1 greedy generation timed the way users decode, alone or interleaved
with the dense model, and which masked-GEMV path produced the numbers.

Two harnesses (`LATENCY_MODES`): "eager" (generate with the dynamic cache) and "compiled"
(generate with a fresh StaticCache per run, transformers compiling the decode step; the
default on CUDA). Dense and compressed models are always timed the same way.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import CompileConfig, GenerationConfig, StaticCache

from ..kernels.cpu_gemv import native_status
from ..kernels.masked_gemv import triton_available
from .common import eval_mode, model_device

DEFAULT_PROMPT = "The history of the Python programming language begins in the late 1980s, when"
LATENCY_MODES = ("eager", "compiled")


def _prompt_ids(tokenizer_or_ids, prompt: str) -> torch.Tensor:
    """A (1, T) prompt, from token ids or by tokenising `prompt`."""
    if isinstance(tokenizer_or_ids, torch.Tensor):
        ids = tokenizer_or_ids
    else:
        ids = tokenizer_or_ids(prompt, return_tensors="pt")["input_ids"]
    return ids.reshape(1, -1).long()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_latency_mode(device: torch.device | str) -> str:
    """compiled (static cache + torch.compile: the fast path transformers gives users) on CUDA, else eager."""
    return "compiled" if torch.device(device).type == "cuda" else "eager"


def generation_config(model: torch.nn.Module, new_tokens: int, mode: str, device: torch.device) -> GenerationConfig:
    """Greedy decoding of exactly `new_tokens` tokens under harness `mode` (tests swap the compile backend here)."""
    base = model.generation_config
    eos = base.eos_token_id
    config = GenerationConfig(
        do_sample=False,
        use_cache=True,
        min_new_tokens=new_tokens,  # with max, forces a fixed length (EOS is suppressed)
        max_new_tokens=new_tokens,
        eos_token_id=eos,
        pad_token_id=base.pad_token_id if base.pad_token_id is not None else (eos if isinstance(eos, int) else 0),
    )
    if mode == "compiled":
        # transformers compiles the single-token decode step when the cache is static; fullgraph: a graph
        # break in a masked module would be a bug, not a slower run. CUDA graphs on CUDA ("reduce-overhead").
        compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead" if device.type == "cuda" else "default")
        compile_config._compile_all_devices = device.type != "cuda"  # transformers compiles on CUDA only, by default
        config.compile_config = compile_config
    else:
        config.disable_compile = True
    return config


def _time_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, mode: str = "eager") -> float:
    """Seconds for one batch-1 greedy generate of exactly `new_tokens` tokens.

    compiled: a fresh StaticCache per run (it counts its length on every call, so one cannot be reused)."""
    device = ids.device
    config = generation_config(model, new_tokens, mode, device)
    kwargs = {}
    if mode == "compiled":
        kwargs["past_key_values"] = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
    _sync(device)
    start = time.perf_counter()
    model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, **kwargs)
    _sync(device)
    return time.perf_counter() - start


def _measure(models: Sequence[torch.nn.Module], ids: torch.Tensor, new_tokens: int, warmup: int, repeats: int,
             mode: str = "eager") -> list[dict[str, Any]]:
    """Interleave timings of several models so drift (clocks, thermals) hits all alike.

    compiled: one short eager generate per model first, so the Triton kernels take their tuning
    decisions outside compilation and CUDA-graph capture; the warmup runs then compile."""
    if mode not in LATENCY_MODES:
        raise ValueError(f"latency mode must be one of {LATENCY_MODES}, got {mode!r}")
    full: list[list[float]] = [[] for _ in models]
    prefill: list[list[float]] = [[] for _ in models]
    with torch.inference_mode():
        if mode == "compiled":
            for model in models:
                with eval_mode(model):
                    _time_generate(model, ids.to(model_device(model)), 2, "eager")
        for step in range(max(warmup, 1 if mode == "compiled" else 0) + repeats):
            for i, model in enumerate(models):
                model_ids = ids.to(model_device(model))
                with eval_mode(model):
                    t_full = _time_generate(model, model_ids, new_tokens, mode)
                    t_prefill = _time_generate(model, model_ids, 1, mode)
                if step >= max(warmup, 1 if mode == "compiled" else 0):
                    full[i].append(t_full)
                    prefill[i].append(t_prefill)
    return [{**_summary(f, p, new_tokens, ids.shape[1], model_device(m)), "mode": mode}
            for f, p, m in zip(full, prefill, models)]


def _summary(
    full: list[float], prefill: list[float], new_tokens: int, prompt_tokens: int, device: torch.device
) -> dict[str, Any]:
    """Median timings → tokens/s overall and for the decode steps alone (prefill removed)."""
    t_full, t_prefill = statistics.median(full), statistics.median(prefill)
    decode = t_full - t_prefill
    return {
        "tokens_per_s": new_tokens / t_full,
        "decode_tokens_per_s": (new_tokens - 1) / decode if decode > 0 and new_tokens > 1 else float("nan"),
        "seconds": t_full,
        "prefill_seconds": t_prefill,
        "new_tokens": new_tokens,
        "prompt_tokens": int(prompt_tokens),
        "repeats": len(full),
        "device": str(device),
    }


def decode_latency(
    model: torch.nn.Module,
    tokenizer_or_prompt_ids,
    *,
    prompt: str = DEFAULT_PROMPT,
    new_tokens: int = 64,
    warmup: int = 2,
    repeats: int = 5,
    mode: str | None = None,
) -> dict[str, Any]:
    """Batch-1 greedy generation speed (median of `repeats` after `warmup` runs).

    `mode`: "eager" (generate, dynamic cache) or "compiled" (generate with a fresh StaticCache per run,
    transformers compiling the decode step); default :func:`default_latency_mode` of the model's device.

    `tokens_per_s` is end to end (prefill + `new_tokens` steps); `decode_tokens_per_s`
    subtracts a 1-token generate to isolate the per-token decode cost.
    """
    ids = _prompt_ids(tokenizer_or_prompt_ids, prompt)
    return _measure([model], ids, new_tokens, warmup, repeats, mode or default_latency_mode(model_device(model)))[0]


def latency_ratio(
    model: torch.nn.Module,
    dense_model: torch.nn.Module,
    tokenizer_or_prompt_ids,
    *,
    prompt: str = DEFAULT_PROMPT,
    new_tokens: int = 64,
    warmup: int = 2,
    repeats: int = 5,
    mode: str | None = None,
) -> dict[str, Any]:
    """Compressed vs dense decode speed, timed interleaved in the same run under the same harness (`mode`,
    as in :func:`decode_latency`).

    `latency_ratio` = compressed / dense seconds per generated token (< 1 is faster);
    `speedup` is its inverse. The `decode_` variants exclude prefill.
    """
    ids = _prompt_ids(tokenizer_or_prompt_ids, prompt)
    mode = mode or default_latency_mode(model_device(model))
    ours, dense = _measure([model, dense_model], ids, new_tokens, warmup, repeats, mode)
    ratio = dense["tokens_per_s"] / ours["tokens_per_s"]
    decode_ratio = dense["decode_tokens_per_s"] / ours["decode_tokens_per_s"]
    return {
        "tokens_per_s": ours["tokens_per_s"],
        "dense_tokens_per_s": dense["tokens_per_s"],
        "latency_ratio": ratio,
        "speedup": 1.0 / ratio,
        "decode_tokens_per_s": ours["decode_tokens_per_s"],
        "dense_decode_tokens_per_s": dense["decode_tokens_per_s"],
        "decode_latency_ratio": decode_ratio,
        "mode": mode,
        "model": ours,
        "dense": dense,
    }


def measure_latency(model: torch.nn.Module, tokenizer, dense_model: torch.nn.Module | None = None, *,
                    new_tokens: int = 64, repeats: int = 5, warmup: int = 2, mode: str | None = None) -> dict:
    """Batch-1 decode tokens/s; against `dense_model` (timed interleaved, same harness) as a ratio.

    `decode_path` says which masked-GEMV path produced the numbers (they differ by device,
    thread count and whether the native CPU kernel could be built here)."""
    mode = mode or default_latency_mode(model_device(model))
    if dense_model is None or dense_model is model:
        r = decode_latency(model, tokenizer, new_tokens=new_tokens, warmup=warmup, repeats=repeats, mode=mode)
        out = {"tokens_per_s": r["tokens_per_s"], "decode_tokens_per_s": r["decode_tokens_per_s"], "model": r}
        if dense_model is model:
            out.update(dense_tokens_per_s=r["tokens_per_s"], latency_ratio=1.0, speedup=1.0, decode_latency_ratio=1.0)
    else:
        out = latency_ratio(model, dense_model, tokenizer, new_tokens=new_tokens, warmup=warmup, repeats=repeats,
                            mode=mode)
    out["mode"] = mode
    out["decode_path"] = decode_path(model)
    return out


def decode_path(model: torch.nn.Module) -> str:
    """The batch-1 masked-GEMV path `model`'s adapters take where it lives, in words."""
    device = model_device(model)
    if device.type == "cuda":
        return "CUDA: " + ("Triton masked-GEMV kernels (rana::masked_gemv_triton)" if triton_available()
                           else "dense masked product (no triton)")
    if device.type == "cpu":
        return f"CPU, {torch.get_num_threads()} thread(s): {native_status()}"
    return f"{device.type}: dense masked product"
