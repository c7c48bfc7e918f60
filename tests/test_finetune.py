"""rana.finetune on tiny random models (offline, CPU): what trains, LoRA merge, resume, failures,
self-guided start, lr sweep, and a 2-process `accelerate launch` run of the CLI."""
from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from rana.compress import CompressConfig, compress_model
from rana.data import DataError
from rana.finetune import (CHECKPOINTS, FinetuneConfig, FinetuneError, NonFiniteLossError, Trainer,
                           adapter_linear_names, finetune, next_token_loss, resolve_lora_targets, sync_neuron_norms)
from rana.finetune.checkpoints import CheckpointFolder
from rana.finetune.data import prepare_blocks
from rana.finetune.source import inspect_source, probe_tokenizer
from rana.finetune.trainer import make_accelerator
from rana.io import load, save
from rana.units import parse_tokens
from rana.modules import NeuronThresholdLinear, RankAdapterLinear, SharedRankCode

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread is fastest

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _compress(model, method: str):
    ids = torch.randint(0, 128, (20, 32), generator=torch.Generator().manual_seed(1))
    cfg = CompressConfig(model="x", method=method, flops=0.7, calib_tokens=512, seq_len=32, batch_size=4,
                         search_tokens=128, fit_sample_tokens=256)
    return compress_model(model, None, cfg, SimpleNamespace(fit=ids[:16], heldout=ids[16:]))


@pytest.fixture(scope="module")
def work(tmp_path_factory, one_thread):
    """A compressed tiny Llama (the paper's RaNA: rank adapters + neuron-thresholded down proj), its dense
    original as an HF folder, and pre-tokenised data."""
    root = tmp_path_factory.mktemp("ft")
    torch.manual_seed(0)
    dense = LlamaForCausalLM(LlamaConfig(**SMALL)).eval()
    dense.save_pretrained(root / "dense")
    result = _compress(dense, "rana-paper")
    assert any(isinstance(m, RankAdapterLinear) for m in result.model.modules())
    assert any(isinstance(m, SharedRankCode) for m in result.model.modules())
    save(result.model, None, root / "rana", plan=result.plan)
    g = torch.Generator().manual_seed(2)
    torch.save(torch.randint(0, 128, (3000,), generator=g), root / "train.pt")
    torch.save(torch.randint(0, 128, (40,), generator=g), root / "short.pt")
    return SimpleNamespace(root=root, rana=str(root / "rana"), dense=str(root / "dense"), data=str(root / "train.pt"))


def cfg(work, **kw) -> FinetuneConfig:
    base = dict(source=work.rana, data=work.data, tokens=8 * 4 * 32, seq_len=32, batch_size=4, lr=1e-3,
                laurel="rw+lr", laurel_rank=4, lora_r=4, eval_tokens=32 * 4, save_every=0, eval_every=4)
    return FinetuneConfig(**{**base, **kw})


def trainer(config: FinetuneConfig, **kw) -> Trainer:
    """A Trainer built from public parts the way finetune() builds one (no folder is created)."""
    source = inspect_source(config)
    accelerator = make_accelerator(config)
    train_blocks, heldout_blocks = prepare_blocks(config, *probe_tokenizer(source, config))
    return Trainer(config, source, train_blocks, heldout_blocks, accelerator, CheckpointFolder(config, accelerator), **kw)


def _batch(seed=3):
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(seed))


def _perturb(model, seed=4):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))


# ------------------------------------------------------------------------------------------ config


def test_parse_tokens_and_config_roundtrip(work):
    assert parse_tokens("2M") == 2_000_000 and parse_tokens("500k") == 500_000 and parse_tokens("1.5e6") == 1_500_000
    assert parse_tokens("2_000") == 2000 and parse_tokens(300) == 300 and parse_tokens("1G") == 10**9
    for bad in ("two", "-1", "0", "2X"):
        with pytest.raises(ValueError):
            parse_tokens(bad)
    c = cfg(work, tokens="2M", sweep_lrs="1e-4,1e-3", out="/x/y")
    assert c.tokens == 2_000_000 and c.sweep_lrs == (1e-4, 1e-3)
    back = FinetuneConfig.from_json(c.to_json())
    assert back == c and back.config_hash() == c.config_hash()
    assert cfg(work, out="/elsewhere", save_every=3).config_hash() == cfg(work).config_hash()  # bookkeeping only
    assert cfg(work, lr=2e-3).config_hash() != cfg(work).config_hash()
    with pytest.raises(FinetuneError, match="laurel"):
        cfg(work, laurel="rw+xx").validate()
    with pytest.raises(FinetuneError, match="--full"):
        cfg(work, full=True, lora_targets="all").validate()


