"""Token streams for calibration, fine-tuning and evaluation.

Everything funnels through one shape: a list of documents (`load_texts`) becomes one 1-D
token stream with EOS between documents (`tokenize_stream`), which is then cut into
non-overlapping `seq_len` windows. All window cutters drop the incomplete tail, so the
same stream and `seq_len` always give the same windows.

Reading is bounded by what is asked for, not by the size of the source: `load_texts(max_chars=…)`
and `read_tokens(limit=…)` read text files in chunks and JSON / Parquet files and hub datasets
through `datasets` streaming, and stop once they have enough; the up-front `check_source(tokens=…)`
checks only what a read of that budget reaches. Local JSON / Parquet files are always streamed, so
nothing is ever copied into the `datasets` cache; only an unbounded read of a hub dataset loads it whole.
"""
from __future__ import annotations

import codecs
import io
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import UserError

BUNDLED_CORPUS = Path(__file__).parent / "assets" / "pydoc_sample.txt"
# held-out text for demos and checks: other Python-docs pages (the tutorial), never calibrated on
BUNDLED_HELDOUT = Path(__file__).parent / "assets" / "pydoc_heldout_sample.txt"

# file suffix -> datasets packaged builder that reads it
_BUILDERS: dict[str, str] = {
    ".txt": "text",
    ".raw": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}

# characters of text read first for a budget of tokens: ~16 per token is generous for any tokenizer
CHARS_PER_TOKEN = 16
# `datasets` parses a JSON Lines file in blocks of this many bytes (its default), or, when a budget is
# known, of about what the budget needs: a small budget never parses megabytes of a large file
_JSON_BLOCK_MAX = 10 << 20
_JSON_BLOCK_MIN = 64 << 10


class DataError(UserError):
    """A data source is missing, malformed or too small; the message says how to fix it."""


@dataclass(frozen=True)
class CalibrationData:
    """Calibration windows: `fit` feeds the statistics, `heldout` only scores candidates."""

    fit: torch.Tensor  # (n_fit, seq_len) int64
    heldout: torch.Tensor  # (n_heldout, seq_len) int64

    @property
    def seq_len(self) -> int:
        return int(self.fit.shape[1])

    @property
    def n_tokens(self) -> int:
        return int(self.fit.numel() + self.heldout.numel())


# --------------------------------------------------------------------------- loading


def load_texts(
    source: str | Path | None,
    *,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    max_chars: int | None = None,
    keep_empty: bool = False,
) -> list[str]:
    """Read documents from the bundled corpus, a local file/folder, or a hub dataset.

    `.txt`/`.raw` files are one document each (read as `datasets`' text builder reads them: UTF-8,
    universal newlines, so WikiText's `wiki.test.raw` is tokenised as published); `.jsonl`/`.json`/
    `.parquet` give one document per row of `text_column`. A folder reads every supported file in
    it, recursively, in sorted order. Anything else that is not an existing path is treated as a
    hub dataset name, loaded with `load_dataset(source, config, split=split)`. Empty documents are
    dropped (kept with `keep_empty`, for protocols that join rows as they are). `max_chars`
    truncates the total text, and then only that much is read (text files in chunks, JSON /
    Parquet files and hub datasets through `datasets` streaming).
    """
    origin, docs = open_documents(source, config=config, split=split, text_column=text_column,
                                  stream=max_chars is not None, keep_empty=keep_empty, max_chars=max_chars)
    texts = _take_chars(docs, max_chars)
    if not any(t.strip() for t in texts):
        raise DataError(f"no text found in {origin} (column {text_column!r}); pass a source with non-empty text")
    return texts


