"""What every measurement shares: where a model's inputs go, eval mode for the time of a
measurement, and the progress callback the commands pass in."""
from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager

import torch

# `progress(what, done, total)`: the CLI passes a rich bar, the library reports through it
Progress = Callable[[str, int, "int | None"], None]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where inputs must go: the device of the model's first parameter (input embeddings)."""
    return next(model.parameters()).device


@contextmanager
def eval_mode(model: torch.nn.Module):
    """Run in eval mode (no dropout) and restore the caller's train/eval state afterwards."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
