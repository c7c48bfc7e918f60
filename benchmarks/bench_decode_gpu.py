"""Batch-1 decoding on a GPU, dense vs rana, with models that need no download.

Builds Llama-2-7B-shaped (hidden 4096, intermediate 11008, 32 layers, 32 KV heads, vocabulary 32000)
and Llama-3-8B-shaped (intermediate 14336, 8 KV heads, vocabulary 128256) models with random weights,
in bf16. Compressing all 32 layers per budget would dominate the run, so `--compress-layers` layers
(default 2) of a model of the same widths are compressed with rana's own `compress_model` on the GPU
(bf16) at each budget F, and their adapters are repeated over the 32 layers of a copy of the dense
model. When compression on the GPU fails (see the notes in the output), it runs on the CPU in float32
and the adapters are moved to the GPU. The per-layer budget is what F sets (the calibration model's
vocabulary is tiny, so its embedding and head weigh nothing in F); the end-to-end model keeps a dense
LM head.

For each model and F, two harnesses of `rana.evaluation.latency_ratio`, dense and rana timed
identically and interleaved in the same run, >= 128 timed tokens, decode ms/token with prefill removed:

- step: gpt-fast style: one StaticCache, eager prefill, a compiled one-token step (fullgraph,
  CUDA graphs) in a bare loop: the model's own decode time;
- compiled: `generate` with one reused StaticCache, transformers compiling the decode step: the user path.

Also per model and F: each harness's greedy tokens against eager `generate`'s (bf16 may diverge late:
recorded, never fatal); compile time (first run minus a timed run) and compile health during the timed
runs (new graphs, graph breaks, CUDA-graph recordings); a torch.profiler breakdown of the compiled decode
step (GPU time per token in rana's masked kernels, its split-K reduce, other GEMV/GEMM, attention, the
rest; kernels per token; host time per step).

Work runs in priority order: `--models` in turn at F = 0.58, then at the other `--budgets`; per model and
F, the `--harnesses` in turn, the profile right after the step harness (it replays that harness's compiled
step: same cache length, nothing recompiles). So the first-contact selection, the first model at F = 0.58
in the step harness, comes first, and the rest follows while time remains. The report (--out STEM .md +
.json, default benchmarks/results/gpu_decode) is rewritten atomically after every piece of work
(benchmarks/atomic_table.py), and names the piece in flight: a run stopped at any moment leaves all it
measured and says where it stopped. A piece starts only if its estimate fits what is left of
`--time-budget`: what the same kind of work took (this model, else another model, else the other harness),
else a prior (PRIOR_SECONDS, never 0). The run's first harness always starts: it is what the run is for,
and a prior is only a guess. What does not fit is skipped and listed.

    python benchmarks/bench_decode_gpu.py                         # on a CUDA machine (~80 GB GPU)
    python benchmarks/bench_decode_gpu.py --models llama-2-7b-shaped --budgets 0.58 --harnesses step
    python benchmarks/bench_decode_gpu.py --smoke                 # tiny model on CPU: code paths only
"""
from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from types import SimpleNamespace

_START = time.perf_counter()  # main's --time-budget counts from here: imports are part of the run

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # also when a test loads this file by path
from atomic_table import write_report  # noqa: E402

