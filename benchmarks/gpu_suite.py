"""Every GPU check of the decode path in ONE command, inside one 10-minute call on the H200 we measure on.

    python benchmarks/gpu_suite.py --results R               # tests, kernels, compress, decode
    python benchmarks/gpu_suite.py --only tuner --results R  # the tuner: a GPU window of its own
    python benchmarks/gpu_suite.py --smoke --results /tmp/s  # every section on CPU, tiny shapes

On the GPU machine run it through benchmarks/gpu_one_command.sh (docs/gpu.md): that installs what the
machine lacks and packs what the suite wrote into $OUT. The machine is lent for 15 minutes in all, at
most 10 per command, so everything here is made to return numbers when it is cut short.

Sections, in this order, each in its own process group (one failure or hang does not stop the rest) and
each with its share of one global deadline (``--deadline``, default 480 s: with the installs and the
packing it leaves more than a minute of the 600 s a command may take; time a section leaves unused goes
to the ones after it):

1. tests    pytest with the Triton interpreter off (TRITON_INTERPRET=0), in priority order: first the
            compiled CUDA decode (tests/test_gpu_decode.py) and the Triton-kernel CUDA tests
            (tests/test_kernels.py, tests/test_decode_ops.py, tests/test_cuda_kernels.py, then any other
            file with `cuda` tests), `-m cuda`; then the CUDA compression matrix of
            tests/test_dtype_device.py cut to three methods × three dtypes (COMPRESSION_CUT). Every
            test's outcome is logged as it happens (benchmarks/gpu_test_log.py), so the report keeps the
            failures, their messages and the test in flight even when pytest is killed; plus junit XML
            → gpu_tests.md/.json, gpu_tests_N.xml/.jsonl
2. kernels  benchmarks/bench_kernels_gpu.py → gpu_kernels.md/.json
3. compress bench_compress_gpu.py --one-layer: one Llama-2-7B-shaped layer → gpu_compress.md/.json
4. decode   benchmarks/bench_decode_gpu.py with what is left: the first-contact selection first (the
            Llama-2-7B-shaped model at F = 0.58 in the step harness, then its profile), the rest while
            time remains, in the same process → gpu_decode.md/.json
5. tuner    only when named (``--only tuner``): ``python -m rana.kernels.gemv_tune`` (bf16 first) on
            RESULTS/gemv_configs.json, seeded from the shipped table; the keys it finished are copied
            into kernels/gemv_configs.json even when it is stopped → gpu_tuner.md/.json

Every benchmark writes its report after each measured cell (benchmarks/atomic_table.py) and checks its
own budget; the suite kills a section that overruns its share and never deletes a report: a benchmark
that wrote nothing gets its output tail in STEM_failed.md instead. SIGTERM (the one command's hard
timeout) stops the section in flight and still writes the summary.

Writes RESULTS/gpu_suite.md + .json (device; torch, triton, transformers versions; git commit; each
section's status, wall time and budget; what was skipped for time) and each process's full output under
RESULTS/gpu_suite_logs/. ``--smoke`` runs every section on CPU with tiny shapes (Triton interpreter for
the kernels; the CUDA tests are collected and skip) and writes only into ``--results``, which it then
requires. Exit code: 0 when no section failed or timed out.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))  # also when a test loads this file by path
from atomic_table import write_report, write_text  # noqa: E402

DEFAULT_RESULTS = BENCH / "results"
SHIPPED_TABLE = ROOT / "kernels" / "gemv_configs.json"
TUNER = "rana.kernels.gemv_tune"
DEFAULT_DEADLINE = 480.0
SUMMARY_RESERVE = 5.0  # seconds kept back from the sections for the summary itself
MIN_SECTION = 10.0  # a section offered less than this is skipped for time: it could only be killed
TAIL = 6000  # characters of a process's output kept in a report

# ------------------------------------------------------------------------------------ what runs
# the tests that matter most on first contact: the only test of the compiled CUDA decode, then the Triton
# kernels on CUDA (the int8 and expert kernels' CUDA tests live in test_cuda_kernels.py)
PRIORITY_TEST_FILES = ("tests/test_gpu_decode.py", "tests/test_kernels.py", "tests/test_decode_ops.py",
                       "tests/test_cuda_kernels.py")
COMPRESSION_TESTS = "tests/test_dtype_device.py"
# its CUDA matrix is 16 method/allocation pairs × 3 dtypes, each compression under a TorchDispatchMode
# (100-400 s on the H200: more than the section has). Three methods × the three dtypes: rana (the
# product), teal (input sparsity, the decode kernels' method) and larosa (rotations: another math path)
COMPRESSION_CUT = ("test_cuda_compression_keeps_the_work_on_the_gpu and "
                   "([rana-uniform- or [teal-uniform- or [larosa-uniform-)")
COMPRESSION_RESERVE = 0.3  # of the tests section, kept for the compression matrix while the first command runs
TEST_PLUGIN = "gpu_test_log"  # benchmarks/gpu_test_log.py

# the decode benchmark's selection, in priority order: the first model at F = 0.58 in the step harness is
# the first-contact number; the rest follows in the same process while its budget lasts
DECODE_MODELS = ("llama-2-7b-shaped", "llama-3-8b-shaped")
DECODE_BUDGETS = ("0.58", "0.85", "0.70", "0.50")
DECODE_HARNESSES = ("step", "compiled")


class SuiteStopped(Exception):
    """SIGTERM: the one command's hard timeout. The section in flight is killed; the summary is still written."""


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


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it ended between the timeout and the kill
        pass


