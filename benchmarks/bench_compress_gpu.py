"""`rana compress` on one GPU at the defaults (32768 calibration tokens, seq 512, F = 0.58, bf16):
Llama-2-7B- and Llama-3-8B-shaped models, with and without `--offload-dir`.

    python benchmarks/bench_compress_gpu.py                        # both shapes, random weights
    python benchmarks/bench_compress_gpu.py --checkpoint DIR       # a real checkpoint folder instead
    python benchmarks/bench_compress_gpu.py --smoke                # tiny shapes, any device: checks the script
    python benchmarks/bench_compress_gpu.py --one-layer            # one Llama-2-7B-shaped layer: seconds per layer (~1 min)

Random weights are built on the GPU in the script (no download) and saved once as an ordinary
safetensors folder with a byte-level tokenizer, so both the in-RAM and the streamed (`--offload-dir`)
paths read a real checkpoint. Each compression runs in its own process: wall time per layer and
in total, peak GPU memory (`torch.cuda.max_memory_allocated`), peak host memory (the process's
peak RSS), the measured FLOP fraction. The per-layer time is fitted against the layer's
parameter count over the two shapes and extrapolated to Llama-2-70B (80 layers, hidden 8192,
intermediate 28672, 8 KV heads). Writes benchmarks/results/compress_gpu.{md,json}.

`--one-layer` times just the per-layer cost, in about a minute: a model of ONE decoder layer of the
Llama-2-7B shape (its vocabulary cut to ONE_LAYER_VOCAB tokens, so the embedding and a dense head
weigh nothing in the FLOP budget and every projection is compressed at F, as in the 32-layer model),
compressed in RAM at the defaults with the head kept dense (its calibration is a once-per-model
cost). Seconds per layer is compress()'s own wall time (the plan's `wall_time_s`: the layer's
calibration, search and fit, plus the embedding lookup); 32 × that estimates the whole 7B model.
Writes benchmarks/results/compress_gpu_layer.{md,json} (or --out STEM).

The report is rewritten after every compression (atomically: benchmarks/atomic_table.py), so a run
stopped at any moment keeps every row it measured; a compression that fails is a row with its error
(exit code 1), and the runs after it still go. `--time-budget S` (from the process start): a build or a
compression starts only if what the last one of its kind took per layer (PRIOR_SECONDS_PER_LAYER before
any) times its layers still fits, and each compression's process is given what is left; the run's first
compression always starts (an estimate is only a guess, and it is what the run is for).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_START = time.perf_counter()  # --time-budget counts from here: imports are part of the run
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "tests"))  # the offline byte tokenizer the tests use
sys.path.insert(0, str(ROOT / "benchmarks"))

from atomic_table import write_report  # noqa: E402
from helpers import byte_tokenizer  # noqa: E402

# (name, hidden, intermediate, layers, heads, kv heads, vocab)
SHAPES = {
    "llama2-7b-shape": (4096, 11008, 32, 32, 32, 32000),
    "llama3-8b-shape": (4096, 14336, 32, 32, 8, 128256),
}
SMOKE_SHAPES = {
    "tiny-a": (64, 176, 2, 4, 4, 300),
    "tiny-b": (64, 224, 2, 4, 2, 300),
}
LLAMA2_70B = (8192, 28672, 80, 64, 8, 32000)
SMOKE_CALIB = dict(calib_tokens=1024, seq_len=64, search_tokens=128, fit_sample_tokens=128)
ONE_LAYER_VOCAB = 512  # ≥ the byte tokenizer's 257 ids, a multiple of 64; see --one-layer above
TARGET_MINUTES_7B, TARGET_GPU_GB_7B, TARGET_MINUTES_70B = 10, 40, 60
# seconds per decoder layer before one like it was timed (never 0): building and saving random bf16 weights
# of a 7B-wide layer; compressing one (the 7B target, 10 minutes for 32 layers, is ~19 s a layer)
PRIOR_SECONDS_PER_LAYER = {"build": 1.0, "compress": 20.0}


def layer_params(hidden: int, inter: int, heads: int, kv: int) -> int:
    head_dim = hidden // heads
    return 2 * hidden * hidden + 2 * hidden * kv * head_dim + 3 * hidden * inter


def build_random(folder: Path, shape: tuple, device: str, dtype) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv, vocab = shape
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=4096, rope_theta=10000.0)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder, max_shard_size="4GB")
    byte_tokenizer().save_pretrained(folder)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


CHILD = r"""
import json, resource, sys, time
import torch
from rana.compress import CompressConfig, compress
cfg = CompressConfig(**json.loads(sys.argv[1]))
marks = []
def progress(stage, done, total):
    if stage == "layers":
        marks.append(time.perf_counter())