BUDGETS = [0.85, 0.70, 0.58, 0.50]
FIRST_BUDGET = 0.58  # measured first, for every model: the budget the GPU suite must report
HARNESSES = ("step", "compiled")
SHAPES = {
    "llama-2-7b-shaped": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                              num_key_value_heads=32, vocab_size=32000),
    "llama-3-8b-shaped": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256),
}
SMOKE_SHAPES = {"tiny-llama": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)}
# seconds a piece of work of a 32-layer model is expected to take on the H200 before one like it was timed
# (scaled by --layers / 32; never 0): a build and eager generate are seconds; compressing 2 layers about a
# minute; a harness is two cold inductor compiles of the 32-layer step (35-80 s each) and the timed runs; the
# profile replays the step harness's compiled step
PRIOR_SECONDS = {"build": 15.0, "eager": 20.0, "compress": 60.0, "step": 150.0, "compiled": 150.0, "profile": 20.0}
# kernel (or, on CPU, op) name fragments → profile class; the first class that matches wins
KERNEL_CLASSES = (
    ("rana_reduce", ("rana_gemv_reduce",)),
    ("rana_masked", ("rana_masked_gemv", "rana::decode_masked")),
    ("rana_dense", ("rana_dense_gemv",)),  # rana's own dense GEMV (rank adapters' B), apart from cuBLAS
    ("attention", ("flash", "fmha", "attention", "sdpa", "softmax")),
    ("gemm", ("gemm", "gemv", "cublas", "cutlass", "xmma", "nvjet", "splitk", "fused_mm", "aten::mm", "aten::addmm",
              "aten::bmm", "aten::mv", "aten::matmul", "aten::linear")),
)


# ------------------------------------------------------------------------------------------ models
def _config(shape: dict, layers: int, vocab: int | None = None):
    from transformers import LlamaConfig

    kw = dict(shape, num_hidden_layers=layers, max_position_embeddings=4096)
    if vocab is not None:
        kw["vocab_size"] = vocab
    return LlamaConfig(**kw)


