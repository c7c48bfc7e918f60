"""Fill the masked-GEMV tuning table for this GPU: ``python -m rana.kernels.gemv_tune --out FILE``.

For the launches a decode step of each model shape makes (:func:`problems`), every candidate config
(:func:`candidates`) is timed on *cold* weights: enough copies of every tensor that one pass over
them reads more than twice the L2 cache, launched back to back inside one CUDA graph (what a
compiled decode step replays), so a config is ranked on HBM streaming and launch cost, not on an
L2-resident benchmark. The fastest config per table key (:func:`triton_gemv.table_key`) is merged
into FILE under this GPU's name, with the measured µs beside it. The kernels read the table at
their first launch (``kernels/gemv_configs.json`` ships with the package; exports inline it).

Tuning never happens on a decode path: this command, run once per GPU (``benchmarks/gpu_suite.py
--only tuner``, the one command's second run: docs/gpu.md), is the only place that times configs.

Made for a GPU lent by the minute:

- every candidate is checked against the fp32 reference before it is timed; a config that computes
  a wrong result is never chosen, and it is reported (exit code 1: that is a kernel bug);
- the table is written after every key (merged with what FILE holds, atomically), so a tuner stopped
  at any moment leaves every key it finished; a key that was cut short keeps what it measured when at
  least two candidates ran, and is marked so in the table's "measured" part;
- ``--budget`` is the process's wall time (imports included): a candidate starts only if the last
  one's time (a prior before any) still fits, a key only if its operands and two candidates do;
- problems are tuned in order of importance, bf16 first (every sparsity bin, bin 2 first), then fp16;
  keys left out keep the heuristic;
- operands are drawn on the GPU (a 4096 × 128256 head is half a billion normals).

    python -m rana.kernels.gemv_tune --out kernels/gemv_configs.json          # on the GPU
    TRITON_INTERPRET=1 python -m rana.kernels.gemv_tune --smoke --out /tmp/t.json   # code paths on CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import triton_gemv as tg
from .torch_gemv import masked_gemv_reference

# hidden, intermediate, attention heads, KV heads, vocabulary
MODEL_SHAPES = {
    "llama-2-7b": (4096, 11008, 32, 32, 32000),
    "llama-3-8b": (4096, 14336, 32, 8, 128256),
}
SMOKE_SHAPES = {"tiny": (64, 160, 4, 2, 256)}
SPARSITY_BINS = (2, 1, 3, 4)  # F ≈ 0.5 first: the bins a compressed model's launches fall in most
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
TOLERANCE = 2e-2  # max |error| / max |reference| of a correct config: a few half-precision output roundings
# seconds a piece takes before one like it was timed (never 0, or the budget check would wave unknown work
# through): one key's operands and reference; one candidate (its Triton compile dominates)
PRIOR_SECONDS = {"operands": 2.0, "candidate": 3.0}


@dataclass(frozen=True)
class Problem:
    """One launch of a decode step: input sizes ks, output sizes ns (one per grouped projection)."""

    name: str
    ks: tuple
    ns: tuple
    mode: str


def problems(shape: tuple) -> list[Problem]:
    """The masked launches of one decoder layer and the head (input-sparse and rank-adapter forms)."""
    hidden, inter, heads, kv, vocab = shape
    head_dim = hidden // heads
    rank = hidden // 2  # rank adapters keep about half the width at the budgets people use
    qkv_ns = (hidden, kv * head_dim, kv * head_dim)
    return [
        Problem("q/k/v", (hidden,) * 3, qkv_ns, "abs"),
        Problem("o", (hidden,), (hidden,), "abs"),
        Problem("gate/up", (hidden,) * 2, (inter, inter), "abs"),
        Problem("down", (inter,), (hidden,), "abs_scaled"),
        Problem("lm head", (hidden,), (vocab,), "abs"),
        Problem("q/k/v A (rank code)", (rank,) * 3, qkv_ns, "square"),
        Problem("gate/up A (rank code)", (rank,) * 2, (inter, inter), "square"),
    ]


def _compiles_lean(block_n: int, block_k: int, warps: int, dtype) -> bool:
    """A half-precision tile of 8 to 32 weights per thread: fewer gives 8-byte loads instead of 16-byte
    ones, more takes over 128 registers (compiled for sm_90 under triton 3.6: (32, 32, 8 warps) and
    (128, 64, 4 warps) failed tests/test_triton_codegen.py's load-width and register checks)."""
    if dtype == torch.float32:
        return True
    return 8 <= block_n * block_k // (32 * warps) <= 32


def candidates(ks, ns, dtype, sms: int) -> list[tg.GemvConfig]:
    """The heuristic first, then row widths × steps × programs per SM × warps."""
    out = [tg.heuristic_config(ks, ns, dtype, torch.device("cuda"), sms=sms)]
    widths = (16, 32, 64) if dtype == torch.float32 else (32, 64, 128)
    for block_n in widths:
        for block_k in (32, 64):
            for waves in (2, 4):
                for warps in (4, 8):
                    if not _compiles_lean(block_n, block_k, warps, dtype):
                        continue
                    cfg = tg.GemvConfig(block_n, block_k, tg.split_for(ks, ns, block_n, block_k, sms, waves), warps)
                    if cfg not in out:
                        out.append(cfg)
    return out


def _threshold_for(v: torch.Tensor, fraction: float, mode: str) -> torch.Tensor:
    """A 0-dim fp32 threshold on v's device keeping about `fraction` of v's scores."""
    if fraction >= 1:
        return torch.tensor(-float("inf"), device=v.device)
    score = (v.float() ** 2) if mode == "square" else v.float().abs()
    return torch.quantile(score, 1.0 - fraction).to(torch.float32)


def _operands(problem: Problem, dtype, fraction: float, device, copies: int, seed: int = 0):
    """`copies` independent sets of (vs, w_ts, thresholds, scales, biases) for one launch, drawn on `device`
    (on the GPU: a CPU generator would draw them on one thread, seconds per key)."""
    g = torch.Generator(device=device).manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, device=device, dtype=dtype, generator=g)  # noqa: E731
    sets = []
    for _ in range(copies):
        vs = [draw(k) for k in problem.ks]
        ws = [draw(k, n) for k, n in zip(problem.ks, problem.ns)]
        ts = [_threshold_for(v, fraction, problem.mode) for v in vs]
        scales = [torch.rand(k, device=device, generator=g) + 0.5 if problem.mode == "abs_scaled" else None
                  for k in problem.ks]
        sets.append((vs, ws, ts, scales, [None] * len(vs)))
    return sets