def open_documents(source: str | Path | None, *, config: str | None = None, split: str = "train",
                   text_column: str = "text", stream: bool = True, keep_empty: bool = False,
                   max_chars: int | None = None):
    """(origin, documents): the name messages give the source, and an iterator over the documents
    `load_texts` keeps, read lazily: a text file is a `TextFile`, a row a `str`. A missing path or an
    unsupported file fails here; a bad file or hub failure when its documents are reached. Local files
    are always read lazily; `stream`: a hub dataset is too. `max_chars`: about how much will be taken
    (None: everything), which sizes the blocks a JSON file is parsed in."""
    if source is None:
        source = BUNDLED_CORPUS
    refuse_empty(source)
    path = Path(os.path.expanduser(str(source)))
    if path.exists():
        origin, docs = str(path), _local_documents(path, text_column, _json_block(max_chars))
    elif _looks_local(str(source)):
        raise DataError(f"data file not found: {source}; pass an existing .txt/.raw/.jsonl/.json/.parquet file or folder")
    else:
        origin = f"hub dataset {source!r}" + (f" ({config}, split {split})" if config else f" (split {split})")
        docs = _hub_documents(str(source), config, split, text_column, stream)
    return origin, _kept(docs, keep_empty)


def _kept(docs: Iterable, keep_empty: bool) -> Iterator:
    """Strings (a null row is no document) and text files, the blank ones only with `keep_empty`."""
    for doc in docs:
        if isinstance(doc, TextFile):
            if keep_empty or not doc.blank():
                yield doc
        elif isinstance(doc, str) and (keep_empty or doc.strip()):
            yield doc


def _take_chars(docs: Iterable, max_chars: int | None) -> list[str]:
    """Whole documents until `max_chars`, the last one cut to fit; nothing after it is read."""
    if max_chars is None:
        return [doc.text() if isinstance(doc, TextFile) else doc for doc in docs]
    out: list[str] = []
    left = max_chars
    for doc in docs:
        if left <= 0:
            break
        out.append(doc.prefix(left) if isinstance(doc, TextFile) else doc[:left])
        left -= len(out[-1])
    return out


def refuse_empty(source: str | Path, option: str | None = None) -> None:
    """An empty path is the current folder to `Path` (`Path('') == Path('.')`): reading every text file
    under it is never what was meant, so the empty string (or only blanks) names no source."""
    if not str(source).strip():
        raise DataError(f"{option + ' is' if option else 'the data source is'} an empty path, which would read every "
                        "text file under the current folder: pass a data file, a folder or a hub dataset name")


def chars_for_tokens(tokens: int) -> int:
    """The characters the readers take first for a budget of `tokens` tokens (`CHARS_PER_TOKEN` each,
    and a margin for a small budget)."""
    return CHARS_PER_TOKEN * tokens + 1024


def _json_block(max_chars: int | None) -> int | None:
    """Bytes per block `datasets` parses a JSON Lines file in: about what `max_chars` characters take
    (up to 4 bytes each in UTF-8; None: everything is wanted, `datasets`' own block size)."""
    if max_chars is None:
        return None
    return min(_JSON_BLOCK_MAX, max(_JSON_BLOCK_MIN, 4 * max_chars))


def check_source(source: str | Path | None, option: str = "--dataset", *, tokens: int | None = None,
                 text_column: str | None = None) -> None:
    """Up-front check of a local data source, so a bad file is reported before a model is loaded: it
    exists and holds supported files, and the part a read of `tokens` tokens reaches (about
    `chars_for_tokens(tokens)` characters; None: all of it) is UTF-8 text, or JSON / Parquet rows
    (with the column `text_column`, when given). Bounded like the read itself: files are streamed,
    never parsed whole nor copied into a cache, and the check stops where the budget ends. Hub names
    are checked when they are loaded."""
    if source is None:
        return
    refuse_empty(source, option)
    name = str(source).split(":")[0] if not Path(os.path.expanduser(str(source))).exists() else str(source)
    path = Path(os.path.expanduser(name))
    if not path.exists():
        if _looks_local(name):
            raise DataError(f"{option}: data file not found: {source}; pass an existing .txt/.raw/.jsonl/.json/.parquet "
                            "file or folder")
        return
    left = None if tokens is None else chars_for_tokens(tokens)
    for builder, files in _data_files(path).items():
        for f in files:
            if left is not None and left <= 0:
                return
            left = (_check_text_file(Path(f), left) if builder == "text"
                    else _check_rows(builder, f, text_column, left))


