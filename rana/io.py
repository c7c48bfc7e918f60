"""The rana folder format: HF config + tokenizer, one safetensors file, `rana_config.json`
(every adapter's type, shape, rank, threshold) and `plan.json`. Written atomically.

`load(dir)` rebuilds the stock architecture from config.json, swaps in empty adapters of the
recorded shapes and loads the weights, so no compression code runs at load time.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from .archs import get_arch, set_submodule
from .card import write_folder_card
from .config import FORMAT_VERSION, write_json
from .modules import (CatsActivation, InputSparseLinear, NeuronThresholdLinear, RankAdapterLinear, RankSliceLinear,
                      SharedRankCode)
from .modules.common import column_major_linear

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"  # sharded layout, written for models compressed from disk
RANA_CONFIG = "rana_config.json"
PLAN = "plan.json"


class OutputExistsError(ValueError):
    """The output folder exists and --overwrite was not given (user-facing)."""


@contextmanager
def atomic_dir(out: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside `out`; on success rename it into place (nothing half-written)."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output folder '{out}' already exists; choose another --out or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            backup = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(backup)
            tmp.rename(out)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _f(x: float) -> float | None:
    return None if math.isinf(x) else x


def adapter_specs(model: nn.Module) -> list[dict]:
    """A JSON description of every adapter module, enough to rebuild empty ones."""
    specs = []
    for name, m in model.named_modules():
        if isinstance(m, RankAdapterLinear):
            specs.append({"path": name, "type": "rank", "in": m.in_features, "out": m.out_features, "rank": m.rank,
                          "bias": m.A.bias is not None, "threshold": _f(float(m.threshold))})
        elif isinstance(m, SharedRankCode):
            specs.append({"path": name, "type": "shared_code", "in": m.in_features, "out": m.out_features,
                          "rank": m.rank, "consumers": m.consumers, "threshold": _f(float(m.threshold))})
        elif isinstance(m, RankSliceLinear):
            code_name = next(n for n, c in model.named_modules() if c is m._code())
            specs.append({"path": name, "type": "rank_slice", "out": m.out_features, "rank": m.A.in_features,
                          "bias": m.A.bias is not None, "code": code_name})
        elif isinstance(m, NeuronThresholdLinear):
            specs.append({"path": name, "type": "neuron", "in": m.in_features, "out": m.out_features,
                          "bias": m.linear.bias is not None, "threshold": _f(float(m.threshold))})
        elif isinstance(m, InputSparseLinear):
            specs.append({"path": name, "type": "input_sparse", "in": m.in_features, "out": m.out_features,
                          "bias": m.linear.bias is not None, "threshold": _f(float(m.threshold))})
        elif isinstance(m, CatsActivation):
            specs.append({"path": name, "type": "cats", "hidden": m.hidden, "intermediate": m.intermediate,
                          "threshold": _f(float(m.threshold))})
    return specs


def install_empty_adapters(model: nn.Module, specs: list[dict], dtype: torch.dtype) -> None:
    """Swap in adapters of the recorded shapes (weights to be loaded afterwards)."""
    z = lambda *shape: torch.zeros(*shape, dtype=dtype)  # noqa: E731
    codes = {}
    for s in sorted(specs, key=lambda s: s["type"] != "shared_code"):  # codes before their slices
        t = s.get("threshold")
        t = -math.inf if t is None else t
        if s["type"] == "rank":
            m = RankAdapterLinear(z(s["out"], s["rank"]), z(s["rank"], s["in"]), z(s["out"]) if s["bias"] else None, t)
        elif s["type"] == "shared_code":
            m = codes[s["path"]] = SharedRankCode(z(s["rank"], s["in"]), t, s["out"], s["consumers"])
        elif s["type"] == "rank_slice":
            m = RankSliceLinear(z(s["out"], s["rank"]), z(s["out"]) if s["bias"] else None, codes[s["code"]])
        elif s["type"] == "neuron":
            m = NeuronThresholdLinear(z(s["out"], s["in"]), z(s["out"]) if s["bias"] else None, t)
        elif s["type"] == "input_sparse":
            m = InputSparseLinear(z(s["out"], s["in"]), z(s["out"]) if s["bias"] else None, t)
        elif s["type"] == "cats":
            m = CatsActivation(model.get_submodule(s["path"]), t, s["hidden"], s["intermediate"])
        else:
            raise ValueError(f"unknown adapter type '{s['type']}' in {RANA_CONFIG}")
        set_submodule(model, s["path"], m)


def _state_dict_for_saving(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        out_emb = model.get_output_embeddings()
        tied = [k for k, v in sd.items() if out_emb is not None and v.device.type != "meta"
                and v.data_ptr() == out_emb.weight.data_ptr() and k.endswith("weight")
                and k.startswith(get_arch(model.config).lm_head)]
        for k in tied:
            sd.pop(k)
    return {k: v.detach().contiguous() for k, v in sd.items()}


def save(model: nn.Module, tokenizer, out: Path, *, plan: dict | None = None, extra: dict | None = None,
         overwrite: bool = False) -> Path:
    """Write a compressed model as a rana folder (atomically)."""
    out = Path(out)
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        offloaded = getattr(model, "_rana_offloaded", None)  # layers compressed to disk one by one (rana.offload)
        if offloaded is not None:
            offloaded.write_weights(tmp, _state_dict_for_saving(model))
            adapters = offloaded.adapter_specs()
        else:
            save_file(_state_dict_for_saving(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
            adapters = adapter_specs(model)
        write_json(tmp / RANA_CONFIG, {"format_version": FORMAT_VERSION, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                                       "adapters": adapters, **(extra or {})})
        if plan is not None:
            write_json(tmp / PLAN, plan)
        write_folder_card(tmp, name=out.name)  # README.md (model card) + recipe.json
    return out


def _load_weights(path: Path) -> dict[str, torch.Tensor]:
    """One `model.safetensors`, or the shards named by `model.safetensors.index.json`."""
    index = path / WEIGHTS_INDEX
    if not index.exists():
        return load_file(str(path / WEIGHTS))
    state = {}
    for name in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        state.update(load_file(str(path / name)))
    return state


def is_rana_dir(path: Path | str) -> bool:
    return (Path(path) / RANA_CONFIG).is_file()


def load(path: Path | str, *, device: str = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer) from a rana folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not is_rana_dir(path):
        raise ValueError(f"'{path}' is not a rana folder (no {RANA_CONFIG}); produce one with `rana compress`")
    meta = json.loads((path / RANA_CONFIG).read_text())
    saved_dtype = getattr(torch, meta.get("dtype", "float32"))
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config, dtype=saved_dtype)
    install_empty_adapters(model, meta["adapters"], saved_dtype)
    if meta.get("laurel"):
        from .modules.laurel import LaurelConfig, apply_laurel
        apply_laurel(model, LaurelConfig.from_dict(meta["laurel"]))
    state = _load_weights(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (getattr(config, "tie_word_embeddings", False) and k.startswith(get_arch(config).lm_head))]
    if missing or unexpected:
        raise ValueError(f"weights in '{path}' do not match its {RANA_CONFIG}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()
    for m in model.modules():
        if isinstance(m, NeuronThresholdLinear):
            m.refresh_norms()
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    model.eval()
    return model.to(device), tokenizer


__all__ = ["save", "load", "atomic_dir", "adapter_specs", "install_empty_adapters", "is_rana_dir",
           "OutputExistsError", "column_major_linear"]
