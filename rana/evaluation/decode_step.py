"""The "step" latency harness: gpt-fast-style batch-1 greedy decoding with a compiled one-token step.

One path, read top to bottom (as gpt-fast's generate.py):

1. one StaticCache per model, allocated once and `reset()` between runs, so its tensors keep their
   addresses and CUDA graphs recorded over them are replayed, never re-recorded;
2. prefill: an ordinary eager forward over the prompt, which fills the cache and gives the first token;
3. decode: `new_tokens - 1` calls of one compiled function, `model(token, position) → argmax`
   (`torch.compile(fullgraph=True)`, mode "reduce-overhead", i.e. CUDA graphs, on CUDA);
4. timing: the prefill alone and the whole run, each ended by a device sync; nothing else runs
   per token but the step and a copy of its token, so the decode time is the model's own, not
   `generate`'s Python bookkeeping.

It uses only the ordinary forward API of transformers' causal LMs (`input_ids`, `position_ids`, the
cache keyword, and `cache_position` / `logits_to_keep` where the forward declares them), so Llama,
Qwen, Mistral, … and rana's compressed copies of them all run through it.
"""
from __future__ import annotations

import inspect
import re
import time
import types
from collections.abc import Callable
from typing import Any

import torch
from transformers import StaticCache

Step = Callable[[torch.Tensor, torch.Tensor, Any], torch.Tensor]