def run_child(cmd: list[str], env: dict, timeout: float, log: Path) -> dict:
    """Run `cmd` in its own process group, output to `log`; on timeout (or when the suite itself is
    stopped) kill that group, its own workers too (e.g. inductor's compile pool). Returns rc, wall_s,
    timed_out and the output tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    with open(log, "w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc, timed_out = proc.wait(timeout=max(1.0, timeout)), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            rc, timed_out = proc.wait(), True
        except BaseException:  # SuiteStopped: no child may outlive the suite
            _kill_group(proc)
            proc.wait()
            raise
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


def write_output_report(ctx: Ctx, stem: str, title: str, runs: list[dict], notes: list[str]) -> list[str]:
    """RESULTS/<stem>.md + .json for a section whose product is its processes' output (the tuner), or for a
    benchmark that wrote no report of its own."""
    lines = [f"# {title}", ""] + [f"- {n}" for n in notes] + [""]
    for r in runs:
        lines += [f"## `{' '.join(r['cmd'][1:])}`", "",
                  f"exit code {r['rc']}{' (killed: out of time)' if r['timed_out'] else ''}, {r['wall_s']:.1f} s", ""]
        lines += _fenced(r["tail"]) + [""]
    write_report(ctx.results / stem, {"title": title, "notes": notes, "runs": runs}, "\n".join(lines))
    return [f"{stem}.md", f"{stem}.json"]


def _worst(statuses: list[str]) -> str:
    for status in ("timeout", "fail", "pass"):
        if status in statuses:
            return status
    return "skipped"


def _last_line(text: str) -> str:
    lines = [l.strip() for l in text.splitlines() if l.strip()]
    return lines[-1] if lines else "(no output)"


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return None


# ------------------------------------------------------------------------------------ tests
def cuda_test_files() -> list[str]:
    """The test files that use the cuda marker."""
    return [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").glob("test_*.py"))
            if "mark.cuda" in p.read_text(errors="replace")]


@dataclass
class TestCommand:
    label: str
    args: list  # pytest's arguments after the suite's common ones
    reserve_after: float  # fraction of the section's budget kept for the commands after this one


def test_commands() -> list[TestCommand]:
    """The section's pytest runs in priority order (files that do not exist are left out)."""
    first = [f for f in PRIORITY_TEST_FILES if (ROOT / f).exists()]
    first += [f for f in cuda_test_files() if f not in first and f != COMPRESSION_TESTS]
    cmds = [TestCommand("compiled CUDA decode and Triton kernels", ["-m", "cuda", *first], COMPRESSION_RESERVE)]
    cmds = cmds if first else []
    if (ROOT / COMPRESSION_TESTS).exists():
        cmds.append(TestCommand("compression on CUDA (3 methods × 3 dtypes)",
                                ["-m", "cuda", COMPRESSION_TESTS, "-k", COMPRESSION_CUT], 0.0))
    return cmds


