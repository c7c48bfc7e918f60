"""`rana eval` as a library: measure models and return one JSON-ready row per model.

`evaluate_model` measures one in-memory model: perplexity on several texts with the FLOPs its
masks actually take on those tokens, lm-eval tasks, decode speed against the dense model.
`evaluate_models` opens each reference (a rana folder or a dense model), loads the dense model
it came from when latency or per-layer errors need it (one at a time), and returns the table
`rana eval` prints and writes as JSON.
"""
from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..accounting import measured_macs, metering
from ..data import DataError
from ..io import is_rana_dir
from ..io.models import LoadedModel, load_model, open_model
from . import diagnostics
from .common import Progress
from .harness import lm_eval_tasks
from .latency import measure_latency
from .serving import SERVE_MODE, Exporter, serve_latency, serve_unavailable
from .perplexity import (PplProtocol, combine_flops, eval_tokens, labelled_sources, perplexity, ppl_preset,
                         protocol_tokens, summarize_flops, window_starts)
from .perplexity import ppl_protocol as describe_protocol

# --------------------------------------------------------------------------- perplexity with the meters on


def metered_perplexity(model: nn.Module, tokens: torch.Tensor, *, seq_len: int = 512, batch_size: int = 4,
                       progress: Progress | None = None, label: str = "perplexity",
                       protocol: PplProtocol | None = None) -> tuple[dict, dict]:
    """Perplexity under `protocol` (default: `rana` with `seq_len`-token windows) with the adapters'
    meters on: (ppl result, FLOP block).

    The meters see every token of every window the protocol runs (with `teal`'s overlapping windows a
    token is run once per window it is in), and attention products are counted at the window length:
    each run token attends to the positions before it in its window, (window + 1) / 2 on average."""
    protocol = protocol or ppl_preset("rana", seq_len)
    n_windows = len(window_starts(tokens.numel(), protocol))
    done = [0]

    def on_batch(ids):
        done[0] += len(ids)
        if progress:
            progress(label, done[0], n_windows)

    with metering(model):
        result = perplexity(model, tokens, batch_size=batch_size, progress=False, on_batch=on_batch, protocol=protocol)
        flops = summarize_flops(measured_macs(model, protocol.window), result["windows"] * protocol.window)
    return result, flops


# --------------------------------------------------------------------------- one model


