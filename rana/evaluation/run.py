"""`rana eval` as a library: measure models and return one JSON-ready row per model.

`evaluate_model` measures one in-memory model: perplexity on several texts with the FLOPs its
masks actually take on those tokens, lm-eval tasks, decode speed against the dense model.
`evaluate_models` opens each reference (a rana folder or a dense model), loads the dense model
it came from when latency or per-layer errors need it (one at a time), and returns the table
`rana eval` prints and writes as JSON.
"""
from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..accounting import measured_macs, metering
from ..data import DataError
from ..errors import UserError
from ..io import is_rana_dir
from ..io.models import LoadedModel, load_model, model_config, open_model
from ..units import Progress
from . import diagnostics
from .config import EvalConfig, check_request, check_serve_available
from .harness import lm_eval_tasks
from .latency import DEFAULT_PROMPT, check_decode_fits, check_prompts_fit, measure_latency
from .serving import SERVE_MODE, SERVE_PROMPTS, Exporter, serve_latency
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


def evaluate_model(model: nn.Module, tokenizer, config: EvalConfig | None = None, *,
                   dense_model: nn.Module | None = None, name: str | None = None, plan: dict | None = None,
                   progress: Progress | None = None, reference: str | Path | None = None,
                   export: Exporter | None = None, **settings) -> dict:
    """Evaluate one in-memory model as `config` asks (or the keyword `settings`, `EvalConfig` field
    names, on top of it; `EvalConfig.merged`); returns a JSON-ready dict.

    - `ppl_data` (library name `ppl_sources`): texts to measure perplexity on — paths / hub names
      (`name[:config[:split]]`) or pre-tokenised 1-D streams (used as given), as a list or a
      {label: source} mapping. Each is truncated to `eval_tokens` (`max_tokens`) tokens and scored with
      `perplexity.perplexity` under the preset `ppl_protocol` (`rana`: non-overlapping `seq_len` windows,
      tail dropped, all tokens but the first of each window; `gptq`, `teal`: see `perplexity.PPL_PRESETS`).
      `seq_len` (None: the preset's) replaces the window length of `rana` / `gptq` and the context of `teal`.
    - FLOPs are *measured*: the meters of every adapter are on during those perplexity passes, so
      `flops` is the average per-token cost of the masks actually taken on the tokens of every window
      run (attention products counted at the window length, docs/method.md §3), overall and per text.
    - `tasks`: lm-eval task names; `include_path` adds task YAMLs, `task_data` renders the
      bundled offline `*_local` tasks from that data folder.
    - `latency`: batch-1 decode speed; with `dense_model`, timed interleaved with it under the same
      harness (`latency_mode`: "compiled" = static cache + torch.compile, "step" = gpt-fast-style compiled
      one-token step, "eager"; "auto" / None: compiled on CUDA, eager elsewhere) and reported as a ratio,
      next to the measured FLOP fraction F (when perplexity was measured) and the memory-bound limit 1/F
      of the speed-up. `latency_mode` "serve" times both through `transformers serve` instead
      (`serving.serve_latency`): the compressed model exported from `reference` (its rana folder; an
      in-memory model is saved first) with `export` (`rana.export.export`), the dense one saved as a plain folder.
    """
    config = EvalConfig.merged(config, settings)
    protocol = config.protocol
    if config.latency:  # a decode that cannot finish is refused before anything is measured
        check_prompts_fit([model, dense_model], tokenizer,
                          SERVE_PROMPTS if config.latency_mode == SERVE_MODE else [DEFAULT_PROMPT],
                          config.latency_tokens, f"'{name}'" if name else "the model")
    result: dict[str, Any] = {"name": name, "seq_len": protocol.window, "max_tokens_per_text": config.eval_tokens,
                              "ppl_protocol": protocol.name}
    if plan:
        result["method"] = plan.get("method")
        result["target_flops"] = plan.get("target_flops")
        result["plan_measured_flops"] = plan.get("measured_flops")
        result["plan_measured_on"] = plan.get("measured_on")
    result["params"] = sum(p.numel() for p in model.parameters())
    result.update(_perplexities(model, tokenizer, config, protocol, progress))
    if config.task_list:
        result.update(_tasks(model, tokenizer, config, progress))
    if config.latency and config.latency_mode == SERVE_MODE:
        result["latency"] = serve_latency(model, tokenizer, dense_model, reference=reference, export=export,
                                          new_tokens=config.latency_tokens, repeats=config.latency_repeats,
                                          warmup=config.latency_warmup, progress=progress)
    elif config.latency:
        result["latency"] = measure_latency(model, tokenizer, dense_model, new_tokens=config.latency_tokens,
                                            repeats=config.latency_repeats, warmup=config.latency_warmup,
                                            mode=config.harness_mode)
        fraction = (result.get("flops") or {}).get("fraction")
        result["latency"]["flops_fraction"] = fraction
        result["latency"]["speedup_limit"] = 1.0 / fraction if fraction else None
    return result


