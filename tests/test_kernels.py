"""Masked GEMV kernels: Triton (interpreter on CPU, compiled on CUDA), torch fast path, dense path, the decode route.

Every result is checked against an independent float64 computation written here (explicit
active-index sum), with thresholds placed midway between two sorted scores so the number of
active rows is known exactly and no score sits on the boundary.
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gemv_dispatch as dispatch
from rana.kernels import cpu_gemv as cg
from rana.kernels import route
from rana.kernels import torch_gemv as mg
from rana.kernels import triton_gemv as tg
from rana.kernels.weights import FloatWeight

KERNEL_FILE = Path(mg.__file__).resolve()
MODES = ["square", "abs_scaled", "abs"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# --------------------------------------------------------------------------------------------
# independent expectation
# --------------------------------------------------------------------------------------------
def _scores64(v: torch.Tensor, mode: str, scale: torch.Tensor | None) -> torch.Tensor:
    v = v.double()
    if mode == "square":
        return v * v
    if mode == "abs":
        return v.abs()
    return v.abs() * scale.double()


def _threshold_for(scores: torch.Tensor, n_active: int) -> float:
    """A threshold leaving exactly `n_active` scores >= t, midway between two sorted scores."""
    s, _ = torch.sort(scores.flatten(), descending=True)
    if n_active <= 0:
        return float(s[0]) * 2 + 1.0
    if n_active >= s.numel():
        return float(s[-1]) / 2 - 1e-3 if float(s[-1]) > 0 else -1.0
    return (float(s[n_active - 1]) + float(s[n_active])) / 2


def _expected(w_t, v, t, mode, scale=None, bias=None) -> torch.Tensor:
    """float64: sum over the active k of v_k * w_t[k, :], token by token, + bias."""
    K, N = w_t.shape
    rows = v.reshape(-1, K)
    out = torch.zeros(rows.shape[0], N, dtype=torch.float64)
    for r, vr in enumerate(rows):
        if t is None:
            active = torch.arange(K)
        else:
            active = (_scores64(vr, mode, scale) >= float(t)).nonzero().flatten()
        for k in active.tolist():
            out[r] += vr[k].double() * w_t[k].double()
        if bias is not None:
            out[r] += bias.double()
    return out.reshape(*v.shape[:-1], N)


def _assert_close(y: torch.Tensor, exp: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype
    assert y.shape == exp.shape
    mag = max(float(exp.abs().max()), 1.0)
    atol = 2e-5 * mag if dtype == torch.float32 else 2 * torch.finfo(dtype).eps * mag
    torch.testing.assert_close(y.double(), exp, atol=atol, rtol=0)


def _problem(K, N, dtype, mode, frac, *, bias=True, seed=0, lead=(1,)):
    g = torch.Generator().manual_seed(seed)
    w_t = torch.randn(K, N, generator=g).to(dtype)
    v = torch.randn(*lead, K, generator=g).to(dtype)
    scale = (torch.rand(K, generator=g) + 0.25) if mode == "abs_scaled" else None
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    t = _threshold_for(_scores64(v, mode, scale), round(frac * v.numel()))
    return w_t, v, t, scale, b


# --------------------------------------------------------------------------------------------
# Triton: under the interpreter on CPU, and compiled on CUDA
# --------------------------------------------------------------------------------------------
# The kernels are defined once per process, interpreted or compiled (TRITON_INTERPRET, read when triton_gemv
# is imported; tests/conftest.py sets it to 1 unless told otherwise): each test runs under whichever this
# process has. The CUDA variant carries the `cuda` marker, so the GPU machine's `pytest -m cuda` (with
# TRITON_INTERPRET=0) runs it.
TRITON_DEVICES = [pytest.param("cpu", id="interpreter"), pytest.param("cuda", id="cuda", marks=pytest.mark.cuda)]


def _triton_skip_reason(device: str) -> str | None:
    """Why the Triton kernels cannot run on `device` in this process (None: they can). Only a missing
    setting, package or device is a reason: a kernel that fails to run is a test failure, never a skip."""
    if not tg.triton_available():
        return "triton is not installed"
    if device == "cpu" and not tg.interpreting():
        return "TRITON_INTERPRET is not 1: the kernels are compiled for a GPU in this process"
    if device == "cuda" and not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if device == "cuda" and tg.interpreting():
        return "TRITON_INTERPRET=1: the kernels are interpreted in this process (run with TRITON_INTERPRET=0)"
    return None


@pytest.fixture(scope="module", params=TRITON_DEVICES)
def triton_device(request):
    dev = request.param
    reason = _triton_skip_reason(dev)
    if reason:
        pytest.skip(reason)
    # one tiny call first: a kernel that cannot run here fails here, once, with its own error
    y = dispatch.masked_gemv_triton(torch.ones(4, 4, device=dev), torch.ones(4, device=dev), None, mode="abs")
    assert torch.allclose(y.cpu(), torch.full((4,), 4.0))
    return dev


def _on(dev, *xs):
    return [None if x is None else (x.to(dev) if isinstance(x, torch.Tensor) else x) for x in xs]


# shapes include non-multiples of every block size (BLOCK_N 64, BLOCK_K*K_ITERS 32 interpreted)
@pytest.mark.parametrize("K,N", [(100, 77), (256, 130), (33, 200), (7, 5)])
@pytest.mark.parametrize("mode", MODES)
def test_triton_matches_fp32(triton_device, K, N, mode):
    w_t, v, t, scale, b = _problem(K, N, torch.float32, mode, 0.3, seed=K + N)
    exp = _expected(w_t, v, t, mode, scale, b)
    dense = _expected(w_t, v, None, mode, scale, b)
    assert (exp - dense).abs().max() > 1e-2  # the mask really changes the result
    dw, dv, ds, db = _on(triton_device, w_t, v, scale, b)
    for thr in (t, torch.tensor(t, device=triton_device)):  # python float and device tensor
        y = dispatch.masked_gemv_triton(dw, dv, thr, mode=mode, scale=ds, bias=db)
        _assert_close(y.cpu(), exp, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", MODES)
def test_triton_matches_half(triton_device, dtype, mode):
    K, N = 150, 90
    w_t, v, t, scale, b = _problem(K, N, dtype, mode, 0.4, seed=3)
    exp = _expected(w_t, v, t, mode, scale, b)
    dw, dv, ds, db = _on(triton_device, w_t, v, scale, b)
    y = dispatch.masked_gemv_triton(dw, dv, torch.tensor(t, device=triton_device), mode=mode, scale=ds, bias=db)
    _assert_close(y.cpu(), exp, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_empty_and_full_mask(triton_device, dtype):
    K, N = 96, 70
    w_t, v, _, scale, b = _problem(K, N, dtype, "abs_scaled", 0.5, seed=5)
    dw, dv, ds, db = _on(triton_device, w_t, v, scale, b)
    for mode in MODES:
        y = dispatch.masked_gemv_triton(dw, dv, 1e30, mode=mode, scale=ds, bias=db)
        assert torch.equal(y.cpu().reshape(N), b)  # nothing active: bias only
        y = dispatch.masked_gemv_triton(dw, dv, torch.tensor(1e30, device=triton_device), mode=mode, scale=ds)
        assert torch.equal(y.cpu(), torch.zeros(1, N, dtype=dtype))
        dense = _expected(w_t, v, None, mode, scale, b)
        for t in (None, -math.inf, torch.tensor(-math.inf, device=triton_device)):
            _assert_close(dispatch.masked_gemv_triton(dw, dv, t, mode=mode, scale=ds, bias=db).cpu(), dense, dtype)


def test_triton_never_reads_inactive_rows(triton_device):
    K, N = 120, 100
    w_t, v, t, _, _ = _problem(K, N, torch.float32, "abs", 0.25, bias=False, seed=7)
    inactive = v.reshape(K).abs() < t
    poisoned = w_t.clone()
    poisoned[inactive] = float("nan")
    y = dispatch.masked_gemv_triton(poisoned.to(triton_device), v.to(triton_device), t, mode="abs").cpu()
    assert torch.isfinite(y).all()
    _assert_close(y, _expected(w_t, v, t, "abs"), torch.float32)


@pytest.mark.parametrize("lead", [(), (1,), (1, 1)])
def test_triton_leading_shapes(triton_device, lead):
    w_t, v, t, _, _ = _problem(64, 48, torch.float32, "square", 0.5, bias=False, seed=9, lead=lead)
    y = dispatch.masked_gemv_triton(w_t.to(triton_device), v.to(triton_device), t, mode="square").cpu()
    assert y.shape == (*lead, 48)
    _assert_close(y, _expected(w_t, v, t, "square"), torch.float32)


def test_triton_rejects_several_tokens(triton_device):
    w = torch.ones(8, 4, device=triton_device)
    with pytest.raises(ValueError):
        dispatch.masked_gemv_triton(w, torch.ones(2, 8, device=triton_device), 0.0, mode="abs")


# --------------------------------------------------------------------------------------------
# torch paths
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frac", [0.0, 0.1, 0.4, 0.9, 1.0])
@pytest.mark.parametrize("native", [True, False], ids=["native", "torch-only"])
def test_reference_and_torch_paths(dtype, mode, frac, native, monkeypatch):
    if not native:
        monkeypatch.setattr(cg, "_load", lambda: (None, "torch fallback (disabled in this test)"))
    K, N = 200, 130
    w_t, v, t, scale, b = _problem(K, N, dtype, mode, frac, seed=11)
    exp = _expected(w_t, v, t, mode, scale, b)
    for fn in (mg.masked_gemv_reference, mg.masked_gemv_torch, mg.masked_gemv_dense, dispatch.masked_gemv):
        for thr in (t, torch.tensor(t)):
            _assert_close(fn(w_t, v, thr, mode=mode, scale=scale, bias=b), exp, dtype)


@pytest.fixture
def no_native(monkeypatch):
    """The CPU torch path as on a machine without a C compiler (the native kernel declines)."""
    monkeypatch.setattr(cg, "_load", lambda: (None, "torch fallback (disabled in this test)"))


@pytest.mark.parametrize("max_fraction", [0.0, 0.5, 1.0])
def test_torch_path_both_branches(no_native, monkeypatch, max_fraction):
    """Force the gather branch (embedding_bag) and the dense branch of the CPU fast path."""
    for dtype in DTYPES:
        monkeypatch.setitem(mg.CPU_GATHER_MAX_FRACTION, dtype, max_fraction)
    for dtype in DTYPES:
        for frac in (0.05, 0.3, 0.8):
            w_t, v, t, scale, b = _problem(160, 96, dtype, "abs_scaled", frac, seed=13)
            y = mg.masked_gemv_torch(w_t, v, t, mode="abs_scaled", scale=scale, bias=b)
            _assert_close(y, _expected(w_t, v, t, "abs_scaled", scale, b), dtype)


def test_torch_gather_never_reads_inactive_rows(no_native):
    K, N = 300, 64
    w_t, v, t, _, _ = _problem(K, N, torch.float32, "square", 0.2, bias=False, seed=17)
    poisoned = w_t.clone()
    poisoned[(v.reshape(K).double() ** 2) < t] = float("nan")
    y = mg.masked_gemv_torch(poisoned, v, t, mode="square")  # 0.2 < CPU_GATHER_MAX_FRACTION
    assert torch.isfinite(y).all()
    _assert_close(y, _expected(w_t, v, t, "square"), torch.float32)


@pytest.mark.parametrize("lead", [(), (1,), (1, 1), (3,), (2, 5)])
@pytest.mark.parametrize("mode", MODES)
def test_shapes_and_batch_path(lead, mode):
    K, N = 90, 50
    w_t, v, t, scale, b = _problem(K, N, torch.float32, mode, 0.35, seed=19, lead=lead)
    exp = _expected(w_t, v, t, mode, scale, b)
    for fn in (dispatch.masked_gemv, mg.masked_gemv_dense, mg.masked_gemv_torch, mg.masked_gemv_reference):
        y = fn(w_t, v, torch.tensor(t), mode=mode, scale=scale, bias=b)
        assert y.shape == (*lead, N)
        _assert_close(y, exp, torch.float32)


def test_empty_and_full_mask_torch():
    K, N = 128, 40
    for dtype in DTYPES:
        w_t, v, _, scale, b = _problem(K, N, dtype, "abs_scaled", 0.5, seed=23)
        for fn in (dispatch.masked_gemv, mg.masked_gemv_torch, mg.masked_gemv_dense, mg.masked_gemv_reference):
            for mode in MODES:
                assert torch.equal(fn(w_t, v, 1e30, mode=mode, scale=scale, bias=b).reshape(N), b)
                assert torch.equal(fn(w_t, v, torch.tensor(1e30), mode=mode, scale=scale),
                                   torch.zeros(1, N, dtype=dtype))
                dense = _expected(w_t, v, None, mode, scale, b)
                for t in (None, -math.inf, torch.tensor(-math.inf)):
                    _assert_close(fn(w_t, v, t, mode=mode, scale=scale, bias=b), dense, dtype)


def test_argument_errors():
    w, v = torch.ones(8, 4), torch.ones(8)
    with pytest.raises(ValueError):
        dispatch.masked_gemv(w, v, 0.0, mode="relu")
    with pytest.raises(ValueError):
        dispatch.masked_gemv(w, v, 0.0, mode="abs_scaled")  # scale missing
    with pytest.raises(ValueError):
        dispatch.masked_gemv(w, torch.ones(7), 0.0, mode="abs")


# --------------------------------------------------------------------------------------------
# the decode route
# --------------------------------------------------------------------------------------------
def test_route_serves_cpu_tokens_by_backend(monkeypatch):
    """One CPU token: the native kernel first for fp32 weights (the torch gather when it declines), the gather
    for bf16 weights (their backend is torch); several tokens: dense. No Triton for CPU tensors."""
    calls = []

    def spy(name, fn):
        def wrapped(*a, **k):
            calls.append(name)
            return fn(*a, **k)
        return wrapped

    def no_triton(*a, **k):
        raise AssertionError("triton path used for CPU tensors")

    monkeypatch.setattr(route, "grouped_masked_gemv_triton", no_triton)
    monkeypatch.setattr(cg.NativeCall, "__call__", spy("native", cg.NativeCall.__call__))
    monkeypatch.setattr(route, "masked_gemv_gather", spy("gather", mg.masked_gemv_gather))
    monkeypatch.setattr(route, "masked_gemv_dense", spy("dense", mg.masked_gemv_dense))
    w_t = torch.randn(32, 16)
    native = cg.native_kernel() is not None
    t = torch.tensor(0.5)
    for shape in [(32,), (1, 32), (1, 1, 32)]:
        w = FloatWeight(w_t.t())
        assert w.backend == ("native" if native else "torch")
        calls.clear()
        route.decode_masked(w, torch.randn(shape), t, "abs")
        assert calls == (["native"] if native else ["gather"])
        calls.clear()
        w16 = FloatWeight(w_t.bfloat16().t())
        assert w16.backend == "torch"  # the native kernel is fp32 only
        route.decode_masked(w16, torch.randn(shape).bfloat16(), t, "abs")
        assert calls == ["gather"]
        if native:
            calls.clear()
            route.decode_masked(w, torch.randn(shape).bfloat16(), t, "abs")  # a token the kernel declines
            assert calls == ["native", "gather"]
    calls.clear()
    route.decode_masked(FloatWeight(w_t.t()), torch.randn(2, 3, 32), t, "abs")
    assert calls == ["dense"]


# --------------------------------------------------------------------------------------------
# the file works alone, without triton
# --------------------------------------------------------------------------------------------
def test_imports_and_runs_without_triton(tmp_path):
    """The kernel files copied flat into a package (as in an export) import and run alone."""
    flat = tmp_path / "flatpkg"
    flat.mkdir()
    (flat / "__init__.py").write_text("")
    for path in KERNEL_FILE.parent.iterdir():
        if path.suffix in (".py", ".c", ".h", ".json") and path.name != "__init__.py":
            (flat / path.name).write_text(path.read_text())
    code = f"""
