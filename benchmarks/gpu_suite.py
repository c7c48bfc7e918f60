"""Every GPU check of the decode path in ONE command, inside 8 minutes on one H100.

    python benchmarks/gpu_suite.py                       # then copy benchmarks/results/gpu_* back
    python benchmarks/gpu_suite.py --only kernels decode # some sections
    python benchmarks/gpu_suite.py --smoke --results /tmp/s   # every section on CPU, tiny shapes

Sections, in this order, each in its own process (one failure or hang does not stop the rest) and
each with its share of one global deadline (``--deadline``, default 460 s, which leaves start-up and
the summary inside 8 minutes; time a section leaves unused goes to the ones after it):

1. tests    ``pytest -m cuda tests/`` with the Triton interpreter off, plus the tests of
            tests/test_triton_codegen.py without the cuda marker (its CUDA-only ones skip on CPU
            machines, so this is where they run) → gpu_tests.md/.json
2. tuner    ``python -m rana.kernels.gemv_tune --out RESULTS/gemv_configs.json``, the table then
            copied to kernels/gemv_configs.json so that it ships (skipped while the tuner does not
            exist) → gpu_tuner.md/.json
3. kernels  benchmarks/bench_kernels_gpu.py (after the tuner: it measures the shipped configs)
            → gpu_kernels.md/.json
4. decode   benchmarks/bench_decode_gpu.py with the time left → gpu_decode.md/.json
5. compress bench_compress_gpu.py --one-layer: one Llama-2-7B-shaped layer → gpu_compress.md/.json

Writes RESULTS/gpu_suite.md + .json (device; torch, triton, transformers versions; git commit; each
section's status, wall time and budget; what was skipped for time) and each section's full output
under RESULTS/gpu_suite_logs/. ``--smoke`` runs every section on CPU with tiny shapes (Triton
interpreter for the kernels; the pytest section collects the ``-m cuda`` tests of the files that
have them and reports their skips) and writes only into ``--results``, which it then requires.
Exit code: 0 when no section failed or timed out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
DEFAULT_RESULTS = BENCH / "results"
CODEGEN_TESTS = ROOT / "tests" / "test_triton_codegen.py"
SHIPPED_TABLE = ROOT / "kernels" / "gemv_configs.json"
TUNER = "rana.kernels.gemv_tune"
DEFAULT_DEADLINE = 460.0
SUMMARY_RESERVE = 5.0  # seconds kept back from the sections for the summary itself
MIN_SECTION = 10.0  # a section offered less than this is skipped for time: it could only be killed
TAIL = 6000  # characters of a section's output kept in its report


@dataclass
class Ctx:
    results: Path
    smoke: bool
    logs: Path
    env: dict


@dataclass
class Outcome:
    status: str  # pass, fail, timeout, skipped
    note: str = ""
    outputs: list = field(default_factory=list)
    skipped_for_time: list = field(default_factory=list)
    commands: list = field(default_factory=list)


# ------------------------------------------------------------------------------------ processes
def child_env(ctx: Ctx, interpret: str | None) -> dict:
    """The suite's environment for a child: offline hub; TRITON_INTERPRET as given (None: unset)."""
    env = {**ctx.env, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("TRITON_INTERPRET", None)
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return env


def run_child(cmd: list[str], env: dict, timeout: float, log: Path) -> dict:
    """Run `cmd` in its own process group, output to `log`; on timeout kill that group (its own
    workers too, e.g. inductor's compile pool). Returns rc, wall_s, timed_out and the output tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with open(log, "w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=max(1.0, timeout)), False
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended between the timeout and the kill
                pass
            rc, timed_out = proc.wait(), True
    text = log.read_text(errors="replace")
    return {"cmd": cmd, "rc": rc, "wall_s": time.perf_counter() - began, "timed_out": timed_out,
            "tail": text[-TAIL:]}


def _status(run: dict, ok_codes=(0,)) -> str:
    return "timeout" if run["timed_out"] else ("pass" if run["rc"] in ok_codes else "fail")


def _child_budget(budget: float) -> float:
    """The --time-budget a child is given: its share less what starting and writing take."""
    return max(1.0, budget - max(5.0, 0.1 * budget))


def _fenced(text: str) -> list[str]:
    return ["```", text.replace("```", "ʼʼʼ").rstrip(), "```"]


def write_report(ctx: Ctx, stem: str, title: str, runs: list[dict], notes: list[str]) -> list[str]:
    """RESULTS/<stem>.md + .json for a section whose product is its processes' output (tests, tuner),
    or that failed before writing its own report."""
    lines = [f"# {title}", ""] + [f"- {n}" for n in notes] + [""]
    for r in runs:
        lines += [f"## `{' '.join(r['cmd'][1:])}`", "",
                  f"exit code {r['rc']}{' (killed: out of time)' if r['timed_out'] else ''}, {r['wall_s']:.1f} s", ""]
        lines += _fenced(r["tail"]) + [""]
    md, js = ctx.results / f"{stem}.md", ctx.results / f"{stem}.json"
    md.write_text("\n".join(lines))
    js.write_text(json.dumps({"title": title, "notes": notes, "runs": runs}, indent=1) + "\n")
    return [md.name, js.name]


def _help_text(module_or_script: list[str], env: dict, timeout: float) -> str | None:
    """`--help` of a command (None when it cannot even start, e.g. the module does not exist yet)."""
    try:
        res = subprocess.run([sys.executable, *module_or_script, "--help"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return res.stdout if res.returncode == 0 else None


def _worst(statuses: list[str]) -> str:
    for status in ("timeout", "fail", "pass"):
        if status in statuses:
            return status
    return "skipped"


def _last_line(text: str) -> str:
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else "(no output)"


# ------------------------------------------------------------------------------------ sections
def cuda_test_files() -> list[str]:
    """The test files that use the cuda marker: the smoke run collects only these (small, and it
    still shows each CUDA test being skipped on CPU)."""
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
            if "mark.cuda" in p.read_text(errors="replace")]


def section_tests(ctx: Ctx, budget: float) -> Outcome:
    base = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs"]
    if ctx.smoke:
        cmds, env = [base + ["-m", "cuda", *(cuda_test_files() or ["tests/"])]], child_env(ctx, "1")
    else:
        cmds = [base + ["-m", "cuda", "tests/"]]
        if CODEGEN_TESTS.exists():
            cmds.append(base + ["-m", "not cuda", str(CODEGEN_TESTS.relative_to(ROOT))])
        # tests/conftest.py does setdefault("TRITON_INTERPRET", "1"), so unsetting it would mean the
        # interpreter; "0" is "unset" to triton and to rana's interpreting() and survives setdefault
        env = child_env(ctx, "0")
    runs, skipped, ends = [], [], time.perf_counter() + budget
    for i, cmd in enumerate(cmds):
        if runs and ends - time.perf_counter() < MIN_SECTION / 2:  # the first command always runs
            skipped.append(f"`{' '.join(cmd[3:])}`")
            continue
        runs.append(run_child(cmd, env, ends - time.perf_counter(), ctx.logs / f"tests_{i}.log"))
    # pytest's exit code 5 is "no test selected": a checkout without CUDA tests has nothing to fail
    status = _worst([_status(r, (0, 5)) for r in runs])
    notes = [f"`{' '.join(r['cmd'][3:])}`: {_last_line(r['tail'])}" for r in runs]
    if not ctx.smoke:
        notes.append("TRITON_INTERPRET=0: the Triton kernels run compiled on the GPU")
    notes += [f"skipped for time: {c}" for c in skipped]
    outputs = write_report(ctx, "gpu_tests", "CUDA tests" + (" (smoke: CPU, skips only)" if ctx.smoke else ""), runs, notes)
    return Outcome(status, "; ".join(notes), outputs, skipped, commands=[r["cmd"] for r in runs])


def _budget_flag(usage: str) -> str | None:
    """The command's time-limit option, as its --help spells it (the tuner has --budget)."""
    for flag in ("--time-budget", "--budget"):
        if re.search(rf"(?<![\w-]){flag}(?![\w-])", usage):
            return flag
    return None


def section_tuner(ctx: Ctx, budget: float) -> Outcome:
    env, began = child_env(ctx, "1" if ctx.smoke else None), time.perf_counter()
    usage = _help_text(["-m", TUNER], env, timeout=min(60.0, budget / 3))
    if usage is None:
        note = f"skipped: `python -m {TUNER}` does not exist here yet, so no tuned table was made or shipped"
        return Outcome("skipped", note, write_report(ctx, "gpu_tuner", "Kernel tuner", [], [note]))
    table = ctx.results / "gemv_configs.json"
    # the tuner merges this GPU's entries into --out: start from the shipped table so that copying the
    # result back keeps the other GPUs' entries (and never from an earlier run's leftover)
    table.unlink(missing_ok=True)
    if SHIPPED_TABLE.exists() and not ctx.smoke:
        shutil.copyfile(SHIPPED_TABLE, table)
    cmd = [sys.executable, "-m", TUNER, "--out", str(table)] + (["--smoke"] if ctx.smoke else [])
    left, flag = budget - (time.perf_counter() - began), _budget_flag(usage)
    if flag:
        cmd += [flag, f"{_child_budget(left):.0f}"]
    run = run_child(cmd, env, left, ctx.logs / "tuner.log")
    status, notes = _status(run), [_last_line(run["tail"])]
    if status == "pass" and not table.exists():
        status = "fail"
        notes.append("the tuner exited 0 but wrote no table")
    elif status == "pass" and ctx.smoke:
        notes.append("smoke table (interpreter configs): NOT copied into kernels/")
    elif status == "pass":
        shutil.copyfile(table, SHIPPED_TABLE)
        notes.append(f"{table.name} copied to {SHIPPED_TABLE.relative_to(ROOT)}: the tuned table ships with the package "
                     "(commit it)")
    else:
        table.unlink(missing_ok=True)  # only the shipped table's seed copy: not a result of this run
        notes.append("no table shipped: the tuner did not finish")
    outputs = write_report(ctx, "gpu_tuner", "Kernel tuner", [run], notes) + ([table.name] if table.exists() else [])
    # the tuner reports "N keys skipped for time" on its last line (those keys keep the heuristic)
    left_out = re.search(r"(\d+) keys? skipped", run["tail"])
    skipped = [f"{left_out.group(1)} tuning-table keys (they keep the heuristic)"] if left_out and int(left_out.group(1)) else []
    return Outcome(status, "; ".join(notes), outputs, skipped, commands=[cmd])


def _bench_section(ctx: Ctx, cmd: list[str], stem: Path, budget: float, interpret: str | None, title: str,
                   headline=lambda data: "") -> Outcome:
    """A benchmark script that writes STEM.md/.json itself; the suite reads back what it skipped and
    `headline(report)`, the result in one line for the summary."""
    for old in (stem.with_suffix(".md"), stem.with_suffix(".json")):
        old.unlink(missing_ok=True)  # an earlier run's report must not pass for this one's
    run = run_child(cmd, child_env(ctx, interpret), budget, ctx.logs / f"{stem.name}.log")
    status, skipped, notes = _status(run), [], []
    report = stem.with_suffix(".json")
    if report.exists():
        data = json.loads(report.read_text())
        for key in ("skipped_for_time", "skipped"):
            value = data.get(key) if isinstance(data, dict) else None
            skipped += [str(v) for v in value] if isinstance(value, list) else ([str(value)] if value else [])
        if isinstance(data, dict) and data.get("failures"):
            notes.append(f"{len(data['failures'])} FAILURES (see the report)")
        try:
            notes.insert(0, headline(data))
        except (KeyError, TypeError, IndexError, ValueError):  # another report format: no headline
            pass
    if not stem.with_suffix(".md").exists():  # died before writing: leave its output where it is looked for
        write_report(ctx, stem.name, f"{title}: FAILED before writing its report", [run],
                     ["the benchmark exited without writing its report; its output is below"])
        notes.append("no report written: output tail in " + stem.with_suffix(".md").name)
    elif status != "pass":
        notes.append(_last_line(run["tail"]))
    outputs = [p.name for p in (stem.with_suffix(".md"), stem.with_suffix(".json")) if p.exists()]
    return Outcome(status, "; ".join(n for n in notes if n) or _last_line(run["tail"])[:200], outputs, skipped, [cmd])


def _kernels_headline(data: dict) -> str:
    rana = [r for r in data["records"] if r["kernel"] == "rana" and "ratio" in r]
    met = sum(bool(r["target_met"]) for r in rana)
    below = sum(bool(r.get("below_reference")) for r in rana)
    return f"rana meets f+0.10 in {met}/{len(rana)} cells, is below teal-ref in {below}/{len(rana)}"


def _compress_headline(data: dict) -> str:
    return f"{data['rows'][0]['median_layer_s']:.1f} s per layer ({data['rows'][0]['model']})"


def section_kernels(ctx: Ctx, budget: float) -> Outcome:
    stem = ctx.results / "gpu_kernels"
    cmd = [sys.executable, str(BENCH / "bench_kernels_gpu.py"), "--out", str(stem),
           "--time-budget", f"{_child_budget(budget):.0f}"] + (["--smoke"] if ctx.smoke else [])
    return _bench_section(ctx, cmd, stem, budget, "1" if ctx.smoke else None, "Masked GEMV kernels", _kernels_headline)


def section_decode(ctx: Ctx, budget: float) -> Outcome:
    stem = ctx.results / "gpu_decode"
    cmd = [sys.executable, str(BENCH / "bench_decode_gpu.py"), "--out", str(stem),
           "--time-budget", f"{_child_budget(budget):.0f}"] + (["--smoke"] if ctx.smoke else [])
    return _bench_section(ctx, cmd, stem, budget, "1" if ctx.smoke else None, "End-to-end decode")


def section_compress(ctx: Ctx, budget: float) -> Outcome:
    stem = ctx.results / "gpu_compress"
    with tempfile.TemporaryDirectory(prefix="rana-gpu-suite-") as work:  # the 1-layer checkpoint: ~0.4 GB
        cmd = [sys.executable, str(BENCH / "bench_compress_gpu.py"), "--one-layer", "--out", str(stem),
               "--work", work] + (["--smoke"] if ctx.smoke else [])
        return _bench_section(ctx, cmd, stem, budget, "1" if ctx.smoke else None, "One-layer compression",
                              _compress_headline)


# name -> (share of the deadline, section)
SECTIONS = {
    "tests": (0.20, section_tests),
    "tuner": (0.15, section_tuner),
    "kernels": (0.22, section_kernels),
    "decode": (0.30, section_decode),
    "compress": (0.13, section_compress),
}


# ------------------------------------------------------------------------------------ summary
ENV_PROBE = r"""
import json, platform
info = {"python": platform.python_version()}
try:
    import torch
    info["torch"], info["cuda"] = torch.__version__, torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    l2_mib=round(p.L2_cache_size / 2**20, 1))
    else:
        info["device"] = "cpu (no CUDA device)"
except Exception as e:
    info["torch"] = "unavailable: %r" % (e,)
for name in ("triton", "transformers"):
    try:
        info[name] = __import__(name).__version__
    except Exception as e:
        info[name] = "unavailable: %s" % type(e).__name__
print(json.dumps(info))
"""


def environment(env: dict) -> dict:
    """Device and versions, from a child process: the suite itself never touches CUDA, so no
    section shares the GPU with a context the suite holds."""
    try:
        res = subprocess.run([sys.executable, "-c", ENV_PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as e:
        return {"device": f"unknown (probe failed: {type(e).__name__})"}


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown (git unavailable)"
    if head.returncode != 0:
        return "unknown (not a git checkout)"
    changed = len(dirty.stdout.splitlines())
    return head.stdout.strip() + (f" + {changed} modified tracked files" if changed else "")


def write_summary(ctx: Ctx, meta: dict, rows: list[dict]) -> None:
    lines = [f"# GPU suite on {meta['env'].get('device', 'unknown')}" + (" (SMOKE: CPU, tiny shapes)" if ctx.smoke else ""),
             "", f"- started {meta['started']}, total {meta['total_s']:.0f} s of a {meta['deadline_s']:.0f} s deadline",
             f"- git commit: {meta['commit']}"]
    lines += [f"- {k}: {meta['env'][k]}" for k in ("torch", "cuda", "triton", "transformers", "python", "sm_count",
                                                      "memory_gib", "l2_mib") if k in meta["env"]]
    lines += [f"- command: `{meta['command']}`", "",
              "| # | section | status | wall s | budget s | outputs | notes |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        note = r["note"].replace("|", "/").replace("\n", " ")[:400]
        lines.append(f"| {i} | {r['section']} | {r['status'].upper() if r['status'] != 'pass' else 'pass'} | "
                     f"{r['wall_s']:.1f} | {r['budget_s']:.0f} | {', '.join(r['outputs']) or '—'} | {note} |")
    skipped = [(r["section"], item) for r in rows for item in r["skipped_for_time"]]
    lines += ["", "## Skipped for time", ""] + ([f"- {sec}: {item}" for sec, item in skipped] or ["nothing"])
    lines += ["", f"Full output of every section: {ctx.logs.name}/ (one log per process).", ""]
    (ctx.results / "gpu_suite.md").write_text("\n".join(lines))
    (ctx.results / "gpu_suite.json").write_text(json.dumps({**meta, "sections": rows}, indent=1) + "\n")


# ------------------------------------------------------------------------------------ main
def run_sections(ctx: Ctx, names: list[str], deadline: float, start: float) -> list[dict]:
    """The sections in order, each offered its share of what is left of the deadline (so time one
    leaves unused goes to those after it); a section that would get too little is skipped."""
    rows = []
    for i, name in enumerate(names):
        weight, section = SECTIONS[name]
        left = deadline - (time.perf_counter() - start) - SUMMARY_RESERVE
        budget = left * weight / sum(SECTIONS[n][0] for n in names[i:])
        tag = f"[gpu_suite] {i + 1}/{len(names)} {name}"
        began = time.perf_counter()
        if budget < MIN_SECTION:
            outcome = Outcome("skipped", f"skipped for time: {max(0.0, budget):.0f} s left for it",
                              skipped_for_time=["the whole section"])
        else:
            print(f"{tag}: running (budget {budget:.0f} s)", flush=True)
            try:
                outcome = section(ctx, budget)
            except Exception as e:  # the suite's own bug in one section must not cost the others
                outcome = Outcome("fail", f"the suite failed running this section: {type(e).__name__}: {e}")
        wall = time.perf_counter() - began
        print(f"{tag}: {outcome.status} in {wall:.1f} s" + (f" — {outcome.note[:200]}" if outcome.note else ""), flush=True)
        rows.append({"section": name, "status": outcome.status, "wall_s": wall, "budget_s": budget,
                     "note": outcome.note, "outputs": outcome.outputs, "skipped_for_time": outcome.skipped_for_time,
                     "commands": outcome.commands})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=None, help=f"where gpu_*.md/.json go (default {DEFAULT_RESULTS})")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE, help="seconds for all sections together")
    p.add_argument("--only", nargs="+", choices=list(SECTIONS), default=None, help="run only these sections (in suite order)")
    p.add_argument("--smoke", action="store_true", help="every section on CPU with tiny shapes; needs --results")
    args = p.parse_args(argv)
    if args.smoke and args.results is None:
        p.error("--smoke needs --results (smoke output never goes into benchmarks/results)")
    start = time.perf_counter()
    results = (args.results or DEFAULT_RESULTS).resolve()
    ctx = Ctx(results=results, smoke=args.smoke, logs=results / "gpu_suite_logs", env=dict(os.environ))
    names = [n for n in SECTIONS if args.only is None or n in args.only]
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "deadline_s": args.deadline, "smoke": args.smoke,
            "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else f"main({argv})",
            "commit": git_commit(), "env": environment(child_env(ctx, None))}
    print(f"[gpu_suite] {meta['env'].get('device')}, torch {meta['env'].get('torch')}, "
          f"triton {meta['env'].get('triton')}, commit {meta['commit']}", flush=True)
    if not args.smoke and str(meta["env"].get("device", "")).startswith(("cpu", "unknown")):
        p.error(f"needs a CUDA GPU (found {meta['env'].get('device')}); --smoke checks the suite on CPU")
    results.mkdir(parents=True, exist_ok=True)
    rows = run_sections(ctx, names, args.deadline, start)
    meta["total_s"] = time.perf_counter() - start
    write_summary(ctx, meta, rows)
    bad = [r["section"] for r in rows if r["status"] in ("fail", "timeout")]
    print(f"[gpu_suite] done in {meta['total_s']:.0f} s; {results / 'gpu_suite.md'}"
          + (f"; FAILED: {', '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
