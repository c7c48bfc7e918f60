"""Where a fine-tuning run's model comes from: the source (a rana folder, or a dense checkpoint when
everything or chosen dense layers train), its weights, its tokenizer, and the dense model a self-guided
start mixes in.

Models are opened with `rana.io.models.open` (the one way to open a model); this module decides only
what fine-tuning opens and which tokenizer it uses.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from ..io import check_folder, is_rana_dir, read_meta, read_plan
from ..io import load as load_rana
from ..io.models import dense_reference as compressed_from
from ..io.models import load_tokenizer
from ..io.models import open as open_model
from .config import FinetuneConfig, FinetuneError


@dataclass
class Source:
    kind: str  # "rana" | "dense"
    path: str
    meta: dict  # rana_config.json ({} for a dense checkpoint)
    plan: dict | None  # plan.json (None for a dense checkpoint)
    save_dtype: torch.dtype  # the dtype the fine-tuned folder is written in


def inspect_source(config: FinetuneConfig) -> Source:
    """What `config.source` is, read without loading weights; a rana folder is checked whole here."""
    src = os.path.expanduser(config.source)
    if is_rana_dir(src):
        check_folder(src)  # schema, index and headers: one line before any work
        meta, plan = read_meta(Path(src)), read_plan(src)
        if meta.get("weights", "none") == "int8" and config.full:
            # LoRA on the frozen int8 base works (rana.finetune.int8_lora); the codes themselves cannot train
            raise FinetuneError(
                f"'{config.source}' holds int8 weights: --full cannot train them (int8 codes have no gradient); "
                "fine-tune it with LoRA (merged back by requantizing), or --full on the full-precision folder it "
                "was quantized from, then `rana quantize DIR --weights int8 --out DIR2`")
        return Source("rana", src, meta, plan, getattr(torch, meta.get("dtype", "float32")))
    if not config.full and config.lora_targets in (None, "adapters"):
        raise FinetuneError(
            f"'{config.source}' is a dense checkpoint, not a rana folder (no rana_config.json): there are no RaNA "
            "adapters to fine-tune. Compress it first (`rana compress MODEL --out DIR`) and fine-tune DIR, or fine-tune "
            "the dense model itself with --full (all weights) or --lora-targets all|q_proj,v_proj,... (LoRA)")
    return Source("dense", src, {}, None, torch.float32)


def load_source(source: Source, config: FinetuneConfig):
    """(model, tokenizer or None) in `config.dtype`; the tokenizer from `config.tokenizer` when the source has none
    (a rana folder's own tokenizer only: not its dense reference's, which `open` would fall back to)."""
    if source.kind == "rana":
        model, tokenizer = load_rana(source.path, dtype=config.dtype)
    else:
        model, tokenizer = load_dense(source.path, config.dtype)
    if tokenizer is None and config.tokenizer is not None:
        tokenizer = load_tokenizer(config.tokenizer)
    return model, tokenizer


def load_dense(reference: str, dtype: str = "float32"):
    """(model, tokenizer or None) for a dense checkpoint; a missing tokenizer is fine here
    (pre-tokenised data needs none)."""
    opened = open_model(reference, dtype=dtype, dense=True, require_tokenizer=False)
    return opened.model, opened.tokenizer


def probe_tokenizer(source: Source, config: FinetuneConfig):
    """(tokenizer or None, vocab size) without loading the weights."""
    tok, vocab = None, None
    if config.tokenizer is not None:
        tok = load_tokenizer(config.tokenizer)
    if source.kind == "rana":
        path = Path(source.path)
        vocab = getattr(AutoConfig.from_pretrained(path, trust_remote_code=False), "vocab_size", None)
        if tok is None and (path / "tokenizer_config.json").exists():
            tok = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    elif tok is None:
        needs_text = not all(str(s).endswith((".pt", ".npy")) for s in (config.data, config.eval_data) if s is not None) \
            or config.data is None
        if needs_text:
            tok = load_tokenizer(source.path)
    if vocab is None and tok is not None:
        vocab = len(tok)
    return tok, vocab


def dense_reference(source: Source, config: FinetuneConfig) -> str | None:
    """The dense model the source was compressed from: --dense-model, else what plan.json names."""
    if config.dense_model is not None:
        return config.dense_model
    return compressed_from(source.plan, source.meta) if source.kind == "rana" else None
