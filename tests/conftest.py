"""Test-wide settings: offline hub, Triton interpreter before any kernel is defined."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Tests that pin torch to one thread must not leak it: results compared across processes (export
    parity) depend on the reduction order, which depends on the thread count."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
