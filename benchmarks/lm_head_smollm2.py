"""`--lm-head dense` vs `--lm-head sparse` on SmolLM2-135M at one budget: compress both with the
default method (calibration on pydoc_calib.txt), `rana eval` both and the dense model on three
held-out texts, and write benchmarks/results/lm_head_smollm2.{md,json}.

Runs the CLI commands it reports (each step skipped when its output exists in --work, so a
killed run resumes):

    python benchmarks/lm_head_smollm2.py --work /tmp/lm_head_runs [--flops 0.58] [--calib-tokens 16384]
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from _paths import RESULTS, data_dir

DATA = data_dir()
TEXTS = {"pydoc_heldout": DATA / "text" / "pydoc_heldout.txt", "shakespeare": DATA / "text" / "shakespeare.txt",
         "wikitext2_test": DATA / "eval" / "wikitext2_test.raw"}
CALIB = DATA / "text" / "pydoc_calib.txt"


def rana(*args: str) -> list[str]:
    return [str(Path(sys.executable).parent / "rana"), *args]


def run(cmd: list[str], log: Path) -> None:
    print("$", shlex.join(cmd), flush=True)
    with open(log, "w") as f:
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--flops", type=float, default=0.58)
    ap.add_argument("--calib-tokens", type=int, default=16384)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--out", type=Path, default=RESULTS / "lm_head_smollm2")
    a = ap.parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    ppl_args = [x for p in TEXTS.values() for x in ("--ppl-data", str(p))]
    commands, rows = [], []
    for mode in ("dense", "sparse"):
        folder = a.work / f"smol_head_{mode}"
        compress = rana("compress", "smollm2-135m", "--flops", str(a.flops), *(["--lm-head", "sparse"] if mode == "sparse" else []),
                        "--dataset", str(CALIB), "--calib-tokens", str(a.calib_tokens), "--out", str(folder))
        evaluate = rana("eval", str(folder), *ppl_args, "--eval-tokens", str(a.eval_tokens), "--json", f"{folder}.eval.json")
        if not (folder / "plan.json").is_file():
            run(compress, a.work / f"compress_{mode}.log")
        if not Path(f"{folder}.eval.json").is_file():
            run(evaluate, Path(f"{folder}.eval.log"))
        commands += [shlex.join(compress), shlex.join(evaluate)]
        rows.append((f"rana, --lm-head {mode}", folder, Path(f"{folder}.eval.json")))
    dense_json = a.work / "eval_dense_model.json"
    evaluate = rana("eval", "smollm2-135m", *ppl_args, "--eval-tokens", str(a.eval_tokens), "--json", str(dense_json))
    if not dense_json.is_file():
        run(evaluate, a.work / "eval_dense_model.log")
    commands.append(shlex.join(evaluate))
    rows.insert(0, ("dense", None, dense_json))

    table = []
    for label, folder, eval_json in rows:
        model = json.loads(eval_json.read_text())["models"][0]
        plan = json.loads((folder / "plan.json").read_text()) if folder else None
        budget = plan["budget"] if plan else {}
        table.append({
            "model": label,
            "target_flops": plan["target_flops"] if plan else 1.0,
            # plans written before `--lm-head` existed hold no budget summary: the head was dense
            "projections_fraction": budget.get("projections_fraction", plan["adapted_fraction"] if plan else 1.0),
            "lm_head_fraction": budget.get("lm_head_fraction", 1.0),
            "measured_flops": model["flops"]["fraction"],
            "measured_lm_head_fraction": model["flops"]["by_part"]["other"]["fraction_of_part"],
            "ppl": {k: model["ppl"][k]["ppl"] for k in TEXTS},
            "plan_measured_flops": plan["measured_flops"] if plan else None,
            "compress_wall_s": plan["wall_time_s"] if plan else None,
        })
    lines = ["| model | target F | projections keep | LM head keeps | measured F (eval) | LM head measured | "
             + " | ".join(f"ppl {k}" for k in TEXTS) + " |",
             "|---|---|---|---|---|---|" + "---|" * len(TEXTS)]
    for r in table:
        lines.append(f"| {r['model']} | {r['target_flops']:.2f} | {r['projections_fraction']:.3f} | {r['lm_head_fraction']:.3f} | "
                     f"{r['measured_flops']:.4f} | {r['measured_lm_head_fraction']:.3f} | "
                     + " | ".join(f"{r['ppl'][k]:.2f}" for k in TEXTS) + " |")
    md = "\n".join(lines) + "\n\nCommands:\n\n```\n" + "\n".join(commands) + "\n```\n"
    a.out.with_suffix(".md").write_text(md)
    a.out.with_suffix(".json").write_text(json.dumps({"rows": table, "commands": commands,
                                                      "calib_tokens": a.calib_tokens, "eval_tokens": a.eval_tokens},
                                                     indent=2) + "\n")
    print(md)


if __name__ == "__main__":
    main()
