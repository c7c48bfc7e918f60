"""Where the benchmarks find their data: one rule for every script.

The texts and evaluation sets are not shipped with rana (they are large and licensed apart). A
script reads them from `$RANA_SHARED_DATA` (the folder holding `text/` and `eval/`), or, when that
is unset, from `shared/data` beside the repository, where the team's checkout keeps them.
"""
from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def data_dir() -> Path:
    """The shared data folder (`text/`, `eval/`)."""
    return Path(os.environ.get("RANA_SHARED_DATA", ROOT.parent / "shared" / "data"))


def text_file(name: str) -> Path:
    """A text under `data_dir()/text`, e.g. text_file("pydoc_calib.txt")."""
    return data_dir() / "text" / name
