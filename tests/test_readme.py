"""The README is the truth: every `rana` command and option it names exists (checked against
each command's `--help`), every method in its Methods table is accepted, and the Python API
names it uses are importable."""
import re
from functools import lru_cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rana.cli.app import app

README = Path(__file__).resolve().parents[1] / "README.md"
runner = CliRunner()
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
WIDE = {"COLUMNS": "250", "TERMINAL_WIDTH": "250"}  # help text must not be cut to 80 columns


@lru_cache(maxsize=None)
def help_text(*command: str) -> str:
    res = runner.invoke(app, [*command, "--help"], env=WIDE)
    assert res.exit_code == 0, f"`rana {' '.join(command)} --help` failed: {res.output}"
    return res.output


@lru_cache(maxsize=None)
def commands() -> frozenset[str]:
    """Sub-commands the root `rana --help` lists."""
    text = help_text()
    listed = set(re.findall(r"^\W*([a-z][a-z-]*)\s{2,}\S", text.split("Commands", 1)[-1], flags=re.M))
    assert {"compress", "eval"} <= listed, text
    return frozenset(listed)


def options_of(command: str) -> set[str]:
    return set(OPTION.findall(help_text(command))) | {"--help"}


def readme() -> str:
    return README.read_text(encoding="utf-8")


def section(title: str) -> str:
    text = readme()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def table_rows(text: str) -> list[list[str]]:
    """Markdown table rows (header and separator dropped), cells split on unescaped `|`."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("|") or set(line) <= set("|-: "):
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows.append(cells)
    return rows[1:]  # the header


def cli_table() -> list[tuple[str, set[str]]]:
    """(command, options named anywhere in its row) for each row of the README's CLI table."""
    out = []
    for cells in table_rows(section("CLI")):
        m = re.match(r"`rana ([a-z-]+)", cells[0])
        assert m, f"CLI table row does not start with `rana COMMAND`: {cells[0]}"
        out.append((m.group(1), set(OPTION.findall(" ".join(cells)))))
    return out


def command_lines() -> list[str]:
    """Every `rana …` invocation in the README: code-block lines (with `\\` continuations
    joined) and inline code spans; `… -m rana.cli CMD …` counts as `rana CMD …`."""
    text = readme()
    found = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            line = re.sub(r"^.*-m rana\.cli ", "rana ", line)
            if re.match(r"rana [a-z]", line):
                found.append(line)
    no_blocks = re.sub(r"```.*?```", "", text, flags=re.S)
    for span in re.findall(r"`([^`\n]+)`", no_blocks):
        span = re.sub(r"^.*-m rana\.cli ", "rana ", span)
        if re.match(r"rana [a-z]+\b", span) and not span.startswith(("rana.", "rana/")):
            found.append(span)
    return found


def test_cli_table_commands_and_options_exist():
    rows = cli_table()
    assert {c for c, _ in rows} >= {"compress", "eval", "sweep", "finetune", "export"}
    missing = []
    for command, options in rows:
        assert command in commands(), f"README's CLI table names `rana {command}`, which does not exist"
        missing += [f"rana {command} {o}" for o in sorted(options - options_of(command))]
    assert not missing, f"README's CLI table names options that --help does not list: {missing}"


def test_every_command_line_in_the_readme_is_real():
    lines = command_lines()
    assert any(line.startswith("rana compress smollm2-135m") for line in lines)
    missing = []
    for line in lines:
        command = line.split()[1]
        assert command in commands(), f"README runs `{line}`: no command `rana {command}`"
        missing += [f"`{line}`: {o}" for o in sorted(set(OPTION.findall(line)) - options_of(command))]
    assert not missing, "README command lines use options that do not exist:\n" + "\n".join(missing)


def test_every_option_the_readme_mentions_exists_somewhere():
    """Options in prose (`--allocation global`, `--flops F`, …) belong to some command."""
    no_blocks = re.sub(r"```.*?```", "", readme(), flags=re.S)
    spans = [s for s in re.findall(r"`([^`\n]+)`", no_blocks) if s.startswith("--")]
    assert spans
    every = set().union(*(options_of(c) for c in commands()))
    unknown = sorted({o for s in spans for o in OPTION.findall(s)} - every)
    assert not unknown, f"README mentions options no command has: {unknown}"


def test_allocation_and_recipe_are_compress_options():
    assert {"--allocation", "--recipe", "--flops", "--method", "--dataset"} <= options_of("compress")
    assert "uniform" in help_text("compress") and "global" in help_text("compress")


def test_methods_table_names_real_methods():
    from rana.compress.config import METHODS

    names = [re.match(r"`([a-z-]+)`", cells[0]).group(1) for cells in table_rows(section("Methods"))]
    assert names and set(names) == set(METHODS), (names, METHODS)
    assert all(m in help_text("compress") for m in METHODS)


def test_python_api_names_exist():
    """`rana.load`, `rana.io.save/load`, `rana.compress.compress/compress_model`, the math modules."""
    import importlib

    import rana

    api = section("Python API")
    for dotted in sorted(set(re.findall(r"\brana(?:\.[a-z_]+)+", api))):
        parts = dotted.split(".")
        for i in range(len(parts), 0, -1):  # the longest importable prefix, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            break
    for name in re.findall(r"from (rana[\w.]*) import ([\w, ]+)", api):
        module = importlib.import_module(name[0])
        for attr in name[1].split(","):
            assert hasattr(module, attr.strip()), f"{name[0]}.{attr.strip()}"
    assert "rana.load(" in api and callable(rana.load)


def test_make_targets_the_readme_names_exist():
    makefile = (README.parent / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    named = set(re.findall(r"(?m)^\s*make ([a-z][\w-]*)", readme()))
    assert {"demo", "test"} <= named <= targets, (named, targets)
    assert "make test" in (README.parent / ".ci" / "run").read_text()


@pytest.mark.parametrize("command", ["compress", "eval", "sweep", "finetune", "export"])
def test_help_is_complete_at_a_wide_width(command):
    """The parser above relies on --help listing options in full; compare with the command's params."""
    import typer.main

    click_cmd = typer.main.get_command(app).commands[command]
    declared = {o for p in click_cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}
    assert declared <= options_of(command), declared - options_of(command)
