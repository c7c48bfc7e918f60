"""Each section of benchmarks/gpu_suite.py killed mid-way (--smoke on CPU) leaves its partial table.

The suite kills what overruns its share of the GPU machine's minutes; so does an out-of-memory kill. A
section's process is made to die by SIGKILL right after its first table write that holds a measured cell:
`os.replace` (every report and the tuning table go through it) is wrapped, in that process only, before
the script runs. The suite must report the section as failed, keep the table (never delete it) and read
back what it holds. The test section's pytest is killed by one of its own tests instead.
"""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_suite.py"

pytest.importorskip("triton")

# argv: TARGET_JSON CONDITION MARKDOWN|- then the command (a script or -m module, then its arguments).
# After TARGET_JSON is replaced with content for which CONDITION (a Python expression over `data`) holds, the
# process kills itself: at once, or after the next replace of MARKDOWN (a report's .md follows its .json).
KILLER = r"""
import json, os, runpy, signal, sys
target, condition, markdown = sys.argv[1:4]
armed = []
real = os.replace
def replace(src, dst, *args, **kwargs):
    real(src, dst, *args, **kwargs)
    name = os.path.basename(os.fspath(dst))
    if name == target and eval(condition, {"data": json.load(open(dst))}):
        armed.append(True)
        if markdown == "-":
            os.kill(os.getpid(), signal.SIGKILL)
    elif armed and name == markdown:
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
if sys.argv[4] == "-m":
    sys.argv = [sys.argv[5]] + sys.argv[6:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
else:
    sys.argv = sys.argv[4:]
    runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.fixture
def suite(monkeypatch):
    spec = importlib.util.spec_from_file_location("gpu_suite", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "environment", lambda env: {"device": "test", "torch": "x"})
    return module


def kill_after(suite, monkeypatch, target: str, condition: str, markdown: str = "-") -> None:
    real = suite.run_child

    def run_child(cmd, env, timeout, log):
        return real([cmd[0], "-c", KILLER, target, condition, markdown, *cmd[1:]], env, timeout, log)

    monkeypatch.setattr(suite, "run_child", run_child)


def run_section(suite, tmp_path, name: str) -> dict:
    suite.main(["--smoke", "--results", str(tmp_path), "--only", name, "--deadline", "400"])
    (row,) = json.loads((tmp_path / "gpu_suite.json").read_text())["sections"]
    return row


def test_killed_kernels_leave_the_cells_they_measured(suite, tmp_path, monkeypatch):
    kill_after(suite, monkeypatch, "gpu_kernels.json", "len(data['records']) >= 2", "gpu_kernels.md")
    row = run_section(suite, tmp_path, "kernels")
    data = json.loads((tmp_path / "gpu_kernels.json").read_text())
    assert row["status"] == "fail" and "PARTIAL" in row["note"] and "gpu_kernels.md" in row["outputs"]
    assert len(data["records"]) == 2 and not data["complete"]  # the first cell: rana and teal-ref
    assert "PARTIAL" in (tmp_path / "gpu_kernels.md").read_text()


def test_killed_decode_leaves_the_step_harness_it_measured(suite, tmp_path, monkeypatch):
    kill_after(suite, monkeypatch, "gpu_decode.json", "len(data['records']) >= 1", "gpu_decode.md")
    row = run_section(suite, tmp_path, "decode")
    data = json.loads((tmp_path / "gpu_decode.json").read_text())
    assert row["status"] == "fail" and "PARTIAL" in row["note"] and "step: " in row["note"]
    assert [r["harness"] for r in data["records"]] == ["step"] and not data["complete"]
    assert "| tiny-llama | 0.58 | step |" in (tmp_path / "gpu_decode.md").read_text()


def test_killed_compression_leaves_its_row(suite, tmp_path, monkeypatch):
    kill_after(suite, monkeypatch, "gpu_compress.json", "len(data['rows']) >= 1", "gpu_compress.md")
    row = run_section(suite, tmp_path, "compress")
    data = json.loads((tmp_path / "gpu_compress.json").read_text())
    assert row["status"] == "fail" and "s per layer" in row["note"] and "PARTIAL" in row["note"]
    assert data["rows"][0]["median_layer_s"] > 0 and not data["complete"]
    assert "PARTIAL" in (tmp_path / "gpu_compress.md").read_text()


def test_a_killed_tuner_keeps_the_keys_it_finished(suite, tmp_path, monkeypatch):
    kill_after(suite, monkeypatch, "gemv_configs.json", "len(data.get('measured', {}).get('cpu (smoke)', {})) >= 1")
    shipped = suite.SHIPPED_TABLE.read_bytes()
    row = run_section(suite, tmp_path, "tuner")
    table = json.loads((tmp_path / "gemv_configs.json").read_text())
    assert row["status"] == "fail" and "1 keys tuned" in row["note"] and "gemv_configs.json" in row["outputs"]
    assert len(table["gpus"]["cpu (smoke)"]) == 1
    assert suite.SHIPPED_TABLE.read_bytes() == shipped  # a smoke table never ships


def test_killed_tests_report_what_passed_failed_and_was_running(suite, tmp_path, monkeypatch):
    tests = tmp_path / "t" / "test_synthetic.py"
    tests.parent.mkdir()
    tests.write_text("import os, signal\n"
                     "def test_a(): pass\n"
                     "def test_b(): assert 1 == 2, 'the message'\n"
                     "def test_c(): os.kill(os.getpid(), signal.SIGKILL)\n"
                     "def test_d(): pass\n")
    monkeypatch.setattr(suite, "test_commands", lambda: [suite.TestCommand("synthetic", [str(tests)], 0.0)])
    row = run_section(suite, tmp_path / "r", "tests")
    data = json.loads((tmp_path / "r" / "gpu_tests.json").read_text())
    (run,) = data["runs"]
    assert row["status"] == "fail" and "1 passed, 1 failed" in row["note"] and "1 FAILURES" in row["note"]
    assert [n.rsplit("/", 1)[-1] for n in run["log"]["in_flight"]] == ["test_synthetic.py::test_c"]
    assert "the message" in run["log"]["failures"][0]["message"]
    assert "gpu_tests_1.jsonl" in row["outputs"] and "gpu_tests_1.xml" not in row["outputs"]  # pytest died first
    md = (tmp_path / "r" / "gpu_tests.md").read_text()
    assert "test_c" in md and "Running when pytest ended" in md and "the message" in md
