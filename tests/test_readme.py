"""The README and the docs are the truth: every `rana` command line they show parses with the real
CLI, every option they name exists (checked against each command's `--help`), every method of the
Methods tables is accepted, the Python API names they use are importable, every relative link and
`#anchor` resolves, and the README stays short (≤ 16 KB; the rest lives in docs/ and
benchmarks/results/README.md)."""
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rana.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
RESULTS = ROOT / "benchmarks" / "results" / "README.md"
CLI_DOC = ROOT / "docs" / "cli.md"
METHOD_DOC = ROOT / "docs" / "method.md"
API_DOC = ROOT / "docs" / "python-api.md"
INSTALL_DOC = ROOT / "docs" / "install.md"
README_MAX_BYTES = 16 * 1024
runner = CliRunner()
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
WIDE = {"COLUMNS": "250", "TERMINAL_WIDTH": "250"}  # help text must not be cut to 80 columns
# fenced blocks whose lines are shell commands; diagrams use ```text and code ```python
SHELL_FENCES = {"", "bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", flags=re.S | re.M)
# options of other programs that the docs name in prose: `transformers serve` (docs/serving.md), lm_eval's
# `--model` / `--model_args`, benchmarks/gpu_suite.py's `--smoke` (docs/gpu.md), pip's `--extra-index-url`
# (docs/serving.md, vLLM's CPU build)
FOREIGN_OPTIONS = {"--continuous-batching", "--model-timeout", "--trust-remote-code", "--model", "--smoke",
                   "--extra-index-url"}


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


def click_command(command: str):
    """The click command Typer builds for `rana COMMAND` (typer may ship its own copy of click)."""
    import typer.main

    return typer.main.get_command(app).commands[command]


