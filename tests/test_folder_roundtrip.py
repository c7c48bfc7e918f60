"""Every registered method × every adapter kind: save → `rana.load` gives the in-memory model's logits.

The property behind issue 27's root cause 1 (a side-path folder `rana compress` wrote and the
loader refused): whatever any method writes loads back, prefill and one decode token. The cases
are tiny llama models whose up/down/q projections are low-rank (so side paths and rank adapters
pay), plus the adapter kinds a plain llama does not give: the adapted LM head (tied and untied)
and a fused-qkv architecture's rank adapter. The last test checks that the cases cover every
registered adapter kind, and one rsparse side-path folder goes through `rana export` too.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import rana
import rana.io as rio
from helpers import exported_logits, tiny_calibration, tiny_compress_config, tiny_model
from rana.compress import compress_model
from rana.io.format import ModelLoadError
from rana.methods import names
from rana.modules.registry import ADAPTER_KINDS

pytestmark = pytest.mark.usefixtures("one_thread")

SEEN_KINDS: set[str] = set()  # adapter kinds the cases wrote (checked by the last test)


def low_rank(model):
    """Make up/down/q rank 2 (or the fused qkv's first rows): a side path and a rank adapter pay there."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and any(k in name for k in ("up_proj", "down_proj", "q_proj", "query_key_value")):
                p.copy_(torch.linalg.svd(p, full_matrices=False).U[:, :2] @ torch.randn(2, p.shape[1], generator=g))
    return model


# (method, arch, compress settings, model settings): every registered method once, then the kinds a plain
# llama does not give
CASES = [(m, "llama", {}, {}) for m in names()] + [
    ("rana", "llama", {"lm_head": "sparse"}, {"vocab_size": 1024, "tie_word_embeddings": True}),
    ("teal", "qwen2", {"lm_head": "sparse"}, {"vocab_size": 1024, "tie_word_embeddings": False}),
    ("rana", "gpt_neox", {}, {}),
    ("rana", "mixtral", {}, {}),  # a mixture of experts' stacked experts (moe_input_sparse)
    # Gemma 3's multimodal wrapper, untied: its text config still asks for tied embeddings (the head must be saved)
    ("rana", "gemma3", {}, {"tie_word_embeddings": False}),
]


def _id(case) -> str:
    method, arch, cfg, _ = case
    return "-".join([method, arch, *(f"{k}={v}" for k, v in cfg.items())])


def _compress(tmp_path, method, arch, cfg, model_kw):
    vocab = model_kw.get("vocab_size", 128)
    model = low_rank(tiny_model(arch, **model_kw))
    config = tiny_compress_config(method=method, flops=0.7, **cfg)
    result = compress_model(model, None, config, tiny_calibration(vocab=vocab))
    folder = rio.save(result.model, None, tmp_path / "folder", plan=result.plan,
                      extra={"method": method, "compress_config": config.to_dict()})
    return result.model.eval(), folder, vocab


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_every_method_round_trips(tmp_path, case):
    model, folder, vocab = _compress(tmp_path, *case)
    SEEN_KINDS.update(a["type"] for a in rio.read_meta(folder)["adapters"])
    loaded, _ = rana.load(folder)
    assert [type(m).__name__ for m in loaded.modules()] == [type(m).__name__ for m in model.modules()]
    prompt = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(loaded(prompt).logits, model(prompt).logits, rtol=1e-5, atol=1e-5)
        # one decode token: the masked-GEMV paths, rebuilt with their recorded sparsity bins
        torch.testing.assert_close(loaded(prompt[:1, :1]).logits, model(prompt[:1, :1]).logits, rtol=1e-5, atol=1e-5)
    again = rio.save(loaded, None, tmp_path / "again", plan=rio.read_plan(folder))  # what it read, it writes alike
    assert rio.read_meta(again)["adapters"] == rio.read_meta(folder)["adapters"]


def test_the_cases_cover_every_adapter_kind():
    if len(SEEN_KINDS) == 0:
        pytest.skip("run with the round-trip cases")
    assert SEEN_KINDS == set(ADAPTER_KINDS), f"never written: {sorted(set(ADAPTER_KINDS) - SEEN_KINDS)}"


def test_side_path_folder_exports(tmp_path):
    """One export (a fresh process without rana) of an rsparse folder with side paths."""
    from rana.export import export

    model, folder, vocab = _compress(tmp_path, "rsparse", "llama", {}, {})
    assert any(a["type"] == "sparse_lowrank" for a in rio.read_meta(folder)["adapters"])
    export(folder, tmp_path / "hf")
    prompt = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(6))
    got = exported_logits(tmp_path / "hf", prompt, tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(got, model(prompt).logits, rtol=1e-4, atol=1e-4)


def test_a_folder_without_the_head_its_model_does_not_tie_is_refused(tmp_path):
    # folders written before 5e0bab4 left out an untied Gemma 3 wrapper's head: one line, never a random head
    _, folder, _ = _compress(tmp_path, "rana", "gemma3", {}, {"tie_word_embeddings": False})
    weights = folder / "model.safetensors"
    save_file({k: v for k, v in load_file(weights).items() if k != "lm_head.weight"}, weights, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"1 tensors of the model were not loaded \(e.g. lm_head.weight\)") as e:
        rana.load(folder)
    assert "\n" not in str(e.value)
