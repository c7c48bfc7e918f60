"""--self-guided-frac on a folder whose adapters the self-guided start does not hook: refused in one line
before anything is written (it used to train with no guidance and no warning); a RaNA folder still hooks
its rank adapters and masked linears."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rana.finetune import FinetuneConfig, FinetuneError, Trainer, finetune
from rana.finetune.checkpoints import CheckpointFolder
from rana.finetune.data import prepare_blocks
from rana.finetune.source import inspect_source, probe_tokenizer
from rana.finetune.trainer import make_accelerator
from rana.io import load, save
from rana.modules import (CatsActivation, InputSparseLinear, NeuronThresholdLinear, RankAdapterLinear,
                          RankSliceLinear)

from test_finetune import SMALL, _compress  # the tiny Llama and its compression, shared

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

# what the self-guided start blends with a dense path, written out here (not taken from
# rana.finetune.guidance) so that a kind it stops hooking shows
HOOKED = (RankAdapterLinear, RankSliceLinear, NeuronThresholdLinear, InputSparseLinear)


@pytest.fixture(scope="module")
def work(tmp_path_factory, one_thread):
    """A `cats` folder (CatsActivation only), a `rana-paper` folder (rank adapters + thresholded down
    proj), the dense original of the latter, and pre-tokenised data."""
    root = tmp_path_factory.mktemp("self_guided")
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    dense.save_pretrained(root / "dense")
    for name, method in (("rana", "rana-paper"), ("cats", "cats")):
        result = _compress(LlamaForCausalLM.from_pretrained(root / "dense").eval(), method)
        save(result.model, None, root / name, plan=result.plan)
    torch.save(torch.randint(0, 128, (3000,), generator=torch.Generator().manual_seed(2)), root / "train.pt")
    return SimpleNamespace(root=root, rana=str(root / "rana"), cats=str(root / "cats"), dense=str(root / "dense"),
                           data=str(root / "train.pt"))


def cfg(work, folder: str, **kw) -> FinetuneConfig:
    base = dict(source=getattr(work, folder), data=work.data, tokens=4 * 4 * 32, seq_len=32, batch_size=4, lr=1e-3,
                laurel="none", lora_r=4, eval_tokens=32 * 4, save_every=0, eval_every=4, self_guided_frac=0.5)
    return FinetuneConfig(**{**base, **kw})


def test_a_folder_with_no_hooked_adapter_is_refused_before_anything_is_written(work, tmp_path):
    model, _ = load(work.cats)
    kinds = {type(m) for m in model.modules() if isinstance(m, (CatsActivation, *HOOKED))}
    assert kinds == {CatsActivation}  # the folder under test: adapters, none of them hooked
    out = tmp_path / "out"
    # --full: a cats folder has no linears for LoRA, which build_model refuses before guidance is set up
    with pytest.raises(FinetuneError) as err:
        finetune(cfg(work, "cats", full=True, out=str(out)))
    msg = str(err.value)
    assert "\n" not in msg
    assert "--self-guided-frac" in msg and work.cats in msg
    assert f"CatsActivation ×{SMALL['num_hidden_layers']}" in msg  # what the folder holds
    assert all(c.__name__ in msg for c in HOOKED)  # what the self-guided start needs
    assert not out.exists() and list(tmp_path.iterdir()) == []  # no output folder, no checkpoint folder left


def test_the_same_folder_trains_without_self_guidance(work, tmp_path):
    # the refusal above is about self-guidance, not about the folder: with it off the run completes
    out = tmp_path / "out"
    r = finetune(cfg(work, "cats", full=True, self_guided_frac=0.0, out=str(out)))
    assert r.summary["status"] == "completed" and out.is_dir()


def test_a_rana_folder_hooks_its_rank_adapters_and_masked_linears(work):
    config = cfg(work, "rana", dense_model=work.dense)
    source = inspect_source(config)
    accelerator = make_accelerator(config)
    trainer = Trainer(config, source, *prepare_blocks(config, *probe_tokenizer(source, config)), accelerator,
                      CheckpointFolder(config, accelerator))  # as finetune() builds it; no folder is created
    model, _, _ = trainer.build_model()
    base = model.get_base_model()
    want = sum(isinstance(m, HOOKED) for m in base.modules())
    assert any(isinstance(m, (RankAdapterLinear, RankSliceLinear)) for m in base.modules())
    guide = trainer._self_guidance(model, total_steps=4, start_step=0)
    try:
        assert guide is not None and guide.sites == want > 0 and guide.active
    finally:
        guide.remove()
