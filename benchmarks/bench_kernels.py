"""Masked GEMV benchmark: time of the masked paths relative to a dense GEMV, same run.

    python benchmarks/bench_kernels.py                 # CPU section, plus GPU section if CUDA
    python benchmarks/bench_kernels.py --skip-cpu      # GPU only (e.g. on the H200)
    python benchmarks/bench_kernels.py --quick         # fewer shapes / fractions
    python benchmarks/bench_kernels.py --skip-gpu --threads 2 --cpu-dtypes fp32   # kernels_cpu_2threads.md

Writes benchmarks/results/kernels_cpu.{md,json} and, with CUDA, kernels_gpu.{md,json}.
Every number in a table is time(masked path) / time(dense `v @ w_t`) measured in the same run
on the same tensors (< 1 means faster than dense). The mask keeps exactly round(f*K) inputs,
chosen by magnitude from a random normal v (scattered, as in decoding); the threshold is a
0-dim tensor on the device, as the RaNA modules hold it.

CPU timing: each path runs over copies of the weight filling --pool-mb (600 MB: streamed from
memory, as in decoding), median of passes; --pool-mb 0 times one cache-resident weight with
torch.utils.benchmark.Timer.blocked_autorange.
GPU timing: triton.testing.do_bench (median, L2 flushed before each call: weights are not L2
resident across layers in decoding) and, separately, do_bench_cudagraph (launch overhead
removed, as under CUDA graphs / torch.compile "reduce-overhead").
`--interpret-smoke` runs the GPU section's code on CPU tensors under TRITON_INTERPRET=1 with
tiny shapes (checks the script itself on a machine without a GPU; timings meaningless).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
from pathlib import Path

if "--interpret-smoke" in sys.argv:  # must precede the first kernel build
    os.environ["TRITON_INTERPRET"] = "1"
    os.environ["RANA_TRITON_ON_CPU"] = "1"  # CPU operands take the Triton kernels (rana.kernels.weights)

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    from rana.kernels import cpu_gemv as cg
    from rana.kernels import modes, route, triton_gemv
    from rana.kernels import torch_gemv as mg
    from rana.kernels import weights
except ImportError:  # running from a checkout without `pip install -e .`: import kernels/ as a package
    import importlib

    sys.path.insert(0, str(ROOT))
    cg = importlib.import_module("kernels.cpu_gemv")
    mg = importlib.import_module("kernels.torch_gemv")
    modes, route = importlib.import_module("kernels.modes"), importlib.import_module("kernels.route")
    triton_gemv, weights = importlib.import_module("kernels.triton_gemv"), importlib.import_module("kernels.weights")

SHAPES = [(576, 192), (576, 576), (576, 1536), (1536, 576), (4096, 4096), (4096, 11008), (11008, 4096)]
FRACS = [0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
DTYPE_NAMES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def make_weight(K, N, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(K, N, generator=g).to(dtype=dtype, device=device)


def make_input(K, dtype, device, frac, mode, seed=1):
    """v (1, K), a 0-dim threshold tensor keeping exactly round(frac*K) inputs, and scale."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(1, K, generator=g).to(dtype=dtype, device=device)
    scale = (torch.rand(K, generator=g) + 0.5).to(device)
    vf = v.float().reshape(K).cpu()
    score = {"square": vf * vf, "abs": vf.abs(), "abs_scaled": vf.abs() * scale.float().cpu()}[mode]
    n = round(frac * K)
    s, _ = torch.sort(score, descending=True)
    if n >= K:
        t = float(s[-1]) - 1.0
    elif n <= 0:
        t = float(s[0]) + 1.0
    else:
        t = (float(s[n - 1]) + float(s[n])) / 2
    return v, torch.tensor(t, dtype=torch.float32, device=device), scale


# ------------------------------------------------------------------------------------- timers
def cpu_time_us(fn, min_run_time, threads=1):
    from torch.utils import benchmark

    fn()
    m = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads).blocked_autorange(
        min_run_time=min_run_time)
    return m.median * 1e6


def gpu_time_us(fn, graph=False):
    import triton.testing

    fn()
    torch.cuda.synchronize()
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


