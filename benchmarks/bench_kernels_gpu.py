"""Batch-1 masked GEMV on a GPU, measured the way a compiled decode step runs it.

Problems (K inputs × N outputs): 4096×4096, 4096×14336, 14336×4096, the 4096×128256 LM head, and the
two grouped launches of a Llama-3-8B layer — q/k/v (4096 → 4096+1024+1024) and gate/up
(4096 → 14336+14336); active fraction f ∈ {0.25, 0.5, 0.75, 1.0} with exactly round(f·K) inputs
active, scattered at random; bf16 and fp16. Kernels:

* dense, the denominator: what the dense model runs — ``F.linear(x, W)`` with W [out, in] row-major
  (nn.Linear's layout), one call per projection for the grouped problems (q, k, v; gate, up);
* rana: ``grouped_masked_gemv_triton``, one launch per group, with the config the compiled path
  takes (the shipped tuning table or the shape heuristic: nothing is tuned here);
* teal-ref: benchmarks/teal_reference_gemv.py, TEAL's split-K atomic design (zero fill + kernel +
  cast, one call per projection), autotuned on its own before any timing.

How it is timed (gpu_review.md, item 6): every tensor is rotated over enough copies that the bytes a
kernel touches in one pass exceed twice the L2 size, so weights come from HBM as in a real decode
step; the calls over all copies are captured in one CUDA graph, replayed, and the time divided by
the number of calls, so launch overhead is what a compiled step sees. Every kernel is checked
against an fp64 reference first; a kernel that disagrees is reported and not timed (exit code 1).
The profiler then gives each kernel's own device time (rana: ``rana_masked_gemv`` /
``rana_gemv_reduce``). Per cell: µs, time / dense, whether rana meets f + 0.10, whether it is below
the reference, and active-byte bandwidth (active weight rows + input + output bytes per second).

    python benchmarks/bench_kernels_gpu.py [--time-budget S] [--out STEM]   # default STEM benchmarks/results/gpu_kernels
    TRITON_INTERPRET=1 python benchmarks/bench_kernels_gpu.py --smoke --out /tmp/k

The report (STEM.md + .json) is rewritten after every cell, atomically (benchmarks/atomic_table.py),
so a run stopped at any moment leaves every cell it measured. ``--time-budget`` counts from the
process start; a cell starts only if what the cells before it took (a prior before any) still fits.

``--smoke``: tiny shapes on CPU under the Triton interpreter with a wall-clock timer — it exercises
the code paths, its numbers mean nothing, and it writes only where --out says.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

_START = time.perf_counter()  # --time-budget counts from here: imports are part of the run

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from atomic_table import write_report  # noqa: E402
from teal_reference_gemv import best_config as teal_config  # noqa: E402
from teal_reference_gemv import teal_reference_gemv  # noqa: E402

from rana.kernels import triton_gemv as tg  # noqa: E402

# (name, kind, K inputs, the outputs of each projection of one launch)
PROBLEMS = [
    ("4096x4096", "square", 4096, (4096,)),
    ("4096x14336", "wide", 4096, (14336,)),
    ("14336x4096", "tall", 14336, (4096,)),
    ("4096x128256 LM head", "lm-head", 4096, (128256,)),
    ("q/k/v 4096x(4096+1024+1024)", "qkv", 4096, (4096, 1024, 1024)),
    ("gate/up 4096x(14336+14336)", "gate-up", 4096, (14336, 14336)),
]
# the same kinds, small enough for the interpreter (sizes not multiples of the blocks: masked tails)
SMOKE_PROBLEMS = [
    ("40x48", "square", 40, (48,)),
    ("24x72", "wide", 24, (72,)),
    ("72x24", "tall", 72, (24,)),
    ("24x200 LM head", "lm-head", 24, (200,)),
    ("q/k/v 32x(32+16+16)", "qkv", 32, (32, 16, 16)),
    ("gate/up 24x(40+40)", "gate-up", 24, (40, 40)),
]
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
SMOKE_FRACTIONS = (0.5,)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
SMOKE_DTYPES = ("float16",)  # numpy, which the interpreter runs on, has no bfloat16
THRESHOLD = 1.0
TARGET_SLACK = 0.10  # rana's target: time / dense ≤ f + 0.10
# seconds a piece of work is expected to take before one like it was timed (never 0, or the budget
# check would wave through what it knows nothing about): a new problem's operands, copies and dense
# timing; one cell (both kernels: compile, fp64 check, graph timing, profile)
PRIOR_SECONDS = {"setup": 5.0, "cell": 5.0}
TOLERANCE = 2e-2  # max |error| / max |reference|: a few half-precision output roundings
KERNELS = ("rana", "teal-ref")


# ------------------------------------------------------------------------------------ operands
def make_input(K: int, fraction: float, dtype, device, seed: int = 0):
    """v with exactly round(f·K) entries at |v| ≥ THRESHOLD, scattered at random. Active magnitudes
    are ≥ 1.1 and inactive ones ≤ 0.9, so no rounding to half precision moves one across the
    threshold (a sorted-midpoint threshold fails on the ties bf16 makes)."""
    g = torch.Generator().manual_seed(seed)
    n = round(fraction * K)
    mag = torch.empty(K).uniform_(0.05, 0.9, generator=g)
    mag[torch.randperm(K, generator=g)[:n]] = torch.empty(n).uniform_(1.1, 3.0, generator=g)
    sign = torch.randint(0, 2, (K,), generator=g) * 2 - 1
    v = (mag * sign).to(dtype).to(device)
    assert int((v.float().abs() >= THRESHOLD).sum()) == n
    return v, n


def n_copies(touched_bytes: int, l2_bytes: int, smoke: bool) -> int:
    """Copies whose bytes touched in one pass exceed twice the L2: the first copy is evicted by the
    time the rotation comes back to it. Two at least, so the rotation itself is always exercised."""
    if smoke:
        return 2
    return max(2, 2 * l2_bytes // max(1, touched_bytes) + 1)


class Operands:
    """One problem at one dtype: the transposed weights rana and the reference read (K × N_g
    row-major, `linear.weight.t()` of a column-major-stored weight) and the dense model's own
    weights (N_g × K row-major), with as many copies of each as a cell asks for, made on demand."""

    def __init__(self, problem, dtype, device, l2_bytes: int, smoke: bool, seed: int = 0):
        self.name, self.kind, self.K, self.ns = problem
        self.dtype, self.device, self.l2, self.smoke = dtype, device, l2_bytes, smoke
        g = torch.Generator(device=device).manual_seed(seed)
        self.w_ts = [(torch.randn(self.K, n, device=device, generator=g) * self.K ** -0.5).to(dtype) for n in self.ns]
        self._t_copies = [self.w_ts]
        self._dense_copies = [[w.t().contiguous() for w in self.w_ts]]
        self.n_total = sum(self.ns)
        self.elt = self.w_ts[0].element_size()

    def transposed(self, count: int) -> list[list[torch.Tensor]]:
        while len(self._t_copies) < count:
            self._t_copies.append([w.clone() for w in self.w_ts])
        return self._t_copies[:count]

    def dense(self, count: int) -> list[list[torch.Tensor]]:
        while len(self._dense_copies) < count:
            self._dense_copies.append([w.clone() for w in self._dense_copies[0]])
        return self._dense_copies[:count]

    def io_bytes(self) -> int:
        return (self.K + self.n_total) * self.elt


def masked_reference(v: torch.Tensor, w_ts, threshold: float) -> torch.Tensor:
    """(m ⊙ v) @ w_t in fp64 over the active rows only (a full fp64 LM head would be 4 GB)."""
    rows = torch.nonzero(v.abs() >= threshold).flatten()
    vd = v.double()[rows]
    return torch.cat([vd @ w[rows].double() for w in w_ts])


def relative_error(out, expected: torch.Tensor) -> float:
    out = torch.cat([o.reshape(-1) for o in out]) if isinstance(out, (list, tuple)) else out.reshape(-1)
    return float((out.double() - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------ timers
def graph_us(calls, trials: int = 5, min_ms: float = 2.0) -> float:
    """µs per call of `calls` (one per copy), captured in one CUDA graph and replayed: weights cold,
    launch cost what a compiled decode step pays. Every call runs once eagerly first, outside the
    capture (Triton compiles and the reference autotunes there; neither may happen in a capture)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()  # the first replay uploads the graph
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    reps = max(1, math.ceil(min_ms / max(start.elapsed_time(end), 1e-3)))
    per_call = []
    for _ in range(trials):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) * 1e3 / (reps * len(calls)))
    del graph
    return statistics.median(per_call)


