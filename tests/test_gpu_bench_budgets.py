"""How the GPU benchmarks and the tuner spend a lent GPU's minutes, checked on CPU without timings: work
never timed is estimated with a prior (never 0), the budget is checked before every piece of work (also
inside a unit), the run's first measurement always starts, the report is written after each piece, a
failure is a row and not the end of the run; the decode profile replays the step harness's compiled step
(nothing recompiles); the tuner never ships a config that computes a wrong result, keeps the other
entries of the table it merges into, counts its budget from the process start and draws its operands on
the run's device."""
import importlib.util
import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------ decode
@pytest.fixture
def decode():
    return load("bench_decode_gpu")


def test_decode_estimates_are_never_zero_and_come_from_like_work(decode):
    clock = decode.Clock(100.0, layers=2)
    assert all(clock.estimate(kind, "a") >= 1.0 for kind in decode.PRIOR_SECONDS)
    assert decode.Clock(100.0, layers=32).estimate("step", "a") == decode.PRIOR_SECONDS["step"]
    clock.costs[("step", "a")] = 7.0
    assert clock.estimate("step", "b") == 7.0 and clock.estimate("compiled", "a") == 7.0  # another model, harness
    assert clock.fits([], "a", first=True) and not decode.Clock(0.0).fits([], "a", first=True)


def test_decode_runs_the_profile_right_after_the_step_harness(decode):
    assert decode.pieces(["step", "compiled"]) == ["step", "profile", "compiled"]
    assert decode.pieces(["compiled", "step"]) == ["compiled", "step", "profile"]
    assert decode.pieces(["compiled"]) == ["compiled", "profile"]


