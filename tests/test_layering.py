"""The house rules, read from the source: which part of rana may import which.

The tiers (docs/design.md "Four tiers"):

* leaves — `rana.units`, `rana.errors`, `rana.settings`, `rana.archs`, `rana.math`, `rana.kernels` — know nothing of rana;
* building blocks — `rana.modules`, `rana.data`, `rana.accounting`, `rana.io`, `rana.methods`, … —
  never import a command package;
* one package per command — `rana.compress`, `rana.finetune`, `rana.evaluation`, `rana.sweep`,
  `rana.export` — which do not import each other (the sweep runs compress and evaluation);
* the face — `rana.cli` — which nothing in the library imports.

`cli/` and `kernels/` are top-level folders of the repository installed as `rana.cli` and
`rana.kernels` (pyproject.toml), so this test maps them the same way. Every import statement
counts, at module level or inside a function, except those under `if TYPE_CHECKING:`, which count
for the import-cycle check alone.
"""
from __future__ import annotations

import ast
import re
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = {"rana": ROOT / "rana", "rana.cli": ROOT / "cli", "rana.kernels": ROOT / "kernels"}
# shipped with exports and loaded as flat remote-code files: not part of the import graph
SKIP_DIRS = {ROOT / "rana" / "export" / "template"}

LEAVES = ("rana.units", "rana.errors", "rana.settings", "rana.archs", "rana.math", "rana.kernels")
COMMANDS = ("rana.compress", "rana.finetune", "rana.evaluation", "rana.sweep", "rana.export")
ALLOWED_BETWEEN_COMMANDS = {("rana.sweep", "rana.compress"), ("rana.sweep", "rana.evaluation")}
FACE = "rana.cli"


def _module_name(path: Path) -> str | None:
    for prefix, folder in SOURCES.items():
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            return ".".join([prefix, *parts])
    return None


@lru_cache(maxsize=None)
def modules() -> dict[str, Path]:
    found = {}
    for prefix, folder in SOURCES.items():
        for path in folder.rglob("*.py"):
            if any(path.is_relative_to(d) for d in SKIP_DIRS) or "__pycache__" in path.parts:
                continue
            found[_module_name(path)] = path
    return found


def _is_package(name: str) -> bool:
    return modules()[name].name == "__init__.py"


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _resolve(name: str, candidates: list[str]) -> str | None:
    """The rana module an imported name lands in: the longest known module prefix."""
    for cand in candidates:
        parts = cand.split(".")
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in modules():
                return prefix
    return None


@lru_cache(maxsize=None)
def imports_of(name: str, type_checking: bool = False) -> frozenset[str]:
    """rana modules that module `name` imports (any statement; those under TYPE_CHECKING only when
    `type_checking`)."""
    path = modules()[name]
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = set() if type_checking else _type_checking_lines(tree)
    package = name if _is_package(name) else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "rana" or alias.name.startswith("rana."):
                    found.add(_resolve(name, [alias.name]))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target != "rana" and not target.startswith("rana."):
                continue
            # `from pkg import sub` may name a submodule: count the submodule, not only the package
            found.add(_resolve(name, [f"{target}.{a.name}" for a in node.names] + [target]))
    found.discard(None)
    found.discard(name)
    return frozenset(found)


def _top(name: str, groups) -> str | None:
    return next((g for g in groups if name == g or name.startswith(g + ".")), None)


def test_sources_found():
    names = modules()
    assert "rana.units" in names and "rana.cli.app" in names and "rana.kernels.ops" in names
    assert any(n.startswith("rana.compress") for n in names)


@pytest.mark.parametrize("type_checking", [False, True], ids=["runtime", "with-type-checking"])
def test_no_import_cycles(type_checking):
    """No module reaches itself through imports, even through type hints: two modules that need each
    other's names are split the wrong way (move what both need to the lower one)."""
    graph = {name: imports_of(name, type_checking) for name in modules()}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [nxt]
                pytest.fail("import cycle: " + " → ".join(cycle))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_nothing_of_rana(leaf):
    for name in modules():
        if _top(name, [leaf]):
            outside = {m for m in imports_of(name) if not _top(m, [leaf, "rana.errors"])}
            assert not outside, f"{name} is a leaf but imports {sorted(outside)}"


def test_modules_import_only_kernels_and_archs():
    for name in modules():
        if _top(name, ["rana.modules"]):
            outside = {m for m in imports_of(name) if not _top(m, ["rana.modules", "rana.kernels", "rana.archs", "rana.errors"])}
            assert not outside, f"{name} (adapters, shipped with exports) imports {sorted(outside)}"


def test_building_blocks_import_no_command():
    for name in modules():
        if _top(name, COMMANDS) or _top(name, [FACE]) or name == "rana":
            continue
        commands = {m for m in imports_of(name) if _top(m, COMMANDS)}
        assert not commands, f"{name} is a building block but imports the command package(s) {sorted(commands)}"


def test_commands_do_not_import_each_other():
    for name in modules():
        own = _top(name, COMMANDS)
        if own is None:
            continue
        for m in imports_of(name):
            other = _top(m, COMMANDS)
            if other and other != own:
                assert (own, other) in ALLOWED_BETWEEN_COMMANDS, f"{name} ({own}) imports {m} ({other})"


def test_nothing_in_the_library_imports_the_cli():
    for name in modules():
        if _top(name, [FACE]):
            continue
        assert not any(_top(m, [FACE]) for m in imports_of(name)), f"{name} imports the CLI"


_PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")


def _private_uses(path: Path) -> list[str]:
    """`_private` names a test takes from rana: imported, read off an imported rana module, or
    named in a dotted string (monkeypatch.setattr("rana.x._y", ...))."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rana_aliases = set()
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and (node.module == "rana" or node.module.startswith("rana.")):
            for a in node.names:
                if _PRIVATE.match(a.name):
                    uses.append(f"from {node.module} import {a.name}")
                elif f"{node.module}.{a.name}" in modules():
                    rana_aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "rana" or a.name.startswith("rana."):
                    rana_aliases.add(a.asname or a.name.split(".")[0])
                    if any(_PRIVATE.match(p) for p in a.name.split(".")):
                        uses.append(f"import {a.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"rana(\.\w+)*\._[A-Za-z0-9]\w*", node.value):
                uses.append(repr(node.value))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _PRIVATE.match(node.attr):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in rana_aliases:
                uses.append(ast.unparse(node))
    return uses


def test_tests_use_no_private_names():
    offenders = {}
    for path in sorted((ROOT / "tests").glob("*.py")):
        uses = _private_uses(path)
        if uses:
            offenders[path.name] = sorted(set(uses))
    assert not offenders, f"tests reach into private names (make them public units or test the public API): {offenders}"


def test_the_rules_catch_what_they_claim(tmp_path):
    """The checks themselves can fail: a private import and a private attribute are found."""
    probe = tmp_path / "test_probe.py"
    probe.write_text("from rana.units import _UNITS\nimport rana.units as u\nx = u._UNITS\n"
                     "s = 'rana.units._UNITS'\n")
    assert len(_private_uses(probe)) == 3