# ------------------------------------------------------------------------------------------ what trains


def test_lora_and_laurel_get_gradients_and_nothing_else(work):
    tr = trainer(cfg(work))
    model, _, info = tr.build_model()
    base = model.get_base_model()
    targets = set(resolve_lora_targets(base, "adapters"))
    assert targets and targets == set(adapter_linear_names(base))
    wrapped = {n.removeprefix("base_model.model.") for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == targets  # every adapter child, nothing else (o_proj, lm_head stay plain)
    _perturb(model)  # LoRA B and LAuReL's up start at zero: move them so every factor gets a gradient
    model.train()
    model(input_ids=_batch(), labels=_batch()).loss.backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or "laurel_" in n for n in trainable)
    assert any("laurel_" in n for n in trainable) and any("lora_" in n for n in trainable)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n
    assert info.laurel_params > 0 and info.trainable_params == info.lora_params + info.laurel_params

    # gradient checkpointing (non-reentrant) gives the same gradients through adapters and LAuReL
    tr2 = trainer(cfg(work, gradient_checkpointing=True))
    model2, _, _ = tr2.build_model()
    _perturb(model2)
    model2.train()
    model2(input_ids=_batch(), labels=_batch()).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    for n, p in model2.named_parameters():
        if p.requires_grad:
            assert torch.allclose(p.grad, grads[n], atol=1e-6, rtol=1e-4), n


def test_lora_target_choices(work):
    model, _ = load(work.rana)
    adapters = adapter_linear_names(model)
    everything = resolve_lora_targets(model, "all")
    assert set(adapters) < set(everything) and any(n.endswith("o_proj") for n in everything)
    assert not any("lm_head" in n or "embed" in n for n in everything)
    assert resolve_lora_targets(model, "o_proj,down_proj") == [
        n for n in everything if n.endswith("o_proj")] + [n for n in adapters if ".down_proj." in n]
    assert resolve_lora_targets(model, "none") == []
    with pytest.raises(FinetuneError, match="no linear or adapter module named 'nope'"):
        resolve_lora_targets(model, "nope")


def test_trainer_trains_with_the_loss_it_is_given(work):
    seen = []

    def counting(model, batch):
        seen.append(tuple(batch.shape))
        return next_token_loss(model, batch)

    tr = trainer(cfg(work, laurel="none", grad_accum=2), loss=counting)
    result = tr.run(1e-3, 3)
    assert result.status == "completed" and result.step == 3 and result.checkpoint is None
    assert seen == [(4, 32)] * 6  # 3 optimizer steps × 2 micro-batches, all through the given loss
    assert [r["step"] for r in tr.records] == [0, 1, 2, 3]  # the held-out score before step 1, then every step
    assert result.final_eval["tokens"] == len(tr.heldout_blocks) * 31
    assert result.final_eval["loss"] == pytest.approx(tr.records[-1]["heldout_loss"])
    assert result.trainables.peft and result.trainables.laurel is None


# ------------------------------------------------------------------------------------------ merge / save


def test_merged_lora_equals_unmerged(work):
    tr = trainer(cfg(work, lora_targets="all"))
    model, _, _ = tr.build_model()
    _perturb(model, seed=7)
    sync_neuron_norms(model)  # what each optimizer step does: masks follow the effective weight W + ΔW
    model.eval()
    x = _batch(5)
    with torch.no_grad():
        ref = model(input_ids=x).logits
    merged = tr.merge(model)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        got = merged(input_ids=x).logits
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for m in merged.modules():
        if isinstance(m, RankAdapterLinear):  # A column-major for the masked GEMV, B row-major (read whole)
            assert m.A.weight.t().is_contiguous() and m.B.weight.is_contiguous()
        if isinstance(m, NeuronThresholdLinear):  # norms follow the merged weight
            torch.testing.assert_close(m.column_norms, m.linear.weight.float().norm(dim=0))