def evaluate_model(
    model: nn.Module,
    tokenizer,
    *,
    ppl_sources=None,
    ppl_protocol: str = "rana",
    seq_len: int | None = None,
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
    reference: str | Path | None = None,
    export: Exporter | None = None,
) -> dict:
    """Evaluate one in-memory model; returns a JSON-ready dict.

    - `ppl_sources`: texts to measure perplexity on — paths / hub names (`name[:config[:split]]`)
      or pre-tokenised 1-D streams (used as given), as a list or a {label: source} mapping. Each is
      truncated to `max_tokens` tokens and scored with `perplexity.perplexity` under the preset
      `ppl_protocol` (`rana`: non-overlapping `seq_len` windows, tail dropped, all tokens but the
      first of each window; `gptq`, `teal`: see `perplexity.PPL_PRESETS`). `seq_len` (None: the
      preset's) replaces the window length of `rana` / `gptq` and the context of `teal`.
    - FLOPs are *measured*: the meters of every adapter are on during those perplexity passes, so
      `flops` is the average per-token cost of the masks actually taken on the tokens of every window
      run (attention products counted at the window length, docs/method.md §3), overall and per text.
    - `tasks`: lm-eval task names; `include_path` adds task YAMLs, `task_data` renders the
      bundled offline `*_local` tasks from that data folder.
    - `latency`: batch-1 decode speed; with `dense_model`, timed interleaved with it under the same
      harness (`latency_mode`: "compiled" = static cache + torch.compile, "step" = gpt-fast-style compiled
      one-token step, "eager"; default compiled on
      CUDA, eager elsewhere) and reported as a ratio, next to the measured FLOP fraction F (when
      perplexity was measured) and the memory-bound limit 1/F of the speed-up.
      `latency_mode` "serve" times both through `transformers serve` instead (`serving.serve_latency`):
      the compressed model exported from `reference` (its rana folder; an in-memory model is saved
      first) with `export` (`rana.export.export`), the dense one saved as a plain folder.
    """
    protocol = ppl_preset(ppl_protocol, seq_len)
    result: dict[str, Any] = {"name": name, "seq_len": protocol.window, "max_tokens_per_text": max_tokens,
                              "ppl_protocol": protocol.name}
    if plan:
        result["method"] = plan.get("method")
        result["target_flops"] = plan.get("target_flops")
        result["plan_measured_flops"] = plan.get("measured_flops")
        result["plan_measured_on"] = plan.get("measured_on")
    result["params"] = sum(p.numel() for p in model.parameters())

    sources = labelled_sources(ppl_sources)
    ppl, flop_blocks, per_text = {}, [], {}
    for label, source in sources:
        tokens = source if isinstance(source, torch.Tensor) else protocol_tokens(
            source, tokenizer, protocol, max_tokens=max_tokens, text_column=text_column)
        if isinstance(source, torch.Tensor) and max_tokens is not None:
            tokens = tokens[:max_tokens]
        if tokens.numel() < protocol.window:
            raise DataError(f"evaluation text '{label}' has {tokens.numel()} tokens, fewer than one "
                            f"{protocol.window}-token window of the {protocol.name} perplexity protocol; pass more "
                            "text or a smaller --seq-len")
        r, fl = metered_perplexity(model, tokens, batch_size=batch_size, progress=progress, label=f"ppl {label}",
                                   protocol=protocol)
        r["source"] = str(source) if not isinstance(source, torch.Tensor) else "token ids"
        ppl[label] = r
        flop_blocks.append(fl)
        per_text[label] = fl["fraction"]
    result["ppl"] = ppl
    if sources:
        result["protocol"] = describe_protocol(protocol, max_tokens)
        flops = combine_flops(flop_blocks)
        flops["per_text"] = per_text
        flops["measured_on"] = f"{flops['tokens']} evaluation tokens ({', '.join(ppl)})"
        result["flops"] = flops
    else:
        result["flops"] = None

    if tasks:
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
    if latency and latency_mode == SERVE_MODE:
        result["latency"] = serve_latency(model, tokenizer, dense_model, reference=reference, export=export,
                                          new_tokens=latency_new_tokens, repeats=latency_repeats,
                                          warmup=latency_warmup, progress=progress)
    elif latency:
        result["latency"] = measure_latency(model, tokenizer, dense_model, new_tokens=latency_new_tokens,
                                            repeats=latency_repeats, warmup=latency_warmup, mode=latency_mode)
        fraction = (result.get("flops") or {}).get("fraction")
        result["latency"]["flops_fraction"] = fraction
        result["latency"]["speedup_limit"] = 1.0 / fraction if fraction else None
    return result


# --------------------------------------------------------------------------- several models (`rana eval`)


def check_request(*, ppl_sources: Sequence = (), tasks: Sequence[str] = (), latency: bool = False,
                  layer_errors: bool = False) -> None:
    """Something to measure, and a text for the per-layer errors (checked before any model loads)."""
    if not ppl_sources and not tasks and not latency:
        raise ValueError("nothing to evaluate: pass --ppl-data FILE (perplexity + measured FLOPs), --tasks and/or --latency")
    if layer_errors and not ppl_sources:
        raise ValueError("--layer-errors runs on the first --ppl-data text: pass one")


def check_serving(refs: Sequence[str], export: Exporter | None) -> None:
    """The serve latency mode can run: `transformers serve` is installed here, and rana folders have an
    exporter to become servable folders."""
    reason = serve_unavailable()
    if reason:
        raise ValueError(f"--latency-mode serve: {reason}")
    if export is None and any(is_rana_dir(r) for r in refs):
        raise ValueError("the serve latency mode serves rana folders as quantizer-format exports: pass "
                         "export=rana.export.export")


