"""Writing and reading rana folders (the format: `rana.io.format`). Written atomically.

`load(dir)` rebuilds the stock architecture from config.json, swaps in empty adapters of the
recorded shapes and loads the weights, so no compression code runs at load time (the rebuild is
`rana.modules.rebuild`'s, which exports and the transformers quantizer run too).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
import torch.nn as nn
from accelerate import init_empty_weights
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..archs import ArchSpec, get_arch
from ..errors import UserError
from ..modules.rebuild import finish_rana
from . import loadchecks
from .card import write_folder_card
from .format import (FORMAT_VERSION, PLAN, RANA_CONFIG, WEIGHTS, WEIGHTS_INDEX, ModelLoadError, adapter_specs,
                     tied_keys, weights_meta, write_json)
from .jsonfile import read_json
from .paths import OutputExistsError, apply_umask, check_output, remove_stale_temps, temp_prefix, write_manifest
from .schema import PLAN_SCHEMA, RANA_CONFIG_SCHEMA, FieldError, validate
from .weightfiles import check_safetensors_folder, weight_files


@contextmanager
def atomic_dir(out: Path, *, overwrite: bool = False, kind: str = "rana output") -> Iterator[Path]:
    """Yield a temp folder beside `out`; on success rename it into place (nothing half-written).

    The last file written into it is its manifest (`rana.io.paths.write_manifest`): what rana
    wrote, so a later `overwrite` can prove the folder is rana's. `overwrite` replaces only an empty
    folder or one whose every file its manifest lists (rana.io.paths.check_output), checked again
    just before the swap (a file put there during the work is not deleted); temp folders left beside
    `out` by killed runs are removed first; the result gets the user's umask."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output folder '{out}' already exists; choose another --out or pass --overwrite")
    check_output(out, overwrite=overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out), dir=out.parent))
    try:
        yield tmp
        write_manifest(tmp, kind)
        apply_umask(tmp)
        if out.exists() or out.is_symlink():
            check_output(out, overwrite=overwrite)
            backup = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "old"), dir=out.parent))
            out.rename(backup / out.name)
            tmp.rename(out)
            shutil.rmtree(backup, ignore_errors=True)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _state_dict_for_saving(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors, without the output embedding when it is the input embedding's tensor
    (`load` ties it back). A config may ask for tied embeddings that the model does not tie (Gemma 3's
    multimodal wrapper: its text config asks, transformers ties by the outer one): such a head is saved."""
    sd = model.state_dict()
    in_emb = model.get_input_embeddings()
    for k in tied_keys(model):
        v = sd.get(k)
        if v is not None and in_emb is not None and v.device.type != "meta" and v.data_ptr() == in_emb.weight.data_ptr():
            sd.pop(k)
    return {k: v.detach().contiguous() for k, v in sd.items()}


def save(model: nn.Module, tokenizer, out: Path, *, plan: dict | None = None, extra: dict | None = None,
         overwrite: bool = False, offloaded: OffloadedLayers | None = None) -> Path:
    """Write a compressed model as a rana folder (atomically). `offloaded`: the decoder layers a
    streamed compression wrote to disk one by one (`CompressResult.offloaded`); the folder is then
    written sharded, one file per layer plus the rest."""
    out = Path(out)
    if offloaded is None and any(t.device.type == "meta" for t in model.state_dict().values()):
        raise ValueError("the model's decoder layers are on disk (a streamed compression): pass "
                         "offloaded=result.offloaded to save them")
    with atomic_dir(out, overwrite=overwrite) as tmp:
        model.config.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        if offloaded is not None:
            offloaded.write_weights(tmp, _state_dict_for_saving(model))
            # the layers' adapters as written layer by layer, then any outside the stack (a sparse LM head)
            adapters = offloaded.adapter_specs() + adapter_specs(model, outside=offloaded.spec.layers)
        else:
            save_file(_state_dict_for_saving(model), str(tmp / WEIGHTS), metadata={"format": "pt"})
            adapters = adapter_specs(model)
        weights = weights_meta(model)  # int8 modules, if any: rebuilt as such on load
        write_json(tmp / RANA_CONFIG, {"format_version": FORMAT_VERSION, "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
                                       "adapters": adapters, **(extra or {}), **weights})
        if plan is not None:
            if weights and isinstance(plan.get("quantization"), dict):  # the int8 folder's size, as written
                plan["quantization"]["file_bytes"] = sum(f.stat().st_size for f in tmp.glob("*.safetensors"))
            write_json(tmp / PLAN, plan)
        write_folder_card(tmp, name=out.name)  # README.md (model card) + recipe.json
    return out


def _load_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    """The tensors of a folder's safetensors `files` (their headers checked already)."""
    state = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - safetensors' own error type: the file's data is unreadable
            raise ModelLoadError(f"'{f}' is not a readable safetensors file ({str(e).splitlines()[0]}); "
                                 "re-save or re-export the model") from None
    return state


def _in_model_dtypes(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each tensor in the dtype of the model's tensor it replaces: an assigning load casts as a
    copying one would (a float32 file into a model built in bf16)."""
    have = model.state_dict(keep_vars=True)
    for name, value in state.items():
        target = have.get(name)
        if target is not None and target.dtype != value.dtype:
            state[name] = value.to(target.dtype)
    return state


def _shared_parameters(model: nn.Module) -> list[list[str]]:
    """The names of each parameter the model holds under several names (an LM head tied to the embedding)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def _reshare(model: nn.Module, shared: list[list[str]], state: dict[str, torch.Tensor]) -> None:
    """Every name of each group in `shared` holds the parameter loaded under the group's first name the state
    held, as after a load that copies into the shared tensor."""
    for group in shared:
        source = next((name for name in group if name in state), None)
        if source is None:
            continue
        param = model.get_parameter(source)
        for name in group:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, param)


def _check_materialized(model: nn.Module, *, where: str, fix: str) -> None:
    """ModelLoadError when a parameter or buffer was left on the meta device (nothing in the folder filled it):
    a model that would fail, or compute nonsense, at its first forward."""
    empty = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if empty:
        raise ModelLoadError(f"{where}: {len(empty)} tensors of the model were not loaded (e.g. {', '.join(empty[:3])}); "
                             f"{fix}")


def _read_json(file: Path, schema, fix: str):
    """A folder's JSON file (read with a size and depth bound) checked against `schema` (rana.io.schema); one
    line naming the file and the field otherwise. `fix`: what the user can do about it."""
    try:
        doc = read_json(file, "the file")
        if not isinstance(doc, dict):
            raise FieldError("not a JSON object")
        validate(doc, schema)
    except ValueError as e:  # FieldError and JsonFileError (unreadable, too large, too deep, not JSON)
        raise ModelLoadError(f"'{file}' is invalid: {str(e).splitlines()[0]}; {fix}") from None
    return doc


def read_meta(path: Path) -> dict:
    """rana_config.json of a rana folder, its schema checked (one line naming the file and field otherwise)."""
    return _read_json(Path(path) / RANA_CONFIG, RANA_CONFIG_SCHEMA, "re-create the folder with `rana compress`")


def read_plan(path: Path | str) -> dict | None:
    """plan.json of a rana folder (None when absent), its schema checked: a plan of the wrong shape is
    refused here, not met by the model-card writer after a fine-tune."""
    file = Path(path) / PLAN
    if not file.is_file():
        return None
    return _read_json(file, PLAN_SCHEMA, "restore it or delete it")


def check_folder(path: Path | str) -> None:
    """The cheap part of `load`'s checks (rana_config.json schema, weight index and file headers),
    for commands that validate every input before the work starts."""
    read_meta(Path(path))
    read_plan(path)
    config = Path(path) / "config.json"
    try:
        if not isinstance(read_json(config, "it"), dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise ModelLoadError(f"'{config}' is unreadable ({str(e).splitlines()[0]}); restore it or re-create the "
                             "folder with `rana compress`") from None
    check_safetensors_folder(Path(path), error=ModelLoadError)


def check_thresholds(model: nn.Module, specs: list[dict], path: Path) -> None:
    """Every loaded threshold is a number and the one rana_config.json records (`rana.io.loadchecks`)."""
    loadchecks.check_thresholds(model, specs, where=f"'{path}'", record=RANA_CONFIG)


def is_rana_dir(path: Path | str) -> bool:
    return (Path(path) / RANA_CONFIG).is_file()


def load(path: Path | str, *, device: str = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer) from a rana folder, checked as every loader checks one (`rana.io.loadchecks`, which the
    transformers quantizer and an export's remote code run too): rana_config.json's schema, then the tensors the
    weight files hold against the rebuilt model (names, dtypes, shapes) before any is read, then the loaded
    int8 scales and thresholds."""
    path = Path(path)
    if not is_rana_dir(path):
        raise UserError(f"'{path}' is not a rana folder (no {RANA_CONFIG}); produce one with `rana compress`")
    meta = read_meta(path)
    read_plan(path)  # every field rana reads back, checked before the model is built
    saved_dtype = getattr(torch, meta.get("dtype", "float32"))
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"'{path / 'config.json'}' is unreadable: {str(e).splitlines()[0]}") from None
    files = weight_files(path, error=ModelLoadError)  # the index checked: nothing outside the folder
    if not files:
        raise ModelLoadError(f"'{path}' has no {WEIGHTS} (nor {WEIGHTS_INDEX}); the rana folder is incomplete")
    where, fix = f"'{path}'", "re-create the folder with `rana compress`"
    found = loadchecks.weight_specs(files, where=where)  # every header (nothing truncated), before the model is built
    # Built in the dtype asked for and the weights cast as they are copied in, as
    # `from_pretrained(folder, dtype=...)` does with a quantizer-format export (rana.quantizer): the
    # same float32 buffers the stock class keeps (RoPE's inv_freq), and column norms computed below
    # from the weights the model multiplies with, not from the float32 file (a cast after loading
    # would round RoPE's frequencies and leave norms that flip a few masks in half precision).
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."))
    build_dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else saved_dtype
    # Built on the meta device and the folder's tensors assigned, not copied in: an int8 folder never passes
    # through a float copy of the model, so loading takes about the folder's size in memory, not 4 bytes per
    # weight. The stock model's buffers are real (RoPE's tables are computed, not loaded); rana's modules are
    # wholly meta (every tensor they hold is in the folder, or recomputed by finish_rana).
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=build_dtype)
    with init_empty_weights(include_buffers=True):  # empty adapters, int8 modules (rana.modules.int8) and LAuReL
        loadchecks.install_record(model, meta, build_dtype, where=f"'{path / RANA_CONFIG}'", record_name=RANA_CONFIG)
    # only what tie_weights() fills may be absent: a tied head's threshold (or bias) missing from the
    # weights would otherwise be taken from rana_config.json without a word
    loadchecks.check_tensors(loadchecks.tensor_specs(model.state_dict()), found, absent_ok=tied_keys(model),
                             where=where, record=RANA_CONFIG, fix=fix)
    shared = _shared_parameters(model)  # tied at construction: an assigning load would part them
    state = _in_model_dtypes(model, _load_weights(files))
    model.load_state_dict(state, strict=False, assign=True)  # (strict: checked above, tied keys aside)
    _reshare(model, shared, state)
    loadchecks.check_loaded(model, meta, where=where, record=RANA_CONFIG, fix=fix)
    model.tie_weights()
    _check_materialized(model, where=where, fix=fix)
    finish_rana(model, get_arch(config))  # column norms of the loaded weights, decode groups
    if dtype is not None and dtype != build_dtype:  # (not again: .to() would round RoPE's float32 buffers)
        model = model.to(dtype)
    tokenizer = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    model.eval()
    return model.to(device), tokenizer


@dataclass
class OffloadedLayers:
    """Compressed decoder layers written one file per layer by a streamed compression
    (`rana.compress.residency`); `save(..., offloaded=...)` writes them as a sharded folder."""

    spec: ArchSpec
    folder: Path
    layers: dict[int, tuple[str, list[dict]]] = field(default_factory=dict)

    def adapter_specs(self) -> list[dict]:
        return [s for idx in sorted(self.layers) for s in self.layers[idx][1]]

    def write_weights(self, out: Path, rest: dict[str, torch.Tensor]) -> None:
        """Layer files (hard-linked or copied) + `rest` (everything outside the decoder stack) + index."""
        out = Path(out)
        prefix = self.spec.layers + "."
        rest = {k: v for k, v in rest.items() if not k.startswith(prefix)}
        n = len(self.layers) + 1
        weight_map = {}
        rest_name = f"model-{n:05d}-of-{n:05d}.safetensors"
        save_file(rest, str(out / rest_name), metadata={"format": "pt"})
        weight_map.update({k: rest_name for k in rest})
        for i, idx in enumerate(sorted(self.layers), start=1):
            src = self.folder / self.layers[idx][0]
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            try:
                os.link(src, out / name)
            except OSError:
                shutil.copyfile(src, out / name)
            with safe_open(str(src), framework="pt") as st:
                weight_map.update({k: name for k in st.keys()})
        (out / WEIGHTS_INDEX).write_text(json.dumps({"metadata": {"format": "rana-sharded"}, "weight_map": weight_map},
                                                    indent=1))


__all__ = ["save", "load", "check_folder", "read_meta", "read_plan", "check_thresholds", "atomic_dir", "is_rana_dir",
           "OutputExistsError", "OffloadedLayers"]
