"""The native W8A8 kernel (int8 weights × int8 activations, one token) against an earlier revision of it, in one run.

    python benchmarks/bench_kernels_w8a8.py --against eda1df0      # writes benchmarks/results/kernels_w8a8_cpu.{md,json}
    python benchmarks/bench_kernels_w8a8.py --against HEAD --smoke --out /tmp/w8a8   # tiny, checks the script only

For each shape (SmolLM2-135M's and Qwen2.5-Coder-1.5B's decoder projections), thread count and kept fraction f, two
builds of `kernels/cpu_gemv.c` run back to back over the same pool of int8 weight copies (--pool-mb, so the rows
stream from memory as a decoding model's layers do), `--rounds` times, interleaved:

* ``before``: the C source of git revision `--against`, compiled with the same flags (its W8A8 activation block is
  whatever that source quantizes with: 64 before the block was a setting);
* ``now B``: this checkout's source, at each activation block B of `--blocks`.

The token's kept inputs are chosen by magnitude (mode "abs"; f = 1.0 is mode "none", the dense W8A8 GEMV). The
tables give medians of the per-round times, the ratio now / before per round (median), and the kept int8 bytes
read per µs. Only the native call is timed (its operands bound once, as a module's are).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
try:
    from rana.kernels import cpu_gemv as cg
    from rana.kernels.modes import HEADER_NAME, c_header
except ImportError:  # a checkout without `pip install -e .`: import kernels/ as a package
    import importlib

    sys.path.insert(0, str(ROOT))
    cg = importlib.import_module("kernels.cpu_gemv")
    HEADER_NAME, c_header = importlib.import_module("kernels.modes").HEADER_NAME, importlib.import_module(
        "kernels.modes").c_header

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_kernels_int8 import _pool_us, _threshold  # noqa: E402  (the int8 kernel benchmark's pool and masks)

# (name, K, N): SmolLM2-135M (hidden 576, MLP 1536) and Qwen2.5-Coder-1.5B (hidden 1536, MLP 8960)
SHAPES = [("smollm2 up", 576, 1536), ("smollm2 down", 1536, 576), ("qwen2.5-1.5b up", 1536, 8960),
          ("qwen2.5-1.5b down", 8960, 1536)]
FRACS = [0.3, 0.5, 1.0]


def _build(source: str, folder: Path) -> "cg.Library":
    """The library compiled from `source` (a cpu_gemv.c text) with the flags the loaded library was built with."""
    folder.mkdir(parents=True, exist_ok=True)
    real = cg.source
    cg.source = lambda: source.replace(f'#include "{HEADER_NAME}"\n', c_header())
    try:
        return cg.build_variant(os.environ.get("CC", "cc"), cg.BUILD_ATTEMPTS[0], folder)
    finally:
        cg.source = real


def run(shapes, fracs, threads_list, blocks, libs, pool_mb: float, rounds: int, reps: int) -> list[dict]:
    torch.set_grad_enabled(False)
    records = []
    for name, K, N in shapes:
        g = torch.Generator().manual_seed(0)
        q_t = torch.randint(-127, 128, (K, N), generator=g, dtype=torch.int8)
        qscale = torch.rand(N, generator=g) * 0.01 + 1e-3
        count = 1 if pool_mb <= 0 else max(2, int(pool_mb * 2**20 // q_t.nbytes))
        pool = [q_t] + [q_t.clone() for _ in range(count - 1)]
        v = torch.randn(1, K, generator=torch.Generator().manual_seed(1)) * torch.rand(K, generator=g) * 4
        paths = [("before", libs["before"], 64)] + [(f"now {b}", libs["now"], b) for b in blocks]
        for threads in threads_list:
            torch.set_num_threads(threads)
            print(f"{name} K={K} N={N} threads={threads} ({count} copies)", flush=True)
            for f in fracs:
                t = _threshold(v, f)
                mode = "none" if f >= 1.0 else "abs"
                calls = {p: {id(w): cg.NativeCall.bind(w, qscale, mode, activations="int8", block=b, library=lib)
                             for w in pool} for p, lib, b in paths}
                times = {p: [] for p, _, _ in paths}
                for _ in range(rounds):  # interleaved: load drifting on a shared machine hits every path alike
                    for p, _, _ in paths:
                        times[p].append(_pool_us(lambda w, c=calls[p]: c[id(w)](v, t), pool, reps))
                med = {p: float(torch.tensor(ts).median()) for p, ts in times.items()}
                kept_bytes = (K if mode == "none" else round(f * K)) * N
                rec = dict(shape=name, K=K, N=N, threads=threads, frac=f, copies=count, rounds=rounds,
                           us={p: med[p] for p in med},
                           over_before={p: float((torch.tensor(times[p]) / torch.tensor(times["before"])).median())
                                        for p in med if p != "before"},
                           gb_per_s={p: kept_bytes / med[p] / 1e3 for p in med})
                records.append(rec)
                print(f"  f={f:<4} " + "  ".join(f"{p} {med[p]:7.1f} us" for p in med) + "  "
                      + "  ".join(f"{p}/before x{r:.2f}" for p, r in rec["over_before"].items()), flush=True)
        del pool
    return records


def markdown(records: list[dict], meta: dict) -> str:
    paths = list(records[0]["us"]) if records else []
    now = [p for p in paths if p != "before"]
    lines = ["# The native W8A8 kernel against an earlier revision (one token)", "",
             f"{meta['date']}, {meta['machine']}, torch {meta['torch']}, {meta['native']}; `before` = "
             f"kernels/cpu_gemv.c of {meta['against']} (blocks of 64), `now B` = this checkout at activation block B; "
             f"pool {meta['pool_mb']} MB of int8 weight copies, {meta['rounds']} interleaved rounds, medians. "
             f"Generated by `{meta['command']}`.", "",
             "| shape | K×N | threads | kept f | " + " | ".join(f"{p} µs" for p in paths) + " | "
             + " | ".join(f"{p} / before" for p in now) + " | " + " | ".join(f"{p} GB/s" for p in paths) + " |",
             "|---|---|---|---|" + "---|" * (2 * len(paths) + len(now))]
    for r in records:
        lines.append(f"| {r['shape']} | {r['K']}×{r['N']} | {r['threads']} | {r['frac']} | "
                     + " | ".join(f"{r['us'][p]:.1f}" for p in paths) + " | "
                     + " | ".join(f"{r['over_before'][p]:.2f}" for p in now) + " | "
                     + " | ".join(f"{r['gb_per_s'][p]:.1f}" for p in paths) + " |")
    lines += ["", "GB/s: the kept int8 rows' bytes per call over its time (f = 1.0: every row, the dense W8A8 GEMV)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", required=True, help="git revision whose kernels/cpu_gemv.c is `before`")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "kernels_w8a8_cpu",
                   help="output path without suffix (.md and .json are written)")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--blocks", type=int, nargs="+", default=[64, 32])
    p.add_argument("--pool-mb", type=float, default=256.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, one round: checks the script, not speed")
    args = p.parse_args(argv)
    if cg.native_kernel() is None:
        p.error(f"the native kernel is unavailable here: {cg.native_status()}")
    try:
        old = subprocess.run(["git", "show", f"{args.against}:kernels/cpu_gemv.c"], cwd=ROOT, check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        p.error(f"cannot read kernels/cpu_gemv.c at {args.against!r}: {getattr(e, 'stderr', '') or e}".strip())
    if args.smoke:
        if "--out" not in (argv if argv is not None else sys.argv):
            p.error("--smoke needs --out (smoke numbers never go into benchmarks/results)")
        shapes, fracs, pool_mb, rounds, reps = [("tiny", 96, 128)], [0.5, 1.0], 1.0, 1, 1
    else:
        shapes, fracs, pool_mb, rounds, reps = SHAPES, FRACS, args.pool_mb, args.rounds, args.reps
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"before": _build(old, Path(tmp) / "before"), "now": _build(cg.source(), Path(tmp) / "now")}
        records = run(shapes, fracs, args.threads, args.blocks, libs, pool_mb, rounds, reps)
    meta = dict(date=_dt.date.today().isoformat(), machine=f"{platform.machine()} ({os.cpu_count()} cores here)",
                torch=torch.__version__, native=cg.native_status(), against=args.against, pool_mb=pool_mb,
                rounds=rounds, smoke=args.smoke,
                command="python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(records, meta))
    print(f"wrote {args.out.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
