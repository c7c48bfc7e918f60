"""`rana.evaluation.preflight(config)`: every check `rana eval` makes before the first model loads, in the
library, so a Python caller gets them too; and `EvalConfig`, the one description of `rana eval`'s options
that `evaluate_model` / `evaluate_models` take."""
from __future__ import annotations

import dataclasses

import pytest

from helpers import tiny_model_dir
from rana.errors import UserError
from rana.evaluation import EvalConfig, evaluate_models, preflight


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    tiny_model_dir(root / "tiny")
    (root / "held.txt").write_text("hello world " * 500)
    return root


def _config(work, **kw) -> EvalConfig:
    base = dict(models=[str(work / "tiny")], ppl_data=[str(work / "held.txt")], seq_len=64)
    return EvalConfig(**{**base, **kw})


@pytest.mark.parametrize("settings, message", [
    (dict(ppl_data=[]), "nothing to evaluate"),
    (dict(ppl_data=[], latency=True, layer_errors=True), "--layer-errors runs on the first --ppl-data text"),
    (dict(latency=True, latency_mode="served"), "--latency-mode must be auto, compiled, step, eager or serve"),
    (dict(ppl_protocol="wiki"), "unknown --ppl-protocol 'wiki'"),
    (dict(seq_len=1), "--seq-len must be at least 2"),
    (dict(batch_size=0), "--batch-size must be a positive integer, got 0"),
    (dict(latency_tokens=0), "--latency-tokens must be a positive integer"),
    (dict(latency_repeats=0), "--latency-repeats must be a positive integer"),
    (dict(eval_tokens=10), "--eval-tokens (10) must be at least one perplexity window (64 tokens)"),
    (dict(layer_error_tokens=1), "--layer-error-tokens must be at least 2"),
    (dict(num_fewshot=-1), "--num-fewshot must be ≥ 0"),
    (dict(dtype="int4"), "--dtype must be one of float32, bfloat16, float16, got 'int4'"),
    (dict(device="nonsense"), "--device 'nonsense' is not a device"),
    (dict(limit=0), "--limit must be positive, got 0"),
])
def test_every_setting_is_checked_as_a_user_error(work, no_model_load, settings, message):
    config = _config(work, **settings)
    with pytest.raises(UserError) as checked:
        config.validate()
    assert message in str(checked.value)
    with pytest.raises(UserError) as before_any_work:
        preflight(config)
    assert str(before_any_work.value) == str(checked.value)


@pytest.mark.parametrize("settings, message", [
    (dict(models=["no-such-model-xyz"]), "unknown model 'no-such-model-xyz'"),
    (dict(compare=["no-such-a, no-such-b"]), "unknown model 'no-such-a'"),
    (dict(dense="no-such-dense", latency=True), "unknown model 'no-such-dense'"),
    (dict(ppl_data=["missing.txt"]), "data file not found"),
    (dict(seq_len=None), "--seq-len 512 is longer than"),
    (dict(tasks="hellaswag_local"), "pass --task-data FOLDER"),
])
def test_every_model_file_and_task_is_checked_before_any_model_loads(work, no_model_load, settings, message):
    with pytest.raises(UserError, match=message):
        preflight(_config(work, **settings))


def test_the_json_output_is_never_an_input(work, no_model_load):
    with pytest.raises(UserError, match="--json"):
        preflight(_config(work, json_out=work / "tiny" / "config.json"))
    preflight(_config(work, json_out=work / "out" / "r.json"))  # a new file beside the inputs is fine


def test_the_command_line_and_library_spellings_make_the_same_settings(work):
    assert EvalConfig.merged(None, dict(ppl_sources=["a"], max_tokens=128, latency_new_tokens=8)) == EvalConfig(
        ppl_data=["a"], eval_tokens=128, latency_tokens=8)
    base = EvalConfig(batch_size=2)
    assert EvalConfig.merged(base, dict(seq_len=64)) == dataclasses.replace(base, seq_len=64) and base.seq_len is None
    with pytest.raises(TypeError):
        EvalConfig.merged(None, dict(no_such_setting=1))
    config = EvalConfig.from_options(dict(models=["m"], compare=["a,b", "c"], tasks="x, y", limit=2.0,
                                          latency_mode="auto"))
    assert config.references == ["m", "a", "b", "c"] and config.task_list == ["x", "y"]
    assert config.limit == 2 and isinstance(config.limit, int) and config.harness_mode is None
    assert EvalConfig.from_options(dict(limit=0.5)).limit == 0.5


def test_evaluate_models_takes_the_settings_object(work):
    with pytest.raises(UserError, match="nothing to evaluate"):
        evaluate_models([work / "tiny"], EvalConfig())
    results = evaluate_models([work / "tiny"], _config(work, eval_tokens=256))
    row = results["models"][0]
    assert results["seq_len"] == 64 and results["eval_tokens"] == 256 and row["ppl"]["held"]["windows"] == 256 // 64
