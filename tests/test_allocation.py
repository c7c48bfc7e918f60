"""Model-level allocation (`--allocation global`) on tiny models."""
import pytest
import torch

from rana.accounting import dense_macs_per_layer
from rana.compress import compress_model
from helpers import tiny_calibration, tiny_compress_config, tiny_model


def _spent(plan, model_config, seq_len=512):
    dense = dense_macs_per_layer(model_config, seq_len)
    parts = {"attention": ("q", "k", "v", "o"), "mlp": ("up", "gate", "down")}
    total = spent = 0.0
    for idx, d in enumerate(dense):
        for step, names in parts.items():
            cost = sum(d[n] for n in names)
            f = plan["allocation"]["fractions"][idx].get(step, 1.0)
            total += cost
            spent += f * cost
    return spent / total


def test_global_allocation_hits_model_budget():
    model = tiny_model("llama", num_hidden_layers=3)
    result = compress_model(model, None, tiny_compress_config(flops=0.65, allocation="global"), tiny_calibration())
    plan = result.plan
    u = plan["allocation"]["uniform_fraction"]
    assert _spent(plan, model.config) == pytest.approx(u, rel=0.01)
    assert plan["measured_flops"] == pytest.approx(0.65, abs=0.015)
    for layer in plan["allocation"]["fractions"]:
        assert all(0 < f <= 1.0 for f in layer.values())  # never more than a block's dense cost


def test_fragile_layer_gets_more_budget():
    model = tiny_model("llama", num_hidden_layers=3)
    with torch.no_grad():  # layer 1's MLP now dominates the residual stream it writes to
        model.model.layers[1].mlp.down_proj.weight.mul_(8.0)
    result = compress_model(model, None, tiny_compress_config(flops=0.65, allocation="global"), tiny_calibration())
    fr = result.plan["allocation"]["fractions"]
    assert fr[1]["mlp"] > fr[0]["mlp"] and fr[1]["mlp"] > fr[2]["mlp"]
