"""The CPU decode-step fixes of docs/cpu_decode_profile.md: a tied LM head decodes through a column-major copy,
decode groups step aside eagerly on CPU, int8 siblings decode in one grouped int8 call. No timing assertions."""
from __future__ import annotations

import torch
import torch.nn as nn

from rana.kernels import ops, route
from rana.kernels.weights import FloatWeight
from rana.modules import groups
from rana.modules.groups import DecodeGroup
from rana.modules.int8 import Int8Linear
from rana.modules.neuron_linear import InputSparseHead, InputSparseLinear, NeuronThresholdLinear
from rana.modules.rank_linear import RankAdapterLinear


def _tied_head(seed=0, n=96, k=32):
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(n, k)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(n, k, generator=g))
    head = InputSparseHead(emb.weight, None, 0.5).eval()
    assert head.weight is emb.weight and emb.weight.is_contiguous()  # tied, row-major
    return emb, head


def _reference(head, x):
    mask = x.abs() >= head.threshold
    return nn.functional.linear(x * mask, head.weight.detach(), head.bias)


def test_tied_head_decodes_through_a_column_major_copy_and_follows_the_weight():
    emb, head = _tied_head()
    x = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = head(x)
        torch.testing.assert_close(y, _reference(head, x), rtol=1e-5, atol=1e-5)
        assert head._decode_t is not None and head._decode_t[1].t().is_contiguous()
        assert emb.weight.is_contiguous() and head.weight is emb.weight  # the tie and its layout untouched
        assert "_decode_t" not in str(list(head.state_dict()))
        first = head._decode_t[1]
        head(x)
        assert head._decode_t[1] is first  # reused while the weight is unchanged
        emb.weight.mul_(2.0)  # an in-place change (a merge, a load): the copy is remade
        torch.testing.assert_close(head(x), _reference(head, x), rtol=1e-5, atol=1e-5)
        assert head._decode_t[1] is not first


def test_tied_head_decode_copy_off_takes_the_masked_dense_product():
    _, head = _tied_head(seed=2)
    head.decode_copy = False
    x = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(head(x), _reference(head, x), rtol=1e-5, atol=1e-5)
    assert head._decode_t is None


def test_tied_head_with_gradients_keeps_the_torch_path():
    _, head = _tied_head(seed=4)
    x = torch.randn(1, 1, 32, requires_grad=True)
    head(x).sum().backward()
    assert x.grad is not None and head._decode_t is None


def _siblings(kind="input_sparse", n_out=(48, 16, 16), k=32, seed=0, int8=False):
    g = torch.Generator().manual_seed(seed)
    mods = []
    for n in n_out:
        w = torch.randn(n, k, generator=g) / 6
        if kind == "input_sparse":
            m = InputSparseLinear(w, torch.randn(n, generator=g), 0.6)
        elif kind == "neuron":
            m = NeuronThresholdLinear(w, None, 0.1)
        else:
            m = RankAdapterLinear(torch.randn(n, 8, generator=g) / 3, torch.randn(8, k, generator=g) / 6, None, 0.05)
        if int8:
            name = "A" if kind == "rank" else "linear"
            lin = getattr(m, name)
            q = torch.randint(-127, 128, lin.weight.shape, generator=g, dtype=torch.int8)
            s = torch.rand(lin.weight.shape[0], generator=g) / 50 + 1e-3
            setattr(m, name, Int8Linear.from_quantized(q, s, lin.bias, torch.float32))
        mods.append(m.eval())
    return mods


def _count_grouped(monkeypatch):
    calls = {"fp32": [], "int8": []}
    real = groups.decode_masked_grouped

    def counting(ws, *a):
        calls["int8" if ws[0].format == "int8" else "fp32"].append(len(ws))
        return real(ws, *a)

    monkeypatch.setattr(groups, "decode_masked_grouped", counting)
    return calls


def test_groups_step_aside_eagerly_on_cpu(monkeypatch):
    calls = _count_grouped(monkeypatch)
    mods = _siblings()
    x = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        single = [m(x) for m in mods]
        DecodeGroup(mods)
        assert not groups.GROUP_EAGER_CPU and route.eager_cpu(x)
        grouped = [m(x) for m in mods]
    assert calls == {"fp32": [], "int8": []}  # each member its own native call
    for a, b in zip(grouped, single):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_int8_siblings_decode_in_one_grouped_int8_call(monkeypatch):
    monkeypatch.setattr(groups, "GROUP_EAGER_CPU", True)
    calls = _count_grouped(monkeypatch)
    for kind in ("input_sparse", "neuron", "rank"):
        mods = _siblings(kind, int8=True, seed=11)
        x = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(8))
        with torch.no_grad():
            single = [m(x) for m in mods]
            for m in mods:
                m.meter_on = True  # the torch masked product over the dequantized weights
            refs = [m(x) for m in mods]
            for m in mods:
                m.meter_on = False
            DecodeGroup(mods)
            grouped = [m(x) for m in mods]
        for a, b, r in zip(grouped, single, refs):
            assert a.shape == b.shape == r.shape
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(a, r, rtol=1e-4, atol=1e-4)
    assert calls == {"fp32": [], "int8": [3, 3, 3]}


def test_int8_beside_full_precision_siblings_decode_on_their_own(monkeypatch):
    monkeypatch.setattr(groups, "GROUP_EAGER_CPU", True)
    calls = _count_grouped(monkeypatch)
    mods = _siblings(seed=5)
    mods[1] = _siblings(seed=5, int8=True)[1]
    x = torch.randn(1, 1, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        single = [m(x) for m in mods]
        DecodeGroup(mods)
        grouped = [m(x) for m in mods]
    assert calls == {"fp32": [], "int8": []}
    for a, b in zip(grouped, single):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bound_call_matches_the_op_implementation():
    """A module's operand (its native call bound once) and the registered op's implementation (its binding kept by
    op_native, a group of one) agree to fp32 rounding: the group entry may split the kept rows between threads,
    so its sums run in another order."""
    g = torch.Generator().manual_seed(12)
    w = torch.randn(40, 24, generator=g).t().contiguous().t()  # column-major, as the adapters store it
    x = torch.randn(1, 1, 24, generator=g)
    t = torch.tensor(0.7)
    for mode in ("abs", "square", "abs_scaled"):
        scale = torch.rand(24, generator=g) if mode == "abs_scaled" else None
        a = route.decode_masked(FloatWeight(w), x, t, mode, scale)
        b = ops.decode_masked_impl(w.t(), None, x, t, mode, scale, None)
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(a.abs().max()))
