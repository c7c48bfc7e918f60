"""The remote code an export ships, rendered from rana's own sources and checked.

What ships (`SHIPPED_MODULES`) is derived, not listed: the modules of the registered adapter kinds
(rana.modules.registry) and the rana files the template imports (``rebuild.py``, ``groups.py``, and
``loadchecks.py``: the schema and tensor checks rana.load and rana's quantizer run, from rana.io),
plus everything they import of rana (the masked-GEMV kernels, LAuReL, ...), so a new adapter module
ships by registering. They are copied flat with their imports of one another rewritten to flat
relative imports (``from ..kernels.route import`` → ``from .route import``, ``from
rana.archs import`` → ``from .archspec import``); ``archspec.py`` is ``rana.archs.base`` plus this
model's spec; the kernels' data files are inlined (the GEMV tuning table into ``triton_gemv.py``, the C
source into ``cpu_gemv.py``: transformers copies only the .py files of remote code); ``configuration_rana.py`` and ``modeling_rana.py`` are rendered from ``template/``
(the latter importing every adapter module, so that its kinds register). `check_sources` then proves with ast and
symtable what transformers' remote-code loader needs: every file imports only the standard
library, torch, transformers and the other shipped files (anything else only inside ``try``,
e.g. triton), every relatively imported name exists, and no function reads an undefined global.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import re
import symtable
import sys
from pathlib import Path

import transformers

from ..archs import base as _archs_base
from ..archs import get_arch
from ..errors import UserError
from ..modules.registry import adapter_classes

TEMPLATE_DIR = Path(__file__).parent / "template"
CONFIG_FILE = "configuration_rana.py"
MODELING_FILE = "modeling_rana.py"
ARCHSPEC_MODULE = "archspec"  # rendered from rana.archs.base + the model's ArchSpec
_IMPORT_ALIASES = {"rana.archs": ARCHSPEC_MODULE, "rana.archs.base": ARCHSPEC_MODULE}
_ALLOWED_TOP_LEVEL = {"torch", "transformers", "__future__"} | set(sys.stdlib_module_names)
# the template sits beside the shipped copies of rana.modules: `from .rebuild import` is rana.modules.rebuild's
_TEMPLATE_PACKAGE = "rana.modules"
# what the template imports from elsewhere in rana: the checks every loader runs (rana.load and the quantizer
# import the same module), so an export checks its record and weights with rana's source, not a rewrite of it
_TEMPLATE_MODULES = {"loadchecks": "rana.io.loadchecks"}


class ExportError(RuntimeError):
    """A shipped source file would not load as remote code (a bug in rana, not a user error)."""


# --------------------------------------------------------------------------------------------
# source rendering
# --------------------------------------------------------------------------------------------
def module_source(name: str) -> str:
    """The source text of rana module `name` (e.g. "rana.kernels.cpu_gemv"), as it ships."""
    module = importlib.import_module(name)
    return Path(module.__file__).read_text(encoding="utf-8")


def _rana_imports(module_name: str, source: str) -> list[str]:
    """The rana modules `source` (of rana module `module_name`) imports, in the order it names them."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            absolute = _resolve(module_name, node)
            if absolute is not None and (absolute == "rana" or absolute.startswith("rana.")):
                found.append(absolute)
    return list(dict.fromkeys(found))


def _template_imports() -> list[str]:
    """The rana modules the modeling template imports (its relative imports, but the rendered files): those of
    rana.modules by their name, the others as `_TEMPLATE_MODULES` names them."""
    rendered = {ARCHSPEC_MODULE, CONFIG_FILE.removesuffix(".py")}
    tree = ast.parse((TEMPLATE_DIR / MODELING_FILE).read_text(encoding="utf-8"))
    return [_TEMPLATE_MODULES.get(node.module, f"{_TEMPLATE_PACKAGE}.{node.module}") for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module not in rendered]


def shipped_modules() -> dict[str, str]:
    """{absolute module name in the rana package: basename of its copy in the export}: the modules of every
    registered adapter kind and those the template imports, and every rana module they import (rana.archs
    ships as archspec.py, rendered: what rana.archs.base imports ships). Sorted by module name."""
    wanted = [cls.__module__ for cls in adapter_classes()] + _template_imports()
    seen: set[str] = set()
    while wanted:
        name = wanted.pop()
        if name in seen:
            continue
        seen.add(name)
        source_of = _archs_base.__name__ if name in _IMPORT_ALIASES else name
        try:
            module = importlib.import_module(source_of)
        except ImportError:
            raise ExportError(f"the export would ship {name}, which does not exist") from None
        if hasattr(module, "__path__"):
            raise ExportError(f"{name} is a package, which cannot ship flat; import names from its modules")
        wanted += _rana_imports(source_of, module_source(source_of))
    out = {name: name.rsplit(".", 1)[-1] for name in sorted(seen - set(_IMPORT_ALIASES))}
    basenames = list(out.values())
    clash = sorted({b for b in basenames if basenames.count(b) > 1} | ({ARCHSPEC_MODULE} & set(basenames)))
    if clash:
        raise ExportError(f"shipped modules would share the file name(s) {', '.join(f'{b}.py' for b in clash)} in an export")
    return out


def _resolve(module_name: str, node: ast.ImportFrom) -> str | None:
    """Absolute module an ImportFrom refers to, seen from the (non-package) module `module_name`."""
    if node.level == 0:
        return node.module
    parts = module_name.split(".")[:-node.level]
    if not parts:
        return None
    return ".".join(parts + ([node.module] if node.module else []))