def wall_us(calls) -> float:
    """--smoke: wall-clock µs per call on CPU (a code-path check, not a measurement)."""
    for call in calls:
        call()
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) * 1e6 / len(calls)


def kernel_profile(calls, device: torch.device) -> dict[str, float]:
    """Each kernel's own device µs per call, from the profiler (eager launches over the copies). On
    CPU (--smoke) the top-level ops stand in for kernels, to exercise the same code."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for call in calls:
            call()
        if cuda:
            torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if (event.device_type != DeviceType.CUDA) if cuda else (event.cpu_parent is not None):
            continue
        totals[event.name] = totals.get(event.name, 0.0) + event.time_range.elapsed_us()
    return {name: us / len(calls) for name, us in sorted(totals.items(), key=lambda kv: -kv[1])}


def rana_config(w_ts, dtype, sbin: int, device) -> str | None:
    """The config rana's compiled path takes for this launch (BLOCK_N, BLOCK_K, SPLIT, warps), and
    whether it came from the tuning table or the shape heuristic, where the kernel module exposes
    its choice (`choose_config`, `heuristic_config`); the report goes without it otherwise."""
    choose, heuristic = getattr(tg, "choose_config", None), getattr(tg, "heuristic_config", None)
    ks, ns = [w.shape[0] for w in w_ts], [w.shape[1] for w in w_ts]
    try:
        cfg = choose(ks, ns, dtype, "abs", sbin, device)
        source = "heuristic" if heuristic is not None and tuple(heuristic(ks, ns, dtype, device)) == tuple(cfg) else "table"
    except TypeError:  # absent (None) or another signature
        return None
    return f"{tuple(cfg)} {source}"


# ------------------------------------------------------------------------------------ cells
def _calls(label: str, vs, w_sets, t_dev, sbin: int):
    """One zero-argument call per copy: rana's one grouped launch, or the reference per projection."""
    g = len(w_sets[0])
    if label == "rana":
        return [lambda v=v, ws=ws: tg.grouped_masked_gemv_triton([v] * g, ws, [t_dev] * g, "abs", [None] * g,
                                                                 [None] * g, sbin)
                for v, ws in zip(vs, w_sets)]
    return [lambda v=v, ws=ws: [teal_reference_gemv(w, v, THRESHOLD, sbin) for w in ws] for v, ws in zip(vs, w_sets)]


