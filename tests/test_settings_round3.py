"""Issue 39, causes 3 and 4 (the settings' part): every option and every recipe value is checked by its
settings field (`rana.settings`: type and range) before anything is loaded, whether it came from the
command line, a recipe or a library call; no option takes an empty text (an empty path is the current
folder, which `--dataset ''` read whole); recipes from a newer rana and JSON nested past any recipe are
refused; and `python -m rana.cli.demo --flops nan` is one line, not a traceback.

Cheap: each refusal comes before any model loads, which `nothing_loads` turns into a test failure."""
from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import tiny_model_dir, one_line_error
from rana.cli.app import app
from rana.compress import CompressConfig
from rana.errors import UserError
from rana.evaluation import EvalConfig
from rana.export.config import ExportConfig
from rana.finetune import FinetuneConfig
from rana.quantize.config import QuantizeConfig
from rana.sweep import SweepConfig

runner = CliRunner()
HUGE_SEED = "99999999999999999999"  # past numpy's and torch's seed range: OverflowError deep in a run


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A tiny dense model, a text, a folder standing for a rana folder (nothing reads it: the refusal
    comes first), and `here`, the current folder of the commands, holding a user's text and work folder
    that an empty path would read or fill."""
    root = tmp_path_factory.mktemp("settings3")
    tiny_model_dir(root / "tiny")
    (root / "held.txt").write_text("hello world " * 500)
    (root / "src").mkdir()
    (root / "here" / "activations").mkdir(parents=True)
    (root / "here" / "notes.txt").write_text("a user's notes, not calibration text " * 100)
    return root


@pytest.fixture
def nothing_loads(monkeypatch, work):
    """Fail the test if the command gets as far as loading a model, or starting a compression or an
    evaluation: the bad value must be refused before. Runs in `work/here` (an empty path would name it)."""
    import transformers

    import rana.compress
    import rana.evaluation.run

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the bad value was reported")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(rana.evaluation.run, "open_model", refuse)
    monkeypatch.setattr(rana.compress, "compress", refuse)
    monkeypatch.chdir(work / "here")


def _run(work, template: list[str]):
    return runner.invoke(app, [a.format(w=work) for a in template])


# --------------------------------------------------------------------------- cause 3: empty paths

# every command with good settings for the tiny model (256 positions), but for the one value a test changes;
# quantize and export name a folder that is not a rana folder: their options are checked before it is looked at
SMALL = ["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4"]
COMPRESS = ["compress", "{w}/tiny", *SMALL, "--out", "{w}/out"]
FINETUNE = ["finetune", "{w}/tiny", "--full", "--tokens", "1024", "--seq-len", "32", "--out", "{w}/ft"]
EVAL = ["eval", "{w}/tiny", "--ppl-data", "{w}/held.txt", "--seq-len", "64"]
QUANTIZE = ["quantize", "{w}/src", "--weights", "int8", "--out", "{w}/q"]
SWEEP = ["sweep", "{w}/tiny", "--ppl-data", "{w}/held.txt", *SMALL, "--out", "{w}/sweep"]
EXPORT = ["export", "{w}/src", "--out", "{w}/exported"]


@pytest.mark.parametrize("empty", ["", "  "], ids=["empty", "blank"])
@pytest.mark.parametrize("command, option", [
    (COMPRESS, "--dataset"), (COMPRESS, "--offload-dir"), (COMPRESS, "--out"), (EVAL, "--ppl-data"),
    (EVAL, "--json"), (FINETUNE, "--data"), (FINETUNE, "--eval-data"), (FINETUNE, "--checkpoint-dir"),
    (FINETUNE, "--out"), (QUANTIZE, "--dataset"), (QUANTIZE, "--out"), (SWEEP, "--dataset"), (SWEEP, "--ppl-data"),
    (EXPORT, "--out"),
], ids=lambda x: x if isinstance(x, str) else x[0])
def test_an_empty_path_option_is_refused_not_read_as_the_current_folder(work, nothing_loads, command, option, empty):
    one_line_error(_run(work, [*command, option, empty]), option, "is empty")


def test_an_empty_model_argument_is_refused(work, nothing_loads):
    one_line_error(runner.invoke(app, ["eval", "", "--ppl-data", str(work / "held.txt")]), "MODELS", "is empty")


# --------------------------------------------------------------------------- cause 4: values nobody checked


@pytest.mark.parametrize("command, option, value, needle", [
    (COMPRESS, "--seed", HUGE_SEED, "must be in [0, 4294967295]"),
    (COMPRESS, "--seed", "-1", "must be in [0, 4294967295]"),
    (FINETUNE, "--seed", HUGE_SEED, "must be in [0, 4294967295]"),
    (QUANTIZE, "--seed", HUGE_SEED, "must be in [0, 4294967295]"),
    (SWEEP, "--seed", HUGE_SEED, "must be in [0, 4294967295]"),
    (FINETUNE, "--laurel-rank", "0", "must be a positive integer"),
    (FINETUNE, "--laurel-rank", "-1", "must be a positive integer"),
    (FINETUNE, "--laurel-history", "-1", "must be a positive integer"),
    (EVAL, "--limit", "nan", "must be a finite number"),
    (EVAL, "--limit", "inf", "must be a finite number"),
    (EXPORT, "--max-shard-size", "abc", "is not a size"),
    (EXPORT, "--max-shard-size", "0", "is not a size"),
    (EXPORT, "--max-shard-size", "-5GB", "is not a size"),
    (EXPORT, "--max-shard-size", "", "is empty"),
    (EXPORT, "--max-shard-size", "0KB", "must be positive"),
], ids=lambda x: x if isinstance(x, str) else x[0])
def test_a_value_out_of_its_settings_range_is_one_line_before_any_work(work, nothing_loads, command, option, value,
                                                                       needle):
    one_line_error(_run(work, [*command, option, value]), option, needle)


def _recipe(work, name: str, doc) -> str:
    path = work / name
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


@pytest.mark.parametrize("doc, needles", [
    ({"config": {"model": "{tiny}", "calib_tokens": "2048"}}, ["'calib_tokens' must be an integer, got '2048'"]),
    ({"config": {"model": "{tiny}", "seq_len": 64.5}}, ["'seq_len' must be an integer, got 64.5"]),
    ({"config": {"model": "{tiny}", "flops": "0.5"}}, ["'flops' must be a number"]),
    ({"config": {"model": "{tiny}", "dataset": ""}}, ["'dataset' is empty"]),
    ({"config": {"model": "{tiny}", "offload_dir": " "}}, ["'offload_dir' is empty"]),
    ({"config": {"model": "{tiny}", "seed": True}}, ["'seed' must be an integer"]),
    ({"rana_recipe": 2, "command": "compress", "config": {"model": "{tiny}"}}, ["newer rana", "'rana_recipe' 2"]),
    ({"rana_recipe": 1, "rana_version": "99.0", "command": "compress", "config": {"model": "{tiny}"}},
     ["written by rana 99.0, newer than this rana"]),
    ({"config": {"model": "{tiny}", "format_version": 99}}, ["newer rana", "'format_version' 99"]),
    ({"rana_recipe": "1", "config": {"model": "{tiny}"}}, ["'rana_recipe' must be an integer"]),
], ids=["str-int", "float-int", "str-float", "empty-path", "blank-path", "bool-int", "newer-format", "newer-rana",
        "newer-settings", "text-version"])
def test_a_recipe_value_is_checked_by_its_settings_field(work, nothing_loads, doc, needles):
    doc = json.loads(json.dumps(doc).replace("{tiny}", str(work / "tiny")))
    doc["config"] = {"calib_tokens": 1024, "seq_len": 64, "batch_size": 4, **doc["config"]}  # good for the tiny model
    recipe = _recipe(work, "recipe.json", doc)
    one_line_error(runner.invoke(app, ["compress", "--recipe", recipe, "--out", str(work / "out")]), recipe, *needles)


def test_a_deeply_nested_recipe_is_one_line_not_a_recursion_error(work, nothing_loads):
    recipe = _recipe(work, "deep.json", '{"config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    one_line_error(runner.invoke(app, ["compress", "--recipe", recipe, "--out", str(work / "out")]), "nests")


def test_a_recipe_this_rana_wrote_loads_back(tmp_path):
    """The version and type checks take what this rana writes (a folder's recipe.json, its every setting)."""
    from rana.compress.config import read_recipe
    from rana.io.card import recipe_from

    settings = CompressConfig(model="tiny", flops=0.7, seed=2**32 - 1, offload_dir="work").to_dict()
    (tmp_path / "recipe.json").write_text(json.dumps(recipe_from(settings)))
    del settings["format_version"]
    assert read_recipe(tmp_path) == settings


def test_demo_with_a_flops_of_nan_is_one_line(work, nothing_loads, capsys):
    from rana.cli import demo

    code = demo.main(["--model", str(work / "tiny"), "--out", str(work / "demo"), "--flops", "nan"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        "error: --flops must be a finite number, got nan"], err
    assert not (work / "demo").exists()


# --------------------------------------------------------------------------- one check for every field

# good settings, each number at the edge of its range (taken: the ranges are what the options always took)
BASES = {
    CompressConfig: dict(model="m", seed=2**32 - 1, flops=1, grid_step=1.0, calib_tokens=4096, seq_len=8),
    EvalConfig: dict(models=["m"], ppl_data=["held.txt"], limit=0.5, num_fewshot=0, seq_len=2, latency_warmup=0),
    FinetuneConfig: dict(source="s", out="o", laurel="rw+lr+pa", laurel_rank=1, laurel_history=1, seed=0, lr=1,
                         tokens=1.5e6, lora_dropout=0.0, warmup=0, min_lr_ratio=1, save_every=0, eval_every=0),
    SweepConfig: dict(model="m", out="o", ppl_data=["held.txt"], flops=[1.0, 0.01], seed=0),
    ExportConfig: dict(src="a", out="b", max_shard_size="500MB"),
    QuantizeConfig: dict(src="a", out="b", calib_tokens=0, seed=2**32 - 1, seq_len=2),
}


def _wrong_values(hint) -> list:
    """Values of the wrong type for a field annotated `hint` (Optional stripped): text for a number, a
    float or a bool for an int, a non-finite float, text for a bool, an empty text for a text."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
        hint = args[0]
    if typing.get_origin(hint) is list:
        (element,) = typing.get_args(hint)
        return [[v] for v in _wrong_values(element) if not isinstance(v, list)]
    return {int: ["7", 7.5, True], float: ["0.5", math.nan, math.inf], bool: ["yes", 1], str: ["", "  "],
            Path: ["", "  "]}.get(hint, [])


@pytest.mark.parametrize("cls", list(BASES), ids=lambda c: c.__name__)
def test_every_field_refuses_a_value_of_the_wrong_type_with_its_option_name(cls):
    """Whatever built the settings (a library call here; a recipe, the command line), `validate` checks
    each field against its annotation and names the option: no TypeError later, no value taken as given."""
    from rana.settings import field_types, setting_name

    base = cls(**BASES[cls])
    base.validate()  # the values at the edge of each range are good
    hints, missed, checked = field_types(cls), [], 0
    for f in dataclasses.fields(cls):
        for wrong in _wrong_values(hints[f.name]):
            config = dataclasses.replace(base)
            setattr(config, f.name, wrong)  # as given: no __post_init__ conversion
            checked += 1
            try:
                config.validate()
            except UserError as e:
                if setting_name(f) not in str(e):
                    missed.append(f"{f.name}={wrong!r}: {e}")
            else:
                missed.append(f"{f.name}={wrong!r} accepted")
    assert checked >= 5 and not missed, missed
