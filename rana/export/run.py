"""`rana export`: a rana folder → a folder that loads with plain transformers, in one of two formats.

``--format quantizer`` (the default) — the stock model class, no remote code, rana installed::

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out)            # dtype=, device_map= as usual

config.json keeps the source's ``model_type`` and ``architectures`` (what ``transformers serve``,
``lm_eval --model hf`` and vLLM resolve) and records the adapters the way AWQ / GPTQ checkpoints
record their quantization: ``quantization_config = {"quant_method": "rana", "format_version",
"rana_version", "adapters": [...rana_config.json's adapters...], "laurel": {...} | null}``.
`rana.quantizer`, registered in every process where rana is installed (imported, or through the
start-up hook `rana.hf_hook` / ``rana-hf-quantizer.pth``, so a process that never imports rana
still knows quant_method "rana"), swaps in the adapters before the weights load and leaves the
modules, thresholds and decode groups as ``rana.io.load(src)`` builds them: the same logits and
greedy tokens in fp32, bf16 and fp16. Without rana, plain transformers stops with one line saying
to ``pip install rana`` (config.json's ``transformers_weights`` holds that sentence, not a file
name); with ``trust_remote_code=True`` it runs the remote code shipped in the folder (``auto_map``)
instead, which needs no rana.

``--format remote-code`` — a model type of its own, loaded without the rana package::

    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)

gives the same logits as ``rana.io.load(src)``; config.json has ``model_type`` ``rana_<type>``,
``architectures`` ``Rana<Class>``, ``auto_map``, ``dtype``, ``rana_adapters`` (every adapter's path,
type, shapes, rank and threshold, as in ``rana_config.json``) and ``rana_laurel`` (LAuReL settings or
null). A class of its own cannot be served by ``transformers serve`` (it resolves
``architectures[0]`` on the transformers module) and needs the flag many deployments forbid.

Both formats hold

* ``config.json`` as above;
* the weights as safetensors, keyed by the module paths of the model (adapters included), sharded
  past ``max_shard_size`` with ``model.safetensors.index.json``;
* tokenizer files, ``generation_config.json`` and ``plan.json`` copied from the source folder, and
  a model card (``README.md``, ``recipe.json``);
* the remote code (the whole model in the remote-code format, the fallback in the quantizer
  format): ``configuration_rana.py`` and ``modeling_rana.py`` (rendered from
  ``rana/export/template/``) and *copies of the rana sources themselves* — the module of every
  registered adapter kind and what it imports (``registry.py``, ``rebuild.py``, ``common.py``, ``int8.py``,
  ``groups.py``, ``errors.py``, …: `rana.export.render` derives the list), the masked-GEMV kernels
  (``route.py`` the modules decode through, ``weights.py``, ``modes.py``, ``torch_gemv.py``,
  ``triton_gemv.py`` (triton imported lazily and optionally), ``ops.py`` (the torch.library ops a traced
  step calls) and ``cpu_gemv.py`` with the native CPU kernel's C source inlined), LAuReL (``laurel.py``) and the architecture spec (``archspec.py``: the ``ArchSpec``
  machinery of ``rana.archs.base`` plus this model's spec) — with their imports of one another
  rewritten to flat relative imports (``from ..kernels.route import`` → ``from .route
  import``, ``from rana.archs import`` → ``from .archspec import``), so the same code ships. Every
  shipped file is checked at export time: it may import only the standard library, torch,
  transformers and the other shipped files (anything else only inside ``try``, e.g. triton): see
  `rana.export.render`.
"""
from __future__ import annotations

import json
import shutil
from importlib.metadata import version
from pathlib import Path

from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file

from .. import io as rana_io
from ..io.card import write_export_card
from ..io.paths import check_output
from ..quantizer import WEIGHTS_GUARD, quantization_config_dict
from ..checks import check_writable_dir
from .config import FORMATS, ExportConfig
from .render import CONFIG_FILE, MODELING_FILE, render_sources
from ..errors import UserError

# rana-folder files that describe the rana format itself, not the exported model
_NOT_COPIED = {"config.json", "rana_config.json", "model.safetensors", "model.safetensors.index.json"}


# --------------------------------------------------------------------------------------------
# weights
# --------------------------------------------------------------------------------------------
def _tied_keys(model) -> set[str]:
    """State-dict keys that transformers ties to another one (the LM head of tied embeddings)."""
    tied = getattr(model, "all_tied_weights_keys", None)  # transformers >= 5: {target: source}
    if tied is None:
        tied = getattr(model, "_tied_weights_keys", None) or ()  # transformers 4: [target, ...]
    return set(tied)


def export_state_dict(model) -> dict:
    """The model's state dict as saved in the export, tied copies dropped.

    Keys are exactly the module paths of the exported class (no checkpoint-format renames such as
    GPT-NeoX's `lm_head` → `embed_out`: the exported class is custom code, which transformers
    loads without the stock class's key conversions). Tensors are returned as they are (adapter
    weights are column-major views); a tensor sharing storage with an earlier one is cloned, as
    safetensors requires."""
    tied, seen, storages, out = _tied_keys(model), set(), set(), {}
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach()
        if tensor.device.type == "meta":
            raise ValueError(f"'{key}' has no data (meta tensor); load the model fully before exporting")
        ident = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and ident in seen and key in tied:
            continue  # tied to an earlier key; transformers ties it again on load
        seen.add(ident)
        storage = tensor.untyped_storage().data_ptr()
        out[key] = tensor.clone() if tensor.numel() and storage in storages else tensor
        storages.add(storage)
    return out


