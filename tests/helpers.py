"""Tiny random HF models built in-process (no hub) and a calibration bundle for them."""
from __future__ import annotations

from types import SimpleNamespace

import torch

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
    }[arch]
    cfg = cfg_cls(**{**TINY, **overrides})
    return model_cls(cfg).eval()


def tiny_calibration(n_fit: int = 48, n_heldout: int = 8, seq_len: int = 32, vocab: int = 128, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_fit + n_heldout, seq_len), generator=g)
    return SimpleNamespace(fit=ids[:n_fit], heldout=ids[n_fit:])


def tiny_compress_config(**kw):
    from rana.config import CompressConfig

    base = dict(model="tiny", flops=0.7, calib_tokens=1792, seq_len=32, batch_size=4, search_tokens=128,
                fit_sample_tokens=256)
    return CompressConfig(**{**base, **kw})


def byte_tokenizer():
    """An offline byte-level tokenizer (256 bytes + <eos>): any text round-trips."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_model_dir(path, arch: str = "llama"):
    """A tiny random model + byte tokenizer saved as an ordinary HF folder."""
    model = tiny_model(arch, vocab_size=257)
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path