def _check_text_file(path: Path, left: int | None, chunk: int = 1 << 20) -> int | None:
    """`check_utf8_text` of the first `left` characters of `path` (None: all of it); the characters left."""
    if left is None:
        check_utf8_text(path, chunk)
        return None
    reader = Utf8Reader(path)
    while left > 0:
        text = reader.read(min(chunk, left))  # bytes: at most as many characters
        if text is None:
            break
        left -= len(text)
    return left


def _check_rows(builder: str, file: str, column: str | None, left: int | None) -> int | None:
    """Stream the rows of one JSON / Parquet file until `left` characters of text are seen (None: every
    row): they parse, and hold `column` when one is named (else every string counts as text). The
    characters left."""
    ds = _streamed(builder, file, _json_block(left))
    blocks = _stream_blocks(ds, lambda exc: _unreadable(builder, file, exc))
    if column is not None and ds.column_names is not None and column not in ds.column_names:
        raise _no_column(column, f"{file} ({builder} files)", ds.column_names)
    for block in blocks:
        if column is not None and column not in block:
            raise _no_column(column, f"{file} ({builder} files)", list(block))
        values = block[column] if column is not None else [v for col in block.values() for v in col]
        seen = sum(len(v) for v in values if isinstance(v, str))
        if left is not None:
            left -= seen
            if left <= 0:
                break
    return left


def _looks_local(source: str) -> bool:
    """A missing path is 'local' if it has a data suffix or an explicit path prefix."""
    explicit = source.startswith((".", "/", "~")) or "\\" in source or source.count("/") > 1
    return explicit or Path(source).suffix.lower() in _BUILDERS


def _data_files(path: Path) -> dict[str, list[str]]:
    """Group the supported files under `path` by the builder that reads them."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    groups: dict[str, list[str]] = {}
    for f in files:
        builder = _BUILDERS.get(f.suffix.lower())
        if builder is not None:
            groups.setdefault(builder, []).append(str(f))
    if not groups:
        kind = "file type" if path.is_file() else "files in folder"
        raise DataError(f"unsupported {kind}: {path}; use .txt, .raw, .jsonl, .json or .parquet")
    return groups


def _local_documents(path: Path, text_column: str, json_block: int | None) -> Iterator:
    """The documents of a local file or folder (`_data_files` runs at once, so an unsupported file
    fails before anything is read): text files as lazily read `TextFile`s; JSON / Parquet rows
    streamed by `datasets` file by file (`json_block`: bytes per parsed block, None: its default), so
    nothing is read past what is taken, and nothing is copied into the `datasets` cache."""
    groups = _data_files(path)

    def documents():
        for builder, files in groups.items():
            origin = f"{path} ({builder} files)"
            if builder == "text":
                yield from (TextFile(Path(f)) for f in files)
            else:
                for f in files:
                    yield from _streamed_rows(builder, f, text_column, origin, json_block)
    return documents()


class TextFile:
    """A UTF-8 text file read in chunks only as far as it is asked for: the text
    `open(path, encoding="utf-8").read()` gives (universal newlines, as `datasets`' text builder reads
    it), with `check_utf8_text`'s errors for the part read."""

    def __init__(self, path: Path, chunk: int = 1 << 16):
        self.path, self.chunk = path, chunk
        self._bytes = Utf8Reader(path)
        self._newlines = io.IncrementalNewlineDecoder(None, translate=True)
        self._text, self.complete = "", False

    def prefix(self, n: int) -> str:
        """The first `n` characters (fewer: the whole file)."""
        while len(self._text) < n and not self.complete:
            self._read(max(self.chunk, n - len(self._text)))
        return self._text[:n]

    def text(self) -> str:
        while not self.complete:
            self._read(max(self.chunk, len(self._text)))  # doubling: few reads for a big file
        return self._text

    def blank(self) -> bool:
        """Only whitespace (read until the first other character)."""
        while not self._text.strip() and not self.complete:
            self._read(self.chunk)
        return not self._text.strip()

    def _read(self, size: int) -> None:
        piece = self._bytes.read(size)
        self.complete = piece is None
        self._text += self._newlines.decode(piece or "", final=self.complete)