def _build(config, dtype, device, seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def compressed_layers(shape: dict, budget: float, n_layers: int, dtype, device, smoke: bool, notes: list):
    """`n_layers` decoder layers compressed by rana at `budget` (on the GPU if it works, else CPU float32)."""
    from rana.compress import CompressConfig, compress_model

    vocab = 64
    calib = torch.randint(0, vocab, (24 if smoke else 72, 16 if smoke else 128),
                          generator=torch.Generator().manual_seed(1))
    data = SimpleNamespace(fit=calib[:-4], heldout=calib[-4:])
    tokens = calib[:-4].numel()
    on_cpu_fp32 = torch.device(device).type == "cpu" and dtype == torch.float32
    attempts = [(device, dtype)] + ([] if on_cpu_fp32 else [("cpu", torch.float32)])
    for dev, dt in attempts:
        model = _build(_config(shape, n_layers, vocab), dt, dev)
        cfg = CompressConfig(model="random", flops=budget, method="rana", calib_tokens=tokens, seq_len=calib.shape[1],
                             batch_size=4, search_tokens=min(512, tokens // 2), fit_sample_tokens=min(1024, tokens),
                             dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dt],
                             device=str(dev))
        start = time.perf_counter()
        try:
            compress_model(model, None, cfg, data)
        except Exception as exc:  # compression on the GPU / in bf16 is another issue's work: say so, fall back
            notes.append(f"compress on {dev} {dt} failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
                         "falling back")
            continue
        notes.append(f"F={budget}: {n_layers} layers compressed on {dev} in {dt} in {time.perf_counter() - start:.0f} s")
        return [layer.to(device=device, dtype=dtype) for layer in model.model.layers]
    raise RuntimeError("compression failed on every device")


def rana_model(dense, layers):
    """A copy of `dense` whose decoder layers are copies of the compressed `layers`, repeated in turn."""
    from rana.modules import relink

    model = copy.deepcopy(dense)
    for i in range(len(model.model.layers)):
        layer = copy.deepcopy(layers[i % len(layers)])
        relink(layer)  # each copy's q/k/v (shared code, or grouped siblings) and gate/up use their own weights
        layer.self_attn.layer_idx = i
        model.model.layers[i] = layer
    return model.eval()


# ------------------------------------------------------------------------------------ measurements
def matching_prefix(tokens: list[int], reference: list[int]) -> int:
    """How many of the first tokens equal the reference's (greedy decoding diverges for good after one)."""
    n = 0
    for a, b in zip(tokens, reference):
        if a != b:
            break
        n += 1
    return n


def eager_tokens(model, prompt, new_tokens: int) -> list[int]:
    """Greedy tokens of eager `generate` (dynamic cache): the reference of both compiled harnesses."""
    from rana.evaluation import decode_latency

    return decode_latency(model, prompt, new_tokens=new_tokens, warmup=0, repeats=1, mode="eager")["generated_ids"]


def time_harness(model, dense, prompt, harness: str, refs: dict, args) -> dict:
    """Dense and rana timed interleaved under `harness`; tokens against eager; compile time and health."""
    from rana.evaluation import latency_ratio

    r = latency_ratio(model, dense, prompt, new_tokens=args.new_tokens, warmup=args.warmup, repeats=args.repeats,
                      mode=harness, compile_backend=args.compile_backend)
    ours, base = r["model"], r["dense"]
    return {"harness": harness,
            "dense_ms_per_token": 1e3 / r["dense_decode_tokens_per_s"],
            "rana_ms_per_token": 1e3 / r["decode_tokens_per_s"],
            "speedup": r["decode_tokens_per_s"] / r["dense_decode_tokens_per_s"],
            # the first run compiles (and records CUDA graphs); a timed run does not
            "compile_seconds": {"rana": ours["first_run_seconds"] - ours["seconds"],
                                "dense": base["first_run_seconds"] - base["seconds"]},
            "eager_match": {"rana": matching_prefix(ours["generated_ids"], refs["rana"]),
                            "dense": matching_prefix(base["generated_ids"], refs["dense"]),
                            "of": args.new_tokens},
            "compile_warmup": ours["compile_warmup"], "compile_timed": ours["compile_timed"], "raw": r}


def _classify(name: str) -> str:
    low = name.lower()
    for cls, keys in KERNEL_CLASSES:
        if any(k in low for k in keys):
            return cls
    return "other"


def _event_totals(events, device_type) -> tuple[dict[str, float], int]:
    """µs per class and the number of kernels (CUDA) or operators (CPU: events named like `ns::op`).

    CUDA: each kernel's own duration. CPU: self time, so an op is not counted again inside its caller."""
    from torch.autograd import DeviceType

    totals = {cls: 0.0 for cls, _ in KERNEL_CLASSES} | {"other": 0.0}
    count = 0
    for evt in events:
        if evt.device_type != device_type:
            continue
        if device_type == DeviceType.CUDA:
            us = float(evt.time_range.end - evt.time_range.start)
        else:
            us = float(getattr(evt, "self_cpu_time_total", 0.0))
            if "::" not in evt.name:
                totals["other"] += us  # Python-level ranges (compiled region, cudagraph replay): host time
                continue
        totals[_classify(evt.name)] += us
        count += 1
    return totals, count


@torch.inference_mode()  # as the timed harnesses: the adapters take their decode kernels only without autograd
def profile_step(model, prompt, new_tokens: int, steps: int, kwargs, device) -> dict:
    """Where one compiled decode step's time goes (the step harness's step, warmed and replayed).

    The runner has the step harness's own cache length (prompt + `new_tokens`) and compiles its own step, as every
    step-harness runner does (one graph: rana.evaluation.decode_step gives each compiled step a code object of its
    own and no guards on the model). `compile_events` counts what compiled here: 1 graph, more if a replay
    recompiled.

    Per token: device time by class (on CUDA, GPU kernel time; on CPU, operator self time), kernels, the
    host time of a step call (it returns once its work is queued: far below the device time when the step
    is GPU-bound), and the synced wall time per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from rana.evaluation import compile_counters
    from rana.evaluation.decode_step import StepRunner, decode_steps, prefill

    on_cuda = device.type == "cuda"
    steps = max(1, min(steps, new_tokens - 1))  # the cache holds the prompt and new_tokens positions
    before = compile_counters()
    runner = StepRunner(model, prompt, new_tokens, kwargs)
    for _ in range(2):  # this cache is new: record its CUDA graphs (the step itself is compiled), then replay
        runner()
    compiled = {k: v - before[k] for k, v in compile_counters().items()}
    host: list[float] = []
    token, position = prefill(runner.prefill_fn, prompt, runner.cache)
    _sync(device)
    start = time.perf_counter()
    decode_steps(runner.step, token, position, runner.cache, steps, host)
    _sync(device)
    wall = (time.perf_counter() - start) / steps
    token, position = prefill(runner.prefill_fn, prompt, runner.cache)
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        decode_steps(runner.step, token, position, runner.cache, steps)
        _sync(device)
    totals, count = _event_totals(prof.events(), DeviceType.CUDA if on_cuda else DeviceType.CPU)
    per_token = {k: v / steps for k, v in totals.items()}
    return {"us_per_token": per_token, "total_us_per_token": sum(per_token.values()),
            "kernels_per_token": count / steps, "host_us_per_step": 1e6 * sum(host) / len(host),
            "wall_us_per_step": 1e6 * wall, "steps": steps, "time_kind": "GPU kernel" if on_cuda else "CPU op self",
            "compile_events": compiled}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _init_profiler_for_cuda_graphs(notes: list) -> None:
    """Kernels replayed from a CUDA graph are seen by the profiler only if it was initialised before the
    capture (torch.profiler._utils._init_for_cuda_graphs, where this torch has it)."""
    try:
        from torch.profiler._utils import _init_for_cuda_graphs
    except ImportError:
        notes.append("torch.profiler._utils._init_for_cuda_graphs missing: graph kernels may be absent from profiles")
        return
    _init_for_cuda_graphs()


# ------------------------------------------------------------------------------------- scheduling
class Clock:
    """The --time-budget: a piece of work starts only if its estimate still fits in what is left. The estimate
    is what the same kind took last (this model, else the other model, else the other harness), else its
    prior (PRIOR_SECONDS scaled by the layer count: never 0)."""

    def __init__(self, seconds: float, layers: int = 32, start: float | None = None):
        self.start = time.perf_counter() if start is None else start
        self.seconds, self.layers = seconds, layers
        self.costs: dict[tuple[str, str], float] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def estimate(self, kind: str, model: str) -> float:
        if (kind, model) in self.costs:
            return self.costs[(kind, model)]
        kinds = (kind,) + tuple(h for h in HARNESSES if kind in HARNESSES and h != kind)
        for k in kinds:
            seen = [v for (k2, _), v in self.costs.items() if k2 == k]
            if seen:
                return max(seen)
        return max(1.0, PRIOR_SECONDS[kind] * self.layers / 32)

    def fits(self, kinds: list[str], model: str, first: bool = False) -> bool:
        """Whether `kinds` fit; `first`: the run's first measurement, which starts whenever time is left."""
        left = self.seconds - self.elapsed()
        return left > 0 and (first or sum(self.estimate(k, model) for k in kinds) <= left)

    def timed(self, kind: str, model: str, fn):
        start = time.perf_counter()
        out = fn()
        self.costs[(kind, model)] = time.perf_counter() - start
        return out


def work_order(models: list[str], budgets: list[float]) -> list[tuple[str, float]]:
    """F = 0.58 for every model first (the number the GPU suite reports), then the other budgets in turn."""
    first = [(m, b) for b in budgets if b == FIRST_BUDGET for m in models]
    return first + [(m, b) for b in budgets if b != FIRST_BUDGET for m in models]


def pieces(harnesses: list[str]) -> list[str]:
    """A unit's measurements in order: the harnesses, the profile right after the step harness (it replays
    that harness's compiled step), or last when the step harness is not run (it then compiles its own)."""
    if "step" in harnesses:
        i = harnesses.index("step") + 1
        return list(harnesses[:i]) + ["profile"] + list(harnesses[i:])
    return list(harnesses) + ["profile"]


class Session:
    """The state of one benchmark run: dense models and their eager tokens (built once per shape), the
    clock, and what was measured, skipped and noted; `save()` writes the report so far."""

    def __init__(self, args, write=None, started: float | None = None):
        self.args = args
        self.device = torch.device("cpu" if args.smoke else "cuda")
        self.dtype = torch.float32 if args.smoke else torch.bfloat16
        self.shapes = {name: (SMOKE_SHAPES if args.smoke else SHAPES)[name] for name in args.models}
        self.prompt = torch.randint(0, 64, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(2))
        self.clock = Clock(args.time_budget, args.layers, started)
        self.records, self.profiles, self.skipped, self.notes = [], [], [], []
        self.running: str | None = None
        self._dense: dict[str, tuple] = {}
        self._write = write

    def save(self) -> None:
        if self._write is not None:
            self._write(result(self, complete=False))

    def step(self, what: str, kind: str, name: str, fn):
        """`fn()` timed as `kind`; the report names it while it runs and is written again once it is done."""
        self.running = f"{what} (started at {self.clock.elapsed():.0f} s)"
        self.save()
        try:
            return self.clock.timed(kind, name, fn)
        finally:
            self.running = None

    def dense(self, name: str):
        """(dense model, its eager greedy tokens), built on first use."""
        if name not in self._dense:
            model = self.step(f"building {name}", "build", name, lambda: _build(
                _config(self.shapes[name], self.args.layers), self.dtype, self.device))
            ref = self.step(f"eager tokens of dense {name}", "eager", name, lambda: eager_tokens(
                model, self.prompt.to(self.device), self.args.new_tokens))
            self._dense[name] = (model, ref)
        return self._dense[name]

    def skip(self, name: str, budget: float, what: str) -> None:
        self.skipped.append(f"{name} F={budget}: {what} (time budget: {self.clock.elapsed():.0f} of "
                            f"{self.args.time_budget:.0f} s used)")


def profile_unit(s: Session, name: str, budget: float, dense, model, prompt) -> dict:
    """The profile of one unit: the step harness's compiled step of the dense and the rana model."""
    from rana.evaluation import step_compile_kwargs

    return {"model": name, "budget": budget,
            **{which: profile_step(m, prompt, s.args.new_tokens, s.args.profile_steps,
                                   step_compile_kwargs(m, s.device, s.args.compile_backend), s.device)
               for which, m in (("dense", dense), ("rana", model))}}


def run_unit(s: Session, name: str, budget: float) -> None:
    """One model at one budget: compress, eager reference tokens, the harnesses and the profile, each
    written as soon as it is measured; the budget is checked before each."""
    args, clock, prompt = s.args, s.clock, s.prompt.to(s.device)
    todo = pieces(args.harnesses)
    setup = ["compress", "eager"] + ([] if name in s._dense else ["build", "eager"])
    if not clock.fits(setup + todo[:1], name, first=not s.records):
        s.skip(name, budget, "everything (compression, " + ", ".join(todo) + ")")
        return
    dense, dense_ref = s.dense(name)
    layers = s.step(f"compressing {args.compress_layers} layers of {name} at F={budget}", "compress", name,
                    lambda: compressed_layers(s.shapes[name], budget, args.compress_layers, s.dtype, s.device,
                                              args.smoke, s.notes))
    model = rana_model(dense, layers)
    refs = {"dense": dense_ref,
            "rana": s.step(f"eager tokens of rana {name} F={budget}", "eager", name,
                           lambda: eager_tokens(model, prompt, args.new_tokens))}
    for piece in todo:
        if not clock.fits([piece], name, first=not s.records and piece != "profile"):
            s.skip(name, budget, "profile" if piece == "profile" else f"{piece} harness")
            continue
        if piece == "profile":
            s.profiles.append(s.step(f"profile of {name} F={budget}", "profile", name,
                                     lambda: profile_unit(s, name, budget, dense, model, prompt)))
        else:
            record = s.step(f"{piece} harness of {name} F={budget}", piece, name,
                            lambda: time_harness(model, dense, prompt, piece, refs, args))
            s.records.append({"model": name, "budget": budget, "limit": 1 / budget, **record})
        s.save()
    del model, layers
    _release(s.device)


def _release(device) -> None:
    """Compiled code and CUDA graphs of the finished rana model go (dense recompiles in the next unit: the
    price of never holding two rana models' graphs and weights at once)."""
    import gc

    torch._dynamo.reset()
    if device.type == "cuda":
        try:
            from torch._inductor.cudagraph_trees import reset_cudagraph_trees
        except ImportError:  # newer torch resets them in torch._dynamo.reset
            reset_cudagraph_trees = None
        if reset_cudagraph_trees is not None:
            reset_cudagraph_trees()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run(args, write=None, started: float | None = None) -> dict:
    """Every unit in priority order; `write(result)` after every piece of work, so a run stopped from outside
    (the GPU suite's deadline) still leaves a report of what it measured and of the piece it was in.
    `started`: the time.perf_counter() the budget counts from (default now)."""
    s = Session(args, write, started)
    if s.device.type == "cuda":
        _init_profiler_for_cuda_graphs(s.notes)
    for name, budget in work_order(list(s.shapes), args.budgets):
        run_unit(s, name, budget)
        s.save()
    return result(s, complete=True)


def result(s: Session, complete: bool) -> dict:
    args = s.args
    return {"device": torch.cuda.get_device_name() if s.device.type == "cuda" else "cpu (smoke)",
            "torch": torch.__version__, "transformers": _version("transformers"), "triton": _version("triton"),
            "smoke": args.smoke, "dtype": str(s.dtype), "layers": args.layers, "new_tokens": args.new_tokens,
            "prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "compress_layers": args.compress_layers,
            "compile_backend": args.compile_backend or "inductor", "time_budget": args.time_budget,
            "models": list(args.models), "budgets": list(args.budgets), "harnesses": list(args.harnesses),
            "elapsed_seconds": s.clock.elapsed(), "complete": complete, "running": s.running,
            "piece_seconds": {f"{k} {m}": v for (k, m), v in s.clock.costs.items()},
            "notes": s.notes, "skipped": s.skipped, "records": s.records, "profiles": s.profiles}


def _version(package: str) -> str:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # not installed: say so in the output rather than fail the benchmark
        return "absent"


# ------------------------------------------------------------------------------------------ output
def _timing_table(result: dict) -> list[str]:
    lines = ["| model | F | harness | dense ms/token | rana ms/token | rana speed vs dense | limit 1/F | "
             "greedy = eager (rana, dense, of) | compile s (rana, dense) | timed: new graphs, breaks, graph records |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["records"]:
        m, c, t = r["eager_match"], r["compile_seconds"], r["compile_timed"]
        lines.append(f"| {r['model']} | {r['budget']} | {r['harness']} | {r['dense_ms_per_token']:.2f} | "
                     f"{r['rana_ms_per_token']:.2f} | {r['speedup']:.2f}x | {r['limit']:.2f}x | "
                     f"{m['rana']}, {m['dense']}, {m['of']} | {c['rana']:.0f}, {c['dense']:.0f} | "
                     f"{t['graphs']}, {t['graph_breaks']}, {t['cudagraph_recorded_inputs']} |")
    return lines


def _profile_table(result: dict) -> list[str]:
    classes = [cls for cls, _ in KERNEL_CLASSES] + ["other"]
    lines = ["| model | F | which | " + " | ".join(f"{c} µs" for c in classes) +
             " | total µs | kernels/token | host µs/step | wall µs/step | graphs compiled here |",
             "|---|---|---|" + "---|" * (len(classes) + 5)]
    for p in result["profiles"]:
        for which in ("dense", "rana"):
            b = p[which]
            lines.append(f"| {p['model']} | {p['budget']} | {which} | "
                         + " | ".join(f"{b['us_per_token'][c]:.0f}" for c in classes)
                         + f" | {b['total_us_per_token']:.0f} | {b['kernels_per_token']:.0f} | "
                         f"{b['host_us_per_step']:.0f} | {b['wall_us_per_step']:.0f} | "
                         f"{b.get('compile_events', {}).get('graphs', '—')} |")
    return lines


def markdown(result: dict) -> str:
    kind = result["profiles"][0]["dense"]["time_kind"] if result["profiles"] else "GPU kernel"
    lines = [f"# Batch-1 decoding, dense vs rana, on {result['device']} (torch {result['torch']}, transformers "
             f"{result['transformers']}, triton {result['triton']}, {result['dtype']})", "",
             f"{result['layers']}-layer models, {result['prompt_tokens']}-token prompt, {result['new_tokens']} new "
             f"tokens, median of {result['repeats']} interleaved runs, decode ms/token (prefill removed); "
             f"{result['compress_layers']} compressed layers repeated over the stack; compile backend "
             f"{result['compile_backend']}. Limit: 1/F (memory bound). step = gpt-fast-style compiled step; "
             "compiled = generate with a static cache + torch.compile. Greedy = eager: leading tokens equal to "
             "eager generate's. Timed compile events must all be 0.",
             "Generated by `python benchmarks/bench_decode_gpu.py`.", "", *_timing_table(result), "",
             f"Compiled decode step (step harness), per token ({kind} time):", "", *_profile_table(result), "",
             f"Elapsed {result['elapsed_seconds']:.0f} s of a {result['time_budget']:.0f} s budget"
             + ("." if result["complete"] else " (**PARTIAL report**: the run had not finished"
                + (f"; in flight: {result['running']}" if result.get("running") else "") + ")."), "",
             "Skipped:", *([f"- {x}" for x in result["skipped"]] or ["- nothing"]), "",
             "Notes:", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU (float32): exercise the code, no numbers")
    p.add_argument("--models", nargs="+", default=None, choices=list(SHAPES) + list(SMOKE_SHAPES),
                   help=f"in this order (default {' '.join(SHAPES)}; --smoke: {' '.join(SMOKE_SHAPES)})")
    p.add_argument("--harnesses", nargs="+", default=list(HARNESSES), choices=HARNESSES,
                   help="in this order (the profile follows the step harness)")
    p.add_argument("--budgets", nargs="+", type=float, default=BUDGETS, help="F values (0.58 always runs first)")
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the timed models")
    p.add_argument("--compress-layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128, help="timed tokens per run")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds (compile, CUDA-graph recording)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--profile-steps", type=int, default=8, help="decode steps under the profiler")
    p.add_argument("--time-budget", type=float, default=240.0,
                   help="seconds from the process start; work that would not fit is skipped")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend (default inductor; --smoke: eager, which skips inductor's C++ build)")
    p.add_argument("--out", type=Path, default=None,
                   help="output stem (default benchmarks/results/gpu_decode; --smoke writes only where this says)")
    args = p.parse_args(argv)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    args.models = list(dict.fromkeys(args.models or shapes))
    args.harnesses = list(dict.fromkeys(args.harnesses))
    if any(m not in shapes for m in args.models):
        p.error(f"--models: {'--smoke runs' if args.smoke else 'a GPU run takes'} {', '.join(shapes)}")
    if args.smoke:
        args.layers, args.prompt_tokens = 2, min(args.prompt_tokens, 8)
        args.new_tokens, args.repeats, args.profile_steps = min(args.new_tokens, 6), 1, min(args.profile_steps, 2)
        args.budgets = [FIRST_BUDGET]
        args.compile_backend = args.compile_backend or "eager"
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")
    out = args.out or (None if args.smoke else HERE / "results" / "gpu_decode")

    def write(data: dict) -> None:
        write_report(out, data, markdown(data))

    data = run(args, write if out is not None else None, started=_START)
    if out is not None:
        write(data)
    print(markdown(data))
    return data


if __name__ == "__main__":
    main()
