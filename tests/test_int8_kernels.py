"""int8-weight masked GEMV (issue 28): the native CPU kernel, the torch paths, the Triton kernel under the
interpreter, the torch.library ops and the decode route with an int8 operand.

    y = qscale ⊙ ((m ⊙ v) @ q_t)  (+ bias),   q_t int8 (K, N), qscale fp32 (N,)

Every result is checked against an independent float64 sum over the active rows written here, with
thresholds placed midway between two sorted scores (test_kernels._threshold_for) so the active count is
known exactly and no score sits on the boundary.
"""
from __future__ import annotations

import math

import pytest
import torch

import gemv_dispatch as dispatch
from rana.kernels import cpu_gemv as cg
from rana.kernels import ops, route
from rana.kernels import torch_gemv as mg
from rana.kernels import triton_gemv as tg
from rana.kernels import weights
from rana.kernels.weights import Int8Weight

from test_kernels import _scores64, _threshold_for

MODES = ["none", "square", "abs_scaled", "abs"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# --------------------------------------------------------------------------------------------
# problems and the independent expectation
# --------------------------------------------------------------------------------------------
def _problem(K, N, dtype, mode, frac, *, bias=True, seed=0, lead=(1,)):
    """(q_t, qscale, v, t, scale, bias); t a python float (-inf for mode "none")."""
    g = torch.Generator().manual_seed(seed)
    q_t = torch.randint(-127, 128, (K, N), generator=g, dtype=torch.int8)
    qscale = torch.rand(N, generator=g) * 0.02 + 1e-3
    v = torch.randn(*lead, K, generator=g).to(dtype)
    scale = (torch.rand(K, generator=g) + 0.25) if mode == "abs_scaled" else None
    b = torch.randn(N, generator=g) if bias else None
    if mode == "none":
        t = -math.inf
    else:
        t = _threshold_for(_scores64(v, mode, scale), round(frac * v.numel()))
    return q_t, qscale, v, t, scale, b


def _expected(q_t, qscale, v, t, mode, scale=None, bias=None):
    """float64, token by token: sum over the active k of v_k * q_t[k, :], times qscale, + bias; and the
    magnitude of the sum of |terms| (what accumulation error scales with)."""
    K, N = q_t.shape
    rows = v.reshape(-1, K).double()
    q = q_t.double()
    out = torch.zeros(rows.shape[0], N, dtype=torch.float64)
    mag = torch.zeros(rows.shape[0], N, dtype=torch.float64)
    for r, vr in enumerate(rows):
        active = torch.arange(K) if mode == "none" else (_scores64(vr, mode, scale) >= t).nonzero().flatten()
        out[r] = vr[active] @ q[active] * qscale.double()
        mag[r] = vr[active].abs() @ q[active].abs() * qscale.double()
        if bias is not None:
            out[r] += bias.double()
    return out.reshape(*v.shape[:-1], N), float(mag.max()) if mag.numel() else 0.0


def _assert_close(y, expected, dtype, *, rounding_ulps=1.0):
    exp, mag = expected
    assert y.dtype == dtype, y.dtype
    assert y.shape == exp.shape, (y.shape, exp.shape)
    top = max(float(exp.abs().max()) if exp.numel() else 0.0, 1.0)
    atol = 1e-5 * max(mag, 1.0)  # fp32 accumulation
    if dtype != torch.float32:
        atol += rounding_ulps * torch.finfo(dtype).eps * top  # the output rounded once to v's dtype
    torch.testing.assert_close(y.double(), exp, atol=atol, rtol=0)


def _per_call(q_t, qs, v, t, mode, scale=None, bias=None):
    """The native kernel with the operands bound for one call (cg.native_masked), int8 weights."""
    return cg.native_masked(q_t, qs, v, t, mode, scale, bias)


@pytest.fixture
def native():
    if cg.native_kernel() is None:
        pytest.skip(f"native CPU kernel unavailable here: {cg.native_status()}")


@pytest.fixture
def interpreter():
    if not (tg.triton_available() and tg.interpreting()):
        pytest.skip("needs triton and TRITON_INTERPRET=1")


# --------------------------------------------------------------------------------------------
# native CPU kernel
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,frac", [("none", 1.0)] + [(m, f) for m in MODES[1:] for f in (0.0, 0.3, 1.0)])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_native_int8_matches_float64(native, dtype, mode, frac, nthreads):
    """Empty, partial and full masks; K and N not multiples of 4 / 16 / 64; the OpenMP column split
    (N=320 at 2 threads); with and without bias; fp32, bf16 and fp16 inputs."""
    torch.set_num_threads(nthreads)
    for K, N, lead in [(203, 130, (1,)), (576, 320, (1, 1)), (7, 3, ())]:
        q_t, qs, v, t, scale, b = _problem(K, N, dtype, mode, frac, seed=K + N, lead=lead)
        for bias in (b, None):
            exp = _expected(q_t, qs, v, t, mode, scale, bias)
            y = _per_call(q_t, qs, v, t, mode, scale, bias)
            assert y is not None
            _assert_close(y, exp, dtype)
            y2 = dispatch.masked_gemv_int8(q_t, qs, v, t, mode=mode, scale=scale, bias=bias)  # the decode route
            torch.testing.assert_close(y2, y, atol=0, rtol=0)
            if frac == 0.0 and mode != "none":  # nothing active: exactly the bias (or zeros)
                only_bias = (bias if bias is not None else torch.zeros(N)).to(dtype).float()
                assert torch.equal(y.reshape(N).float(), only_bias)


def test_native_int8_threads_agree(native):
    """The column split changes no sum: 1 and 2 threads give the same bits."""
    q_t, qs, v, t, _, b = _problem(300, 1000, torch.float32, "abs", 0.4, seed=3)
    torch.set_num_threads(1)
    y1 = _per_call(q_t, qs, v, t, "abs", None, b)
    torch.set_num_threads(2)
    y2 = _per_call(q_t, qs, v, t, "abs", None, b)
    assert torch.equal(y1, y2)


def test_native_int8_strided_rows(native):
    """A row stride larger than N (a column slice of a wider int8 matrix) reads the right bytes."""
    q_wide, qs, v, t, _, b = _problem(64, 100, torch.float32, "square", 0.5, seed=4)
    q_t = q_wide[:, 10:70]
    assert q_t.stride() == (100, 1)
    y = _per_call(q_t, qs[10:70], v, t, "square", None, b[10:70])
    _assert_close(y, _expected(q_t, qs[10:70], v, t, "square", None, b[10:70]), torch.float32)


@pytest.mark.parametrize("mode,frac", [("none", 1.0)] + [(m, f) for m in MODES[1:] for f in (0.0, 0.3, 1.0)])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_bound_int8_call_matches_float64(native, mode, frac, nthreads):
    """The operands bound once (NativeCall) give the per-call binding's bits, against float64 too;
    growing K after a smaller call grows the per-thread index scratch."""
    torch.set_num_threads(nthreads)
    for K, N, lead in [(7, 3, ()), (203, 130, (1,)), (576, 320, (1, 1)), (1500, 70, (1,))]:
        q_t, qs, v, t, scale, b = _problem(K, N, torch.float32, mode, frac, seed=K + N + 1, lead=lead)
        for bias in (b, None):
            call = cg.NativeCall.bind(q_t, qs, mode, scale, bias)
            y = call(v, t)
            _assert_close(y, _expected(q_t, qs, v, t, mode, scale, bias), torch.float32)
            per_call = _per_call(q_t, qs, v, t, mode, scale, bias)
            assert torch.equal(y, per_call)
            assert call.binds(q_t, qs, mode, scale, bias)


def test_bound_int8_call_declines_and_rebinds(native):
    import copy
    import pickle
    q_t, qs, v, t, scale, b = _problem(40, 24, torch.float32, "abs", 0.5)
    call = cg.NativeCall.bind(q_t, qs, "abs", None, b)
    assert call(v.to(torch.bfloat16), t) is None  # other dtypes: native_masked converts them for one call
    assert call(torch.randn(2, 40), t) is None  # two tokens
    assert call(v.clone().requires_grad_(), t) is None  # autograd
    with torch.no_grad():
        assert call(v.clone().requires_grad_(), t) is not None
    # operands the kernel cannot take: bound all the same (not re-examined per token), calling gives None
    assert cg.NativeCall.bind(q_t, qs, "abs", None, b.bfloat16())(v, t) is None
    assert cg.NativeCall.bind(q_t, qs, "abs_scaled", None, b)(v, t) is None  # no scale
    assert cg.NativeCall.bind(q_t.t().contiguous().t(), qs, "abs", None, b)(v, t) is None
    # identity, not equality: a replaced tensor (a reload, a .to()) is another binding
    assert not call.binds(q_t.clone(), qs, "abs", None, b)
    assert not call.binds(q_t, qs, "square", None, b)
    # an in-place change of the weights is seen (the address is the same)
    before = call(v, t)
    q_t.neg_()
    torch.testing.assert_close(call(v, t), (-before + 2 * b).reshape(before.shape), atol=1e-4, rtol=0)
    # a copy never carries the addresses of the original's tensors
    assert copy.deepcopy(call) is None and pickle.loads(pickle.dumps(call)) is None


def _bound_call(m):
    """The native call bound in the operand an Int8Linear keeps of its own weights (rana.modules.operands)."""
    from rana.modules.operands import kept_operand
    operand = kept_operand(m, "own")
    return None if operand is None else operand.bound


def test_int8_modules_bind_their_own_tensors(native):
    """Int8Linear keeps its operand and bound call until its tensors change: a `.to()` drops them, a replaced
    buffer or a deepcopy rebinds; an in-place load_state_dict is seen without rebinding."""
    import copy
    from rana.modules.int8 import Int8Linear
    from rana.modules.operands import KEPT
    torch.manual_seed(0)
    lin = torch.nn.Linear(48, 40)
    q = torch.randint(-127, 128, (40, 48), dtype=torch.int8)
    m = Int8Linear.from_quantized(q, torch.rand(40) * 0.01, lin.bias, torch.float32).eval()
    x = torch.randn(1, 1, 48)
    with torch.no_grad():
        y = m(x)
        call = _bound_call(m)
        assert call is not None and call.usable
        torch.testing.assert_close(y, torch.nn.functional.linear(x, m.weight, m.bias), atol=1e-5, rtol=1e-5)
        m(x)
        assert _bound_call(m) is call  # bound once
        twin = copy.deepcopy(m)
        assert _bound_call(twin) is None
        torch.testing.assert_close(twin(x), y, atol=0, rtol=0)
        assert _bound_call(twin) is not None and _bound_call(twin) is not call
        state = {k: v.clone() for k, v in m.state_dict().items()}
        state["qweight"].neg_()
        m.load_state_dict(state)
        torch.testing.assert_close(m(x), torch.nn.functional.linear(x, m.weight, m.bias), atol=1e-5, rtol=1e-5)
        assert _bound_call(m) is call  # an in-place copy keeps the bound address
        m.qweight = m.qweight.clone()
        m(x)
        assert _bound_call(m) is not call
        m.to(torch.float64)
        assert not any(key.startswith(KEPT) for key in m.__dict__)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_route_keeps_half_precision_int8_tokens_on_the_kernel(native, dtype, monkeypatch):
    """A bf16 / fp16 token (or bias) on int8 weights: the bound call declines it and the route calls the kernel
    for this one call with fp32 operands (as the module path always did), never the torch path; alone and
    in a group (q/k/v, gate/up)."""
    def no_torch_path(*args):
        raise AssertionError("a one-token int8 call on CPU reached the torch path")

    monkeypatch.setattr(route, "_torch_masked", no_torch_path)
    for mode in MODES:
        q_t, qs, v, t, scale, b = _problem(70, 50, dtype, mode, 0.4, seed=15, lead=(1, 1))
        thr = None if mode == "none" else torch.tensor(t, dtype=torch.float32)
        for bias in (b, b.to(dtype), None):
            per_call = _per_call(q_t, qs, v, -math.inf if thr is None else float(thr), mode, scale, bias)
            w = Int8Weight(q_t, qs, bias)
            assert torch.equal(route.decode_masked(w, v, thr, mode, scale), per_call)
            w2 = Int8Weight(q_t[:, :20], qs[:20], None if bias is None else bias[:20])
            ys = route.decode_masked_grouped([w, w2], [v, v], [thr, thr], mode, [scale, scale])
            assert torch.equal(ys[0], per_call.reshape(-1))
            assert torch.equal(ys[1], _per_call(q_t[:, :20], qs[:20], v, -math.inf if thr is None else float(thr),
                                                mode, scale, None if bias is None else bias[:20]).reshape(-1))


def test_native_int8_declines_what_it_cannot_do(native):
    q_t, qs, v, t, _, b = _problem(40, 24, torch.float32, "abs", 0.5)
    assert _per_call(q_t.float(), qs, v, t, "abs") is None  # not int8
    assert _per_call(q_t.t().contiguous().t(), qs, v, t, "abs") is None  # not unit stride along N
    assert _per_call(q_t, qs, torch.randn(2, 40), t, "abs") is None  # two tokens
    assert _per_call(q_t, qs, v, t, "abs_scaled") is None  # no scale
    assert _per_call(q_t, qs, v.clone().requires_grad_(), t, "abs") is None  # autograd
    with torch.no_grad():
        assert _per_call(q_t, qs, v.clone().requires_grad_(), t, "abs") is not None


def test_unavailable_native_kernel_falls_back(monkeypatch):
    monkeypatch.setattr(cg, "_load", lambda: (None, "torch fallback (disabled in this test)"))
    assert cg.native_kernel() is None
    q_t, qs, v, t, _, b = _problem(50, 30, torch.float32, "abs", 0.3, seed=5)
    assert _per_call(q_t, qs, v, t, "abs", None, b) is None
    exp = _expected(q_t, qs, v, t, "abs", None, b)
    _assert_close(mg.masked_gemv_int8_torch(q_t, qs, v, t, mode="abs", bias=b), exp, torch.float32)
    operand = Int8Weight(q_t, qs, b)
    assert operand.backend == "torch"
    _assert_close(route.decode_masked(operand, v, torch.tensor(t), "abs"), exp, torch.float32)


def test_the_int8_entry_point_comes_from_the_same_cached_library():
    """The int8 kernel is compiled into the one cached library (its name hashes the whole source) and reached
    through the one entry point: where the fp32 kernel loads, so does the int8 one."""
    if cg.native_kernel() is None:
        pytest.skip(cg.native_status())
    assert cg.native_kernel().masked_i8 is not None and cg.native_kernel().lanes in (16, 8, 1)
    assert cg.library_name("cc", cg.BUILD_FLAGS) != cg.library_name("cc", cg.BUILD_FLAGS + ("-DX",))


@pytest.mark.parametrize("target,lanes", [((), (16, 8, 1)), (("-mno-avx512f",), (8, 1)),
                                          (("-mno-avx512f", "-mno-avx2"), (1,))])
def test_every_int8_inner_loop_matches_float64(native, tmp_path, target, lanes):
    """The int8 rows' inner loop is written three times (AVX-512, AVX2, plain C), picked by what the
    compiler targets: build the library for each target this machine can run and check each against
    the float64 sum, with widths that leave vector tails (N = 3, 37, 130) and active counts that leave
    row tails (not multiples of 4)."""
    import shutil

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    flags = (*cg.BUILD_FLAGS[:2], *target, *cg.BUILD_FLAGS[2:])
    lib = cg.build_variant(compiler, flags, tmp_path)
    assert lib.lanes in lanes
    for K, N, frac in [(203, 130, 0.33), (64, 37, 0.5), (9, 3, 1.0), (50, 16, 0.0)]:
        q_t, qs, v, t, _, b = _problem(K, N, torch.float32, "abs", frac, seed=K * N)
        call = cg.NativeCall.bind(q_t, qs, "abs", None, b, library=lib)
        y = torch.empty(N)
        n = lib.masked_i8(call.operands_address, v.data_ptr(), t, y.data_ptr(), 1)
        assert n == round(frac * K)
        _assert_close(y.reshape(1, N), _expected(q_t, qs, v, t, "abs", None, b), torch.float32)


# --------------------------------------------------------------------------------------------
# torch paths
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", MODES)
def test_torch_paths_match_float64(dtype, mode):
    for frac in ((1.0,) if mode == "none" else (0.0, 0.2, 0.7, 1.0)):
        # several tokens (any leading dims) through the dense path
        q_t, qs, v, t, scale, b = _problem(45, 21, dtype, mode, frac, seed=6, lead=(2, 3))
        for bias in (b, None):
            exp = _expected(q_t, qs, v, t, mode, scale, bias)
            thr = None if mode == "none" else t
            _assert_close(mg.masked_gemv_int8_dense(q_t, qs, v, thr, mode=mode, scale=scale, bias=bias), exp, dtype)
            _assert_close(dispatch.masked_gemv_int8(q_t, qs, v, thr, mode=mode, scale=scale, bias=bias), exp, dtype)
            ref = mg.masked_gemv_int8_reference(q_t, qs, v, thr, mode=mode, scale=scale, bias=bias)
            torch.testing.assert_close(ref, exp[0], atol=1e-9 * max(exp[1], 1.0), rtol=0)
        # one token: the gather path and the CPU dispatcher (native when built), a tensor threshold too
        q_t, qs, v, t, scale, b = _problem(45, 21, dtype, mode, frac, seed=7)
        exp = _expected(q_t, qs, v, t, mode, scale, b)
        thr = None if mode == "none" else torch.tensor(t, dtype=torch.float32)
        for fn in (mg.masked_gemv_int8_gather, mg.masked_gemv_int8_torch, dispatch.masked_gemv_int8):
            _assert_close(fn(q_t, qs, v, thr, mode=mode, scale=scale, bias=b), exp, dtype)


def test_dense_path_runs_on_meta_without_sync():
    """Sync-free: the dense path never reads a value on the host (it runs on meta tensors)."""
    q_t = torch.empty(64, 32, dtype=torch.int8, device="meta")
    qs = torch.empty(32, device="meta")
    v = torch.empty(3, 64, dtype=torch.bfloat16, device="meta")
    t = torch.empty((), device="meta")
    for mode in MODES:
        y = mg.masked_gemv_int8_dense(q_t, qs, v, t, mode=mode, scale=torch.empty(64, device="meta"),
                                      bias=torch.empty(32, device="meta"))
        assert y.shape == (3, 32) and y.dtype == torch.bfloat16


def test_int8_checks():
    q_t, qs, v, t, _, _ = _problem(16, 8, torch.float32, "abs", 0.5)
    with pytest.raises(ValueError, match="int8"):
        mg.masked_gemv_int8_dense(q_t.float(), qs, v, t, mode="abs")
    with pytest.raises(ValueError, match="qscale"):
        mg.masked_gemv_int8_dense(q_t, qs[:3], v, t, mode="abs")
    with pytest.raises(ValueError, match="mode"):
        mg.masked_gemv_int8_dense(q_t, qs, v, t, mode="bogus")
    with pytest.raises(ValueError, match="scale"):
        mg.masked_gemv_int8_dense(q_t, qs, v, t, mode="abs_scaled")


# --------------------------------------------------------------------------------------------
# Triton kernel under the interpreter
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_int8_matches_float64(interpreter, dtype):
    """Every mode incl. "none", odd shapes (K, N not multiples of the blocks), bias / no bias, empty and
    full masks; the interpreter's config splits K (workspace + reduce launch)."""
    for mode in MODES:
        for frac in ((1.0,) if mode == "none" else (0.0, 0.4, 1.0)):
            q_t, qs, v, t, scale, b = _problem(37, 29, dtype, mode, frac, seed=8)
            for bias in (b, None):
                exp = _expected(q_t, qs, v, t, mode, scale, bias)
                thr = None if mode == "none" else torch.tensor(t)
                y = dispatch.masked_gemv_int8_triton(q_t, qs, v, thr, mode=mode, scale=scale, bias=bias)
                _assert_close(y, exp, dtype, rounding_ulps=2.0)  # the interpreter's casts may truncate


def test_triton_int8_grouped_and_both_store_paths(interpreter, monkeypatch):
    """q/k/v as one launch (GQA widths, biases on q and v only), and configs with SPLIT == 1 (direct store)
    and SPLIT > 1 (fp32 partials, each scaled once, summed by the reduce launch)."""
    dtype = torch.bfloat16
    groups = [_problem(40, n, dtype, "abs", frac, seed=s, bias=bias)
              for n, frac, s, bias in ((48, 0.5, 9, True), (16, 0.3, 10, False), (16, 0.8, 11, True))]
    v = groups[0][2]
    q_ts, qss, ts, bs = [g[0] for g in groups], [g[1] for g in groups], [g[3] for g in groups], [g[5] for g in groups]
    exp = torch.cat([_expected(q, qs, v, t, "abs", None, b)[0].reshape(-1) for q, qs, t, b in zip(q_ts, qss, ts, bs)])
    mag = max(_expected(q, qs, v, t, "abs", None, b)[1] for q, qs, t, b in zip(q_ts, qss, ts, bs))
    thresholds = [torch.tensor(t) for t in ts]
    outs = [tg.grouped_masked_gemv_triton([v] * 3, q_ts, thresholds, "abs", [None] * 3, bs, qscales=qss)]
    for cfg in (tg.GemvConfig(16, 8, 1, 4), tg.GemvConfig(32, 8, 3, 4), tg.GemvConfig(64, 16, 8, 4)):
        outs.append(tg.grouped_masked_gemv_triton([v] * 3, q_ts, thresholds, "abs", [None] * 3, bs, qscales=qss,
                                                  config=cfg))
    monkeypatch.setattr(weights, "TRITON_ON_CPU", True)  # RANA_TRITON_ON_CPU=1: CPU operands take the kernels
    operands = [Int8Weight(q, qs, b) for q, qs, b in zip(q_ts, qss, bs)]
    assert {w.backend for w in operands} == {"triton"}
    outs.append(torch.cat(route.decode_masked_grouped(operands, [v] * 3, thresholds, "abs", [None] * 3)))
    for y in outs:
        _assert_close(y, (exp, mag), dtype, rounding_ulps=2.0)


def test_triton_op_and_decode_path_under_interpreter(interpreter, monkeypatch):
    q_t, qs, v, t, scale, b = _problem(33, 20, torch.float16, "abs_scaled", 0.5, seed=12, lead=(1, 1))
    exp = _expected(q_t, qs, v, t, "abs_scaled", scale, b)
    thr = torch.tensor(t)
    if ops.HAS_TRITON:
        flat = torch.ops.rana.decode_masked_triton([v], [q_t], [qs], [thr], "abs_scaled", [scale], [b], 2)
        _assert_close(flat.reshape(1, 1, 20), exp, torch.float16, rounding_ulps=2.0)
    monkeypatch.setattr(weights, "TRITON_ON_CPU", True)  # RANA_TRITON_ON_CPU=1: CPU tensors take the kernel eagerly
    operand = Int8Weight(q_t, qs, b)
    assert operand.backend == "triton"
    y = route.decode_masked(operand, v, thr, "abs_scaled", scale)
    _assert_close(y, exp, torch.float16, rounding_ulps=2.0)
    dense = route.decode_masked(operand, v, None, "none")
    _assert_close(dense, _expected(q_t, qs, v, -math.inf, "none", None, b), torch.float16, rounding_ulps=2.0)


# --------------------------------------------------------------------------------------------
# ops, the decode route, torch.compile
# --------------------------------------------------------------------------------------------
def test_ops_are_registered():
    """int8 weights take the same ops as float ones (their scales as `qscale`)."""
    assert {"rana::decode_masked", "rana::decode_masked_grouped"} <= set(ops.OP_NAMES)
    if ops.HAS_TRITON:
        assert "rana::decode_masked_triton" in ops.OP_NAMES


@pytest.mark.parametrize("mode", MODES)
def test_opcheck_and_fake_shapes(mode):
    q_t, qs, v, t, scale, b = _problem(40, 24, torch.bfloat16, mode, 0.5, lead=(1, 1))
    thr = torch.tensor(0.0 if mode == "none" else t)
    torch.library.opcheck(torch.ops.rana.decode_masked.default, (q_t, qs, v, thr, mode, scale, b))
    y = torch.ops.rana.decode_masked(q_t, qs, v, thr, mode, scale, b)
    _assert_close(y, _expected(q_t, qs, v, t, mode, scale, b), torch.bfloat16)
    q2, qs2, _, t2, s2, _ = _problem(40, 8, torch.bfloat16, mode, 0.3, seed=1, bias=False)
    thr2 = torch.tensor(0.0 if mode == "none" else t2)
    args = ([v, v], [q_t, q2], [qs, qs2], [thr, thr2], mode, [scale, s2], [b, None])
    torch.library.opcheck(torch.ops.rana.decode_masked_grouped.default, args)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as fake:
        f = lambda x: fake.from_tensor(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        y = torch.ops.rana.decode_masked(f(q_t), f(qs), f(torch.randn(2, 5, 40)), f(thr), mode, f(scale), f(b))
        assert y.shape == (2, 5, 24) and y.dtype == torch.float32
        flat = torch.ops.rana.decode_masked_grouped([f(v), f(v)], [f(q_t), f(q2)], [f(qs), f(qs2)],
                                                  [f(thr), f(thr2)], mode, [f(scale), f(s2)], [f(b), None])
        assert flat.shape == (32,) and flat.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_masked_int8_eager(dtype):
    for mode in MODES:
        q_t, qs, v, t, scale, b = _problem(70, 50, dtype, mode, 0.4, seed=13, lead=(1, 1))
        thr = torch.tensor(0.0 if mode == "none" else t)
        y = route.decode_masked(Int8Weight(q_t, qs, b), v, thr, mode, scale)
        _assert_close(y, _expected(q_t, qs, v, t, mode, scale, b), dtype)
        # several tokens: the dense dequantized product
        q_t, qs, v, t, scale, b = _problem(70, 50, dtype, mode, 0.4, seed=14, lead=(3,))
        y = route.decode_masked(Int8Weight(q_t, qs, b), v, torch.tensor(0.0 if mode == "none" else t), mode, scale)
        _assert_close(y, _expected(q_t, qs, v, t, mode, scale, b), dtype)


def test_compiled_fullgraph_calls_the_op(monkeypatch):
    """torch.compile(fullgraph=True) of a function calling the decode route with int8 operands (and the grouped
    form) on CPU: no graph break, the custom ops in the graph, the eager result; aot_eager checks the fakes."""
    monkeypatch.setattr(weights, "TRITON_ON_CPU", False)
    torch._dynamo.reset()
    q_t, qs, v, t, scale, b = _problem(64, 48, torch.float32, "abs_scaled", 0.5, seed=15, lead=(1, 1))
    q2, qs2, _, t2, _, _ = _problem(64, 16, torch.float32, "abs", 0.5, seed=16, bias=False)
    thr, thr2 = torch.tensor(t), torch.tensor(t2)
    w, w_nobias, w2 = Int8Weight(q_t, qs, b), Int8Weight(q_t, qs), Int8Weight(q2, qs2)

    def step(x):
        y = route.decode_masked(w, x, thr, "abs_scaled", scale)
        d = route.decode_masked(w_nobias, x, thr, "none")
        g = route.decode_masked_grouped([w, w2], [x, x], [thr, thr2], "abs", [None, None])
        return torch.relu(y) + d, torch.cat(g)

    from decode_harness import traced_targets

    targets = traced_targets(step, v)
    assert {"rana.decode_masked", "rana.decode_masked_grouped"} <= targets, targets
    eager = step(v)
    (y_exp, y_mag), (d_exp, d_mag) = (_expected(q_t, qs, v, t, "abs_scaled", scale, b),
                                      _expected(q_t, qs, v, -math.inf, "none"))
    _assert_close(eager[0], (torch.relu(y_exp) + d_exp, y_mag + d_mag), torch.float32)
    torch._dynamo.reset()
