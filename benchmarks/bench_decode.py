"""End-to-end batch-1 greedy decoding: compressed SmolLM2 vs dense, as ratios measured in one run.

    python benchmarks/bench_decode.py                          # compress at F = 0.85 / 0.70 / 0.58, CPU (+ GPU)
    python benchmarks/bench_decode.py --from 0.70=DIR ...      # reuse rana folders instead of compressing
    python benchmarks/bench_decode.py --save-dir DIR           # keep the compressed folders (DIR/smollm2_f070)
    python benchmarks/bench_decode.py --save-dir DIR --compress-only   # compress now, time later
    python benchmarks/bench_decode.py --quick                  # fewer tokens / repeats (smoke run)

Writes benchmarks/results/decode_cpu.{md,json} (and decode_gpu.{md,json} when CUDA is available).

Two measurements per budget F, both *ratios to the dense model timed interleaved in the same run*:

1. end to end: `rana.evaluation.latency_ratio` — median seconds per generated token of batch-1 greedy
   `generate` (KV cache, fixed length), compressed / dense; also with prefill subtracted (decode only).
2. per adapted unit of every layer (q/k/v with their shared rank code, o, gate, up, down): on CPU
   the unit's modules are timed inside real greedy decoding (weights streamed from memory as in
   use), compressed vs dense generations alternating; on GPU on single-token inputs captured
   during a real decode. Next to it the unit's measured FLOP fraction f on the decoded tokens
   (MacMeter). Decoding is memory bound, so the limit of an adapted unit's speedup is about 1/f
   (docs/method.md §5); "efficiency" is achieved speedup / (1/f).

`--threads N` (CPU, default 1) writes decode_cpu_Nthreads.{md,json} when N > 1.

`--harness compiled` times both models the way transformers' fast path decodes: `generate` with a
fresh StaticCache per run and the single-token decode step compiled (`torch.compile(fullgraph=True)`,
inductor; the masked modules run as the rana torch.library ops, q/k/v and gate/up as grouped calls).
Dense is compiled and timed the same way, interleaved. End to end only (a wall clock around each
module cannot sit inside a compiled graph); the first (compiling) run of each model is timed and
reported. Writes decode_cpu_compiled[_Nthreads].{md,json}.

    python benchmarks/bench_decode.py --harness compiled --from 0.70=DIR 0.58=DIR --new-tokens 32

`--profile` adds the top torch ops of one decode step of the dense and the most compressed model.
"""
from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from _paths import text_file

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATASET = str(text_file("pydoc_calib.txt"))
FLOPS = (0.85, 0.70, 0.58)
MODEL = "smollm2-135m"


# ------------------------------------------------------------------------------------ models
def compressed_models(args, dense_config) -> dict[float, tuple[torch.nn.Module, dict]]:
    """{F: (model, plan)}: rana folders from --from / --save-dir, else compressed now."""
    from rana import io as rio
    from rana.compress import CompressConfig, compress

    given = {}
    for item in args.from_dirs or []:
        f, _, d = item.partition("=")
        given[float(f)] = Path(d)
    out = {}
    for f in args.flops:
        folder = given.get(f)
        if folder is None and args.save_dir and rio.is_rana_dir(Path(args.save_dir) / _folder_name(f)):
            folder = Path(args.save_dir) / _folder_name(f)
        if folder is not None:
            model, _ = rio.load(folder)
            plan_file = folder / "plan.json"
            plan = json.loads(plan_file.read_text()) if plan_file.is_file() else {}
            print(f"F={f}: loaded {folder}", flush=True)
        else:
            t0 = time.perf_counter()
            config = CompressConfig(model=MODEL, flops=f, dataset=args.dataset, calib_tokens=args.calib_tokens)
            result = compress(config)
            model, plan = result.model, result.plan
            print(f"F={f}: compressed in {time.perf_counter() - t0:.0f}s, measured {plan['measured_flops']:.4f}", flush=True)
            if args.save_dir:
                rio.save(model, result.tokenizer, Path(args.save_dir) / _folder_name(f), plan=plan, overwrite=True,
                         offloaded=result.offloaded, extra={"method": config.method, "compress_config": config.to_dict()})
        out[f] = (model.eval(), plan)
    return out