t0 = time.perf_counter()
result = compress(cfg, progress=progress)
wall = time.perf_counter() - t0
per_layer = [b - a for a, b in zip([t0] + marks[:-1], marks)]
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_available() and cfg.device.startswith("cuda") else 0
print("RESULT " + json.dumps({"wall_s": wall, "per_layer_s": per_layer, "peak_gpu_bytes": gpu,
                             "peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                             "measured_flops": result.plan["measured_flops"],
                             "in_process_s": result.plan["wall_time_s"]}))
"""


def run_one(folder: Path, config: dict, timeout: float | None = None) -> dict:
    """One compression in its own process: its RESULT, or {"error": why} when it failed or overran `timeout`."""
    try:
        res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(config)], capture_output=True, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"compression of {folder.name} killed at the time budget after {timeout:.0f} s"}
    lines = [l for l in res.stdout.splitlines() if l.startswith("RESULT ")]
    if res.returncode != 0 or not lines:
        return {"error": f"compression of {folder.name} failed (exit code {res.returncode}): "
                         + (res.stderr.strip().splitlines() or ["no output"])[-1][:300], "stderr": res.stderr[-4000:]}
    return json.loads(lines[-1][len("RESULT "):])


def fit_and_extrapolate(rows: list[dict]) -> dict | None:
    """Per-layer seconds ≈ a + b · layer parameters (least squares over the measured shapes,
    streamed runs excluded: they add disk reads the in-RAM runs do not have)."""
    pts = [(r["layer_params"], r["median_layer_s"]) for r in rows if not r["offload_dir"] and "error" not in r]
    if len({p for p, _ in pts}) < 2:
        return None
    n = len(pts)
    mx, my = sum(p for p, _ in pts) / n, sum(t for _, t in pts) / n
    b = sum((p - mx) * (t - my) for p, t in pts) / sum((p - mx) ** 2 for p, _ in pts)
    a = my - b * mx
    hidden, inter, layers, heads, kv, _ = LLAMA2_70B
    p70 = layer_params(hidden, inter, heads, kv)
    per_layer = a + b * p70
    return {"model": "seconds per layer = a + b * layer params", "a_s": a, "b_s_per_param": b,
            "llama2_70b_layer_params": p70, "llama2_70b_per_layer_s": per_layer,
            "llama2_70b_total_min": per_layer * layers / 60}


def _targets(args, work: Path) -> list[tuple[str, Path, tuple | None]]:
    """(name, checkpoint folder, shape to build there or None for a given checkpoint)."""
    if args.one_layer:
        name, shape = ("tiny-a", SMOKE_SHAPES["tiny-a"]) if args.smoke else ("llama2-7b-shape", SHAPES["llama2-7b-shape"])
        hidden, inter, _, heads, kv, vocab = shape
        return [(f"{name}-1-layer", work / f"{name}-1-layer", (hidden, inter, 1, heads, kv, min(vocab, ONE_LAYER_VOCAB)))]
    return [(Path(c).name, Path(c), None) for c in args.checkpoint] or \
           [(name, work / name, shape) for name, shape in (SMOKE_SHAPES if args.smoke else SHAPES).items()]


class Clock:
    """--time-budget: estimates per layer from what the last build / compression took, else the prior."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.per_layer: dict[str, float] = {}
        self.started = False  # whether a compression has started: the first always does

    def left(self) -> float | None:
        return None if self.seconds is None else self.seconds - (time.perf_counter() - _START)

    def fits(self, kinds: list[str], layers: int) -> bool:
        left = self.left()
        need = sum(self.per_layer.get(k, PRIOR_SECONDS_PER_LAYER[k]) for k in kinds) * layers
        return left is None or (left > 0 and (not self.started or need <= left))

    def record(self, kind: str, seconds: float, layers: int) -> None:
        self.per_layer[kind] = seconds / max(1, layers)


