"""Tiny random HF models built in-process (no hub) and a calibration bundle for them."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

TINY = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)


def tiny_model(arch: str = "llama", seed: int = 0, **overrides):
    import transformers as tf

    torch.manual_seed(seed)
    cfg_cls, model_cls, extra = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        # head_dim 32 ≠ hidden / heads = 16
        "gemma": (tf.GemmaConfig, tf.GemmaForCausalLM, dict(head_dim=32)),
        # a sliding window shorter than the calibration sequences, so layer types really differ
        "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
                   dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
        "gemma3_text": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
                        dict(head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])),
        "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM,
                     dict(num_key_value_heads=None, rotary_pct=0.25, use_parallel_residual=True, attention_bias=True)),
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        # q/k norms per head; head_dim 32 ≠ hidden / heads = 16 (as Qwen3's real checkpoints)
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32)),
        # layer 1 skips RoPE (NoPE)
        "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM,
                    dict(no_rope_layers=[1, 0], pad_token_id=0, bos_token_id=1, eos_token_id=2)),
        # Granite 3.x-like multipliers, all far from 1 so a place that ignores one shows
        "granite": (tf.GraniteConfig, tf.GraniteForCausalLM,
                    dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.125,
                         logits_scaling=8.0)),
        # no pre-norms: post-norms on both blocks, q/k norms over the whole projection. A wider init than
        # 0.02: there the post-normed attention output (RMS 1) swamps the embeddings (RMS 0.02) and the
        # near-uniform attention makes every MLP input of a sequence about one running mean, so thresholds
        # rest on a dozen independent samples and the held-out F missed by 0.01-0.03
        "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM,
                  dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.1)),
        # mixtures of experts: 8 experts of 32 neurons, top 2 (transformers 5: stacked 3-D experts)
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                      dict(head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)),
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM,
                    dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32)),
        "olmoe": (tf.OlmoeConfig, tf.OlmoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)),
    }.get(arch, (None, None, None))
    if arch == "gemma3":
        return _tiny_gemma3_multimodal(**overrides)
    kw = {**TINY, **extra, **overrides}
    kw = {k: v for k, v in kw.items() if v is not None}  # None: drop the key (GPT-NeoX has no kv heads)
    cfg = cfg_cls(**kw)
    return model_cls(cfg).eval()


def _tiny_gemma3_multimodal(**overrides):
    """Gemma 3's multimodal wrapper around the tiny gemma3_text decoder, with a one-layer SigLIP tower
    (28 px images, 4 image tokens; the image-token ids sit at the top of the 128-token vocabulary)."""
    import transformers as tf

    text = {**TINY, "head_dim": 16, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    top = {k: overrides.pop(k) for k in ("tie_word_embeddings",) if k in overrides}
    text.update(overrides)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    vocab = text["vocab_size"]
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab - 1,
                          boi_token_index=vocab - 3, eoi_token_index=vocab - 2, **top)
    return tf.Gemma3ForConditionalGeneration(cfg).eval()


def perturbed_tiny_model(arch: str, **kw):
    """A tiny model whose norm scales and biases are far from their init, so a transform that folds
    or rotates around them is checked where they matter."""
    model = tiny_model(arch, **kw)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.copy_(torch.rand(p.shape, generator=g) * 1.5 + 0.25)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def tiny_calibration(n_fit: int = 48, n_heldout: int = 8, seq_len: int = 32, vocab: int = 128, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n_fit + n_heldout, seq_len), generator=g)
    return SimpleNamespace(fit=ids[:n_fit], heldout=ids[n_fit:])


def tiny_compress_config(**kw):
    from rana.compress import CompressConfig

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


def exported_logits(folder, ids: torch.Tensor, work, model_check: str = "") -> torch.Tensor:
    """Logits of an exported folder loaded by plain transformers (`trust_remote_code`, offline, a
    bare environment) in a fresh process; `model_check`: a Python statement on the loaded model
    `m`, run before the forward (e.g. an assert on its modules)."""
    script = ("import sys, json, torch; from transformers import AutoModelForCausalLM; "
              "m = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval(); "
              "ids = torch.tensor(json.loads(sys.argv[2]));\n"
              + (model_check + "\n" if model_check else "")
              + "with torch.no_grad(): print(json.dumps(m(ids).logits.tolist()))")
    proc = subprocess.run([sys.executable, "-c", script, str(folder), json.dumps(ids.tolist())],
                          capture_output=True, text=True, cwd=work, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                               "HF_MODULES_CACHE": str(Path(work) / "mods")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1]))


def one_line_error(res, *needles: str) -> str:
    """The command failed with a single `error:` line (no traceback) containing every needle."""
    assert res.exit_code not in (0, None), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output, res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    text = " ".join(res.output[res.output.index("error:"):].split())  # rich wraps long lines
    for needle in needles:
        assert needle in text, text
    return text