def _perplexities(model: nn.Module, tokenizer, config: EvalConfig, protocol: PplProtocol,
                  progress: Progress | None) -> dict:
    """`ppl` (one result per text) and `flops` (measured on all of them), with `protocol` between when
    there is any text."""
    max_tokens = config.eval_tokens
    sources = labelled_sources(config.ppl_data)
    ppl, flop_blocks, per_text = {}, [], {}
    for label, source in sources:
        tokens = source if isinstance(source, torch.Tensor) else protocol_tokens(
            source, tokenizer, protocol, max_tokens=max_tokens, text_column=config.text_column)
        if isinstance(source, torch.Tensor) and max_tokens is not None:
            tokens = tokens[:max_tokens]
        if tokens.numel() < protocol.window:
            raise DataError(f"evaluation text '{label}' has {tokens.numel()} tokens, fewer than one "
                            f"{protocol.window}-token window of the {protocol.name} perplexity protocol; pass more "
                            "text or a smaller --seq-len")
        r, fl = metered_perplexity(model, tokens, batch_size=config.batch_size, progress=progress,
                                   label=f"ppl {label}", protocol=protocol)
        r["source"] = str(source) if not isinstance(source, torch.Tensor) else "token ids"
        ppl[label] = r
        flop_blocks.append(fl)
        per_text[label] = fl["fraction"]
    if not sources:
        return {"ppl": ppl, "flops": None}
    flops = combine_flops(flop_blocks)
    flops["per_text"] = per_text
    flops["measured_on"] = f"{flops['tokens']} evaluation tokens ({', '.join(ppl)})"
    return {"ppl": ppl, "protocol": describe_protocol(protocol, max_tokens), "flops": flops}


def _tasks(model: nn.Module, tokenizer, config: EvalConfig, progress: Progress | None) -> dict:
    """`tasks` (lm-eval's metrics per task) and `tasks_limit`."""
    tasks = config.task_list
    local = [t for t in tasks if t.endswith("_local")]
    if local and config.task_data is None and config.include_path is None:
        raise DataError(f"task(s) {', '.join(local)} read local data: pass --task-data FOLDER (the folder holding "
                        "eval/hellaswag_validation.jsonl etc., e.g. ../shared/data)")
    if progress:
        progress("lm-eval tasks", 0, 1)
    metrics = lm_eval_tasks(model, tokenizer, tasks, include_path=config.include_path,
                            data_dir=config.task_data if local else None, limit=config.limit,
                            num_fewshot=config.num_fewshot)
    if progress:
        progress("lm-eval tasks", 1, 1)
    return {"tasks": metrics, "tasks_limit": config.limit}


# --------------------------------------------------------------------------- several models (`rana eval`)


def check_serving(refs: Sequence[str], export: Exporter | None) -> None:
    """The serve latency mode can run: `transformers serve` is installed here, and rana folders have an
    exporter to become servable folders."""
    check_serve_available()
    if export is None and any(is_rana_dir(r) for r in refs):
        raise UserError("the serve latency mode serves rana folders as quantizer-format exports: pass "
                        "export=rana.export.export")


def check_latency_positions(refs: Sequence[str], new_tokens: int) -> None:
    """Before any weights load: refuse `new_tokens` latency tokens that no prompt leaves room for in a
    model's positions (its config read alone; the exact prompt is checked once the tokenizer is loaded,
    in `evaluate_model`). A config that cannot be read here is left to the load to report."""
    for ref in refs:
        try:
            config = model_config(ref)
        except Exception:  # noqa: BLE001 - unreadable here: opening the model says why, in one line
            continue
        check_decode_fits(config, 1, new_tokens, f"'{ref}'")  # a prompt holds at least one token


