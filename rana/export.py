"""`rana export`: a rana folder → a folder that loads with plain transformers (remote code).

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)

works without the `rana` package installed and gives the same logits as ``rana.io.load(src)``.

The output folder holds

* ``config.json``: the source model's config with ``model_type`` ``rana_<type>``, ``architectures``,
  ``auto_map``, ``dtype`` and ``rana_adapters`` (every adapter's path, type, shapes, rank and
  threshold, as in ``rana_config.json``) and ``rana_laurel`` (LAuReL settings or null);
* the weights as safetensors, sharded past ``max_shard_size`` with ``model.safetensors.index.json``;
* tokenizer files, ``generation_config.json`` and ``plan.json`` copied from the source folder;
* the remote code: ``configuration_rana.py`` and ``modeling_rana.py`` (rendered from
  ``rana/export_template/``) and *copies of the rana sources themselves* — the adapter modules
  (``common.py``, ``rank_linear.py``, ``neuron_linear.py``, ``cats.py``), the masked-GEMV kernels
  (``masked_gemv.py``, ``triton_gemv.py`` (triton imported lazily and optionally), ``ops.py`` (the
  torch.library ops the modules decode through) and ``cpu_gemv.py`` with the native CPU kernel's C source), LAuReL (``laurel.py``) and the architecture spec (``archspec.py``: the
  ``ArchSpec`` machinery of ``rana.archs.base`` plus this model's spec) — with their imports of one
  another rewritten to flat relative imports (``from ..kernels.masked_gemv import`` → ``from
  .masked_gemv import``, ``from rana.archs import`` → ``from .archspec import``), so the same code
  ships. Every shipped file is checked at export time: it may import only the standard library,
  torch, transformers and the other shipped files (anything else only inside ``try``, e.g. triton).
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
import shutil
import symtable
import sys
from pathlib import Path

from .archs import base as _archs_base
from .archs import get_arch
from .io.card import write_export_card

TEMPLATE_DIR = Path(__file__).parent / "export_template"
CONFIG_FILE = "configuration_rana.py"
MODELING_FILE = "modeling_rana.py"

# absolute module name in the rana package → basename of its copy in the export
SHIPPED_MODULES: dict[str, str] = {
    "rana.kernels.masked_gemv": "masked_gemv",
    "rana.kernels.cpu_gemv": "cpu_gemv",
    "rana.kernels.triton_gemv": "triton_gemv",
    "rana.kernels.ops": "ops",
    "rana.modules.common": "common",
    "rana.modules.rank_linear": "rank_linear",
    "rana.modules.neuron_linear": "neuron_linear",
    "rana.modules.cats": "cats",
    "rana.modules.laurel": "laurel",
}
ARCHSPEC_MODULE = "archspec"  # rendered from rana.archs.base + the model's ArchSpec
_IMPORT_ALIASES = {"rana.archs": ARCHSPEC_MODULE, "rana.archs.base": ARCHSPEC_MODULE}
_ALLOWED_TOP_LEVEL = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)
# rana-folder files that describe the rana format itself, not the exported model
_NOT_COPIED = {"config.json", "rana_config.json", "model.safetensors", "model.safetensors.index.json"}


class ExportError(RuntimeError):
    """A shipped source file would not load as remote code (a bug in rana, not a user error)."""


# --------------------------------------------------------------------------------------------
# source rendering
# --------------------------------------------------------------------------------------------
def _module_source(name: str) -> str:
    module = importlib.import_module(name)
    return Path(module.__file__).read_text(encoding="utf-8")


def _resolve(module_name: str, node: ast.ImportFrom) -> str | None:
    """Absolute module an ImportFrom refers to, seen from the (non-package) module `module_name`."""
    if node.level == 0:
        return node.module
    parts = module_name.split(".")[:-node.level]
    if not parts:
        return None
    return ".".join(parts + ([node.module] if node.module else []))


def _rewrite_imports(module_name: str, source: str, targets: dict[str, str]) -> str:
    """Rewrite imports of other shipped rana modules into flat relative imports.

    `from ..kernels.masked_gemv import masked_gemv` → `from .masked_gemv import masked_gemv`;
    imports of rana modules that are not shipped raise ExportError.
    """
    tree = ast.parse(source)
    lines = source.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "rana" or alias.name.startswith("rana."):
                    raise ExportError(f"{module_name}: `import {alias.name}` cannot ship in an export; "
                                      "use `from <module> import <name>`")
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        absolute = _resolve(module_name, node)
        if absolute is None or not (absolute == "rana" or absolute.startswith("rana.")):
            continue
        if node.module is None:  # `from . import x`: transformers would not copy x
            raise ExportError(f"{module_name}: `from {'.' * node.level} import ...` cannot ship in an export; "
                              "import names from the module instead")
        target = targets.get(absolute)
        if target is None:
            raise ExportError(f"{module_name} imports {absolute}, which is not shipped with exported models "
                              f"(shipped: {', '.join(sorted(targets))}); keep adapter modules torch-only")
        names = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
        start = offsets[node.lineno - 1] + node.col_offset
        end = offsets[node.end_lineno - 1] + node.end_col_offset
        edits.append((start, end, f"from .{target} import {names}"))
    for start, end, text in sorted(edits, reverse=True):
        source = source[:start] + text + source[end:]
    return source


def _render_archspec(spec) -> str:
    """rana.archs.base (the ArchSpec machinery) plus this model's spec, registered as SPEC."""
    source = _rewrite_imports(_archs_base.__name__, _module_source(_archs_base.__name__), {})
    fields = ", ".join(f"{f.name}={getattr(spec, f.name)!r}" for f in dataclasses.fields(spec))
    return (source.rstrip() + "\n\n\n# ---- rendered by `rana export`: the architecture of this model ----\n"
            f"SPEC = register(ArchSpec({fields}))\n")


