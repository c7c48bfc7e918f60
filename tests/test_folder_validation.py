"""What rana writes, it can read; what it reads, it checks (issue 27, root causes 1, 4, 5 and 8).

One test (or parametrised group) per root cause, each failing on the code before the fix
(19048eb): a side-path folder refused by the loader (1), a tied LM head's recorded shape and its
missing threshold taken on trust (4), unchecked fields of rana_config.json and plan.json (5), a
head threshold of +inf loaded without a word (8). Tiny random models, compressed in-process."""
from __future__ import annotations

import ast
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import rana
import rana.io as rio
from helpers import byte_tokenizer, tiny_calibration, tiny_compress_config, tiny_model
from rana.cli.app import app
from rana.compress import compress_model
from rana.io import ModelLoadError

pytestmark = pytest.mark.usefixtures("one_thread")

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[1]
PROMPT = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))


def low_rank_model(arch: str = "llama", **kw):
    """A tiny model whose up/down/q projections are rank 2: a side path (or a rank adapter) pays there."""
    model = tiny_model(arch, **kw)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            for w in (layer.mlp.up_proj.weight, layer.mlp.down_proj.weight, layer.self_attn.q_proj.weight):
                w.copy_(torch.linalg.svd(w, full_matrices=False).U[:, :2] @ torch.randn(2, w.shape[1], generator=g))
    return model


def compressed_folder(path: Path, model, vocab: int = 128, tokenizer=None, **cfg) -> tuple[torch.nn.Module, Path]:
    config = tiny_compress_config(**cfg)
    result = compress_model(model, None, config, tiny_calibration(vocab=vocab))
    rio.save(result.model, tokenizer, path, plan=result.plan, extra={"compress_config": config.to_dict()})
    return result.model, path


def one_line_error(res, *needles: str) -> None:
    assert res.exit_code not in (0, None), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output, res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    for needle in needles:
        assert needle in res.output, res.output


def edit_json(file: Path, edit) -> None:
    doc = json.loads(file.read_text())
    edit(doc)
    file.write_text(json.dumps(doc))


# ------------------------------------------------------------ 1: folders rana writes load back


@pytest.mark.parametrize("method", ["rsparse", "rana-side"])
def test_side_path_folders_load_back(tmp_path, method):
    model, folder = compressed_folder(tmp_path / method, low_rank_model(), method=method, flops=0.6)
    kinds = {a["type"] for a in rio.read_meta(folder)["adapters"]}
    assert "sparse_lowrank" in kinds, kinds  # the side path the loader used to refuse
    rio.check_folder(folder)
    loaded, _ = rana.load(folder)
    with torch.no_grad():
        torch.testing.assert_close(loaded(PROMPT).logits, model(PROMPT).logits, rtol=1e-5, atol=1e-5)