def dense_cell(ops: Operands, timer, profile: bool) -> dict:
    """The dense model's GEMVs for this problem: checked, timed on cold copies, profiled."""
    v, _ = make_input(ops.K, 1.0, ops.dtype, ops.device)
    copies = n_copies(ops.K * ops.n_total * ops.elt, ops.l2, ops.smoke)
    xs = [v.reshape(1, 1, -1).clone() for _ in range(copies)]  # (batch, token, hidden), as decoding has it
    calls = [lambda x=x, ws=ws: [F.linear(x, w) for w in ws] for x, ws in zip(xs, ops.dense(copies))]
    err = relative_error(calls[0](), masked_reference(v, ops.w_ts, 0.0))
    if not err <= TOLERANCE:
        return {"error": f"dense F.linear disagrees with the fp64 reference: max error {err:.3g}", "max_err": err}
    us = timer(calls)
    return {"us": us, "copies": copies, "max_err": err,
            "gb_per_s": (ops.K * ops.n_total * ops.elt + ops.io_bytes()) / us / 1e3,
            "profile": kernel_profile(calls, ops.device) if profile else None}


def kernel_cell(ops: Operands, label: str, fraction: float, dense: dict, timer, profile: bool) -> dict:
    """One kernel at one active fraction: fp64 check first, then cold-weight timing and the profile."""
    v, n_active = make_input(ops.K, fraction, ops.dtype, ops.device)
    sbin = tg.sparsity_bin(fraction)
    t_dev = torch.full((), THRESHOLD, dtype=torch.float32, device=ops.device)
    active_bytes = n_active * ops.n_total * ops.elt + ops.io_bytes()
    copies = n_copies(active_bytes, ops.l2, ops.smoke)
    calls = _calls(label, [v.clone() for _ in range(copies)], ops.transposed(copies), t_dev, sbin)
    rec = {"K": ops.K, "N": list(ops.ns), "active_inputs": n_active, "sparsity_bin": sbin, "copies": copies,
           "dense_us": dense["us"], "dense_copies": dense["copies"], "dense_gb_per_s": dense["gb_per_s"],
           "target": fraction + TARGET_SLACK}
    rec["max_err"] = relative_error(calls[0](), masked_reference(v, ops.w_ts, THRESHOLD))
    if not rec["max_err"] <= TOLERANCE:
        rec["error"] = f"disagrees with the fp64 reference: max error {rec['max_err']:.3g} of the largest output"
        return rec
    rec["us"] = timer(calls)
    rec["ratio"] = rec["us"] / dense["us"]
    rec["target_met"] = rec["ratio"] <= rec["target"]
    rec["active_gb_per_s"] = active_bytes / rec["us"] / 1e3
    rec["config"] = rana_config(ops.w_ts, ops.dtype, sbin, ops.device) if label == "rana" else teal_config(sbin, ops.w_ts[0])
    rec["profile"] = kernel_profile(calls, ops.device) if profile else None
    return rec