def declared_options(command: str) -> set[str]:
    return {o for p in click_command(command).params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


def options_of(command: str) -> set[str]:
    return set(OPTION.findall(help_text(command))) | {"--help"}


def read(path: Path = README) -> str:
    return path.read_text(encoding="utf-8")


def readme() -> str:
    return read(README)


def documents() -> list[Path]:
    """Every page whose commands and links are checked: the README, docs/*.md, the results page."""
    return [README, *DOCS, RESULTS]


def name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def section(title: str, path: Path = README, level: int = 2) -> str:
    text = read(path)
    mark = "\n" + "#" * level + " "
    start = text.index(f"{mark}{title}\n")
    end = text.find(mark, start + 1)
    return text[start:end if end != -1 else None]


def without_fences(text: str) -> str:
    return FENCE.sub("", text)


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
    """(command, options named anywhere in its row) for each row of docs/cli.md's commands table."""
    out = []
    for cells in table_rows(section("Commands at a glance", CLI_DOC)):
        m = re.match(r"`rana ([a-z-]+)", cells[0])
        assert m, f"CLI table row does not start with `rana COMMAND`: {cells[0]}"
        out.append((m.group(1), set(OPTION.findall(" ".join(cells)))))
    return out


def as_rana(line: str) -> str:
    """`… -m rana.cli CMD …` (torchrun, accelerate launch) counts as `rana CMD …`."""
    return re.sub(r"^.*-m rana\.cli ", "rana ", line)


def block_command_lines(text: str) -> list[str]:
    """`rana …` lines of the shell code blocks (`\\` continuations joined, comments dropped)."""
    found = []
    for info, block in FENCE.findall(text):
        if info.strip() not in SHELL_FENCES:
            continue
        for line in block.replace("\\\n", " ").splitlines():
            line = as_rana(line.split("#", 1)[0].strip())
            if re.match(r"rana [a-z]", line):
                found.append(line)
    return found


def span_command_lines(text: str) -> list[str]:
    """`rana …` inline code spans outside code blocks (these may hold placeholders: FILE, N, …)."""
    found = []
    for span in re.findall(r"`([^`\n]+)`", without_fences(text)):
        span = as_rana(span)
        if re.match(r"rana [a-z]+\b", span) and not span.startswith(("rana.", "rana/")):
            found.append(span)
    return found


def command_lines(text: str) -> list[str]:
    """Every `rana …` invocation of a page: code-block lines and inline code spans."""
    return block_command_lines(text) + span_command_lines(text)


def test_readme_is_short():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, (f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail to "
                                      "docs/ or benchmarks/results/README.md and link it")


def test_cli_table_commands_and_options_exist():
    rows = cli_table()
    assert {c for c, _ in rows} >= {"compress", "eval", "sweep", "finetune", "export", "quantize"}
    missing = []
    for command, options in rows:
        assert command in commands(), f"docs/cli.md's table names `rana {command}`, which does not exist"
        missing += [f"rana {command} {o}" for o in sorted(options - options_of(command))]
    assert not missing, f"docs/cli.md's table names options that --help does not list: {missing}"


@pytest.mark.parametrize("command", ["compress", "eval", "sweep", "finetune", "quantize", "export"])
def test_cli_reference_lists_every_option(command):
    """docs/cli.md's "Every option" has one table per command naming exactly the options it declares."""
    every = section("Every option", CLI_DOC)
    start = every.index(f"\n### `rana {command}`\n")
    end = every.find("\n### ", start + 1)
    listed = set(OPTION.findall(" ".join(cells[0] for cells in table_rows(every[start:end if end != -1 else None]))))
    declared = declared_options(command) - {"--help"}
    assert listed == declared, (f"docs/cli.md, `rana {command}`: missing {sorted(declared - listed)}, "
                                f"not options {sorted(listed - declared)}")


def test_every_command_line_in_the_readme_and_docs_is_real():
    assert any(line.startswith("rana compress smollm2-135m") for line in command_lines(readme()))
    missing = []
    for path in documents():
        for line in command_lines(read(path)):
            command = line.split()[1]
            assert command in commands(), f"{name(path)} runs `{line}`: no command `rana {command}`"
            missing += [f"{name(path)}: `{line}`: {o}"
                        for o in sorted(set(OPTION.findall(line)) - options_of(command))]
    assert not missing, "command lines use options that do not exist:\n" + "\n".join(missing)


def test_every_code_block_command_parses():
    """Each `rana …` line of a shell code block parses with the real CLI: right command, known options,
    values of the right type, the required arguments and options present."""
    lines = [(path, line) for path in [README, *DOCS] for line in block_command_lines(read(path))]
    assert len(lines) >= 10, lines
    failed = []
    for path, line in lines:
        _, command, *args = shlex.split(line)
        try:
            with click_command(command).make_context(command, list(args)):
                pass
        except Exception as e:  # click's UsageError / BadParameter (typer may vendor click: no one class)
            failed.append(f"{name(path)}: `{line}`: {type(e).__name__}: {getattr(e, 'format_message', e.__str__)()}")
    assert not failed, "code-block commands that the CLI rejects:\n" + "\n".join(failed)


def test_every_option_the_docs_mention_exists_somewhere():
    """Options in prose (`--allocation global`, `--flops F`, …) belong to some command (or, in the
    docs, to one of the other tools named in FOREIGN_OPTIONS)."""
    every = set().union(*(options_of(c) for c in commands())) | options_of_root()
    spans = [s for s in re.findall(r"`([^`\n]+)`", without_fences(readme())) if s.startswith("--")]
    assert spans
    unknown = sorted({o for s in spans for o in OPTION.findall(s)} - every)
    assert not unknown, f"README mentions options no command has: {unknown}"
    for path in [*DOCS, RESULTS]:
        spans = [s for s in re.findall(r"`([^`\n]+)`", without_fences(read(path))) if s.startswith("--")]
        unknown = sorted({o for s in spans for o in OPTION.findall(s)} - every - FOREIGN_OPTIONS)
        assert not unknown, f"{name(path)} mentions options no command has: {unknown}"


def options_of_root() -> set[str]:
    return set(OPTION.findall(help_text()))


def test_allocation_and_recipe_are_compress_options():
    assert {"--allocation", "--recipe", "--flops", "--method", "--dataset"} <= options_of("compress")
    assert "uniform" in help_text("compress") and "global" in help_text("compress")


def methods_of(table: str) -> list[str]:
    return [re.match(r"`([a-z-]+)`", cells[0]).group(1) for cells in table_rows(table)]


def test_methods_tables_name_real_methods():
    """The README's short Methods table and docs/method.md §9 (each method in full) list every method."""
    from rana.compress.config import METHODS

    for where, table in [("README.md", section("Methods")),
                         ("docs/method.md §9", section("9. The `--method` catalogue in full", METHOD_DOC))]:
        names = methods_of(table)
        assert names and set(names) == set(METHODS) and len(names) == len(set(names)), (where, names, METHODS)
    assert all(m in help_text("compress") for m in METHODS)


def check_api_names(api: str) -> None:
    import importlib

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
    for module_name, attrs in re.findall(r"from (rana[\w.]*) import ([\w, ]+)", api):
        module = importlib.import_module(module_name)
        for attr in attrs.split(","):
            assert hasattr(module, attr.strip()), f"{module_name}.{attr.strip()}"


def test_python_api_names_exist():
    """`rana.open`, `rana.load`, `rana.io.save/load`, `rana.compress.compress/compress_model`, the math
    modules: in the README's Python API section and in docs/python-api.md."""
    import rana

    api = section("Python API")
    check_api_names(api)
    check_api_names(read(API_DOC))
    assert "rana.open(" in api and callable(rana.open)
    assert "rana.load(" in api and callable(rana.load)


def test_make_targets_the_readme_names_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([a-z][\w-]*):", makefile, flags=re.M))
    make = re.compile(r"(?m)(?:^\s*|`)make ([a-z][\w-]*)")
    named = set(make.findall(readme()))
    assert {"demo", "test"} <= named, named
    for path in documents():
        assert set(make.findall(read(path))) <= targets, (name(path), set(make.findall(read(path))), targets)
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def slug(title: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title.strip())  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for title in re.findall(r"^#{1,6} +(.+?)\s*#*$", without_fences(read(path)), flags=re.M):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def test_slug_matches_github():
    assert slug("3. What `--flops F` means") == "3-what---flops-f-means"
    assert slug("Install (your own environment)") == "install-your-own-environment"


def test_every_relative_link_and_anchor_resolves():
    broken = []
    checked = 0
    for path in documents():
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", without_fences(read(path))):
            if re.match(r"[a-z][a-z+.-]*:", target):  # http:, https:, mailto:
                continue
            checked += 1
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                broken.append(f"{name(path)}: ({target}): no such file")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{name(path)}: ({target}): no heading #{anchor} in {dest.name}")
            elif ROOT not in dest.parents and dest != ROOT:
                broken.append(f"{name(path)}: ({target}): outside the repository")
    assert checked >= 20
    assert not broken, "broken links:\n" + "\n".join(broken)


@pytest.mark.parametrize("command", ["compress", "eval", "sweep", "finetune", "export"])
def test_help_is_complete_at_a_wide_width(command):
    """The parser above relies on --help listing options in full; compare with the command's params."""
    declared = declared_options(command)
    assert declared <= options_of(command), declared - options_of(command)
