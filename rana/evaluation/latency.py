"""Decode speed: batch-1 greedy generation timed the way users decode, alone or interleaved
with the dense model, and which masked-GEMV path produced the numbers.

Three harnesses (`LATENCY_MODES`), dense and compressed models always timed the same way:

- "eager": `generate` with the dynamic cache (a correctness harness on CUDA: it is host-bound);
- "compiled": `generate` with one StaticCache per model, reset between runs, transformers compiling
  the decode step (fullgraph; CUDA graphs on CUDA): the fast path transformers gives users, and the
  default on CUDA;
- "step": gpt-fast style (`decode_step.py`): the same cache, an eager prefill, then a compiled
  one-token step called in a bare loop: the model's own decode time, without `generate`'s overhead.

A fourth, "serve" (`serving.py`), times both models out of process, as clients of `transformers serve`.

A run that cannot finish is refused before it starts (`check_decode_fits`): the prompt and the new tokens
must fit the model's positions (`max_position_embeddings`), or generation would run past its position
table (or size a static cache by it) for as long as it takes.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import CompileConfig, GenerationConfig

from ..checks import _POSITION_KEYS
from ..errors import UserError
from ..kernels.cpu_gemv import native_status
from ..kernels.triton_gemv import triton_available
from .common import eval_mode, model_device
from .decode_step import StepRunner, cache_keyword, compile_kwargs, new_cache

DEFAULT_PROMPT = "The history of the Python programming language begins in the late 1980s, when"
LATENCY_MODES = ("eager", "compiled", "step")
COMPILED_MODES = ("compiled", "step")  # compiled steps: warmed up (compile, CUDA graphs) before timing


def _prompt_ids(tokenizer_or_ids, prompt: str) -> torch.Tensor:
    """A (1, T) prompt, from token ids or by tokenising `prompt`."""
    if isinstance(tokenizer_or_ids, torch.Tensor):
        ids = tokenizer_or_ids
    else:
        ids = tokenizer_or_ids(prompt, return_tensors="pt")["input_ids"]
    return ids.reshape(1, -1).long()


def model_positions(config) -> int | None:
    """The longest sequence a model config allows (its text config's, for a multimodal one); None when it
    names none."""
    config = getattr(config, "text_config", None) or config
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def prompt_length(tokenizer_or_ids, prompts: Sequence[str]) -> int:
    """Tokens of the longest prompt as the harnesses tokenise it (`_prompt_ids`: special tokens included),
    or of the prompt ids given instead of a tokenizer."""
    return max(_prompt_ids(tokenizer_or_ids, p).shape[1] for p in prompts)


def check_decode_fits(config, prompt_tokens: int, new_tokens: int, name: str = "the model") -> None:
    """Refuse a decode that cannot finish: `prompt_tokens` + `new_tokens` positions past what `config`
    (a model config) allows. Unknown positions: nothing is refused."""
    limit = model_positions(config)
    if limit is None or prompt_tokens + new_tokens <= limit:
        return
    most = limit - prompt_tokens
    fix = (f"pass --latency-tokens {most} or less" if most >= 1 else "its prompt alone fills them")
    raise UserError(f"--latency-tokens {new_tokens} cannot finish on {name}: a {prompt_tokens}-token prompt and "
                    f"{new_tokens} new tokens need {prompt_tokens + new_tokens} positions, and it has {limit} "
                    f"(max_position_embeddings); {fix}")


def check_prompts_fit(models: Sequence[torch.nn.Module | None], tokenizer_or_ids, prompts: Sequence[str],
                      new_tokens: int, name: str = "the model") -> None:
    """`check_decode_fits` of every model in `models` (None: skipped) for the longest of `prompts`."""
    length = prompt_length(tokenizer_or_ids, prompts)
    for m in models:
        if m is not None:
            check_decode_fits(getattr(m, "config", None), length, new_tokens, name)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_latency_mode(device: torch.device | str) -> str:
    """compiled (static cache + torch.compile: the fast path transformers gives users) on CUDA, else eager."""
    return "compiled" if torch.device(device).type == "cuda" else "eager"


def cpu_inductor_options() -> dict[str, bool]:
    """inductor settings of a compiled CPU decode step: its generated wrapper without the size and alignment asserts
    on every extern kernel's output (Python calls that check inductor's own bookkeeping, not results; ~1 ms of a
    16 ms SmolLM2 W8A8 step, whose ~120 registered ops are extern kernels). Only the settings this torch has."""
    from torch._inductor import config as inductor_config

    return {name: False for name in ("size_asserts", "alignment_asserts") if hasattr(inductor_config, name)}


def generation_config(model: torch.nn.Module, new_tokens: int, mode: str, device: torch.device) -> GenerationConfig:
    """Greedy decoding of exactly `new_tokens` tokens under harness `mode`.

    Its compile_config is the one compile setting of both compiled harnesses (the step harness compiles its
    step with it too), so tests swap the compile backend of both here."""
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
        if device.type == "cuda":
            compile_config = CompileConfig(fullgraph=True, mode="reduce-overhead")
        else:  # inductor's default mode (torch.compile takes a mode or options, not both)
            compile_config = CompileConfig(fullgraph=True, mode=None, options=cpu_inductor_options())
        compile_config._compile_all_devices = device.type != "cuda"  # transformers compiles on CUDA only, by default
        config.compile_config = compile_config
    else:
        config.disable_compile = True
    return config


class _GenerateRunner:
    """One model under a `generate` harness ("eager" or "compiled"): a full run of `new_tokens` tokens and a
    1-token run (the prefill, subtracted to isolate the decode steps).

    compiled: ONE StaticCache for every run of this model, reset in place before each, so the cache tensors
    (static inputs of the compiled step) keep their addresses and CUDA graphs are recorded once, then
    replayed. (A cache per run would re-record the graphs every run: transformers marks the cache tensors
    static without a guard, and cudagraph trees re-record on a new static address.) transformers'
    `cache_implementation="static"` builds a new cache per call in 5.17 and 5.24 alike, so it is not used."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, mode: str,
                 compile_backend: str | None):
        self.model, self.ids = model, ids
        self.configs = [_config(model, n, mode, ids.device, compile_backend) for n in (new_tokens, 1)]
        self.cache = new_cache(model, ids.shape[1] + new_tokens) if mode == "compiled" else None
        self.cache_kw = cache_keyword(model)  # generate takes the forward's name (cache= in 5.2x)

    def _generate(self, config: GenerationConfig) -> tuple[float, torch.Tensor]:
        kwargs = {}
        if self.cache is not None:
            self.cache.reset()  # zeroes keys, values and the fill counter in place
            kwargs[self.cache_kw] = self.cache
        device = self.ids.device
        _sync(device)
        start = time.perf_counter()
        out = self.model.generate(self.ids, attention_mask=torch.ones_like(self.ids), generation_config=config,
                                  **kwargs)
        _sync(device)
        return time.perf_counter() - start, out[:, self.ids.shape[1]:]

    def __call__(self) -> tuple[float, float, torch.Tensor]:
        """(seconds for `new_tokens` tokens, seconds for 1 token, the generated tokens (1, new_tokens))."""
        t_full, tokens = self._generate(self.configs[0])
        t_prefill, _ = self._generate(self.configs[1])
        return t_full, t_prefill, tokens


