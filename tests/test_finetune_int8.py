"""Fine-tuning int8 rana folders (issue 28): LoRA on a frozen int8 base (rana.finetune.int8_lora), merged
back by requantizing, saved as an int8 folder again."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

import rana
from rana.compress import CompressConfig, compress_model
from rana.finetune import FinetuneConfig, FinetuneError, Trainer, finetune, resolve_lora_targets, sync_neuron_norms
from rana.finetune.checkpoints import CheckpointFolder
from rana.finetune.data import prepare_blocks
from rana.finetune.int8_lora import Int8LoraLinear
from rana.modules.int8 import quantize_input
from rana.finetune.source import inspect_source, probe_tokenizer
from rana.finetune.trainer import make_accelerator
from rana.io import read_meta, save
from rana.math.quantize import quantize_int8
from rana.modules import NeuronThresholdLinear, RankAdapterLinear
from rana.modules.int8 import Int8Linear
from rana.modules.neuron_linear import Int8InputSparseHead
from rana.quantize import quantize_model

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
INT8 = (Int8Linear, Int8InputSparseHead)


@pytest.fixture(scope="module")
def work(tmp_path_factory, one_thread):
    """A tiny Llama compressed (rank adapters, a shared q/k/v code, neuron-thresholded down, input-sparse
    LM head), quantized to int8 with calibration, saved; pre-tokenised training data."""
    root = tmp_path_factory.mktemp("ft8")
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    ids = torch.randint(0, 128, (20, 32), generator=torch.Generator().manual_seed(1))
    cfg_ = CompressConfig(model="x", method="rana-paper", flops=0.7, calib_tokens=512, seq_len=32, batch_size=4,
                          search_tokens=128, fit_sample_tokens=256, lm_head="sparse")
    result = compress_model(dense, None, cfg_, SimpleNamespace(fit=ids[:16], heldout=ids[16:]))
    model = result.model.eval()
    report = quantize_model(model, ids[:16], batch_size=4)
    assert any(isinstance(m, RankAdapterLinear) for m in model.modules())
    assert any(isinstance(m, NeuronThresholdLinear) for m in model.modules())
    assert type(model.lm_head) is Int8InputSparseHead
    save(model, None, root / "int8", plan={**result.plan, "weights": "int8", "quantization": report})
    g = torch.Generator().manual_seed(2)
    torch.save(torch.randint(0, 128, (3000,), generator=g), root / "train.pt")
    return SimpleNamespace(root=root, int8=str(root / "int8"), data=str(root / "train.pt"))


def cfg(work, **kw) -> FinetuneConfig:
    base = dict(source=work.int8, data=work.data, tokens=4 * 4 * 32, seq_len=32, batch_size=4, lr=1e-3,
                laurel="none", lora_r=4, eval_tokens=32 * 4, save_every=0, eval_every=4)
    return FinetuneConfig(**{**base, **kw})


def trainer(config: FinetuneConfig) -> Trainer:
    source = inspect_source(config)
    accelerator = make_accelerator(config)
    train_blocks, heldout_blocks = prepare_blocks(config, *probe_tokenizer(source, config))
    return Trainer(config, source, train_blocks, heldout_blocks, accelerator, CheckpointFolder(config, accelerator))


def _batch(seed=3):
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(seed))


def _perturb(model, seed=4, scale=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _int8_state(model) -> dict:
    """Every int8 module's codes and scales, by path (peft's wrapper prefixes stripped)."""
    out = {}
    for name, m in model.named_modules():
        if type(m) in INT8:
            key = name.removeprefix("base_model.model.").replace(".base_layer", "")
            out[key] = (m.qweight.clone(), m.weight_scale.clone())
    return out


# ------------------------------------------------------------------------------------------ training


def test_lora_wraps_the_int8_targets_and_leaves_the_codes_alone(work):
    tr = trainer(cfg(work, lora_targets="all"))
    model, _, info = tr.build_model()
    base = model.get_base_model()
    wrapped = {n.removeprefix("base_model.model."): m for n, m in model.named_modules() if isinstance(m, Int8LoraLinear)}
    fresh, _ = rana.load(work.int8)
    assert wrapped and set(wrapped) == set(resolve_lora_targets(fresh, "all")) and info.lora_targets == len(wrapped)
    assert all(type(m.base_layer) is Int8Linear for m in wrapped.values())
    assert not any(type(m) is nn.Linear for n, m in base.named_modules() if n.startswith("model.layers.")
                   and ".lora_" not in n)  # every base linear of the decoder stayed int8
    layer = next(iter(wrapped.values()))
    assert layer.weight.shape == (layer.out_features, layer.in_features)  # the dequantized base, not the codes
    assert layer.lora_A["default"].weight.dtype == torch.float32
    before = _int8_state(model)

    # gradients: LoRA A and B (B moved off zero) and nothing else
    _perturb(model)
    model.train()
    saved, inside = [], []  # what autograd keeps from inside the wrapped int8 layers

    def pack(t):
        if inside:
            saved.append((inside[-1], tuple(t.shape), t.dtype))
        return t

    def enter(mod, args):
        inside.append(mod)

    def leave(mod, args, out):
        inside.pop()

    hooks = [h for m in wrapped.values() for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    ids = _batch()[:1, :7]  # 7 tokens: no activation has a weight's shape
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    for h in hooks:
        h.remove()
    loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n
    # the graph keeps the int8 codes of the base layers, never a dequantized full-precision copy
    with_codes = 0  # (a layer whose input needs no gradient, the first one reading the embeddings, saves none)
    for m in wrapped.values():
        mine = [(shape, dtype) for mod, shape, dtype in saved if mod is m]
        with_codes += (tuple(m.base_layer.qweight.shape), torch.int8) in mine
        weight_shapes = {(m.out_features, m.in_features), (m.in_features, m.out_features)}
        assert not [s for s, d in mine if d.is_floating_point and s in weight_shapes], mine
    assert with_codes > len(wrapped) // 2

    # a few optimizer steps: the codes and scales are the source's, bit for bit
    result = tr.run(1e-3, 3)
    assert result.status == "completed" and result.step == 3
    after = _int8_state(result.model)
    assert after.keys() == before.keys()
    for k, (q, s) in before.items():
        assert torch.equal(after[k][0], q) and torch.equal(after[k][1], s), k
    lora_b = [p for n, p in result.model.named_parameters() if "lora_B" in n]
    assert any(p.abs().sum() > 0 for p in lora_b)  # it trained


def test_int8_lora_forward_matches_the_dequantized_reference(work):
    """The wrapped int8 layer: base + scaling·B A x, with the input gradient of the dequantized linear."""
    tr = trainer(cfg(work, lora_targets="o_proj"))
    model, _, _ = tr.build_model()
    _perturb(model, seed=11)
    layer = next(m for m in model.modules() if isinstance(m, Int8LoraLinear))
    w = layer.base_layer.dequantized(torch.float32)
    ref_w = w + layer.get_delta_weight("default")
    x = torch.randn(3, 5, layer.in_features, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = layer(x)
    base_in = quantize_input(layer.base_layer, x_ref.detach())  # the base multiplies its input as it decodes
    lora_in = x_ref - x_ref.detach()  # (zero: the input's gradient path, straight through the rounding)
    y_ref = (base_in + lora_in) @ w.t() + x_ref @ layer.get_delta_weight("default").t() + (
        0 if layer.base_layer.bias is None else layer.base_layer.bias)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # one token, no gradients: the base's own int8 decode path, LoRA still added
        torch.testing.assert_close(layer(x[:1, :1].detach()), y_ref[:1, :1].detach(), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------ merge


@pytest.mark.parametrize("masks", [True, False], ids=["masks", "no-masks"])
def test_merge_requantizes_and_stays_close_to_the_unmerged_model(work, masks):
    tr = trainer(cfg(work, lora_targets="all"))
    model, _, _ = tr.build_model()
    before = _int8_state(model)
    if not masks:  # every threshold -inf: the logits then differ by the requantization error alone
        for m in model.modules():
            if "threshold" in m._buffers:
                m._buffers["threshold"].fill_(-float("inf"))
    _perturb(model, seed=7, scale=0.02)
    sync_neuron_norms(model)  # what each optimizer step does
    wrapped = {n.removeprefix("base_model.model."): m for n, m in model.named_modules() if isinstance(m, Int8LoraLinear)}
    want = {n: m.base_layer.dequantized(torch.float32) + m.get_delta_weight("default") for n, m in wrapped.items()}
    model.eval()
    x = _batch(5)
    with torch.no_grad():
        ref = model(input_ids=x).logits
    merged = tr.merge(model)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert not any(isinstance(m, Int8LoraLinear) for m in merged.modules())
    after = _int8_state(merged)
    assert after.keys() == before.keys()  # the same modules are int8, nothing became full precision
    for n, w in want.items():
        m = merged.get_submodule(n)
        assert type(m) is Int8Linear and m.qweight.dtype == torch.int8 and m.qweight.is_contiguous()
        q, s = quantize_int8(w)  # the merge: max-abs requantization of W + ΔW
        assert torch.equal(m.qweight, q.t()) and torch.equal(m.weight_scale, s), n
        assert ((m.weight.float() - w).abs() <= s[:, None] / 2 * (1 + 1e-5) + 1e-8).all(), n
    for k in set(before) - set(want):  # the LM head was not a target: untouched
        assert torch.equal(after[k][0], before[k][0]) and torch.equal(after[k][1], before[k][1])
    for m in merged.modules():
        if isinstance(m, NeuronThresholdLinear):  # norms follow the requantized weight
            torch.testing.assert_close(m.column_norms, m.linear.weight.float().norm(dim=0))
    with torch.no_grad():
        got = merged(input_ids=x).logits
    # within the requantization error (at most half a step per weight): ~1 % of these (small, random) logits;
    # with the masks on, a weight that moves by a rounding step also flips the mask entries sitting at a
    # threshold, which on a random tiny model moves the logits by a few per cent more; with int8 activations the
    # merged ΔW also multiplies the quantized input, where the unmerged LoRA term read the float one
    rel = float((got - ref).norm() / ref.norm())
    a8 = any(getattr(m, "activations", None) == "int8" for m in merged.modules())
    assert rel < (0.1 if masks else 2e-2 * (1.5 if a8 else 1.0)), rel


def test_merging_untrained_adapters_gives_back_the_source_codes(work):
    """B = 0 (peft's init): W' = dequant(q, s) and max-abs requantizes it to the same codes."""
    tr = trainer(cfg(work, lora_targets="all"))
    model, _, _ = tr.build_model()
    before = _int8_state(model)
    merged = tr.merge(model)
    after = _int8_state(merged)
    for k, (q, s) in before.items():
        assert torch.equal(after[k][0], q), k
        torch.testing.assert_close(after[k][1], s, rtol=1e-6, atol=0)


# ------------------------------------------------------------------------------------------ the run


def test_finetune_writes_an_int8_folder_that_reloads(work, tmp_path):
    out = tmp_path / "out"
    r = finetune(cfg(work, out=str(out)))
    meta, src_meta = read_meta(out), read_meta(work.int8)
    assert meta["weights"] == "int8" and meta["int8"]["modules"] == src_meta["int8"]["modules"]
    assert meta["finetune"]["mode"] == "lora" and meta["finetune"]["int8_merge"]["requantized_modules"] > 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["weights"] == "int8" and plan["quantization"]["file_bytes"] > 0
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
        dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
    assert not any("lora" in k for k in keys)
    assert {v for k, v in dtypes.items() if k.endswith("qweight")} == {"I8"}
    assert sum(k.endswith("qweight") for k in keys) == len(meta["int8"]["modules"])
    ids = _batch(6)
    with torch.no_grad():
        want = r.model(input_ids=ids).logits
    loaded, _ = rana.load(out)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    script = ("import sys, json, torch, rana; m, _ = rana.load(sys.argv[1]); ids = torch.tensor(json.loads(sys.argv[2]))\n"
              "assert any(type(x).__name__ == 'Int8Linear' for x in m.modules())\n"
              "with torch.no_grad(): print(json.dumps(m(input_ids=ids).logits.tolist()))")
    proc = subprocess.run([sys.executable, "-c", script, str(out), json.dumps(ids.tolist())], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1])), want, rtol=1e-5,
                               atol=1e-5)


def test_full_finetuning_of_an_int8_folder_is_refused_in_one_line(work):
    with pytest.raises(FinetuneError, match="--full") as e:
        inspect_source(FinetuneConfig(source=work.int8, full=True))
    assert "\n" not in str(e.value)
    assert inspect_source(FinetuneConfig(source=work.int8)).meta["weights"] == "int8"  # LoRA is fine