_FORMAT_HINT = {"text": "a UTF-8 text file", "json": "JSON Lines: one JSON object per line, each with the text column",
                "parquet": "a Parquet file (written by pandas / pyarrow)"}


def _unreadable(builder: str, culprit: str, exc: BaseException) -> DataError:
    return DataError(f"could not read '{culprit}' as {_FORMAT_HINT[builder]}: {root_cause(exc)}; fix or remove the file")


def _streamed(builder: str, file: str, json_block: int | None = None):
    """One JSON / Parquet file as a `datasets` streaming dataset (no cache, no whole-file table; a JSON
    file parsed `json_block` bytes at a time when given); a file that cannot be opened names itself."""
    import datasets

    kwargs = {"chunksize": json_block} if builder == "json" and json_block is not None else {}
    with _quiet_datasets():
        try:
            return datasets.load_dataset(builder, data_files=[file], split="train", streaming=True, **kwargs)
        except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many unrelated types for a bad file
            raise _unreadable(builder, file, exc) from None


def _streamed_rows(builder: str, file: str, column: str, origin: str, json_block: int | None = None) -> Iterator:
    """The `column` values of one JSON / Parquet file, streamed (`_streamed`); a read error names the file."""
    ds = _streamed(builder, file, json_block)
    return _stream_column(ds, column, origin, lambda exc: _unreadable(builder, file, exc))


def _stream_blocks(ds, failure: Callable[[BaseException], DataError], batch: int = 256) -> Iterator[dict]:
    """The rows of a streamed dataset, `batch` at a time as {column: values}; `failure(exc)` is the
    DataError a read error becomes."""
    rows = iter(ds.iter(batch_size=batch))
    while True:
        with _quiet_datasets():  # datasets logs a bad JSON file itself; the DataError says it once
            try:
                block = next(rows, None)
            except Exception as exc:  # noqa: BLE001 - a bad row deep in the file, or a dropped connection
                raise failure(exc) from None
        if block is None:
            return
        yield block


def _stream_column(ds, column: str, origin: str, failure: Callable[[BaseException], DataError],
                   batch: int = 256) -> Iterator:
    """One column of a streamed dataset, `batch` rows per read (`_stream_blocks`). The column is checked
    as soon as the columns are known (for JSON: its first rows)."""
    names = ds.column_names
    if names is not None and column not in names:
        raise _no_column(column, origin, names)
    for block in _stream_blocks(ds, failure, batch):
        if column not in block:
            raise _no_column(column, origin, list(block))
        yield from block[column]


@contextmanager
def _quiet_datasets():
    from datasets.utils import logging as ds_logging

    level = ds_logging.get_verbosity()
    bars = ds_logging.is_progress_bar_enabled()
    ds_logging.set_verbosity(ds_logging.CRITICAL + 10)
    ds_logging.disable_progress_bar()
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            ds_logging.enable_progress_bar()


def root_cause(exc: BaseException) -> str:
    """The first line of the innermost cause of `exc` (library wrappers say little)."""
    seen = set()
    while id(exc) not in seen and (exc.__cause__ or exc.__context__) is not None:
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def check_utf8_text(path: Path, chunk: int = 1 << 20) -> None:
    """Refuse a file that is not UTF-8 text (binary data, another encoding), naming the byte offset."""
    reader = Utf8Reader(path)
    while reader.read(chunk) is not None:
        pass


