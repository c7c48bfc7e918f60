"""Methods × FLOP budgets on SmolLM2-135M: the paper's Fig. 1 (perplexity vs measured FLOPs).

    python benchmarks/sweep_smollm2.py [--methods dense,rana,rana-paper,teal,cats,svd,wina,wina-ortho,rsparse,larosa]
        [--flops 0.85,0.70,0.58,0.50] [--calib-tokens 32768] [--eval-tokens 32768] [--out DIR]

Compresses smollm2-135m with every method at every budget, calibrating on pydoc_calib.txt (the
model is loaded once and deep-copied per point; the calibration windows are drawn once and shared),
and measures each point on pydoc_heldout.txt, shakespeare.txt and WikiText-2 test: perplexity with
the standard protocol (non-overlapping 512-token windows, tail dropped) on the first `--eval-tokens`
tokens of each text, and the FLOPs the masks actually take on those same tokens.

Writes benchmarks/results/sweep_smollm2/: results.json, results.md, points/ (one JSON + plan per
point; re-running resumes, skipping finished points) and the figures (ppl_vs_flops.png,
layer_errors.png, rank_contributions.png; layer_budget.png when plans vary by layer).
CPU-heavy: expect minutes per point at the defaults; cut --calib-tokens / --eval-tokens to go faster.
"""
from __future__ import annotations

import argparse

import platform
import sys
import time
from pathlib import Path

import torch
from _paths import data_dir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rana.sweep import SweepConfig, run_sweep  # noqa: E402

SHARED = data_dir()
CALIB = SHARED / "text" / "pydoc_calib.txt"
EVAL_TEXTS = [SHARED / "text" / "pydoc_heldout.txt", SHARED / "text" / "shakespeare.txt", SHARED / "eval" / "wikitext2_test.raw"]
OUT = ROOT / "benchmarks" / "results" / "sweep_smollm2"

def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--methods", default="dense,rana,rana-paper,teal,cats,svd,wina,wina-ortho,rsparse,larosa")
    ap.add_argument("--flops", default="0.85,0.70,0.58,0.50")
    ap.add_argument("--calib-tokens", type=int, default=32768)
    ap.add_argument("--eval-tokens", type=int, default=32768, help="tokens scored per evaluation text (first N)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--figure-flops", type=float, default=None, help="budget for the per-layer figures (default: smallest)")
    ap.add_argument("--allocation", default="uniform", choices=["uniform", "global"],
                    help="FLOP allocation across layers (global: by measured sensitivity; use another --out)")
    ap.add_argument("--lm-head", default="auto", choices=["auto", "dense", "sparse"],
                    help="auto: each method's own (rana: sparse); dense/sparse for every method (use another --out)")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    missing = [str(p) for p in [CALIB, *EVAL_TEXTS] if not p.is_file()]
    if missing:
        sys.exit(f"missing data: {', '.join(missing)} (set RANA_SHARED_DATA to the folder holding text/ and eval/)")
    config = SweepConfig(model=args.model, out=args.out, ppl_data=[str(p) for p in EVAL_TEXTS],
                         methods=args.methods.split(","), flops=[float(f) for f in args.flops.split(",")],
                         dense="dense" in args.methods.split(","), dataset=str(CALIB), calib_tokens=args.calib_tokens,
                         seq_len=args.seq_len, eval_tokens=args.eval_tokens, figure_flops=args.figure_flops,
                         allocation=args.allocation, lm_head=args.lm_head, device=args.device)
    from rana.cli.common import LazyProgress, console, print_wide, setup_environment
    from rana.cli.sweep_cmd import results_table

    setup_environment()
    console.print(f"sweep {args.model}: methods {config.methods}{' + dense' if config.dense else ''}, budgets {config.flops}, "
                  f"{args.calib_tokens} calibration tokens, {args.eval_tokens} eval tokens per text, "
                  f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, device {args.device}",
                  highlight=False)
    t0 = time.perf_counter()
    with LazyProgress("sweep") as progress:
        results = run_sweep(config, progress=progress, log=lambda m: console.print(m, highlight=False))
    print_wide(console, results_table(results))
    console.print(f"protocol: {results['protocol']}", highlight=False)
    console.print(f"wrote {args.out}/results.md, results.json, points/ and figures in {time.perf_counter() - t0:.0f}s",
                  highlight=False)
    return results

if __name__ == "__main__":
    main()
