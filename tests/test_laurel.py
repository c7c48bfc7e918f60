"""LAuReL (rana.modules.laurel): exact identity at init, parameter counts, the residual forms for
sequential / post-norm / parallel-residual layers, KV-cache generation, gradient checkpointing, peft,
state_dict round-trips. Tiny random models built in-process; CPU, float32, offline."""
import copy
import math
import warnings

import pytest
import torch
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from rana.archs import get_arch
from rana.archs.gemma2 import GEMMA2 as GEMMA2_SPEC
from rana.archs.gpt_neox import GPT_NEOX as NEOX_SPEC
from rana.modules.laurel import (
    LaurelConfig,
    LaurelReport,
    LaurelResidual,
    apply_laurel,
    get_laurel_config,
    is_laurel_applied,
    laurel_parameters,
    remove_laurel,
)

D, V = 64, 128
SMALL = dict(
    hidden_size=D,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=V,
    max_position_embeddings=128,
)


def make(arch="llama", layers=3, seed=0):
    torch.manual_seed(seed)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **SMALL))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=layers, **SMALL))
    elif arch == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config(num_hidden_layers=layers, head_dim=16, **SMALL))
    elif arch == "gpt_neox":
        cfg = dict(SMALL)
        cfg.pop("num_key_value_heads")
        model = GPTNeoXForCausalLM(
            GPTNeoXConfig(num_hidden_layers=layers, use_parallel_residual=True, rotary_pct=0.25, **cfg)
        )
    elif arch in ("granite", "olmo2"):  # the registered tiny configs (Granite's multipliers; OLMo 2: no pre-norms)
        from helpers import tiny_model

        model = tiny_model(arch, seed=seed, num_hidden_layers=layers, intermediate_size=128, max_position_embeddings=128)
    else:
        raise ValueError(arch)
    return model.float().eval()


# the registered specs, passed explicitly (apply_laurel(spec=...)) rather than looked up
SPECS = {"gemma2": GEMMA2_SPEC, "gpt_neox": NEOX_SPEC}


def spec_of(arch):
    return SPECS.get(arch)


def ids(batch=2, length=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (batch, length), generator=g)


def logits(model, x):
    with torch.no_grad():
        return model(x).logits


def perturb(model, scale=0.5, seed=3):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in laurel_parameters(model):
            p.add_(scale * torch.randn(p.shape, generator=g))


VARIANTS = ["rw", "lr", "pa", "rw+lr", "rw+lr+pa", "skip", "lr+pa", "rw+pa", "skip+lr+pa"]


# ------------------------------------------------------------------------------------ identity ----


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_identity_at_init_bit_exact(arch, variant):
    model = make(arch)
    x = ids()
    base = logits(model, x)
    for per_dim in (False, True):
        report = apply_laurel(model, LaurelConfig(variant=variant, rank=8, history=3, per_dim=per_dim))
        assert isinstance(report, LaurelReport) and report.num_params > 0
        assert is_laurel_applied(model)
        assert torch.equal(logits(model, x), base), (variant, per_dim)
        remove_laurel(model)
        assert not is_laurel_applied(model)
    assert torch.equal(logits(model, x), base)


@pytest.mark.parametrize("arch", ["gemma2", "gpt_neox", "olmo2", "granite"])
@pytest.mark.parametrize("variant", ["rw", "rw+lr+pa", "skip+lr"])
def test_identity_post_norm_and_parallel_residual(arch, variant):
    """Also OLMo 2 (x recorded at the block's own input: no pre-norm) and Granite (skip terms divided
    by the residual multiplier): still bit for bit at init."""
    model = make(arch, layers=2)
    x = ids()
    base = logits(model, x)
    apply_laurel(model, LaurelConfig(variant=variant, rank=4, history=2, per_dim=True), spec=spec_of(arch))
    assert torch.equal(logits(model, x), base)


