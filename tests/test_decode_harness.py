"""The decode latency harnesses on CPU: the step harness (gpt-fast style) decodes the greedy tokens of
`generate`; both compiled harnesses keep one StaticCache per model (same object, same storage) across
runs; no hidden eager warm-up runs; the GPU decode benchmark's --smoke covers its code paths.

Compilation uses the "eager" backend here: it traces with dynamo like inductor (fullgraph, guards,
recompiles) without inductor's C++ build; inductor itself is covered by tests/test_decode_ops.py."""
from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from helpers import tiny_model
from rana.evaluation import decode_latency, latency_ratio, measure_latency, step_greedy
from rana.evaluation import decode_step, latency
from rana.evaluation.decode_step import cache_keyword

REPO = Path(__file__).resolve().parents[1]
PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8]])
EAGER_COMPILE = {"fullgraph": True, "backend": "eager"}

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _generate_tokens(model, n: int) -> torch.Tensor:
    """Eager greedy `generate` of exactly n tokens (EOS suppressed, as in the latency harness)."""
    out = model.generate(PROMPT, attention_mask=torch.ones_like(PROMPT), do_sample=False, max_new_tokens=n,
                         min_new_tokens=n)
    return out[:, PROMPT.shape[1]:]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_step_harness_decodes_generates_greedy_tokens(arch):
    model = tiny_model(arch)
    ref = _generate_tokens(model, 20)
    assert torch.equal(step_greedy(model, PROMPT, 20), ref)  # eager step
    assert torch.equal(step_greedy(model, PROMPT, 20, EAGER_COMPILE), ref)  # compiled step (fullgraph)


def test_step_harness_never_picks_eos():
    """min_new_tokens suppresses EOS in the generate harnesses; the step harness must do the same work."""
    model = tiny_model("llama")
    first = int(step_greedy(model, PROMPT, 1)[0, 0])
    model.generation_config.eos_token_id = [first, 3]
    tokens = step_greedy(model, PROMPT, 8)
    assert first not in tokens.tolist()[0] and 3 not in tokens.tolist()[0]
    assert torch.equal(tokens, _generate_tokens(model, 8))


def _spy_decode(monkeypatch) -> list[tuple[int, int, list[int]]]:
    """Record (model id, cache id, cache data pointers after the run) for every step-harness run."""
    runs = []
    decode = decode_step.decode

    def spy(model, step, cache, ids, new_tokens, prefill_fn=None):
        out = decode(model, step, cache, ids, new_tokens, prefill_fn)
        pointers = [t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)]
        runs.append((id(model), id(cache), pointers))
        return out

    monkeypatch.setattr(decode_step, "decode", spy)
    return runs


