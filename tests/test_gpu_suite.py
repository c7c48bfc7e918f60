"""benchmarks/gpu_suite.py and the one command (benchmarks/gpu_one_command.sh) on CPU: --smoke runs every
section (tiny shapes, Triton interpreter) and the one command leaves its few files in $OUT; the deadline is
shared out and enforced; one failing or hanging section does not stop the ones after it; SIGTERM stops the
section in flight and still writes the summary; the test section's log survives a kill."""
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_suite.py"
ONE_COMMAND = REPO / "benchmarks" / "gpu_one_command.sh"
DEFAULT = ["tests", "kernels", "compress", "decode"]


def load_suite(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "environment", lambda env: {"device": "test", "torch": "x"})  # no torch import
    return module


@pytest.fixture
def suite(monkeypatch):
    return load_suite(monkeypatch)


def one_command(out: Path, *flags: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1"}
    env.pop("TRITON_INTERPRET", None)  # the suite sets it per section, as on the GPU machine
    return subprocess.run(["bash", str(ONE_COMMAND), "--smoke", *flags], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


# every section's smoke run through the one command takes a minute; the default run proves the wrapper with
# the tuner alone (below) and each section in tests/test_gpu_suite_sections.py, and `make test-device-versions`
# (benchmarks/device_versions.sh sets RANA_DEVICE_VERSIONS) runs this one under the GPU machine's versions
@pytest.mark.skipif(not os.environ.get("RANA_DEVICE_VERSIONS"), reason="make test-device-versions runs it")
def test_the_one_command_runs_every_section_and_leaves_its_files_in_out(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "out"
    res = one_command(out, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == ["console.log", "env.txt", "gpu_results.tgz", "gpu_suite.md"]  # the machine returns ≤ 8
    assert all((out / f).stat().st_size < 16 * 2**20 for f in files)
    assert "commit:" in (out / "env.txt").read_text() and "[gpu_suite] done" in (out / "console.log").read_text()
    results = tmp_path / "results"
    with tarfile.open(out / "gpu_results.tgz") as tar:
        tar.extractall(results, filter="data")
    data = json.loads((results / "gpu_suite.json").read_text())
    assert [(s["section"], s["status"]) for s in data["sections"]] == [(n, "pass") for n in DEFAULT]
    assert (results / "gpu_suite.md").read_text() == (out / "gpu_suite.md").read_text()
    summary = (out / "gpu_suite.md").read_text()
    assert all(f"| {name} |" in summary for name in DEFAULT) and "git commit" in summary and "triton" in summary
    for stem in ("gpu_tests", "gpu_kernels", "gpu_decode", "gpu_compress"):
        assert (results / f"{stem}.md").exists() and (results / f"{stem}.json").exists()
    assert {"gpu_tests_1.xml", "gpu_tests_1.jsonl", "gpu_tests_2.xml"} <= {p.name for p in results.iterdir()}
    tests = json.loads((results / "gpu_tests.json").read_text())
    assert tests["runs"][0]["log"]["counts"]["skipped"] > 0  # on CPU the CUDA tests only report their skips
    assert "gpu_suite_logs" in {p.name for p in results.iterdir()}


def test_the_one_command_runs_the_tuner_alone_and_returns_its_table(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "out"
    res = one_command(out, "--tuner", timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["console.log", "env.txt", "gemv_configs.json", "gpu_results.tgz",
                                                     "gpu_suite.md"]
    table = json.loads((out / "gemv_configs.json").read_text())
    assert table["gpus"]["cpu (smoke)"] and "| tuner |" in (out / "gpu_suite.md").read_text()


def test_smoke_needs_results(suite):
    with pytest.raises(SystemExit):
        suite.main(["--smoke"])


def test_a_spent_deadline_skips_every_section_for_time(suite, tmp_path):
    assert suite.main(["--smoke", "--results", str(tmp_path), "--deadline", "1"]) == 0
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert [(s["section"], s["status"]) for s in data["sections"]] == [(n, "skipped") for n in DEFAULT]
    assert (tmp_path / "gpu_suite.md").read_text().count("the whole section") == len(DEFAULT)


def _child_section(suite, code, limit=3.0):
    def section(ctx, budget):
        run = suite.run_child([sys.executable, "-c", code], suite.child_env(ctx, None), min(budget, limit),
                              ctx.logs / "child.log")
        return suite.Outcome(suite._status(run), suite._last_line(run["tail"]))
    return section


def test_a_hanging_or_failing_section_does_not_stop_the_rest(suite, tmp_path, monkeypatch):
    def broken(ctx, budget):
        raise RuntimeError("a bug in the suite")

    monkeypatch.setattr(suite, "SECTIONS", {"hang": (0.3, _child_section(suite, "import time; time.sleep(600)")),
                                            "broken": (0.2, broken),
                                            "fail": (0.2, _child_section(suite, "raise SystemExit(3)")),
                                            "ok": (0.3, _child_section(suite, "print('fine')"))})
    monkeypatch.setattr(suite, "DEFAULT_SECTIONS", ("hang", "broken", "fail", "ok"))
    assert suite.main(["--results", str(tmp_path), "--deadline", "100"]) == 1
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert [(s["section"], s["status"]) for s in data["sections"]] == [
        ("hang", "timeout"), ("broken", "fail"), ("fail", "fail"), ("ok", "pass")]
    assert data["sections"][-1]["note"] == "fine"
    # time the earlier sections left unused went to the later ones
    assert data["sections"][-1]["budget_s"] > 0.3 * 100


def test_sigterm_kills_the_section_in_flight_and_still_writes_the_summary(suite, tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    monkeypatch.setattr(suite, "SECTIONS", {"hang": (0.5, _child_section(suite, code, limit=600)),
                                            "after": (0.5, _child_section(suite, "print('never')"))})
    monkeypatch.setattr(suite, "DEFAULT_SECTIONS", ("hang", "after"))

    def terminate_once_the_child_runs():
        for _ in range(600):
            if pid_file.exists() and pid_file.read_text():
                break
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_once_the_child_runs, daemon=True).start()
    assert suite.main(["--results", str(tmp_path), "--deadline", "600"]) == 1
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert [(s["section"], s["status"]) for s in data["sections"]] == [("hang", "timeout"), ("after", "skipped")]
    assert "SIGTERM" in data["stopped"] and "STOPPED" in (tmp_path / "gpu_suite.md").read_text()
    with pytest.raises(ProcessLookupError):  # no child outlives the suite
        os.kill(int(pid_file.read_text()), 0)
    assert signal.getsignal(signal.SIGTERM) is not suite._stop  # the handler is the suite's only while it runs


def test_default_sections_share_the_deadline_and_the_tuner_runs_alone(suite):
    assert list(suite.DEFAULT_SECTIONS) == DEFAULT == [n for n in suite.SECTIONS if n != "tuner"]
    assert abs(sum(suite.SECTIONS[n][0] for n in DEFAULT) - 1.0) < 1e-9


def test_the_test_section_runs_the_compiled_decode_and_kernels_first_and_the_cut_matrix_last(suite):
    commands = suite.test_commands()
    first, last = commands[0].args, commands[-1].args
    files = [a for a in first if a.startswith("tests/")]
    assert first[:2] == ["-m", "cuda"] and files[0] == "tests/test_gpu_decode.py"
    assert files[:len(suite.PRIORITY_TEST_FILES)] == [f for f in suite.PRIORITY_TEST_FILES if (REPO / f).exists()]
    assert "tests/test_dtype_device.py" not in files
    assert set(suite.cuda_test_files()) - {"tests/test_dtype_device.py"} <= set(files)  # every other CUDA file
    assert last[:3] == ["-m", "cuda", "tests/test_dtype_device.py"] and last[3] == "-k"


def test_the_cut_compression_matrix_is_three_methods_in_three_dtypes(suite):
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--collect-only", "-q", "-m", "cuda",
                          "tests/test_dtype_device.py", "-k", suite.COMPRESSION_CUT],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    ids = [line.split("[", 1)[1].rstrip("]") for line in res.stdout.splitlines() if "::" in line]
    assert {i.rsplit("-", 2)[0] for i in ids} == {"rana", "teal", "larosa"}
    assert {i.rsplit("-", 1)[1] for i in ids} == {"bfloat16", "float16", "float32"}
    assert len(ids) == 9, res.stdout[-2000:]


def test_the_test_log_reader_keeps_failures_skips_and_the_test_in_flight(suite, tmp_path):
    log = tmp_path / "t.jsonl"
    events = [{"event": "start", "nodeid": "a"},
              {"event": "report", "nodeid": "a", "when": "setup", "outcome": "passed"},
              {"event": "report", "nodeid": "a", "when": "call", "outcome": "passed"},
              {"event": "report", "nodeid": "a", "when": "teardown", "outcome": "passed"},
              {"event": "start", "nodeid": "b"},
              {"event": "report", "nodeid": "b", "when": "call", "outcome": "failed", "message": "E  assert 1 == 2"},
              {"event": "report", "nodeid": "b", "when": "teardown", "outcome": "passed"},
              {"event": "start", "nodeid": "c"},
              {"event": "report", "nodeid": "c", "when": "setup", "outcome": "skipped", "message": "Skipped: no GPU"},
              {"event": "report", "nodeid": "c", "when": "teardown", "outcome": "passed"},
              {"event": "start", "nodeid": "d"}]
    log.write_text("".join(json.dumps(e) + "\n" for e in events) + '{"event": "report", "nodeid": "d", "wh')
    read = suite.read_test_log(log)
    assert read["counts"] == {"passed": 1, "failed": 1, "error": 0, "skipped": 1}
    assert read["failures"] == [{"nodeid": "b", "when": "call", "message": "E  assert 1 == 2"}]
    assert read["skipped"] == {"Skipped: no GPU": 1} and read["in_flight"] == ["d"]


def test_the_tuner_table_ships_every_key_it_finished_and_smoke_tables_never(suite, tmp_path, monkeypatch):
    shipped = tmp_path / "shipped.json"
    monkeypatch.setattr(suite, "SHIPPED_TABLE", shipped)
    seed = {"format": 1, "gpus": {"Other": {"k": [64, 64, 1, 4]}}, "measured": {"Other": {"k": {"us": 1.0}}}}
    table = tmp_path / "gemv_configs.json"
    table.write_text(json.dumps(seed))
    assert suite.ship_tuned(seed, table, smoke=False) == [] and not shipped.exists()  # nothing new: nothing copied
    tuned = {**seed, "gpus": {**seed["gpus"], "H200": {"k2": [32, 64, 2, 4]}},
             "measured": {**seed["measured"], "H200": {"k2": {"us": 2.0}}}}
    table.write_text(json.dumps(tuned))
    assert suite.ship_tuned(seed, table, smoke=True) == ["H200: k2"] and not shipped.exists()
    assert suite.ship_tuned(seed, table, smoke=False) == ["H200: k2"]
    assert json.loads(shipped.read_text()) == tuned  # the other GPU's entries kept


def test_a_report_the_run_did_not_write_is_left_alone(suite, tmp_path):
    """An earlier run's table is neither deleted nor read as this run's: the failed run's output goes beside it."""
    ctx = suite.Ctx(results=tmp_path, smoke=True, logs=tmp_path / "logs", env=dict(os.environ))
    earlier = {"records": [{"kernel": "rana", "ratio": 0.5, "target_met": True}], "complete": True}
    (tmp_path / "gpu_kernels.json").write_text(json.dumps(earlier))
    (tmp_path / "gpu_kernels.md").write_text("earlier table")
    outcome = suite._bench_section(ctx, [sys.executable, "-c", "raise SystemExit(2)"], tmp_path / "gpu_kernels", 30,
                                   None, "Masked GEMV kernels", suite._kernels_headline)
    assert outcome.status == "fail" and outcome.outputs == ["gpu_kernels_failed.md", "gpu_kernels_failed.json"]
    assert (tmp_path / "gpu_kernels.md").read_text() == "earlier table" and "meets" not in outcome.note
    assert "SystemExit(2)" in (tmp_path / "gpu_kernels_failed.md").read_text()