def _config(model: torch.nn.Module, new_tokens: int, mode: str, device: torch.device,
            compile_backend: str | None) -> GenerationConfig:
    """generation_config (looked up at call time: tests replace it), with `compile_backend` if given."""
    config = generation_config(model, new_tokens, mode, device)
    if compile_backend is not None and config.compile_config is not None:
        config.compile_config.backend = compile_backend
        if compile_backend != "inductor":
            config.compile_config.mode = "default"  # "reduce-overhead" is inductor's; others refuse a mode
            config.compile_config.options = None  # and inductor's options
    return config


def step_compile_kwargs(model: torch.nn.Module, device: torch.device | str,
                        compile_backend: str | None = None) -> dict[str, Any]:
    """torch.compile keywords of the step harness: the compiled harness's CompileConfig (fullgraph; CUDA
    graphs on CUDA), so both compiled harnesses compile alike."""
    return compile_kwargs(_config(model, 1, "compiled", torch.device(device), compile_backend).compile_config)


def _runner(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, mode: str, compile_backend: str | None):
    """What times one run of `model` under harness `mode`: (t_full, t_prefill, tokens) per call."""
    if mode == "step":
        return StepRunner(model, ids, new_tokens, step_compile_kwargs(model, ids.device, compile_backend))
    return _GenerateRunner(model, ids, new_tokens, mode, compile_backend)