def test_decode_schedules_by_estimate_inside_a_unit_and_writes_after_each_piece(decode, monkeypatch):
    """Fake work on a fake clock (budget 100 s; priors of a 32-layer model): the first harness starts
    although its prior (150 s) does not fit; the profile's prior (20 s) fits what is left; the compiled
    harness, estimated by the step harness's 50 s, does not; the second model's unit, estimated by the
    first's pieces, does not start at all. Every piece is written before and after it runs."""
    now = [0.0]
    cost = {"build": 5.0, "eager": 5.0, "compress": 10.0, "step": 50.0, "compiled": 50.0, "profile": 5.0}

    def work(kind, value=None):
        def fn(*args, **kwargs):
            now[0] += cost[kind]
            return value
        return fn

    monkeypatch.setattr(decode, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    monkeypatch.setattr(decode, "SMOKE_SHAPES", {"a": {}, "b": {}})
    monkeypatch.setattr(decode, "_build", work("build", object()))
    monkeypatch.setattr(decode, "eager_tokens", work("eager", [1, 2]))
    monkeypatch.setattr(decode, "compressed_layers", work("compress", []))
    monkeypatch.setattr(decode, "rana_model", lambda dense, layers: object())
    monkeypatch.setattr(decode, "time_harness", lambda model, dense, prompt, harness, refs, args: (
        work(harness)(), {"harness": harness})[1])
    monkeypatch.setattr(decode, "profile_unit", work("profile", {"profile": True}))
    monkeypatch.setattr(decode, "_release", lambda device: None)
    written = []
    args = SimpleNamespace(smoke=True, models=["a", "b"], harnesses=["step", "compiled"], budgets=[0.58], layers=32,
                           prompt_tokens=4, new_tokens=4, repeats=1, compress_layers=2, compile_backend="eager",
                           time_budget=100.0, profile_steps=2, warmup=1)
    data = decode.run(args, write=written.append)
    assert [r["harness"] for r in data["records"]] == ["step"] and data["profiles"] == [{"profile": True}]
    assert [s.split(" (")[0] for s in data["skipped"]] == ["a F=0.58: compiled harness", "b F=0.58: everything"]
    assert now[0] == 80.0 and data["complete"]
    in_flight = [w["running"] for w in written if w["running"]]
    assert any(r.startswith("step harness of a F=0.58") for r in in_flight)
    assert any(w["records"] and not w["running"] for w in written)  # written once the step harness was measured


def test_decode_profile_replays_the_step_harness_compiled_step(decode, tmp_path):
    data = decode.main(["--smoke", "--harnesses", "step", "--out", str(tmp_path / "d")])
    assert [r["harness"] for r in data["records"]] == ["step"] and data["harnesses"] == ["step"]
    (profile,) = data["profiles"]
    # each runner compiles its own step (its own code object: no guards on the model) once, and its replays of
    # the harness's cache length never recompile it
    assert profile["rana"]["compile_events"]["graphs"] == 1 and profile["dense"]["compile_events"]["graphs"] == 1
    assert "graphs compiled here" in (tmp_path / "d.md").read_text()


def test_decode_models_must_be_the_runs_own(decode):
    with pytest.raises(SystemExit):
        decode.main(["--smoke", "--models", "llama-2-7b-shaped"])


# ------------------------------------------------------------------------------------ compress
@pytest.fixture
def compress():
    return load("bench_compress_gpu")


def test_compress_clock_starts_the_first_compression_and_then_goes_by_estimate(compress):
    assert compress.Clock(None).fits(["compress"], 32)
    clock = compress.Clock(time.perf_counter() - compress._START + 60.0)
    assert clock.fits(["build", "compress"], 32)  # nothing started yet: the first always does
    clock.started = True
    assert not clock.fits(["compress"], 32)  # its prior: 20 s a layer
    clock.record("compress", 32.0, 32)
    assert clock.fits(["compress"], 32)  # measured: 1 s a layer
    assert not compress.Clock(-1.0).fits(["compress"], 1)  # no time left: nothing starts


def test_a_failed_compression_is_a_row_and_the_exit_code(compress, tmp_path, monkeypatch):
    monkeypatch.setattr(compress, "run_one", lambda folder, config, timeout=None: {"error": "compression failed: boom"})
    rc = compress.main(["--smoke", "--one-layer", "--device", "cpu", "--work", str(tmp_path / "w"),
                        "--out", str(tmp_path / "c")])
    data = json.loads((tmp_path / "c.json").read_text())
    assert rc == 1 and data["complete"] and data["rows"][0]["error"] == "compression failed: boom"
    assert data["failures"] and "FAILED" in (tmp_path / "c.md").read_text()


# ------------------------------------------------------------------------------------ tuner
@pytest.fixture
def tune():
    pytest.importorskip("triton")
    from rana.kernels import gemv_tune

    return gemv_tune


def test_the_tuner_never_takes_a_wrong_config_and_keeps_the_other_entries(tune, tmp_path, monkeypatch, capsys):
    tg = tune.tg
    real = tg._launch
    wrong = tg.INTERPRETER_CONFIG  # the heuristic under the interpreter, and the first candidate

    def launch(vs, ws, ts, mode, ss, bs, cfg, *args, **kwargs):
        out = real(vs, ws, ts, mode, ss, bs, cfg, *args, **kwargs)
        return out * 2 if tuple(cfg) == tuple(wrong) else out

    monkeypatch.setattr(tg, "_launch", launch)
    out = tmp_path / "t.json"
    out.write_text(json.dumps({"format": 1,
                               "gpus": {"Other": {"k": [64, 64, 1, 4]}, "cpu (smoke)": {"old": [1, 2, 3, 4]}},
                               "measured": {"Other": {"k": {"us": 1.0}}}}))
    assert tune.main(["--smoke", "--out", str(out)]) == 1  # a config computing a wrong result is a kernel bug
    table = json.loads(out.read_text())
    ours = table["gpus"]["cpu (smoke)"]
    assert table["gpus"]["Other"] == {"k": [64, 64, 1, 4]} and ours.pop("old") == [1, 2, 3, 4]
    assert ours and all(cfg != list(wrong) for cfg in ours.values())
    assert "WRONG RESULT" in capsys.readouterr().err


def test_the_tuner_budget_counts_from_the_process_start(tune):
    args = SimpleNamespace(smoke=True, budget=60.0, shapes=[], dtypes=[], bins=[2])
    keys = []
    result = tune.run(args, started=time.monotonic() - 3600, on_key=lambda gpu, key, r: keys.append(key))
    assert keys == [] and result["tuned"] == {}
    assert len(result["skipped"]) == len(tune.problems(tune.SMOKE_SHAPES["tiny"]))  # every key, none started


def test_the_tuner_draws_operands_on_the_runs_device_in_its_dtype(tune, monkeypatch):
    calls = []
    real = torch.randn

    def randn(*shape, **kwargs):
        calls.append((kwargs.get("device"), kwargs.get("dtype")))
        return real(*shape, **kwargs)

    monkeypatch.setattr(torch, "randn", randn)
    problem = tune.problems(tune.SMOKE_SHAPES["tiny"])[0]
    sets = tune._operands(problem, torch.float16, 0.5, torch.device("cpu"), copies=2)
    assert len(sets) == 2 and calls and set(calls) == {(torch.device("cpu"), torch.float16)}


def test_the_tuner_tunes_every_bf16_key_before_fp16(tune):
    order = [d for d, *_ in tune.work(tune.MODEL_SHAPES, tune.DTYPES, tune.SPARSITY_BINS)]
    assert order == sorted(order, key=["bfloat16", "float16"].index) and order[0] == "bfloat16"