def test_finetune_writes_a_loadable_rana_folder(work, tmp_path):
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(**SMALL)).eval()  # q/k/v biases; default method
    save(_compress(qwen, "rana").model, None, tmp_path / "q", plan={"config": {"model": "x"}})
    # merge is exact for this adapter mix too (input-sparse / neuron q, k, v, o with biases)
    tr = trainer(cfg(work, source=str(tmp_path / "q")))
    model, _, _ = tr.build_model()
    _perturb(model, seed=8)
    sync_neuron_norms(model)
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=_batch(9)).logits
        torch.testing.assert_close(tr.merge(model)(input_ids=_batch(9)).logits, ref, atol=1e-5, rtol=1e-5)

    out = tmp_path / "out"
    logs = []
    r = finetune(cfg(work, source=str(tmp_path / "q"), out=str(out), save_every=3), on_log=logs.append)
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "rana_config.json", "train_log.jsonl", "finetune.json", "plan.json"} <= files
    assert CHECKPOINTS not in files  # spent checkpoints go when the run finishes
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r_["step"] for r_ in log] == list(range(0, 9)) and log == logs
    assert {"step", "tokens", "loss", "lr", "tokens_per_s", "heldout_ppl"} <= set(log[-1])
    summary = json.loads((out / "finetune.json").read_text())
    assert summary["steps"] == 8 and summary["tokens_trained"] == 8 * 128 and summary["laurel"]["variant"] == "rw+lr"
    assert summary["heldout_ppl_after"] == pytest.approx(log[-1]["heldout_ppl"])
    meta = json.loads((out / "rana_config.json").read_text())
    assert meta["laurel"]["rank"] == 4 and meta["finetune"]["mode"] == "lora"
    loaded, _ = load(out)
    x = _batch(6)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, r.model(input_ids=x).logits, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="already exists"):
        finetune(cfg(work, source=str(tmp_path / "q"), out=str(out)))


# ------------------------------------------------------------------------------------------ resume


def test_resume_reproduces_uninterrupted_run(work, tmp_path):
    kw = dict(tokens=8 * 4 * 32, save_every=2, lora_dropout=0.1, eval_every=2)  # dropout: RNG must be restored too
    full = finetune(cfg(work, out=str(tmp_path / "a"), **kw))
    stopped = finetune(cfg(work, out=str(tmp_path / "b"), stop_after=5, **kw))
    assert stopped.summary["status"] == "stopped" and stopped.model is None and stopped.summary["steps"] == 5
    assert not (tmp_path / "b" / "model.safetensors").exists()
    with pytest.raises(FinetuneError, match="unfinished run"):
        finetune(cfg(work, out=str(tmp_path / "b"), **kw))
    with pytest.raises(FinetuneError, match=r"different run .*differs in: lr"):
        finetune(cfg(work, out=str(tmp_path / "b"), resume=True, lr=5e-4, **kw))
    resumed = finetune(cfg(work, out=str(tmp_path / "b"), resume=True, **kw))
    assert resumed.summary["resumed_from_step"] == 5
    a = [r for r in full.log if r["step"] > 0]
    b = [r for r in resumed.log if r["step"] > 0]
    assert [r["step"] for r in b] == list(range(1, 9))
    for ra, rb in zip(a, b):
        assert rb["loss"] == pytest.approx(ra["loss"], abs=1e-6), ra["step"]
        assert rb["lr"] == pytest.approx(ra["lr"], rel=1e-12)
        if "heldout_loss" in ra:
            assert rb["heldout_loss"] == pytest.approx(ra["heldout_loss"], abs=1e-6)
    for (n, p), (_, q) in zip(full.model.state_dict().items(), resumed.model.state_dict().items()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)


# ------------------------------------------------------------------------------------------ failures


def test_dense_checkpoint_needs_full_or_targets(work, tmp_path):
    with pytest.raises(FinetuneError, match="dense checkpoint.*--full"):
        finetune(cfg(work, source=work.dense, out=str(tmp_path / "o")))
    r = finetune(cfg(work, source=work.dense, full=True, laurel="none", tokens=2 * 128, lr=1e-4))
    assert r.summary["mode"] == "full" and r.summary["trainable_params"] == r.summary["total_params_while_training"]


def test_too_little_data(work, tmp_path):
    with pytest.raises(DataError, match="too short"):
        finetune(cfg(work, data=str(work.root / "short.pt")))
    with pytest.raises(DataError, match="need at least 64"):
        finetune(cfg(work, data=str(work.root / "short.pt"), seq_len=64, eval_data=work.data))


