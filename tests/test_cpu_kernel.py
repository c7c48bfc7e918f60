"""The native CPU masked GEMV (kernels/cpu_gemv.py): parity, its dense branch, threads, fallbacks.

Expectations are float64 sums over the active rows written in test_kernels.py, with thresholds
placed between two scores so the active count is known exactly.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gemv_dispatch as dispatch
from rana.kernels import cpu_gemv as cg
from rana.modules import InputSparseLinear, NeuronThresholdLinear, RankAdapterLinear

from test_kernels import MODES, _assert_close, _expected, _problem

KERNEL_DIR = Path(cg.__file__).resolve().parent


def _native_gemv(w_t, v, t, mode, scale=None, bias=None, limit=None):
    """The native kernel with its operands bound for one call (cg.native_masked), float weights."""
    return cg.native_masked(w_t, None, v, t, mode, scale, bias, limit)


@pytest.fixture(scope="module")
def native():
    fn = cg.native_kernel()
    if fn is None:
        pytest.skip(f"native CPU kernel unavailable here: {cg.native_status()}")
    return fn


@pytest.fixture
def threads():
    """Restore torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frac", [0.0, 0.05, 0.5, 0.88, 0.95, 1.0])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_native_matches_float64(native, threads, mode, frac, nthreads):
    """Both branches: accumulate the active rows (<= limit) and dense BLAS on the masked input."""
    torch.set_num_threads(nthreads)
    for K, N, lead in [(203, 130, (1,)), (576, 192, (1, 1)), (7, 3, ())]:
        w_t, v, t, scale, b = _problem(K, N, torch.float32, mode, frac, seed=K + N, lead=lead)
        exp = _expected(w_t, v, t, mode, scale, b)
        for bias in (b, None):
            e = exp if bias is not None else _expected(w_t, v, t, mode, scale, None)
            y = _native_gemv(w_t, v, t, mode, scale=scale, bias=bias)
            assert y is not None and y.shape == (*lead, N)
            _assert_close(y, e, torch.float32)
            y_bound = cg.NativeCall.bind(w_t, None, mode, scale, bias)(v, t)  # bound once, as a module's
            _assert_close(y_bound, e, torch.float32)


@pytest.mark.parametrize("limit", [0, 10, 10_000])
def test_native_limit_switches_branch_not_result(native, limit):
    w_t, v, t, scale, b = _problem(300, 80, torch.float32, "abs_scaled", 0.4, seed=3)
    y = _native_gemv(w_t, v, t, "abs_scaled", scale=scale, bias=b, limit=limit)
    _assert_close(y, _expected(w_t, v, t, "abs_scaled", scale, b), torch.float32)


@pytest.mark.parametrize("nthreads", [1, 2])
def test_native_never_reads_inactive_rows(native, threads, nthreads):
    torch.set_num_threads(nthreads)
    K, N = 400, 256
    w_t, v, t, _, _ = _problem(K, N, torch.float32, "square", 0.3, bias=False, seed=5)
    poisoned = w_t.clone()
    poisoned[(v.reshape(K).double() ** 2) < t] = float("nan")
    y = _native_gemv(poisoned, v, t, "square", limit=K)
    assert torch.isfinite(y).all()
    _assert_close(y, _expected(w_t, v, t, "square"), torch.float32)


def test_dense_prediction_never_changes_the_result(native):
    """After a mostly-active token a weight skips the scan for a few tokens (dense branch
    predicted); sparse tokens in that window must still give their own exact masked product."""
    K, N = 256, 96
    w_t, _, _, _, b = _problem(K, N, torch.float32, "abs", 0.5, seed=21)
    g = torch.Generator().manual_seed(22)
    t = 0.8
    cg.reset_dense_streaks()
    calls = []
    for step in range(3 * cg.DENSE_STREAK):
        v = torch.randn(1, 1, K, generator=g) * (4.0 if step % 5 == 0 else 0.5)  # dense / sparse tokens
        y = _native_gemv(w_t, v, t, "abs", bias=b)
        _assert_close(y, _expected(w_t, v, t, "abs", None, b), torch.float32)
        calls.append(cg.dense_streak(w_t.t(), t))
    assert max(calls) == cg.DENSE_STREAK and min(calls) == 0  # both branches were taken
    for t in (0.0, -1.0, float("-inf")):  # every input active: the plain product
        v = torch.randn(1, 1, K, generator=g)
        _assert_close(_native_gemv(w_t, v, t, "abs", bias=b), _expected(w_t, v, None, "abs", None, b),
                      torch.float32)


def test_native_declines_what_it_does_not_handle(native):
    """Other dtypes, layouts and several tokens go back to the caller's torch path."""
    w_t, v, t, scale, _ = _problem(64, 32, torch.float32, "abs", 0.5, seed=7)
    assert _native_gemv(w_t.half(), v.half(), t, "abs") is None
    assert _native_gemv(w_t.t().contiguous().t(), v, t, "abs") is None  # columns not contiguous
    assert _native_gemv(w_t, torch.randn(2, 64), t, "abs") is None
    assert _native_gemv(w_t, v, t, "abs_scaled") is None  # no scale
    assert _native_gemv(w_t, v, t, "relu") is None