def _reference(operands, mode: str) -> torch.Tensor:
    """The fp32 reference of one set's launch (concatenated outputs)."""
    vs, ws, ts, scales, _ = operands
    return torch.cat([masked_gemv_reference(w, v, t, mode=mode, scale=s).float()
                      for v, w, t, s in zip(vs, ws, ts, scales)])


def max_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """max |out - reference| / max |reference|."""
    return float((out.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def _copies_for(problem: Problem, dtype, l2_bytes: int) -> int:
    size = sum(k * n for k, n in zip(problem.ks, problem.ns)) * torch.tensor([], dtype=dtype).element_size()
    return max(2, -(-2 * l2_bytes // size) + 1)


def _time_cuda(sets, mode, cfg, reps: int = 10) -> float:
    """µs per launch, cold weights, inside one CUDA graph that walks every copy once."""
    launch = lambda: [tg._launch(vs, ws, ts, mode, ss, bs, cfg) for vs, ws, ts, ss, bs in sets]  # noqa: E731
    launch()  # compile + warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * len(sets))


def _time_wall(sets, mode, cfg) -> float:
    """--smoke on CPU: one interpreted pass, wall clock (its numbers mean nothing)."""
    start = time.perf_counter()
    for vs, ws, ts, ss, bs in sets:
        tg._launch(vs, ws, ts, mode, ss, bs, cfg)
    return (time.perf_counter() - start) * 1e6 / len(sets)


class Budget:
    """--budget seconds counted from `started` (time.monotonic() of the process start). A piece of work
    fits when what the last piece of its kind took (its prior before any) is still left."""

    def __init__(self, seconds: float, started: float):
        self.seconds, self.started = seconds, started
        self.last: dict[str, float] = {}

    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def fits(self, kinds: list[str]) -> bool:
        return sum(self.last.get(k, PRIOR_SECONDS[k]) for k in kinds) <= self.left()

    def timed(self, kind: str, fn):
        start = time.monotonic()
        try:
            return fn()
        finally:
            self.last[kind] = time.monotonic() - start


def tune_problem(problem: Problem, dtype, sbin: int, device, sms: int, l2_bytes: int, smoke: bool,
                 budget: Budget | None = None) -> dict:
    """The fastest correct candidate for one launch at one sparsity bin, with the heuristic's time beside
    it. Candidates are checked against the fp32 reference first: a wrong one is listed under "wrong",
    never timed. With `budget`, candidates stop when the next would not fit ("cut short")."""
    budget = budget or Budget(float("inf"), time.monotonic())
    fraction = max(0.05, min(1.0, sbin / 4))

    def prepare():
        sets = _operands(problem, dtype, fraction, device, 1 if smoke else _copies_for(problem, dtype, l2_bytes))
        return sets, _reference(sets[0], problem.mode)

    sets, reference = budget.timed("operands", prepare)
    cands = candidates(problem.ks, problem.ns, dtype, sms)[: 2 if smoke else None]
    timed, wrong, cut = [], [], False
    for cfg in cands:
        if not budget.fits(["candidate"]):
            cut = True
            break
        try:
            us, err = budget.timed("candidate", lambda: _check_and_time(sets, reference, problem.mode, cfg, smoke))
        except Exception as exc:  # a config this GPU cannot run (registers, shared memory): skip it
            print(f"  {problem.name} {cfg}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
                  file=sys.stderr)
            continue
        if us is None:
            wrong.append({"config": list(cfg), "max_error": err})
            print(f"  WRONG RESULT: {problem.name} {cfg}: max error {err:.3g} of the largest output", file=sys.stderr)
            continue
        timed.append((us, cfg))
    best_us, best = min(timed) if timed else (None, None)
    heuristic_us = timed[0][0] if timed and timed[0][1] == cands[0] else None
    return {"config": list(best) if best else None, "us": None if best_us is None else round(best_us, 2),
            "heuristic_us": None if heuristic_us is None else round(heuristic_us, 2), "problem": problem.name,
            "ks": list(problem.ks), "ns": list(problem.ns), "candidates": len(cands), "timed": len(timed),
            "cut_short": cut, "wrong": wrong}


def _check_and_time(sets, reference, mode, cfg, smoke: bool):
    """(µs, error) of a correct config; (None, error) of a wrong one (then it is not timed)."""
    vs, ws, ts, ss, bs = sets[0]
    err = max_error(tg._launch(vs, ws, ts, mode, ss, bs, cfg), reference)
    if not err <= TOLERANCE:
        return None, err
    return (_time_wall if smoke else _time_cuda)(sets, mode, cfg), err


def usable(r: dict) -> bool:
    """Whether a key's result may go into the table: every candidate timed, or, cut short, at least two
    (the heuristic and one more: else the entry would only restate the heuristic)."""
    return r["config"] is not None and (not r["cut_short"] or r["timed"] >= 2)


def work(shapes: dict, dtypes: dict, bins) -> list[tuple]:
    """(dtype name, sparsity bin, shape name, problem) in tuning order: every bin of the first dtype (bf16:
    what decoding runs in) before the next dtype; in a bin, the shapes' launches in turn."""
    return [(dname, sbin, shape_name, p) for dname in dtypes for sbin in bins for shape_name in shapes
            for p in problems(shapes[shape_name])]


def run(args, started: float | None = None, on_key=None) -> dict:
    """Tune every key of `work` that fits the budget; `on_key(gpu, key, result)` after each one that may
    go into the table (main merges and writes it there). `started`: time.monotonic() the budget counts
    from (main: the process start; default now)."""
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = SMOKE_SHAPES if args.smoke else {k: MODEL_SHAPES[k] for k in args.shapes}
    dtypes = {"float16": torch.float16} if args.smoke else {k: DTYPES[k] for k in args.dtypes}
    bins = (2,) if args.smoke else tuple(args.bins)
    if args.smoke:
        gpu, sms, l2 = "cpu (smoke)", 8, 0
    else:
        props = torch.cuda.get_device_properties(device)
        gpu, sms, l2 = tg.gpu_name(device), props.multi_processor_count, props.L2_cache_size
    print(f"tuning for {gpu} ({sms} SMs, L2 {l2 / 2**20:.0f} MiB), budget {args.budget:.0f} s", flush=True)
    budget = Budget(args.budget, time.monotonic() if started is None else started)
    tuned, skipped, cut, wrong, seen = {}, [], [], [], set()
    for dname, sbin, shape_name, p in work(shapes, dtypes, bins):
        key = tg.table_key(p.ks, p.ns, dtypes[dname], sbin)
        if key in seen:
            continue  # another model's launch of the same size class
        seen.add(key)
        if not budget.fits(["operands", "candidate", "candidate"]):
            skipped.append(key)
            continue
        r = tune_problem(p, dtypes[dname], sbin, device, sms, l2, args.smoke, budget)
        wrong += [{"key": key, "problem": p.name, **w} for w in r["wrong"]]
        if not usable(r):
            (cut if r["cut_short"] else skipped).append(key)
            continue
        tuned[key] = r
        if on_key is not None:
            on_key(gpu, key, r)
        heuristic = "—" if r["heuristic_us"] is None else f"{r['heuristic_us']:.1f}"
        print(f"{key:40s} {shape_name} {p.name}: {r['config']} {r['us']:.1f} µs (heuristic {heuristic}; "
              f"{r['timed']}/{r['candidates']} candidates{', cut short' if r['cut_short'] else ''})", flush=True)
    return {"gpu": gpu, "tuned": tuned, "skipped": skipped + cut, "wrong": wrong, "torch": torch.__version__}


def merge_entry(table: dict, gpu: str, key: str, r: dict) -> dict:
    """`table` with this GPU's entry for `key` set to `r`'s config (its other keys and other GPUs kept)."""
    table.setdefault("format", 1)
    table.setdefault("gpus", {}).setdefault(gpu, {})[key] = r["config"]
    table.setdefault("measured", {}).setdefault(gpu, {})[key] = {
        "us": r["us"], "heuristic_us": r["heuristic_us"], "problem": r["problem"],
        **({"cut_short": f"{r['timed']} of {r['candidates']} candidates"} if r["cut_short"] else {})}
    return table


def merge(path: Path, result: dict) -> dict:
    """The table at `path` with every key of `result` merged in (this GPU's other keys, other GPUs kept)."""
    table = tg.read_table(path)
    for key, r in sorted(result["tuned"].items()):
        merge_entry(table, result["gpu"], key, r)
    return table


def write_table(path: Path, table: dict) -> None:
    """The table into `path` through a temporary file and a rename: a reader, or a kill, never sees half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def process_started() -> float:
    """time.monotonic() at this process's start (its imports, torch's included, count towards --budget);
    now when the start time cannot be read."""
    try:
        import psutil

        return time.monotonic() - max(0.0, time.time() - psutil.Process().create_time())
    except Exception:  # psutil missing or the process table unreadable: count from here
        return time.monotonic()


def main(argv=None, started: float | None = None) -> int:
    """The command; `started` is the time.monotonic() its --budget counts from (python -m: the process
    start; default now)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=tg.TABLE_FILE, help="the table to update (default: the shipped one)")
    p.add_argument("--shapes", nargs="+", default=list(MODEL_SHAPES), choices=list(MODEL_SHAPES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="tuned in this order")
    p.add_argument("--bins", nargs="+", type=int, default=list(SPARSITY_BINS), choices=range(5),
                   help=f"sparsity bins, tuned in this order (default {' '.join(map(str, SPARSITY_BINS))})")
    p.add_argument("--budget", type=float, default=120.0,
                   help="seconds of wall time from the process start; keys that do not fit keep the heuristic")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1): code paths only")
    args = p.parse_args(argv)
    if not tg.triton_available():
        p.error("triton is not installed")
    if args.smoke:
        if not tg.interpreting():
            p.error("--smoke runs the kernels on CPU: set TRITON_INTERPRET=1")
        if "--out" not in (argv if argv is not None else sys.argv):
            p.error("--smoke needs --out (smoke numbers never go into the shipped table)")
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")

    def on_key(gpu: str, key: str, r: dict) -> None:
        write_table(args.out, merge_entry(tg.read_table(args.out), gpu, key, r))

    result = run(args, started, on_key)
    for w in result["wrong"]:
        print(f"WRONG RESULT: {w['key']} ({w['problem']}) config {w['config']}: max error {w['max_error']:.3g}",
              file=sys.stderr)
    print(f"{len(result['tuned'])} entries for {result['gpu']} in {args.out}; {len(result['skipped'])} keys skipped "
          "for time (they keep the heuristic)"
          + (f"; {len(result['wrong'])} configs gave WRONG results (a kernel bug)" if result["wrong"] else ""),
          flush=True)
    return 1 if result["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main(started=process_started()))