def read_test_log(path: Path) -> dict:
    """What a gpu_test_log file says: counts by outcome, failures with their messages, skip reasons, the
    tests started but never finished (in flight when pytest was killed), collection errors."""
    outcome: dict[str, str] = {}
    failures, skipped, started, finished, collect = [], {}, [], set(), []
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines() if path.exists() else []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:  # the line a kill cut short
            continue
        if e.get("event") == "start":
            started.append(e["nodeid"])
        elif e.get("event") == "collect_error":
            collect.append({"nodeid": e["nodeid"], "message": e.get("message", "")})
        elif e.get("event") == "report":
            node, when, result = e["nodeid"], e["when"], e["outcome"]
            if result == "failed":
                outcome[node] = "failed" if when == "call" else "error"
                failures.append({"nodeid": node, "when": when, "message": e.get("message", "")})
            elif result == "skipped":
                outcome.setdefault(node, "skipped")
                reason = e.get("message") or "(no reason)"
                skipped[reason] = skipped.get(reason, 0) + 1
            elif when == "call":
                outcome.setdefault(node, "passed")
            if when == "teardown":
                finished.add(node)
    counts = {k: sum(v == k for v in outcome.values()) for k in ("passed", "failed", "error", "skipped")}
    return {"counts": counts, "failures": failures, "skipped": skipped, "collect_errors": collect,
            "in_flight": [n for n in dict.fromkeys(started) if n not in finished]}


def _test_summary(log: dict) -> str:
    c = log["counts"]
    parts = [f"{c['passed']} passed", f"{c['failed']} failed"] + [f"{c[k]} {k}" for k in ("error", "skipped") if c[k]]
    if log["collect_errors"]:
        parts.append(f"{len(log['collect_errors'])} files failed to collect")
    return ", ".join(parts)


def _test_run_lines(i: int, run: dict) -> list[str]:
    log = run["log"]
    head = (f"`pytest {' '.join(run['cmd'][3:])}`: exit code {run['rc']}, {run['wall_s']:.1f} s"
            + (" — **KILLED at its time limit**" if run["timed_out"] else ""))
    lines = [f"## {i}. {run['label']}", "", head, "", f"**{_test_summary(log)}**", ""]
    if log["in_flight"]:
        lines += ["Running when pytest ended (killed, or it crashed):", ""]
        lines += [f"- `{n}`" for n in log["in_flight"]] + [""]
    for title, items in (("Collection errors", log["collect_errors"]), ("Failures", log["failures"])):
        if items:
            lines += [f"### {title}", ""]
            for f in items:
                lines += [f"- `{f['nodeid']}`" + (f" ({f['when']})" if f.get("when", "call") != "call" else ""), ""]
                lines += _fenced(f["message"][-1500:]) + [""]
    if log["skipped"]:
        lines += ["### Skipped", ""] + [f"- {n} × {reason}" for reason, n in sorted(log["skipped"].items())] + [""]
    lines += ["### Output (end)", ""] + _fenced(run["tail"][-2500:]) + [""]
    return lines