def write_weights(state: dict, folder: Path, max_shard_size: int | str) -> list[str]:
    """safetensors file(s) as transformers writes them: sharded past max_shard_size with an index.
    Each shard's tensors are made contiguous (row-major, the standard layout) only while it is written."""
    split = split_torch_state_dict_into_shards(state, filename_pattern="model{suffix}.safetensors",
                                               max_shard_size=max_shard_size)
    for filename, keys in split.filename_to_tensors.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": dict(split.metadata), "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return sorted(split.filename_to_tensors)


# --------------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------------
def _check_out_name(out: Path) -> None:
    if "." in out.name:
        raise UserError(f"export folder name '{out.name}' contains a '.', which breaks transformers' remote-code "
                         "module path (the folder name becomes a Python module name); choose a name without dots, "
                         f"e.g. '{out.name.replace('.', '_')}'")


def exported_config(meta: dict, config, model_cls: type) -> dict:
    """config.json of the export: the stock config with the rana model type, classes and adapters."""
    config_name, model_name = f"Rana{type(config).__name__}", f"Rana{model_cls.__name__}"
    out = json.loads(config.to_json_string(use_diff=True))  # what save_pretrained would write
    out.update({
        "model_type": f"rana_{config.model_type}",
        "architectures": [model_name],
        "auto_map": {"AutoConfig": f"{CONFIG_FILE[:-3]}.{config_name}",
                     "AutoModelForCausalLM": f"{MODELING_FILE[:-3]}.{model_name}"},
        "dtype": meta.get("dtype", "float32"),
        "torch_dtype": meta.get("dtype", "float32"),  # what transformers < 5 reads
        "rana_version": _rana_version(),
        "rana_format_version": meta.get("format_version"),
        "rana_adapters": meta["adapters"],
        "rana_laurel": meta.get("laurel") or None,
    })
    if meta.get("weights", "none") == "int8":  # the modules rebuilt as int8 before the weights load
        out.update({"rana_weights": "int8", "rana_int8": meta.get("int8")})
    return dict(sorted(out.items()))


def quantizer_format_config(meta: dict, config, model_cls: type) -> dict:
    """config.json of a quantizer-format export: the stock config (model type, architectures: what
    `transformers serve` and vLLM resolve) plus quantization_config {"quant_method": "rana", ...}
    (`rana.quantizer`), the weights guard plain transformers stops on without rana, and the auto_map
    of the shipped remote code (the fallback with trust_remote_code=True)."""
    remote = exported_config(meta, config, model_cls)
    out = json.loads(config.to_json_string(use_diff=True))
    out.update({
        "architectures": [model_cls.__name__],
        "auto_map": remote["auto_map"],
        "dtype": remote["dtype"],
        "torch_dtype": remote["torch_dtype"],
        "quantization_config": quantization_config_dict(meta, _rana_version()),
        "transformers_weights": WEIGHTS_GUARD,
    })
    return dict(sorted(out.items()))


def _rana_version() -> str | None:
    try:
        return version("rana")
    except Exception:  # not installed as a distribution
        return None


def export_folder(config: ExportConfig) -> Path:
    """`rana export` as a library call: `export` with the settings of one `ExportConfig` (checked first, as
    the command line checks them)."""
    config.validate()
    return export(config.src, config.out, overwrite=config.overwrite, max_shard_size=config.max_shard_size,
                  format=config.format)


def export(src_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False,
           max_shard_size: int | str = "2GB", format: str = FORMATS[0]) -> Path:
    """Write the rana folder `src_dir` as a folder `out_dir` that plain transformers loads.

    `format` "quantizer": the stock model class with quant_method "rana" (`rana.quantizer`; needs
    rana installed, no remote code), the remote code shipped as the fallback; "remote-code": a
    model type of its own, loaded with trust_remote_code=True and without rana.

    Atomic: `out_dir` appears complete or not at all. Raises ValueError for a source that is not
    a rana folder, an output name with a '.', or out == src; OutputExistsError (a ValueError)
    when `out_dir` exists and `overwrite` is False.
    """
    src, out = Path(src_dir), Path(out_dir)
    check_writable_dir(out, "--out")
    if format not in FORMATS:
        raise UserError(f"unknown export format '{format}'; choose one of {', '.join(FORMATS)}")
    _check_out_name(out)
    if not rana_io.is_rana_dir(src):
        raise UserError(f"'{src}' is not a rana folder (no {rana_io.RANA_CONFIG}); produce one with `rana compress`")
    if out.exists() and not overwrite:
        raise rana_io.OutputExistsError(f"output folder '{out}' already exists; choose another --out or pass --overwrite")
    check_output(out, [src], overwrite=overwrite)  # never the source, a folder holding it, or someone else's folder
    rana_io.check_folder(src)  # rana_config.json, plan.json, config.json, weight headers: one line each
    meta = rana_io.read_meta(src)
    model, _tokenizer = rana_io.load(src)
    sources = render_sources(model.config, type(model))  # fails before anything is written
    with rana_io.atomic_dir(out, overwrite=overwrite) as tmp:
        write_weights(export_state_dict(model), tmp, max_shard_size)
        for f in sorted(src.iterdir()):  # tokenizer, generation config, plan.json, README, ...
            if f.is_file() and f.name not in _NOT_COPIED and f.suffix != ".safetensors" and f.name not in sources:
                shutil.copy2(f, tmp / f.name)
        for name, text in sources.items():
            (tmp / name).write_text(text, encoding="utf-8")
        write_config = quantizer_format_config if format == "quantizer" else exported_config
        config = write_config(meta, model.config, type(model))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_export_card(tmp, src, out.name)  # README.md (model card, library transformers) + recipe.json
    return out
