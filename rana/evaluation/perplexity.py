"""Perplexity and the FLOPs measured while it runs.

Perplexity follows the common GPTQ/SparseGPT protocol so numbers compare across papers:
the documents of a held-out set joined into one stream, cut into non-overlapping windows
(incomplete tail dropped), mean NLL over every token of each window except the first.

Also here: reading an evaluation text into that stream (`eval_tokens`), the labels texts get
in tables and JSON (`text_name`, `text_labels`), and the FLOP blocks the adapters' meters
give during those passes (`summarize_flops`, `combine_flops`).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import Progress as ProgressBar

from ..data import eval_windows, load_texts, tokenize_stream
from .common import eval_mode, model_device

# --------------------------------------------------------------------------- perplexity


def window_nll(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed NLL of tokens 1.. of each window given (B, T, V) logits; float32 log-softmax."""
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for row_logits, row_ids in zip(logits, input_ids):  # one row at a time bounds float32 memory
        total += F.cross_entropy(row_logits[:-1].float(), row_ids[1:], reduction="sum").double()
    return total


def perplexity(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    *,
    seq_len: int = 512,
    batch_size: int = 4,
    progress: bool = True,
    on_batch: Callable[[torch.Tensor], None] | None = None,
) -> dict[str, Any]:
    """Perplexity of any HF causal LM on a 1-D token stream (see module docstring).

    `on_batch(input_ids)` is called after each forward pass, e.g. to tally FLOPs or
    tokens; any hooks or meters the caller has enabled on the model stay active.
    """
    windows = eval_windows(tokens, seq_len)
    device = model_device(model)
    total_nll = 0.0

    with eval_mode(model), torch.inference_mode(), ProgressBar(disable=not progress, transient=True) as bar:
        job = bar.add_task(f"perplexity ({len(windows)}×{seq_len})", total=len(windows))
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits
            total_nll += float(window_nll(logits, batch))
            if on_batch is not None:
                on_batch(batch)
            bar.advance(job, len(batch))
    n_pred = len(windows) * (seq_len - 1)
    nll = total_nll / n_pred
    return {
        "ppl": float(torch.tensor(nll).exp()),
        "nll": nll,
        "tokens": n_pred,
        "windows": len(windows),
        "seq_len": seq_len,
        "protocol": (
            f"non-overlapping {seq_len}-token windows of the joined stream (tail dropped); "
            f"mean NLL over all tokens but the first of each window"
        ),
    }


def ppl_protocol(seq_len: int, max_tokens: int | None) -> str:
    """The protocol of `rana eval` / `rana sweep` perplexities, in words (tables and JSON carry it)."""
    cap = f"the first {max_tokens} tokens of each text" if max_tokens else "each whole text"
    return (f"perplexity on {cap}: documents tokenised without special tokens and joined with EOS, cut into "
            f"non-overlapping {seq_len}-token windows (tail dropped), mean NLL over every token but the first of each "
            f"window; FLOPs metered on the same tokens, attention products at {seq_len}-token context")


# --------------------------------------------------------------------------- evaluation text


def text_name(source: str | Path) -> str:
    """A short label for an evaluation text: the file stem, or the dataset name."""
    s = str(source)
    p = Path(os.path.expanduser(s))
    if p.exists():
        return p.stem if p.is_file() else p.name
    return s.split(":")[0].rstrip("/").split("/")[-1]


def text_labels(sources: Sequence) -> list[str]:
    """One unique label per evaluation text, in order: `text_name` (`text<i>` for a token tensor),
    repeats numbered `name_2`, `name_3`, …"""
    labels, seen = [], set()
    for i, s in enumerate(sources):
        name = text_name(s) if not isinstance(s, torch.Tensor) else f"text{i}"
        base, k = name, 2
        while name in seen:
            name, k = f"{base}_{k}", k + 1
        seen.add(name)
        labels.append(name)
    return labels


