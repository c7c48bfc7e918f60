"""Fill the masked-GEMV tuning table for this GPU: ``python -m rana.kernels.gemv_tune --out FILE``.

For the launches a decode step of each model shape makes (:func:`problems`), every candidate config
(:func:`candidates`) is timed on *cold* weights: enough copies of every tensor that one pass over
them reads more than twice the L2 cache, launched back to back inside one CUDA graph (what a
compiled decode step replays), so a config is ranked on HBM streaming and launch cost, not on an
L2-resident benchmark. The fastest config per table key (:func:`triton_gemv.table_key`) is merged
into FILE under this GPU's name, with the measured µs beside it. The kernels read the table at
their first launch (``kernels/gemv_configs.json`` ships with the package; exports inline it).

Tuning never happens on a decode path: this command, run once per GPU (benchmarks/gpu_suite.py
runs it), is the only place that times configs. ``--budget`` bounds its wall time; problems are
tuned in order of importance (bf16, sparsity bin 2 first) and the rest keep the heuristic.

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

# hidden, intermediate, attention heads, KV heads, vocabulary
MODEL_SHAPES = {
    "llama-2-7b": (4096, 11008, 32, 32, 32000),
    "llama-3-8b": (4096, 14336, 32, 8, 128256),
}
SMOKE_SHAPES = {"tiny": (64, 160, 4, 2, 256)}
SPARSITY_BINS = (2, 1, 3, 4)  # F ≈ 0.5 first: the bins a compressed model's launches fall in most
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


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


def candidates(ks, ns, dtype, sms: int) -> list[tg.GemvConfig]:
    """The heuristic first, then row widths × steps × programs per SM × warps."""
    out = [tg.heuristic_config(ks, ns, dtype, torch.device("cuda"), sms=sms)]
    widths = (16, 32, 64) if dtype == torch.float32 else (32, 64, 128)
    for block_n in widths:
        for block_k in (32, 64):
            for waves in (2, 4):
                for warps in (4, 8):
                    cfg = tg.GemvConfig(block_n, block_k, tg.split_for(ks, ns, block_n, block_k, sms, waves), warps)
                    if cfg not in out:
                        out.append(cfg)
    return out


def _threshold_for(v: torch.Tensor, fraction: float, mode: str) -> torch.Tensor:
    """A 0-dim threshold keeping about `fraction` of v's scores."""
    score = (v.float() ** 2) if mode == "square" else v.float().abs()
    t = torch.quantile(score.cpu(), 1.0 - fraction) if fraction < 1 else torch.tensor(-float("inf"))
    return t.to(device=v.device, dtype=torch.float32)


def _operands(problem: Problem, dtype, fraction: float, device, copies: int, seed: int = 0):
    """`copies` independent sets of (vs, w_ts, thresholds, scales, biases) for one launch."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    sets = []
    for _ in range(copies):
        vs = [torch.randn(k, generator=g).to(device=device, dtype=dtype) for k in problem.ks]
        ws = [torch.randn(k, n, generator=g).to(device=device, dtype=dtype) for k, n in zip(problem.ks, problem.ns)]
        ts = [_threshold_for(v, fraction, problem.mode) for v in vs]
        scales = [torch.rand(k, generator=g).to(device=device) + 0.5 if problem.mode == "abs_scaled" else None
                  for k in problem.ks]
        sets.append((vs, ws, ts, scales, [None] * len(vs)))
    return sets


def _copies_for(problem: Problem, dtype, l2_bytes: int) -> int:
    size = sum(k * n for k, n in zip(problem.ks, problem.ns)) * torch.tensor([], dtype=dtype).element_size()
    return max(2, -(-2 * l2_bytes // size) + 1)


def _time_cuda(sets, mode, cfg, reps: int = 10) -> float:
    """µs per launch, cold weights, inside one CUDA graph that walks every copy once."""
    launch = lambda: [tg._launch(vs, ws, ts, mode, ss, bs, cfg) for vs, ws, ts, ss, bs in sets]
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


def tune_problem(problem: Problem, dtype, sbin: int, device, sms: int, l2_bytes: int, smoke: bool) -> dict:
    """The fastest candidate for one launch at one sparsity bin, with the heuristic's time beside it."""
    fraction = max(0.05, min(1.0, sbin / 4))
    sets = _operands(problem, dtype, fraction, device, 1 if smoke else _copies_for(problem, dtype, l2_bytes))
    cands = candidates(problem.ks, problem.ns, dtype, sms)[: 2 if smoke else None]
    timed = []
    for cfg in cands:
        try:
            us = (_time_wall if smoke else _time_cuda)(sets, problem.mode, cfg)
        except Exception as exc:  # a config this GPU cannot run (registers, shared memory): skip it
            print(f"  {problem.name} {cfg}: {type(exc).__name__}", file=sys.stderr)
            continue
        timed.append((us, cfg))
    if not timed:
        raise RuntimeError(f"no config ran for {problem.name}")
    best_us, best = min(timed)
    return {"config": list(best), "us": round(best_us, 2), "heuristic_us": round(timed[0][0], 2),
            "problem": problem.name, "ks": list(problem.ks), "ns": list(problem.ns)}