def _folder_name(f: float) -> str:
    return f"smollm2_f{round(f * 100):03d}"


# ------------------------------------------------------------------------------------ per-unit timing
UNIT_ORDER = ["qkv", "o", "gate", "up", "gate_up", "down"]


def _units(model) -> list[dict]:
    """Adapted units of every layer: {layer, name, paths (modules called with the same input), meters}.

    qkv is one unit (its three projections share their input): a shared rank code + slices, or
    per-projection adapters; o, gate, up (or a fused gate_up) and down are units of their own. A
    unit counts when at least one of its modules is adapted; dense members cost the same in both."""
    from rana.archs import decoder_layers, get_arch
    from rana.modules import MacMeter, RankSliceLinear

    spec = get_arch(model.config)
    units = []
    for i, layer in enumerate(decoder_layers(model, spec)):
        prefix = f"{spec.layers}.{i}"
        groups = {
            "qkv": [f"{spec.attn}.{p}" for p in ((spec.qkv_fused,) if spec.qkv_fused else (spec.q, spec.k, spec.v))],
            "o": [f"{spec.attn}.{spec.o}"],
            "gate_up": [f"{spec.mlp}.{spec.gate_up_fused}"] if spec.gate_up_fused else [],
            "gate": [f"{spec.mlp}.{spec.gate}"] if spec.gate and not spec.gate_up_fused else [],
            "up": [f"{spec.mlp}.{spec.up}"] if spec.up and not spec.gate_up_fused else [],
            "down": [f"{spec.mlp}.{spec.down}"],
        }
        for name, paths in groups.items():
            if not paths:
                continue
            mods = [layer.get_submodule(p) for p in paths]
            meters, dense_macs = [], 0.0
            for m in mods:
                if isinstance(m, RankSliceLinear):
                    code = m._code()
                    if code not in meters:
                        meters.append(code)
                elif isinstance(m, MacMeter):
                    meters.append(m)
                elif isinstance(m, torch.nn.Linear):
                    dense_macs += m.in_features * m.out_features
            if meters:
                units.append({"layer": i, "name": name, "paths": [f"{prefix}.{p}" for p in paths], "meters": meters,
                              "dense_member_macs": dense_macs})
    return units


@torch.no_grad()
def capture_decode_inputs(model, ids: torch.Tensor, units: list[dict], steps: int) -> dict[str, list[torch.Tensor]]:
    """Single-token inputs of every unit's first module during `steps` greedy decode steps."""
    captured = {u["paths"][0]: [] for u in units}
    hooks = []
    for path in captured:
        def hook(_m, args, store=captured[path]):
            x = args[0]
            if x.numel() == x.shape[-1]:
                store.append(x.detach().clone())
        hooks.append(model.get_submodule(path).register_forward_pre_hook(hook))
    try:
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                       do_sample=False, pad_token_id=0)
    finally:
        for h in hooks:
            h.remove()
    return captured


def _timer_us(fn, device, min_run_time: float) -> float:
    from torch.utils import benchmark

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    m = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads()).blocked_autorange(
        min_run_time=min_run_time)
    return m.median * 1e6


@torch.no_grad()
def unit_timings(model, dense, inputs: dict, units: list[dict], device, min_run_time: float, rounds: int) -> list[dict]:
    """Per unit: compressed and dense µs per token (same inputs, interleaved rounds) and FLOP fraction."""
    rows = []
    for u in units:
        xs = inputs[u["paths"][0]]
        if not xs:
            continue
        mods = [model.get_submodule(p) for p in u["paths"]]
        dense_mods = [dense.get_submodule(p) for p in u["paths"]]
        for meter in u["meters"]:  # FLOP fraction on exactly these inputs
            meter.reset_meter()
            meter.meter_on = True
        for x in xs:
            for m in mods:
                m(x)
        macs = sum(m.measured_macs() for m in u["meters"]) + u["dense_member_macs"]
        dense_macs = sum(m.macs_dense for m in u["meters"]) + u["dense_member_macs"]
        for meter in u["meters"]:
            meter.meter_on = False

        def run(ms):
            def fn():
                for x in xs:
                    for m in ms:
                        m(x)
            return fn

        comp_t, dense_t = [], []
        for _ in range(rounds):
            comp_t.append(_timer_us(run(mods), device, min_run_time) / len(xs))
            dense_t.append(_timer_us(run(dense_mods), device, min_run_time) / len(xs))
        f = macs / dense_macs
        speedup = statistics.median(dense_t) / statistics.median(comp_t)
        rows.append({"layer": u["layer"], "unit": u["name"], "flop_fraction": f, "us": statistics.median(comp_t),
                     "dense_us": statistics.median(dense_t), "speedup": speedup, "ideal_speedup": 1.0 / f,
                     "efficiency": speedup * f})
    return rows


