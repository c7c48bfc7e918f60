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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest single-threaded: a second intra-op thread only adds sync cost, a lot
    on a busy machine. Modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny dense model saved as an HF folder (what the CLI tests compress)."""
    from helpers import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def calib_file(tmp_path_factory):
    """20,000 characters of the bundled corpus as a local calibration text."""
    from rana.data import BUNDLED_CORPUS

    p = tmp_path_factory.mktemp("d") / "calib.txt"
    p.write_text(BUNDLED_CORPUS.read_text()[:20000])
    return p


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if a command gets as far as loading a model (the error must come first)."""
    import rana.compress
    import rana.evaluation.run

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(rana.evaluation.run, "open_model", refuse)
    monkeypatch.setattr(rana.compress, "compress", refuse)