def compile_counters() -> dict[str, int]:
    """A snapshot of torch's compile counters; deltas between two snapshots are the compile events between.

    graphs: graphs dynamo compiled (a new one after the first compile of a step is a recompile);
    graph_breaks: breaks dynamo recorded (fullgraph=True raises on one instead);
    cudagraph_recorded_inputs: grows with every CUDA-graph recording (by its non-static inputs), so 0
    during timed runs means no graph was re-recorded; cudagraph_skips: functions run without CUDA graphs."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "cudagraph_recorded_inputs": int(counters["inductor"]["cudagraph_recorded_non_static_inputs"]),
            "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"])}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


def _measure(models: Sequence[torch.nn.Module], ids: torch.Tensor, new_tokens: int, warmup: int, repeats: int,
             mode: str = "eager", compile_backend: str | None = None) -> list[dict[str, Any]]:
    """Interleave timings of several models so drift (clocks, thermals) hits all alike.

    Compiled harnesses ("compiled", "step") run at least one untimed warm-up round: it compiles the step
    and records its CUDA graphs (its first-run seconds are reported, compile time included). There is no
    eager tuning run: the kernels run the configurations a user's first compiled call gets."""
    if mode not in LATENCY_MODES:
        raise UserError(f"latency mode must be one of {LATENCY_MODES}, got {mode!r}")
    if repeats < 1:
        raise UserError(f"latency repeats must be at least 1, got {repeats}")
    for m in models:
        check_decode_fits(getattr(m, "config", None), ids.shape[1], new_tokens)
    warm = max(warmup, 1 if mode in COMPILED_MODES else 0)
    full: list[list[float]] = [[] for _ in models]
    prefill: list[list[float]] = [[] for _ in models]
    first: list[float | None] = [None] * len(models)
    tokens: list[torch.Tensor | None] = [None] * len(models)
    with torch.inference_mode():
        runners = [_runner(m, ids.to(model_device(m)), new_tokens, mode, compile_backend) for m in models]
        counts = [compile_counters()]
        for step in range(warm + repeats):
            if step == warm:
                counts.append(compile_counters())
            for i, (model, runner) in enumerate(zip(models, runners)):
                with eval_mode(model):
                    t_full, t_prefill, tokens[i] = runner()
                if step == 0:
                    first[i] = t_full
                if step >= warm:
                    full[i].append(t_full)
                    prefill[i].append(t_prefill)
        counts.append(compile_counters())
    health = {"compile_warmup": _delta(counts[0], counts[1]), "compile_timed": _delta(counts[1], counts[2])}
    return [{**_summary(f, p, new_tokens, ids.shape[1], model_device(m)), "mode": mode,
             "first_run_seconds": t0, "generated_ids": tok[0].tolist(), **health}
            for f, p, m, t0, tok in zip(full, prefill, models, first, tokens)]


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
    compile_backend: str | None = None,
) -> dict[str, Any]:
    """Batch-1 greedy generation speed (median of `repeats` after `warmup` runs).

    `mode`: "eager" (generate, dynamic cache), "compiled" (generate with one reused StaticCache,
    transformers compiling the decode step) or "step" (gpt-fast style: eager prefill, compiled one-token
    step in a bare loop); default :func:`default_latency_mode` of the model's device.
    `compile_backend`: torch.compile's backend for the compiled modes (default inductor, the product
    path; "eager" checks the harness cheaply on a CPU).

    `tokens_per_s` is end to end (prefill + `new_tokens` steps); `decode_tokens_per_s` removes the
    prefill (a 1-token generate, or the step harness's own timed prefill) to isolate the per-token
    decode cost. `generated_ids` are the greedy tokens of the last run; `compile_timed` counts the compile
    events during the timed runs (all 0 when nothing recompiled or re-recorded).
    """
    ids = _prompt_ids(tokenizer_or_prompt_ids, prompt)
    mode = mode or default_latency_mode(model_device(model))
    return _measure([model], ids, new_tokens, warmup, repeats, mode, compile_backend)[0]


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
    compile_backend: str | None = None,
) -> dict[str, Any]:
    """Compressed vs dense decode speed, timed interleaved in the same run under the same harness (`mode`,
    `compile_backend` as in :func:`decode_latency`).

    `latency_ratio` = compressed / dense seconds per generated token (< 1 is faster);
    `speedup` is its inverse. The `decode_` variants exclude prefill.
    """
    ids = _prompt_ids(tokenizer_or_prompt_ids, prompt)
    mode = mode or default_latency_mode(model_device(model))
    ours, dense = _measure([model, dense_model], ids, new_tokens, warmup, repeats, mode, compile_backend)
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
        "compile_timed": ours["compile_timed"],
        "model": ours,
        "dense": dense,
    }


def measure_latency(model: torch.nn.Module, tokenizer, dense_model: torch.nn.Module | None = None, *,
                    new_tokens: int = 64, repeats: int = 5, warmup: int = 2, mode: str | None = None,
                    compile_backend: str | None = None) -> dict:
    """Batch-1 decode tokens/s; against `dense_model` (timed interleaved, same harness) as a ratio.

    `decode_path` says which masked-GEMV path produced the numbers (they differ by device,
    thread count and whether the native CPU kernel could be built here)."""
    mode = mode or default_latency_mode(model_device(model))
    if dense_model is None or dense_model is model:
        r = decode_latency(model, tokenizer, new_tokens=new_tokens, warmup=warmup, repeats=repeats, mode=mode,
                           compile_backend=compile_backend)
        out = {"tokens_per_s": r["tokens_per_s"], "decode_tokens_per_s": r["decode_tokens_per_s"], "model": r}
        if dense_model is model:
            out.update(dense_tokens_per_s=r["tokens_per_s"], latency_ratio=1.0, speedup=1.0, decode_latency_ratio=1.0)
    else:
        out = latency_ratio(model, dense_model, tokenizer, new_tokens=new_tokens, warmup=warmup, repeats=repeats,
                            mode=mode, compile_backend=compile_backend)
    out["mode"] = mode
    out["decode_path"] = decode_path(model)
    return out


def decode_path(model: torch.nn.Module) -> str:
    """The batch-1 masked-GEMV path `model`'s adapters take where it lives, in words."""
    device = model_device(model)
    if device.type == "cuda":
        return "CUDA: " + ("Triton masked-GEMV kernels (rana::decode_masked_triton)" if triton_available()
                           else "dense masked product (no triton)")
    if device.type == "cpu":
        return f"CPU, {torch.get_num_threads()} thread(s): {native_status()}"
    return f"{device.type}: dense masked product"