def section_tests(ctx: Ctx, budget: float) -> Outcome:
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", TEST_PLUGIN, "-v", "-rA",
            "--continue-on-collection-errors"]
    # tests/conftest.py does setdefault("TRITON_INTERPRET", "1"), so unsetting it would mean the
    # interpreter; "0" is "unset" to triton and to rana's interpreting() and survives setdefault
    env = child_env(ctx, "1" if ctx.smoke else "0")
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    runs, skipped, outputs, ends = [], [], [], time.perf_counter() + budget
    commands = test_commands()
    try:
        for i, command in enumerate(commands, 1):
            left = ends - time.perf_counter()
            if runs and left < MIN_SECTION / 2:  # the first command always runs
                skipped.append(f"{command.label}: `pytest {' '.join(command.args)}`")
                continue
            progress, junit = ctx.results / f"gpu_tests_{i}.jsonl", ctx.results / f"gpu_tests_{i}.xml"
            write_text(progress, "")  # this run's log only
            junit_before = _mtime(junit)
            cmd = base + [f"--junitxml={junit}", *command.args]
            limit = left - budget * command.reserve_after if i < len(commands) else left
            run = {"label": command.label, "log": {}}
            try:
                run.update(run_child(cmd, {**env, "RANA_TEST_LOG": str(progress)}, max(limit, MIN_SECTION / 2),
                                     ctx.logs / f"tests_{i}.log"))
            except SuiteStopped:
                run.update(cmd=cmd, rc=-signal.SIGKILL, wall_s=0.0, timed_out=True,
                           tail="(the suite was stopped while this command ran)")
                raise
            finally:
                run["log"] = read_test_log(progress)
                if "cmd" in run:
                    runs.append(run)
                junit_written = junit.exists() and _mtime(junit) != junit_before  # pytest writes it at the end
                outputs += [progress.name] + ([junit.name] if junit_written else [])
    finally:
        notes = [f"{r['label']}: {_test_summary(r['log'])}" + (" (KILLED at its time limit)" if r["timed_out"] else "")
                 for r in runs]
        notes += [f"{len(r['log']['failures'])} FAILURES in {r['label']}" for r in runs if r["log"]["failures"]]
        notes += [f"skipped for time: {c}" for c in skipped]
        title = "CUDA tests" + (" (smoke: CPU, skips only)" if ctx.smoke
                                else " (TRITON_INTERPRET=0: compiled on the GPU)")
        lines = [f"# {title}", ""] + [f"- {n}" for n in notes] + [""]
        for i, run in enumerate(runs, 1):
            lines += _test_run_lines(i, run)
        write_report(ctx.results / "gpu_tests", {"title": title, "notes": notes, "runs": runs}, "\n".join(lines))
    return Outcome(_worst([_test_status(r) for r in runs]), "; ".join(notes),
                   ["gpu_tests.md", "gpu_tests.json"] + outputs, skipped, commands=[r["cmd"] for r in runs])


def _test_status(run: dict) -> str:
    """timeout when killed; fail on any failure or collection error, or an exit code other than 0 and 5
    (pytest's "no test selected": a checkout without CUDA tests has nothing to fail); else pass."""
    if run["timed_out"]:
        return "timeout"
    log = run["log"]
    return "fail" if log["failures"] or log["collect_errors"] or run["rc"] not in (0, 5) else "pass"


# ------------------------------------------------------------------------------------ tuner
def tuned_keys(seed: dict, table: dict) -> list[str]:
    """The GPU/key entries of `table` that this run measured: new or changed against the seed."""
    before, after = seed.get("measured", {}), table.get("measured", {})
    return [f"{gpu}: {key}" for gpu, entries in after.items() if isinstance(entries, dict)
            for key, value in entries.items() if before.get(gpu, {}).get(key) != value]


def ship_tuned(seed: dict, table: Path, smoke: bool) -> list[str]:
    """The entries this run tuned into `table`; unless `smoke`, the table then replaces the shipped one
    (atomically; it was seeded from it, so the other GPUs' entries are kept). Each key in it was written
    whole, so a tuner stopped mid-way still ships every key it finished."""
    tuned = tuned_keys(seed, _read_json(table))
    if tuned and not smoke:
        write_text(SHIPPED_TABLE, table.read_text(encoding="utf-8"))
    return tuned


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def section_tuner(ctx: Ctx, budget: float) -> Outcome:
    env = child_env(ctx, "1" if ctx.smoke else None)
    table = ctx.results / "gemv_configs.json"
    # the tuner merges this GPU's entries into --out: seeded from the shipped table, so that copying the
    # result back keeps the other GPUs' entries (and never from an earlier run's leftover)
    seed = _read_json(SHIPPED_TABLE) or {"format": 1, "gpus": {}}
    write_text(table, json.dumps(seed, indent=1, sort_keys=True) + "\n")
    cmd = [sys.executable, "-m", TUNER, "--out", str(table), "--budget", f"{_child_budget(budget):.0f}"]
    cmd += ["--smoke"] if ctx.smoke else []
    try:
        run = run_child(cmd, env, budget, ctx.logs / "tuner.log")
    finally:  # killed, stopped or done: every key the tuner finished ships
        tuned = ship_tuned(seed, table, ctx.smoke)
    status, notes = _status(run), [_last_line(run["tail"])]
    if not tuned:
        notes.append(f"no key tuned: {SHIPPED_TABLE.relative_to(ROOT)} unchanged")
    elif ctx.smoke:
        notes.append(f"{len(tuned)} keys tuned; smoke table (interpreter configs): NOT copied into kernels/")
    else:
        notes.append(f"{len(tuned)} keys tuned" + ("" if status == "pass" else " before the tuner was stopped")
                     + f", copied into {SHIPPED_TABLE.relative_to(ROOT)}: the tuned table ships with the package "
                     "(commit it)")
    if "WRONG RESULT" in run["tail"]:
        notes.append("configs gave WRONG results (see the report): a kernel bug")
    outputs = write_output_report(ctx, "gpu_tuner", "Kernel tuner", [run], notes) + [table.name]
    # the tuner reports "N keys skipped for time" on its last line (those keys keep the heuristic)
    left_out = re.search(r"(\d+) keys? skipped", run["tail"])
    skipped = ([f"{left_out.group(1)} tuning-table keys (they keep the heuristic)"]
               if left_out and int(left_out.group(1)) else [])
    return Outcome(status, "; ".join(notes), outputs, skipped, commands=[cmd])


