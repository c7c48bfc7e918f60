"""`rana compress` of a real model (default SmolLM2-135M) at F = 0.85 / 0.70 / 0.58: wall time, peak
memory, measured FLOPs, held-out perplexity vs dense (no fine-tuning), and with --latency the batch-1
CPU decode time against dense (the harness of `rana eval --latency`, interleaved in one process).
Each compression runs as its own `rana compress` process so its peak resident memory is its own.

    python benchmarks/bench_compress.py [--model smollm2-135m] [--flops 0.85,0.7,0.58] [--method rana]
    python benchmarks/bench_compress.py --model qwen2.5-coder-1.5b --flops 0.7,0.58 --latency   # make models first

Writes benchmarks/results/compress_<model>.{md,json} (SmolLM2: compress_smollm2). Calibration:
pydoc_calib.txt; measured on pydoc_heldout.txt and shakespeare.txt (never calibrated on).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _paths import data_dir

ROOT = Path(__file__).resolve().parents[1]
DATA = data_dir() / "text"
RESULTS = ROOT / "benchmarks" / "results"

CHILD = r"""
import resource, sys, runpy
sys.argv = ["rana"] + sys.argv[1:]
try:
    from rana.cli.app import main
    main()
except SystemExit as e:
    code = e.code or 0
else:
    code = 0
