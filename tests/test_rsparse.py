"""R-Sparse: input sparsity plus a low-rank path for the dropped inputs (rana.math.sparse_lowrank,
SparseLowRankLinear, the `rsparse` method)."""
import math

import pytest
import torch

from rana.accounting import measured_macs, metering
from rana.compress import compress_model
from rana.math.masks import threshold_for_keep_fraction
from rana.math.sparse_lowrank import Svd, side_rank, sparse_lowrank_choice, sparse_lowrank_output
from rana.modules import InputSparseLinear, SparseLowRankLinear
from helpers import tiny_calibration, tiny_compress_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def _layer(o=24, i=16, rank=5, threshold=0.5, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(o, i, generator=g)
    b = torch.randn(o, generator=g) if bias else None
    A, B = Svd.of(W).factors(rank)
    return W, b, SparseLowRankLinear(W, b, threshold, A, B).eval()


def _inputs(n=7, i=16, seed=1):
    return torch.randn(n, i, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("rank", [3, 16])
def test_side_path_with_nothing_dropped_is_exact(rank):
    W, b, m = _layer(rank=rank, threshold=-math.inf)
    x = _inputs()
    with torch.no_grad():
        assert torch.equal(m(x), torch.nn.functional.linear(x, W, b))  # the side path adds exactly zero
        # the one-token decode path runs the masked-GEMV kernel: same sum, another order
        torch.testing.assert_close(m(x[:1]), torch.nn.functional.linear(x[:1], W, b), rtol=1e-6, atol=1e-6)


def test_full_rank_side_path_recovers_every_dropped_input():
    W, b, m = _layer(rank=16, threshold=math.inf)  # everything dropped, A B = W
    x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(m(x), torch.nn.functional.linear(x, W, b), rtol=1e-5, atol=1e-5)


def test_module_is_the_formula_and_the_decode_path_agrees():
    W, b, m = _layer(rank=4, threshold=0.6)
    x = _inputs()
    A, B = Svd.of(W).factors(4)
    with torch.no_grad():
        expected = sparse_lowrank_output(x, W, 0.6, A, B) + b
        torch.testing.assert_close(m(x), expected, rtol=1e-5, atol=1e-5)
        for j in range(len(x)):  # one decode token at a time
            torch.testing.assert_close(m(x[j:j + 1]), expected[j:j + 1], rtol=1e-5, atol=1e-5)


def test_meter_counts_kept_inputs_and_the_side_path():
    W, b, m = _layer(rank=4, threshold=0.6)
    x = _inputs(n=50)
    m.meter_on = True
    with torch.no_grad():
        m(x)
    m.meter_on = False
    kept = float((x.abs() >= 0.6).sum()) / 50
    assert m.measured_macs() == pytest.approx(24 * kept + 4 * (16 + 24))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_float32(dtype):
    W, b, m = _layer(rank=4, threshold=0.6)
    x = _inputs()
    with torch.no_grad():
        ref = m(x)
        half = m.to(dtype)
        assert half.threshold.dtype == torch.float32
        out = half(x.to(dtype))
    assert out.dtype == dtype
    assert float((out.float() - ref).norm() / ref.norm()) < 2e-2


def test_choice_meets_the_budget_and_never_errs_more_than_plain_sparsity():
    g = torch.Generator().manual_seed(2)
    W = torch.randn(48, 32, generator=g) @ torch.diag(torch.linspace(3, 0.1, 32))
    x_fit, x_eval = torch.randn(400, 32, generator=g), torch.randn(200, 32, generator=g)
    budget = 0.5 * W.numel()
    c = sparse_lowrank_choice(x_fit, x_eval, W, budget)
    assert c.macs == pytest.approx(budget, rel=0.02)
    assert c.rank == 0 or c.rank * (32 + 48) <= 0.5 * budget
    plain = sparse_lowrank_choice(x_fit, x_eval, W, budget, shares=(0.0,))
    assert plain.rank == 0 and plain.threshold == threshold_for_keep_fraction(x_fit.abs(), 0.5)
    assert c.error <= plain.error
    assert sparse_lowrank_choice(x_fit, x_eval, W, W.numel()).dense
    assert side_rank(budget, 0.5, 32, 48) == int(0.5 * budget // 80)


def test_low_rank_weights_make_the_side_path_worth_it():
    """A weight of rank 4 is captured exactly by a rank-4 side path: the search must take it."""
    g = torch.Generator().manual_seed(3)
    W = torch.randn(64, 4, generator=g) @ torch.randn(4, 64, generator=g)
    x_fit, x_eval = torch.randn(400, 64, generator=g), torch.randn(200, 64, generator=g)
    c = sparse_lowrank_choice(x_fit, x_eval, W, 0.4 * W.numel())
    assert c.rank >= 4 and c.error < 1e-6


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rsparse_hits_its_budget_on_held_out_tokens(arch):
    model = tiny_model(arch)
    with torch.no_grad():  # random weights are full-rank; make one projection low-rank so a side path pays
        up = model.model.layers[0].mlp.up_proj.weight
        up.copy_(torch.linalg.svd(up, full_matrices=False).U[:, :2] @ torch.randn(2, up.shape[1]))
    result = compress_model(model, None, tiny_compress_config(method="rsparse", flops=0.6), tiny_calibration())
    kinds = {type(m) for m in result.model.modules()}
    assert SparseLowRankLinear in kinds or InputSparseLinear in kinds
    held_out = torch.randint(0, 128, (32, 32), generator=torch.Generator().manual_seed(9))
    with metering(result.model), torch.no_grad():
        result.model(held_out)
    assert measured_macs(result.model, seq_len=32)["fraction"] == pytest.approx(0.6, abs=0.01)
    ranks = [c.get("rank", 0) for layer in result.plan["layers"] for step in ("attention", "mlp")
             for c in layer[step]["components"].values()]
    assert any(r > 0 for r in ranks), "no projection took a side path on this model"


def test_rana_side_installs_side_paths_where_they_pay_and_meets_the_budget():
    """rana-side = rana + R-Sparse's side path as a candidate: on a model whose up/down projections are
    low-rank the searches must take it (also down's, chosen after the split), on budget."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            for w in (layer.mlp.up_proj.weight, layer.mlp.down_proj.weight, layer.self_attn.q_proj.weight):
                w.copy_(torch.linalg.svd(w, full_matrices=False).U[:, :2] @ torch.randn(2, w.shape[1]))
    result = compress_model(model, None, tiny_compress_config(method="rana-side", flops=0.6), tiny_calibration())
    assert result.plan["measured_flops"] == pytest.approx(0.6, abs=0.01)
    kinds = {name: c["kind"] for layer in result.plan["layers"] for step in ("attention", "mlp")
             for name, c in layer[step]["components"].items()}
    assert any(isinstance(m, SparseLowRankLinear) for m in result.model.modules())
    assert "sparse_lowrank" in {kinds.get("up"), kinds.get("down"), kinds.get("q")}


def test_side_candidates_need_magnitude_sparsity():
    from rana.methods import Candidates

    with pytest.raises(ValueError, match="side path"):
        Candidates(rank=True, sparse=False, side=True)
    with pytest.raises(ValueError, match="side path"):
        Candidates(rank=False, sparse=True, score="contribution", side=True)
