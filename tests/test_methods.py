"""The method catalogue: what it lists, what methods declare, and that a method registered from
outside (here, a tiny one defined in this file) is usable by compress_model like a built-in one."""
import pytest
import torch

from rana.archs import get_arch
from rana.compress import compress_model
from rana.methods import METHODS
from rana.math.masks import subsample_rows, threshold_for_keep_fraction
from rana.methods import (Candidates, MemoryNeed, Method, Step, get_method, install_choice, names, register, sparse_choice,
                          summary, unregister, unsupported_reason)
from rana.modules import InputSparseLinear
from rana.compress.memory import estimate_memory
from helpers import tiny_calibration, tiny_compress_config, tiny_model

BUILT_IN = ("rana", "rana-paper", "wina", "cats", "svd", "teal", "rsparse", "larosa", "wina-ortho", "rana-dense-head",
            "rana-contrib", "rana-mixed", "rana-side", "larosa-heads", "rana-heads")
MAIN = 9  # BUILT_IN[:MAIN] are the main methods, the rest ablations


def test_names_list_the_main_methods_then_the_ablations():
    assert names() == BUILT_IN
    assert names(ablations=False) == BUILT_IN[:MAIN] and names(ablations=True) == BUILT_IN[MAIN:]
    assert tuple(METHODS) == BUILT_IN and "svd" in METHODS and "dense" not in METHODS
    for name in BUILT_IN:
        method = get_method(name)
        assert method.name == name and method.description and method.steps and method.style.get("marker")
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        get_method("nope")
    with pytest.raises(ValueError, match="unknown method 'rana-wina' \\(renamed 'wina'\\)"):
        get_method("rana-wina")
    assert "fuses gate and up" in unsupported_reason("cats", get_arch(tiny_model("phi3").config))
    assert "non-gated MLP" in unsupported_reason("cats", get_arch(tiny_model("gpt_neox").config))
    assert all(unsupported_reason(n, get_arch(tiny_model("llama").config)) is None for n in BUILT_IN)


def test_methods_declare_their_memory_needs():
    assert {n: get_method(n).memory for n in BUILT_IN} == {
        **{n: MemoryNeed(grid_search=True) for n in ("rana", "rana-paper", "rana-dense-head", "rana-contrib", "rana-mixed", "wina",
                                                      "rana-side", "rana-heads", "wina-ortho")},
        "svd": MemoryNeed(stacked_gate_up=False, decomposes_down=True, wide_sample_rows=True),
        "teal": MemoryNeed(decomposes=False, wide_sample_rows=True),
        "larosa": MemoryNeed(decomposes=False, wide_sample_rows=True),
        "larosa-heads": MemoryNeed(decomposes=False, wide_sample_rows=True),
        "cats": MemoryNeed(decomposes=False),
        "rsparse": MemoryNeed(stacked_gate_up=False, decomposes_down=True, wide_sample_rows=True),  # an SVD per weight
    }


def test_rana_variants_are_their_candidates():
    """The search space decides the steps: o_proj (square) only with input sparsity, second
    moments only for rank adapters."""
    for name, adapts_o, moments in (("rana", True, False), ("rana-contrib", True, False), ("wina", True, False),
                                    ("wina-ortho", True, False),
                                    ("rana-mixed", True, True), ("rana-paper", False, True)):
        method = get_method(name)
        assert ("o" in method.adapted_parts) == adapts_o
        assert [s.targets for s in method.steps] == [("qkv_in",)] + [("o",)] * adapts_o + [("mlp_in",)]
        assert all(bool(s.moments) == moments for s in method.steps if s.targets != ("o",))
    with pytest.raises(ValueError, match="rank adapters, input sparsity or both"):
        Candidates(rank=False, sparse=False)
    with pytest.raises(ValueError, match="score"):
        Candidates(rank=False, sparse=True, score="wanda")
    with pytest.raises(ValueError, match="split"):
        Candidates(rank=True, sparse=False, split="random")


def _mlp_magnitude(ctx, stats):
    """Keep each MLP projection's largest inputs |x_j| at the layer's fraction (a tiny TEAL)."""
    entries = {}
    for name, path in ctx.spec.mlp_paths().items():
        x = subsample_rows(stats["down" if name == "down" else "mlp_in"].fit, ctx.fit_sample_tokens)
        lin = ctx.module(path)
        o, i = lin.weight.shape
        t = threshold_for_keep_fraction(x.abs(), ctx.fraction)
        entries[name] = install_choice(ctx, path, lin, sparse_choice(t, ctx.fraction * i, o * ctx.fraction * i),
                                       score="magnitude")
    return summary(entries)


def test_a_registered_method_is_usable_by_compress_model():
    method = Method("mlp-magnitude", ("up", "gate", "down"), (Step(("mlp_in", "down"), "down", (), _mlp_magnitude, "mlp"),),
                    description="test: magnitude sparsity of the MLP's inputs", memory=MemoryNeed(decomposes=False))
    register(method)
    try:
        assert names(ablations=False)[-1] == "mlp-magnitude" and "mlp-magnitude" in METHODS
        config = tiny_compress_config(method="mlp-magnitude", flops=0.8)
        config.validate()
        model = tiny_model("llama")
        assert unsupported_reason("mlp-magnitude", get_arch(model.config)) is None
        assert estimate_memory(model.config, config).parts["second moments"] == 0.0  # decomposes=False
        result = compress_model(model, None, config, tiny_calibration())
        plan = result.plan
        assert plan["method"] == "mlp-magnitude" and plan["method_description"] == method.description
        assert plan["measured_flops"] == pytest.approx(0.8, abs=0.02)
        for idx, layer in enumerate(result.model.model.layers):
            assert set(plan["layers"][idx]["mlp"]["components"]) == {"up", "gate", "down"}
            assert "attention" not in plan["layers"][idx]
            for proj in (layer.mlp.up_proj, layer.mlp.gate_proj, layer.mlp.down_proj):
                assert isinstance(proj, InputSparseLinear)
            assert type(layer.self_attn.q_proj) is torch.nn.Linear
    finally:
        unregister("mlp-magnitude")
    assert names() == BUILT_IN and "mlp-magnitude" not in METHODS
    with pytest.raises(ValueError, match="unknown method 'mlp-magnitude'"):
        tiny_compress_config(method="mlp-magnitude").validate()
