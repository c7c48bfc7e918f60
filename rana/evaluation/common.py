"""What every measurement shares: where a model's inputs go and eval mode for the time of a
measurement."""
from __future__ import annotations

from contextlib import contextmanager

import torch


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