# ------------------------------------------------------------------------------------ the run
def _cells(problems, dtypes, fractions):
    """(dtype, problem, fraction) in priority order: every problem at the first dtype before the second."""
    return [(d, p, f) for d in dtypes for p in problems for f in fractions]


def _guarded(fn, *args) -> dict:
    """One cell; an exception (a kernel that fails to compile or launch, out of memory) becomes the
    cell's error instead of ending the run."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported per cell, the run goes on
        return {"error": f"raised {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}


def _problem_cells(ops: Operands, dense: dict, fraction: float, timer, profile: bool, failures: list) -> list[dict]:
    """Both kernels at one fraction; rana is marked below the reference when both were timed."""
    recs = []
    for label in KERNELS:
        rec = _guarded(kernel_cell, ops, label, fraction, dense, timer, profile)
        rec.update({"problem": ops.name, "kind": ops.kind, "dtype": str(ops.dtype).split(".")[-1],
                    "fraction": fraction, "kernel": label})
        if "error" in rec:
            failures.append(f"{label} on {ops.name} {rec['dtype']} f={fraction}: {rec['error']}")
        recs.append(rec)
    rana, ref = recs
    if "us" in rana and "us" in ref:
        rana["below_reference"] = rana["us"] < ref["us"]
    return recs


def _header(args, device: torch.device, l2: int) -> dict:
    props = torch.cuda.get_device_properties(device) if device.type == "cuda" else None
    return {"device": props.name if props else "cpu (smoke, TRITON_INTERPRET=1)",
            "l2_bytes": l2, "sm_count": props.multi_processor_count if props else None,
            "torch": torch.__version__, "triton": _triton_version(), "smoke": args.smoke,
            "timer": "wall clock on CPU (smoke)" if args.smoke else "CUDA graph replay over rotating copies",
            "fractions": list(args.fractions), "complete": False, "dense": [], "records": [],
            "skipped_for_time": [], "failures": [], "wall_s": 0.0}


class Costs:
    """What each kind of work took so far (its median), else its prior: the budget check's estimates."""

    def __init__(self):
        self.seen: dict[str, list[float]] = {}

    def add(self, kind: str, seconds: float) -> None:
        self.seen.setdefault(kind, []).append(seconds)

    def estimate(self, kinds: list[str]) -> float:
        return sum(statistics.median(self.seen[k]) if k in self.seen else PRIOR_SECONDS[k] for k in kinds)