print("PEAK_RSS_KB", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)
sys.exit(code)
"""


def run_compress(model: str, flops: float, method: str, out: Path, extra: list[str], reuse: bool) -> dict:
    """Compress into `out` in a child process; its costs are kept beside the folder so --reuse can time
    decoding later (on a quiet machine) without compressing again."""
    record = out.with_name(out.name + ".cost.json")
    if reuse and reusable(out):
        return json.loads(record.read_text())
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_start = os.getloadavg()[0]
    cmd = [sys.executable, "-c", CHILD, "compress", model, "--flops", str(flops), "--method", method,
           "--dataset", str(DATA / "pydoc_calib.txt"), "--out", str(out), "--overwrite", *extra]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"compress failed:\n{res.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak_kb = int(next(l for l in res.stderr.splitlines() if l.startswith("PEAK_RSS_KB")).split()[1])
    # CPU seconds barely move when other jobs share the machine; wall seconds do (see the load averages)
    cost = {"wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "peak_rss_gb": peak_kb / 1e6, "load_avg_start": load_start, "load_avg_end": os.getloadavg()[0]}
    record.write_text(json.dumps(cost))
    return cost


def reusable(out: Path) -> bool:
    """A finished compression with its recorded costs: --reuse times it again without compressing."""
    return out.with_name(out.name + ".cost.json").exists() and (out / "plan.json").exists()


def _latency(model, dense, tok, new_tokens: int) -> dict:
    """Batch-1 greedy decoding, compressed and dense interleaved in one process (eager: the CPU default)."""
    from rana.evaluation import measure_latency

    r = measure_latency(model, tok, dense, new_tokens=new_tokens, repeats=3, warmup=1)
    return {"decode_latency_ratio": r["decode_latency_ratio"], "decode_path": r["decode_path"]}


def write_results(args, rows: list[dict], load_avg: float, slug: str) -> None:
    """The table and JSON so far: written after every row, so a long run that is stopped keeps its rows."""
    meta = {"model": args.model + (" (SmolLM2-135M-Instruct Q4_1 GGUF, dequantised to fp32)"
                                   if args.model == "smollm2-135m" else ""),
            "calibration": "pydoc_calib.txt, 32768 tokens (default), seq 512",
            "eval": f"first {args.eval_tokens} tokens of each text, non-overlapping 512-token windows",
            "machine": f"{os.cpu_count()} CPU cores; 1-min load average at start {load_avg:.1f}; each row "
                       "records the load average around its compression and its decode timing (above 2 means "
                       "other jobs shared the machine: wall times are then upper bounds, CPU seconds hold)",
            "extra_args": args.extra}
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"compress_{slug}{args.tag}"
    rows = sorted(rows, key=lambda r: (r["method"] != "dense", r["method"], -r["target"]))
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["| method | target F | measured F | wall (s) | CPU (s) | peak RSS (GB) | ppl pydoc_heldout "
             "| ppl shakespeare | decode time / dense |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['target']:.2f} | {r['measured_flops']:.4f} | "
                     f"{r.get('wall_s', float('nan')):.0f} | {r.get('cpu_s', float('nan')):.0f} | "
                     f"{r.get('peak_rss_gb', float('nan')):.2f} | "
                     f"{r['ppl_pydoc_heldout']:.2f} | {r['ppl_shakespeare']:.2f} | "
                     f"{r.get('decode_latency_ratio', float('nan')):.3f} |")
    notes = [f"- {r['method']} F = {r['target']:.2f}: {r['note']}" for r in rows if r.get("note")]  # added by hand
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in meta.items())
                                      + "\n" + "".join(n + "\n" for n in notes))


def previous_rows(path: Path, args) -> list[dict]:
    """Rows of an earlier run of the same table, when it measured the same model on the same tokens."""
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    same_eval = earlier["meta"].get("eval", "").startswith(f"first {args.eval_tokens} tokens")
    return earlier["rows"] if same_eval else []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m", help="alias, folder or .gguf (default smollm2-135m)")
    ap.add_argument("--flops", default="0.85,0.7,0.58")
    ap.add_argument("--latency", action="store_true", help="also time batch-1 CPU decoding against dense")
    ap.add_argument("--latency-tokens", type=int, default=32)
    ap.add_argument("--method", default="rana")
    ap.add_argument("--eval-tokens", type=int, default=32768)
    ap.add_argument("--work", default=None, help="folder for compressed models (default: a temp dir)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--reuse", action="store_true",
                    help="keep folders (and their recorded costs) already in --work instead of compressing again")
    ap.add_argument("extra", nargs="*", help="extra `rana compress` options, after --")
    args = ap.parse_args()

    import torch

    from rana.data import load_texts, tokenize_stream
    from rana.evaluation.perplexity import perplexity
    from rana.io import load
    from rana.io.models import load_model

    work = Path(args.work or tempfile.mkdtemp(prefix="rana-bench-"))
    slug = "smollm2" if args.model == "smollm2-135m" else Path(args.model).name.replace(".", "p").lower()
    # --reuse also keeps the rows already in this table (same model, same eval tokens): perplexity is
    # deterministic, so a later run on a quiet machine only has to time decoding again
    kept = previous_rows(RESULTS / f"compress_{slug}{args.tag}.json", args) if args.reuse else []
    dense, tok, _ = load_model(args.model)
    texts = {name: tokenize_stream(load_texts(str(DATA / f"{name}.txt")), tok)[: args.eval_tokens]
             for name in ("pydoc_heldout", "shakespeare")}
    dense_row = next((r for r in kept if r["method"] == "dense"), None)
    rows = [dense_row or {"method": "dense", "target": 1.0, "measured_flops": 1.0,
                          **{f"ppl_{k}": perplexity(dense, v, progress=False)["ppl"] for k, v in texts.items()}}]
    del dense  # a 1.5B model twice (dense + the compress child) would not fit 24 GB; reloaded for latency
    load_avg = os.getloadavg()[0]
    flops = [float(x) for x in args.flops.split(",")]
    rows += [r for r in kept if r["method"] != "dense" and (r["method"], r["target"]) not in
             {(args.method, f) for f in flops}]
    dense = None  # the latency reference, kept across rows that compress nothing (reused folders)
    for f in flops:
        out = work / f"{slug}_{args.method}_{round(f * 100)}"
        if not (args.reuse and reusable(out)):
            dense = None  # a 1.5B model twice (dense + the compress child) would not fit 24 GB
        cost = run_compress(args.model, f, args.method, out, args.extra, args.reuse)
        plan = json.loads((out / "plan.json").read_text())
        model, _ = load(out)
        old = next((r for r in kept if (r["method"], r["target"]) == (args.method, f)
                    and r.get("measured_flops") == plan["measured_flops"]), None)
        if old is not None:
            ppl = {k: v for k, v in old.items() if k.startswith("ppl_")}
        else:
            with torch.no_grad():
                ppl = {f"ppl_{k}": perplexity(model, v, progress=False)["ppl"] for k, v in texts.items()}
        speed = {}
        if args.latency:
            dense = dense if dense is not None else load_model(args.model)[0]
            speed = _latency(model, dense, tok, args.latency_tokens)
            speed["latency_load_avg"] = os.getloadavg()[0]
        rows.append({"method": args.method, "target": f, "measured_flops": plan["measured_flops"], **cost,
                     "compress_s_in_process": plan["wall_time_s"], **ppl, **speed})
        print(rows[-1], flush=True)
        write_results(args, rows, load_avg, slug)
        del model
    write_results(args, rows, load_avg, slug)
    print(RESULTS.joinpath(f"compress_{slug}{args.tag}.md").read_text())


if __name__ == "__main__":
    main()
