"""Batch-1 masked GEMV on a GPU: rana's Triton kernel vs dense cuBLAS vs a TEAL-design reference.

For each shape K×N (inputs × outputs; plus the fused q/k/v launch of a Llama-3-8B-shaped layer), dtype
and active fraction f (exactly f·K inputs active, scattered), it times

* dense: ``v @ w_t`` (cuBLAS), the denominator of every ratio;
* rana: ``rana.kernels.triton_gemv`` (the op the modules call; tuned on a first eager call);
* teal-ref: benchmarks/teal_reference_gemv.py, the split-K atomic design (zero-fill + kernel + cast);

each under eager launches (``triton.testing.do_bench``) and CUDA graphs (``do_bench_cudagraph``), and
reports time / dense (the memory-bound limit is f) and effective bandwidth (bytes of the active rows,
the input and the output per second). Writes benchmarks/results/kernels_gpu.md + .json.

    python benchmarks/bench_kernels_gpu.py                      # on a CUDA machine
    TRITON_INTERPRET=1 python benchmarks/bench_kernels_gpu.py --smoke --out /tmp/k   # code paths on CPU

``--smoke`` runs tiny shapes once with a wall-clock timer (its numbers mean nothing) and checks every
kernel against an fp64 reference; it never writes into benchmarks/results unless --out says so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from teal_reference_gemv import teal_reference_gemv  # noqa: E402

from rana.kernels import triton_gemv as tg  # noqa: E402

SHAPES = [(4096, 4096), (4096, 11008), (11008, 4096), (4096, 14336), (14336, 4096)]
QKV = (4096, (4096, 1024, 1024))  # Llama-3-8B: 32 query heads, 8 KV heads of 128
FRACTIONS = [0.1, 0.3, 0.5, 0.7]
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SMOKE_SHAPES = [(40, 48), (72, 24)]
SMOKE_QKV = (32, (32, 16, 16))


def _threshold(v: torch.Tensor, fraction: float) -> float:
    """A threshold leaving exactly round(f·K) of |v| at or above it (midway between two sorted values)."""
    a = v.float().abs().sort(descending=True).values.cpu()
    n = round(fraction * a.numel())
    if n <= 0:
        return float(a[0]) * 2 + 1
    if n >= a.numel():
        return 0.0
    return float(a[n - 1] + a[n]) / 2


def _timer(smoke: bool, graphs: bool):
    if smoke:
        def wall(fn):
            fn()
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return wall
    import triton.testing as tt

    return (lambda fn: tt.do_bench_cudagraph(fn, rep=100)) if graphs else (lambda fn: tt.do_bench(fn, warmup=25, rep=100))


def _case(K, ns, dtype, fraction, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    ws = [torch.randn(K, n, generator=g).to(dtype).to(device) for n in ns]
    v = torch.randn(K, generator=g).to(dtype).to(device)
    t = _threshold(v, fraction)
    return ws, v, t


def _expected(ws, v, t) -> torch.Tensor:
    vf = v.double().cpu()
    vm = vf * (vf.abs() >= t)
    return torch.cat([vm @ w.double().cpu() for w in ws])


def run(args) -> dict:
    device = torch.device("cpu" if args.smoke else "cuda")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    qkv = SMOKE_QKV if args.smoke else QKV
    problems = [(f"{K}x{N}", K, (N,)) for K, N in shapes] + [(f"qkv {qkv[0]}x{'+'.join(map(str, qkv[1]))}", qkv[0], qkv[1])]
    fractions = [0.5] if args.smoke else FRACTIONS
    dtypes = {"float16": torch.float16} if args.smoke else {k: DTYPES[k] for k in args.dtypes}
    records = []
    for name, K, ns in problems:
        for dname, dtype in dtypes.items():
            for f in fractions:
                ws, v, t = _case(K, ns, dtype, f, device)
                t_dev = torch.full((), t, dtype=torch.float32, device=device)
                w_cat = torch.cat(ws, 1)
                n_total = w_cat.shape[1]
                g = len(ws)
                call_rana = lambda: tg.grouped_masked_gemv_triton([v] * g, ws, [t_dev] * g, "abs", [None] * g, [None] * g,
                                                                  tg.sparsity_bin(f))
                call_teal = lambda: torch.cat([teal_reference_gemv(w, v, t) for w in ws]) if g > 1 else teal_reference_gemv(ws[0], v, t)
                call_dense = lambda: v @ w_cat
                exp = _expected(ws, v, t)
                scale = max(1.0, float(exp.abs().max()))
                for label, fn in (("rana", call_rana), ("teal-ref", call_teal)):
                    err = float((fn().double().cpu() - exp).abs().max()) / scale
                    if err > 2e-2:
                        raise AssertionError(f"{label} disagrees with the reference on {name} {dname} f={f}: {err:.3g}")
                active_bytes = f * K * n_total * w_cat.element_size() + (K + n_total) * v.element_size()
                for harness in ("eager", "graphs"):
                    timer = _timer(args.smoke, harness == "graphs")
                    dense_ms = timer(call_dense)
                    for label, fn in (("rana", call_rana), ("teal-ref", call_teal)):
                        ms = timer(fn)
                        records.append({"problem": name, "dtype": dname, "fraction": f, "harness": harness,
                                        "kernel": label, "ms": ms, "dense_ms": dense_ms, "ratio": ms / dense_ms,
                                        "gb_per_s": active_bytes / (ms * 1e-3) / 1e9,
                                        "dense_gb_per_s": (K * n_total * w_cat.element_size()) / (dense_ms * 1e-3) / 1e9})
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke, TRITON_INTERPRET)",
            "torch": torch.__version__, "smoke": args.smoke, "records": records, "fractions": fractions}


def markdown(result: dict) -> str:
    recs, fractions = result["records"], result["fractions"]
    lines = [f"# Masked GEMV kernels on {result['device']} (torch {result['torch']})", "",
             "time / dense cuBLAS `v @ w_t` (memory-bound limit: f), `rana / teal-ref`; exactly f·K inputs active.",
             "Generated by `python benchmarks/bench_kernels_gpu.py`.", ""]
    for harness, title in (("graphs", "CUDA graphs (`do_bench_cudagraph`)"), ("eager", "eager launches (`do_bench`)")):
        lines += [f"## {title}", "", "| problem | dtype | dense µs | " + " | ".join(f"f={f}" for f in fractions) + " |",
                  "|---|---|---|" + "---|" * len(fractions)]
        keys = list(dict.fromkeys((r["problem"], r["dtype"]) for r in recs))
        for problem, dtype in keys:
            cells, dense = [], None
            for f in fractions:
                pick = {r["kernel"]: r for r in recs if (r["problem"], r["dtype"], r["fraction"], r["harness"]) == (problem, dtype, f, harness)}
                dense = dense or statistics.median([p["dense_ms"] for p in pick.values()]) * 1e3
                cells.append(f"{pick['rana']['ratio']:.2f} / {pick['teal-ref']['ratio']:.2f}")
            lines.append(f"| {problem} | {dtype} | {dense:.1f} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## effective bandwidth, CUDA graphs (GB/s: rana / teal-ref / dense)", "",
              "| problem | dtype | " + " | ".join(f"f={f}" for f in fractions) + " |", "|---|---|" + "---|" * len(fractions)]
    for problem, dtype in dict.fromkeys((r["problem"], r["dtype"]) for r in recs):
        cells = []
        for f in fractions:
            pick = {r["kernel"]: r for r in recs if (r["problem"], r["dtype"], r["fraction"], r["harness"]) == (problem, dtype, f, "graphs")}
            cells.append(f"{pick['rana']['gb_per_s']:.0f} / {pick['teal-ref']['gb_per_s']:.0f} / {pick['rana']['dense_gb_per_s']:.0f}")
        lines.append(f"| {problem} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1): exercise the code, no numbers")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--out", type=Path, default=None, help="output stem (default benchmarks/results/kernels_gpu)")
    args = p.parse_args(argv)
    if args.smoke and not tg.interpreting():
        p.error("--smoke runs the Triton kernels on CPU: set TRITON_INTERPRET=1")
    if not args.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")
    out = args.out or (Path(__file__).resolve().parent / "results" / "kernels_gpu")
    if args.smoke and args.out is None:
        p.error("--smoke needs --out (smoke numbers never go into benchmarks/results)")
    result = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
