"""rana.finetune on the adapter kinds beyond the paper's (issue 26): LoRA wraps the linear children of
R-Sparse's SparseLowRankLinear (side path included), leaves the input-sparse LM head (a weight of its
own, maybe the embedding's) and wina-ortho's RotatedInput (no weights) alone, --full trains them, and
the merged model keeps every adapter's decode layout, saves, reloads and decodes as its torch path.
Tiny random Llamas, CPU, offline."""
from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rana.accounting import metering
from rana.compress import CompressConfig, compress_model
from rana.finetune import FinetuneConfig, FinetuneError, Trainer, finetune, resolve_lora_targets
from rana.finetune.checkpoints import CheckpointFolder
from rana.finetune.data import prepare_blocks
from rana.finetune.source import inspect_source, probe_tokenizer
from rana.finetune.targets import merge_trained
from rana.finetune.trainer import make_accelerator
from rana.io import load, save
from rana.modules import (InputSparseExperts, InputSparseHead, InputSparseLinear, NeuronThresholdLinear, RotatedInput,
                          SparseLowRankLinear)
from rana.modules.common import restore_layouts

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
# the linear children LoRA must wrap, per adapter kind these folders hold (written out here, not taken from
# rana.finetune.targets, so a kind it forgets shows); RotatedInput and InputSparseHead: none
LORA_CHILDREN = {SparseLowRankLinear: ("linear", "side_in", "side_out"), InputSparseLinear: ("linear",),
                 NeuronThresholdLinear: ("linear",)}
NO_LINEARS = (RotatedInput, InputSparseHead)


def _compress(model, method: str):
    """`method` at F = 0.6 with the LM head adapted (InputSparseHead)."""
    ids = torch.randint(0, 128, (20, 32), generator=torch.Generator().manual_seed(1))
    cfg = CompressConfig(model="x", method=method, flops=0.6, calib_tokens=512, seq_len=32, batch_size=4,
                         search_tokens=128, fit_sample_tokens=256, lm_head="sparse")
    return compress_model(model, None, cfg, SimpleNamespace(fit=ids[:16], heldout=ids[16:]))