def test_identity_default_config_and_targets():
    model = make("llama")
    x = ids()
    base = logits(model, x)
    report = apply_laurel(model)  # default: rw+lr, rank 16, identity
    assert report.config.variant == "rw+lr"
    assert torch.equal(logits(model, x), base)
    remove_laurel(model)
    report = apply_laurel(model, LaurelConfig("rw+lr+pa", targets=("mlp",), history=3))
    assert {s.target for s in report.sites} == {"mlp"} and len(report.sites) == 3
    assert torch.equal(logits(model, x), base)


def test_init_values_identity():
    model = make("llama", layers=2)
    apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4, history=3))
    m = model.model.layers[0].laurel_attn
    assert torch.equal(m.alpha(), torch.ones(1)) and torch.equal(m.beta(), torch.ones(1))
    assert torch.count_nonzero(m.up) == 0
    a = m.down.detach()  # A: r x D, A_ji = 1/sqrt(rD) if i mod r == j
    expect = torch.zeros(4, D)
    for i in range(D):
        expect[i % 4, i] = 1 / math.sqrt(4 * D)
    assert torch.equal(a, expect)
    gram = a @ a.T  # rows of A (= columns of the paper's D x r matrix) are orthogonal
    assert torch.allclose(gram, torch.diag(torch.diagonal(gram)))
    assert torch.equal(m.gamma.detach(), torch.ones(3))  # h = BA already zero through B = 0
    remove_laurel(model)
    apply_laurel(model, LaurelConfig("pa", history=3))
    assert torch.equal(model.model.layers[1].laurel_mlp.gamma.detach(), torch.zeros(3))  # h = identity


def test_skip_schedule_init_by_depth():
    model = make("llama", layers=4)
    x = ids()
    base = logits(model, x)
    report = apply_laurel(model, LaurelConfig(variant="skip", init="skip_schedule"))
    expect = [1.0, 0.5, 0.0, 0.0]
    for i, layer in enumerate(model.model.layers):
        for target in ("attn", "mlp"):
            assert getattr(layer, f"laurel_{target}").skip_weight.item() == expect[i]
    assert [s.skip_init for s in report.sites] == [v for v in expect for _ in range(2)]
    assert report.num_params == 8
    # intentionally not an identity: from-scratch init
    assert not torch.allclose(logits(model, x), base)
    remove_laurel(model)
    apply_laurel(model, LaurelConfig(variant="skip+lr", init="skip_schedule", rank=4, per_dim=True))
    assert torch.equal(model.model.layers[1].laurel_mlp.skip_weight.detach(), torch.full((D,), 0.5))


# -------------------------------------------------------------------------------- param counts ----


def expected_site_params(variant, rank, history, per_dim):
    comps = variant.split("+")
    w = D if per_dim else 1
    return (
        (2 * w if "rw" in comps else 0)
        + (w if "skip" in comps else 0)
        + (2 * rank * D if "lr" in comps else 0)
        + (history if "pa" in comps else 0)
    )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("per_dim", [False, True])
def test_parameter_count_formula(variant, per_dim):
    layers, rank, history = 3, 8, 3
    model = make("llama", layers=layers)
    n_base = sum(p.numel() for p in model.parameters())
    report = apply_laurel(model, LaurelConfig(variant=variant, rank=rank, history=history, per_dim=per_dim))
    expect = layers * 2 * expected_site_params(variant, rank, history, per_dim)
    assert report.num_params == expect
    assert sum(p.numel() for p in laurel_parameters(model)) == expect
    assert sum(p.numel() for p in model.parameters()) == n_base + expect
    assert report.base_params == n_base
    assert [row["params"] for row in report.per_layer] == [expect // layers] * layers
    ids_laurel = {id(p) for p in laurel_parameters(model)}
    assert all("laurel" in n for n, p in model.named_parameters() if id(p) in ids_laurel)


def test_parameter_count_parallel_residual():
    # primary branch (attn): rw 2w + lr 2rD + pa k ; second branch (mlp): alpha only (w)
    model = make("gpt_neox", layers=2)
    report = apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4, history=2, per_dim=True), spec=NEOX_SPEC)
    assert report.num_params == 2 * ((2 * D + 2 * 4 * D + 2) + D)
    assert [s.role for s in report.sites] == ["residual", "alpha_only"] * 2
    remove_laurel(model)
    report = apply_laurel(model, LaurelConfig("lr", rank=4), spec=NEOX_SPEC)  # no alpha: mlp untouched
    assert report.num_params == 2 * 2 * 4 * D and {s.target for s in report.sites} == {"attn"}


