"""rana.io.models: one rule for the dense model a rana folder came from, and `open_model`, which
opens a dense reference or a rana folder with its plan, metadata and tokenizer."""
import torch

import rana.io
from rana.compress import compress_model
from rana.io.models import LoadedModel, dense_reference, open_model
from helpers import tiny_calibration, tiny_compress_config, tiny_model_dir


def test_dense_reference_prefers_the_plan_then_the_compress_settings():
    plan = {"model": "loaded/from", "config": {"model": "config/named"}}
    assert dense_reference(plan, {"compress_config": {"model": "meta/named"}}) == "loaded/from"
    assert dense_reference({"config": {"model": "config/named"}}, {"compress_config": {"model": "meta/named"}}) == "config/named"
    assert dense_reference(None, {"compress_config": {"model": "meta/named"}}) == "meta/named"
    assert dense_reference({"config": {}}, {"compress_config": None}) is None
    assert dense_reference(None, None) is None


def test_open_model_dense_and_rana_folder(tmp_path):
    dense_dir = tiny_model_dir(tmp_path / "dense")
    dense = open_model(dense_dir)
    assert isinstance(dense, LoadedModel) and dense.kind == "dense"
    assert dense.dense_reference == str(dense_dir) and dense.plan is None and dense.meta == {}
    assert dense.tokenizer is not None and next(dense.model.parameters()).dtype == torch.float32

    config = tiny_compress_config(model=str(dense_dir), method="teal", flops=0.8)
    result = compress_model(dense.model, None, config, tiny_calibration())
    result.plan["model"] = str(dense_dir)
    rana.io.save(result.model, None, tmp_path / "rana", plan=result.plan,
                 extra={"method": "teal", "compress_config": config.to_dict()})

    opened = open_model(tmp_path / "rana")
    assert opened.kind == "rana" and opened.dense_reference == str(dense_dir)
    assert opened.plan["method"] == "teal" and opened.meta["method"] == "teal" and opened.meta["adapters"]
    assert opened.tokenizer is not None  # the folder has none: read from its dense reference
    reference, _ = rana.io.load(tmp_path / "rana")
    ids = torch.randint(0, 257, (1, 12))
    with torch.no_grad():
        assert torch.equal(opened.model(ids).logits, reference(ids).logits)

    cast = open_model(tmp_path / "rana", dtype="bfloat16", tokenizer=str(dense_dir))
    assert next(cast.model.parameters()).dtype == torch.bfloat16 and cast.tokenizer is not None


def test_rana_open_is_the_one_way_and_the_older_names_are_its_shapes(tmp_path):
    """`rana.open(reference)` → LoadedModel(model, tokenizer, plan, provenance) for a dense reference and a
    rana folder, dtypes as names; `load_model` is `open(..., dense=True)` as a tuple, `open_model` is `open`."""
    import pytest

    import rana
    from rana.io.models import ModelLoadError, Provenance, load_model

    assert rana.open is rana.io.models.open and rana.io.open_model is rana.open and "open" in dir(rana)
    dense_dir = tiny_model_dir(tmp_path / "dense")
    opened = rana.open(dense_dir, dtype="bfloat16")
    assert isinstance(opened.provenance, Provenance) and opened.provenance.kind == "dense"
    assert opened.provenance.source is not None and opened.provenance.source.path == str(dense_dir)
    assert next(opened.model.parameters()).dtype == torch.bfloat16 and opened.plan is None

    model, tok, src = load_model(str(dense_dir))
    assert src == rana.open(dense_dir).provenance.source and tok is not None

    config = tiny_compress_config(model=str(dense_dir), method="teal", flops=0.8)
    result = compress_model(rana.open(dense_dir).model, None, config, tiny_calibration())
    rana.io.save(result.model, None, tmp_path / "rana", plan=result.plan,
                 extra={"method": "teal", "compress_config": config.to_dict()})
    folder = rana.open(tmp_path / "rana", dtype="float16")
    assert folder.provenance.kind == "rana" and folder.provenance.source is None
    assert folder.provenance.meta["adapters"] and folder.plan["method"] == "teal"
    assert next(folder.model.parameters()).dtype == torch.float16
    with pytest.raises(ModelLoadError):  # the caller needs an uncompressed model
        rana.open(tmp_path / "rana", dense=True)
    with pytest.raises(ModelLoadError, match="unknown dtype"):
        rana.open(dense_dir, dtype="float64")
    model, _ = rana.load(tmp_path / "rana", dtype="bfloat16")  # the short form takes names too
    assert next(model.parameters()).dtype == torch.bfloat16
