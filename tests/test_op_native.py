"""The registered ops' CPU token through bindings kept across calls (rana.kernels.op_native).

What a compiled CPU decode step runs per projection or sibling group per token: the results equal the kernels'
own (float against float64, int8 bit for bit against each projection's own bound call), a binding is made once
and reused, an in-place threshold change rebinds, freed weights drop their binding, and a compiled model's
steps bind nothing after the first.
"""
from __future__ import annotations

import gc
import math

import pytest
import torch

from rana.kernels import cpu_gemv as cg
from rana.kernels import op_native
from rana.kernels.torch_gemv import masked_gemv_torch

from test_kernels import _assert_close, _expected, _problem
import test_w8a8


@pytest.fixture(autouse=True)
def native():
    if cg.native_kernel() is None:
        pytest.skip(f"native CPU kernel unavailable here: {cg.native_status()}")
    op_native.forget_all()
    yield
    op_native.forget_all()


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _op(name):
    return getattr(torch.ops.rana, name).default


BLOCK = 32  # the W8A8 ops' block here (test_w8a8 covers every block)


def _masked_op(activations: str):
    """rana::decode_masked, or for int8 activations rana::decode_w8a8 with blocks of BLOCK: one signature."""
    if activations != "int8":
        return _op("decode_masked")
    return lambda *args: _op("decode_w8a8")(*args, BLOCK)


def _grouped_op(activations: str):
    if activations != "int8":
        return _op("decode_masked_grouped")
    return lambda *args: _op("decode_w8a8_grouped")(*args, BLOCK)


def _own(q_t, qs, b, activations: str):
    """The projection's own bound native call."""
    return cg.NativeCall.bind(q_t, qs, "abs", None, b, activations=activations, block=BLOCK)


@pytest.mark.parametrize("mode", ["abs", "abs_scaled", "square", "none"])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_float_op_matches_float64(threads, mode, nthreads):
    torch.set_num_threads(nthreads)
    w_t, v, t, scale, b = _problem(203, 97, torch.float32, "abs" if mode == "none" else mode, 0.4, seed=3)
    thr = torch.tensor(-math.inf if mode == "none" else float(t))
    with torch.inference_mode():
        y = _op("decode_masked")(w_t, None, v, thr, mode, scale, b)
    _assert_close(y, _expected(w_t, v, None if mode == "none" else float(t), mode, scale, b), torch.float32)


@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("frac", [0.0, 0.5, 1.0])
def test_int8_op_equals_the_projections_own_call(activations, frac):
    q_t, qs, v, t, _, b = test_w8a8._problem(130, 300, "abs", frac, seed=6)
    with torch.inference_mode():
        y = _masked_op(activations)(q_t, qs, v, torch.tensor(float(t)), "abs", None, b)
    own = _own(q_t, qs, b, activations)(v.contiguous(), float(t))
    torch.testing.assert_close(y, own, atol=0, rtol=0)


def _siblings(K, widths, seed, activations):
    """int8 q/k/v-like projections (their own thresholds) and their own bound calls."""
    members = []
    for i, N in enumerate(widths):
        q_t, qs, v, t, _, b = test_w8a8._problem(K, N, "abs", 0.3 + 0.2 * i, seed=seed)
        members.append((q_t, qs, torch.tensor(float(t)), b if i == 0 else None))
    return members, v


@pytest.mark.parametrize("activations", ["float", "int8"])
@pytest.mark.parametrize("separate_buffers", [False, True])
def test_group_is_one_call_equal_to_each_member(activations, separate_buffers):
    """One binding for the group; inputs in separate buffers of equal values (as inductor hands them) too."""
    members, v = _siblings(96, [96, 32, 32], seed=9, activations=activations)
    vs = [v.clone() if separate_buffers else v for _ in members]
    before = op_native.bound_count()
    with torch.inference_mode():
        y = _grouped_op(activations)(vs, [m[0] for m in members], [m[1] for m in members], [m[2] for m in members], "abs",
                      [None] * 3, [m[3] for m in members])
    assert op_native.bound_count() == before + 1
    at = 0
    for q_t, qs, t, b in members:
        own = _own(q_t, qs, b, activations)(v.contiguous(), float(t))
        torch.testing.assert_close(y[at:at + q_t.shape[1]], own.reshape(-1), atol=0, rtol=0)
        at += q_t.shape[1]
    assert at == y.numel()


