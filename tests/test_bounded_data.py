"""Issue 27, "bounded by the budget, not by the corpus": reading data stops once the token budget (plus
the held-out share) is met, so a 50 MB file costs what a small one costs, and what is read is a prefix
of what an unbounded read gives (the same blocks for a source no longer than the budget)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import helpers
from rana.data import BUNDLED_CORPUS, DataError, load_texts, read_tokens, tokenize_stream
from rana.finetune.config import FinetuneConfig
from rana.finetune.data import prepare_blocks, train_blocks_needed

TESTS = Path(__file__).parent
# --tokens 8192 at seq_len 128 / batch 4: 64 training blocks, at most 8 held out
BUDGET = dict(tokens=8192, seq_len=128, batch_size=4, eval_tokens=1024)

_PROBE = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[2])
import helpers
from rana.finetune.config import FinetuneConfig
from rana.finetune.data import prepare_blocks
tok = helpers.byte_tokenizer()
config = FinetuneConfig(source="unused", data=sys.argv[1], **json.loads(sys.argv[3]))
start = time.perf_counter()
train, held = prepare_blocks(config, tok, 257)
seconds = time.perf_counter() - start
# bytes this process read through system calls (imports included, alike for every file): what a bounded
# reader keeps small, counted by the kernel instead of timed
rchar = int(next(l for l in open("/proc/self/io") if l.startswith("rchar:")).split()[1])
print(json.dumps({"s": seconds, "rchar": rchar, "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "train": list(train.shape), "held": list(held.shape)}))
"""


def _prepare_in_subprocess(path: Path, timeout: float) -> dict:
    """prepare_blocks on `path` in a fresh process: its time and the process's peak RSS."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(TESTS), json.dumps(BUDGET)],
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_finetune_data_of_a_50mb_file_costs_what_a_small_one_does(tmp_path):
    text = BUNDLED_CORPUS.read_text()[:1_000_000]
    small, large = tmp_path / "small.txt", tmp_path / "large.txt"
    small.write_text(text[:200_000])
    with open(large, "w") as fh:  # 50 MB: the corpus again and again
        for _ in range(50):
            fh.write(text)
    assert large.stat().st_size > 50_000_000
    try:
        big = _prepare_in_subprocess(large, timeout=60)  # reading it all took minutes and GBs
    except subprocess.TimeoutExpired:
        pytest.fail("preparing 8192 tokens of a 50 MB file took over 60 s: the whole file is read")
    base = _prepare_in_subprocess(small, timeout=60)
    assert big["train"] == base["train"] == [68, 128] and big["held"] == base["held"] == [4, 128]  # 72 blocks read
    assert big["rss_kb"] < base["rss_kb"] * 1.25 + 50_000, (big, base)  # peak memory: that of the small file
    assert big["rchar"] < base["rchar"] + 8_000_000, (big, base)  # read: a few MB at most, never the 50 MB


def _config(data, **kw) -> FinetuneConfig:
    return FinetuneConfig(source="unused", data=str(data), **{**BUDGET, **kw})


def _unbounded(config, tok):
    """What prepare_blocks gave before it was bounded: the whole stream, the tail held out."""
    stream = tokenize_stream(load_texts(config.data), tok)
    n = stream.numel() // config.seq_len
    blocks = stream[: n * config.seq_len].reshape(n, config.seq_len)
    n_held = min(max(1, round(n * config.heldout_fraction)), max(1, config.eval_tokens // config.seq_len), n - 1)
    return blocks[: n - n_held], blocks[n - n_held:]


def test_a_source_within_the_budget_gives_the_blocks_it_always_gave(tmp_path):
    tok = helpers.byte_tokenizer()
    path = tmp_path / "d.txt"
    path.write_text(BUNDLED_CORPUS.read_text()[:9000])  # 70 blocks: within 64 + 8
    train, held = prepare_blocks(_config(path), tok, 257)
    old_train, old_held = _unbounded(_config(path), tok)
    assert torch.equal(train, old_train) and torch.equal(held, old_held)


def test_a_longer_source_is_read_as_far_as_the_budget(tmp_path):
    """The rule for a source beyond the budget: its first 64 + 8 blocks, the held-out ones at their tail."""
    tok = helpers.byte_tokenizer()
    path = tmp_path / "d.txt"
    path.write_text(BUNDLED_CORPUS.read_text()[:200_000])
    config = _config(path)
    assert train_blocks_needed(config, processes=1) == 64 and train_blocks_needed(config, processes=2) == 64
    assert train_blocks_needed(_config(path, tokens=8193), processes=2) == 72  # whole steps of 8 blocks
    train, held = prepare_blocks(config, tok, 257, processes=1)
    stream = tokenize_stream(load_texts(path), tok)[: 72 * 128].reshape(72, 128)
    assert torch.equal(train, stream[:68]) and torch.equal(held, stream[68:])  # 5% of 72 blocks held out
    train, held = prepare_blocks(_config(path, eval_data=str(path)), tok, 257, processes=1)
    assert torch.equal(train, stream[:64]) and torch.equal(held, stream[:8])


def test_read_tokens_is_a_prefix_of_the_unbounded_stream(tmp_path):
    tok = helpers.byte_tokenizer()
    text = BUNDLED_CORPUS.read_text()
    (tmp_path / "a.txt").write_text(text[:30_000])
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": text[i:i + 500]}) for i in range(0, 20_000, 500)))
    for source in (tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path):
        full = tokenize_stream(load_texts(source), tok)
        for limit in (1, 700, 20_001, full.numel(), full.numel() + 9):
            assert torch.equal(read_tokens(source, tok, limit=limit), full[:limit])


def test_bounded_reads_keep_the_error_lines(tmp_path):
    tok = helpers.byte_tokenizer()
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(DataError, match="no text found"):
        read_tokens(tmp_path / "empty.txt", tok, limit=100)
    (tmp_path / "latin1.txt").write_bytes("café au lait ".encode("latin-1") * 50)
    with pytest.raises(DataError, match=r"is not UTF-8 text \(byte 3 cannot be decoded\)"):
        read_tokens(tmp_path / "latin1.txt", tok, limit=100)
    (tmp_path / "broken.jsonl").write_text('{"text": "fine"}\n{not json at all\n')
    with pytest.raises(DataError, match="could not read .*broken.jsonl"):
        read_tokens(tmp_path / "broken.jsonl", tok, limit=100)
    (tmp_path / "rows.jsonl").write_text('{"text": "fine"}\n' * 1000)
    with pytest.raises(DataError, match="column 'body' not in .*columns: text"):
        read_tokens(tmp_path / "rows.jsonl", tok, limit=1, text_column="body")


def test_a_hub_dataset_is_streamed_and_read_only_as_far_as_needed(monkeypatch):
    import datasets

    pulled, calls = [], []

    def rows():
        for i in range(10**9):  # an endless dataset: an unbounded read would never finish
            pulled.append(i)
            yield {"text": f"row {i} " * 10}

    def fake_load(name, config=None, split=None, streaming=False, **kw):
        calls.append(streaming)
        assert streaming, "a bounded read of a hub dataset must stream"
        return datasets.IterableDataset.from_generator(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    tok = helpers.byte_tokenizer()
    tokens = read_tokens("someone/corpus", tok, limit=5000)
    assert tokens.numel() == 5000 and calls == [True]
    assert len(pulled) < 2000  # a few batches of rows, not the dataset
    assert len(load_texts("someone/corpus", max_chars=3000)) == 10 + 35  # 60-character rows, then 70