class Utf8Reader:
    """Decoded text of a file, as many bytes per `read` as asked (None at the end); the first byte
    that is not UTF-8, or a NUL, is a one-line DataError naming the file and the offset. The file is
    opened per read, so a reader dropped half-way (its budget met) holds no file open."""

    def __init__(self, path: Path):
        self.path, self.offset = path, 0
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def read(self, size: int) -> str | None:
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            block = fh.read(size)
        pending = len(self._decoder.getstate()[0])  # bytes of a character split across reads
        try:
            text = self._decoder.decode(block, final=not block)
        except UnicodeDecodeError as e:
            raise DataError(f"'{self.path}' is not UTF-8 text (byte {self.offset - pending + e.start} "
                            "cannot be decoded): convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or pass "
                            "another file") from None
        if "\x00" in text:
            raise DataError(f"'{self.path}' looks binary (it contains NUL bytes), not text: pass a .txt/.jsonl/"
                            ".parquet file of text")
        self.offset += len(block)
        return text if block else None


def _hub_documents(name: str, config: str | None, split: str, text_column: str, stream: bool) -> Iterator:
    """The rows of one split of a hub dataset: streamed when only a prefix is wanted (nothing beyond
    it is downloaded), else (or where streaming fails, e.g. offline with only the prepared dataset
    cached) loaded whole; a failure becomes a `DataError`."""
    import datasets

    def failure(exc: BaseException) -> DataError:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return DataError(f"could not load hub dataset {name!r} (config={config!r}, split={split!r}): {first}; "
                         "check the name/config/split and network access, or pass a local file")

    def documents():
        ds = None
        if stream:
            try:
                ds = datasets.load_dataset(name, config, split=split, streaming=True)
            except Exception:  # noqa: BLE001 - not streamable here: the full load below says why if it fails too
                ds = None
        if ds is not None:
            yield from _stream_column(ds, text_column, f"hub dataset {name!r}", failure)
            return
        try:
            ds = datasets.load_dataset(name, config, split=split)
        except Exception as exc:  # noqa: BLE001 - datasets raises many unrelated types
            raise failure(exc) from exc
        yield from _column(ds, text_column, f"hub dataset {name!r}")
    return documents()


def _no_column(column: str, origin: str, names) -> DataError:
    return DataError(f"column {column!r} not in {origin} (columns: {', '.join(names)}); pass text_column=<one of them>")


def _column(ds, column: str, origin: str) -> list[str]:
    """Return one column as a list, with a helpful error if it does not exist."""
    if column not in ds.column_names:
        raise _no_column(column, origin, ds.column_names)
    return list(ds[column])


# --------------------------------------------------------------------------- tokenising


def tokenize_stream(texts: Iterable[str], tokenizer, *, add_eos: bool = True) -> torch.Tensor:
    """Tokenise documents in one batched call and join them into a 1-D int64 stream.

    No BOS or other special tokens are added; with `add_eos` the tokenizer's EOS
    separates consecutive documents (it is a separator, so a single document's stream is
    exactly its own tokens).
    """
    texts = list(texts)
    if not texts:
        raise DataError("no documents to tokenise; pass at least one non-empty text")
    eos = tokenizer.eos_token_id
    if add_eos and len(texts) > 1 and eos is None:
        raise DataError("tokenizer has no eos_token_id to separate documents; set one or pass add_eos=False")
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    pieces: list[torch.Tensor] = []
    sep = torch.tensor([eos], dtype=torch.long) if add_eos and eos is not None else None
    for i, doc in enumerate(ids):
        if i and sep is not None:
            pieces.append(sep)
        pieces.append(torch.as_tensor(doc, dtype=torch.long))
    return torch.cat(pieces)


# a document cut to a prefix is tokenised with this many tokens to spare: cutting a text changes
# only the tokens next to the cut (pre-tokenisers split at word boundaries), so the kept ones are
# those the whole document gives
_CUT_MARGIN = 256
_BATCH_CHARS = 1 << 16  # short documents are tokenised together, in calls of about this many characters