def run(args, save=lambda result: None) -> dict:
    """Every cell in priority order within --time-budget; `save(result)` after each one, so a run
    stopped from outside still leaves what it measured. The first cell always runs (a run that
    refused its first cell on an estimate would return nothing); a later one only if its estimate,
    with a new problem's setup when it starts one, fits in what is left."""
    device = torch.device("cpu" if args.smoke else "cuda")
    l2 = 0 if args.smoke else torch.cuda.get_device_properties(device).L2_cache_size
    timer = wall_us if args.smoke else graph_us
    problems = [p for p in (SMOKE_PROBLEMS if args.smoke else PROBLEMS) if not args.kinds or p[1] in args.kinds]
    result, costs = _header(args, device, l2), Costs()
    ops = dense = None
    for dname, problem, fraction in _cells(problems, args.dtypes, args.fractions):
        new_problem = ops is None or (ops.name, ops.dtype) != (problem[0], DTYPES[dname])
        need = costs.estimate(["setup", "cell"] if new_problem else ["cell"])
        elapsed = time.perf_counter() - _START
        if args.time_budget is not None and costs.seen and elapsed + need > args.time_budget:
            result["skipped_for_time"].append(f"{problem[0]} {dname} f={fraction}")
            continue
        if new_problem:
            began = time.perf_counter()
            ops = dense = None  # free the previous problem's copies before making the next one's
            if device.type == "cuda":
                torch.cuda.empty_cache()
            ops = Operands(problem, DTYPES[dname], device, l2, args.smoke)
            dense = _guarded(dense_cell, ops, timer, args.profile)
            result["dense"].append({"problem": ops.name, "kind": ops.kind, "dtype": dname, **dense})
            if "error" in dense:
                result["failures"].append(f"dense on {ops.name} {dname}: {dense['error']}")
            costs.add("setup", time.perf_counter() - began)
        if "error" in dense:
            continue  # no denominator: this problem's cells cannot be reported
        began = time.perf_counter()
        recs = _problem_cells(ops, dense, fraction, timer, args.profile, result["failures"])
        result["records"] += recs
        costs.add("cell", time.perf_counter() - began)
        result["wall_s"] = time.perf_counter() - _START
        save(result)
        print(f"{problem[0]} {dname} f={fraction}: dense {dense['us']:.1f} us, " + ", ".join(
            f"{r['kernel']} {r['us']:.1f} us ({r['ratio']:.2f}x)" if "us" in r else f"{r['kernel']} FAILED"
            for r in recs), flush=True)
    result.update(complete=True, wall_s=time.perf_counter() - _START)
    save(result)
    return result


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


# ------------------------------------------------------------------------------------ report
def _num(value, spec: str = ".1f") -> str:
    return "—" if value is None else format(value, spec)


def _yes(value) -> str:
    return "—" if value is None else ("yes" if value else "**no**")


def _split(profile: dict | None, groups: tuple[str, ...]) -> str:
    """Profiler µs per call summed by kernel-name substring, the rest as the last column."""
    if not profile:
        return "—"
    sums = [sum(us for name, us in profile.items() if group in name) for group in groups]
    rest = sum(profile.values()) - sum(sums)
    return " / ".join(f"{x:.1f}" for x in sums + [rest])


def _pairs(records: list[dict]):
    """(rana, teal-ref) record pairs of the same cell, in run order."""
    by_cell: dict[tuple, dict] = {}
    for r in records:
        by_cell.setdefault((r["problem"], r["dtype"], r["fraction"]), {})[r["kernel"]] = r
    return [(cell, pair.get("rana", {}), pair.get("teal-ref", {})) for cell, pair in by_cell.items()]