# ------------------------------------------------------------------------------------ benchmarks
def _bench_section(ctx: Ctx, cmd: list[str], stem: Path, budget: float, interpret: str | None, title: str,
                   headline=lambda data: "") -> Outcome:
    """A benchmark script that writes STEM.md/.json itself after each cell; the suite reads back what it
    skipped, its failures and `headline(report)`, the result in one line for the summary. A report the
    run did not write (an earlier run's) is left as it is and not read."""
    md, js = stem.with_suffix(".md"), stem.with_suffix(".json")
    before = {p: _mtime(p) for p in (md, js)}
    fresh = lambda p: p.exists() and _mtime(p) != before[p]  # noqa: E731
    run = run_child(cmd, child_env(ctx, interpret), budget, ctx.logs / f"{stem.name}.log")
    status, skipped, notes, outputs = _status(run), [], [], [p.name for p in (md, js) if fresh(p)]
    data = _read_json(js) if fresh(js) else {}
    for key in ("skipped_for_time", "skipped"):
        value = data.get(key)
        skipped += [str(v) for v in value] if isinstance(value, list) else ([str(value)] if value else [])
    if data.get("failures"):
        notes.append(f"{len(data['failures'])} FAILURES (see the report)")
    if data and data.get("complete") is False:
        in_flight = f" (in flight: {data['running']})" if data.get("running") else ""
        notes.append("PARTIAL report: stopped before the end" + in_flight)
    try:
        notes.insert(0, headline(data))
    except (KeyError, TypeError, IndexError, ValueError, StopIteration):  # nothing measured yet: no headline
        pass
    if not fresh(md):  # died before writing: its output goes where it is looked for, beside any earlier report
        outputs += write_output_report(ctx, f"{stem.name}_failed", f"{title}: FAILED before writing its report", [run],
                                       ["the benchmark exited without writing its report; its output is below"])
        notes.append(f"no report written: output tail in {stem.name}_failed.md")
    elif status != "pass":
        notes.append(_last_line(run["tail"]))
    return Outcome(status, "; ".join(n for n in notes if n) or _last_line(run["tail"])[:200], outputs, skipped, [cmd])


def _kernels_headline(data: dict) -> str:
    rana = [r for r in data["records"] if r["kernel"] == "rana" and "ratio" in r]
    met = sum(bool(r["target_met"]) for r in rana)
    below = sum(bool(r.get("below_reference")) for r in rana)
    return f"rana meets f+0.10 in {met}/{len(rana)} cells, is below teal-ref in {below}/{len(rana)}"


def _decode_headline(data: dict) -> str:
    return "; ".join(f"{r['model']} F={r['budget']} {r['harness']}: {r['speedup']:.2f}x dense" for r in data["records"])


def _compress_headline(data: dict) -> str:
    row = next(r for r in data["rows"] if "median_layer_s" in r)
    return f"{row['median_layer_s']:.1f} s per layer ({row['model']})"


def section_kernels(ctx: Ctx, budget: float) -> Outcome:
    stem = ctx.results / "gpu_kernels"
    cmd = [sys.executable, str(BENCH / "bench_kernels_gpu.py"), "--out", str(stem),
           "--time-budget", f"{_child_budget(budget):.0f}"] + (["--smoke"] if ctx.smoke else [])
    return _bench_section(ctx, cmd, stem, budget, "1" if ctx.smoke else None, "Masked GEMV kernels", _kernels_headline)