def test_nan_loss_stops_and_keeps_last_good_checkpoint(work, tmp_path):
    calls = {"n": 0}

    def flaky(model, batch):
        calls["n"] += 1
        loss = next_token_loss(model, batch)
        return loss * float("nan") if calls["n"] == 5 else loss

    out = tmp_path / "o"
    with pytest.raises(NonFiniteLossError, match=r"step 5 .*checkpoint-00000004"):
        finetune(cfg(work, out=str(out), save_every=2), loss=flaky)
    assert sorted(p.name for p in (out / CHECKPOINTS).glob("checkpoint-*")) == ["checkpoint-00000002", "checkpoint-00000004"]
    assert not (out / "model.safetensors").exists()
    assert "error" in (out / CHECKPOINTS / "train_log.jsonl").read_text().splitlines()[-1]


def test_cli_reports_nan_with_nonzero_exit(work, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    import rana.finetune as ft
    from rana.cli.app import app

    # the CLI has no loss option: the finetune() it calls gets one passed in
    nan_loss = lambda model, batch: model(input_ids=batch, labels=batch).loss * float("nan")  # noqa: E731
    monkeypatch.setattr(ft, "finetune", functools.partial(ft.finetune, loss=nan_loss))
    res = CliRunner().invoke(app, ["finetune", work.rana, "--data", work.data, "--tokens", "512", "--seq-len", "32",
                                   "--out", str(tmp_path / "o")])
    assert res.exit_code == 3, res.output
    assert "loss became nan at step 1" in res.output.replace("\n", " ")
    res = CliRunner().invoke(app, ["finetune", work.dense, "--data", work.data, "--out", str(tmp_path / "d")])
    assert res.exit_code == 2 and "dense checkpoint" in res.output


# ------------------------------------------------------------------------------------------ self-guided / sweep


def test_self_guided_start_begins_at_the_dense_model(work):
    logs = []
    r = finetune(cfg(work, self_guided_frac=0.5, dense_model=work.dense, laurel="none", eval_every=1), on_log=logs.append)
    # α = 1 at step 0 routes every adapted projection through its dense weight: the dense model's loss
    dense = LlamaForCausalLM.from_pretrained(work.dense).eval()
    _, heldout = prepare_blocks(cfg(work), None, 128)
    with torch.no_grad():
        ref = dense(input_ids=heldout, labels=heldout).loss.item()
    assert r.summary["heldout_loss_before"] == pytest.approx(ref, abs=1e-5)
    alphas = [x["alpha"] for x in logs if "alpha" in x]
    assert alphas[0] == 1.0 and alphas == sorted(alphas, reverse=True) and len(alphas) == 5  # 4 steps + step 0
    assert not any(m._forward_hooks for m in r.model.modules() if isinstance(m, RankAdapterLinear))
    with pytest.raises(FinetuneError, match="dense weights of the original model 'x'"):
        finetune(cfg(work, self_guided_frac=0.5))  # plan.json names model "x": not loadable


def test_lr_sweep_keeps_best(work):
    seen = []
    r = finetune(cfg(work, lr_sweep=True, sweep_lrs=(1e-6, 1e-2), sweep_frac=0.5, laurel="none"), on_log=seen.append)
    sweep = r.summary["lr_sweep"]
    assert [s["lr"] for s in sweep] == [1e-6, 1e-2] and all(s["steps"] == 4 for s in sweep)
    assert r.summary["lr"] == min(sweep, key=lambda s: s["heldout_loss"])["lr"]
    assert sum("sweep" in x for x in seen) == 2


# ------------------------------------------------------------------------------------------ CLI, 2 processes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_two_processes_accelerate_launch(work, tmp_path):
    """`accelerate launch` with 2 CPU processes (DDP over gloo). accelerate's `--cpu` launcher starts a single
    process unless MPI is set up, so the multi-process launcher is used; rana.finetune turns on CPU mode
    itself when several processes find no GPU (ACCELERATE_USE_CPU makes it explicit)."""
    out = tmp_path / "out"
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()), "-m", "rana.cli", "finetune", work.rana,
           "--data", work.data, "--tokens", "1k", "--seq-len", "32", "--batch-size", "2", "--laurel", "rw+lr",
           "--laurel-rank", "4", "--lora-r", "4", "--lr", "1e-3", "--eval-tokens", "128", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "finetune.json").read_text())
    assert summary["num_processes"] == 2 and summary["distributed_type"] == "MULTI_CPU"
    assert summary["tokens_per_step"] == 2 * 2 * 32 and summary["steps"] == 8
    assert "held-out ppl after" in proc.stdout
    model, _ = load(out)
    assert model.model.layers[0].laurel_attn.up.abs().sum() > 0  # LAuReL trained and saved
