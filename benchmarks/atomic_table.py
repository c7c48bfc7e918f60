"""How the GPU benchmarks write their tables so that being stopped costs nothing already measured.

The GPU machine is lent for minutes, and the suite (benchmarks/gpu_suite.py) kills whatever overruns its
share. So every benchmark writes its whole report after each measured cell, and each file goes through a
temporary file in the same folder renamed over the old one (`os.replace`, atomic on one file system): a
kill at any moment leaves the previous report or the new one, never half of one. Nothing here deletes a
report.

Standard library only: the suite imports it too, and the suite never imports torch.
"""
from __future__ import annotations

import json
import os
from pathlib import Path


def write_text(path: str | os.PathLike, text: str) -> None:
    """`text` into `path`, atomically (the folder is made if needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # only left behind when the write itself failed


def write_report(stem: str | os.PathLike, data: dict, markdown: str) -> None:
    """STEM.json (the data, what the suite reads back) then STEM.md (the table people read), each atomic."""
    stem = Path(stem)
    write_text(stem.with_suffix(".json"), json.dumps(data, indent=1, default=str) + "\n")
    write_text(stem.with_suffix(".md"), markdown)


__all__ = ["write_report", "write_text"]