def _no_generate(model, monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("the step harness must not call generate (no eager warm-up either)")

    monkeypatch.setattr(model, "generate", fail)


def test_step_harness_reuses_one_cache_per_model(monkeypatch):
    from torch._dynamo.utils import counters

    ours, dense = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    runs = _spy_decode(monkeypatch)
    for m in (ours, dense):
        _no_generate(m, monkeypatch)
    counters.clear()
    r = latency_ratio(ours, dense, PROMPT, new_tokens=5, warmup=1, repeats=3, mode="step", compile_backend="eager")
    assert r["mode"] == "step" and r["tokens_per_s"] > 0 and r["dense_tokens_per_s"] > 0
    assert [run[0] for run in runs] == [id(ours), id(dense)] * 4  # interleaved: warm-up round + 3 timed
    for m in (ours, dense):
        mine = [run for run in runs if run[0] == id(m)]
        assert len({run[1] for run in mine}) == 1 and len({tuple(run[2]) for run in mine}) == 1
    assert r["model"]["compile_warmup"]["graphs"] >= 1  # the step really was compiled, in the warm-up round
    assert r["compile_timed"] == {"graphs": 0, "graph_breaks": 0, "cudagraph_recorded_inputs": 0,
                                  "cudagraph_skips": 0}
    monkeypatch.undo()  # generate back, for the reference tokens
    assert r["model"]["generated_ids"] == _generate_tokens(ours, 5)[0].tolist()
    assert r["dense"]["generated_ids"] == _generate_tokens(dense, 5)[0].tolist()


def _spy_generate(model, monkeypatch) -> list[tuple]:
    """Record (compile config or None, cache, its first key tensor's data pointer) for each generate."""
    calls = []
    generate = model.generate
    key = cache_keyword(model)

    def spy(ids, **kwargs):
        out = generate(ids, **kwargs)
        cache = kwargs.get(key)
        config = kwargs["generation_config"]
        calls.append((None if config.disable_compile else config.compile_config, cache,
                      None if cache is None else cache.layers[0].keys.data_ptr()))
        return out

    monkeypatch.setattr(model, "generate", spy)
    return calls


def test_compiled_harness_reuses_one_cache_and_has_no_eager_warmup(monkeypatch):
    from transformers import StaticCache

    ours, dense = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    calls = {id(m): _spy_generate(m, monkeypatch) for m in (ours, dense)}
    r = latency_ratio(ours, dense, PROMPT, new_tokens=4, warmup=0, repeats=2, mode="compiled", compile_backend="eager")
    assert r["mode"] == "compiled" and r["tokens_per_s"] > 0
    for m in (ours, dense):
        mine = calls[id(m)]
        assert len(mine) == 2 * 3  # (full + 1-token) × (1 warm-up round + 2 timed): nothing else
        assert all(c[0] is not None and c[0].fullgraph and c[0].backend == "eager" for c in mine)  # all compiled
        assert isinstance(mine[0][1], StaticCache) and all(c[1] is mine[0][1] for c in mine)
        assert len({c[2] for c in mine}) == 1
    assert r["model"]["compile_warmup"]["graphs"] >= 1 and r["compile_timed"]["graphs"] == 0
    monkeypatch.undo()
    assert r["model"]["generated_ids"] == _generate_tokens(ours, 4)[0].tolist()


def test_generation_config_swap_reaches_both_compiled_harnesses(monkeypatch):
    """Tests (and the benchmark's smoke) replace latency.generation_config's compile backend: the step
    harness compiles with that config too."""
    make = latency.generation_config
    seen = []

    def eager_backend(*args):
        config = make(*args)
        if config.compile_config is not None:
            config.compile_config.backend = "eager"
            seen.append(args[2])
        return config

    monkeypatch.setattr(latency, "generation_config", eager_backend)
    assert latency.step_compile_kwargs(tiny_model("llama"), "cpu")["backend"] == "eager"
    assert "mode" not in latency.step_compile_kwargs(tiny_model("llama"), "cpu")  # inductor's keyword only
    assert seen == ["compiled", "compiled"]


def test_cpu_steps_compile_without_inductors_asserts():
    """A compiled CPU step: inductor's default mode, its generated code without the per-output size and alignment
    asserts (torch.compile takes a mode or options, not both); CUDA keeps CUDA graphs."""
    kwargs = latency.step_compile_kwargs(tiny_model("llama"), "cpu")
    assert kwargs["backend"] == "inductor" and "mode" not in kwargs
    assert kwargs["options"] and not any(kwargs["options"].values())
    assert set(kwargs["options"]) <= {"size_asserts", "alignment_asserts"}
    cuda = latency.generation_config(tiny_model("llama"), 4, "compiled", torch.device("cuda")).compile_config
    assert cuda.mode == "reduce-overhead" and not cuda.options


class _Entry:
    def __init__(self, name: str):
        self.name = name


def test_step_guard_filter_drops_the_models_guards_only():
    """Guards on the model and everything reached through it are dropped; the step's inputs, the cache, global
    state and module globals keep theirs."""
    dropped = ["model._modules['model']._modules['layers']._modules['0']._parameters['weight']", "model.training",
               "dict(type(model.config).__mro__[1].__dict__)['attribute_map']", "type(model)", "model"]
    kept = ["ids", "positions", "cache.layers[0].keys", "dict(type(cache).__dict__)", "", "const['use_cache']",
            "G['__import_rana_dot_modules_dot_groups'].GROUP_EAGER_CPU", "model_x", "suppress"]
    flags = decode_step.step_guard_filter([_Entry(n) for n in dropped + kept])
    assert flags == [False] * len(dropped) + [True] * len(kept)


def test_step_compile_options_add_the_filter_and_keep_the_mode():
    """A mode becomes the options it stands for (torch.compile takes one or the other): on CUDA, reduce-overhead's
    CUDA graphs, the same inductor settings as the mode itself; the caller's kwargs are not modified."""
    cuda = {"fullgraph": True, "dynamic": None, "backend": "inductor", "mode": "reduce-overhead"}
    got = decode_step.step_compile_options(cuda)
    assert "mode" not in got and got["options"]["guard_filter_fn"] is decode_step.step_guard_filter
    assert cuda["mode"] == "reduce-overhead" and "options" not in cuda
    settings = {k: v for k, v in got["options"].items() if k != "guard_filter_fn"}
    assert torch._TorchCompileInductorWrapper("reduce-overhead", None, None).config == \
        torch._TorchCompileInductorWrapper(None, settings, None).config
    cpu = latency.step_compile_kwargs(tiny_model("llama"), "cpu")
    got = decode_step.step_compile_options(cpu)
    assert {k: v for k, v in got["options"].items() if k != "guard_filter_fn"} == cpu["options"]
    assert "guard_filter_fn" not in cpu["options"]
    assert decode_step.step_compile_options(EAGER_COMPILE)["options"] == {"guard_filter_fn":
                                                                          decode_step.step_guard_filter}


def test_compiled_steps_of_two_models_keep_their_own_graphs():
    """Without guards on the model, a step must never run a graph compiled for another model of the same
    architecture: each compiled step has a code object (a graph cache) of its own."""
    a = tiny_model("qwen2")
    b = copy.deepcopy(a)
    for layer in b.model.layers:
        layer.self_attn.scaling *= 30.0  # a Python float the traced graph holds as a constant
    ref_a, ref_b = step_greedy(a, PROMPT, 8), step_greedy(b, PROMPT, 8)
    assert not torch.equal(ref_a, ref_b)
    assert torch.equal(step_greedy(a, PROMPT, 8, EAGER_COMPILE), ref_a)
    assert torch.equal(step_greedy(b, PROMPT, 8, EAGER_COMPILE), ref_b)


def test_step_mode_in_public_api():
    model = tiny_model("llama")
    r = decode_latency(model, PROMPT, new_tokens=3, warmup=0, repeats=1, mode="step", compile_backend="eager")
    assert r["mode"] == "step" and r["new_tokens"] == 3 and len(r["generated_ids"]) == 3
    m = measure_latency(model, PROMPT, model, new_tokens=3, warmup=0, repeats=1, mode="step", compile_backend="eager")
    assert m["mode"] == "step" and m["latency_ratio"] == 1.0
    assert "step" in latency.LATENCY_MODES
    with pytest.raises(ValueError, match="latency mode"):
        decode_latency(model, PROMPT, new_tokens=2, warmup=0, repeats=1, mode="fast")


def _bench():
    spec = importlib.util.spec_from_file_location("bench_decode_gpu", REPO / "benchmarks" / "bench_decode_gpu.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_decode_gpu_smoke(tmp_path, monkeypatch):
    """The decode benchmark end to end on a tiny model: compression, repeated layers, both harnesses, the
    token comparison and the profile breakdown (CPU events); compiled with the eager backend."""
    make = latency.generation_config

    def eager_backend(*args):
        config = make(*args)
        if config.compile_config is not None:
            config.compile_config.backend = "eager"
        return config

    monkeypatch.setattr(latency, "generation_config", eager_backend)
    _bench().main(["--smoke", "--out", str(tmp_path / "d")])
    data = json.loads((tmp_path / "d.json").read_text())
    assert [r["harness"] for r in data["records"]] == ["step", "compiled"]
    for r in data["records"]:
        assert r["raw"]["tokens_per_s"] > 0 and r["raw"]["dense_tokens_per_s"] > 0
        assert r["eager_match"] == {"rana": 6, "dense": 6, "of": 6}  # float32: every token equals eager's
        assert r["compile_timed"]["graphs"] == 0 and r["compile_warmup"]["graphs"] >= 1
    (profile,) = data["profiles"]
    assert profile["rana"]["us_per_token"]["rana_masked"] > 0 and profile["dense"]["us_per_token"]["rana_masked"] == 0
    assert profile["rana"]["kernels_per_token"] > 0 and profile["rana"]["host_us_per_step"] > 0
    assert data["skipped"] == []
    text = (tmp_path / "d.md").read_text()
    assert "| tiny-llama | 0.58 | step |" in text and "Skipped:" in text


def test_bench_decode_gpu_time_budget_skips_and_lists(tmp_path):
    results = REPO / "benchmarks" / "results"
    before = sorted(results.iterdir()) if results.is_dir() else []
    data = _bench().main(["--smoke", "--time-budget", "0"])  # no --out: nothing written anywhere
    assert data["records"] == [] and data["profiles"] == []
    assert len(data["skipped"]) == 1 and "tiny-llama F=0.58: everything" in data["skipped"][0]
    assert (sorted(results.iterdir()) if results.is_dir() else []) == before
    order = _bench().work_order(["a", "b"], [0.85, 0.70, 0.58, 0.50])
    assert order[:2] == [("a", 0.58), ("b", 0.58)] and len(order) == 8
