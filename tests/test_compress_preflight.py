"""The pre-flight of `rana compress` (rana.compress.job / resources): every check runs once, in the
library, before any work; the resources it decides (memory cap, devices, work folder, streaming, the
memory estimate) are handed down to the loader, the memory check and the residency, which no longer
re-derive them from the config."""
import json

import pytest
from typer.testing import CliRunner

import rana.compress
import rana.compress.config
import rana.compress.job
import rana.compress.memory
import rana.compress.residency
import rana.compress.resource_types
import rana.compress.resources
import rana.compress.run
import rana.compress.streaming
from rana.cli.app import app
from rana.compress import CompressConfig, CompressJob, Resources
from rana.compress.memory import MemoryBudgetError
from rana.compress.resources import streams
from helpers import tiny_model_dir

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(calib_tokens=1024, seq_len=64, batch_size=4)


def counting(monkeypatch, module, name: str) -> list:
    """Replace `module.name` by a wrapper that records each call and calls the original."""
    calls, real = [], getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


def test_the_resource_helpers_take_no_config_of_their_own():
    for module in (rana.compress.memory, rana.compress.streaming, rana.compress.residency):
        assert not hasattr(module, "parse_memory"), module.__name__  # the cap arrives parsed, in Resources
    assert not hasattr(rana.compress.streaming, "check_work_dir")  # the pre-flight checks the work folder


def test_resources_of_a_config():
    r = Resources.of(CompressConfig(model="m", max_memory="2GB", offload_dir="/tmp/work"))
    assert (r.cap, r.max_memory, r.device.type, r.offload.type, str(r.work_dir)) == (2e9, "2GB", "cpu", "cpu", "/tmp/work")
    assert r.stream_from is None and r.estimate is None  # decided once the checkpoint is known
    assert streams(r, 1.0)  # --offload-dir: always streamed
    in_ram = Resources.of(CompressConfig(model="m", max_memory="2GB"))
    assert streams(in_ram, 3e9) and not streams(in_ram, 1e9)
    assert not streams(Resources.of(CompressConfig(model="m")), 1e12)  # no cap: never


def test_the_cli_checks_once_and_hands_the_resources_down(tmp_path, calib_file, monkeypatch):
    model = tiny_model_dir(tmp_path / "model")
    validated = []
    real_validate = CompressConfig.validate
    monkeypatch.setattr(CompressConfig, "validate", lambda self: (validated.append(self), real_validate(self))[1])
    work_dirs = counting(monkeypatch, rana.compress.job, "check_work_dir")
    inputs = counting(monkeypatch, rana.compress.job, "check_inputs")
    caps = counting(monkeypatch, rana.compress.resource_types, "parse_memory")  # in Resources.of
    checked_early = counting(monkeypatch, rana.compress.resources, "check_memory")
    checked_late = counting(monkeypatch, rana.compress.residency, "check_memory")
    decided = []
    real_decide = rana.compress.job.decide_resources
    monkeypatch.setattr(rana.compress.job, "decide_resources", lambda config: decided.append(real_decide(config)) or decided[-1])
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["compress", str(model), "--out", str(out), "--dataset", str(calib_file),
                                   "--max-memory", "8GB", "--calib-tokens", "1024", "--seq-len", "64",
                                   "--batch-size", "4"])
    assert res.exit_code == 0, res.output
    assert (len(validated), len(work_dirs), len(inputs), len(caps), len(decided)) == (1, 1, 1, 1, 1)
    assert (len(checked_early), len(checked_late)) == (1, 0)  # the estimate is made once, before loading
    resources = decided[0]
    assert resources.cap == 8e9 and resources.stream_from is None  # a small model fits in RAM
    plan = json.loads((out / "plan.json").read_text())
    assert plan["memory"]["estimate"] == resources.estimate.to_dict()
    assert plan["memory"]["max_memory"] == "8GB"


def test_a_bare_config_runs_the_preflight_itself(tmp_path, calib_file, monkeypatch):
    model = tiny_model_dir(tmp_path / "model")
    jobs = counting(monkeypatch, rana.compress.run, "preflight")
    work_dirs = counting(monkeypatch, rana.compress.job, "check_work_dir")
    loads = counting(monkeypatch, rana.compress.run, "load_for_compression")
    config = CompressConfig(model=str(model), dataset=str(calib_file), offload_dir=str(tmp_path / "work"), **SMALL)
    result = rana.compress.compress(config)
    assert (len(jobs), len(work_dirs)) == (1, 1)
    resources = loads[0][1]
    assert resources.stream_from == model and resources.work_dir == tmp_path / "work"  # --offload-dir streams
    assert result.offloaded is not None and result.plan["memory"]["weights_home"].startswith("disk")


def test_a_job_is_not_checked_again(tmp_path, calib_file, monkeypatch):
    model = tiny_model_dir(tmp_path / "model")
    job = rana.compress.preflight(CompressConfig(model=str(model), dataset=str(calib_file), **SMALL))
    assert isinstance(job, CompressJob) and job.config.lm_head == "sparse"  # "auto" resolved for rana
    jobs = counting(monkeypatch, rana.compress.run, "preflight")
    validated = []
    monkeypatch.setattr(CompressConfig, "validate", lambda self: validated.append(self))
    result = rana.compress.compress(job)
    assert (len(jobs), len(validated)) == (0, 0)
    assert result.plan["config"] == job.run_config.to_dict()


def test_a_cap_too_small_fails_in_the_preflight(tmp_path, monkeypatch):
    model = tiny_model_dir(tmp_path / "model")
    monkeypatch.setattr(rana.compress.streaming, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(MemoryBudgetError, match="--max-memory 50kB is too small"):
        rana.compress.preflight(CompressConfig(model=str(model), max_memory="50kB", **SMALL))