# ------------------------------------------------------------------------- the residual forms ----


def closed_form(mod: LaurelResidual, f, x, stream):
    """alpha f + beta (x + g), g = h(sum_j gamma_j x_{l-j}), written out independently of forward()."""
    comps = mod.components
    alpha = 2 * torch.sigmoid(mod.alpha_logit) if "rw" in comps else 1.0
    if mod.alpha_only:
        return alpha * f
    beta = 2 * torch.sigmoid(mod.beta_logit) if "rw" in comps else (mod.skip_weight if "skip" in comps else 1.0)
    if "pa" in comps:
        prev = list(reversed(stream))[: mod.history - 1]
        z = mod.gamma[0] * x + sum(mod.gamma[j + 1] * p for j, p in enumerate(prev))
    else:
        z = x
    if "lr" in comps:
        g = z @ mod.down.T @ mod.up.T
    elif "pa" in comps:
        g = z
    else:
        g = 0.0
    return alpha * f + beta * (x + g)


def reference_forward(model, spec, layer_inputs, layer_kwargs, laurels):
    """Chain the decoder layers by hand (hooks removed) with the closed-form LAuReL residuals. The branch
    f is what the layer adds: m·post_norm(block(pre_norm(x))), each piece where the arch has it."""
    ref = copy.deepcopy(model)
    remove_laurel(ref)
    layers = ref.get_submodule(spec.layers)
    m_scale = spec.residual_scale(model.config)

    def pre(layer, block, x):  # OLMo 2: no pre-norm
        return layer.get_submodule(spec.pre_norm(block))(x) if spec.pre_norm(block) else x

    h = layer_inputs[0]
    stream, outs = [], []
    for i, layer in enumerate(layers):
        kw = {k: layer_kwargs[i][k] for k in ("attention_mask", "position_embeddings", "position_ids") if k in layer_kwargs[i]}
        la, lm = laurels[i]
        x = h
        a = layer.get_submodule(spec.attn)(pre(layer, "attention", x), **kw)[0]
        if spec.attn_post_norm:
            a = layer.get_submodule(spec.attn_post_norm)(a)
        a = m_scale * a
        if spec.parallel_residual:
            m = layer.get_submodule(spec.mlp)(pre(layer, "mlp", x))
            h = closed_form(la, a, x, stream) + closed_form(lm, m, x, stream)
            stream.append(x)
        else:
            h = closed_form(la, a, x, stream)
            stream.append(x)
            x = h
            m = layer.get_submodule(spec.mlp)(pre(layer, "mlp", x))
            if spec.mlp_post_norm:
                m = layer.get_submodule(spec.mlp_post_norm)(m)
            m = m_scale * m
            h = closed_form(lm, m, x, stream)
            stream.append(x)
        outs.append(h)
    return outs


