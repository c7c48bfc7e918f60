"""The native kernel's sibling group (cpu_gemv.NativeGroup): several projections of one token in one call.

Each projection's columns must equal what its own bound call (NativeCall) computes: float weights against
float64 sums (the group's threads split rows, not columns, so its sum order differs from the single call's),
int8 weights (W8A16, W8A8) bit for bit (the group calls the same functions). Columns outside the group's
projections are never written.
"""
from __future__ import annotations

import pytest
import torch

from rana.kernels import cpu_gemv as cg

from test_kernels import MODES, _assert_close, _expected, _problem, _scores64, _threshold_for
import test_w8a8


@pytest.fixture(scope="module")
def native():
    if cg.native_kernel() is None:
        pytest.skip(f"native CPU kernel unavailable here: {cg.native_status()}")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _float_members(K, widths, mode, frac, seed):
    """(NativeCall, threshold, expected float64 output) per projection of one shared token; each projection
    keeps its own share of the inputs (its own threshold), as q, k and v do."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(1, K, generator=g)
    scale = (torch.rand(K, generator=g) + 0.25) if mode == "abs_scaled" else None
    scores = _scores64(v, mode, scale)
    members = []
    for i, N in enumerate(widths):
        w_t = torch.randn(K, N, generator=g)
        bias = torch.randn(N, generator=g) if i % 2 == 0 else None
        keep = frac if frac in (0.0, 1.0) else min(1.0, frac + 0.1 * i)
        t = _threshold_for(scores, round(keep * K))
        call = cg.NativeCall.bind(w_t, None, mode, scale, bias)
        members.append((call, t, _expected(w_t, v, t, mode, scale, bias)))
    return members, v


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frac", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("nthreads", [1, 2, 3])
def test_float_group_matches_float64(native, threads, mode, frac, nthreads):
    """q/k/v-like (narrow rows, split over threads by rows) and a wide head-like group (split by columns), with
    gaps between the projections' columns that stay untouched."""
    torch.set_num_threads(nthreads)
    for K, widths in [(96, [96, 32, 32]), (203, [130, 7]), (64, [9000])]:
        members, v = _float_members(K, widths, mode, frac, seed=K)
        offsets, at = [], 3
        for call, _, _ in members:
            offsets.append(at)
            at += call.N + 5
        group = cg.NativeGroup.bind([m[0] for m in members], [m[1] for m in members], offsets, at)
        assert group is not None and group.K == K
        y = torch.full((1, at), 1234.5)
        assert group(v.contiguous(), y)
        written = torch.zeros(at, dtype=torch.bool)
        for (call, _, exp), off in zip(members, offsets):
            _assert_close(y[:, off:off + call.N], exp, torch.float32)
            written[off:off + call.N] = True
        assert bool((y[0, ~written] == 1234.5).all())


def test_float_group_never_takes_the_dense_branch(native):
    """Everything kept: the group multiplies the rows itself (no dense-BLAS branch, no streak recorded), so its
    result cannot depend on what earlier tokens kept."""
    cg.reset_dense_streaks()
    members, v = _float_members(300, [64, 64], "abs", 1.0, seed=1)
    group = cg.NativeGroup.bind([m[0] for m in members], [m[1] for m in members], [0, 64], 128)
    y = torch.empty(1, 128)
    assert group(v, y)
    for (call, t, exp), off in zip(members, (0, 64)):
        _assert_close(y[:, off:off + 64], exp, torch.float32)
        assert cg.dense_streak(call.tensors[0], float(t)) == 0


@pytest.mark.parametrize("nthreads", [1, 2])
def test_mixed_formats_equal_their_own_calls(native, threads, nthreads):
    """float, W8A16 and W8A8 projections in one group: the int8 ones bit for bit as their bound calls."""
    torch.set_num_threads(nthreads)
    K = 130
    w_t, v, t, _, b = _problem(K, 70, torch.float32, "abs", 0.5, seed=5, lead=(1,))
    q_t, qs, _, _, _, qb = test_w8a8._problem(K, 300, "abs", 0.5, seed=6)
    calls = [cg.NativeCall.bind(w_t, None, "abs", None, b),
             cg.NativeCall.bind(q_t, qs, "abs", None, qb),
             cg.NativeCall.bind(q_t, qs, "abs", None, None, activations="int8"),
             cg.NativeCall.bind(q_t, qs, "none", None, None, activations="int8")]
    ts = [t, t, t, float("-inf")]
    offsets = [0, 70, 370, 670]
    group = cg.NativeGroup.bind(calls, ts, offsets, 970)
    y = torch.empty(1, 970)
    assert group(v, y)
    _assert_close(y[:, :70], _expected(w_t, v, t, "abs", None, b), torch.float32)
    for call, tt, off in zip(calls[1:], ts[1:], offsets[1:]):
        torch.testing.assert_close(y[:, off:off + 300], call(v, tt), atol=0, rtol=0)


def test_bind_declines_what_it_cannot_serve(native):
    w_t, v, t, _, _ = _problem(40, 16, torch.float32, "abs", 0.5, seed=2, lead=(1,))
    call = cg.NativeCall.bind(w_t, None, "abs")
    other_k = cg.NativeCall.bind(torch.randn(41, 16), None, "abs")
    unusable = cg.NativeCall.bind(w_t.to(torch.float64), None, "abs")
    assert not unusable.usable
    assert cg.NativeGroup.bind([], [], [], 0) is None
    assert cg.NativeGroup.bind([call, other_k], [t, t], [0, 16], 32) is None  # one input width per group
    assert cg.NativeGroup.bind([call, unusable], [t, t], [0, 16], 32) is None
    assert cg.NativeGroup.bind([call], [t], [20], 32) is None  # its columns past the row
    assert cg.NativeGroup.bind([call, call], [t, t], [0, 8], 32) is None  # overlapping columns
    assert cg.NativeGroup.bind([call], [t], [16], 32) is not None
