"""How `rana compress` scales: wall time, CPU time and peak memory on random Llama-shaped models of
growing hidden size, intermediate size and layer count (tiny → SmolLM2-135M-shaped), each run in
a fresh subprocess (single-threaded torch, so a busy shared CPU does not distort the timings).

Fits per-layer time to the work terms of one layer and extrapolates to Llama-2-7B / 70B, on this
CPU and on an H100 under stated throughput assumptions; checks `rana.compress.memory.estimate_memory`
against the measured peak. Writes benchmarks/results/scaling.{json,md}.

    python benchmarks/bench_scaling.py                 # the default grid (≈ 5–8 min on 1 busy core)
    python benchmarks/bench_scaling.py --quick         # three points, a smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# calibration / search settings of every run (small, for a scarce CPU; the fit scales them up)
RUN = dict(method="rana", flops=0.6, calib_tokens=4096, seq_len=128, batch_size=8, fit_sample_tokens=512,
           search_tokens=256, grid_step=0.125)

SMOLLM2_135M = dict(hidden=576, inter=1536, layers=30, heads=9, kv=3, vocab=49152)
# (name, hidden, intermediate, layers, heads, kv heads, vocab)
GRID = [
    ("tiny", 64, 160, 2, 4, 2, 256),
    # hidden size (intermediate = 8/3 hidden, as SmolLM2), 3 layers
    ("h128", 128, 344, 3, 4, 2, 256),
    ("h256", 256, 688, 3, 4, 2, 256),
    ("h384", 384, 1024, 3, 6, 2, 256),
    ("h576", 576, 1536, 3, 9, 3, 256),
    # intermediate size at hidden 256, 3 layers
    ("h256-i384", 256, 384, 3, 4, 2, 256),
    ("h256-i1280", 256, 1280, 3, 4, 2, 256),
    ("h256-i2048", 256, 2048, 3, 4, 2, 256),
    # layer count at hidden 256
    ("h256-l6", 256, 688, 6, 4, 2, 256),
    ("h256-l12", 256, 688, 12, 4, 2, 256),
    # SmolLM2-135M-shaped (random weights, full vocabulary and depth)
    ("smollm2-135m", 576, 1536, 30, 9, 3, 49152),
]
# runs at h256 / 3 layers with other calibration settings, to separate the forward (∝ calibration
# tokens) from the search (∝ sample + search tokens) in the fit
VARIANTS = {
    "h256-t1024": dict(base="h256", calib_tokens=1024),
    "h256-t16384": dict(base="h256", calib_tokens=16384),
    "h256-n1536": dict(base="h256", fit_sample_tokens=1024, search_tokens=512),
}
QUICK = ["tiny", "h128", "h256-l6"]
ALL = [g[0] for g in GRID] + list(VARIANTS)

# Target shapes for the extrapolation (Llama-2: 7B MHA, 70B GQA with 8 kv heads)
TARGETS = {
    "llama2-7b": dict(hidden=4096, inter=11008, layers=32, heads=32, kv=32, vocab=32000),
    "llama2-70b": dict(hidden=8192, inter=28672, layers=80, heads=64, kv=8, vocab=32000),
}
# Paper-scale run the extrapolation assumes (rana defaults): 32k calibration tokens, 1536 threshold
# sample + 1024 search tokens.
PAPER = dict(calib_tokens=32768, n_search=1536 + 1024)
# H100 assumptions (stated in the output): effective FLOP/s for each kind of work. Each term of the
# CPU fit is scaled by (CPU rate of that kind of op, micro-benchmarked here) / (the H100 rate below).
H100 = {"forward": 300e12,   # bf16 GEMMs of the calibration forwards (990 TFLOP/s dense peak, ~30 %)
        "search": 40e12,     # float32 codes / grid search (67 TFLOP/s fp32 peak, ~60 %; no TF32)
        "dense_f64": 40e12,  # float64 matmuls of the decompositions (67 TFLOP/s FP64 tensor-core peak)
        "eigh": 2e12}        # float64 eigh (cuSOLVER syevd, n = 4–8k), counting 9·n³ flops per eigh
CPU_KIND = {"forward": "mm32", "search": "mm32", "dense_f64": "mm64", "eigh": "eigh64", "overhead": None}


def _worker(spec: dict) -> dict:
    """Runs in a subprocess: build the random model, compress it, report time and memory."""
    import resource

    import torch
    import transformers as tf

    torch.set_num_threads(1)
    from rana.accounting import layer_dims
    from rana.compress import CompressConfig, compress_model
    from rana.compress.memory import estimate_memory
    from types import SimpleNamespace

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=spec["hidden"], intermediate_size=spec["inter"], num_hidden_layers=spec["layers"],
                         num_attention_heads=spec["heads"], num_key_value_heads=spec["kv"], vocab_size=spec["vocab"],
                         max_position_embeddings=512, tie_word_embeddings=spec["vocab"] > 1000)
    model = tf.LlamaForCausalLM(cfg).eval()
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    config = CompressConfig(model=spec["name"], **{**RUN, **spec.get("run", {})})
    n_seq = config.calib_tokens // config.seq_len
    n_held = max(1, round(n_seq * config.heldout_fraction))
    ids = torch.randint(0, spec["vocab"], (n_seq, config.seq_len), generator=torch.Generator().manual_seed(1))
    calib = SimpleNamespace(fit=ids[: n_seq - n_held], heldout=ids[n_seq - n_held:])
    stamps = []
    import gc
    import ctypes

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the previous model's memory back to the OS
    rss_before = status("VmRSS")
    try:
        open("/proc/self/clear_refs", "w").write("5")  # peak-RSS mark := now
    except OSError:
        pass
    cpu0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    p0 = time.process_time()
    result = compress_model(model, None, config, calib,
                            progress=lambda what, i, n: stamps.append((time.perf_counter(), time.process_time())))
    wall = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    layer_times = np.diff([t0] + [w for w, _ in stamps]).tolist()
    layer_cpu = np.diff([p0] + [c for _, c in stamps]).tolist()
    est = estimate_memory(cfg, config, device="cpu")
    d = layer_dims(cfg)[0]
    return {
        **spec, "wall_s": wall, "cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "layer_wall_s": float(np.median(layer_times)), "layer_s": float(np.median(layer_cpu)),
        "layer_wall_times_s": layer_times, "layer_cpu_times_s": layer_cpu, "rss_before_bytes": rss_before, "peak_rss_bytes": status("VmHWM"),
        "model_bytes": model_bytes, "layer_bytes": 4 * (2 * d.q_out * d.hidden + 2 * d.kv_out * d.hidden + 3 * d.intermediate * d.hidden),
        "estimate_bytes": est.total, "estimate_parts": est.parts, "measured_flops": result.plan["measured_flops"],
        "calib_tokens": n_seq * config.seq_len, "n_search": config.fit_sample_tokens + config.search_tokens,
    }


FITTED = ("overhead", "forward", "search")
ANALYTIC = ("eigh", "dense_f64")


def _features(hidden, inter, heads, kv, calib_tokens, n_search) -> dict[str, float]:
    """The work of compressing one layer, by kind. Fitted terms are in units the fit scales;
    analytic terms are flop counts timed with the micro-benchmarked rates."""
    head_dim = hidden // heads
    qkv = hidden + 2 * kv * head_dim
    layer_macs = hidden * (qkv + hidden) + 3 * hidden * inter
    return {
        "overhead": 1.0,  # per-layer fixed cost (python, hooks, small ops)
        "forward": calib_tokens * layer_macs,  # capture/collect/run passes over all calibration tokens
        "search": n_search * hidden * (qkv + 2 * inter),  # codes + line / grid searches on sample tokens
        # 3 decompositions (stacked qkv, up, gate), each 2 float64 eigh of hidden × hidden (9 n³ flops)
        "eigh": 3 * 2 * 9 * hidden ** 3,
        # W L, (W L)ᵀ W L, W L V, QR, Uᵀ W: ~5 float64 o·i² products (10 o·i² flops) per decomposition
        "dense_f64": 10 * (qkv + 2 * inter) * hidden ** 2,
    }


def _row_features(r):
    return _features(r["hidden"], r["inter"], r["heads"], r["kv"], r["calib_tokens"],
                     r.get("n_search", RUN["fit_sample_tokens"] + RUN["search_tokens"]))


def fit(rows: list[dict], rates: dict[str, float]) -> dict:
    """Per-layer CPU time = analytic float64 decomposition time (flops / micro-benchmarked rate) +
    non-negative least squares of the rest on overhead, forward and search (relative errors)."""
    from scipy.optimize import nnls

    F = [_row_features(r) for r in rows]
    analytic = np.array([f["eigh"] / rates["eigh64"] + f["dense_f64"] / rates["mm64"] for f in F])
    X = np.array([[f[k] for k in FITTED] for f in F])
    y = np.array([r["layer_s"] for r in rows])
    w = 1 / y  # fit relative errors: small and large layers count alike
    coef, _ = nnls(X * w[:, None], (y - analytic) * w)
    pred = X @ coef + analytic
    rel = np.abs(pred - y) / y
    return {"terms": list(FITTED) + list(ANALYTIC), "seconds_per_unit": dict(zip(FITTED, coef.tolist())),
            "analytic_share": (analytic / y).tolist(), "rows": [r["name"] for r in rows],
            "relative_error": rel.tolist(), "median_relative_error": float(np.median(rel)),
            "max_relative_error": float(rel.max())}


def cpu_rates() -> dict[str, float]:
    """Single-thread FLOP/s of this CPU for the op kinds of the fit (best of 3)."""
    import torch

    torch.set_num_threads(1)

    def best(fn, flops):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return flops / min(times)

    a32, a64 = torch.randn(768, 768), torch.randn(768, 768, dtype=torch.float64)
    s64 = a64 @ a64.T
    return {"mm32": best(lambda: a32 @ a32, 2 * 768 ** 3), "mm64": best(lambda: a64 @ a64, 2 * 768 ** 3),
            "eigh64": best(lambda: torch.linalg.eigh(s64), 9 * 768 ** 3)}


def extrapolate(model_fit: dict, rates: dict[str, float]) -> dict:
    out = {}
    c = model_fit["seconds_per_unit"]
    for name, t in TARGETS.items():
        f = _features(t["hidden"], t["inter"], t["heads"], t["kv"], PAPER["calib_tokens"], PAPER["n_search"])
        cpu_layer = {k: c[k] * f[k] for k in FITTED}
        cpu_layer.update(eigh=f["eigh"] / rates["eigh64"], dense_f64=f["dense_f64"] / rates["mm64"])
        # the fixed per-layer overhead is assumed to stay as on the CPU (python and small ops)
        h100_layer = {k: cpu_layer[k] * (rates[CPU_KIND[k]] / H100[k] if CPU_KIND[k] else 1.0) for k in f}
        out[name] = {
            "shape": t,
            "cpu_1thread_per_layer_s": cpu_layer, "cpu_1thread_total_h": sum(cpu_layer.values()) * t["layers"] / 3600,
            "h100_per_layer_s": h100_layer, "h100_total_h": sum(h100_layer.values()) * t["layers"] / 3600,
        }
    return out


def memory_at_scale() -> dict:
    """rana.compress.memory.estimate_memory for the targets in bfloat16 on CUDA (defaults: 32k tokens, seq 512)."""
    import transformers as tf

    from rana.compress import CompressConfig
    from rana.compress.memory import estimate_memory, model_weight_bytes

    out = {}
    for name, t in TARGETS.items():
        cfg = tf.LlamaConfig(hidden_size=t["hidden"], intermediate_size=t["inter"], num_hidden_layers=t["layers"],
                             num_attention_heads=t["heads"], num_key_value_heads=t["kv"], vocab_size=t["vocab"])
        row = {"model_bf16_bytes": model_weight_bytes(cfg, "bfloat16")}
        for bs in (8, 2):
            c = CompressConfig(model=name, dtype="bfloat16", device="cuda", batch_size=bs, seq_len=512,
                               calib_tokens=PAPER["calib_tokens"])
            est = estimate_memory(cfg, c)
            row[f"gpu_batch{bs}"] = {"total_bytes": est.total, "parts": est.parts}
        row["host_hidden_states_bytes"] = 2 * PAPER["calib_tokens"] * t["hidden"] * 2
        out[name] = row
    return out


def _gb(x):
    return f"{x / 1e9:.2f}"


def write(rows, model_fit, extra, mem, path_json, path_md, elapsed):
    data = {"run_settings": RUN, "rows": rows, "fit": model_fit, "extrapolation": extra, "memory_at_scale": mem,
            "h100_assumptions": H100, "paper_scale_settings": PAPER, "benchmark_wall_s": elapsed,
            "machine": {"torch_threads": 1, "cpus": os.cpu_count(), "load_avg": os.getloadavg()}}
    path_json.write_text(json.dumps(data, indent=1, default=float) + "\n")
    L = ["# Compression scaling (CPU, random Llama-shaped models)", "",
         f"`python benchmarks/bench_scaling.py` — method `{RUN['method']}`, --flops {RUN['flops']}, "
         f"{RUN['calib_tokens']} calibration tokens (seq {RUN['seq_len']}, batch {RUN['batch_size']}), "
         f"{RUN['fit_sample_tokens']} threshold-sample + {RUN['search_tokens']} search tokens, grid step "
         f"{RUN['grid_step']}; float32; one torch thread on a shared 2-core machine (load average "
         f"{os.getloadavg()[0]:.1f}), each model in a fresh subprocess. Peak RSS is measured during compression "
         "(VmHWM reset at its start) and includes the interpreter, the model and its calibration state; "
         "'estimate' is `rana.compress.memory.estimate_memory` (CPU device, model in RAM).", "",
         "| model | hidden | inter | layers | vocab | params (M) | wall s | CPU s | CPU s / layer | RSS before MB | peak RSS MB | peak − before MB | estimate MB | measured FLOPs |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['name']} | {r['hidden']} | {r['inter']} | {r['layers']} | {r['vocab']} | {r['model_bytes'] / 4e6:.1f} | "
                 f"{r['wall_s']:.1f} | {r['cpu_s']:.1f} | {r['layer_s']:.2f} | {r['rss_before_bytes'] / 1e6:.0f} | "
                 f"{r['peak_rss_bytes'] / 1e6:.0f} | {(r['peak_rss_bytes'] - r['rss_before_bytes']) / 1e6:.0f} | "
                 f"{r['estimate_bytes'] / 1e6:.0f} | {r['measured_flops']:.3f} |")
    c = model_fit["seconds_per_unit"]
    rates = model_fit["cpu_rates_flops_per_s"]
    L += ["", "## Fit", "",
          "Per-layer CPU time (process time, so other jobs on the machine do not count) = overhead + a·forward + "
          "d·search + eigh/rate(eigh64) + dense_f64/rate(mm64), with forward = calibration tokens × layer MACs, "
          "search = (sample + search tokens) × hidden × (qkv_out + 2·inter) (codes, line and grid searches), and the "
          "float64 decompositions timed analytically from their flop counts (eigh = 3 decompositions × 2 eigh × "
          "9·hidden³, dense_f64 = 10·(qkv_out + 2·inter)·hidden²) at this CPU's micro-benchmarked rates: at these "
          "sizes they are too small a share to fit (they dominate at 70B). a, d and the overhead: non-negative least "
          f"squares on relative error over all rows; median relative error {model_fit['median_relative_error']:.0%}, "
          f"max {model_fit['max_relative_error']:.0%}.", "",
          "| term | seconds per unit | CPU op rate (1 thread, micro-benchmark) | assumed H100 rate | H100 / CPU |",
          "|---|---|---|---|---|"]
    for k in model_fit["terms"]:
        if CPU_KIND[k] is None:
            L.append(f"| {k} | {c[k]:.3e} s per layer | – | (kept as on CPU) | 1× |")
            continue
        r = rates[CPU_KIND[k]]
        coef = f"{c[k]:.3e}" if k in c else "analytic (flops / rate)"
        L.append(f"| {k} | {coef} | {CPU_KIND[k]} {r / 1e9:.1f} GFLOP/s | {H100[k] / 1e12:.0f} TFLOP/s | {H100[k] / r:.0f}× |")
    L += ["", "Layer count enters only as a multiplier: CPU s / layer is flat from 3 to 12 layers (h256, h256-l6, "
          "h256-l12) and peak − before grows only by the calibration state, since one layer is worked on at a time "
          "(the whole model is in RAM in these runs: streaming from disk, tests/test_offload.py, removes even that).", "",
          "## Extrapolation to Llama-2", "",
          f"Paper-scale settings: {PAPER['calib_tokens']} calibration tokens, {PAPER['n_search']} sample + search "
          "tokens (rana defaults). CPU: the fit above (one thread). H100: each fitted term scaled by the ratio of "
          "the assumed H100 rate to this CPU's rate for that kind of op (table above) — i.e. assuming compression "
          "work runs on the GPU at those effective rates; an assumption, not a measurement (no GPU here).", "",
          "| model | CPU 1 thread per layer s | CPU total h | H100 per layer s (overhead / forward / eigh / f64 matmul / search) | H100 total h |",
          "|---|---|---|---|---|"]
    for name, e in extra.items():
        h = e["h100_per_layer_s"]
        L.append(f"| {name} | {sum(e['cpu_1thread_per_layer_s'].values()):.0f} | {e['cpu_1thread_total_h']:.1f} | "
                 f"{sum(h.values()):.1f} ({h['overhead']:.1f} / {h['forward']:.1f} / {h['eigh']:.1f} / {h['dense_f64']:.1f} / {h['search']:.1f}) | "
                 f"{e['h100_total_h']:.2f} |")
    L += ["", "## Memory at scale (estimate, bfloat16, CUDA, seq 512)", "",
          "| model | weights (bf16) GB | GPU need, batch 8 GB | GPU need, batch 2 GB | largest parts (batch 8) | host: calibration hidden states GB |",
          "|---|---|---|---|---|---|"]
    for name, m in mem.items():
        parts = sorted(m["gpu_batch8"]["parts"].items(), key=lambda kv: -kv[1])[:4]
        L.append(f"| {name} | {_gb(m['model_bf16_bytes'])} | {_gb(m['gpu_batch8']['total_bytes'])} | "
                 f"{_gb(m['gpu_batch2']['total_bytes'])} | " + ", ".join(f"{k} {_gb(v)}" for k, v in parts) +
                 f" | {_gb(m['host_hidden_states_bytes'])} |")
    L += ["", f"Benchmark wall time {elapsed / 60:.1f} min in all (wall time here is 3–10× the CPU time: other "
          "jobs shared the 2 cores; the CPU s column and the fit use process CPU time)."]
    path_md.write_text("\n".join(L) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--worker")
    ap.add_argument("--reuse", help="scaling.json of an earlier run: keep its rows, run only the missing models")
    ap.add_argument("--out", default=str(RESULTS / "scaling"))
    args = ap.parse_args()
    if args.worker:  # one process for every model: one import, peak RSS mark reset per model
        for spec in json.loads(args.worker):
            print("RESULT " + json.dumps(_worker(spec), default=float), flush=True)
        return
    names = args.only or (QUICK if args.quick else ALL)
    t0 = time.perf_counter()
    rows = []
    earlier_s = 0.0
    if args.reuse:  # rows measured by an earlier run of this script (same worker code)
        prev = json.loads(Path(args.reuse).read_text())
        rows = [r for r in prev["rows"] if r["name"] in names]
        earlier_s = prev.get("benchmark_wall_s", 0.0)
        names = [n for n in names if n not in {r["name"] for r in rows}]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    base = {g[0]: dict(name=g[0], hidden=g[1], inter=g[2], layers=g[3], heads=g[4], kv=g[5], vocab=g[6]) for g in GRID}
    specs = [base[n] for n in names if n in base]
    specs += [dict(base[v["base"]], name=n, run={k: x for k, x in v.items() if k != "base"})
              for n, v in VARIANTS.items() if n in names]
    proc = subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(specs)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        if not line.startswith("RESULT "):
            continue
        rows.append(json.loads(line[7:]))
        r = rows[-1]
        print(f"{r['name']:>14}: wall {r['wall_s']:.1f}s cpu {r['cpu_s']:.1f}s layer cpu {r['layer_s']:.2f}s "
              f"peak {r['peak_rss_bytes'] / 1e6:.0f}MB (+{(r['peak_rss_bytes'] - r['rss_before_bytes']) / 1e6:.0f}) "
              f"est {r['estimate_bytes'] / 1e6:.0f}MB", flush=True)
    if proc.wait() != 0 and specs:
        raise SystemExit(f"worker failed:\n{proc.stderr.read()[-3000:]}")
    rates = cpu_rates()
    model_fit = fit(rows, rates)
    model_fit["cpu_rates_flops_per_s"] = rates
    extra = extrapolate(model_fit, rates)
    mem = memory_at_scale()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write(rows, model_fit, extra, mem, out.with_suffix(".json"), out.with_suffix(".md"), earlier_s + time.perf_counter() - t0)
    print(out.with_suffix(".md").read_text())


if __name__ == "__main__":
    main()