def _type_name_tables(tree: ast.AST, names: set[str]):
    """(line, name) of adapter type names compared against, or listed together (two or more in one
    tuple / list / set / dict's keys): a table or a dispatch of their own."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            found = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant) and c.value in names]
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)):
            items = node.keys if isinstance(node, ast.Dict) else node.elts
            found = [c for c in items if isinstance(c, ast.Constant) and c.value in names]
            found = found if len(found) >= 2 else []
        else:
            continue
        yield from ((c.lineno, c.value) for c in found)


def test_adapter_type_names_live_in_one_table():
    """No table or dispatch of adapter type names besides the registry's in rana/io or rana/export:
    a second one is what the next adapter kind would miss (sparse_lowrank was)."""
    from rana.modules.registry import ADAPTER_KINDS

    names = set(ADAPTER_KINDS)
    for folder in (ROOT / "rana" / "io", ROOT / "rana" / "export"):
        for path in sorted(folder.rglob("*.py")):
            for line, name in _type_name_tables(ast.parse(path.read_text(encoding="utf-8")), names):
                pytest.fail(f"{path.relative_to(ROOT)}:{line} names adapter type {name!r}; use rana.modules.registry")


# ------------------------------------------------------------ 4: a tied LM head's shape and threshold


@pytest.fixture(scope="module")
def tied_head(tmp_path_factory):
    """A tied-embeddings llama with the adapted (input-sparse) LM head, saved."""
    folder = tmp_path_factory.mktemp("head") / "tied"
    model = tiny_model("llama", vocab_size=1024, tie_word_embeddings=True)
    compressed_folder(folder, model, vocab=1024, flops=0.7, lm_head="sparse")
    spec = next(a for a in rio.read_meta(folder)["adapters"] if a["path"] == "lm_head")
    assert spec["type"] == "input_sparse_head" and spec["tied"]
    return folder


def _copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / "copy"))


def _edit_head_spec(folder: Path, **fields) -> None:
    edit_json(folder / rio.RANA_CONFIG,
              lambda m: next(a for a in m["adapters"] if a["path"] == "lm_head").update(fields))


@pytest.mark.parametrize("field, value", [("in", 32), ("out", 512)])
def test_tied_head_shape_is_checked_against_the_model(tied_head, tmp_path, field, value):
    folder = _copy(tied_head, tmp_path)
    _edit_head_spec(folder, **{field: value})
    with pytest.raises(ModelLoadError, match=rf"rana_config.json.*'lm_head': its '{field}' is {value}"):
        rio.load(folder)


def test_missing_head_threshold_is_an_error(tied_head, tmp_path):
    folder = _copy(tied_head, tmp_path)
    state = load_file(str(folder / rio.WEIGHTS))
    del state["lm_head.threshold"]  # a tied head's weight is absent by design; its threshold is not
    save_file(state, str(folder / rio.WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.safetensors|1 missing \['lm_head.threshold'\]"):
        rio.load(folder)


def test_missing_threshold_field_is_an_error(tied_head, tmp_path):
    folder = _copy(tied_head, tmp_path)
    edit_json(folder / rio.RANA_CONFIG,
              lambda m: next(a for a in m["adapters"] if a["path"] == "lm_head").pop("threshold"))
    with pytest.raises(ModelLoadError, match=r"rana_config.json' is invalid: adapter 'lm_head': 'threshold' .*missing"):
        rio.load(folder)


# ------------------------------------------------------------ 8: a head threshold of +inf


def test_infinite_head_threshold_is_refused(tied_head, tmp_path):
    folder = _copy(tied_head, tmp_path)
    _edit_head_spec(folder, threshold="inf")
    state = load_file(str(folder / rio.WEIGHTS))
    state["lm_head.threshold"].fill_(float("inf"))  # the weights agree: only the value itself is wrong
    save_file(state, str(folder / rio.WEIGHTS), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError,
                       match=r"rana_config.json' is invalid: adapter 'lm_head': 'threshold' is \"inf\""):
        rio.load(folder)
    res = runner.invoke(app, ["export", str(folder), "--out", str(tmp_path / "x")])
    one_line_error(res, "lm_head", "threshold")
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------ 5: every field read is checked


@pytest.fixture(scope="module")
def rotated(tmp_path_factory):
    """A wina-ortho folder (rotated_input adapters), with a tokenizer, for the commands."""
    folder = tmp_path_factory.mktemp("rot") / "rot"
    compressed_folder(folder, tiny_model("llama", vocab_size=257), vocab=257, tokenizer=byte_tokenizer(),
                      method="wina-ortho", flops=0.8)
    assert any(a["type"] == "rotated_input" for a in rio.read_meta(folder)["adapters"])
    return folder


def _first(kind: str):
    return lambda m: next(a for a in m["adapters"] if a["type"] == kind)


@pytest.mark.parametrize("edit, needle", [
    (lambda m: _first("rotated_input")(m).update(block="sideways"), "'block' must be one of 'attention', 'mlp'"),
    (lambda m: _first("rotated_input")(m).update(**{"in": True}), "'in' must be a positive integer"),
    (lambda m: m.update(compress_config=[1, 2]), "'compress_config' must be an object"),
    (lambda m: m["compress_config"].update(lm_head="both"), "'compress_config.lm_head' must be one of"),
    (lambda m: m.update(finetune="yes"), "'finetune' must be an object"),
    (lambda m: m["adapters"].append(dict(m["adapters"][-1])), "names a path twice"),
])
def test_rana_config_fields_are_checked(rotated, tmp_path, edit, needle):
    folder = Path(shutil.copytree(rotated, tmp_path / "r"))
    edit_json(folder / rio.RANA_CONFIG, edit)
    with pytest.raises(ModelLoadError, match="rana_config.json' is invalid: .*" + needle.replace("(", r"\(")):
        rio.load(folder)


BAD_PLANS = [
    (lambda p: p.update(layers=5), "'layers' must be a list, got 5"),
    (lambda p: p.update(config=["rana"]), "'config' must be an object"),
    (lambda p: p.update(measured_flops="0.8"), "'measured_flops' must be a number"),
    (lambda p: p["layers"][0].update(mlp=[1]), "'layers[0].mlp' must be an object"),
    (lambda p: p["layers"][1]["attention"].update(shares=["a"]), "'layers[1].attention.shares[0]' must be a number"),
    (lambda p: p.update(measured={"by_part": {"mlp": 3}}), "'measured.by_part.mlp' must be an object"),
    (lambda p: p["config"].update(flops=4), "'config.flops' must be a number in [0, 1]"),
]


@pytest.mark.parametrize("edit, needle", BAD_PLANS)
def test_plan_of_the_wrong_shape_is_refused_on_load(rotated, tmp_path, edit, needle):
    folder = Path(shutil.copytree(rotated, tmp_path / "r"))
    edit_json(folder / rio.PLAN, edit)
    for read in (rio.read_plan, rio.check_folder, rio.load):
        with pytest.raises(ModelLoadError, match=r"plan.json' is invalid: " + re.escape(needle)):
            read(folder)


def test_bad_plan_stops_finetune_and_export_before_any_work(rotated, tmp_path):
    """`finetune` used to train every step and then crash in the model-card writer (leaving
    `.checkpoints/`); `export` crashed the same way."""
    folder = Path(shutil.copytree(rotated, tmp_path / "r"))
    edit_json(folder / rio.PLAN, lambda p: p.update(layers=5))
    data = tmp_path / "data.txt"
    data.write_text("some text to fine-tune on. " * 400)
    res = runner.invoke(app, ["finetune", str(folder), "--data", str(data), "--out", str(tmp_path / "ft"),
                              "--tokens", "1024", "--seq-len", "32", "--batch-size", "4", "--lora-r", "4"])
    one_line_error(res, "plan.json", "'layers'")
    assert not (tmp_path / "ft").exists() and not any(p.name.startswith(".ft") for p in tmp_path.iterdir())
    res = runner.invoke(app, ["export", str(folder), "--out", str(tmp_path / "x")])
    one_line_error(res, "plan.json", "'layers'")
    assert not (tmp_path / "x").exists()