def rewrite_imports(module_name: str, source: str, targets: dict[str, str]) -> str:
    """Rewrite imports of other shipped rana modules into flat relative imports.

    `from ..kernels.route import decode_masked` → `from .route import decode_masked`;
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


def __getattr__(name: str):
    # SHIPPED_MODULES ({rana module: basename of its copy in an export}) is derived when asked for, not when
    # rana.export is imported (every `rana` command imports it): walking the import graph reads a dozen sources,
    # and a kind registered later ships too
    if name == "SHIPPED_MODULES":
        return shipped_modules()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _render_archspec(spec, shipped: dict[str, str]) -> str:
    """rana.archs.base (the ArchSpec machinery) plus this model's spec, registered as SPEC."""
    source = rewrite_imports(_archs_base.__name__, module_source(_archs_base.__name__), shipped)
    fields = ", ".join(f"{f.name}={getattr(spec, f.name)!r}" for f in dataclasses.fields(spec))
    return (source.rstrip() + "\n\n\n# ---- rendered by `rana export`: the architecture of this model ----\n"
            f"SPEC = register(ArchSpec({fields}))\n")


def _replace_marker(source: str, marker: str, text: str) -> str:
    pattern = re.compile(rf"^[^\n]*# rana:{re.escape(marker)}[^\n]*$", re.MULTILINE)
    if len(pattern.findall(source)) != 1:
        raise ExportError(f"export template: marker 'rana:{marker}' must appear exactly once")
    return pattern.sub(lambda _m: text, source)


def _stock_import(cls: type, alias: str) -> str:
    if getattr(transformers, cls.__name__, None) is cls:
        return f"from transformers import {cls.__name__} as {alias}"
    if not cls.__module__.startswith("transformers."):
        raise UserError(f"cannot export a model whose class {cls.__module__}.{cls.__name__} is not part of "
                         "transformers (remote-code source models are not supported)")
    return f"from {cls.__module__} import {cls.__name__} as {alias}"


def _adapter_module_imports(shipped: dict[str, str]) -> str:
    """The template's imports of every module that registers adapter kinds, in registration order (the
    export's registry then holds the kinds rana's does, in the same order)."""
    classes: dict[str, list[str]] = {}
    for cls in adapter_classes():
        classes.setdefault(cls.__module__, []).append(cls.__name__)
    lines = [f"from .{shipped[module]} import {', '.join(names)}" for module, names in classes.items()]
    return "\n".join(["# the adapter modules: importing one registers its adapter kinds (registry.py)", *lines])


def inline_gemv_table(source: str) -> str:
    """The masked-GEMV kernel with its tuning table inlined (remote code ships .py files only)."""
    from ..kernels import triton_gemv

    table = triton_gemv.read_table()  # a Python literal (JSON's true/null are not Python)
    return _replace_marker(source, "shipped-gemv-table", f"SHIPPED_TABLE: dict | None = {table!r}")


def inline_c_source(source: str) -> str:
    """The native CPU kernel's loader with its C source inlined (remote code ships .py files only); the text is
    the one rana compiles, so an export and rana share the cached library."""
    from ..kernels import cpu_gemv

    return _replace_marker(source, "shipped-c-source", f"SHIPPED_SOURCE: str | None = {cpu_gemv.source()!r}")


def render_sources(config, model_cls: type) -> dict[str, str]:
    """{file name: source} of the remote code for a model of `config` / stock class `model_cls`."""
    spec = get_arch(config)
    stock_type = config.model_type
    rana_type = f"rana_{stock_type}"
    config_name, model_name = f"Rana{type(config).__name__}", f"Rana{model_cls.__name__}"
    spec = dataclasses.replace(spec, model_types=(stock_type, rana_type))
    shipped = shipped_modules()
    targets = {**shipped, **_IMPORT_ALIASES}
    files = {f"{short}.py": rewrite_imports(name, module_source(name), targets) for name, short in shipped.items()}
    files["triton_gemv.py"] = inline_gemv_table(files["triton_gemv.py"])
    files["cpu_gemv.py"] = inline_c_source(files["cpu_gemv.py"])
    files[f"{ARCHSPEC_MODULE}.py"] = _render_archspec(spec, shipped)

    cfg = (TEMPLATE_DIR / CONFIG_FILE).read_text(encoding="utf-8")
    cfg = _replace_marker(cfg, "stock-config-import", _stock_import(type(config), "_StockConfig"))
    cfg = _replace_marker(cfg, "model-type", f"    model_type = {rana_type!r}")
    files[CONFIG_FILE] = re.sub(r"\bRanaConfig\b", config_name, cfg)

    mdl = (TEMPLATE_DIR / MODELING_FILE).read_text(encoding="utf-8")
    mdl = _replace_marker(mdl, "stock-model-import", _stock_import(model_cls, "_StockForCausalLM"))
    mdl = _replace_marker(mdl, "adapter-modules", _adapter_module_imports(shipped))
    mdl = re.sub(r"\bRanaConfig\b", config_name, mdl)
    files[MODELING_FILE] = re.sub(r"\bRanaForCausalLM\b", model_name, mdl)
    check_sources(files)
    return files


# --------------------------------------------------------------------------------------------
# checks: what transformers' remote-code loader needs
# --------------------------------------------------------------------------------------------
_RELATIVE_IMPORT_RE = re.compile(r"^\s*from\s+\.(\S+)\s+import", re.MULTILINE)  # as transformers finds them


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at its top level, including inside module-level `if` / `try` blocks (the
    optional Triton kernels are defined under `if triton is not None:`)."""
    names = set()
    for node in _module_level_statements(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return names


def _module_level_statements(body):
    for node in body:
        yield node
        if isinstance(node, ast.If):
            yield from _module_level_statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            handlers = [stmt for h in node.handlers for stmt in h.body]
            yield from _module_level_statements(node.body + handlers + node.orelse + node.finalbody)


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
