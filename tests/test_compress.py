"""End-to-end compression on tiny random Llama / Mistral / Qwen2 models."""
import math

import pytest
import torch

from rana.accounting import measured_macs, metering
from rana.archs import UnsupportedArchitectureError, get_arch
from rana.compress import BudgetError, compress_model
from rana.math.decompose import decompose
from rana.modules import NeuronThresholdLinear, RankAdapterLinear
from helpers import tiny_calibration, tiny_compress_config, tiny_model


CASES = ([("llama", m) for m in ("rana", "rana-paper", "svd", "teal", "cats", "rana-contrib", "rana-mixed", "wina", "rsparse", "rana-side")]
         + [("mistral", "rana"), ("qwen2", "rana"), ("qwen2", "rsparse"), ("phi3", "wina-ortho")])


@pytest.mark.parametrize("arch,method", CASES)
def test_compress_end_to_end_hits_budget(arch, method):
    model = tiny_model(arch)
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        dense_logits = model(ids).logits
    result = compress_model(model, None, tiny_compress_config(method=method, flops=0.75), tiny_calibration())
    plan = result.plan
    assert plan["measured_flops"] == pytest.approx(0.75, abs=0.01)
    with torch.no_grad():
        logits = result.model(ids).logits
    assert torch.isfinite(logits).all()
    assert not torch.allclose(logits, dense_logits)  # something was compressed
    # the new adapters share the model's mode (eval): a decode token takes the masked-GEMV kernels
    assert not any(m.training for m in result.model.modules())
    for layer in plan["layers"]:
        for step in ("attention", "mlp"):
            if step in layer:
                assert 0 <= layer[step]["heldout_error"] < 1.5


def test_qwen2_biases_are_carried_into_the_stacked_adapter():
    model = tiny_model("qwen2")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    biases = [p.bias.detach().clone() for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
    result = compress_model(model, None, tiny_compress_config(flops=0.8, method="rana-paper"), tiny_calibration())
    attn = result.model.model.layers[0].self_attn
    assert torch.equal(torch.cat([attn.q_proj.A.bias, attn.k_proj.A.bias, attn.v_proj.A.bias]),
                       torch.cat([b for b in biases]))


def _full_rank_swap(model):
    """Replace every up/gate by a full-rank, unmasked rank adapter and every down by a
    neuron-thresholded linear with threshold -inf: must reproduce the dense model."""
    spec = get_arch(model.config)
    for layer in model.model.layers:
        mlp = layer.mlp
        C = torch.eye(mlp.up_proj.in_features, dtype=torch.float64)
        for name in ("up_proj", "gate_proj"):
            lin = getattr(mlp, name)
            A, B = decompose(lin.weight, C).factors(lin.weight, lin.in_features)
            setattr(mlp, name, RankAdapterLinear(A.float(), B.float(), lin.bias, -math.inf))
        mlp.down_proj = NeuronThresholdLinear(mlp.down_proj.weight.detach(), mlp.down_proj.bias, -math.inf)
    return spec


def test_full_rank_adapters_reproduce_dense_logits():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        dense = model(ids).logits
        _full_rank_swap(model)
        adapted = model(ids).logits
    assert torch.allclose(adapted, dense, atol=1e-4, rtol=1e-4)


def test_flops_one_keeps_model_dense():
    model = tiny_model("llama")
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        dense = model(ids).logits
    result = compress_model(model, None, tiny_compress_config(flops=1.0), tiny_calibration())
    with torch.no_grad():
        assert torch.allclose(result.model(ids).logits, dense, atol=1e-5)
    assert result.plan["measured_flops"] == pytest.approx(1.0, abs=1e-6)


def test_measured_flops_drop_as_budget_tightens():
    fractions = []
    for f in (0.9, 0.7, 0.5):
        r = compress_model(tiny_model("llama"), None, tiny_compress_config(flops=f), tiny_calibration())
        fractions.append(r.plan["measured_flops"])
    assert fractions[0] > fractions[1] > fractions[2]


def test_measured_flops_are_measured_not_copied():
    model = tiny_model("llama")
    result = compress_model(model, None, tiny_compress_config(flops=0.7), tiny_calibration())
    # all-zero inputs make every code tiny → far fewer ranks pass the masks than on real data
    with metering(result.model):
        result.model(inputs_embeds=torch.zeros(1, 16, 64))
    assert measured_macs(result.model)["fraction"] < result.plan["measured_flops"] - 0.02


def test_budget_below_unadapted_cost_is_a_clear_error():
    with pytest.raises(BudgetError, match=r"use --flops ≥ 0\.\d+"):
        compress_model(tiny_model("llama"), None, tiny_compress_config(flops=0.05), tiny_calibration())
    with pytest.raises(BudgetError):
        compress_model(tiny_model("llama"), None, tiny_compress_config(flops=0.4, method="cats"), tiny_calibration())


def test_bad_flops_and_unknown_arch():
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        tiny_compress_config(flops=1.5).validate()
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        tiny_compress_config(flops=0).validate()
    with pytest.raises(UnsupportedArchitectureError, match="supported: .*llama"):
        get_arch("bert")


def test_nan_activations_are_reported():
    from rana.compress.calibrate import CalibrationError

    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.fill_(float("nan"))
    with pytest.raises(CalibrationError, match="non-finite"):
        compress_model(model, None, tiny_compress_config(), tiny_calibration())


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt_neox"])
def test_sparse_family_ablations(arch):
    """rana / rana-contrib / wina never build rank adapters; wina keeps every projection at
    the same fraction of its own cost (the equal split, also for a fused gate_up worth 2/3 of the MLP)."""
    for method in ("rana", "rana-contrib", "wina"):
        result = compress_model(tiny_model(arch), None, tiny_compress_config(method=method, flops=0.7),
                                tiny_calibration())
        assert result.plan["measured_flops"] == pytest.approx(0.7, abs=0.01)
        assert not any(isinstance(m, RankAdapterLinear) for m in result.model.modules())
        for layer in result.plan["layers"]:
            comps = layer["mlp"]["components"]
            assert {c["kind"] for c in layer["attention"]["components"].values()} <= {"sparse", "input_sparse", "dense"}
            if method == "wina":
                dense = [c["dense_macs"] for c in comps.values()]
                assert layer["mlp"]["shares"] == pytest.approx([d / sum(dense) for d in dense])
                fractions = [c["expected_macs"] / c["dense_macs"] for c in comps.values()]
                assert max(fractions) - min(fractions) < 0.02


def test_default_scores_inputs_by_magnitude():
    """rana: the |x_j| score (InputSparseLinear) on every projection, the split still searched."""
    from rana.modules import InputSparseLinear

    result = compress_model(tiny_model("llama"), None, tiny_compress_config(method="rana", flops=0.7),
                            tiny_calibration())
    assert result.plan["measured_flops"] == pytest.approx(0.7, abs=0.01)
    layer = result.model.model.layers[0]
    for m in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.up_proj, layer.mlp.down_proj):
        assert isinstance(m, InputSparseLinear)
    assert not any(isinstance(m, NeuronThresholdLinear) for m in result.model.modules())