def labelled_sources(ppl_sources) -> list[tuple[str, Any]]:
    """`ppl_sources` as (label, source) pairs: a {label: source} mapping as given; one source or a
    list of them labelled by `text_labels`."""
    if ppl_sources is None:
        return []
    if isinstance(ppl_sources, Mapping):
        return list(ppl_sources.items())
    if isinstance(ppl_sources, (str, Path, torch.Tensor)):
        ppl_sources = [ppl_sources]
    ppl_sources = list(ppl_sources)
    return list(zip(text_labels(ppl_sources), ppl_sources))


def _parse_source(source: str) -> tuple[str, str | None, str]:
    """`path` or `hub_name[:config[:split]]` (split defaults to test for evaluation)."""
    if Path(os.path.expanduser(source)).exists() or ":" not in source:
        return source, None, "test"
    name, _, rest = source.partition(":")
    config, _, split = rest.partition(":")
    return name, config or None, split or "test"


def eval_tokens(source: str | Path, tokenizer, *, max_tokens: int | None = None, text_column: str = "text") -> torch.Tensor:
    """The token stream of an evaluation text (`load_texts` + `tokenize_stream`, EOS between
    documents), truncated to its first `max_tokens` tokens when given."""
    name, config, split = _parse_source(str(source))

    def read(max_chars):
        texts = load_texts(name, config=config, split=split, text_column=text_column, max_chars=max_chars)
        return tokenize_stream(texts, tokenizer)

    if max_tokens is None:
        return read(None)
    tokens = read(16 * max_tokens + 1024)  # ~16 characters per token is generous for any tokenizer
    if tokens.numel() < max_tokens:
        tokens = read(None)
    return tokens[:max_tokens]


# --------------------------------------------------------------------------- FLOPs


def summarize_flops(measured: dict, tokens: int) -> dict:
    """`accounting.measured_macs` output → the reported FLOP block (fractions and GFLOPs/token)."""
    dense = measured["dense_macs"]
    by_part = {}
    for part, d in measured["by_part"].items():
        by_part[part] = {
            "fraction_of_part": d["fraction_of_part"],
            "gflops_per_token": 2 * d["measured_macs"] / 1e9,
            "dense_gflops_per_token": 2 * d["dense_macs"] / 1e9,
            "share_of_dense_total": d["measured_macs"] / dense,
        }
    return {
        "fraction": measured["fraction"],
        "gflops_per_token": measured["gflops_per_token"],
        "dense_gflops_per_token": measured["dense_gflops_per_token"],
        "measured_macs": measured["measured_macs"],
        "dense_macs": dense,
        "by_part": by_part,
        "tokens": int(tokens),
        "attention_context": measured.get("seq_len_for_attention"),
    }


def combine_flops(blocks: Sequence[dict]) -> dict:
    """Token-weighted average of per-text FLOP blocks. Every metered module sees every token,
    so this equals metering all the texts at once."""
    total = sum(b["tokens"] for b in blocks)
    w = [b["tokens"] / total for b in blocks]
    avg = lambda get: sum(wi * get(b) for wi, b in zip(w, blocks))  # noqa: E731
    first = blocks[0]
    out = {
        "fraction": avg(lambda b: b["fraction"]),
        "gflops_per_token": avg(lambda b: b["gflops_per_token"]),
        "dense_gflops_per_token": first["dense_gflops_per_token"],
        "measured_macs": avg(lambda b: b["measured_macs"]),
        "dense_macs": first["dense_macs"],
        "by_part": {},
        "tokens": total,
        "attention_context": first.get("attention_context"),
    }
    for part in first["by_part"]:
        out["by_part"][part] = {
            "fraction_of_part": avg(lambda b: b["by_part"][part]["fraction_of_part"]),
            "gflops_per_token": avg(lambda b: b["by_part"][part]["gflops_per_token"]),
            "dense_gflops_per_token": first["by_part"][part]["dense_gflops_per_token"],
            "share_of_dense_total": avg(lambda b: b["by_part"][part]["share_of_dense_total"]),
        }
    return out