@pytest.mark.parametrize(
    "arch,variant",
    [("llama", "rw+lr+pa"), ("llama", "skip+pa"), ("qwen2", "rw+lr"), ("gemma2", "rw+lr+pa"), ("gpt_neox", "rw+lr+pa"),
     ("olmo2", "rw+lr+pa"), ("granite", "rw+lr+pa"), ("granite", "skip+lr")],
)
def test_residual_form_matches_closed_form(arch, variant):
    model = make(arch, layers=3)
    spec = spec_of(arch) or get_arch(model.config)
    apply_laurel(model, LaurelConfig(variant=variant, rank=4, history=3, per_dim=True), spec=spec)
    perturb(model)
    layers = model.get_submodule(spec.layers)
    inputs, kwargs, outputs = [], [], []
    hooks = []
    for layer in layers:
        hooks.append(layer.register_forward_pre_hook(lambda m, a, k: (inputs.append(a[0]), kwargs.append(k)) and None, with_kwargs=True))
        hooks.append(layer.register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o) and None))
    with torch.no_grad():
        model(ids())
        for h in hooks:
            h.remove()
        laurels = [(getattr(l, "laurel_attn"), getattr(l, "laurel_mlp", None)) for l in layers]
        ref = reference_forward(model, spec, inputs, kwargs, laurels)
    for got, want in zip(outputs, ref):
        scale = want.abs().max().item()  # float32 rounding relative to the activations' magnitude
        assert torch.allclose(got, want, atol=1e-5 * scale, rtol=1e-4), (got - want).abs().max()
    # and LAuReL changed something: not the plain residual
    remove_laurel(model)
    outputs.clear()
    hook = layers[-1].register_forward_hook(lambda m, a, o: outputs.append(o[0] if isinstance(o, tuple) else o) and None)
    with torch.no_grad():
        model(ids())
    hook.remove()
    assert not torch.allclose(outputs[0], ref[-1], atol=1e-3)


# --------------------------------------------------------------------------------- training ----


@pytest.mark.parametrize("variant", ["rw+lr+pa", "skip", "pa"])
def test_perturb_changes_output_and_grads_reach_exactly_laurel(variant):
    model = make("llama")
    x = ids()
    base = logits(model, x)
    apply_laurel(model, LaurelConfig(variant=variant, rank=4, history=3))
    perturb(model)
    assert not torch.allclose(logits(model, x), base, atol=1e-4)
    for p in model.parameters():
        p.requires_grad_(False)
    params = laurel_parameters(model)
    for p in params:
        p.requires_grad_(True)
    model.train()
    model(x, labels=x).loss.backward()
    with_grad = {id(p) for p in model.parameters() if p.grad is not None}
    assert with_grad == {id(p) for p in params}
    assert all(torch.count_nonzero(p.grad) > 0 for p in params)
    names = [n for n, p in model.named_parameters() if id(p) in with_grad]
    assert names and all("laurel" in n for n in names)


def test_grads_flow_at_identity_init():
    """At init B = 0: B, alpha, beta, gamma(identity h) must still receive gradients (no dead saddle)."""
    model = make("llama")
    x = ids()
    apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4, history=2))
    model.train()
    model(x, labels=x).loss.backward()
    m = model.model.layers[1].laurel_attn
    for p in (m.alpha_logit, m.beta_logit, m.up):
        assert torch.count_nonzero(p.grad) > 0
    remove_laurel(model)
    model.zero_grad()
    apply_laurel(model, LaurelConfig("pa", history=2))
    model(x, labels=x).loss.backward()
    assert torch.count_nonzero(model.model.layers[1].laurel_attn.gamma.grad) == 2


def _grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x, labels=x).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("variant", ["rw+lr+pa", "rw+lr"])
def test_gradient_checkpointing(variant):
    model = make("llama")
    x = ids()
    apply_laurel(model, LaurelConfig(variant=variant, rank=4, history=3))
    perturb(model)
    model.train()
    ref = _grads(model, x)  # all parameters trainable: checks the cross-layer PA path too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()  # HF default: non-reentrant
    assert model.model.layers[0].gradient_checkpointing
    got = _grads(model, x)
    assert ref.keys() == got.keys() and any("laurel" in n for n in got)
    for n in ref:
        assert torch.allclose(ref[n], got[n], atol=1e-6, rtol=1e-4), n
    # eval after checkpointed training still exact / consistent
    model.eval()
    logits(model, x)