def test_members_with_their_own_inputs_are_not_grouped():
    members, v = _siblings(64, [64, 16], seed=2, activations="int8")
    other = v * 2
    args = ([v, other], [m[0] for m in members], [m[1] for m in members], [m[2] for m in members], "abs",
            [None, None], [m[3] for m in members])
    assert op_native.grouped_native(*args, activations="int8", block=BLOCK) is None
    with torch.inference_mode():
        y = _grouped_op("int8")(*args)
    for (q_t, qs, t, b), x, (start, end) in zip(members, (v, other), ((0, 64), (64, 80))):
        own = _own(q_t, qs, b, "int8")(x.contiguous(), float(t))
        torch.testing.assert_close(y[start:end], own.reshape(-1), atol=0, rtol=0)


def test_bound_once_and_rebound_when_the_threshold_moves():
    q_t, qs, v, t, _, b = test_w8a8._problem(130, 64, "abs", 0.5, seed=4)
    thr = torch.tensor(float(t))
    op = _masked_op("int8")
    with torch.inference_mode():
        before = op_native.bound_count()
        first = op(q_t, qs, v, thr, "abs", None, b)
        for _ in range(3):
            torch.testing.assert_close(op(q_t, qs, v, thr, "abs", None, b), first, atol=0, rtol=0)
        assert op_native.bound_count() == before + 1
        thr.fill_(1e9)  # nothing kept: the output is the bias alone
        torch.testing.assert_close(op(q_t, qs, v, thr, "abs", None, b), b.reshape(1, -1), atol=0, rtol=0)
        assert op_native.bound_count() == before + 2


def test_freed_weights_end_their_binding():
    """A binding holds no tensor: once the weights are freed it is never used again, and prune drops it."""
    q_t, qs, v, t, _, b = test_w8a8._problem(64, 32, "abs", 0.5, seed=5)
    thr = torch.tensor(float(t))
    with torch.inference_mode():
        _masked_op("int8")(q_t, qs, v, thr, "abs", None, b)
    (binding,) = op_native.bindings()
    assert binding.current()
    del q_t
    gc.collect()
    assert not binding.current()
    assert op_native.prune() == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_token_with_int8_weights(dtype):
    q_t, qs, v, t, _, b = test_w8a8._problem(130, 64, "abs", 0.5, seed=7)
    v = v.to(dtype)
    with torch.inference_mode():
        y = _masked_op("int8")(q_t, qs, v, torch.tensor(float(t)), "abs", None, b)
    assert y.dtype == dtype
    own = _own(q_t, qs, b, "int8")(v.float().contiguous(), float(t))
    torch.testing.assert_close(y, own.to(dtype), atol=0, rtol=0)


def test_float_weights_in_half_precision_keep_their_torch_path():
    """The native kernel takes fp32 float weights only: a bf16 model's ops decline the binding."""
    w_t, v, t, _, b = _problem(64, 32, torch.bfloat16, "abs", 0.5, seed=8)
    assert op_native.masked_native(w_t, None, v, torch.tensor(float(t)), "abs", None, b) is None
    thr = torch.tensor(float(t))
    with torch.inference_mode():
        y = _op("decode_masked")(w_t, None, v, thr, "abs", None, b)
        torch.testing.assert_close(y, masked_gemv_torch(w_t, v, thr, mode="abs", bias=b), atol=0, rtol=0)


def test_compiled_steps_bind_nothing_after_the_first():
    """A tiny rana model's decode step compiled by inductor: equal to eager, and every later token reuses the
    bindings the first one made."""
    from decode_harness import decode_step, greedy_static
    from test_decode_ops import rana_adapted

    model = rana_adapted()
    ref_logits, ref_tokens = greedy_static(model, decode_step)
    torch._dynamo.reset()
    step = torch.compile(decode_step, fullgraph=True, backend="inductor")
    try:
        greedy_static(model, step)
        made = op_native.bound_count()
        logits, tokens = greedy_static(model, step)
        assert op_native.bound_count() == made
    finally:
        torch._dynamo.reset()
    assert op_native.bindings()
    assert float((logits - ref_logits).abs().max()) <= 1e-5 * float(ref_logits.abs().max())
    assert torch.equal(tokens, ref_tokens)
