"""Every registered architecture through the whole pipeline on tiny random configs (hidden 64,
2 layers, vocab 128): compress → measured FLOPs on target → rana.io save/load gives the same
logits → LAuReL (rw+lr) at init keeps them identical. Plus the registry paths against the
installed transformers modules, per-layer calibration kwargs (sliding / global layers), fused
gate_up (Phi-3) and the non-gated MLP (GPT-NeoX) for every method."""
import pkgutil
import sys
from dataclasses import replace

import pytest
import torch

import rana.archs
from rana.accounting import layer_dims
from rana.archs import (NORM_TYPES, ArchSpec, UnsupportedArchitectureError, decoder_layers, get_arch,
                        supported_model_types)
from rana.compress.calibrate import LayerInputs, capture_first_layer_inputs, run_layer
from rana.compress import compress_model
from rana.io import load, save
from rana.methods import fused_gate_up_act
from rana.modules import NeuronThresholdLinear, RankAdapterLinear
from rana.modules.laurel import LaurelConfig, apply_laurel
from helpers import tiny_calibration, tiny_compress_config, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

# every registered architecture with a dense MLP (the mixtures of experts have their own tests: test_moe.py)
ARCHS = [arch for arch in supported_model_types() if not get_arch(arch).moe]
CPU = torch.device("cpu")


def _ids(seed=3):
    return torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(seed))


def test_every_architecture_is_registered():
    """Importing rana.archs registers the spec of every file in the package: ARCHS reads the registry, so a
    file left out of rana/archs/__init__.py would silently drop out of every test here."""
    files = {m.name for m in pkgutil.iter_modules(rana.archs.__path__)} - {"base"}
    assert files
    for name in files:
        assert f"rana.archs.{name}" in sys.modules, f"rana/archs/__init__.py does not import {name}"
        specs = [v for v in vars(sys.modules[f"rana.archs.{name}"]).values() if isinstance(v, ArchSpec)]
        assert specs and all(get_arch(t) is spec for spec in specs for t in spec.model_types), name
    assert ARCHS and set(ARCHS) <= set(supported_model_types())


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_paths_resolve_in_the_installed_transformers(arch):
    model = tiny_model(arch)
    spec = get_arch(model.config)
    for path in (spec.layers, spec.embed, spec.final_norm, spec.lm_head):
        model.get_submodule(path)
    assert model.get_submodule(spec.lm_head) is model.get_output_embeddings()
    assert model.get_submodule(spec.embed) is model.get_input_embeddings()
    layer = decoder_layers(model, spec)[0]
    attn, mlp = layer.get_submodule(spec.attn), layer.get_submodule(spec.mlp)
    projections = [spec.qkv_fused] if spec.qkv_fused else [spec.q, spec.k, spec.v]
    for name in projections + [spec.o]:
        assert isinstance(attn.get_submodule(name), torch.nn.Linear)
    for name in (spec.up, spec.gate, spec.gate_up_fused, spec.down):
        if name:
            assert isinstance(mlp.get_submodule(name), torch.nn.Linear)
    assert callable(mlp.get_submodule(spec.act))
    for norm in (spec.attn_norm, spec.mlp_norm, spec.attn_post_norm, spec.mlp_post_norm):
        if norm:
            layer.get_submodule(norm)
    for role in ("qkv_in", "o", "mlp_in", "down"):
        layer.get_submodule(spec.role_path(role))
    # the analytic dense cost counts exactly the decoder layers' projection weights
    dims = layer_dims(model.config)
    n_linear = sum(p.numel() for n, p in layer.named_parameters() if p.dim() == 2)
    d = dims[0]
    assert d.q_out * d.hidden * 2 + 2 * d.kv_out * d.hidden + (3 if d.gated else 2) * d.intermediate * d.hidden == n_linear


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_answers_the_path_questions(arch):
    """qkv / o / MLP paths name every linear of a layer once; each role's path is a projection
    reading that role's input (checked on a real forward); block_of places model-level names."""
    model = tiny_model(arch)
    spec = get_arch(model.config)
    layer = decoder_layers(model, spec)[0]
    qkv, mlp = spec.qkv_paths(), spec.mlp_paths()
    assert list(qkv) == (["qkv"] if spec.qkv_fused else ["q", "k", "v"])
    assert list(mlp) == (["gate_up", "down"] if spec.gate_up_fused else ["up", "gate", "down"] if spec.gate
                         else ["up", "down"])
    projections = [*qkv.values(), spec.o_path(), *mlp.values()]
    linears = {name for name, m in layer.named_modules() if isinstance(m, torch.nn.Linear)}
    assert sorted(projections) == sorted(linears)  # every linear of the layer, each once
    assert callable(layer.get_submodule(spec.act_path()))
    seen = {}
    hooks = [layer.get_submodule(p).register_forward_pre_hook(lambda m, a, p=p: seen.setdefault(p, a[0]))
             for p in projections]
    with torch.no_grad():
        model(_ids())
    for h in hooks:
        h.remove()
    readers = {"qkv_in": list(qkv.values()), "o": [spec.o_path()], "down": [mlp["down"]],
               "mlp_in": [p for n, p in mlp.items() if n != "down"]}
    for role, paths in readers.items():
        assert spec.role_path(role) in paths
        for p in paths:  # every projection of a role reads the same input
            assert torch.equal(seen[p], seen[spec.role_path(role)])
    with pytest.raises(KeyError, match="unknown role"):
        spec.role_path("lm_head")
    for p in [*qkv.values(), spec.o_path()]:
        assert spec.block_of(p) == "attention" and spec.block_of(f"{spec.layers}.1.{p}") == "attention"
    for p in [*mlp.values(), spec.act_path()]:
        assert spec.block_of(p) == "mlp" and spec.block_of(f"{spec.layers}.1.{p}") == "mlp"
    norms = [f"{spec.layers}.0.{n}" for n in (spec.attn_norm, spec.mlp_norm) if n]  # OLMo 2 has no pre-norms
    for p in (spec.embed, spec.lm_head, spec.final_norm, f"{spec.layers}.0", *norms):
        assert spec.block_of(p) is None