def test_gradient_checkpointing_reentrant():
    model = make("llama")
    x = ids()
    apply_laurel(model, LaurelConfig("rw+lr", rank=4))
    perturb(model)
    model.train()
    ref = _grads(model, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    got = _grads(model, x)
    for n in ref:
        if "embed_tokens" not in n:
            assert torch.allclose(ref[n], got[n], atol=1e-6, rtol=1e-4), n
    remove_laurel(model)
    apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4))
    with pytest.warns(RuntimeWarning, match="reentrant"):
        model(x, labels=x).loss.backward()


def test_frozen_base_checkpointing_backward():
    model = make("qwen2")
    x = ids()
    apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4, history=2))
    for p in model.parameters():
        p.requires_grad_(False)
    for p in laurel_parameters(model):
        p.requires_grad_(True)
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    model(x, labels=x).loss.backward()
    assert all(p.grad is not None for p in laurel_parameters(model))
    assert all(p.grad is None for n, p in model.named_parameters() if "laurel" not in n)


# ------------------------------------------------------------------------------- generation ----


def test_generate_kv_cache_at_init_matches_base():
    model = make("llama")
    prompt = ids(batch=2, length=6)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        base = model.generate(prompt, **kw)
        apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4, history=3))
        out = model.generate(prompt, **kw)
    assert torch.equal(out, base)


@pytest.mark.parametrize("arch", ["llama", "gpt_neox"])
def test_generate_kv_cache_consistent_after_training(arch):
    model = make(arch)
    apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4, history=3), spec=spec_of(arch))
    perturb(model, scale=1.0)
    seq = ids(batch=2, length=12)
    with torch.no_grad():
        full = model(seq).logits
        out = model(seq[:, :8], use_cache=True)
        steps = [out.logits]
        past = out.past_key_values
        for t in range(8, 12):
            out = model(seq[:, t : t + 1], past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits)
        inc = torch.cat(steps, dim=1)
        assert torch.allclose(inc, full, atol=1e-5, rtol=1e-4)
        kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(seq[:, :5], use_cache=True, **kw), model.generate(seq[:, :5], use_cache=False, **kw))


# ------------------------------------------------------------------------- persistence / misc ----


@pytest.mark.parametrize("variant", ["rw+lr+pa", "skip"])
def test_state_dict_roundtrip(variant):
    cfg = LaurelConfig(variant=variant, rank=4, history=3, per_dim=True)
    model = make("llama")
    base_keys = set(model.state_dict())
    apply_laurel(model, cfg)
    perturb(model)
    sd = model.state_dict()
    laurel_keys = set(sd) - base_keys
    assert base_keys <= set(sd) and laurel_keys and all("laurel" in k for k in laurel_keys)
    x = ids()
    want = logits(model, x)
    fresh = make("llama", seed=123)
    apply_laurel(fresh, LaurelConfig.from_dict(cfg.to_dict()))
    fresh.load_state_dict(sd)
    assert torch.equal(logits(fresh, x), want)
    # a plain checkpoint loads into a LAuReL model with exactly the LAuReL keys missing
    plain = make("llama", seed=5)
    apply_laurel(plain, cfg)
    missing, unexpected = plain.load_state_dict(make("llama").state_dict(), strict=False)
    assert set(missing) == laurel_keys and not unexpected


def test_deepcopy_and_get_config():
    model = make("llama")
    cfg = LaurelConfig("rw+lr+pa", rank=4, history=3)
    apply_laurel(model, cfg)
    perturb(model)
    x = ids()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    model(x, labels=x).loss.backward()  # history retained for recompute: deepcopy must still work
    clone = copy.deepcopy(model)
    model.eval(), clone.eval()
    assert torch.equal(logits(clone, x), logits(model, x))
    with torch.no_grad():
        clone.model.layers[0].laurel_attn.gamma.add_(1.0)
    assert not torch.equal(logits(clone, x), logits(model, x))
    assert get_laurel_config(model) == cfg and get_laurel_config(make("llama", layers=1)) is None