def _flop_fractions(model, ids, units, steps) -> dict[tuple, float]:
    """Each unit's measured FLOP fraction over `steps` greedy decode steps (MacMeter, one-token calls)."""
    for u in units:
        for meter in u["meters"]:
            meter.reset_meter()
            meter.meter_on = True
    try:
        _generate(model, ids, steps)
    finally:
        for u in units:
            for meter in u["meters"]:
                meter.meter_on = False
    out = {}
    for u in units:
        macs = sum(m.measured_macs() for m in u["meters"]) + u["dense_member_macs"]
        out[(u["layer"], u["name"])] = macs / (sum(m.macs_dense for m in u["meters"]) + u["dense_member_macs"])
    return out


def _generate(model, ids, steps):
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
                   do_sample=False, pad_token_id=0)


@torch.no_grad()
def unit_timings_in_decode(model, dense, ids, units: list[dict], steps: int, rounds: int) -> list[dict]:
    """Per unit (CPU): µs per token of its modules *inside* real greedy decoding, compressed vs dense.

    Timing a module in a loop over a few captured inputs keeps its weights in cache, which
    decoding never does (a 135M fp32 model streams ~0.5 GB per token); here each unit's member
    modules are timed with a wall clock around every one-token call while the whole model decodes,
    so weights come from memory exactly as in use. Compressed and dense generations alternate
    `rounds` times; the median per unit is kept. The FLOP fraction f comes from a separate metered
    generation (metering switches the modules to their torch formula)."""
    fractions = _flop_fractions(model, ids, units, steps)
    keys = [(u["layer"], u["name"]) for u in units]

    def instrument(net):
        acc, patched = {k: [0.0, 0] for k in keys}, []
        for u in units:
            slot = acc[(u["layer"], u["name"])]
            for path in u["paths"]:
                mod = net.get_submodule(path)
                inner = mod.forward
                patched.append((mod, mod.__dict__.get("forward")))

                def timed(*a, _inner=inner, _slot=slot, **k):
                    x = a[0] if a else next(iter(k.values()))
                    if x.numel() != x.shape[-1]:
                        return _inner(*a, **k)
                    t0 = time.perf_counter()
                    y = _inner(*a, **k)
                    _slot[0] += time.perf_counter() - t0
                    return y

                mod.forward = timed
        return acc, patched

    per_round = {k: {"ours": [], "dense": []} for k in keys}
    for _ in range(rounds):
        for label, net in (("ours", model), ("dense", dense)):
            acc, patched = instrument(net)
            try:
                _generate(net, ids, steps)
            finally:
                for mod, own in reversed(patched):
                    if own is None:
                        del mod.forward  # back to the class method
                    else:
                        mod.forward = own
            for k in keys:
                per_round[k][label].append(acc[k][0] / steps * 1e6)
    rows = []
    for (layer, name) in keys:
        us, dense_us = statistics.median(per_round[(layer, name)]["ours"]), statistics.median(per_round[(layer, name)]["dense"])
        f = fractions[(layer, name)]
        speedup = dense_us / us
        rows.append({"layer": layer, "unit": name, "flop_fraction": f, "us": us, "dense_us": dense_us,
                     "speedup": speedup, "ideal_speedup": 1.0 / f, "efficiency": speedup * f})
    return rows


