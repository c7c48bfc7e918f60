"""An int8 sparse folder against torch's dynamic int8 dense model and the weightless floor, batch-1 CPU decode.

    python benchmarks/bench_int8_vs_torch.py --model qwen2.5-coder-1.5b --folder DIR_INT8 [--threads 1,2]

For a model too big for the whole of bench_int8.py's table (which compresses, quantizes and times every
variant at three F): only the three rows that decide issue 28's "≤ 0.6 of dense int8" target, timed by
bench_int8's own harness (eager `generate`, interleaved, the order rotating each round):

- dense int8 (torch dynamic): `--model` through torch.ao's quantize_dynamic (bench_int8.torch_int8_dense);
- the int8 sparse folder (`rana quantize DIR --weights int8` of a compressed folder);
- the floor: that folder with every linear returning zeros (bench_int8.weightless).

Writes STEM.json and STEM.md (default benchmarks/results/int8_vs_torch_<model>).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_int8 as b  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the dense model: alias, folder or .gguf")
    ap.add_argument("--folder", required=True, help="an int8 sparse rana folder of that model")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="output stem")
    a = ap.parse_args(argv)
    a.threads_list = [int(t) for t in a.threads.split(",")]
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    b.offline_and_quiet()
    from rana.io import load
    from rana.io.models import load_model

    folder = Path(a.folder)
    plan = json.loads((folder / "plan.json").read_text())
    dense, tok, _ = load_model(a.model)
    torch_int8 = b.torch_int8_dense(dense.eval())
    del dense
    gc.collect()
    sparse, _ = load(folder)
    name = f"rana int8 {folder.name} (F={plan.get('measured_flops', float('nan')):.3f})"
    models = {b.TORCH_INT8: torch_int8, name: sparse.eval(), b.FLOOR: b.weightless(folder)}
    macs = (plan.get("measured") or {}).get("measured_macs")
    result = {"model": a.model, "folder": str(folder), "measured_flops": plan.get("measured_flops"),
              "kept_mb_per_token": macs / 1e6 if macs else None, "command": " ".join(sys.argv), "latency": []}
    for t in a.threads_list:
        lat = b.time_interleaved(models, tok, a, t, None)
        rows = lat["rows"]
        if macs:
            lat["headroom"] = b.headroom(*(rows[n]["ms_per_token"] for n in (b.FLOOR, b.TORCH_INT8, name)), macs)
        result["latency"].append(lat)
    stem = Path(a.out) if a.out else b.RESULTS / f"int8_vs_torch_{Path(a.model).name.replace('.', 'p').lower()}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
    lines = [f"# {a.model}: int8 sparse vs torch's dynamic int8 (batch-1 CPU decode, eager generate)", "",
             f"Folder `{folder}`, measured F {result['measured_flops']}, kept int8 MB per token "
             f"{b._f(result['kept_mb_per_token'], '.1f')}. Command: `{result['command']}`", "",
             "| threads | variant | ms/token | × dense int8 |", "|---|---|---|---|"]
    for lat in result["latency"]:
        for n, r in lat["rows"].items():
            lines.append(f"| {lat['threads']} | {n} | {r['ms_per_token']:.2f} | {r['vs_dense_int8']:.3f} |")
    lines += ["", "| threads | budget ms (0.6 × dense int8 − floor) | read rate it needs | rana's read rate above the floor |",
              "|---|---|---|---|"]
    for lat in result["latency"]:
        h = lat.get("headroom")  # none where plan.json has no measured MACs
        if h:
            lines.append(f"| {lat['threads']} | {h['budget_ms']:.2f} | {b._f(h['needed_gb_s'], '.1f')} GB/s | "
                         f"{b._f(h['rana_gb_s'], '.1f')} GB/s |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
