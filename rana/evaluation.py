"""Evaluation orchestration: load any model (dense checkpoint / alias or rana folder), measure
perplexity on several texts with the FLOPs its masks actually take on those tokens, run
lm-eval tasks, time decoding against the dense model, and report per-block output errors.

`rana.evaluate` holds the low-level measurements (perplexity protocol, lm-eval glue, timing);
this module composes them into one result dict per model (`evaluate_model`), which the
`rana eval` command and `rana sweep` print, tabulate and store as JSON.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .accounting import measured_macs, metering
from .archs import decoder_layers, get_arch
from .data import DataError, load_texts, tokenize_stream

Progress = Callable[[str, int, "int | None"], None]

PART_NAMES = ("attention", "mlp", "other")


# --------------------------------------------------------------------------- loading


@dataclass
class LoadedModel:
    """A model ready to evaluate plus what is known about where it came from."""

    model: nn.Module
    tokenizer: Any
    reference: str
    kind: str  # "rana" (a compressed folder) or "dense"
    plan: dict | None = None
    info: dict = field(default_factory=dict)

    @property
    def dense_reference(self) -> str | None:
        """The dense model this one was compressed from (plan.json's model), or itself if dense."""
        if self.kind == "dense":
            return self.reference
        plan = self.plan or {}
        return plan.get("model") or (plan.get("config") or {}).get("model") or self.info.get("compress_config", {}).get("model")


def _tokenizer_for(reference: str):
    from transformers import AutoTokenizer

    from .io.models import resolve

    src = resolve(reference)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return AutoTokenizer.from_pretrained(src.path, **kw)


def load_for_eval(reference: str | Path, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """A rana folder (`rana.io.load`, with its plan.json) or any dense reference (`load_model`)."""
    from . import io as rana_io
    from .io.models import load_model
    from .units import DTYPES

    reference = str(reference)
    if rana_io.is_rana_dir(reference):
        model, tokenizer = rana_io.load(reference, device=device, dtype=DTYPES.get(dtype) if dtype != "float32" else None)
        plan = rana_io.read_plan(reference)
        meta = rana_io.read_meta(Path(reference))
        loaded = LoadedModel(model, tokenizer, reference, "rana", plan,
                             {k: v for k, v in meta.items() if k in ("method", "compress_config", "laurel")})
        if tokenizer is None and loaded.dense_reference:
            loaded.tokenizer = _tokenizer_for(loaded.dense_reference)
        return loaded
    model, tokenizer, _ = load_model(reference, dtype=dtype, device=device)
    return LoadedModel(model, tokenizer, reference, "dense")


# --------------------------------------------------------------------------- evaluation text


def text_name(source: str | Path) -> str:
    """A short label for an evaluation text: the file stem, or the dataset name."""
    s = str(source)
    p = Path(os.path.expanduser(s))
    if p.exists():
        return p.stem if p.is_file() else p.name
    return s.split(":")[0].rstrip("/").split("/")[-1]


def _parse_source(source: str) -> tuple[str, str | None, str]:
    """`path` or `hub_name[:config[:split]]` (split defaults to test for evaluation)."""
    if Path(os.path.expanduser(source)).exists() or ":" not in source:
        return source, None, "test"
    name, _, rest = source.partition(":")
    config, _, split = rest.partition(":")
    return name, config or None, split or "test"


def eval_tokens(source: str | Path, tokenizer, *, max_tokens: int | None = None, text_column: str = "text") -> torch.Tensor:
    """The token stream of an evaluation text (`load_texts` + `tokenize_stream`, EOS between
    documents), truncated to its first `max_tokens` tokens when given."""
    name, config, split = _parse_source(str(source))

    def read(max_chars):
        texts = load_texts(name, config=config, split=split, text_column=text_column, max_chars=max_chars)
        return tokenize_stream(texts, tokenizer)

    if max_tokens is None:
        return read(None)
    tokens = read(16 * max_tokens + 1024)  # ~16 characters per token is generous for any tokenizer
    if tokens.numel() < max_tokens:
        tokens = read(None)
    return tokens[:max_tokens]


def _as_sources(ppl_sources) -> list[tuple[str, Any]]:
    if ppl_sources is None:
        return []
    if isinstance(ppl_sources, Mapping):
        return list(ppl_sources.items())
    if isinstance(ppl_sources, (str, Path, torch.Tensor)):
        ppl_sources = [ppl_sources]
    out, seen = [], set()
    for i, s in enumerate(ppl_sources):
        name = text_name(s) if not isinstance(s, torch.Tensor) else f"text{i}"
        base, k = name, 2
        while name in seen:
            name, k = f"{base}_{k}", k + 1
        seen.add(name)
        out.append((name, s))
    return out


# --------------------------------------------------------------------------- FLOPs


def summarize_flops(measured: dict, tokens: int) -> dict:
    """`accounting.measured_macs` output → the reported FLOP block (fractions and GFLOPs/token)."""
    dense = measured["dense_macs"]
    by_part = {}
    for part, d in measured["by_part"].items():
        by_part[part] = {
            "fraction_of_part": d["fraction_of_part"],
            "gflops_per_token": 2 * d["measured_macs"] / 1e9,
            "dense_gflops_per_token": 2 * d["dense_macs"] / 1e9,
            "share_of_dense_total": d["measured_macs"] / dense,
        }
    return {
        "fraction": measured["fraction"],
        "gflops_per_token": measured["gflops_per_token"],
        "dense_gflops_per_token": measured["dense_gflops_per_token"],
        "measured_macs": measured["measured_macs"],
        "dense_macs": dense,
        "by_part": by_part,
        "tokens": int(tokens),
        "attention_context": measured.get("seq_len_for_attention"),
    }


def combine_flops(blocks: Sequence[dict]) -> dict:
    """Token-weighted average of per-text FLOP blocks. Every metered module sees every token,
    so this equals metering all the texts at once."""
    total = sum(b["tokens"] for b in blocks)
    w = [b["tokens"] / total for b in blocks]
    avg = lambda get: sum(wi * get(b) for wi, b in zip(w, blocks))  # noqa: E731
    first = blocks[0]
    out = {
        "fraction": avg(lambda b: b["fraction"]),
        "gflops_per_token": avg(lambda b: b["gflops_per_token"]),
        "dense_gflops_per_token": first["dense_gflops_per_token"],
        "measured_macs": avg(lambda b: b["measured_macs"]),
        "dense_macs": first["dense_macs"],
        "by_part": {},
        "tokens": total,
        "attention_context": first.get("attention_context"),
    }
    for part in first["by_part"]:
        out["by_part"][part] = {
            "fraction_of_part": avg(lambda b: b["by_part"][part]["fraction_of_part"]),
            "gflops_per_token": avg(lambda b: b["by_part"][part]["gflops_per_token"]),
            "dense_gflops_per_token": first["by_part"][part]["dense_gflops_per_token"],
            "share_of_dense_total": avg(lambda b: b["by_part"][part]["share_of_dense_total"]),
        }
    return out


def metered_perplexity(model: nn.Module, tokens: torch.Tensor, *, seq_len: int = 512, batch_size: int = 4,
                       progress: Progress | None = None, label: str = "perplexity") -> tuple[dict, dict]:
    """Perplexity (standard protocol) with the adapters' meters on: (ppl result, FLOP block)."""
    from .data import eval_windows
    from .evaluate import perplexity

    n_windows = len(eval_windows(tokens, seq_len))
    done = [0]

    def on_batch(ids):
        done[0] += len(ids)
        if progress:
            progress(label, done[0], n_windows)

    with metering(model):
        result = perplexity(model, tokens, seq_len=seq_len, batch_size=batch_size, progress=False, on_batch=on_batch)
        flops = summarize_flops(measured_macs(model, seq_len), result["windows"] * seq_len)
    return result, flops


# --------------------------------------------------------------------------- one model


def evaluate_model(
    model: nn.Module,
    tokenizer,
    *,
    ppl_sources=None,
    seq_len: int = 512,
    batch_size: int = 4,
    max_tokens: int | None = None,
    text_column: str = "text",
    tasks: Sequence[str] = (),
    include_path: str | Path | None = None,
    task_data: str | Path | None = None,
    limit: int | float | None = None,
    num_fewshot: int = 0,
    latency: bool = False,
    dense_model: nn.Module | None = None,
    latency_new_tokens: int = 64,
    latency_repeats: int = 5,
    latency_warmup: int = 2,
    latency_mode: str | None = None,
    name: str | None = None,
    plan: dict | None = None,
    progress: Progress | None = None,
) -> dict:
    """Evaluate one in-memory model; returns a JSON-ready dict.

    - `ppl_sources`: texts to measure perplexity on — paths / hub names (`name[:config[:split]]`)
      or pre-tokenised 1-D streams, as a list or a {label: source} mapping. Each is truncated to
      `max_tokens` tokens and scored with `rana.evaluate.perplexity` (non-overlapping `seq_len`
      windows, tail dropped, all tokens but the first of each window).
    - FLOPs are *measured*: the meters of every adapter are on during those perplexity passes, so
      `flops` is the average per-token cost of the masks actually taken on the evaluation tokens
      (attention products counted at `seq_len` context, method.md §3), overall and per text.
    - `tasks`: lm-eval task names; `include_path` adds task YAMLs, `task_data` renders the
      bundled offline `*_local` tasks from that data folder.
    - `latency`: batch-1 decode speed; with `dense_model`, timed interleaved with it under the same
      harness (`latency_mode`: "compiled" = static cache + torch.compile, "eager"; default compiled on
      CUDA, eager elsewhere) and reported as a ratio, next to the measured FLOP fraction F (when
      perplexity was measured) and the memory-bound limit 1/F of the speed-up.
    """
    result: dict[str, Any] = {"name": name, "seq_len": seq_len, "max_tokens_per_text": max_tokens}
    if plan:
        result["method"] = plan.get("method")
        result["target_flops"] = plan.get("target_flops")
        result["plan_measured_flops"] = plan.get("measured_flops")
        result["plan_measured_on"] = plan.get("measured_on")
    result["params"] = sum(p.numel() for p in model.parameters())

    sources = _as_sources(ppl_sources)
    ppl, flop_blocks, per_text = {}, [], {}
    for label, source in sources:
        tokens = source if isinstance(source, torch.Tensor) else eval_tokens(source, tokenizer, max_tokens=max_tokens,
                                                                               text_column=text_column)
        if isinstance(source, torch.Tensor) and max_tokens is not None:
            tokens = tokens[:max_tokens]
        if tokens.numel() < seq_len:
            raise DataError(f"evaluation text '{label}' has {tokens.numel()} tokens, fewer than one window of "
                            f"--seq-len {seq_len}; pass more text or a smaller --seq-len")
        r, fl = metered_perplexity(model, tokens, seq_len=seq_len, batch_size=batch_size, progress=progress,
                                   label=f"ppl {label}")
        r["source"] = str(source) if not isinstance(source, torch.Tensor) else "token ids"
        ppl[label] = r
        flop_blocks.append(fl)
        per_text[label] = fl["fraction"]
    result["ppl"] = ppl
    if sources:
        result["protocol"] = ppl_protocol(seq_len, max_tokens)
        flops = combine_flops(flop_blocks)
        flops["per_text"] = per_text
        flops["measured_on"] = f"{flops['tokens']} evaluation tokens ({', '.join(ppl)})"
        result["flops"] = flops
    else:
        result["flops"] = None

    if tasks:
        from .evaluate import lm_eval_tasks

        local = [t for t in tasks if t.endswith("_local")]
        if local and task_data is None and include_path is None:
            raise DataError(f"task(s) {', '.join(local)} read local data: pass --task-data FOLDER (the folder holding "
                            "eval/hellaswag_validation.jsonl etc., e.g. ../shared/data)")
        if progress:
            progress("lm-eval tasks", 0, 1)
        result["tasks"] = lm_eval_tasks(model, tokenizer, list(tasks), include_path=include_path,
                                        data_dir=task_data if local else None, limit=limit, num_fewshot=num_fewshot)
        result["tasks_limit"] = limit
        if progress:
            progress("lm-eval tasks", 1, 1)
    if latency:
        result["latency"] = measure_latency(model, tokenizer, dense_model, new_tokens=latency_new_tokens,
                                            repeats=latency_repeats, warmup=latency_warmup, mode=latency_mode)
        fraction = (result.get("flops") or {}).get("fraction")
        result["latency"]["flops_fraction"] = fraction
        result["latency"]["speedup_limit"] = 1.0 / fraction if fraction else None
    return result


def ppl_protocol(seq_len: int, max_tokens: int | None) -> str:
    cap = f"the first {max_tokens} tokens of each text" if max_tokens else "each whole text"
    return (f"perplexity on {cap}: documents tokenised without special tokens and joined with EOS, cut into "
            f"non-overlapping {seq_len}-token windows (tail dropped), mean NLL over every token but the first of each "
            f"window; FLOPs metered on the same tokens, attention products at {seq_len}-token context")


def measure_latency(model: nn.Module, tokenizer, dense_model: nn.Module | None = None, *, new_tokens: int = 64,
                    repeats: int = 5, warmup: int = 2, mode: str | None = None) -> dict:
    """Batch-1 decode tokens/s; against `dense_model` (timed interleaved, same harness) as a ratio.

    `decode_path` says which masked-GEMV path produced the numbers (they differ by device,
    thread count and whether the native CPU kernel could be built here)."""
    from .evaluate import decode_latency, default_latency_mode, latency_ratio

    mode = mode or default_latency_mode(next(model.parameters()).device)
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


def decode_path(model: nn.Module) -> str:
    """The batch-1 masked-GEMV path `model`'s adapters take where it lives, in words."""
    from .kernels.cpu_gemv import native_status
    from .kernels.masked_gemv import triton_available

    device = next(model.parameters()).device
    if device.type == "cuda":
        return "CUDA: " + ("Triton masked-GEMV kernels (rana::masked_gemv_triton)" if triton_available()
                           else "dense masked product (no triton)")
    if device.type == "cpu":
        return f"CPU, {torch.get_num_threads()} thread(s): {native_status()}"
    return f"{device.type}: dense masked product"


# --------------------------------------------------------------------------- per-block errors


def _windows(tokens: torch.Tensor, seq_len: int, max_tokens: int | None) -> torch.Tensor:
    """(n, T) windows from a 1-D stream (cut into `seq_len` windows) or as given, capped at ~max_tokens."""
    from .data import eval_windows

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
        raise ValueError(f"model has {len(layers)} layers, dense model {len(dense_layers)}: not the same architecture")
    dense_device = next(dense_model.parameters()).device
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
        qkv = [spec.qkv_fused] if spec.qkv_fused else [spec.q, spec.k, spec.v]
        mods = [layer.get_submodule(f"{spec.attn}.{n}") for n in qkv]
        adapted[(idx, "attention")] = any(_changed(m, dlayer.get_submodule(f"{spec.attn}.{n}")) for n, m in zip(qkv, mods))
        for n, m in zip(qkv, mods):
            handles.append(m.register_forward_hook(hook_for((idx, "attention"), dlayer.get_submodule(f"{spec.attn}.{n}"))))
        o = layer.get_submodule(f"{spec.attn}.{spec.o}")
        adapted[(idx, "o")] = _changed(o, dlayer.get_submodule(f"{spec.attn}.{spec.o}"))
        handles.append(o.register_forward_hook(hook_for((idx, "o"), dlayer.get_submodule(f"{spec.attn}.{spec.o}"))))
        mlp = layer.get_submodule(spec.mlp)
        adapted[(idx, "mlp")] = _changed(mlp, dlayer.get_submodule(spec.mlp))
        handles.append(mlp.register_forward_hook(hook_for((idx, "mlp"), dlayer.get_submodule(spec.mlp))))
    windows = _windows(tokens, seq_len, max_tokens)
    device = next(model.parameters()).device
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
    """Modules that compute a rank code `z = B x` (RankAdapterLinear, SharedRankCode)."""
    from .modules import RankAdapterLinear, SharedRankCode

    return {n: m for n, m in model.named_modules() if isinstance(m, (RankAdapterLinear, SharedRankCode))}


@torch.no_grad()
def rank_contributions(model: nn.Module, tokens: torch.Tensor, *, layers: Sequence[int] | None = None,
                       seq_len: int = 512, batch_size: int = 4, max_tokens: int = 2048,
                       bins: Sequence[float] | None = None) -> dict[str, dict]:
    """Histogram of per-token normalised rank contributions `z_j² / Σ_k z_k²` (z = B x) of the
    rank adapters in `layers` (default: the middle decoder layer), captured by forward hooks on
    their `B` child while the model runs on `tokens`. Since A's columns are orthonormal, z_j² is
    rank j's share of ‖y‖² (before masking). Also reports the mean share of ranks the mask
    keeps and the mean share of energy they carry."""
    import numpy as np

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
    device = next(model.parameters()).device
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
