"""benchmarks/gpu_suite.py on CPU: --smoke runs every section (tiny shapes, Triton interpreter) and
writes a summary listing each; the deadline is shared out and enforced; one failing or hanging
section does not stop the ones after it."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_suite.py"
SECTIONS = ["tests", "tuner", "kernels", "decode", "compress"]


@pytest.fixture
def suite(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "environment", lambda env: {"device": "test", "torch": "x"})  # no torch import
    return module


def test_smoke_runs_every_section_and_lists_it(tmp_path):
    pytest.importorskip("triton")
    results = tmp_path / "r"
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--results", str(results)], cwd=REPO,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    data = json.loads((results / "gpu_suite.json").read_text())
    assert [s["section"] for s in data["sections"]] == SECTIONS
    tuner_exists = (REPO / "kernels" / "gemv_tune.py").exists()
    for s in data["sections"]:
        assert s["status"] == "pass" or (s["section"] == "tuner" and not tuner_exists and s["status"] == "skipped"), s
    summary = (results / "gpu_suite.md").read_text()
    assert all(f"| {name} |" in summary for name in SECTIONS) and "git commit" in summary and "triton" in summary
    for stem in ("gpu_tests", "gpu_kernels", "gpu_decode", "gpu_compress"):
        assert (results / f"{stem}.md").exists() and (results / f"{stem}.json").exists()
    assert "skipped" in (results / "gpu_tests.md").read_text()  # the CUDA tests only report their skips on CPU
    assert [line for line in out.stdout.splitlines() if line.startswith("[gpu_suite] ") and ": running" in line]


def test_smoke_needs_results(suite):
    with pytest.raises(SystemExit):
        suite.main(["--smoke"])


def test_a_spent_deadline_skips_every_section_for_time(suite, tmp_path):
    assert suite.main(["--smoke", "--results", str(tmp_path), "--deadline", "1"]) == 0
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert [(s["section"], s["status"]) for s in data["sections"]] == [(n, "skipped") for n in SECTIONS]
    assert (tmp_path / "gpu_suite.md").read_text().count("the whole section") == len(SECTIONS)


def test_a_hanging_or_failing_section_does_not_stop_the_rest(suite, tmp_path, monkeypatch):
    def child(code):
        def section(ctx, budget):
            run = suite.run_child([sys.executable, "-c", code], suite.child_env(ctx, None), min(budget, 3.0),
                                  ctx.logs / "child.log")
            return suite.Outcome(suite._status(run), suite._last_line(run["tail"]))
        return section

    def broken(ctx, budget):
        raise RuntimeError("a bug in the suite")

    monkeypatch.setattr(suite, "SECTIONS", {"hang": (0.3, child("import time; time.sleep(600)")),
                                            "broken": (0.2, broken),
                                            "fail": (0.2, child("raise SystemExit(3)")),
                                            "ok": (0.3, child("print('fine')"))})
    assert suite.main(["--results", str(tmp_path), "--deadline", "100"]) == 1
    data = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert [(s["section"], s["status"]) for s in data["sections"]] == [
        ("hang", "timeout"), ("broken", "fail"), ("fail", "fail"), ("ok", "pass")]
    assert data["sections"][-1]["note"] == "fine"
    # time the earlier sections left unused went to the later ones
    assert data["sections"][-1]["budget_s"] > 0.3 * 100


def test_section_budgets_share_what_is_left(suite):
    assert abs(sum(weight for weight, _ in suite.SECTIONS.values()) - 1.0) < 1e-9
    assert list(suite.SECTIONS) == SECTIONS
