"""Fine-tuning data: the training and held-out blocks, and the order the training blocks are walked in.

Data order is fixed by ``seed``: the training blocks are shuffled once per epoch (each epoch's
permutation drawn from ``seed`` and the epoch number when the loader reaches it), and the prepared
loader walks that sequence, so a resumed run only has to skip the batches already consumed.

The data is read only as far as the budget goes (`prepare_blocks`): the blocks the run walks plus the
largest held-out set, from the start of the source. A source no longer than that gives the blocks it
always gave (the held-out set is the tail of the stream); a longer one is a prefix of itself, so a
multi-GB file or a streamed hub dataset costs what the budget costs, not what the corpus does.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from ..data import DataError, load_token_ids, pack_blocks, read_tokens
from .config import FinetuneConfig


def token_stream(source: str | None, config: FinetuneConfig, tokenizer, vocab_size: int | None,
                 limit: int | None = None) -> torch.Tensor:
    """One 1-D stream from `source`: pre-tokenised ids (.pt/.npy) as they are, anything else read as
    text; with `limit`, only its first `limit` tokens are read (and tokenised)."""
    if source is not None:
        p = Path(os.path.expanduser(str(source)))
        if p.suffix in (".pt", ".npy"):
            if not p.is_file():
                raise DataError(f"token file not found: {source}")
            return load_token_ids(p, vocab_size, limit)
    if tokenizer is None:
        raise DataError("the model folder has no tokenizer to read text data with; pass --tokenizer (a model "
                        "folder, alias or hub id whose tokenizer to use) or pre-tokenised ids (.pt/.npy)")
    return read_tokens(source, tokenizer, limit=limit, config=config.dataset_config, split=config.split,
                       text_column=config.text_column)


def train_blocks_needed(config: FinetuneConfig, processes: int | None = None) -> int:
    """Blocks the run walks: every step takes batch × grad_accum × processes blocks, and the run takes
    ceil(tokens / tokens per step) steps (the trainer's arithmetic); a sweep walks a prefix of them."""
    if processes is None:  # what `accelerate launch` / torchrun give every process
        processes = int(os.environ.get("WORLD_SIZE", "1") or 1)
    per_step = config.batch_size * config.grad_accum * max(1, processes)
    return max(1, math.ceil(config.tokens / (per_step * config.seq_len))) * per_step


def prepare_blocks(config: FinetuneConfig, tokenizer, vocab_size,
                   processes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_blocks, heldout_blocks), each (n, seq_len), read from the data only as far as the budget goes.

    The data is the first `train_blocks_needed` + max-held-out blocks of the stream (all of it when it is
    shorter, which gives exactly the blocks an unbounded read gives); the held-out blocks are the tail of
    what was read. With --eval-data, the training data is the first `train_blocks_needed` blocks and the
    held-out set the first eval_tokens of the eval data."""
    seq_len = config.seq_len
    max_eval = max(1, config.eval_tokens // seq_len)
    need = train_blocks_needed(config, processes)
    if config.eval_data is not None:
        train = pack_blocks(token_stream(config.data, config, tokenizer, vocab_size, need * seq_len), seq_len)
        held = pack_blocks(token_stream(config.eval_data, config, tokenizer, vocab_size, max_eval * seq_len), seq_len)
        return train, held[:max_eval]
    stream = token_stream(config.data, config, tokenizer, vocab_size, (need + max_eval) * seq_len)
    n = stream.numel() // seq_len
    if n < 2:
        raise DataError(
            f"training data too short: {stream.numel()} tokens make {n} block(s) of --seq-len {seq_len}; "
            "need at least 2 (one to train on, one held out): pass more data, a smaller --seq-len, or --eval-data")
    blocks = pack_blocks(stream, seq_len)
    n_held = min(max(1, round(n * config.heldout_fraction)), max_eval, n - 1)
    return blocks[: n - n_held], blocks[n - n_held:]  # held-out = the tail of what was read


class OrderedBlocks(torch.utils.data.Dataset):
    """The whole run's sequence of training blocks: epoch after epoch, each a seeded shuffle.

    Item `i` is block `perm(i // n)[i % n]` of epoch `i // n`; the permutation is drawn when an
    epoch is first reached (one epoch's order is held at a time), so memory does not grow with
    the token budget."""

    def __init__(self, blocks: torch.Tensor, n_items: int, seed: int):
        self.blocks = blocks
        self.n_items = int(n_items)
        self.seed = int(seed)
        self.epochs = self.n_items / len(blocks)
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.blocks), generator=g)
        return self._perm

    def __len__(self) -> int:
        return self.n_items

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n_items:
            raise IndexError(i)
        epoch, pos = divmod(int(i), len(self.blocks))
        return self.blocks[self.permutation(epoch)[pos]]
