"""Perplexity and the FLOPs measured while it runs.

A perplexity protocol (`PplProtocol`) says how a text becomes scored tokens: how documents are
joined into one token stream, the window each forward pass sees, how far consecutive windows
advance and which tokens of a window are scored. Three presets (`PPL_PRESETS`):

- `rana` (default): documents tokenised without special tokens and joined with EOS,
  non-overlapping `seq_len`-token windows (512), every token but the first of each window scored.
- `gptq`: WikiText-2 as GPTQ / SparseGPT / Wanda score it: the dataset's rows joined with
  "\n\n" into one text, tokenised once with the tokenizer's default special tokens (a leading
  BOS where the tokenizer adds one), non-overlapping 2048-token windows, every token but the first
  of each window scored.
- `teal`: as TEAL's evaluation: every row followed by "\n\n", tokenised once with the default
  special tokens, windows of 2048 context + 512 scored tokens advanced by 512, so every scored
  token sees at least 2048 tokens before it; the first 2048 tokens of the text are context only.

Every preset drops the incomplete tail (no partial window is run) and reports exp(mean NLL) over
all scored tokens. For `gptq` / `teal` a row is a line of a .txt/.raw file (as the hub `wikitext`
dataset splits `wiki.test.raw`: each line with its newline, whitespace-only lines as empty rows),
a record of a .jsonl/.json/.parquet file or hub dataset (empty ones kept), so the local
`wiki.test.raw` and `wikitext:wikitext-2-raw-v1:test` give the same stream.

Also here: reading an evaluation text into that stream (`eval_tokens`, `protocol_tokens`), the
labels texts get in tables and JSON (`text_name`, `text_labels`), and the FLOP blocks the
adapters' meters give during those passes (`summarize_flops`, `combine_flops`).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from rich.progress import Progress as ProgressBar

from ..data import DataError, load_texts, tokenize_stream
from ..errors import UserError
from .common import eval_mode, model_device

# --------------------------------------------------------------------------- protocols


@dataclass(frozen=True)
class PplProtocol:
    """How a text becomes scored tokens (see the module docstring)."""

    name: str
    window: int  # tokens per forward pass; FLOPs count attention products at this context
    stride: int  # distance between the starts of consecutive windows
    scored: int  # tokens scored at the end of each window (window - 1: every token but the first)
    separator: str | None  # text between rows; None: EOS token between documents (no special tokens)
    terminate: bool = False  # the separator also follows the last row (TEAL)
    seq_len_given: bool = False  # --seq-len replaced the preset's window / context

    @property
    def context(self) -> int:
        """Tokens before the first scored token of a window."""
        return self.window - self.scored


def _rana(seq_len: int | None) -> PplProtocol:
    n = seq_len or 512
    return PplProtocol("rana", n, n, n - 1, None, seq_len_given=seq_len is not None)


def _gptq(seq_len: int | None) -> PplProtocol:
    n = seq_len or 2048
    return PplProtocol("gptq", n, n, n - 1, "\n\n", seq_len_given=seq_len is not None)


TEAL_SCORED = 512  # TEAL scores 512 tokens per window and advances by as many


def _teal(seq_len: int | None) -> PplProtocol:
    context = seq_len or 2048
    return PplProtocol("teal", context + TEAL_SCORED, TEAL_SCORED, TEAL_SCORED, "\n\n", terminate=True,
                       seq_len_given=seq_len is not None)


# name -> builder taking the --seq-len override (None: the preset's own length)
PPL_PRESETS: dict[str, Callable[[int | None], PplProtocol]] = {"rana": _rana, "gptq": _gptq, "teal": _teal}
PPL_PRESET_HELP = ("rana: EOS-joined documents, non-overlapping --seq-len windows (512) | gptq: WikiText-2 style, "
                   "rows joined with \"\\n\\n\", non-overlapping 2048-token windows | teal: 2048 tokens of context, "
                   "the next 512 scored, windows advanced by 512")


def ppl_preset(name: str, seq_len: int | None = None) -> PplProtocol:
    """The preset `name`; `seq_len` replaces its window length (`rana`, `gptq`) or context (`teal`)."""
    if name not in PPL_PRESETS:
        raise UserError(f"unknown --ppl-protocol {name!r}: choose one of {', '.join(PPL_PRESETS)}")
    if seq_len is not None and seq_len < 2:
        raise UserError(f"--seq-len must be at least 2, got {seq_len}")
    return PPL_PRESETS[name](seq_len)


def window_starts(n_tokens: int, protocol: PplProtocol) -> list[int]:
    """Start of every full window over an `n_tokens` stream (a partial tail window is never run)."""
    if n_tokens < protocol.window:
        return []
    return list(range(0, n_tokens - protocol.window + 1, protocol.stride))


def scored_positions(n_tokens: int, protocol: PplProtocol) -> torch.Tensor:
    """Stream positions of the scored tokens, in scoring order (one entry per prediction)."""
    offsets = torch.arange(protocol.context, protocol.window)
    starts = window_starts(n_tokens, protocol)
    if not starts:
        return torch.zeros(0, dtype=torch.long)
    return (torch.tensor(starts)[:, None] + offsets[None, :]).reshape(-1)


def protocol_windows(tokens: torch.Tensor, protocol: PplProtocol) -> torch.Tensor:
    """The (n_windows, window) token windows the protocol runs."""
    starts = window_starts(tokens.numel(), protocol)
    if not starts:
        return tokens.new_zeros((0, protocol.window))
    return torch.stack([tokens[s : s + protocol.window] for s in starts])


# --------------------------------------------------------------------------- perplexity


def window_nll(logits: torch.Tensor, input_ids: torch.Tensor, scored: int | None = None) -> torch.Tensor:
    """Summed NLL of the last `scored` tokens of each window (default: all but the first) given
    (B, T, V) logits; float32 log-softmax."""
    n = input_ids.shape[1]
    first = 1 if scored is None else n - scored
    total = torch.zeros((), dtype=torch.float64, device=logits.device)
    for row_logits, row_ids in zip(logits, input_ids):  # one row at a time bounds float32 memory
        total += F.cross_entropy(row_logits[first - 1 : -1].float(), row_ids[first:], reduction="sum").double()
    return total


def perplexity(
    model: torch.nn.Module,
    tokens: torch.Tensor,
    *,
    seq_len: int = 512,
    batch_size: int = 4,
    progress: bool = True,
    on_batch: Callable[[torch.Tensor], None] | None = None,
    protocol: PplProtocol | None = None,
) -> dict[str, Any]:
    """Perplexity of any HF causal LM on a 1-D token stream under `protocol` (a `ppl_preset`;
    default: `rana` with `seq_len`-token windows).

    `on_batch(input_ids)` is called after each forward pass, e.g. to tally FLOPs or
    tokens; any hooks or meters the caller has enabled on the model stay active.
    """
    proto = protocol if protocol is not None else _rana(seq_len)
    windows = protocol_windows(tokens, proto)
    if len(windows) == 0:
        raise DataError(f"{tokens.numel()} tokens are fewer than one {proto.window}-token window of the "
                        f"{proto.name} protocol; pass more text")
    device = model_device(model)
    total_nll = 0.0

    with eval_mode(model), torch.inference_mode(), ProgressBar(disable=not progress, transient=True) as bar:
        job = bar.add_task(f"perplexity ({len(windows)}×{proto.window})", total=len(windows))
        for start in range(0, len(windows), batch_size):
            batch = windows[start : start + batch_size].to(device)
            logits = model(input_ids=batch, use_cache=False).logits
            total_nll += float(window_nll(logits, batch, proto.scored))
            if on_batch is not None:
                on_batch(batch)
            bar.advance(job, len(batch))
    n_pred = len(windows) * proto.scored
    nll = total_nll / n_pred
    return {
        "ppl": float(torch.tensor(nll).exp()),
        "nll": nll,
        "tokens": n_pred,
        "windows": len(windows),
        "seq_len": proto.window,
        "stream_tokens": int(tokens.numel()),
        "ppl_protocol": proto.name,
        "protocol": window_rule(proto),
    }


def window_rule(protocol: PplProtocol) -> str:
    """The window part of a protocol, in words."""
    p = protocol
    if p.stride == p.window and p.scored == p.window - 1:
        return (f"non-overlapping {p.window}-token windows (tail dropped); mean NLL over every token but the first "
                f"of each window")
    return (f"{p.window}-token windows advanced by {p.stride} (tail dropped), the last {p.scored} tokens of each "
            f"scored ({p.context} tokens of context before the first; the first {p.context} tokens of the text are "
            f"context only); mean NLL over the scored tokens")


def _stream_rule(protocol: PplProtocol) -> str:
    if protocol.separator is None:
        return "documents tokenised without special tokens and joined with EOS"
    sep = protocol.separator.encode("unicode_escape").decode()
    how = f"every row followed by \"{sep}\"" if protocol.terminate else f"rows joined with \"{sep}\""
    return (f"{how} (a text file's rows are its lines, as the hub wikitext dataset has them) and tokenised once "
            f"with the tokenizer's default special tokens")


def ppl_protocol(protocol: PplProtocol | int, max_tokens: int | None) -> str:
    """The protocol of `rana eval` / `rana sweep` perplexities, in words (tables and JSON carry it);
    an int is the `rana` preset at that window length."""
    p = _rana(protocol) if isinstance(protocol, int) else protocol
    cap = (f"the first {max_tokens} tokens of each text" if max_tokens else "each whole text")
    given = ""
    if p.seq_len_given and p.name != "rana":
        default = PPL_PRESETS[p.name](None)
        given = (f", --seq-len {p.context if p.name == 'teal' else p.window} in place of the preset's "
                 f"{default.context if p.name == 'teal' else default.window}")
    return (f"{p.name} protocol{given}: perplexity on {cap}: {_stream_rule(p)}, cut into {window_rule(p)}; FLOPs "
            f"metered on every token of every window run, attention products at {p.window}-token context")


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


_LINE = re.compile(r"[^\n]*\n|[^\n]+\Z")  # one line with its newline; a last line without one


def text_rows(source: str | Path, *, text_column: str = "text") -> list[str]:
    """The rows the `gptq` / `teal` protocols join: a .txt/.raw file's lines split as the hub
    `wikitext` dataset splits `wiki.*.raw` (each line keeps its newline, whitespace-only lines
    become empty rows); the records of a .jsonl/.json/.parquet file or hub dataset, empty ones kept."""
    return _rows_read(source, text_column, None)[0]


def _rows_read(source: str | Path, text_column: str, max_chars: int | None) -> tuple[list[str], bool]:
    """(rows, whole): `text_rows` of the first `max_chars` characters only (whole: the source ended
    first; else the last row may be cut)."""
    name, config, split = _parse_source(str(source))
    path = Path(os.path.expanduser(name))
    if path.is_dir():
        raise DataError(f"{source} is a folder: the gptq and teal perplexity protocols join the rows of one file or "
                        "hub dataset; pass a file (e.g. wiki.test.raw)")
    read = path if path.is_file() else name
    rows = load_texts(read, config=None if path.is_file() else config, split=split, text_column=text_column,
                      keep_empty=True, max_chars=max_chars)
    whole = max_chars is None or sum(map(len, rows)) < max_chars
    if path.is_file() and path.suffix.lower() in (".txt", ".raw"):
        rows = [line if line.strip() else "" for doc in rows for line in _LINE.findall(doc)]
    return rows, whole


def _joined_prefix(source: str | Path, protocol: PplProtocol, chars: int, text_column: str) -> str:
    """The joined text, or (when longer) at least its first `chars` characters: rows are read until
    complete rows cover them (a cut last row is left out, so what is returned is a prefix of the
    whole joined text)."""
    read = 2 * chars
    while True:
        try:
            rows, whole = _rows_read(source, text_column, read)
        except DataError:  # only blank rows so far (or a bad file): read it all, failing as before if it fails
            rows, whole = _rows_read(source, text_column, None)
        done = rows if whole else rows[:-1]
        text = joined_text(done, protocol) if done else ""  # no complete row yet: no prefix either
        if whole or len(text) >= chars:
            return text
        read *= 2


def joined_text(rows: Sequence[str], protocol: PplProtocol) -> str:
    """One text from rows: joined by the protocol's separator (also after the last row for TEAL)."""
    text = protocol.separator.join(rows)
    return text + protocol.separator if protocol.terminate else text


def protocol_tokens(source: str | Path, tokenizer, protocol: PplProtocol, *, max_tokens: int | None = None,
                    text_column: str = "text") -> torch.Tensor:
    """The token stream `protocol` scores for an evaluation text: `eval_tokens` for `rana`; for the
    row-joining presets the joined text tokenised in one call with the tokenizer's default special
    tokens. Truncated to the first `max_tokens` tokens when given."""
    if protocol.separator is None:
        return eval_tokens(source, tokenizer, max_tokens=max_tokens, text_column=text_column)

    def encode(t: str) -> torch.Tensor:
        return torch.as_tensor(tokenizer(t, verbose=False)["input_ids"], dtype=torch.long)

    if max_tokens is None:
        return encode(joined_text(text_rows(source, text_column=text_column), protocol))
    cap = 16 * max_tokens + 1024  # ~16 characters per token is generous for any tokenizer
    text = _joined_prefix(source, protocol, cap, text_column)  # read only as far as the cap
    tokens = encode(text[:cap])
    if tokens.numel() < max_tokens:
        tokens = encode(joined_text(text_rows(source, text_column=text_column), protocol))
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
