"""`make demo` (`python -m rana.cli.demo`) end to end on a tiny model, and the bundled texts it uses:
calibration and held-out text are different documents."""
import json
import re

import pytest

from helpers import tiny_model_dir
from rana.data import BUNDLED_CORPUS, BUNDLED_HELDOUT


def paragraphs(text: str) -> set[str]:
    """Prose paragraphs (whitespace-normalised, ≥ 120 characters): what would leak if the texts overlapped."""
    out = set()
    for p in re.split(r"\n\s*\n", text):
        p = " ".join(p.split())
        if len(p) >= 120:
            out.add(p)
    return out


def test_calibration_and_heldout_texts_differ():
    calib, held = BUNDLED_CORPUS.read_text(), BUNDLED_HELDOUT.read_text()
    assert 100_000 < len(held.encode()) < 250_000
    shared = paragraphs(calib) & paragraphs(held)
    assert paragraphs(held) and not shared, sorted(shared)[:3]
    long_lines = lambda t: {line.strip() for line in t.splitlines() if len(line.strip()) >= 70}  # noqa: E731
    assert not long_lines(calib) & long_lines(held)
    titles = lambda t: set(re.findall(r"^(?:\*+|=+)\n(.+)\n(?:\*+|=+)$", t, flags=re.M))  # noqa: E731
    assert titles(held) and not titles(calib) & titles(held)


def test_bundled_texts_ship_as_package_data():
    from pathlib import Path

    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    package_data = pyproject.split("[tool.setuptools.package-data]", 1)[1].split("\n[", 1)[0]
    assert '"assets/*"' in package_data and BUNDLED_HELDOUT.parent.name == "assets" and BUNDLED_HELDOUT.is_file()


def test_demo_runs_end_to_end_on_a_tiny_model(tmp_path, capsys):
    from rana.cli import demo

    model = tiny_model_dir(tmp_path / "tiny")
    out = tmp_path / "demo"
    code = demo.main(["--model", str(model), "--out", str(out), "--flops", "0.7", "--calib-tokens", "1024",
                      "--eval-tokens", "640", "--seq-len", "64", "--grid-step", "0.5", "--latency-tokens", "4",
                      "--latency-repeats", "1"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    results = json.loads((out / "results.json").read_text())
    dense, comp = results["models"]
    assert dense["flops"]["fraction"] == pytest.approx(1.0) and comp["flops"]["fraction"] < 0.8
    assert comp["flops"]["tokens"] == 640 - 640 % 64  # measured on the held-out tokens, not on calibration ones
    assert results["evaluation_text"] == BUNDLED_HELDOUT.name != results["calibration_text"]
    assert comp["latency"]["latency_ratio"] > 0 and dense["latency"]["tokens_per_s"] > 0
    folder = out / "tiny-rana70"
    assert (folder / "recipe.json").is_file() and (out / "demo.png").stat().st_size > 10_000
    card = (folder / "README.md").read_text()
    assert "## Evaluation (held-out text)" in card and f"{comp['ppl'][BUNDLED_HELDOUT.stem]['ppl']:.3f}" in card
    assert "outputs in" in printed and "demo.png" in printed and "ppl" in printed


def test_demo_reports_user_errors_in_one_line(tmp_path, capsys):
    from rana.cli import demo

    code = demo.main(["--model", "no-such-model-xyz", "--out", str(tmp_path / "o")])
    assert code == 2
    err = capsys.readouterr().err
    assert "unknown model" in err and "Traceback" not in err


def test_make_demo_runs_the_demo_module():
    """The Makefile's demo target runs a module that exists and is the one tested above."""
    import importlib.util
    from pathlib import Path

    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    recipe = makefile.split("\ndemo:", 1)[1].split("\n\n", 1)[0]
    modules = re.findall(r"-m ([\w.]+)", recipe)
    assert modules == ["rana.cli.demo"], modules
    assert importlib.util.find_spec(modules[0]) is not None