def run(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = SMOKE_SHAPES if args.smoke else {k: MODEL_SHAPES[k] for k in args.shapes}
    dtypes = {"float16": torch.float16} if args.smoke else {k: DTYPES[k] for k in args.dtypes}
    bins = (2,) if args.smoke else SPARSITY_BINS
    if args.smoke:
        gpu, sms, l2 = "cpu (smoke)", 8, 0
    else:
        props = torch.cuda.get_device_properties(device)
        gpu, sms, l2 = tg.gpu_name(device), props.multi_processor_count, props.L2_cache_size
    deadline = time.monotonic() + args.budget
    tuned, skipped = {}, []
    work = [(sbin, dname, shape_name, p) for sbin in bins for dname in dtypes for shape_name in shapes
            for p in problems(shapes[shape_name])]
    for sbin, dname, shape_name, p in work:
        key = tg.table_key(p.ks, p.ns, dtypes[dname], sbin)
        if key in tuned:
            continue  # another model's launch of the same size class
        if time.monotonic() > deadline:
            skipped.append(key)
            continue
        tuned[key] = tune_problem(p, dtypes[dname], sbin, device, sms, l2, args.smoke)
        r = tuned[key]
        print(f"{key:40s} {shape_name} {p.name}: {r['config']} {r['us']:.1f} µs (heuristic {r['heuristic_us']:.1f})",
              flush=True)
    return {"gpu": gpu, "tuned": tuned, "skipped": skipped, "torch": torch.__version__}


def merge(path: Path, result: dict) -> dict:
    """The table at `path` with this GPU's entries replaced by the new ones (other GPUs kept)."""
    table = tg.read_table(path)
    table.setdefault("format", 1)
    table["gpus"][result["gpu"]] = {k: r["config"] for k, r in sorted(result["tuned"].items())}
    table.setdefault("measured", {})[result["gpu"]] = {
        k: {"us": r["us"], "heuristic_us": r["heuristic_us"], "problem": r["problem"]}
        for k, r in sorted(result["tuned"].items())}
    return table


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=tg.TABLE_FILE, help="the table to update (default: the shipped one)")
    p.add_argument("--shapes", nargs="+", default=list(MODEL_SHAPES), choices=list(MODEL_SHAPES))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--budget", type=float, default=120.0, help="seconds; what does not fit keeps the heuristic")
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
    result = run(args)
    table = merge(args.out, result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, args.out)  # atomic: a reader never sees half a table
    print(f"{len(result['tuned'])} entries for {result['gpu']} in {args.out}; {len(result['skipped'])} keys skipped "
          "for time (they keep the heuristic)")


if __name__ == "__main__":
    main()