def read_tokens(source: str | Path | None, tokenizer, *, limit: int | None, config: str | None = None,
                split: str = "train", text_column: str = "text") -> torch.Tensor:
    """The first `limit` tokens of `tokenize_stream(load_texts(source, …), tokenizer)` (all of them
    when the source has fewer), reading and tokenising the source only as far as that takes."""
    if limit is None:
        return tokenize_stream(load_texts(source, config=config, split=split, text_column=text_column), tokenizer)
    origin, docs = open_documents(source, config=config, split=split, text_column=text_column,
                                  max_chars=chars_for_tokens(limit))
    stream = _TokenStream(tokenizer, limit)
    batch: list[str] = []
    for doc in docs:
        if isinstance(doc, str) and len(doc) <= _BATCH_CHARS:
            batch.append(doc)
            if sum(map(len, batch)) >= _BATCH_CHARS:
                stream.add_batch(batch)
                batch = []
        else:
            stream.add_batch(batch)
            batch = []
            if not stream.full:
                stream.add(_prefix_ids(doc, tokenizer, stream.left))
        if stream.full:
            break
    stream.add_batch(batch)
    if not stream.pieces:
        raise DataError(f"no text found in {origin} (column {text_column!r}); pass a source with non-empty text")
    return stream.tensor()


class _TokenStream:
    """Documents' token ids joined as `tokenize_stream` joins them (EOS between documents), up to `limit`."""

    def __init__(self, tokenizer, limit: int):
        self.tokenizer, self.limit = tokenizer, limit
        self.pieces: list[torch.Tensor] = []
        self.count = 0

    @property
    def full(self) -> bool:
        return self.count >= self.limit

    @property
    def left(self) -> int:
        """Tokens still wanted from the next document (after its separator)."""
        return max(0, self.limit - self.count - (1 if self.pieces else 0))

    def add_batch(self, texts: list[str]) -> None:
        for ids in (self.tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []):
            if self.full:
                return
            self.add(ids)

    def add(self, ids) -> None:
        if self.pieces:  # EOS separates documents
            eos = self.tokenizer.eos_token_id
            if eos is None:
                raise DataError("tokenizer has no eos_token_id to separate documents; set one or pass add_eos=False")
            self.pieces.append(torch.tensor([eos], dtype=torch.long))
            self.count += 1
        self.pieces.append(torch.as_tensor(ids, dtype=torch.long))
        self.count += len(ids)

    def tensor(self) -> torch.Tensor:
        return torch.cat(self.pieces)[: self.limit]


def _prefix_ids(doc, tokenizer, need: int) -> list[int]:
    """The token ids of `doc` (a `TextFile` or a long string), or at least its first `need`: a prefix
    is tokenised, grown until it gives `need` + `_CUT_MARGIN` tokens or is the whole document."""
    chars = need + _CUT_MARGIN  # byte-level tokenizers: about one token per character
    while True:
        text = doc.prefix(chars) if isinstance(doc, TextFile) else doc[:chars]
        ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
        if len(text) < chars:  # the whole document
            return ids
        if len(ids) >= need + _CUT_MARGIN:
            return ids[:need]
        # grow to the estimated length (characters per token so far), at least doubling
        chars = max(2 * chars, int(chars * (need + _CUT_MARGIN) / max(len(ids), 1) * 1.2))