def section_decode(ctx: Ctx, budget: float) -> Outcome:
    stem = ctx.results / "gpu_decode"
    selection = [] if ctx.smoke else ["--models", *DECODE_MODELS, "--budgets", *DECODE_BUDGETS,
                                      "--harnesses", *DECODE_HARNESSES]
    cmd = [sys.executable, str(BENCH / "bench_decode_gpu.py"), "--out", str(stem),
           "--time-budget", f"{_child_budget(budget):.0f}", *selection] + (["--smoke"] if ctx.smoke else [])
    return _bench_section(ctx, cmd, stem, budget, "1" if ctx.smoke else None, "End-to-end decode", _decode_headline)


def section_compress(ctx: Ctx, budget: float) -> Outcome:
    stem = ctx.results / "gpu_compress"
    with tempfile.TemporaryDirectory(prefix="rana-gpu-suite-") as work:  # the 1-layer checkpoint: ~0.4 GB
        cmd = [sys.executable, str(BENCH / "bench_compress_gpu.py"), "--one-layer", "--out", str(stem),
               "--work", work, "--time-budget", f"{_child_budget(budget):.0f}"] + (["--smoke"] if ctx.smoke else [])
        return _bench_section(ctx, cmd, stem, budget, "1" if ctx.smoke else None, "One-layer compression",
                              _compress_headline)


# name -> (share of the deadline, section)
SECTIONS = {
    "tests": (0.24, section_tests),
    "kernels": (0.16, section_kernels),
    "compress": (0.18, section_compress),
    "decode": (0.42, section_decode),
    "tuner": (1.0, section_tuner),
}
DEFAULT_SECTIONS = ("tests", "kernels", "compress", "decode")  # the tuner takes a GPU window of its own


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
    """HEAD (+ how many tracked files differ); RANA_COMMIT where the copy has no .git (the GPU machine's)."""
    given = os.environ.get("RANA_COMMIT")
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return f"{given} (from RANA_COMMIT)" if given else "unknown (git unavailable)"
    if head.returncode != 0:
        return f"{given} (from RANA_COMMIT)" if given else "unknown (not a git checkout)"
    changed = len(dirty.stdout.splitlines())
    return head.stdout.strip() + (f" + {changed} modified tracked files" if changed else "")


