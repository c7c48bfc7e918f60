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
    """Yield a temp folder beside `out`; on success rename it into place (nothing half-written).

    `overwrite` replaces only an empty folder or one rana wrote (rana.paths.check_output); temp
    folders left beside `out` by killed runs are removed first; the result gets the user's umask."""
    from .paths import apply_umask, check_output, remove_stale_temps, temp_prefix

    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output folder '{out}' already exists; choose another --out or pass --overwrite")
    check_output(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    try:
        yield tmp
        apply_umask(tmp)
        if out.exists():
            backup = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "old"), dir=out.parent))
            out.rename(backup / out.name)
            tmp.rename(out)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _f(x: float) -> float | str | None:
    """A threshold as JSON: null for -inf (everything active), "inf" for +inf (nothing active)."""
    if x == math.inf:
        return "inf"
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
        t = -math.inf if t is None else float(t)
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
    """One `model.safetensors`, or the shards named by `model.safetensors.index.json` (each file's
    index entry and header checked first: nothing outside the folder, nothing truncated)."""
    from .loading import ModelLoadError
    from .weightfiles import check_safetensors_folder

    files = check_safetensors_folder(path, error=ModelLoadError)
    if not files:
        raise ModelLoadError(f"'{path}' has no {WEIGHTS} (nor {WEIGHTS_INDEX}); the rana folder is incomplete")
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors' own error type: the file's data is unreadable
            raise ModelLoadError(f"'{f}' is not a readable safetensors file ({str(e).splitlines()[0]}); "
                                 "re-save or re-export the model") from None
    return state


_ADAPTER_FIELDS = {  # required integer fields (>= 1) of each adapter type in rana_config.json
    "rank": ("in", "out", "rank"), "shared_code": ("in", "out", "rank", "consumers"), "rank_slice": ("out", "rank"),
    "neuron": ("in", "out"), "input_sparse": ("in", "out"), "cats": ("hidden", "intermediate"),
}
_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def _threshold_value(t) -> float:
    """The threshold a rana_config.json entry records (null: -inf, "inf": +inf); ValueError otherwise."""
    if t is None:
        return -math.inf
    if t == "inf":
        return math.inf
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise ValueError(f"threshold {t!r} is not a finite number (null means -inf, \"inf\" means +inf)")
    return float(t)


def read_meta(path: Path) -> dict:
    """rana_config.json of a rana folder, its schema checked (one line naming the file otherwise)."""
    from .loading import ModelLoadError

    file = Path(path) / RANA_CONFIG
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        version = meta.get("format_version", FORMAT_VERSION)
        if not isinstance(version, int) or version > FORMAT_VERSION:
            raise ValueError(f"format_version {version!r} is newer than this rana reads ({FORMAT_VERSION}); upgrade rana")
        if meta.get("dtype", "float32") not in _DTYPE_NAMES:
            raise ValueError(f"dtype {meta.get('dtype')!r} is not one of {', '.join(_DTYPE_NAMES)}")
        adapters = meta.get("adapters")
        if not isinstance(adapters, list):
            raise ValueError("'adapters' must be a list")
        codes = {a.get("path") for a in adapters if isinstance(a, dict) and a.get("type") == "shared_code"}
        for i, a in enumerate(adapters):
            if not isinstance(a, dict) or not isinstance(a.get("path"), str) or not a["path"]:
                raise ValueError(f"adapter {i} has no 'path'")
            kind = a.get("type")
            if kind not in _ADAPTER_FIELDS:
                raise ValueError(f"adapter '{a['path']}' has unknown type {kind!r}")
            for key in _ADAPTER_FIELDS[kind]:
                v = a.get(key)
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"adapter '{a['path']}': '{key}' must be a positive integer, got {v!r}")
            if kind in ("rank", "rank_slice", "neuron", "input_sparse") and not isinstance(a.get("bias"), bool):
                raise ValueError(f"adapter '{a['path']}': 'bias' must be true or false")
            if kind == "rank_slice" and a.get("code") not in codes:
                raise ValueError(f"adapter '{a['path']}': its code {a.get('code')!r} is not a shared_code adapter")
            if kind != "rank_slice":
                try:
                    _threshold_value(a.get("threshold"))
                except ValueError as e:
                    raise ValueError(f"adapter '{a['path']}': {e}") from None
    except OSError as e:
        raise ModelLoadError(f"cannot read '{file}': {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"'{file}' is invalid: {str(e).splitlines()[0]}; re-create the folder with `rana compress`") from None
    return meta


def read_plan(path: Path | str) -> dict | None:
    """plan.json of a rana folder (None when absent); one line naming the file when unreadable."""
    from .loading import ModelLoadError

    file = Path(path) / PLAN
    if not file.is_file():
        return None
    try:
        plan = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"'{file}' is unreadable ({str(e).splitlines()[0]}); restore it or delete it") from None
    if not isinstance(plan, dict):
        raise ModelLoadError(f"'{file}' is not a JSON object; restore it or delete it")
    return plan