def test_config_roundtrip_and_errors():
    cfg = LaurelConfig("rw+lr+pa", rank=4, history=3, per_dim=True, targets=["mlp"])
    d = cfg.to_dict()
    assert d["targets"] == ["mlp"] and LaurelConfig.from_dict(d) == cfg
    assert LaurelConfig("LR+rw").components == ("rw", "lr")
    model = make("llama", layers=2)
    for bad in ("foo", "rw+foo", "rw+skip", "", "lr+lr"):
        with pytest.raises(ValueError, match="variant"):
            apply_laurel(model, LaurelConfig(variant=bad))
    with pytest.raises(ValueError, match="skip_schedule"):
        LaurelConfig("rw", init="skip_schedule")
    with pytest.raises(ValueError, match="init"):
        LaurelConfig("rw", init="zeros")
    with pytest.raises(ValueError, match="targets"):
        LaurelConfig(targets=("attn", "ffn"))
    with pytest.raises(ValueError, match="rank"):
        apply_laurel(model, LaurelConfig("lr", rank=D + 1))
    with pytest.raises(ValueError, match="keys"):
        LaurelConfig.from_dict({"variant": "rw", "rnak": 3})
    assert not is_laurel_applied(model)
    apply_laurel(model, LaurelConfig("rw"))
    with pytest.raises(RuntimeError, match="already"):
        apply_laurel(model, LaurelConfig("rw"))


def test_block_called_without_norm_is_a_clear_error():
    model = make("llama", layers=1)
    apply_laurel(model, LaurelConfig("rw"))
    with pytest.raises(RuntimeError, match="no residual input recorded"):
        model.model.layers[0].mlp(torch.randn(1, 3, D))


def test_peft_lora_with_laurel():
    peft = pytest.importorskip("peft")
    x = ids()
    # (a) modules_to_save: peft wraps laurel_* and trains a copy; the hooks call the active copy
    model = make("llama")
    apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4))
    pm = peft.get_peft_model(
        model,
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["laurel_attn", "laurel_mlp"]),
    )
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert any("laurel" in n for n in trainable) and any("lora_" in n for n in trainable)
    before = logits(pm, x)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "laurel" in n and p.requires_grad and n.endswith("beta_logit"):
                p.add_(1.0)
    assert not torch.allclose(logits(pm, x), before)
    pm.train()
    pm(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is not None for n, p in pm.named_parameters() if p.requires_grad and "laurel" in n)
    # (b) name filter: plain LoRA, then make the LAuReL parameters trainable
    model = make("llama")
    apply_laurel(model, LaurelConfig("rw+lr", rank=4))
    pm = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert not any(p.requires_grad for p in laurel_parameters(pm))
    for p in laurel_parameters(pm):
        p.requires_grad_(True)
    pm.train()
    pm(input_ids=x, labels=x).loss.backward()
    assert all(p.grad is not None for p in laurel_parameters(pm))
    assert is_laurel_applied(pm)


def test_bf16_identity_and_pickle():
    import io

    model = make("llama").to(torch.bfloat16)
    x = ids()
    base = logits(model, x)
    apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4, history=3, per_dim=True))
    assert model.model.layers[0].laurel_attn.up.dtype == torch.bfloat16  # follows the model
    assert torch.equal(logits(model, x), base)
    remove_laurel(model)
    report = apply_laurel(model, LaurelConfig("rw+lr+pa", rank=4), dtype=torch.float32)  # fp32 master params
    assert model.model.layers[0].laurel_attn.up.dtype == torch.float32
    assert torch.equal(logits(model, x), base)
    assert "rw+lr+pa" in report.summary()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert is_laurel_applied(loaded) and torch.equal(logits(loaded, x), base)