def write_summary(ctx: Ctx, meta: dict, rows: list[dict]) -> None:
    lines = [f"# GPU suite on {meta['env'].get('device', 'unknown')}" + (" (SMOKE: CPU, tiny shapes)" if ctx.smoke else ""),
             "", f"- started {meta['started']}, total {meta['total_s']:.0f} s of a {meta['deadline_s']:.0f} s deadline",
             f"- git commit: {meta['commit']}"]
    lines += [f"- {k}: {meta['env'][k]}" for k in ("torch", "cuda", "triton", "transformers", "python", "sm_count",
                                                      "memory_gib", "l2_mib") if k in meta["env"]]
    if meta.get("stopped"):
        lines.append(f"- **STOPPED**: {meta['stopped']}")
    lines += [f"- command: `{meta['command']}`", "",
              "| # | section | status | wall s | budget s | outputs | notes |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rows, 1):
        note = r["note"].replace("|", "/").replace("\n", " ")[:400]
        lines.append(f"| {i} | {r['section']} | {r['status'].upper() if r['status'] != 'pass' else 'pass'} | "
                     f"{r['wall_s']:.1f} | {r['budget_s']:.0f} | {', '.join(r['outputs']) or '—'} | {note} |")
    skipped = [(r["section"], item) for r in rows for item in r["skipped_for_time"]]
    lines += ["", "## Skipped for time", ""] + ([f"- {sec}: {item}" for sec, item in skipped] or ["nothing"])
    lines += ["", f"Full output of every section: {ctx.logs.name}/ (one log per process).", ""]
    write_report(ctx.results / "gpu_suite", {**meta, "sections": rows}, "\n".join(lines))


# ------------------------------------------------------------------------------------ main
def run_sections(ctx: Ctx, names: list[str], deadline: float, start: float, meta: dict) -> list[dict]:
    """The sections in order, each offered its share of what is left of the deadline (so time one
    leaves unused goes to those after it); a section that would get too little is skipped. When the
    suite is stopped (SIGTERM), the section in flight is killed and the rest are listed as not run."""
    rows = []
    for i, name in enumerate(names):
        weight, section = SECTIONS[name]
        left = deadline - (time.perf_counter() - start) - SUMMARY_RESERVE
        budget = left * weight / sum(SECTIONS[n][0] for n in names[i:])
        tag = f"[gpu_suite] {i + 1}/{len(names)} {name}"
        began = time.perf_counter()
        if meta.get("stopped"):
            outcome = Outcome("skipped", "not run: the suite was stopped", skipped_for_time=["the whole section"])
        elif budget < MIN_SECTION:
            outcome = Outcome("skipped", f"skipped for time: {max(0.0, budget):.0f} s left for it",
                              skipped_for_time=["the whole section"])
        else:
            print(f"{tag}: running (budget {budget:.0f} s)", flush=True)
            try:
                outcome = section(ctx, budget)
            except SuiteStopped as e:
                meta["stopped"] = f"{e} during {name}"
                outcome = Outcome("timeout", f"killed: {e} (what it wrote before is kept)")
            except Exception as e:  # the suite's own bug in one section must not cost the others
                outcome = Outcome("fail", f"the suite failed running this section: {type(e).__name__}: {e}")
        wall = time.perf_counter() - began
        print(f"{tag}: {outcome.status} in {wall:.1f} s" + (f" — {outcome.note[:200]}" if outcome.note else ""), flush=True)
        rows.append({"section": name, "status": outcome.status, "wall_s": wall, "budget_s": budget,
                     "note": outcome.note, "outputs": outcome.outputs, "skipped_for_time": outcome.skipped_for_time,
                     "commands": outcome.commands})
    return rows


def _stop(signum, frame):
    raise SuiteStopped(f"signal {signal.Signals(signum).name}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=None, help=f"where gpu_*.md/.json go (default {DEFAULT_RESULTS})")
    p.add_argument("--deadline", type=float, default=DEFAULT_DEADLINE, help="seconds for all sections together")
    p.add_argument("--only", nargs="+", choices=list(SECTIONS), default=None,
                   help=f"run these sections (in suite order; default {' '.join(DEFAULT_SECTIONS)})")
    p.add_argument("--smoke", action="store_true", help="every section on CPU with tiny shapes; needs --results")
    args = p.parse_args(argv)
    if args.smoke and args.results is None:
        p.error("--smoke needs --results (smoke output never goes into benchmarks/results)")
    start = time.perf_counter()
    results = (args.results or DEFAULT_RESULTS).resolve()
    ctx = Ctx(results=results, smoke=args.smoke, logs=results / "gpu_suite_logs", env=dict(os.environ))
    names = [n for n in SECTIONS if (n in args.only if args.only else n in DEFAULT_SECTIONS)]
    meta = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "deadline_s": args.deadline, "smoke": args.smoke,
            "command": " ".join([Path(sys.executable).name, *sys.argv]) if argv is None else f"main({argv})",
            "commit": git_commit(), "env": environment(child_env(ctx, None))}
    print(f"[gpu_suite] {meta['env'].get('device')}, torch {meta['env'].get('torch')}, "
          f"triton {meta['env'].get('triton')}, commit {meta['commit']}", flush=True)
    if not args.smoke and str(meta["env"].get("device", "")).startswith(("cpu", "unknown")):
        p.error(f"needs a CUDA GPU (found {meta['env'].get('device')}); --smoke checks the suite on CPU")
    results.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        rows = run_sections(ctx, names, args.deadline, start, meta)
    finally:
        signal.signal(signal.SIGTERM, previous)
    meta["total_s"] = time.perf_counter() - start
    write_summary(ctx, meta, rows)
    bad = [r["section"] for r in rows if r["status"] in ("fail", "timeout")]
    print(f"[gpu_suite] done in {meta['total_s']:.0f} s; {results / 'gpu_suite.md'}"
          + (f"; FAILED: {', '.join(bad)}" if bad else ""), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