def load_token_ids(path: Path, vocab_size: int | None, limit: int | None = None) -> torch.Tensor:
    """Pre-tokenised data: a 1-D int64 stream from a `.npy` array or a tensor saved with `torch.save`,
    checked against the model's vocabulary; with `limit`, its first `limit` ids, read through a memory
    map where the file allows one (only those ids are read from disk and checked)."""
    try:
        ids = _token_file(path, limit)
    except Exception as e:  # noqa: BLE001 - numpy/torch/pickle raise many types for a damaged file
        kind = "a NumPy array" if path.suffix == ".npy" else "a tensor saved with torch.save"
        raise DataError(f"could not read token ids from '{path}' ({root_cause(e)}): it must hold {kind} of "
                        "integer token ids") from None
    if ids.dim() != 1:
        ids = ids.reshape(-1)
    if ids.numel() == 0:
        raise DataError(f"{path} holds no token ids")
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        raise DataError(f"token ids in {path} must lie in [0, {vocab_size}) for this model's vocabulary, "
                        f"found [{int(ids.min())}, {int(ids.max())}]")
    return ids


def _token_file(path: Path, limit: int | None) -> torch.Tensor:
    """The ids of a .npy / torch.save file, flattened, its first `limit` copied out of a memory map."""
    if path.suffix == ".npy":
        import numpy as np  # not a declared dependency: only .npy token files need it

        array = np.load(path, mmap_mode="r" if limit is not None else None)
        return torch.from_numpy(np.array(array.reshape(-1)[:limit])).long()
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=limit is not None)
    except RuntimeError:  # an old (non-zip) file cannot be memory-mapped: read it whole
        obj = torch.load(path, map_location="cpu", weights_only=True)
    return torch.as_tensor(obj).reshape(-1)[:limit].clone().long()


# --------------------------------------------------------------------------- windows


def _check_stream(tokens: torch.Tensor, seq_len: int) -> None:
    if tokens.dim() != 1:
        raise DataError(f"expected a 1-D token stream, got shape {tuple(tokens.shape)}; use tokenize_stream()")
    if seq_len < 2:
        raise DataError(f"seq_len must be at least 2, got {seq_len}")


def pack_blocks(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Cut a stream into (n_blocks, seq_len) fine-tuning blocks; the tail is dropped."""
    _check_stream(tokens, seq_len)
    n = tokens.numel() // seq_len
    if n == 0:
        raise DataError(f"found {tokens.numel()} tokens, need at least {seq_len} for one block of seq_len={seq_len}")
    return tokens[: n * seq_len].reshape(n, seq_len).long()


def eval_windows(tokens: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Non-overlapping (n_windows, seq_len) perplexity windows; the tail is dropped."""
    return pack_blocks(tokens, seq_len)


def calibration_batches(
    tokens: torch.Tensor,
    *,
    n_tokens: int,
    seq_len: int,
    heldout_fraction: float = 0.125,
    seed: int = 0,
) -> CalibrationData:
    """Draw `n_tokens // seq_len` random non-overlapping windows and split off a held-out part.

    Windows are sampled (seeded) from the whole stream so calibration covers the corpus
    rather than its first pages. At least one window is held out when the fraction is
    positive; held-out windows are only for scoring, never for statistics.
    """
    _check_stream(tokens, seq_len)
    if not 0.0 <= heldout_fraction < 1.0:
        raise DataError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    n_seq = n_tokens // seq_len
    n_held = max(1, round(n_seq * heldout_fraction)) if heldout_fraction > 0 else 0
    if n_seq - n_held < 1:
        raise DataError(
            f"n_tokens={n_tokens} gives {n_seq} windows of seq_len={seq_len}, need at least {n_held + 1} "
            "(fit + held-out); raise n_tokens or lower seq_len"
        )
    available = tokens.numel() // seq_len
    if available < n_seq:
        raise DataError(
            f"calibration text too short: found {tokens.numel()} tokens, need {n_seq * seq_len} "
            f"({n_seq} windows of seq_len={seq_len}); pass more text or lower n_tokens"
        )
    windows = pack_blocks(tokens, seq_len)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(available, generator=gen)[:n_seq]
    fit_idx, held_idx = order[: n_seq - n_held], order[n_seq - n_held :]
    return CalibrationData(fit=windows[fit_idx.sort().values], heldout=windows[held_idx.sort().values])