def _low_rank(model) -> None:
    """Random weights are full-rank; rank-2 q / up / down make R-Sparse's side path pay (it is then taken)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            for w in (layer.mlp.up_proj.weight, layer.mlp.down_proj.weight, layer.self_attn.q_proj.weight):
                w.copy_(torch.linalg.svd(w, full_matrices=False).U[:, :2] @ torch.randn(2, w.shape[1], generator=g))


@pytest.fixture(scope="module")
def work(tmp_path_factory, one_thread):
    """Two compressed folders: `rsparse` (SparseLowRankLinear beside InputSparseLinear, an untied adapted
    head) and `wina` (wina-ortho: RotatedInput norms, NeuronThresholdLinear, a tied adapted head)."""
    root = tmp_path_factory.mktemp("ft_all")
    torch.manual_seed(0)
    untied = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=False)).eval()
    _low_rank(untied)
    tied = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=True)).eval()
    for name, model, method in (("rsparse", untied, "rsparse"), ("wina", tied, "wina-ortho")):
        result = _compress(model, method)
        save(result.model, None, root / name, plan=result.plan)
    g = torch.Generator().manual_seed(2)
    torch.save(torch.randint(0, 128, (3000,), generator=g), root / "train.pt")
    return SimpleNamespace(root=root, rsparse=str(root / "rsparse"), wina=str(root / "wina"), data=str(root / "train.pt"))


def cfg(work, folder: str, **kw) -> FinetuneConfig:
    """Four LoRA steps (r 4) of 4 × 32 tokens on `folder`, no LAuReL."""
    base = dict(source=getattr(work, folder), data=work.data, tokens=4 * 4 * 32, seq_len=32, batch_size=4, lr=1e-3,
                laurel="none", lora_r=4, eval_tokens=32 * 4, save_every=0, eval_every=4)
    return FinetuneConfig(**{**base, **kw})


def trainer(config: FinetuneConfig) -> Trainer:
    """A Trainer built from public parts the way finetune() builds one (no folder is created)."""
    source = inspect_source(config)
    accelerator = make_accelerator(config)
    blocks = prepare_blocks(config, *probe_tokenizer(source, config))
    return Trainer(config, source, *blocks, accelerator, CheckpointFolder(config, accelerator))


def expected_targets(model) -> set[str]:
    kinds = {type(m) for m in model.modules() if isinstance(m, tuple(LORA_CHILDREN) + NO_LINEARS)}
    assert kinds, "the folder holds no adapters"
    return {f"{n}.{c}" for n, m in model.named_modules() for c in LORA_CHILDREN.get(type(m), ())
            if math.prod(m.get_submodule(c).weight.shape) > 0}


def _batch(seed=3):
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(seed))


def assert_decode_layouts(model) -> None:
    """Masked linears (the side path's too) and an untied head column-major; a tied head the embedding's
    own row-major Parameter."""
    for name, m in model.named_modules():
        for c in LORA_CHILDREN.get(type(m), ()):
            assert m.get_submodule(c).weight.t().is_contiguous(), f"{name}.{c}"
        if isinstance(m, InputSparseHead):
            if m.weight is model.get_input_embeddings().weight:
                assert m.weight.is_contiguous(), name
            else:
                assert m.weight.t().is_contiguous(), name


def assert_reloads_and_decodes(folder: Path, merged) -> None:
    """The saved folder gives the merged model's logits; one decode token (the masked-GEMV path) gives
    what the masked torch path (metering on) gives."""
    loaded, _ = load(folder)
    assert_decode_layouts(loaded)
    x = _batch(6)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, merged(input_ids=x).logits, atol=1e-5, rtol=1e-5)
        token = x[:1, :1]
        fast = loaded(input_ids=token).logits
        with metering(loaded):
            slow = loaded(input_ids=token).logits
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-4)


def test_the_folders_hold_the_kinds_under_test(work):
    rs, _ = load(work.rsparse)
    assert any(isinstance(m, SparseLowRankLinear) and m.rank > 0 for m in rs.modules())
    assert isinstance(rs.lm_head, InputSparseHead) and rs.lm_head.weight is not rs.get_input_embeddings().weight
    wo, _ = load(work.wina)
    assert sum(isinstance(m, RotatedInput) for m in wo.modules()) == 2 * SMALL["num_hidden_layers"]
    assert isinstance(wo.lm_head, InputSparseHead) and wo.lm_head.weight is wo.get_input_embeddings().weight


@pytest.mark.parametrize("folder", ["rsparse", "wina"])
def test_lora_wraps_every_adapters_linear_children(work, folder):
    model, _, info = trainer(cfg(work, folder)).build_model()
    base = model.get_base_model()
    want = expected_targets(base)
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == want and info.lora_targets == len(want)
    if folder == "rsparse":  # the side path's both factors, not only the masked weight
        assert any(n.endswith(".side_in") for n in wrapped) and any(n.endswith(".side_out") for n in wrapped)
    # the head (a bare parameter) and the rotations (buffers) are frozen; only LoRA factors train
    assert {n for n, p in base.named_parameters() if p.requires_grad} == {
        n for n, _ in base.named_parameters() if "lora_" in n}


def test_lora_target_names_reach_side_paths_and_refuse_the_head(work):
    model, _ = load(work.rsparse)
    ups = resolve_lora_targets(model, "up_proj")
    assert set(ups) == {n for n in expected_targets(model) if ".up_proj." in n}
    assert any(n.endswith("up_proj.side_in") for n in ups)
    with pytest.raises(FinetuneError, match="InputSparseHead.*--full"):
        resolve_lora_targets(model, "lm_head")


def test_adapters_without_linears_are_named_in_the_error(work):
    torch.manual_seed(0)
    cats = _compress(LlamaForCausalLM(LlamaConfig(**SMALL)).eval(), "cats").model
    with pytest.raises(FinetuneError, match=r"adapters \(CatsActivation, InputSparseHead\) hold no linear layers"):
        resolve_lora_targets(cats, "adapters")


@pytest.mark.parametrize("folder", ["rsparse", "wina"])
def test_lora_finetune_merges_saves_and_reloads(work, folder, tmp_path):
    source, _ = load(getattr(work, folder))
    out = tmp_path / "out"
    r = finetune(cfg(work, folder, out=str(out)))
    merged = r.model
    want = expected_targets(source)
    assert r.summary["lora_target_modules"] == len(want)
    for name in want:  # each wrapped child trained, its LoRA merged in
        assert not torch.equal(merged.get_submodule(name).weight, source.get_submodule(name).weight), name
    assert torch.equal(merged.lm_head.weight, source.lm_head.weight)  # not a LoRA target
    for (n, a), (_, b) in zip(merged.named_buffers(), source.named_buffers()):
        if n.endswith("rotation"):
            assert torch.equal(a, b), n
    assert_decode_layouts(merged)
    assert_reloads_and_decodes(out, merged)


def test_full_finetune_trains_the_tied_head_and_rotated_norms(work, tmp_path):
    source, _ = load(work.wina)
    out = tmp_path / "out"
    merged = finetune(cfg(work, "wina", full=True, out=str(out))).model
    emb = merged.get_input_embeddings().weight
    assert merged.lm_head.weight is emb and not torch.equal(emb, source.get_input_embeddings().weight)
    rotated = [n for n, m in merged.named_modules() if isinstance(m, RotatedInput)]
    for n in rotated:  # the wrapped norm trains, the rotation (a buffer) does not
        assert not torch.equal(merged.get_submodule(n).norm.weight, source.get_submodule(n).norm.weight), n
        torch.testing.assert_close(merged.get_submodule(n).rotation, source.get_submodule(n).rotation, rtol=0, atol=0)
    assert_decode_layouts(merged)
    assert_reloads_and_decodes(out, merged)


@pytest.mark.parametrize("folder", ["rsparse", "wina"])
def test_merge_restores_layouts_a_loader_handed_back_row_major(work, folder):
    """The merge of a sharded run reloads a state dict, and peft may hand back new tensors: every masked
    weight given row-major comes back column-major, a tied head stays the embedding's (row-major)."""
    model, _ = load(getattr(work, folder))
    ref_x = _batch(7)
    with torch.no_grad():
        ref = model(input_ids=ref_x).logits
    for m in model.modules():
        for c in LORA_CHILDREN.get(type(m), ()):
            w = m.get_submodule(c).weight
            w.data = w.data.contiguous()
    head = model.lm_head.weight
    head.data = head.data.contiguous()
    merged = merge_trained(model, gradient_checkpointing=False)
    assert_decode_layouts(merged)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ref_x).logits, ref, rtol=1e-5, atol=1e-6)


def test_restore_layouts_makes_stacked_experts_input_major():
    """InputSparseExperts' own 3-D weights ([E, out, in]) back to contiguous [E, in, out], values kept."""
    g = torch.Generator().manual_seed(5)
    off = torch.full((4,), -math.inf)
    experts = InputSparseExperts(torch.randn(4, 16, 8, generator=g), torch.randn(4, 8, 8, generator=g), "silu", off,
                                 off.clone(), 2)
    values = {}
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        p.data = p.data.contiguous()  # row-major, as a loader may hand it back
        values[name] = p.detach().clone()
    restore_layouts(experts)
    for name, v in values.items():
        p = getattr(experts, name)
        assert p.transpose(1, 2).is_contiguous() and torch.equal(p, v), name
