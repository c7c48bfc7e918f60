"""How `rana eval` opens the models it measures: a rana folder (with its plan) or any dense
reference, plus the dense model a compressed one came from.

Kept in this one module so that evaluation has a single door to model loading.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn as nn
from transformers import AutoTokenizer

from .. import io as rana_io
from ..io.models import load_model, resolve
from ..units import DTYPES


@dataclass
class LoadedModel:
    """A model ready to evaluate plus what is known about where it came from."""

    model: nn.Module
    tokenizer: Any
    reference: str
    kind: str  # "rana" (a compressed folder) or "dense"
    plan: dict | None = None
    info: dict = field(default_factory=dict)

    @property
    def dense_reference(self) -> str | None:
        """The dense model this one was compressed from (plan.json's model), or itself if dense."""
        if self.kind == "dense":
            return self.reference
        plan = self.plan or {}
        return plan.get("model") or (plan.get("config") or {}).get("model") or self.info.get("compress_config", {}).get("model")


def _tokenizer_for(reference: str):
    src = resolve(reference)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return AutoTokenizer.from_pretrained(src.path, **kw)


def load_for_eval(reference: str | Path, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """A rana folder (`rana.io.load`, with its plan.json) or any dense reference (`load_model`)."""
    reference = str(reference)
    if rana_io.is_rana_dir(reference):
        model, tokenizer = rana_io.load(reference, device=device, dtype=DTYPES.get(dtype) if dtype != "float32" else None)
        plan = rana_io.read_plan(reference)
        meta = rana_io.read_meta(Path(reference))
        loaded = LoadedModel(model, tokenizer, reference, "rana", plan,
                             {k: v for k, v in meta.items() if k in ("method", "compress_config", "laurel")})
        if tokenizer is None and loaded.dense_reference:
            loaded.tokenizer = _tokenizer_for(loaded.dense_reference)
        return loaded
    model, tokenizer, _ = load_model(reference, dtype=dtype, device=device)
    return LoadedModel(model, tokenizer, reference, "dense")


def load_dense(reference: str, *, dtype: str = "float32", device: str = "cpu") -> nn.Module:
    """The dense model `reference` names (the comparison for latency and per-layer errors)."""
    return load_model(reference, dtype=dtype, device=device)[0]