def _replace_marker(source: str, marker: str, text: str) -> str:
    pattern = re.compile(rf"^[^\n]*# rana:{re.escape(marker)}[^\n]*$", re.MULTILINE)
    if len(pattern.findall(source)) != 1:
        raise ExportError(f"export template: marker 'rana:{marker}' must appear exactly once")
    return pattern.sub(lambda _m: text, source)


def _stock_import(cls: type, alias: str) -> str:
    import transformers

    if getattr(transformers, cls.__name__, None) is cls:
        return f"from transformers import {cls.__name__} as {alias}"
    if not cls.__module__.startswith("transformers."):
        raise ValueError(f"cannot export a model whose class {cls.__module__}.{cls.__name__} is not part of "
                         "transformers (remote-code source models are not supported)")
    return f"from {cls.__module__} import {cls.__name__} as {alias}"


def _install_function_source() -> str:
    from . import io as rana_io

    return inspect.getsource(rana_io.install_empty_adapters)


def render_sources(config, model_cls: type) -> dict[str, str]:
    """{file name: source} of the remote code for a model of `config` / stock class `model_cls`."""
    spec = get_arch(config)
    stock_type = config.model_type
    rana_type = f"rana_{stock_type}"
    config_name, model_name = f"Rana{type(config).__name__}", f"Rana{model_cls.__name__}"
    spec = dataclasses.replace(spec, model_types=(stock_type, rana_type))
    targets = {**SHIPPED_MODULES, **_IMPORT_ALIASES}
    files = {f"{short}.py": _rewrite_imports(name, _module_source(name), targets)
             for name, short in SHIPPED_MODULES.items()}
    files[f"{ARCHSPEC_MODULE}.py"] = _render_archspec(spec)

    cfg = (TEMPLATE_DIR / CONFIG_FILE).read_text(encoding="utf-8")
    cfg = _replace_marker(cfg, "stock-config-import", _stock_import(type(config), "_StockConfig"))
    cfg = _replace_marker(cfg, "model-type", f"    model_type = {rana_type!r}")
    files[CONFIG_FILE] = re.sub(r"\bRanaConfig\b", config_name, cfg)

    mdl = (TEMPLATE_DIR / MODELING_FILE).read_text(encoding="utf-8")
    mdl = _replace_marker(mdl, "stock-model-import", _stock_import(model_cls, "_StockForCausalLM"))
    mdl = _replace_marker(mdl, "install-empty-adapters", _install_function_source().rstrip() + "\n")
    mdl = re.sub(r"\bRanaConfig\b", config_name, mdl)
    files[MODELING_FILE] = re.sub(r"\bRanaForCausalLM\b", model_name, mdl)
    check_sources(files)
    return files