def _layers_of(folder: Path, shape: tuple | None) -> int:
    if shape is not None:
        return shape[2]
    return int(json.loads((folder / "config.json").read_text())["num_hidden_layers"])


def _measure(args, work: Path, device: str, dtype, save) -> dict:
    """Each target compressed in its own process: in RAM and streamed, or in RAM only with --one-layer.
    `save(state)` after every compression; what does not fit --time-budget is listed, not run."""
    calib = SMOKE_CALIB if args.smoke else {}
    state = {"rows": [], "skipped_for_time": [], "failures": []}
    clock = Clock(args.time_budget)
    for name, folder, shape in _targets(args, work):
        n_layers = _layers_of(folder, shape)
        offloads = (False,) if args.one_layer else (False, True)
        if shape is not None and not (folder / "config.json").exists():
            if not clock.fits(["build", "compress"], n_layers):
                state["skipped_for_time"] += [f"{name}{' --offload-dir' if o else ''}" for o in offloads]
                continue
            t0 = time.perf_counter()
            build_random(folder, shape, device, dtype)
            clock.record("build", time.perf_counter() - t0, n_layers)
            print(f"{name}: random checkpoint built in {time.perf_counter() - t0:.0f} s", flush=True)
        cfg = json.loads((folder / "config.json").read_text())
        params = layer_params(cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                              cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
        for offload in offloads:
            label = f"{name}{' --offload-dir' if offload else ''}"
            if not clock.fits(["compress"], n_layers):
                state["skipped_for_time"].append(label)
                continue
            config = dict(model=str(folder), flops=args.flops, dtype=args.dtype, device=device, **calib)
            if args.one_layer:
                config["lm_head"] = "dense"
            if offload:
                config["offload_dir"] = str(work / f"{name}-offload")
            clock.started = True
            t0 = time.perf_counter()
            left = clock.left()
            r = run_one(folder, config, timeout=None if left is None else max(1.0, left))
            clock.record("compress", time.perf_counter() - t0, n_layers)
            row = {"model": name, "offload_dir": offload, "layers": cfg["num_hidden_layers"],
                   "hidden": cfg["hidden_size"], "intermediate": cfg["intermediate_size"],
                   "kv_heads": cfg.get("num_key_value_heads"), "layer_params": params}
            if "error" in r:
                state["failures"].append(f"{label}: {r['error']}")
                row.update(r)
            else:
                per = sorted(r["per_layer_s"])
                # one layer: the first progress mark also covers loading; compress()'s own time does not
                row.update(median_layer_s=r["in_process_s"] if args.one_layer else per[len(per) // 2], **r)
            state["rows"].append(row)
            save(state)
            print(json.dumps({k: v for k, v in row.items() if k not in ("per_layer_s", "stderr")}), flush=True)
    return state


def _report(state: dict, fit: dict | None, meta: dict, one_layer: bool, complete: bool) -> str:
    rows = state["rows"]
    lines = ["| model | --offload-dir | layers | total (min) | median s/layer | peak GPU (GB) | peak host (GB) | measured F |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {'yes' if r['offload_dir'] else 'no'} | {r['layers']} | **FAILED**: "
                         f"{r['error'].replace('|', '/')} | | | | |")
            continue
        lines.append(f"| {r['model']} | {'yes' if r['offload_dir'] else 'no'} | {r['layers']} | {r['wall_s'] / 60:.2f} | "
                     f"{r['median_layer_s']:.2f} | {r['peak_gpu_bytes'] / 1e9:.1f} | {r['peak_host_bytes'] / 1e9:.1f} | "
                     f"{r['measured_flops']:.4f} |")
    title = "# `rana compress` on one GPU" + (f": one layer ({rows[0]['model']})" if one_layer and rows else "")
    text = [title, "", *lines, ""]
    if not complete:
        text += ["**PARTIAL report**: the run had not finished.", ""]
    measured = [r for r in rows if "error" not in r]
    if one_layer and measured:
        per = measured[0]["median_layer_s"]
        text.append(f"**{per:.1f} s per layer** (compress()'s own wall time for the 1-layer model, head dense, vocabulary "
                    f"{ONE_LAYER_VOCAB}); × 32 layers ≈ {per * 32 / 60:.1f} min for the whole 7B model, a linear "
                    f"extrapolation that leaves out loading and the head (target ≤ {TARGET_MINUTES_7B} min).")
    if fit:
        text.append(f"Llama-2-70B extrapolation ({fit['model']}, fitted on the in-RAM runs): "
                    f"{fit['llama2_70b_per_layer_s']:.1f} s/layer, {fit['llama2_70b_total_min']:.0f} min for 80 layers "
                    f"(target ≤ {TARGET_MINUTES_70B} min).")
    text += ["", f"Targets (Llama-2-7B shape): ≤ {TARGET_MINUTES_7B} min, ≤ {TARGET_GPU_GB_7B} GB peak GPU memory.", ""]
    text += [f"- {k}: {v}" for k, v in meta.items()]
    if state["skipped_for_time"]:
        text += ["", "Skipped for time: " + ", ".join(state["skipped_for_time"])]
    if state["failures"]:
        text += ["", "## FAILED", ""] + [f"- {f}" for f in state["failures"]]
    return "\n".join(text) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", action="append", default=[], help="real checkpoint folder(s) instead of random shapes")
    ap.add_argument("--flops", type=float, default=0.58)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default=None, help="default: cuda (cpu with --smoke and no GPU)")
    ap.add_argument("--work", default=None, help="folder for the random checkpoints and offload dirs (default: a temp dir)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: exercises the script anywhere")
    ap.add_argument("--one-layer", action="store_true",
                    help="a 1-layer model of the Llama-2-7B shape (tiny with --smoke): seconds per layer only")
    ap.add_argument("--results", default=str(RESULTS), help="where compress_gpu.{md,json} go")
    ap.add_argument("--out", default=None, help="output stem instead (default RESULTS/compress_gpu, "
                                                "RESULTS/compress_gpu_layer with --one-layer)")
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds for the whole run, from the process start (what would not fit is listed)")
    args = ap.parse_args(argv)
    if args.one_layer and args.checkpoint:
        ap.error("--one-layer builds its own model: no --checkpoint")

    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() or not args.smoke else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark measures GPU compression (use --smoke to check the script)")
    work = Path(args.work or tempfile.mkdtemp(prefix="rana-gpu-bench-"))
    meta = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "dtype": args.dtype, "flops": args.flops,
            "calibration": "defaults (32768 tokens of the bundled corpus, seq 512)" if not args.smoke else f"smoke: {SMOKE_CALIB}",
            "weights": "real checkpoint" if args.checkpoint else "random (built in the script)", "smoke": args.smoke,
            "time_budget_s": args.time_budget}
    out = Path(args.out) if args.out else Path(args.results) / ("compress_gpu_layer" if args.one_layer else "compress_gpu")

    def save(state: dict, complete: bool = False) -> str:
        fit = None if args.one_layer else fit_and_extrapolate(state["rows"])
        text = _report(state, fit, meta, args.one_layer, complete)
        write_report(out, {"meta": meta, **state, "fit": fit, "complete": complete,
                           "wall_s": time.perf_counter() - _START}, text)
        return text

    state = _measure(args, work, device, getattr(torch, args.dtype), save)
    print(save(state, complete=True))
    return 1 if state["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