def markdown(result: dict) -> str:
    lines = [f"# Masked GEMV kernels on {result['device']}", "",
             f"torch {result['torch']}, triton {result['triton']}; L2 {result['l2_bytes'] / 2**20:.0f} MiB; "
             f"timer: {result['timer']}; total {result['wall_s']:.0f} s." + (" **Smoke run: the numbers mean nothing.**"
                                                                            if result["smoke"] else "")
             + ("" if result["complete"] else " **PARTIAL: the run was stopped before the end.**"), "",
             "Exactly round(f·K) inputs active, scattered. Dense = the dense model's `F.linear(x, W)` (W [out, in] "
             "row-major; the grouped problems as separate calls). Every tensor rotated over enough copies that one "
             "pass touches more than 2× L2, all copies in one CUDA graph, time per call. rana: the config the "
             "compiled path takes (shipped table or heuristic); teal-ref: TEAL's split-K atomic design, zero fill + "
             "kernel + cast, autotuned on cold L2 before timing. Target: rana / dense ≤ f + 0.10. GB/s: active "
             "weight rows + input + output bytes per second (dense: all weight bytes).", ""]
    for dtype in dict.fromkeys(r["dtype"] for r in result["records"]):
        lines += [f"## {dtype}", "",
                  "| problem | f | dense µs | rana µs | rana / dense | ≤ f+0.10 | teal-ref µs | ref / dense | "
                  "rana < ref | GB/s rana / ref / dense |", "|---|---|---|---|---|---|---|---|---|---|"]
        for (problem, dt, f), rana, ref in _pairs(result["records"]):
            if dt != dtype:
                continue
            lines.append(f"| {problem} | {f} | {_num(rana.get('dense_us'))} | {_num(rana.get('us'))} | "
                         f"{_num(rana.get('ratio'), '.2f')} | {_yes(rana.get('target_met'))} | {_num(ref.get('us'))} | "
                         f"{_num(ref.get('ratio'), '.2f')} | {_yes(rana.get('below_reference'))} | "
                         f"{_num(rana.get('active_gb_per_s'), '.0f')} / {_num(ref.get('active_gb_per_s'), '.0f')} / "
                         f"{_num(rana.get('dense_gb_per_s'), '.0f')} |")
        lines.append("")
    lines += ["## Where the time goes (profiler: device µs per call, eager launches over the same copies)", "",
              "| problem | dtype | f | rana: masked / reduce / other | ref: kernel / fill+cast | rana config (BN, BK, SPLIT, warps) | ref config |",
              "|---|---|---|---|---|---|---|"]
    for (problem, dtype, f), rana, ref in _pairs(result["records"]):
        lines.append(f"| {problem} | {dtype} | {f} | {_split(rana.get('profile'), ('masked_gemv', 'gemv_reduce'))} | "
                     f"{_split(ref.get('profile'), ('teal_splitk_gemv',))} | {rana.get('config') or '—'} | "
                     f"{(ref.get('config') or '—').replace('|', '/')} |")
    lines.append("")
    if result["skipped_for_time"]:
        lines += ["## Skipped for time", "", ", ".join(result["skipped_for_time"]), ""]
    if result["failures"]:
        lines += ["## FAILED correctness checks (not timed)", ""] + [f"- {f}" for f in result["failures"]] + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (TRITON_INTERPRET=1): code paths, no numbers")
    p.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES))
    p.add_argument("--fractions", nargs="+", type=float, default=None, help=f"active fractions (default {FRACTIONS})")
    p.add_argument("--kinds", nargs="+", default=None, choices=sorted({k for _, k, _, _ in PROBLEMS}),
                   help="only these problems")
    p.add_argument("--no-profile", dest="profile", action="store_false", help="skip the per-kernel profiler pass")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds for the whole run; cells that would not fit are listed as skipped")
    p.add_argument("--out", type=Path, default=None, help="output stem (default benchmarks/results/gpu_kernels)")
    args = p.parse_args(argv)
    if args.smoke and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--smoke runs the Triton kernels on CPU: set TRITON_INTERPRET=1 before starting")
    if args.smoke and args.out is None:
        p.error("--smoke needs --out (smoke numbers never go into benchmarks/results)")
    if not args.smoke and not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")
    args.dtypes = args.dtypes or list(SMOKE_DTYPES if args.smoke else DTYPES)
    args.fractions = tuple(args.fractions or (SMOKE_FRACTIONS if args.smoke else FRACTIONS))
    out = args.out or HERE / "results" / "gpu_kernels"
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        write_report(out, result, markdown(result))

    result = run(args, save)
    print(f"wrote {out.with_suffix('.md')} and .json ({len(result['records'])} records, "
          f"{len(result['skipped_for_time'])} cells skipped for time, {len(result['failures'])} failures)")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
