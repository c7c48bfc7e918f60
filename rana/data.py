"""Token streams for calibration, fine-tuning and evaluation.

Everything funnels through one shape: a list of documents (`load_texts`) becomes one 1-D
token stream with EOS between documents (`tokenize_stream`), which is then cut into
non-overlapping `seq_len` windows. All window cutters drop the incomplete tail, so the
same stream and `seq_len` always give the same windows.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

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


class DataError(ValueError):
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

    `.txt`/`.raw` files are one document each (read byte-faithfully, so WikiText's
    `wiki.test.raw` is tokenised exactly as published); `.jsonl`/`.json`/`.parquet` give
    one document per row of `text_column`. A folder reads every supported file in it,
    recursively, in sorted order. Anything else that is not an existing path is treated
    as a hub dataset name, loaded with `load_dataset(source, config, split=split)`.
    Empty documents are dropped (kept with `keep_empty`, for protocols that join rows as they
    are); `max_chars` truncates the total text.
    """
    if source is None:
        source = BUNDLED_CORPUS
    path = Path(os.path.expanduser(str(source)))
    if path.exists():
        texts = _load_local(path, text_column)
        origin = str(path)
    elif _looks_local(str(source)):
        raise DataError(f"data file not found: {source}; pass an existing .txt/.raw/.jsonl/.json/.parquet file or folder")
    else:
        texts = _load_hub(str(source), config, split, text_column)
        origin = f"hub dataset {source!r}" + (f" ({config}, split {split})" if config else f" (split {split})")
    texts = [t for t in texts if isinstance(t, str) and (keep_empty or t.strip())]
    if max_chars is not None:
        texts = _truncate_chars(texts, max_chars)
    if not any(t.strip() for t in texts):
        raise DataError(f"no text found in {origin} (column {text_column!r}); pass a source with non-empty text")
    return texts


def check_source(source: str | Path | None, option: str = "--dataset") -> None:
    """Up-front check of a local data source (exists, supported files, text files are UTF-8, JSON /
    Parquet files parse), so a bad file is reported before a model is loaded; hub names are checked
    when they are loaded."""
    if source is None:
        return
    name = str(source).split(":")[0] if not Path(os.path.expanduser(str(source))).exists() else str(source)
    path = Path(os.path.expanduser(name))
    if not path.exists():
        if _looks_local(name):
            raise DataError(f"{option}: data file not found: {source}; pass an existing .txt/.raw/.jsonl/.json/.parquet "
                            "file or folder")
        return
    for builder, files in _data_files(path).items():
        if builder == "text":
            for f in files:
                check_utf8_text(Path(f))
        else:  # parsed once here; `datasets` caches the result for the real load
            _read_files(builder, files)


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


def _load_local(path: Path, text_column: str) -> list[str]:
    """Read local files through HF `datasets` packaged builders (text/json/parquet).

    Text files are checked to be UTF-8 first (the builder would fail deep inside with no file
    name); any other failure to read names the file that caused it."""
    texts: list[str] = []
    for builder, files in _data_files(path).items():
        if builder == "text":
            for f in files:
                check_utf8_text(Path(f))
        ds = _read_files(builder, files)
        column = "text" if builder == "text" else text_column
        texts.extend(_column(ds, column, f"{path} ({builder} files)"))
    return texts


_FORMAT_HINT = {"text": "a UTF-8 text file", "json": "JSON Lines: one JSON object per line, each with the text column",
                "parquet": "a Parquet file (written by pandas / pyarrow)"}


def _read_files(builder: str, files: list[str]):
    import datasets

    kwargs = {"sample_by": "document"} if builder == "text" else {}
    with _quiet_datasets():  # a bad file is reported once, by the DataError below, not by datasets' logger too
        try:
            return datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
        except Exception as exc:  # noqa: BLE001 - datasets/pyarrow raise many unrelated types for a bad file
            culprit = files[0]
            if len(files) > 1:  # find the file that fails on its own (only on this error path)
                for f in files:
                    try:
                        datasets.load_dataset(builder, data_files=[f], split="train", **kwargs)
                    except Exception:  # noqa: BLE001
                        culprit = f
                        break
            raise DataError(f"could not read '{culprit}' as {_FORMAT_HINT[builder]}: {root_cause(exc)}; fix or "
                            "remove the file") from None


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
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open(path, "rb") as fh:
        while True:
            block = fh.read(chunk)
            pending = len(decoder.getstate()[0])  # bytes of a character split across reads
            try:
                text = decoder.decode(block, final=not block)
            except UnicodeDecodeError as e:
                raise DataError(f"'{path}' is not UTF-8 text (byte {offset - pending + e.start} "
                                "cannot be decoded): convert it to UTF-8 (e.g. `iconv -f latin1 -t utf-8`) or pass "
                                "another file") from None
            if "\x00" in text:
                raise DataError(f"'{path}' looks binary (it contains NUL bytes), not text: pass a .txt/.jsonl/"
                                ".parquet file of text")
            if not block:
                return
            offset += len(block)


def _load_hub(name: str, config: str | None, split: str, text_column: str) -> list[str]:
    """Load one split of a hub dataset; wrap hub/offline failures in a `DataError`."""
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # noqa: BLE001 - datasets raises many unrelated types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(
            f"could not load hub dataset {name!r} (config={config!r}, split={split!r}): {first}; "
            "check the name/config/split and network access, or pass a local file"
        ) from exc
    return _column(ds, text_column, f"hub dataset {name!r}")


def _column(ds, column: str, origin: str) -> list[str]:
    """Return one column as a list, with a helpful error if it does not exist."""
    if column not in ds.column_names:
        raise DataError(
            f"column {column!r} not in {origin} (columns: {', '.join(ds.column_names)}); pass text_column=<one of them>"
        )
    return list(ds[column])


def _truncate_chars(texts: Sequence[str], max_chars: int) -> list[str]:
    """Keep whole documents until `max_chars`, cutting the last one to fit."""
    out: list[str] = []
    left = max_chars
    for t in texts:
        if left <= 0:
            break
        out.append(t[:left])
        left -= len(out[-1])
    return out


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


def load_token_ids(path: Path, vocab_size: int | None) -> torch.Tensor:
    """Pre-tokenised data: a 1-D int64 stream from a `.npy` array or a tensor saved with `torch.save`,
    checked against the model's vocabulary."""
    try:
        if path.suffix == ".npy":
            import numpy as np  # not a declared dependency: only .npy token files need it

            ids = torch.from_numpy(np.load(path)).long()
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
            ids = torch.as_tensor(obj).long()
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
