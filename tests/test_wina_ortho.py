"""wina-ortho: the column-orthogonalising rotations are exact (every architecture), make k's, the
gate's and (per KV group) o's columns orthogonal, are metered and budgeted at d² MACs per token per
block input, and survive half precision, save/load and export."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch

import rana.io as rio
from helpers import exported_logits, perturbed_tiny_model, tiny_calibration, tiny_compress_config, tiny_model
from rana.accounting import dense_macs, measured_macs, metering
from rana.archs import UnsupportedArchitectureError, decoder_layers, get_arch
from rana.compress import compress_model
from rana.methods import get_method
from rana.methods.wina_ortho import column_orthogonalising_rotation, head_rotations, rotate_model, rotation_macs
from rana.modules import NeuronThresholdLinear, RotatedInput

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))
D, LAYERS = 64, 2  # tests/helpers.py TINY


def _logits(model, dtype=torch.float32):
    with torch.no_grad():
        return model(IDS).logits.to(dtype)


def _off_diagonal(W: torch.Tensor) -> float:
    """Largest |off-diagonal| of WᵀW relative to its largest entry."""
    W = W.detach().double()
    G = W.T @ W
    return float((G - torch.diag(torch.diag(G))).abs().max() / G.abs().max())


CASES = [("llama", dict(tie_word_embeddings=True)),  # GQA: 4 query heads on 2 KV heads
         ("qwen2", {}),  # q/k/v biases
         ("phi3", {}),  # fused qkv / gate_up
         ("gemma", {}),  # `1 + w` norm scales, head_dim ≠ hidden / heads
         ("gemma2", {}),  # post-norms: nothing is folded through a norm, so they are no obstacle
         ("gpt_neox", {}),  # LayerNorm, parallel residual, fused interleaved qkv, non-gated MLP
         ("qwen3", {}),  # q/k norms after the projections
         ("granite", {})]  # residual / attention multipliers


@pytest.mark.parametrize("arch,kw", CASES, ids=[c[0] for c in CASES])
def test_rotation_leaves_the_dense_function_unchanged(arch, kw):
    model = perturbed_tiny_model(arch, **kw)
    dense = _logits(model)
    done = rotate_model(model, get_arch(model.config))
    assert torch.allclose(_logits(model), dense, atol=2e-5 * dense.abs().max())
    rotations = [m for m in model.modules() if isinstance(m, RotatedInput)]
    assert len(rotations) == 2 * LAYERS and all(tuple(m.rotation.shape) == (D, D) for m in rotations)
    assert done["runtime_rotation_macs_per_token"] == 2 * LAYERS * D * D == rotation_macs(model.config)
    assert ("none" in done["head_rotations"]) == (arch == "gpt_neox")
    # the readers really moved
    spec = get_arch(model.config)
    first = next(iter(spec.qkv_paths().values()))
    before = decoder_layers(perturbed_tiny_model(arch, **kw), spec)[0].get_submodule(first).weight
    assert not torch.allclose(decoder_layers(model, spec)[0].get_submodule(first).weight, before, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "phi3", "gpt_neox"])
def test_k_and_gate_columns_are_orthogonal_after_the_rotation(arch):
    model = perturbed_tiny_model(arch)
    spec = get_arch(model.config)
    rotate_model(model, spec)
    layer = decoder_layers(model, spec)[1]
    text = model.config
    hd = D // text.num_attention_heads
    n_kv = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    if arch == "llama":
        k, gate = layer.self_attn.k_proj.weight, layer.mlp.gate_proj.weight
    elif arch == "phi3":
        k = layer.self_attn.qkv_proj.weight[4 * hd:(4 + n_kv) * hd]
        gate = layer.mlp.gate_up_proj.weight[:160]
    else:  # rows per head [q, k, v]; the non-gated MLP's up reads the MLP input
        k = layer.attention.query_key_value.weight.reshape(4, 3, hd, D)[:, 1].reshape(4 * hd, D)
        gate = layer.mlp.dense_h_to_4h.weight
    for W in (k, gate):
        assert _off_diagonal(W) < 1e-5
        norms = W.double().norm(dim=0)
        assert (norms[:-1] >= norms[1:] - 1e-5).all()  # largest first
    if k.shape[0] < D:  # GQA: past k's rank the columns are zero (those inputs cost k nothing)
        assert float(k.detach().double().norm(dim=0)[k.shape[0]:].max()) < 1e-5
    assert _off_diagonal(perturbed_tiny_model(arch).get_submodule(spec.layers)[1].get_submodule(spec.role_path("mlp_in")).weight) > 1e-2


def test_o_columns_are_orthogonal_within_each_head():
    """Every query head its own KV head (Mistral config, 4 KV heads): o's column block of each head
    is orthogonal after the fold; under GQA the group's heads stacked are."""
    for kw, per_group in ((dict(num_key_value_heads=4), 1), ({}, 2)):
        model = perturbed_tiny_model("mistral", **kw)
        rotate_model(model, get_arch(model.config))
        Wo = model.model.layers[0].self_attn.o_proj.weight.detach()
        cols = Wo.reshape(D, 4 // per_group, per_group, 16)
        for g in range(cols.shape[1]):
            stacked = cols[:, g].permute(1, 0, 2).reshape(per_group * D, 16)
            assert _off_diagonal(stacked) < 1e-5
    R = head_rotations(torch.randn(8, 12), n_heads=4, n_kv=2)
    assert R.shape == (2, 3, 3)
    assert torch.allclose(R.transpose(1, 2) @ R, torch.eye(3, dtype=torch.float64).expand(2, 3, 3), atol=1e-12)
    V = column_orthogonalising_rotation(torch.randn(5, 7))
    assert torch.allclose(V.T @ V, torch.eye(7, dtype=torch.float64), atol=1e-12)


@pytest.mark.parametrize("arch", ["llama", "phi3"])
def test_thresholds_that_keep_everything_reproduce_the_dense_logits(arch):
    model = perturbed_tiny_model(arch)
    dense = _logits(model)
    result = compress_model(model, None, tiny_compress_config(method="wina-ortho", flops=0.7), tiny_calibration())
    adapters = [m for m in result.model.modules() if isinstance(m, NeuronThresholdLinear)]
    assert len(adapters) == len(get_arch(model.config).qkv_paths()) * 2 + (3 if arch == "llama" else 2) * 2 + 2
    assert not torch.allclose(_logits(result.model), dense, atol=1e-3)
    with torch.no_grad():
        for m in adapters:
            m.threshold.fill_(-math.inf)
    assert torch.allclose(_logits(result.model), dense, atol=2e-5 * dense.abs().max())


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_budget_is_met_on_held_out_tokens_rotations_included(arch):
    result = compress_model(perturbed_tiny_model(arch), None, tiny_compress_config(method="wina-ortho", flops=0.7),
                            tiny_calibration())
    plan = result.plan
    assert plan["measured_flops"] == pytest.approx(0.7, abs=0.01)
    assert plan["budget"]["method_runtime_macs"] == 2 * LAYERS * D * D
    # the adapted projections keep less than plain wina's would: the rotations are paid from their budget
    wina = compress_model(perturbed_tiny_model(arch), None, tiny_compress_config(method="wina", flops=0.7), tiny_calibration())
    adapted = plan["budget"]["adapted_dense_macs"]
    assert plan["adapted_fraction"] == pytest.approx(wina.plan["adapted_fraction"] - 2 * LAYERS * D * D / adapted)


def test_the_meter_counts_the_rotations():
    """Measured MACs = what the adapted projections kept + d² per rotated block input + the parts
    nobody adapts (attention products, LM head), on tokens the thresholds never saw."""
    result = compress_model(perturbed_tiny_model("llama"), None, tiny_compress_config(method="wina-ortho", flops=0.7),
                            tiny_calibration())
    model = result.model
    with metering(model) as meters, torch.no_grad():
        model(tiny_calibration().heldout)
    seq_len = tiny_compress_config().seq_len
    m = measured_macs(model, seq_len)
    rotations = {n: x for n, x in meters.items() if isinstance(x, RotatedInput)}
    adapters = {n: x for n, x in meters.items() if not isinstance(x, RotatedInput)}
    assert len(rotations) == 2 * LAYERS and len(adapters) == 7 * LAYERS
    assert all(m["modules"][n]["measured_macs"] == D * D and m["modules"][n]["dense_macs"] == 0 for n in rotations)
    dense = dense_macs(model.config, seq_len)
    kept = sum(x.measured_macs() for x in adapters.values())
    assert m["measured_macs"] == pytest.approx(kept + 2 * LAYERS * D * D + dense["attn_products"] + dense["lm_head"],
                                               rel=1e-9)
    attention = sum(x.measured_macs() for n, x in adapters.items() if ".self_attn." in n)
    assert m["by_part"]["attention"]["measured_macs"] == pytest.approx(attention + LAYERS * D * D + dense["attn_products"],
                                                                       rel=1e-9)
    assert m["by_part"]["other"]["measured_macs"] == dense["lm_head"]  # nothing of the rotations lands on the head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_rotation_and_compression(dtype):
    model = perturbed_tiny_model("llama", tie_word_embeddings=True)
    dense = _logits(model)
    rotated = perturbed_tiny_model("llama", tie_word_embeddings=True).to(dtype)
    rotate_model(rotated, get_arch(rotated.config))
    assert all(m.rotation.dtype == dtype for m in rotated.modules() if isinstance(m, RotatedInput))
    assert float((_logits(rotated) - dense).norm() / dense.norm()) < 0.05
    # A half-precision compression is the float32 compression of the same (rounded) weights up to
    # rounding: measured 0.29-0.38 (bf16), 0.11-0.18 (fp16) of what the compression changes, as wina
    # (0.23-0.25, 0.06-0.09). Against the float32 compression of the unrounded weights it is 0.7
    # (bf16): the SVD bases of random weights' near-equal singular values turn with the rounding.
    name = str(dtype).removeprefix("torch.")
    result = compress_model(perturbed_tiny_model("llama").to(dtype), None,
                            tiny_compress_config(method="wina-ortho", flops=0.7, dtype=name), tiny_calibration())
    assert result.plan["measured_flops"] == pytest.approx(0.7, abs=0.015)
    assert next(result.model.parameters()).dtype == dtype
    rounded = perturbed_tiny_model("llama").to(dtype).float()
    dense = _logits(rounded)
    ref = _logits(compress_model(rounded, None, tiny_compress_config(method="wina-ortho", flops=0.7),
                                 tiny_calibration()).model)
    out = _logits(result.model)
    assert torch.isfinite(out).all()
    assert float((out - ref).norm()) < 0.5 * float((ref - dense).norm())


def test_save_load_and_export_reproduce_the_logits(tmp_path):
    from rana.export import export

    model = perturbed_tiny_model("qwen2", tie_word_embeddings=True)
    result = compress_model(model, None, tiny_compress_config(method="wina-ortho", flops=0.7), tiny_calibration())
    ref = _logits(result.model)
    rio.save(result.model, None, tmp_path / "r", plan=result.plan)
    meta = json.loads((tmp_path / "r" / rio.RANA_CONFIG).read_text())
    rot = [a for a in meta["adapters"] if a["type"] == "rotated_input"]
    assert len(rot) == 2 * LAYERS and {a["block"] for a in rot} == {"attention", "mlp"}
    loaded, _ = rio.load(tmp_path / "r")
    assert sum(isinstance(m, RotatedInput) for m in loaded.modules()) == 2 * LAYERS
    assert torch.equal(_logits(loaded), ref)
    export(tmp_path / "r", tmp_path / "e")
    exported = exported_logits(tmp_path / "e", IDS, tmp_path,
                               "assert sum(type(x).__name__ == 'RotatedInput' for x in m.modules()) == 4")
    assert torch.allclose(exported, ref, atol=1e-5 * ref.abs().max())


def test_refusals_are_one_line():
    model = tiny_model("llama")
    spec = get_arch(model.config)
    with pytest.raises(UnsupportedArchitectureError, match="stream") as err:
        get_method("wina-ortho").prepare(model, spec, tiny_calibration().fit, batch_size=4, streamed=True)
    assert "\n" not in str(err.value)
    rotate_model(model, spec)
    with pytest.raises(ValueError, match="already rotated"):
        rotate_model(model, spec)
    # something else reading a block's normalised input (here a hook adding its reversed copy to the
    # attention output) is caught by the before/after check
    model = tiny_model("llama")

    def leak(_mod, args, kwargs, out):
        x = kwargs.get("hidden_states", args[0] if args else None)
        return (out[0] + 0.5 * x.flip(-1), *out[1:])

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(leak, with_kwargs=True)
    with pytest.raises(UnsupportedArchitectureError, match="wina-ortho.*changed") as err:
        get_method("wina-ortho").prepare(model, spec, tiny_calibration().fit, batch_size=4, streamed=False)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch,interleaved", [("llama", True), ("gpt_neox", False)])
def test_head_rotations_follow_the_spec_flag_not_the_model_type(arch, interleaved):
    """o's input is rotated per KV head unless the spec says the fused qkv interleaves v's rows
    (`qkv_interleaved`): a Llama spec saying so leaves o alone, a GPT-NeoX spec saying not rotates it."""
    model = perturbed_tiny_model(arch)
    spec = replace(get_arch(model.config), qkv_interleaved=interleaved)
    o = decoder_layers(model, spec)[0].get_submodule(spec.o_path()).weight
    before = o.detach().clone()
    done = rotate_model(model, spec)
    assert done["head_rotations"].startswith("none") == interleaved
    # o writes the residual stream, which wina-ortho leaves unrotated: only the head rotations move it
    assert torch.equal(decoder_layers(model, spec)[0].get_submodule(spec.o_path()).weight, before) == interleaved
