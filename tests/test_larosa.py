"""larosa: PCA rotations folded into the weights (exact at F = 1), thresholds on the rotated inputs
at the budget, save/load/export with the untied head, refusals where invariance fails."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import rana.io as rio
from helpers import exported_logits, perturbed_tiny_model, tiny_calibration, tiny_compress_config, tiny_model
from rana.archs import UnsupportedArchitectureError, decoder_layers, get_arch
from rana.compress import compress_model
from rana.methods import get_method
from rana.methods.larosa import head_block_moments, principal_basis, rotate_model, rotation_statistics
from rana.modules import InputSparseLinear

pytestmark = pytest.mark.usefixtures("one_thread")

IDS = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(3))


def _logits(model, dtype=torch.float32):
    with torch.no_grad():
        return model(IDS).logits.to(dtype)


CASES = [("llama", dict(tie_word_embeddings=True)),  # GQA: 4 query heads on 2 KV heads
         ("qwen2", {}),  # q/k/v biases
         ("mistral", dict(num_key_value_heads=4)),  # no GQA
         ("gemma", {}),  # `1 + w` norm scales, tied embeddings
         ("phi3", {}),  # fused qkv / gate_up
         ("qwen3", {}),  # q/k norms after the projections, head_dim ≠ hidden / heads
         ("granite", {})]  # embedding / residual / logits multipliers: scalars commute with the rotation


@pytest.mark.parametrize("arch,kw", CASES, ids=[c[0] for c in CASES])
def test_rotation_leaves_the_dense_function_unchanged(arch, kw):
    model = perturbed_tiny_model(arch, **kw)
    dense = _logits(model)
    result = compress_model(model, None, tiny_compress_config(method="larosa", flops=1.0), tiny_calibration())
    transform = result.plan["model_transform"]
    assert transform["runtime_rotation_macs_per_token"] == 0
    assert torch.allclose(_logits(result.model), dense, atol=2e-5 * dense.abs().max())
    assert result.plan["measured_flops"] == pytest.approx(1.0, abs=1e-9)
    # the weights really moved: the embedding is rotated, every norm scales by one (Gemma: w = 0)
    emb = tiny_model(arch, **kw).get_input_embeddings().weight
    assert not torch.allclose(result.model.get_input_embeddings().weight, emb, atol=1e-3)
    spec = get_arch(model.config)
    norm = decoder_layers(result.model, spec)[0].get_submodule(spec.attn_norm)
    assert torch.allclose(norm(torch.ones(1, norm.weight.shape[0])), torch.ones(1, norm.weight.shape[0]), atol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_thresholds_that_keep_everything_reproduce_the_dense_logits(arch):
    model = perturbed_tiny_model(arch)
    dense = _logits(model)
    result = compress_model(model, None, tiny_compress_config(method="larosa", flops=0.7), tiny_calibration())
    sparse = [m for m in result.model.modules() if isinstance(m, InputSparseLinear)]
    assert len(sparse) == 7 * 2  # q, k, v, o, up, gate, down in both layers
    assert not torch.allclose(_logits(result.model), dense, atol=1e-3)
    with torch.no_grad():
        for m in sparse:
            m.threshold.fill_(-math.inf)
    assert torch.allclose(_logits(result.model), dense, atol=2e-5 * dense.abs().max())


def test_bfloat16_rotation_is_close():
    model = perturbed_tiny_model("llama", tie_word_embeddings=True)
    dense = _logits(model)
    model = model.to(torch.bfloat16)
    result = compress_model(model, None, tiny_compress_config(method="larosa", flops=1.0, dtype="bfloat16"),
                            tiny_calibration())
    assert next(result.model.parameters()).dtype == torch.bfloat16
    out = _logits(result.model)
    assert float((out - dense).norm() / dense.norm()) < 0.05


@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])
def test_budget_is_met_on_held_out_tokens(arch):
    result = compress_model(perturbed_tiny_model(arch), None, tiny_compress_config(method="larosa", flops=0.7),
                            tiny_calibration())
    assert result.plan["measured_flops"] == pytest.approx(0.7, abs=0.01)  # one point of the dense FLOPs, as for every method


def test_rotated_inputs_are_decorrelated():
    """After the fold, the residual readers' inputs and each KV group's o inputs are (on the fit
    tokens the PCA saw) uncorrelated, with variances in decreasing order: the PCA bases were applied."""
    model = perturbed_tiny_model("llama")
    spec = get_arch(model.config)
    fit = tiny_calibration().fit
    rotate_model(model, spec, rotation_statistics(model, spec, fit, batch_size=8))
    stats = rotation_statistics(model, spec, fit, batch_size=8)
    for C in [stats["residual"], *[m for heads in stats["heads"] for m in heads]]:
        off = C - torch.diag(torch.diag(C))
        assert off.abs().max() < 1e-4 * C.diag().max()
        assert (C.diag()[:-1] >= C.diag()[1:] - 1e-4 * C.diag().max()).all()


def test_head_block_moments_pool_the_query_heads_of_a_kv_group():
    x = torch.randn(5, 4 * 3)  # 4 query heads of head_dim 3, 2 KV heads
    m = head_block_moments(x, n_heads=4, n_kv=2)
    a = x.double().reshape(5, 4, 3)
    assert torch.allclose(m[0], a[:, 0].T @ a[:, 0] + a[:, 1].T @ a[:, 1], rtol=1e-5, atol=1e-5)
    assert torch.allclose(m[1], a[:, 2].T @ a[:, 2] + a[:, 3].T @ a[:, 3], rtol=1e-5, atol=1e-5)
    Q = principal_basis(m[0])
    assert torch.allclose(Q.T @ Q, torch.eye(3, dtype=torch.float64), atol=1e-12)


def test_save_load_and_export_reproduce_the_logits(tmp_path):
    from rana.export import export

    model = perturbed_tiny_model("llama", tie_word_embeddings=True)
    result = compress_model(model, None, tiny_compress_config(method="larosa", flops=0.7), tiny_calibration())
    ref = _logits(result.model)
    assert result.plan["model_transform"]["lm_head_untied"]
    assert result.plan["model_transform"]["extra_stored_parameters"] == 128 * 64
    result.model.tie_weights()  # nothing ties the head back in this process either
    assert torch.equal(_logits(result.model), ref)
    assert "lm_head.weight" not in getattr(result.model, "all_tied_weights_keys", {})
    rio.save(result.model, None, tmp_path / "r", plan=result.plan)
    loaded, _ = rio.load(tmp_path / "r")
    assert not loaded.config.tie_word_embeddings
    assert loaded.lm_head.weight.data_ptr() != loaded.get_input_embeddings().weight.data_ptr()
    assert torch.equal(_logits(loaded), ref)
    export(tmp_path / "r", tmp_path / "e")
    exported = exported_logits(tmp_path / "e", IDS, tmp_path)
    assert torch.allclose(exported, ref, atol=1e-5 * ref.abs().max())


@pytest.mark.parametrize("arch,match", [("gemma2", "post-norms"), ("gemma3_text", "post-norms"),
                                        ("olmo2", "post-norms"), ("gpt_neox", "LayerNorm")])
def test_architectures_without_invariance_are_refused(arch, match):
    with pytest.raises(UnsupportedArchitectureError, match=match) as err:
        compress_model(tiny_model(arch), None, tiny_compress_config(method="larosa", flops=0.7), tiny_calibration())
    assert "\n" not in str(err.value)
    assert get_method("larosa").unsupported_reason(get_arch(arch)) == str(err.value)


def test_streamed_layers_are_refused():
    model = tiny_model("llama")
    with pytest.raises(UnsupportedArchitectureError, match="stream"):
        get_method("larosa").prepare(model, get_arch(model.config), tiny_calibration().fit, batch_size=4, streamed=True)


def test_a_norm_that_breaks_invariance_is_caught():
    """An architecture registered as RMSNorm-like but normalising with LayerNorm (mean subtracted):
    the fold check compares logits before and after and refuses with one line."""
    model = tiny_model("llama")
    with torch.no_grad():
        for layer in model.model.layers:
            norm = torch.nn.LayerNorm(64)
            norm.weight.uniform_(0.5, 1.5)
            layer.input_layernorm = norm
    with pytest.raises(UnsupportedArchitectureError, match="not rotation-invariant") as err:
        compress_model(model, None, tiny_compress_config(method="larosa", flops=0.7), tiny_calibration())
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_heads_only_ablation_is_exact_and_meets_its_budget(arch):
    """larosa-heads folds only the per-KV-head rotations (no invariance of the residual needed, so
    post-norm Gemma 2 too): exact at F = 1 with nothing untied, and on budget at F = 0.7."""
    model = perturbed_tiny_model(arch)
    dense = _logits(model)
    result = compress_model(model, None, tiny_compress_config(method="larosa-heads", flops=1.0), tiny_calibration())
    assert torch.allclose(_logits(result.model), dense, atol=2e-5 * dense.abs().max())
    assert result.plan["model_transform"]["extra_stored_parameters"] == 0
    v = decoder_layers(result.model, get_arch(model.config))[0].self_attn.v_proj.weight
    assert not torch.allclose(v, decoder_layers(perturbed_tiny_model(arch), get_arch(model.config))[0].self_attn.v_proj.weight)
    result = compress_model(perturbed_tiny_model(arch), None, tiny_compress_config(method="larosa-heads", flops=0.7),
                            tiny_calibration())
    assert result.plan["measured_flops"] == pytest.approx(0.7, abs=0.01)
    assert "interleaves" in get_method("larosa-heads").unsupported_reason(get_arch("gpt_neox"))


def test_refusals_follow_the_spec_flags_not_the_model_type():
    """LayerNorm (`norm_type`) and a per-head interleaved fused qkv (`qkv_interleaved`) are read off the spec:
    a Llama spec declaring them is refused, a GPT-NeoX spec declaring neither is not."""
    llama, neox = get_arch("llama"), get_arch("gpt_neox")
    larosa = get_method("larosa")
    assert "LayerNorm subtracts the mean" in larosa.unsupported_reason(replace(llama, norm_type="layer"))
    assert larosa.unsupported_reason(replace(neox, norm_type="rms", parallel_residual=False)) is None
    for name in ("larosa-heads", "rana-heads"):
        heads_only = get_method(name)
        assert "interleaves q, k and v" in heads_only.unsupported_reason(replace(llama, qkv_interleaved=True))
        assert heads_only.unsupported_reason(replace(neox, qkv_interleaved=False)) is None