def evaluate_models(refs: Sequence[str | Path], config: EvalConfig | None = None, *, progress: Progress | None = None,
                    log: Callable[[str], None] | None = None, export: Exporter | None = None, **settings) -> dict:
    """Evaluate every model in `refs` (rana folders or dense references) the same way, as `config` asks
    (or the keyword `settings` on top of it, as for `evaluate_model`); returns `{"models": [one
    evaluate_model row per ref], "seq_len", "eval_tokens", "ppl_protocol", "protocol"}`, what `rana eval`
    tabulates and writes with `--json`. `ppl_protocol` names the perplexity preset (rana | gptq | teal);
    `seq_len` (None: the preset's) overrides its window (see `evaluate_model`).

    Each row also carries `reference`, `kind` ("rana" | "dense") and `dense_reference`. The dense
    model (`dense`; default: the one each rana folder's plan names, a dense ref being its own) is
    loaded only for `latency` (timed interleaved with it) and `layer_errors` (per-layer output
    errors on the first `layer_error_tokens` tokens of the first perplexity text), and kept while
    consecutive models share it. Models are loaded one at a time.

    `latency_mode` "serve": timed through `transformers serve` (`serving.serve_latency`); a rana folder
    is served as its quantizer-format export, written by `export` (pass `rana.export.export`: this
    package does not import the export command; `rana eval` passes it).
    """
    config = EvalConfig.merged(config, settings)
    config = dataclasses.replace(config, ppl_data=list(config.ppl_data), tasks=config.task_list)
    check_request(ppl_sources=config.ppl_data, tasks=config.tasks, latency=config.latency,
                  layer_errors=config.layer_errors)
    protocol = config.protocol
    refs = [str(r) for r in refs]
    if config.latency and config.latency_mode == SERVE_MODE:  # before any model loads
        check_serving(refs, export)
    if config.latency:
        check_latency_positions(refs + ([config.dense] if config.dense else []), config.latency_tokens)
    dense_for = _DenseModels(config, log or (lambda msg: None))
    rows = []
    for i, ref in enumerate(refs):
        # before the first bar: load errors stay one line; float32 keeps a rana folder's saved dtype
        loaded = open_model(ref, dtype=None if config.dtype == "float32" else config.dtype, device=config.device)
        if progress:
            progress("models", i, len(refs))
        if loaded.tokenizer is None:
            raise UserError(f"'{ref}' has no tokenizer and plan.json names no model to take it from")
        dense_model = dense_for(loaded) if (config.latency or config.layer_errors) else None
        row = evaluate_model(loaded.model, loaded.tokenizer, config, dense_model=dense_model, name=ref,
                             plan=loaded.plan, progress=progress, reference=ref, export=export)
        row["reference"], row["kind"] = ref, loaded.kind
        row["dense_reference"] = config.dense or loaded.dense_reference
        if config.layer_errors:
            row.update(_layer_errors(loaded, dense_model, config, protocol))
        rows.append(row)
        del loaded
        gc.collect()
        if progress:
            progress("models", i + 1, len(refs))
    return {"models": rows, "seq_len": protocol.window, "eval_tokens": config.eval_tokens,
            "ppl_protocol": protocol.name,
            "protocol": describe_protocol(protocol, config.eval_tokens) if config.ppl_data else None}


class _DenseModels:
    """The dense model of each evaluated one (`config.dense`, else the one its plan names; a dense model
    is its own), loaded once and kept while consecutive models share it."""

    def __init__(self, config: EvalConfig, log: Callable[[str], None]):
        self.config, self.log = config, log
        self.cache: dict[str, nn.Module] = {}

    def __call__(self, loaded: LoadedModel) -> nn.Module:
        dense = self.config.dense
        ref = dense or loaded.dense_reference
        if ref is None:
            raise UserError(f"no dense model known for '{loaded.reference}' (plan.json names none): pass --dense REF")
        if loaded.kind == "dense" and dense is None:
            return loaded.model
        if ref not in self.cache:
            self.cache.clear()
            self.log(f"loading dense model {ref}")
            self.cache[ref] = load_model(ref, dtype=self.config.dtype, device=self.config.device)[0]
        return self.cache[ref]


def _layer_errors(loaded: LoadedModel, dense_model: nn.Module, config: EvalConfig, protocol: PplProtocol) -> dict:
    """Per-layer output errors vs the dense model on the first `layer_error_tokens` tokens of the first text."""
    first, n = config.ppl_data[0], config.layer_error_tokens
    tokens = eval_tokens(first, loaded.tokenizer, max_tokens=n, text_column=config.text_column)
    errors = diagnostics.layer_errors(loaded.model, dense_model, tokens, seq_len=protocol.window,
                                      batch_size=config.batch_size, max_tokens=n)
    return {"layer_errors": errors, "layer_errors_on": f"first {n} tokens of {first}"}
