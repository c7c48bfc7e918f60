"""Model cards, recipes, `rana compress --recipe` / `--allocation`, and `rana.load`."""
import json
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from rana.compress.config import read_recipe as load_recipe
from rana.io.card import RecipeError, base_model_id
from rana.cli.app import app

runner = CliRunner()
SMALL = ["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4", "--grid-step", "0.5"]


@pytest.fixture(scope="module")
def compressed(model_dir, calib_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("c") / "tiny-rana"
    res = runner.invoke(app, ["compress", str(model_dir), "--flops", "0.8", "--method", "teal", "--out", str(out),
                              "--dataset", str(calib_file), "--seed", "3", *SMALL])
    assert res.exit_code == 0, res.output
    return out


def front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    head, _, _ = card[4:].partition("\n---\n")
    return yaml.safe_load(head)


def test_card_front_matter_summary_numbers_and_usage(compressed):
    card = (compressed / "README.md").read_text()
    meta = front_matter(card)
    plan = json.loads((compressed / "plan.json").read_text())
    assert meta["library_name"] == "rana"
    assert "base_model" not in meta  # a local folder is not a hub id
    assert {"rana", "rana-teal", "llama"} <= set(meta["tags"])
    assert "# tiny-rana" in card
    assert f"{plan['measured_flops']:.4f}" in card  # the measured number, not the target only
    assert "relative output error" in card and "decoder layers | 2" in card
    assert 'rana.load("tiny-rana")' in card
    assert "rana compress --recipe tiny-rana/recipe.json --out tiny-rana-again" in card


def test_recipe_holds_the_full_config(compressed):
    doc = json.loads((compressed / "recipe.json").read_text())
    plan = json.loads((compressed / "plan.json").read_text())
    config = {k: v for k, v in plan["config"].items() if k != "format_version"}
    assert doc["command"] == "compress" and doc["config"] == config
    assert doc["config"]["method"] == "teal" and doc["config"]["seed"] == 3 and doc["config"]["calib_tokens"] == 1024
    assert doc["equivalent_command"].startswith("rana compress ") and "--method teal" in doc["equivalent_command"]
    assert load_recipe(compressed) == config == load_recipe(compressed / "recipe.json")


def test_recipe_round_trip_and_overrides(compressed, tmp_path):
    """`--recipe` of a saved folder reproduces its configuration (and so its plan); explicit
    options win over the recipe; the model argument may be omitted."""
    again = tmp_path / "again"
    res = runner.invoke(app, ["compress", "--recipe", str(compressed / "recipe.json"), "--out", str(again)])
    assert res.exit_code == 0, res.output
    first, second = (json.loads((d / "recipe.json").read_text())["config"] for d in (compressed, again))
    assert first == second
    plan1, plan2 = (json.loads((d / "plan.json").read_text()) for d in (compressed, again))
    assert plan1["measured_flops"] == pytest.approx(plan2["measured_flops"], abs=1e-9)

    override = tmp_path / "override"
    res = runner.invoke(app, ["compress", "--recipe", str(compressed), "--flops", "0.9", "--allocation", "global",
                              "--out", str(override)])
    assert res.exit_code == 0, res.output
    third = json.loads((override / "recipe.json").read_text())["config"]
    assert third["flops"] == 0.9 and third["allocation"] == "global"
    assert {k: v for k, v in third.items() if k not in ("flops", "allocation")} == \
           {k: v for k, v in first.items() if k not in ("flops", "allocation")}
    assert json.loads((override / "plan.json").read_text())["allocation"].get("kind") != "uniform"


def test_allocation_option(model_dir, calib_file, tmp_path):
    out = tmp_path / "g"
    res = runner.invoke(app, ["compress", str(model_dir), "--flops", "0.7", "--allocation", "global", "--out", str(out),
                              "--dataset", str(calib_file), *SMALL])
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["config"]["allocation"] == "global" and "fractions" in plan["allocation"]
    bad = runner.invoke(app, ["compress", str(model_dir), "--allocation", "clever", "--out", str(tmp_path / "b")])
    assert bad.exit_code != 0 and "unknown allocation" in bad.output and not (tmp_path / "b").exists()


@pytest.mark.parametrize("content,needle", [
    ("not json", "not valid JSON"),
    ('{"config": {"model": "x", "flop": 0.5}}', "unknown setting(s) flop"),
    ('{"command": "finetune", "config": {}}', "not `rana compress`"),
    ('{"config": {"flops": 0.5}}', "names no model"),
])
def test_bad_recipes_are_one_line_errors(tmp_path, content, needle):
    recipe = tmp_path / "r.json"
    recipe.write_text(content)
    res = runner.invoke(app, ["compress", "--recipe", str(recipe), "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and needle in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "o").exists()


def test_missing_model_and_recipe(tmp_path):
    res = runner.invoke(app, ["compress", "--out", str(tmp_path / "o")])
    assert res.exit_code != 0 and "missing MODEL" in res.output
    with pytest.raises(RecipeError, match="recipe not found"):
        load_recipe(tmp_path / "nothing.json")


def test_export_card_and_recipe(compressed, tmp_path):
    from rana.export import export

    out = export(compressed, tmp_path / "tiny_hf")
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta["library_name"] == "transformers" and "rana" in meta["tags"]
    assert 'AutoModelForCausalLM.from_pretrained("tiny_hf", trust_remote_code=True)' in card
    assert json.loads((out / "recipe.json").read_text()) == json.loads((compressed / "recipe.json").read_text())


def test_evaluation_goes_into_the_card(compressed, tmp_path):
    import shutil

    from rana.io.card import add_evaluation

    folder = tmp_path / "copy"
    shutil.copytree(compressed, folder)
    add_evaluation(folder, {"models": [{"label": "dense", "flops": {"fraction": 1.0}, "ppl": {"heldout": {"ppl": 12.5}}},
                                       {"label": "copy", "flops": {"fraction": 0.81234}, "ppl": {"heldout": {"ppl": 13.25}},
                                        "latency": {"tokens_per_s": 40.0, "latency_ratio": 0.9}}],
                            "protocol": "test protocol"})
    card = (folder / "README.md").read_text()
    assert "## Evaluation (held-out text)" in card and "| copy | 0.8123 | 13.250 | 40.0 | 0.900 |" in card
    assert json.loads((folder / "evaluation.json").read_text())["protocol"] == "test protocol"


def test_base_model_ids():
    assert base_model_id("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_model_id("llama2-7b") == "meta-llama/Llama-2-7b-hf"
    assert base_model_id("Qwen/Qwen2-0.5B") == "Qwen/Qwen2-0.5B"
    assert base_model_id("/some/folder/model.gguf") is None and base_model_id(None) is None


def test_rana_load_is_top_level_and_import_stays_light(compressed):
    import rana
    import rana.io

    assert rana.load is rana.io.load and "load" in dir(rana)
    model, tok = rana.load(compressed)
    assert tok is not None and model.config.model_type == "llama"
    code = "import sys, rana; assert 'torch' not in sys.modules, 'import rana pulled torch'; print(rana.__version__)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    with pytest.raises(AttributeError):
        rana.no_such_thing


def test_card_names_the_final_folder_not_the_temp_one():
    from rana.io.card import final_name

    assert final_name(".smol-ft.tmp-k2j_x9") == "smol-ft"
    assert final_name("..smol-ft.tmp-a1.tmp-b2") == "smol-ft"  # finetune saves inside atomic_dir's temp folder
    assert final_name("smol-rana") == "smol-rana" and final_name(".hidden") == ".hidden"