@pytest.mark.parametrize("arch", ARCHS)
def test_residual_inputs_and_scale(arch):
    """What LAuReL relies on, on a real forward: `residual_input(block)` receives the residual stream
    x that the block's output f (after its post-norm, if any) is added back to, and the layer
    computes x + m·f with m = `residual_scale` (Granite's residual_multiplier; 1 elsewhere)."""
    model = tiny_model(arch)
    spec = get_arch(model.config)
    layer = decoder_layers(model, spec)[1]
    seen = {}

    def keep(key):
        def hook(_m, args, kwargs):
            seen[key] = args[0] if args else kwargs["hidden_states"]
        return hook

    def keep_output(key):
        def hook(_m, _args, out):
            seen[key] = out[0] if isinstance(out, tuple) else out
        return hook

    hooks = [layer.register_forward_pre_hook(keep("layer_in"), with_kwargs=True),
             layer.register_forward_hook(keep_output("layer_out")),
             layer.get_submodule(spec.mlp_post_norm or spec.mlp).register_forward_hook(keep_output("f"))]
    hooks += [layer.get_submodule(spec.residual_input(b)).register_forward_pre_hook(keep(b), with_kwargs=True)
              for b in ("attention", "mlp")]
    with torch.no_grad():
        model(_ids())
    for h in hooks:
        h.remove()
    out = seen["layer_out"]
    assert torch.equal(seen["attention"], seen["layer_in"])
    m = spec.residual_scale(model.config)
    assert m == (0.22 if arch == "granite" else 1.0)
    if not spec.parallel_residual:  # GPT-NeoX: both blocks read x, out = x + attn + mlp
        torch.testing.assert_close(out, seen["mlp"] + m * seen["f"], atol=1e-6, rtol=1e-6)


def test_arch_specifics():
    gemma = tiny_model("gemma").config
    assert layer_dims(gemma)[0].head_dim == 32 and layer_dims(gemma)[0].q_out == 128  # ≠ hidden
    assert [d.sliding_window for d in layer_dims(tiny_model("gemma2").config)] == [8, None]
    assert [d.sliding_window for d in layer_dims(tiny_model("gemma3_text").config)] == [8, None]
    neox = tiny_model("gpt_neox").config
    assert not get_arch(neox).gated and get_arch(neox).parallel_residual
    assert layer_dims(neox)[0].kv_out == 64  # no GQA: fused qkv is 3 × hidden
    neox.use_parallel_residual = False
    assert not get_arch(neox).parallel_residual  # follows the config flag
    assert get_arch(tiny_model("phi3").config).gated


def test_gpt_neox_alone_declares_layer_norm_and_an_interleaved_qkv():
    neox, phi3 = get_arch("gpt_neox"), get_arch("phi3")
    assert neox.norm_type == "layer" and neox.qkv_interleaved
    assert phi3.qkv_fused and not phi3.qkv_interleaved  # fused, but [all q; all k; all v]
    others = [get_arch(t) for t in supported_model_types() if t != "gpt_neox"]
    assert all(s.norm_type == "rms" and not s.qkv_interleaved for s in others)
    with pytest.raises(ValueError, match="norm_type"):  # a misspelt kind fails at registration
        replace(get_arch("llama"), norm_type="RMSNorm")


