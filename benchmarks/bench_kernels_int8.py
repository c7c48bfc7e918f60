"""int8 vs fp32 weights in the native CPU masked GEMV (batch-1 decoding), measured in one run.

    python benchmarks/bench_kernels_int8.py                  # 576x1536 and 1536x576, 1 and 2 threads
    python benchmarks/bench_kernels_int8.py --smoke --out /tmp/k8   # tiny, checks the script only

For each shape, thread count and active fraction f, the paths run back to back over the same pool of
weight copies (--pool-mb of fp32 copies and as many int8 copies, so both stream from memory as a
decoding model's layers do), `--rounds` times; the tables report medians of the per-round times and
ratios:

* ``fp32 masked``: the native call a module binds for fp32 weights (``cpu_gemv.NativeCall``: the native
  kernel, dense BLAS on the masked input above its active limit);
* ``int8 masked``: the same call bound for int8 weights (the kept int8 rows only, fp32 accumulation, scale at
  the end; f = 1.0 is mode "none": the dense int8 GEMV);
* ``fp32 dense``: ``F.linear`` (BLAS) on the whole fp32 weight.

Writes benchmarks/results/kernels_int8_cpu.{md,json} (or --out PATH.{md,json}).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    from rana.kernels import cpu_gemv as cg
except ImportError:  # a checkout without `pip install -e .`: import kernels/ as a package
    import importlib

    sys.path.insert(0, str(ROOT))
    cg = importlib.import_module("kernels.cpu_gemv")

SHAPES = [(576, 1536), (1536, 576)]
FRACS = [0.1, 0.25, 0.5, 0.75, 1.0]
PATHS = ("fp32_masked", "int8_masked", "fp32_dense")


def _threshold(v: torch.Tensor, frac: float) -> float:
    """|v| >= t keeps exactly round(frac*K) inputs (midway between two sorted magnitudes)."""
    s, _ = torch.sort(v.abs().reshape(-1), descending=True)
    n = round(frac * s.numel())
    if n >= s.numel():
        return float(s[-1]) / 2
    if n <= 0:
        return float(s[0]) * 2 + 1
    return (float(s[n - 1]) + float(s[n])) / 2


def _pools(K: int, N: int, pool_mb: float):
    """fp32 nn.Linear weights stored column-major (the fp32 kernel's layout) and int8 (K, N) copies with
    per-column scales: the same number of each."""
    g = torch.Generator().manual_seed(0)
    w_t = torch.randn(K, N, generator=g)
    qscale = w_t.abs().amax(0) / 127
    q_t = torch.round(w_t / qscale).clamp(-127, 127).to(torch.int8)
    count = 1 if pool_mb <= 0 else max(2, int(pool_mb * 2**20 // w_t.nbytes))
    fp32 = [w_t.t()] + [w_t.clone().t() for _ in range(count - 1)]  # (N, K) with stride (1, N)
    int8 = [q_t] + [q_t.clone() for _ in range(count - 1)]
    return fp32, int8, qscale


def _pool_us(fn, pool, reps: int) -> float:
    fn(pool[0])
    runs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in pool:
            fn(w)
        runs.append((time.perf_counter() - t0) / len(pool))
    return sorted(runs)[len(runs) // 2] * 1e6


def run(shapes, fracs, threads_list, pool_mb: float, rounds: int, reps: int) -> list[dict]:
    torch.set_grad_enabled(False)
    records = []
    for K, N in shapes:
        fp32, int8, qscale = _pools(K, N, pool_mb)
        # each weight's calls bound once, as a module's operand keeps them (by weight and mode)
        calls = {(id(w), "abs"): cg.NativeCall.bind(w.t(), None, "abs") for w in fp32}
        calls.update({(id(q), m): cg.NativeCall.bind(q, qscale, m) for q in int8 for m in ("abs", "none")})
        v = torch.randn(1, K, generator=torch.Generator().manual_seed(1))
        for threads in threads_list:
            torch.set_num_threads(threads)
            print(f"K={K} N={N} threads={threads} ({len(fp32)} copies of each weight)", flush=True)
            for f in fracs:
                t = _threshold(v, f)
                mode = "none" if f >= 1.0 else "abs"
                fns = {
                    "fp32_masked": (lambda w: calls[id(w), "abs"](v, t), fp32),
                    "int8_masked": (lambda q: calls[id(q), mode](v, t), int8),
                    "fp32_dense": (lambda w: torch.nn.functional.linear(v, w), fp32),
                }
                times = {name: [] for name in fns}
                for _ in range(rounds):  # interleaved: load drifting on a shared machine hits every path alike
                    for name, (fn, pool) in fns.items():
                        times[name].append(_pool_us(fn, pool, reps))
                med = {name: float(torch.tensor(ts).median()) for name, ts in times.items()}
                ratio_int8_fp32 = torch.tensor(times["int8_masked"]) / torch.tensor(times["fp32_masked"])
                ratio_int8_dense = torch.tensor(times["int8_masked"]) / torch.tensor(times["fp32_dense"])
                rec = dict(K=K, N=N, threads=threads, frac=f, weight_copies=len(fp32), rounds=rounds,
                           **{f"{n}_us": med[n] for n in PATHS},
                           int8_over_fp32_masked=float(ratio_int8_fp32.median()),
                           int8_over_fp32_dense=float(ratio_int8_dense.median()),
                           fp32_masked_over_dense=float((torch.tensor(times["fp32_masked"])
                                                         / torch.tensor(times["fp32_dense"])).median()))
                records.append(rec)
                print(f"  f={f:<5} " + "  ".join(f"{n} {med[n]:8.1f} us" for n in PATHS)
                      + f"  int8/fp32 masked x{rec['int8_over_fp32_masked']:.2f}", flush=True)
        del fp32, int8
    return records


def markdown(records: list[dict], meta: dict) -> str:
    lines = ["# int8 vs fp32 weights: native CPU masked GEMV (one token)", "",
             f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, {meta['native']}; "
             f"pool {meta['pool_mb']} MB of fp32 copies (as many int8), {meta['rounds']} interleaved rounds, "
             "median per-round ratios. Generated by `python benchmarks/bench_kernels_int8.py`.", "",
             "| K×N | threads | active f | fp32 masked µs | int8 masked µs | fp32 dense µs | int8 / fp32 masked "
             "| int8 / fp32 dense | fp32 masked / dense |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['K']}×{r['N']} | {r['threads']} | {r['frac']} | {r['fp32_masked_us']:.1f} | "
                     f"{r['int8_masked_us']:.1f} | {r['fp32_dense_us']:.1f} | {r['int8_over_fp32_masked']:.2f} | "
                     f"{r['int8_over_fp32_dense']:.2f} | {r['fp32_masked_over_dense']:.2f} |")
    lines += ["", "f = 1.0: the int8 kernel in mode \"none\" (the dense int8 GEMV), the fp32 path on its dense "
              "BLAS branch."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels_int8_cpu",
                   help="output path without suffix (.md and .json are written)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--pool-mb", type=float, default=400.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one round: checks the script, not speed")
    args = p.parse_args(argv)
    if cg.native_kernel() is None:
        p.error(f"the native kernel is unavailable here: {cg.native_status()}")
    if args.smoke:
        if "--out" not in (argv if argv is not None else sys.argv):
            p.error("--smoke needs --out (smoke numbers never go into benchmarks/results)")
        shapes, fracs, pool_mb, rounds, reps = [(64, 96), (96, 64)], [0.25, 1.0], 1.0, 1, 1
    else:
        shapes, fracs, pool_mb, rounds, reps = SHAPES, FRACS, args.pool_mb, args.rounds, args.reps
    records = run(shapes, fracs, args.threads, pool_mb, rounds, reps)
    meta = dict(date=_dt.date.today().isoformat(), machine=f"{platform.machine()} ({os.cpu_count()} cores "
                f"here)", torch=torch.__version__, native=cg.native_status(), pool_mb=pool_mb, rounds=rounds,
                smoke=args.smoke)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(records, meta))
    print(f"wrote {args.out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