# --------------------------------------------------------------------------------------------
# checks: what transformers' remote-code loader needs
# --------------------------------------------------------------------------------------------
_RELATIVE_IMPORT_RE = re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE)  # as transformers finds them


def _top_level_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _unguarded_imports(node: ast.AST):
    """(node, top-level module) of absolute imports outside try blocks (transformers checks those)."""
    if isinstance(node, ast.Try):
        return
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield node, alias.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        yield node, node.module.split(".")[0]
    for child in ast.iter_child_nodes(node):
        yield from _unguarded_imports(child)


def _global_names(source: str) -> set[str]:
    """Global names a module's functions and classes read (symtable), recursively."""
    out: set[str] = set()

    def walk(table):
        if table.get_type() != "module":
            for sym in table.get_symbols():
                if sym.is_global() and sym.is_referenced():
                    out.add(sym.get_name())
        for child in table.get_children():
            walk(child)

    walk(symtable.symtable(source, "<export>", "exec"))
    return out


def check_sources(files: dict[str, str]) -> None:
    """Raise ExportError unless every file imports only stdlib/torch/transformers (outside try) and
    shipped files, every relatively imported name exists, and no function reads an undefined global."""
    import builtins

    trees = {name: ast.parse(src, filename=name) for name, src in files.items()}
    defined = {name.removesuffix(".py"): _top_level_names(tree) for name, tree in trees.items()}
    for name, tree in trees.items():
        for node, top in _unguarded_imports(tree):
            if top not in _ALLOWED_TOP_LEVEL:
                raise ExportError(f"{name}: unguarded `import {top}` (line {node.lineno}) would break loading "
                                  "where it is not installed; only stdlib, torch and transformers may be imported "
                                  "outside try blocks")
        for module in _RELATIVE_IMPORT_RE.findall(files[name]):
            if module not in defined:
                raise ExportError(f"{name}: relative import of '.{module}', which is not shipped")
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                if node.level != 1 or node.module not in defined:
                    raise ExportError(f"{name}: relative import (line {node.lineno}) must be `from .<shipped> import`")
                missing = [a.name for a in node.names if a.name not in defined[node.module]]
                if missing:
                    raise ExportError(f"{name}: {', '.join(missing)} not defined in shipped {node.module}.py")
        undefined = _global_names(files[name]) - defined[name.removesuffix(".py")] - set(dir(builtins))
        if undefined:
            raise ExportError(f"{name}: uses undefined globals {sorted(undefined)}")


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
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

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
        raise ValueError(f"export folder name '{out.name}' contains a '.', which breaks transformers' remote-code "
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
    return dict(sorted(out.items()))


def _rana_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("rana")
    except Exception:  # not installed as a distribution
        return None


def export(src_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False,
           max_shard_size: int | str = "2GB") -> Path:
    """Write the rana folder `src_dir` as a plain-transformers remote-code folder `out_dir`.

    Atomic: `out_dir` appears complete or not at all. Raises ValueError for a source that is not
    a rana folder, an output name with a '.', or out == src; OutputExistsError (a ValueError)
    when `out_dir` exists and `overwrite` is False.
    """
    from . import io as rana_io
    from .io.paths import check_output

    src, out = Path(src_dir), Path(out_dir)
    _check_out_name(out)
    if not rana_io.is_rana_dir(src):
        raise ValueError(f"'{src}' is not a rana folder (no {rana_io.RANA_CONFIG}); produce one with `rana compress`")
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
        config = exported_config(meta, model.config, type(model))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_export_card(tmp, src, out.name)  # README.md (model card, library transformers) + recipe.json
    return out


__all__ = ["export", "render_sources", "check_sources", "ExportError", "SHIPPED_MODULES"]