def evaluate_models(
    refs: Sequence[str | Path],
    *,
    ppl_sources: Sequence[str | Path] = (),
    ppl_protocol: str = "rana",
    seq_len: int | None = None,
    batch_size: int = 4,
    max_tokens: int | None = None,
    text_column: str = "text",
    tasks: Sequence[str] = (),
    include_path: str | Path | None = None,
    task_data: str | Path | None = None,
    limit: int | float | None = None,
    num_fewshot: int = 0,
    latency: bool = False,
    latency_new_tokens: int = 64,
    latency_repeats: int = 5,
    latency_mode: str | None = None,
    layer_errors: bool = False,
    layer_error_tokens: int = 8192,
    dense: str | None = None,
    dtype: str = "float32",
    device: str = "cpu",
    progress: Progress | None = None,
    log: Callable[[str], None] | None = None,
    export: Exporter | None = None,
) -> dict:
    """Evaluate every model in `refs` (rana folders or dense references) the same way; returns
    `{"models": [one evaluate_model row per ref], "seq_len", "eval_tokens", "ppl_protocol", "protocol"}`,
    what `rana eval` tabulates and writes with `--json`. `ppl_protocol` names the perplexity preset
    (rana | gptq | teal); `seq_len` (None: the preset's) overrides its window (see `evaluate_model`).

    Each row also carries `reference`, `kind` ("rana" | "dense") and `dense_reference`. The dense
    model (`dense`; default: the one each rana folder's plan names, a dense ref being its own) is
    loaded only for `latency` (timed interleaved with it) and `layer_errors` (per-layer output
    errors on the first `layer_error_tokens` tokens of the first perplexity text), and kept while
    consecutive models share it. Models are loaded one at a time.

    `latency_mode` "serve": timed through `transformers serve` (`serving.serve_latency`); a rana folder
    is served as its quantizer-format export, written by `export` (pass `rana.export.export`: this
    package does not import the export command; `rana eval` passes it).
    """
    check_request(ppl_sources=ppl_sources, tasks=tasks, latency=latency, layer_errors=layer_errors)
    protocol = ppl_preset(ppl_protocol, seq_len)
    refs = [str(r) for r in refs]
    if latency and latency_mode == SERVE_MODE:  # before any model loads
        check_serving(refs, export)
    log = log or (lambda msg: None)
    dense_cache: dict[str, nn.Module] = {}

    def dense_for(loaded: LoadedModel) -> nn.Module:
        ref = dense or loaded.dense_reference
        if ref is None:
            raise ValueError(f"no dense model known for '{loaded.reference}' (plan.json names none): pass --dense REF")
        if loaded.kind == "dense" and dense is None:
            return loaded.model
        if ref not in dense_cache:
            dense_cache.clear()
            log(f"loading dense model {ref}")
            dense_cache[ref] = load_model(ref, dtype=dtype, device=device)[0]
        return dense_cache[ref]

    rows = []
    for i, ref in enumerate(refs):
        # before the first bar: load errors stay one line; float32 keeps a rana folder's saved dtype
        loaded = open_model(ref, dtype=None if dtype == "float32" else dtype, device=device)
        if progress:
            progress("models", i, len(refs))
        if loaded.tokenizer is None:
            raise ValueError(f"'{ref}' has no tokenizer and plan.json names no model to take it from")
        dense_model = dense_for(loaded) if (latency or layer_errors) else None
        row = evaluate_model(loaded.model, loaded.tokenizer, ppl_sources=list(ppl_sources), ppl_protocol=ppl_protocol,
                             seq_len=seq_len,
                             batch_size=batch_size, max_tokens=max_tokens, text_column=text_column,
                             tasks=list(tasks), include_path=include_path, task_data=task_data, limit=limit,
                             num_fewshot=num_fewshot, latency=latency, dense_model=dense_model,
                             latency_new_tokens=latency_new_tokens, latency_repeats=latency_repeats,
                             latency_mode=latency_mode, name=ref, plan=loaded.plan, progress=progress,
                             reference=ref, export=export)
        row["reference"], row["kind"] = ref, loaded.kind
        row["dense_reference"] = dense or loaded.dense_reference
        if layer_errors:
            tokens = eval_tokens(ppl_sources[0], loaded.tokenizer, max_tokens=layer_error_tokens, text_column=text_column)
            row["layer_errors"] = diagnostics.layer_errors(loaded.model, dense_model, tokens, seq_len=protocol.window,
                                                           batch_size=batch_size, max_tokens=layer_error_tokens)
            row["layer_errors_on"] = f"first {layer_error_tokens} tokens of {ppl_sources[0]}"
        rows.append(row)
        del loaded
        gc.collect()
        if progress:
            progress("models", i + 1, len(refs))
    return {"models": rows, "seq_len": protocol.window, "eval_tokens": max_tokens, "ppl_protocol": protocol.name,
            "protocol": describe_protocol(protocol, max_tokens) if ppl_sources else None}