# ------------------------------------------------------------------------------------ profiling
@torch.no_grad()
def profile_step(model, ids: torch.Tensor, top: int = 12) -> list[dict]:
    """Self CPU time per op of 8 decode steps (prefill excluded), heaviest first."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from rana.kernels import cpu_gemv
    from rana.modules.operands import drop_operands

    out = model(ids, use_cache=True)
    past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    loader = cpu_gemv._load
    lib, status = loader()
    if lib is not None:  # the C call is no torch op: name it for the profiler

        def named(entry):
            def call(*a):
                with record_function("rana::native_masked_gemv (C)"):
                    return entry(*a)
            return call

        cpu_gemv._load = lambda: (lib._replace(masked_f32=named(lib.masked_f32), masked_i8=named(lib.masked_i8)),
                                  status)
        for m in model.modules():
            drop_operands(m)  # their calls were bound to the unnamed entry point
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for step in range(8):
                mask = torch.ones(1, ids.shape[1] + step + 1, dtype=torch.long)
                out = model(nxt, past_key_values=past, attention_mask=mask, use_cache=True)
                past, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    finally:
        cpu_gemv._load = loader
        for m in model.modules():
            drop_operands(m)
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [{"op": e.key, "calls_per_token": e.count / 8, "self_us_per_token": e.self_cpu_time_total / 8,
             "share": e.self_cpu_time_total / total} for e in events[:top]] + [
        {"op": "TOTAL", "calls_per_token": sum(e.count for e in events) / 8, "self_us_per_token": total / 8, "share": 1.0}]


# ------------------------------------------------------------------------------------ report
def summarize_units(rows: list[dict]) -> dict:
    by_unit = {}
    for name in sorted({r["unit"] for r in rows}, key=UNIT_ORDER.index):
        rs = [r for r in rows if r["unit"] == name]
        by_unit[name] = {
            "flop_fraction": statistics.mean(r["flop_fraction"] for r in rs),
            "us": sum(r["us"] for r in rs) / len(rs), "dense_us": sum(r["dense_us"] for r in rs) / len(rs),
            "speedup": sum(r["dense_us"] for r in rs) / sum(r["us"] for r in rs),
            "ideal_speedup": len(rs) / sum(r["flop_fraction"] for r in rs),
            "efficiency_median": statistics.median(r["efficiency"] for r in rs),
            "efficiency_min": min(r["efficiency"] for r in rs), "efficiency_max": max(r["efficiency"] for r in rs),
            "layers": len(rs),
        }
    rs = rows
    by_unit["all adapted"] = {
        "flop_fraction": sum(r["flop_fraction"] * r["dense_us"] for r in rs) / sum(r["dense_us"] for r in rs),
        "us": sum(r["us"] for r in rs), "dense_us": sum(r["dense_us"] for r in rs),
        "speedup": sum(r["dense_us"] for r in rs) / sum(r["us"] for r in rs),
    }
    a = by_unit["all adapted"]
    a["ideal_speedup"] = 1.0 / a["flop_fraction"]
    a["efficiency_median"] = a["speedup"] / a["ideal_speedup"]
    return by_unit


def _env(device) -> str:
    try:
        import triton
        tv = triton.__version__
    except Exception:  # pragma: no cover
        tv = "not installed"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU {platform.machine()} ({torch.get_num_threads()} threads)"
    try:
        import os
        load = " , load average %.1f / %.1f / %.1f" % os.getloadavg()
    except OSError:  # pragma: no cover
        load = ""
    return (f"- device: {name}{load if device.type == 'cpu' else ''}\n- torch {torch.__version__}, triton {tv}, "
            f"python {platform.python_version()}\n- date: {_dt.datetime.now().isoformat(timespec='seconds')}")


def write_report(records: dict, device, args, env: str | None = None) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "gpu" if device.type == "cuda" else "cpu"
    stem = f"decode_{tag}" if tag == "gpu" or args.threads == 1 else f"decode_cpu_{args.threads}threads"
    compiled = records.get("harness", "eager") == "compiled"
    if compiled:
        stem = stem.replace(f"decode_{tag}", f"decode_{tag}_compiled")
    records.setdefault("env", env or _env(device))
    records.setdefault("args", {k: v for k, v in vars(args).items() if k not in ("render", "notes")})
    (RESULTS / f"{stem}.json").write_text(json.dumps(records, indent=1, default=float) + "\n")
    lines = [f"# Batch-1 greedy decoding: compressed {MODEL} vs dense ({tag.upper()})", "", records["env"], "",
             f"- CPU masked GEMV: {records['kernel']}" if tag == "cpu" else "- GPU masked GEMV: Triton",
             f"- model {MODEL}, float32, rana method, calibration {args.calib_tokens} tokens of `{args.dataset}`",
             f"- end to end: `rana.evaluation.latency_ratio`, prompt {records['prompt_tokens']} tokens, "
             f"{args.new_tokens} new tokens, median of {args.repeats} runs after {args.warmup} warm-up, compressed and "
             "dense interleaved in the same run. ratio = compressed / dense seconds per token (< 1 is faster).",
             ("- harness: compiled — `generate` with a fresh `StaticCache` per run, transformers compiling the "
              "single-token decode step with `torch.compile(fullgraph=True)` (inductor, mode \"default\" on CPU); "
              "dense compiled and timed the same way" if compiled else
              "- harness: eager `generate` (dynamic cache)"),
             "", "## End to end", "",
             "| F target | F measured | dense tok/s | compressed tok/s | latency ratio | decode-only ratio | speedup | "
             "1/F |", "|---|---|---|---|---|---|---|---|"]
    for r in records["end_to_end"]:
        lines.append(f"| {r['flops']:.2f} | {r['measured_flops']:.3f} | {r['dense_tokens_per_s']:.1f} | "
                     f"{r['tokens_per_s']:.1f} | {r['latency_ratio']:.3f} | {r['decode_latency_ratio']:.3f} | "
                     f"{r['speedup']:.2f}× | {1 / r['measured_flops']:.2f}× |")
    if compiled:
        lines += ["", "## Compilation (first generate of each model: its decode step compiled by inductor)", "",
                  "| model | first run s | graphs compiled (nodes) | rana ops in the graph | greedy tokens equal to eager |",
                  "|---|---|---|---|---|"]
        for name, c in records.get("compile", {}).items():
            label = "dense" if name == "dense" else f"F={float(name):.2f}"
            ops_ = ", ".join(f"`{k}` ×{v}" for k, v in sorted(c["rana_ops"].items())) or "—"
            lines.append(f"| {label} | {c['first_run_s']:.0f} | {len(c['graph_nodes'])} ({'/'.join(map(str, c['graph_nodes']))}) | "
                         f"{ops_} | first {c['tokens_equal_eager']} of {c['new_tokens']} |")
    if records["units"]:
        lines += _unit_lines(records, args, tag)
    if records.get("profile"):
        lines += ["", "## Profile of decode steps (self time per generated token, top ops)", ""]
        for name, ops in records["profile"].items():
            lines += [f"### {name}", "", "| op | calls/token | self µs/token | share |", "|---|---|---|---|"]
            lines += [f"| `{o['op']}` | {o['calls_per_token']:.0f} | {o['self_us_per_token']:.0f} | {100 * o['share']:.1f}% |"
                      for o in ops]
            lines.append("")
    if args.notes:
        lines += ["", "## Notes", "", Path(args.notes).read_text().strip()]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {RESULTS / f'{stem}.md'}", flush=True)


def _unit_lines(records: dict, args, tag: str) -> list[str]:
    lines = []
    lines += ["", "## Per adapted unit (mean over layers)", "",
              (f"Time per token of each unit's modules measured inside real greedy decoding ({args.new_tokens} "
               f"tokens, weights streamed from memory as in use), compressed and dense generations alternating "
               f"{args.rounds} times, median; f = measured FLOP fraction of the unit on the decoded tokens"
               if tag == "cpu" else
               f"Single-token inputs captured from {args.capture_steps} real decode steps; time per token of the "
               "adapted module(s) vs the dense module(s) it replaced, same inputs, interleaved; f = measured FLOP "
               "fraction of the unit on those inputs") + "; efficiency = speedup / (1/f), 1.0 = the memory-bound limit.",
              "", "| F | unit | f | dense µs | compressed µs | speedup | 1/f | efficiency (median, min–max over layers) |",
              "|---|---|---|---|---|---|---|---|"]
    for f, summary in records["units_summary"].items():
        for unit, s in summary.items():
            eff = (f"{s['efficiency_median']:.2f} ({s['efficiency_min']:.2f}–{s['efficiency_max']:.2f})"
                   if "efficiency_min" in s else f"{s['efficiency_median']:.2f}")
            lines.append(f"| {float(f):.2f} | {unit} | {s['flop_fraction']:.3f} | {s['dense_us']:.1f} | {s['us']:.1f} | "
                         f"{s['speedup']:.2f}× | {s['ideal_speedup']:.2f}× | {eff} |")
    lines += ["", "Per layer (the JSON has every unit):", "",
              "| F | layer | unit | f | dense µs | compressed µs | speedup | 1/f | efficiency |", "|---|---|---|---|---|---|---|---|---|"]
    for f, rows in records["units"].items():
        n_layers = max(r["layer"] for r in rows) + 1
        for r in rows:
            if r["layer"] in (0, n_layers // 2, n_layers - 1):
                lines.append(f"| {float(f):.2f} | {r['layer']} | {r['unit']} | {r['flop_fraction']:.3f} | {r['dense_us']:.1f} | "
                             f"{r['us']:.1f} | {r['speedup']:.2f}× | {r['ideal_speedup']:.2f}× | {r['efficiency']:.2f} |")
    return lines


# ------------------------------------------------------------------------------------ compiled harness
@torch.no_grad()
def compile_check(model, ids: torch.Tensor, new_tokens: int) -> dict:
    """Compile `model`'s decode step as the compiled harness does (its first generate) and say what was
    traced: seconds of that first run, the graphs, the rana ops in them, and how many of its greedy tokens
    equal the eager ones (a masked model's tokens may part after a while: inductor's fused kernels round
    differently, and a score that lands on the other side of a threshold changes the mask). A graph
    break raises (fullgraph=True)."""
    from transformers import StaticCache

    from rana.evaluation.latency import generation_config

    eager = model.generate(ids, attention_mask=torch.ones_like(ids),
                           generation_config=generation_config(model, new_tokens, "eager", ids.device))
    seen: dict[str, int] = {}
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(len(gm.graph.nodes))
        for n in gm.graph.nodes:
            if "rana" in str(n.target):
                name = str(n.target).removesuffix(".default")
                seen[name] = seen.get(name, 0) + 1
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    config = generation_config(model, new_tokens, "compiled", ids.device)
    harness_config = config.compile_config
    config.compile_config = copy.copy(harness_config)
    config.compile_config.backend = recording  # inductor, as the harness, plus a look at the graph
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new_tokens)
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config, past_key_values=cache)
    seconds = time.perf_counter() - start
    model._last_compile_config = harness_config  # the harness reuses this compiled step (same inductor code)
    new_compiled, new_eager = out[0, ids.shape[1]:], eager[0, ids.shape[1]:]
    same = int((new_compiled != new_eager).nonzero()[0, 0]) if not torch.equal(new_compiled, new_eager) else len(new_eager)
    # graph_nodes is the backend's own list: graphs compiled later (recompiles in the timed runs) show there too
    return {"first_run_s": seconds, "graph_nodes": graphs, "rana_ops": dict(seen),
            "tokens_equal_eager": same, "new_tokens": len(new_eager)}


# ------------------------------------------------------------------------------------ main
def run_device(device, dense, models, tokenizer, args) -> dict:
    from rana.evaluation import DEFAULT_PROMPT, latency_ratio

    dense = dense.to(device)
    ids = tokenizer(DEFAULT_PROMPT, return_tensors="pt")["input_ids"]
    from rana.kernels.cpu_gemv import native_status

    records = {"device": str(device), "prompt_tokens": int(ids.shape[1]), "new_tokens": args.new_tokens,
               "kernel": native_status(),
               "threads": torch.get_num_threads(), "end_to_end": [], "units": {}, "units_summary": {}}
    records["harness"] = args.harness
    if args.harness == "compiled":
        records["compile"] = {"dense": compile_check(dense, ids.to(device), args.new_tokens)}
    for f, (model, plan) in models.items():
        model = model.to(device)
        if args.harness == "compiled":
            records["compile"][str(f)] = compile_check(model, ids.to(device), args.new_tokens)
        r = latency_ratio(model, dense, ids.to(device), new_tokens=args.new_tokens, warmup=args.warmup,
                          repeats=args.repeats, mode=args.harness)
        r.update(flops=f, measured_flops=plan.get("measured_flops", float("nan")))
        records["end_to_end"].append(r)
        print(f"[{device}] F={f}: {r['tokens_per_s']:.1f} vs dense {r['dense_tokens_per_s']:.1f} tok/s, "
              f"ratio {r['latency_ratio']:.3f} (decode only {r['decode_latency_ratio']:.3f})", flush=True)
        if args.harness == "compiled":
            model.to("cpu")
            continue
        units = _units(model)
        if device.type == "cpu":
            rows = unit_timings_in_decode(model, dense, ids, units, args.new_tokens, args.rounds)
        else:  # a wall clock per call would need a sync per call on a GPU: time captured inputs instead
            inputs = capture_decode_inputs(model, ids.to(device), units, args.capture_steps)
            rows = unit_timings(model, dense, inputs, units, device, args.min_run_time, args.rounds)
        records["units"][str(f)] = rows
        records["units_summary"][str(f)] = summarize_units(rows)
        a = records["units_summary"][str(f)]["all adapted"]
        print(f"[{device}] F={f}: adapted units {a['speedup']:.2f}× of ideal {a['ideal_speedup']:.2f}×", flush=True)
        model.to("cpu")
    if args.profile and device.type == "cpu":
        f_min = min(models)
        records["profile"] = {"dense": profile_step(dense, ids),
                              f"compressed F={f_min}": profile_step(models[f_min][0], ids)}
    dense.to("cpu")
    return records


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flops", type=float, nargs="+", default=list(FLOPS))
    p.add_argument("--from", dest="from_dirs", nargs="*", metavar="F=DIR", help="rana folders to reuse")
    p.add_argument("--save-dir", help="save compressed folders here (and reuse them on the next run)")
    p.add_argument("--dataset", default=DATASET)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--capture-steps", type=int, default=8)
    p.add_argument("--min-run-time", type=float, default=0.2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads (default 1: batch-1 GEMVs of a 135M model gain little from more, and on a "
                        "shared machine OpenMP threads waiting for a busy core distort timings)")
    p.add_argument("--device", choices=("cpu", "cuda", "all"), default="all")
    p.add_argument("--harness", choices=("eager", "compiled"), default="eager",
                   help="eager generate (dynamic cache), or static cache + compiled decode step (end to end only)")
    p.add_argument("--profile", action="store_true", help="add per-op profiles of decode steps (CPU)")
    p.add_argument("--notes", help="markdown file appended to the report as a Notes section")
    p.add_argument("--compress-only", action="store_true", help="only compress and save (needs --save-dir)")
    p.add_argument("--render", metavar="JSON", help="only rewrite the markdown report from a results JSON")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.render:
        records = json.loads(Path(args.render).read_text())
        for k, v in records.get("args", {}).items():
            if k not in ("render", "notes") or getattr(args, k) is None:
                setattr(args, k, v)
        write_report(records, torch.device("cuda" if "cuda" in records["device"] else "cpu"), args,
                     env=records.get("env"))
        return
    if args.quick:
        args.new_tokens, args.repeats, args.warmup, args.rounds, args.min_run_time = 16, 2, 1, 1, 0.05
    torch.set_num_threads(args.threads)

    from transformers.utils import logging as hf_logging

    from rana.io.models import load_model

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    dense, tokenizer, _ = load_model(MODEL)
    models = compressed_models(args, dense.config)
    if args.compress_only:
        return
    devices = []
    if args.device in ("cpu", "all"):
        devices.append(torch.device("cpu"))
    if args.device in ("cuda", "all") and torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    for device in devices:
        write_report(run_device(device, dense, models, tokenizer, args), device, args)


if __name__ == "__main__":
    sys.exit(main())