import importlib, sys
sys.modules["triton"] = None              # `import triton` now raises ImportError
sys.modules["triton.language"] = None
sys.path.insert(0, {str(tmp_path)!r})
import torch
route = importlib.import_module("flatpkg.route")
weights = importlib.import_module("flatpkg.weights")
tgk = importlib.import_module("flatpkg.triton_gemv")
assert not tgk.triton_available() and not tgk.kernels_available()
assert not any(k == "rana" or k.startswith("rana.") for k in sys.modules), "imports rana"
torch.manual_seed(0)
w, v = torch.randn(64, 24), torch.randn(1, 1, 64)
t = torch.tensor(0.6)
operand = weights.FloatWeight(w.t(), torch.ones(24))
assert operand.backend in ("native", "torch"), operand.backend
y = route.decode_masked(operand, v, t, "abs")
keep = (v.abs() >= 0.6).double()
exp = (v.double() * keep) @ w.double() + 1
assert y.shape == (1, 1, 24), y.shape
assert (y.double() - exp).abs().max() < 1e-4, (y, exp)
try:
    tgk.grouped_masked_gemv_triton([v], [w], [t], "abs", [None], [None])
except RuntimeError:
    pass
else:
    raise AssertionError("the Triton kernel ran without triton")
print("OK")
"""
    env = {k: val for k, val in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK")


def _column_major_problem():
    """A plain nn.Linear weight's .t() (a column-major view: same values, strides (1, K))."""
    w_t, v, t, scale, b = _problem(80, 48, torch.float32, "abs_scaled", 0.3, seed=29)
    w_view = w_t.t().contiguous().t()
    assert not w_view.is_contiguous()
    return w_view, v, t, scale, b, _expected(w_t, v, t, "abs_scaled", scale, b)


def test_non_contiguous_weight_is_still_correct():
    w_view, v, t, scale, b, exp = _column_major_problem()
    for fn in (dispatch.masked_gemv, mg.masked_gemv_torch, mg.masked_gemv_dense):
        _assert_close(fn(w_view, v, t, mode="abs_scaled", scale=scale, bias=b), exp, torch.float32)


def test_triton_non_contiguous_weight_is_still_correct(triton_device):
    w_view, v, t, scale, b, exp = _column_major_problem()
    dw, dv, ds, db = _on(triton_device, w_view, v, scale, b)
    y = dispatch.masked_gemv_triton(dw, dv, t, mode="abs_scaled", scale=ds, bias=db)
    _assert_close(y.cpu(), exp, torch.float32)