def cache_keyword(model: torch.nn.Module) -> str:
    """The forward's KV-cache keyword: `cache` (transformers 5.2x) or `past_key_values` (5.17 and before;
    a deprecated alias in 5.2x, which warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def new_cache(model: torch.nn.Module, max_len: int) -> StaticCache:
    """A StaticCache for `max_len` positions; its tensors are allocated by the first forward (on the model's
    device and dtype) and marked static there, then only written in place."""
    return StaticCache(config=model.config, max_cache_len=max_len)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def eos_ids(model: torch.nn.Module) -> list[int]:
    """The model's end-of-sequence token ids (generation_config's, an int or a list)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def greedy_fn(model: torch.nn.Module) -> Step:
    """`fn(ids, positions, cache) → (1, 1) next token`: one forward and the argmax of its last logits.

    EOS is never chosen: the `generate` harnesses force exactly `new_tokens` tokens with min_new_tokens,
    which suppresses EOS, so the step harness does the same work and yields the same greedy tokens.
    The keywords are resolved here, once, so that the traced function holds no `inspect` calls."""
    params = inspect.signature(model.forward).parameters
    suppress = eos_ids(model)
    cache_kw = cache_keyword(model)
    # older forwards index the static cache with cache_position; 5.x ones use the cache's own counter
    wants_cache_position = "cache_position" in params
    # only the last position's logits are needed (the prefill would otherwise project every prompt token)
    const: dict[str, Any] = {"use_cache": True}
    if "logits_to_keep" in params:
        const["logits_to_keep"] = 1

    def fn(ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        kwargs = dict(const, position_ids=positions)
        kwargs[cache_kw] = cache
        if wants_cache_position:
            kwargs["cache_position"] = positions[0]
        logits = model(input_ids=ids, **kwargs).logits[:, -1]
        if suppress:
            logits = logits.clone()  # the forward's output is left as it was
            logits[:, suppress] = float("-inf")
        return logits.argmax(-1, keepdim=True)

    return fn


def logits_fn(model: torch.nn.Module) -> Step:
    """Like :func:`greedy_fn` but returning the last position's logits (1, vocab): what a test compares
    between a compiled step and the eager one."""
    cache_kw = cache_keyword(model)

    def fn(ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        return model(input_ids=ids, position_ids=positions, use_cache=True, **{cache_kw: cache}).logits[:, -1]

    return fn


def compile_kwargs(compile_config, backend: str | None = None) -> dict[str, Any]:
    """torch.compile keywords from a transformers CompileConfig (the "compiled" harness's own, so both
    compiled harnesses compile alike), `backend` replacing its backend.

    `mode` and `options` are inductor's: another backend (tests use "eager") would be handed them as
    keywords it does not take, so they are dropped there."""
    kwargs = {"fullgraph": compile_config.fullgraph, "dynamic": compile_config.dynamic,
              "backend": backend or compile_config.backend}
    if kwargs["backend"] == "inductor":
        if compile_config.options:
            kwargs["options"] = compile_config.options
        else:
            kwargs["mode"] = compile_config.mode
    return kwargs


# The compiled step's guards. Before every call dynamo re-checks what its graph assumed of every object the step
# read: for a rana model, ~10,000 checks on its modules (types, hook dicts, attributes, the decode groups' links,
# every weight's shape), ~2 ms of a 17 ms SmolLM2 W8A8 CPU step. A compiled step belongs to one model, which is
# not changed while it decodes (StepRunner's life), so the checks under the model are dropped; those on the step's
# inputs (token, position, the cache's tensors), global state and module globals stay. Each compiled step has a
# code object of its own (torch.compile keeps its graphs per code object), so a step never takes a graph another
# model's step compiled. `model` is greedy_fn's closure variable, the name dynamo's guards give the model.
_UNDER_MODEL = re.compile(r"^(?:\w+\()*model\b")


def step_guard_filter(entries) -> list[bool]:
    """torch.compile's `guard_filter_fn` for a compiled step: False (dropped) for each guard on the model or
    anything reached through it, True for the rest."""
    return [not _UNDER_MODEL.match(entry.name) for entry in entries]


def step_compile_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with step_guard_filter added to its options. An inductor mode becomes its options (torch.compile
    takes a mode or options, not both; `list_mode_options` is what the mode stands for: CUDA graphs for
    "reduce-overhead")."""
    kwargs = dict(kwargs)
    options = dict(kwargs.pop("options", None) or {})
    mode = kwargs.pop("mode", None)
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        options = {**list_mode_options(mode, kwargs.get("dynamic")), **options}
    options["guard_filter_fn"] = step_guard_filter
    return {**kwargs, "options": options}


def _own_code(fn: Step) -> Step:
    """`fn` with a code object of its own (the same code): its compiled graphs are its own."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_step(model: torch.nn.Module, kwargs: dict[str, Any] | None) -> Step:
    """The one-token decode step, compiled with `kwargs` (None: eager, the reference) and step_guard_filter: the
    model must not change while the step is used."""
    fn = greedy_fn(model)
    return fn if kwargs is None else torch.compile(_own_code(fn), **step_compile_options(kwargs))


def mark_step() -> None:
    """Tell CUDA-graph trees a new step begins, so the last replay's outputs may be overwritten (the caller
    has copied the token out of it already)."""
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)
    if mark is not None:
        mark()


def decode_steps(step: Step, token: torch.Tensor, position: torch.Tensor, cache, n: int,
                 host_seconds: list[float] | None = None) -> list[torch.Tensor]:
    """`n` greedy steps after `token` (1, 1) at `position` (1, 1), which advances in place.

    `host_seconds`, if given, gets each step's host time (the call returns once its work is queued)."""
    tokens = []
    for _ in range(n):
        start = time.perf_counter()
        mark_step()
        # clone: the token leaves CUDA-graph memory before the next replay reuses it (and every step
        # sees a fresh contiguous (1, 1) input, never a view whose offset would be a new guard)
        token = step(token, position, cache).clone()
        position += 1  # in place, on the device: no host-to-device copy per token
        tokens.append(token)
        if host_seconds is not None:
            host_seconds.append(time.perf_counter() - start)
    return tokens


def prefill(fn: Step, ids: torch.Tensor, cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager forward over the (1, T) prompt into the reset `cache`: (first token, position of the next)."""
    cache.reset()  # zeroes keys, values and the fill counter in place: same tensors, same addresses
    token = fn(ids, torch.arange(ids.shape[1], device=ids.device).unsqueeze(0), cache)
    return token, torch.full((1, 1), ids.shape[1], dtype=torch.long, device=ids.device)


def decode(model: torch.nn.Module, step: Step, cache, ids: torch.Tensor, new_tokens: int,
           prefill_fn: Step | None = None) -> tuple[torch.Tensor, float, float]:
    """One greedy generation of exactly `new_tokens` tokens after the (1, T) prompt `ids`.

    Returns (tokens (1, new_tokens), seconds of the prefill (it yields token 1), seconds of the whole run).
    `cache` must hold T + new_tokens positions; it is reset here, in place."""
    device = ids.device
    _sync(device)
    start = time.perf_counter()
    token, position = prefill(prefill_fn or greedy_fn(model), ids, cache)
    _sync(device)
    t_prefill = time.perf_counter() - start
    out = torch.cat([token, *decode_steps(step, token, position, cache, new_tokens - 1)], 1)
    _sync(device)
    return out, t_prefill, time.perf_counter() - start


class StepRunner:
    """One model under the step harness: its compiled step and its one cache, reused by every run."""

    def __init__(self, model: torch.nn.Module, ids: torch.Tensor, new_tokens: int,
                 kwargs: dict[str, Any] | None):
        self.model, self.ids, self.new_tokens = model, ids, new_tokens
        self.cache = new_cache(model, ids.shape[1] + new_tokens)
        self.prefill_fn = greedy_fn(model)
        self.step = compile_step(model, kwargs)

    def __call__(self) -> tuple[float, float, torch.Tensor]:
        """(seconds for the whole run, seconds for the prefill, the generated tokens (1, new_tokens))."""
        tokens, t_prefill, t_full = decode(self.model, self.step, self.cache, self.ids, self.new_tokens,
                                           self.prefill_fn)
        return t_full, t_prefill, tokens

    def cache_pointers(self) -> list[int]:
        """data_ptr of every allocated cache tensor: equal across runs when the cache is really reused."""
        return [t.data_ptr() for layer in self.cache.layers for t in (layer.keys, layer.values) if t is not None]


def step_greedy(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int,
                kwargs: dict[str, Any] | None = None) -> torch.Tensor:
    """Greedy tokens (1, new_tokens) of one step-harness run (`kwargs`: torch.compile's; None: eager)."""
    with torch.inference_mode():
        return StepRunner(model, ids, new_tokens, kwargs)()[2]