def check_folder(path: Path | str) -> None:
    """The cheap part of `load`'s checks (rana_config.json schema, weight index and file headers),
    for commands that validate every input before the work starts."""
    from .loading import ModelLoadError
    from .weightfiles import check_safetensors_folder

    read_meta(Path(path))
    read_plan(path)
    config = Path(path) / "config.json"
    try:
        if not isinstance(json.loads(config.read_text(encoding="utf-8")), dict):
            raise ValueError("not a JSON object")
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelLoadError(f"'{config}' is unreadable ({str(e).splitlines()[0]}); restore it or re-create the "
                             "folder with `rana compress`") from None
    check_safetensors_folder(Path(path), error=ModelLoadError)


def check_thresholds(model: nn.Module, specs: list[dict], path: Path) -> None:
    """Every loaded threshold is a number and the one rana_config.json records (a NaN masks
    nothing or everything without a word; a changed one is not the model that was measured)."""
    from .loading import ModelLoadError

    for s in specs:
        if s["type"] == "rank_slice":
            continue
        buf = model.get_submodule(s["path"]).get_buffer("threshold")
        got, want = float(buf), _threshold_value(s.get("threshold"))
        if math.isnan(got):
            raise ModelLoadError(f"the threshold of '{s['path']}' in '{path}' weights is NaN; the file is corrupt")
        same = got == want if math.isinf(got) or math.isinf(want) else math.isclose(got, want, rel_tol=1e-2, abs_tol=1e-6)
        if not same:
            raise ModelLoadError(f"the threshold of '{s['path']}' in '{path}' weights ({got:g}) differs from its "
                                 f"{RANA_CONFIG} ({want:g}); the folder was edited or is corrupt")


def is_rana_dir(path: Path | str) -> bool:
    return (Path(path) / RANA_CONFIG).is_file()


def load(path: Path | str, *, device: str = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer) from a rana folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .loading import ModelLoadError

    path = Path(path)
    if not is_rana_dir(path):
        raise ValueError(f"'{path}' is not a rana folder (no {RANA_CONFIG}); produce one with `rana compress`")
    meta = read_meta(path)
    saved_dtype = getattr(torch, meta.get("dtype", "float32"))
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"'{path / 'config.json'}' is unreadable: {str(e).splitlines()[0]}") from None
    state = _load_weights(path)  # headers checked before the model is built
    model = AutoModelForCausalLM.from_config(config, dtype=saved_dtype)
    try:
        install_empty_adapters(model, meta["adapters"], saved_dtype)
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(f"'{path / RANA_CONFIG}' does not fit the model in config.json "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if meta.get("laurel"):
        from .modules.laurel import LaurelConfig, apply_laurel
        try:
            laurel = LaurelConfig.from_dict(meta["laurel"])
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"'{path / RANA_CONFIG}': invalid 'laurel' settings ({e})") from None
        apply_laurel(model, laurel)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shapes that differ from rana_config.json
        raise ModelLoadError(f"weights in '{path}' do not match its {RANA_CONFIG}: "
                             f"{' '.join(str(e).split())[:300]}") from None
    missing = [k for k in missing if not (getattr(config, "tie_word_embeddings", False) and k.startswith(get_arch(config).lm_head))]
    if missing or unexpected:
        raise ModelLoadError(f"weights in '{path}' do not match its {RANA_CONFIG}: {len(missing)} missing "
                             f"{missing[:3]}, {len(unexpected)} unexpected {unexpected[:3]}; the folder is incomplete "
                             "or was edited")
    check_thresholds(model, meta["adapters"], path)
    model.tie_weights()
    for m in model.modules():
        if isinstance(m, NeuronThresholdLinear):
            m.refresh_norms()
    if dtype is not None:
        model = model.to(dtype)
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    model.eval()
    return model.to(device), tokenizer


__all__ = ["save", "load", "check_folder", "read_meta", "read_plan", "atomic_dir", "adapter_specs", "install_empty_adapters", "is_rana_dir",
           "OutputExistsError", "column_major_linear"]