@pytest.mark.parametrize("arch", supported_model_types())
def test_norm_type_matches_the_installed_transformers(arch):
    """`norm_type` "layer" exactly where the model's norms subtract the mean (shifting the input changes nothing)."""
    model = tiny_model(arch)
    spec = get_arch(model.config)
    assert spec.norm_type in NORM_TYPES
    norm = model.get_submodule(spec.final_norm)
    x = torch.randn(3, norm.weight.shape[0], generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        shift_invariant = torch.allclose(norm(x + 5.0), norm(x), atol=1e-5)
    assert shift_invariant == (spec.norm_type == "layer")


def _value_rows(spec: ArchSpec, n_heads: int, n_kv: int, hd: int) -> torch.Tensor:
    """v's rows in a fused qkv, as the spec's layout places them."""
    if spec.qkv_interleaved:  # per head [q, k, v]
        return torch.cat([torch.arange(3 * h * hd + 2 * hd, 3 * (h + 1) * hd) for h in range(n_heads)])
    return torch.arange((n_heads + n_kv) * hd, (n_heads + 2 * n_kv) * hd)  # [all q; all k; all v]


@pytest.mark.parametrize("arch", [arch for arch in ARCHS if get_arch(arch).qkv_fused])
@pytest.mark.parametrize("keep", ["only v", "all but v"])
def test_qkv_interleaved_matches_the_installed_transformers(arch, keep):
    """The rows the layout names as v's are what the attention mixes into o's input: kept alone (q = k = 0:
    uniform attention over v) o reads something; zeroed alone, o reads exactly nothing."""
    model = tiny_model(arch)
    spec = get_arch(model.config)
    d = layer_dims(model.config)[0]
    layer = decoder_layers(model, spec)[0]
    qkv = layer.get_submodule(spec.qkv_paths()["qkv"])
    is_v = torch.zeros(qkv.out_features, dtype=torch.bool)
    is_v[_value_rows(spec, d.n_heads, d.kv_out // d.head_dim, d.head_dim)] = True
    zeroed = ~is_v if keep == "only v" else is_v
    seen = []
    hook = layer.get_submodule(spec.o_path()).register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    with torch.no_grad():
        qkv.weight[zeroed] = 0
        if qkv.bias is not None:
            qkv.bias[zeroed] = 0
        model(_ids())
    hook.remove()
    assert bool(seen[0].abs().max() > 0) == (keep == "only v")


def test_unknown_architecture_says_what_is_supported_and_how_to_add_one():
    with pytest.raises(UnsupportedArchitectureError, match=r"supported: .*gpt_neox.*phi3.*rana/archs/"):
        get_arch("bert")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_text"])
def test_each_layer_gets_its_own_kwargs(arch):
    """Sliding-window and global layers get different masks (and Gemma 3 different RoPE): the
    layer-by-layer pipeline reproduces the model only with each layer's own kwargs."""
    model = tiny_model(arch)
    spec = get_arch(model.config)
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids, output_hidden_states=True).hidden_states[-1]
        captured = capture_first_layer_inputs(model, spec, ids, batch_size=2, device=CPU, offload=CPU)
        first_only = LayerInputs(captured.hidden, [dict(kw) for kw in captured.kwargs])  # layer 0's for all
        for layer in decoder_layers(model, spec):
            captured = run_layer(layer, captured, device=CPU, offload=CPU)
            first_only = run_layer(layer, first_only, device=CPU, offload=CPU)
        norm = model.get_submodule(spec.final_norm)
        assert torch.allclose(norm(torch.cat(captured.hidden)), ref, atol=1e-5)
        assert not torch.allclose(norm(torch.cat(first_only.hidden)), ref, atol=1e-3)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method", ["rana", "rana-paper", "teal"])
def test_pipeline(arch, method, tmp_path):
    model = tiny_model(arch)
    ids = _ids()
    with torch.no_grad():
        dense = model(ids).logits
    result = compress_model(model, None, tiny_compress_config(method=method, flops=0.75), tiny_calibration())
    assert result.plan["measured_flops"] == pytest.approx(0.75, abs=0.01)
    with torch.no_grad():
        logits = result.model(ids).logits
    assert torch.isfinite(logits).all() and not torch.allclose(logits, dense)
    for entry in result.plan["layers"]:
        for step in ("attention", "mlp"):
            assert 0 <= entry[step]["heldout_error"] < 1.0

    save(result.model, None, tmp_path / "out", plan=result.plan)
    loaded, _ = load(tmp_path / "out")
    with torch.no_grad():
        reloaded = loaded(ids).logits
    assert torch.allclose(reloaded, logits, atol=1e-6, rtol=0)

    apply_laurel(loaded, LaurelConfig(variant="rw+lr"))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reloaded)


@pytest.mark.parametrize("arch", ARCHS)
def test_finetune_lora_and_laurel(arch, tmp_path):
    """compress → LoRA + LAuReL fine-tune → saved folder reloads to the trained (merged) model, and
    training moved both the LoRA deltas and the LAuReL parameters."""
    from rana.finetune import FinetuneConfig, finetune
    from rana.modules.laurel import LaurelResidual

    result = compress_model(tiny_model(arch), None, tiny_compress_config(method="rana", flops=0.75),
                            tiny_calibration())
    save(result.model, None, tmp_path / "rana", plan=result.plan)
    with torch.no_grad():
        before = result.model(_ids()).logits
    torch.save(torch.randint(0, 128, (2000,), generator=torch.Generator().manual_seed(5)), tmp_path / "train.pt")
    cfg = FinetuneConfig(source=str(tmp_path / "rana"), out=str(tmp_path / "ft"), data=str(tmp_path / "train.pt"),
                         tokens=6 * 4 * 32, seq_len=32, batch_size=4, lr=3e-3, laurel="rw+lr", laurel_rank=4,
                         lora_r=4, eval_tokens=128, save_every=0, eval_every=0)
    trained = finetune(cfg).model.eval()
    apply_laurel(result.model, LaurelConfig(variant="rw+lr", rank=4))  # the untrained start, for comparison
    init_state = {n: p for n, p in result.model.state_dict().items() if "laurel" in n}
    trained_state = {n: p for n, p in trained.state_dict().items() if n in init_state}
    assert init_state and trained_state.keys() == init_state.keys(), "LAuReL was not applied the same way"
    assert any(not torch.equal(trained_state[n], init_state[n]) for n in init_state), "LAuReL did not train"
    loaded, _ = load(tmp_path / "ft")
    with torch.no_grad():
        after = loaded(_ids()).logits
        torch.testing.assert_close(after, trained(_ids()).logits, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(after).all() and not torch.allclose(after, before, atol=1e-4)
    assert any(isinstance(m, LaurelResidual) for m in loaded.modules())


def test_fused_gate_up_is_one_stacked_adapter():
    model = tiny_model("phi3")
    mlp = model.model.layers[0].mlp
    x = torch.randn(5, 64)
    with torch.no_grad():  # the grid search's h = act(gate) * up off the fused output is the MLP's own
        seen = {}
        hook = mlp.down_proj.register_forward_pre_hook(lambda m, a: seen.setdefault("h", a[0]))
        mlp(x)
        hook.remove()
        assert torch.allclose(fused_gate_up_act(mlp.activation_fn, 160)(mlp.gate_up_proj(x)), seen["h"])
    result = compress_model(model, None, tiny_compress_config(method="rana-paper", flops=0.7), tiny_calibration())
    for entry in result.plan["layers"]:
        comps = entry["mlp"]["components"]
        assert set(comps) == {"gate_up", "down"} and len(entry["mlp"]["shares"]) == 2
        assert comps["gate_up"]["out_features"] == 320
    mlp = result.model.model.layers[0].mlp
    assert isinstance(mlp.gate_up_proj, RankAdapterLinear) and mlp.gate_up_proj.out_features == 320
    assert isinstance(mlp.down_proj, NeuronThresholdLinear)


@pytest.mark.parametrize("arch", ["gpt_neox", "phi3"])
def test_svd_on_non_gated_and_fused_mlps(arch):
    result = compress_model(tiny_model(arch), None, tiny_compress_config(method="svd", flops=0.75), tiny_calibration())
    assert result.plan["measured_flops"] == pytest.approx(0.75, abs=0.01)
    names = set(result.plan["layers"][0]["mlp"]["components"])
    assert names == ({"up", "down"} if arch == "gpt_neox" else {"gate_up", "down"})


@pytest.mark.parametrize("arch,match", [("gpt_neox", "non-gated MLP"), ("phi3", "separate gate projection")])
def test_cats_needs_a_separate_gate(arch, match):
    with pytest.raises(UnsupportedArchitectureError, match=match):
        compress_model(tiny_model(arch), None, tiny_compress_config(method="cats", flops=0.8), tiny_calibration())