# ----------------------------------------------------------------------------------- sections
def _weight_pool(K, N, dtype, pool_mb):
    """Copies of one weight filling `pool_mb` MB (at least 2): timing a path over all of them
    streams the weights from memory, as decoding does (a model's layers do not stay in cache).
    pool_mb=0 gives one weight, cache resident after the first call (the "hot" regime)."""
    w_t = make_weight(K, N, dtype, "cpu")
    count = 1 if pool_mb <= 0 else max(2, int(pool_mb * 2**20 // w_t.nbytes))
    return [w_t] + [w_t.clone() for _ in range(count - 1)]


def _pool_time_us(fn, pool, reps=3):
    import time

    fn(pool[0])
    best = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in pool:
            fn(w)
        best.append((time.perf_counter() - t0) / len(pool))
    return sorted(best)[len(best) // 2] * 1e6


def _without_native(fn):
    """`fn` with the native kernel switched off: the torch-only path of a machine without a compiler."""
    def run(*a, **k):
        saved = cg._load
        cg._load = lambda: (None, "off")
        try:
            return fn(*a, **k)
        finally:
            cg._load = saved
    return run


CPU_PATHS = ("masked_gemv", "torch_gather", "dense_masked")


def run_cpu(shapes, fracs, dtypes, mode, min_run_time, rounds, threads, pool_mb):
    """Dense and the masked paths are timed back to back `rounds` times; the reported ratio is
    the median of the per-round ratios (robust to load drifting on a shared machine).

    masked_gemv: the decode route as the RaNA modules call it, with the operand a module keeps (native
    kernel for fp32, embedding_bag for fp16/bf16); torch_gather: the same without the native kernel
    (embedding_bag below CPU_GATHER_MAX_FRACTION, dense masked above); dense_masked: mask then dense GEMV."""
    torch.set_grad_enabled(False)
    torch.set_num_threads(threads)
    torch_only = _without_native(mg.masked_gemv_torch)
    records = []
    for dname in dtypes:
        dtype = DTYPE_NAMES[dname]
        for K, N in shapes:
            pool = _weight_pool(K, N, dtype, pool_mb)
            operands = {id(w): weights.FloatWeight(w.t()) for w in pool}  # kept per weight, as a module keeps its
            print(f"[cpu] {dname} K={K} N={N} ({len(pool)} weight copies)", flush=True)
            for f in fracs:
                v, t, scale = make_input(K, dtype, "cpu", f, mode)
                fns = {
                    "dense": lambda w: v @ w,
                    "masked_gemv": lambda w: route.decode_masked(operands[id(w)], v, t, mode, scale),
                    "torch_gather": lambda w: torch_only(w, v, t, mode=mode, scale=scale),
                    "dense_masked": lambda w: mg.masked_gemv_dense(w, v, t, mode=mode, scale=scale),
                }
                times = {name: [] for name in fns}
                for _ in range(rounds):
                    for name, fn in fns.items():
                        if len(pool) == 1:
                            times[name].append(cpu_time_us(lambda fn=fn: fn(pool[0]), min_run_time, threads))
                        else:
                            times[name].append(_pool_time_us(fn, pool))
                dense = torch.tensor(times["dense"])
                line = [f"    f={f:<5} dense {dense.median().item():9.1f} us"]
                for name in CPU_PATHS:
                    ratios = torch.tensor(times[name]) / dense
                    records.append(dict(section="cpu", path=name, dtype=dname, K=K, N=N, frac=f,
                                        us=float(torch.tensor(times[name]).median()),
                                        dense_us=float(dense.median()), ratio=float(ratios.median()),
                                        ratio_min=float(ratios.min()), ratio_max=float(ratios.max()),
                                        rounds=rounds, weight_copies=len(pool)))
                    line.append(f"{name} x{records[-1]['ratio']:.2f} [{ratios.min():.2f}-{ratios.max():.2f}]")
                print("  ".join(line), flush=True)
            del pool
    return records


def run_gpu(shapes, fracs, dtypes, mode, device, timer, graphs):
    torch.set_grad_enabled(False)
    records = []
    for dname in dtypes:
        dtype = DTYPE_NAMES[dname]
        for K, N in shapes:
            w_t = make_weight(K, N, dtype, device)
            operand = weights.FloatWeight(w_t.t())
            v, _, scale = make_input(K, dtype, device, 1.0, mode)
            timings = {"eager": lambda fn: timer(fn, False)}
            if graphs:
                timings["graph"] = lambda fn: timer(fn, True)
            dense = {}
            for tname, tm in timings.items():
                try:
                    dense[tname] = tm(lambda: v @ w_t)
                except Exception as e:  # noqa: BLE001 - keep the eager table if graphs fail
                    print(f"[gpu] {tname} timing failed: {type(e).__name__}: {e}", flush=True)
            print(f"[gpu] {dname} K={K} N={N} dense " + " ".join(f"{k}={u:.1f}us" for k, u in dense.items()),
                  flush=True)
            for f in fracs:
                v, t, scale = make_input(K, dtype, device, f, mode)
                paths = {
                    "triton": lambda: route.decode_masked(operand, v, t, mode, scale),
                    "dense_masked": lambda: mg.masked_gemv_dense(w_t, v, t, mode=mode, scale=scale),
                }
                ref = mg.masked_gemv_reference(w_t, v, t, mode=mode, scale=scale).float()
                err = (paths["triton"]().float() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
                line = [f"    f={f:<5} triton rel.err {err:.1e}"]
                for tname in dense:
                    for name, fn in paths.items():
                        us = timings[tname](fn)
                        records.append(dict(section="gpu", timing=tname, path=name, dtype=dname, K=K, N=N,
                                            frac=f, us=us, dense_us=dense[tname], ratio=us / dense[tname],
                                            rel_err=err if name == "triton" else None))
                        line.append(f"{tname}/{name} x{us / dense[tname]:.2f}")
                print("  ".join(line), flush=True)
    return records


# ----------------------------------------------------------------------------------- reports
def _table(records, fracs, title_cols="dense µs"):
    keys = []
    for r in records:
        k = (r["dtype"], r["K"], r["N"])
        if k not in keys:
            keys.append(k)
    head = f"| dtype | K×N | {title_cols} | " + " | ".join(f"f={f:g}" for f in fracs) + " |"
    lines = [head, "|" + "---|" * (3 + len(fracs))]
    for dtype, K, N in keys:
        rs = {r["frac"]: r for r in records if (r["dtype"], r["K"], r["N"]) == (dtype, K, N)}
        any_r = next(iter(rs.values()))
        cells = [f"{rs[f]['ratio']:.2f}" if f in rs else "–" for f in fracs]
        lines.append(f"| {dtype} | {K}×{N} | {any_r['dense_us']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _env(device_name):
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    return (f"- device: {device_name}\n- torch {torch.__version__}, triton {tv}, python {platform.python_version()}"
            f"\n- date: {_dt.datetime.now().isoformat(timespec='seconds')}\n")


def write_cpu(records, fracs, mode, out_dir, threads, pool_mb):
    name = platform.processor() or platform.machine()
    regime = (f"weights streamed from memory: each path is timed over copies of the weight filling {pool_mb} MB"
              " (median of 3 passes), as in decoding, where a model's layers do not stay in cache"
              if pool_mb > 0 else "one weight, cache resident (torch.utils.benchmark blocked_autorange medians)")
    md = [
        "# Masked GEMV on CPU: time relative to dense `v @ w_t` (batch 1)\n",
        _env(f"CPU {name} ({os.cpu_count()} logical cores), timed with {threads} thread(s)"),
        f"- CPU kernel: {cg.native_status()}",
        f"- mode `{mode}`, threshold a 0-dim tensor; f = fraction of the K inputs active (scattered).",
        f"- {regime}.",
        "- ratio = time of the path / time of dense `v @ w_t` on the same weights and v, timed back to back;"
        " median over interleaved rounds (per-round ratios and ranges in the .json); < 1 is faster;"
        " the memory-bound limit is f. The dense µs column is the dense median at the first f.",
        f"- machine load average when written: {os.getloadavg()[0]:.1f}\n",
        "## `masked_gemv` (what the RaNA modules call for one token on CPU: the native kernel for fp32,"
        " dense BLAS on the masked input above `NATIVE_MAX_FRACTION`; embedding_bag for fp16/bf16)\n",
        _table([r for r in records if r["path"] == "masked_gemv"], fracs),
        "\n## torch only (the same without the native kernel, e.g. no C compiler: embedding_bag over the active"
        " rows, dense masked above `CPU_GATHER_MAX_FRACTION`)\n",
        _table([r for r in records if r["path"] == "torch_gather"], fracs),
        "\n## `masked_gemv_dense` (mask then dense product: the batch>1 path, shown at batch 1)\n",
        _table([r for r in records if r["path"] == "dense_masked"], fracs),
        "",
    ]
    stem = "kernels_cpu" if threads == 1 else f"kernels_cpu_{threads}threads"
    (out_dir / f"{stem}.md").write_text("\n".join(md))
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(mode=mode, threads=threads, pool_mb=pool_mb,
                                                          kernel=cg.native_status(), records=records), indent=1))
    print(f"wrote {out_dir / (stem + '.md')}")


def write_gpu(records, fracs, mode, out_dir, device_name, stem="kernels_gpu"):
    md = [
        "# Masked GEMV on GPU: time relative to dense `v @ w_t` (batch 1)\n",
        _env(device_name),
        f"- mode `{mode}`, threshold a 0-dim device tensor; f = fraction of the K inputs active (scattered).",
        "- ratio = median time of the path / median time of dense `v @ w_t` (cuBLAS) on the same w_t,"
        " same run and timing method; < 1 is faster.",
        "- eager: triton.testing.do_bench (L2 flushed, includes launch overhead: zero-init, kernel,"
        " cast); graph: do_bench_cudagraph (no launch overhead, L2 warm).\n",
    ]
    errs = [r["rel_err"] for r in records if r.get("rel_err") is not None]
    if errs:
        md.append(f"- Triton vs fp32 reference: max relative error {max(errs):.1e}\n")
    for timing in ("eager", "graph"):
        for path, title in (("triton", "`masked_gemv_triton`"), ("dense_masked", "`masked_gemv_dense` (mask + cuBLAS)")):
            rs = [r for r in records if r["timing"] == timing and r["path"] == path]
            if rs:
                md += [f"## {timing}: {title}\n", _table(rs, fracs), ""]
    (out_dir / f"{stem}.md").write_text("\n".join(md))
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(mode=mode, device=device_name, records=records), indent=1))
    print(f"wrote {out_dir / (stem + '.md')}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--skip-cpu", action="store_true")
    p.add_argument("--skip-gpu", action="store_true")
    p.add_argument("--quick", action="store_true", help="3 shapes, 3 fractions")
    p.add_argument("--mode", default="abs", choices=list(modes.MASKING_MODES))
    p.add_argument("--cpu-dtypes", default="fp32,bf16,fp16")
    p.add_argument("--gpu-dtypes", default="fp16,bf16")
    p.add_argument("--min-run-time", type=float, default=0.1, help="CPU seconds per measurement")
    p.add_argument("--rounds", type=int, default=5, help="CPU: interleaved dense/path rounds")
    p.add_argument("--threads", type=int, default=1, help="CPU threads while timing")
    p.add_argument("--pool-mb", type=int, default=600,
                   help="CPU: time over weight copies filling this many MB (0: one cache-resident weight)")
    p.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timings")
    p.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--interpret-smoke", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.out_dir.mkdir(parents=True, exist_ok=True)
    shapes, fracs = (SHAPES[:3], [0.1, 0.5, 1.0]) if a.quick else (SHAPES, FRACS)

    if a.interpret_smoke:  # exercise the GPU section's code paths on CPU (timings meaningless)
        recs = run_gpu([(40, 70), (70, 40)], [0.2, 1.0], ["fp16", "bf16"], a.mode, "cpu",
                       lambda fn, graph: cpu_time_us(fn, 0.01), graphs=True)
        write_gpu(recs, [0.2, 1.0], a.mode, a.out_dir, "CPU (TRITON_INTERPRET smoke)", stem="kernels_gpu_smoke")
        return

    if not a.skip_cpu:
        recs = run_cpu(shapes, fracs, a.cpu_dtypes.split(","), a.mode, a.min_run_time, a.rounds, a.threads,
                       a.pool_mb)
        write_cpu(recs, fracs, a.mode, a.out_dir, a.threads, a.pool_mb)
    if not a.skip_gpu:
        if torch.cuda.is_available() and triton_gemv.triton_available():
            if os.environ.get("TRITON_INTERPRET") == "1":
                sys.exit("unset TRITON_INTERPRET to benchmark the GPU")
            recs = run_gpu(shapes, fracs, a.gpu_dtypes.split(","), a.mode, "cuda", gpu_time_us,
                           graphs=not a.no_graphs)
            write_gpu(recs, fracs, a.mode, a.out_dir, torch.cuda.get_device_name())
        else:
            print("no CUDA/triton: GPU section skipped")


if __name__ == "__main__":
    main()
