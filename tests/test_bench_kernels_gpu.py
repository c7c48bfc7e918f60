"""benchmarks/bench_kernels_gpu.py on CPU: its --smoke (Triton interpreter, tiny shapes) covers every
problem kind with both kernels; its operands are what the report claims (exact active counts,
enough copies to leave L2); a kernel that disagrees with the fp64 reference is reported, not timed."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "bench_kernels_gpu.py"
KINDS = {"square", "wide", "tall", "lm-head", "qkv", "gate-up"}

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_kernels_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_covers_every_problem_kind_and_both_kernels(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(tmp_path / "k")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    data = json.loads((tmp_path / "k.json").read_text())
    assert data["complete"] and not data["failures"] and not data["skipped_for_time"]
    assert {(r["kind"], r["kernel"]) for r in data["records"]} == {(k, n) for k in KINDS for n in ("rana", "teal-ref")}
    for r in data["records"]:
        assert r["max_err"] <= 2e-2 and r["us"] > 0 and r["ratio"] == pytest.approx(r["us"] / r["dense_us"])
        assert r["active_inputs"] == round(r["fraction"] * r["K"]) and r["copies"] >= 2
        assert r["profile"] and r["config"]
    assert {d["kind"] for d in data["dense"]} == KINDS
    md = (tmp_path / "k.md").read_text()
    assert all(name in md for name in ("q/k/v", "gate/up", "LM head", "teal-ref", "≤ f+0.10"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inputs_have_exactly_the_asked_active_count(bench, dtype):
    # bf16 has many ties among |v|: the count must still be exact
    for K, f in ((14336, 0.25), (4096, 0.5), (40, 0.75), (33, 1.0)):
        v, n = bench.make_input(K, f, dtype, torch.device("cpu"))
        assert n == round(f * K) == int((v.float().abs() >= bench.THRESHOLD).sum())


def test_copies_leave_twice_the_l2(bench):
    l2 = 50 * 2**20
    for touched in (8 * 2**20, 32 * 2**20, 100 * 2**20, 2**30):
        n = bench.n_copies(touched, l2, smoke=False)
        assert n * touched > 2 * l2
        assert n == 2 or (n - 1) * touched <= 2 * l2  # and no more copies than that takes


def test_masked_reference_matches_a_dense_masked_product(bench):
    v, _ = bench.make_input(64, 0.5, torch.float32, torch.device("cpu"))
    w = torch.randn(64, 24)
    expected = (v * (v.abs() >= bench.THRESHOLD)).double() @ w.double()
    assert torch.allclose(bench.masked_reference(v, [w[:, :10], w[:, 10:]], bench.THRESHOLD), expected)


def test_a_wrong_kernel_is_reported_not_timed(bench, tmp_path, monkeypatch):
    real = bench.tg.grouped_masked_gemv_triton
    monkeypatch.setattr(bench.tg, "grouped_masked_gemv_triton", lambda *a, **k: real(*a, **k) * 1.5)
    rc = bench.main(["--smoke", "--kinds", "square", "--no-profile", "--out", str(tmp_path / "k")])
    data = json.loads((tmp_path / "k.json").read_text())
    rana, ref = data["records"]
    assert rc == 1 and "fp64 reference" in rana["error"] and "us" not in rana and ref["us"] > 0
    assert len(data["failures"]) == 1 and "FAILED" in (tmp_path / "k.md").read_text()


def test_time_budget_skips_the_cells_that_do_not_fit(bench, tmp_path):
    rc = bench.main(["--smoke", "--kinds", "square", "wide", "--no-profile", "--time-budget", "0",
                     "--out", str(tmp_path / "k")])
    data = json.loads((tmp_path / "k.json").read_text())
    assert rc == 0 and data["complete"] and len(data["records"]) == 2  # the first cell always runs
    assert data["skipped_for_time"] == ["24x72 float16 f=0.5"]
    assert "Skipped for time" in (tmp_path / "k.md").read_text()