def test_route_uses_native_for_fp32_cpu_tokens(native, monkeypatch):
    calls = []
    real = cg.NativeCall.__call__

    def spy(*a, **k):
        y = real(*a, **k)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(cg.NativeCall, "__call__", spy)
    w_t, v, t, _, b = _problem(96, 40, torch.float32, "abs", 0.3, seed=9)
    _assert_close(dispatch.masked_gemv(w_t, v, t, mode="abs", bias=b), _expected(w_t, v, t, "abs", None, b),
                  torch.float32)
    assert calls == [True]
    calls.clear()
    dispatch.masked_gemv(w_t.bfloat16(), v.bfloat16(), t, mode="abs")  # bf16 weights: the torch backend
    assert calls == []


def _modules(K=96, N=72, r=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    W, b = torch.randn(N, K, generator=g), torch.randn(N, generator=g)
    A, B = torch.randn(N, r, generator=g), torch.randn(r, K, generator=g)
    return [InputSparseLinear(W, b, 0.6), NeuronThresholdLinear(W, b, 0.9), RankAdapterLinear(A, B, b, 1.0)]


@pytest.mark.parametrize("branch", ["gather", "dense"])
def test_module_decode_path_equals_masked_formula(native, monkeypatch, branch):
    """Eval, one token, plain weights: the native path gives the module's own masked formula."""
    monkeypatch.setattr(cg, "native_limit", (lambda K, threads=1: K) if branch == "gather" else
                        (lambda K, threads=1: 0))
    cg.reset_dense_streaks()
    torch.manual_seed(1)
    for m in _modules():
        m.eval()
        x = torch.randn(1, 1, 96)
        with torch.no_grad():
            y = m(x)
            y_again = m(x)  # the dense branch is now predicted for InputSparseLinear
            m.train()  # the training path is the plain torch formula W (m ⊙ x)
            m.meter_on = True
            ref = m(x)
            m.meter_on = False
            m.eval()
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(y_again, ref, atol=1e-5, rtol=1e-5)
        assert 0 < m.mean_active() < getattr(m, "rank", m.in_features)  # the threshold really masks something


def test_module_follows_threshold_and_weight_updates(native):
    """No stale cache: thresholds and weights loaded later are what the next token uses."""
    m = _modules()[0].eval()
    x = torch.randn(1, 1, 96)
    state = {k: v.clone() for k, v in m.state_dict().items()}
    state["threshold"].fill_(1e9)
    m.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(m(x).reshape(-1), m.linear.bias)
        m.threshold.fill_(-float("inf"))
        m.linear.weight.mul_(2)
        torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.linear.weight, m.linear.bias))


def test_gradients_still_flow_in_eval_mode(native):
    """With autograd on, one token takes the differentiable torch path (the C call is opaque)."""
    for m in _modules():
        m.eval()
        x = torch.randn(1, 1, 96, requires_grad=True)
        m(x).sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0
        weight = (m.linear if hasattr(m, "linear") else m.A).weight
        assert weight.grad is not None and weight.grad.abs().sum() > 0


def _run(code: str, env_extra: dict, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, **env_extra}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)


_FALLBACK_CHECK = """
import torch
from rana.kernels import cpu_gemv as cg, route
from rana.kernels.weights import FloatWeight
assert cg.native_kernel() is None, cg.native_status()
print(cg.native_status())
w, v = torch.randn(64, 24), torch.randn(1, 1, 64)
operand = FloatWeight(w.t())
assert operand.backend == "torch", operand.backend
y = route.decode_masked(operand, v, torch.tensor(0.6), "abs")
exp = (v.double() * (v.abs() >= 0.6)) @ w.double()
assert (y.double() - exp).abs().max() < 1e-4
print("OK")
"""


@pytest.mark.parametrize("env, says", [({"RANA_NATIVE_CPU": "0"}, "disabled"),
                                       ({"CC": "/nonexistent/cc"}, "not found"),
                                       ({"CC": "false"}, "build failed")])  # a "compiler" that fails
def test_falls_back_to_torch_without_the_kernel(tmp_path, env, says):
    out = _run(_FALLBACK_CHECK, {**env, "RANA_KERNEL_CACHE": str(tmp_path / "cache")}, tmp_path)
    assert out.returncode == 0, out.stderr
    assert "torch fallback" in out.stdout and says in out.stdout and out.stdout.strip().endswith("OK")


def test_builds_once_into_the_cache(native, tmp_path):
    code = "from rana.kernels import cpu_gemv as cg; assert cg.native_kernel() is not None; print(cg.native_status())"
    cache = tmp_path / "cache"
    for _ in range(2):
        out = _run(code, {"RANA_KERNEL_CACHE": str(cache)}, tmp_path)
        assert out.returncode == 0, out.stderr
    built = list(cache.glob("*.so"))
    assert len(built) == 1, built
    assert sorted(p.name for p in cache.iterdir()) == [built[0].name, built[0].name + ".sha256"]  # no temp leftovers
