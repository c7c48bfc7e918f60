"""The compiled decode path on CUDA (skipped elsewhere): a tiny rana-adapted Llama in bf16 and fp16.

- a one-token decode step under torch.compile(backend="inductor", mode="reduce-overhead", fullgraph=True)
  gives the eager step's logits, with rana's Triton op (rana::decode_masked_triton) in the traced graph,
  and nothing recompiles or re-records its CUDA graphs over the following tokens;
- the "step" and "compiled" latency harnesses decode eager generate's greedy tokens, with no compile
  event during their timed runs.

Needs the Triton kernels compiled for the GPU, so it skips under TRITON_INTERPRET=1 (tests/conftest.py's
default; the GPU suite runs `pytest -m cuda` with TRITON_INTERPRET=0)."""
from __future__ import annotations

import os

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="TRITON_INTERPRET=1: the kernels would be interpreted; run with TRITON_INTERPRET=0"),
]

PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8]])
STEPS = 12
WARM = 3  # compiled steps before the counters are read: the first runs eagerly, the second records the graph
# logits of the compiled step vs the eager one, relative to the largest eager logit: inductor fuses and
# reorders the non-GEMV arithmetic, and a score near a threshold may round to the other side of it
TOLERANCE = {torch.bfloat16: 5e-2, torch.float16: 1e-2}
TOKENS_EQUAL = 8  # greedy tokens that must equal eager generate's (half precision may diverge later)


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def model(request):
    """Shared rank code + q/k/v slices, rank adapters (gate/up, one grouped launch), neuron thresholding
    (down), TEAL input sparsity (o), thresholds at the median calibration score."""
    from helpers import tiny_model
    from test_export import adapt_like_rana

    model = tiny_model("llama")
    calib = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapt_like_rana(model, calib)
    return model.to("cuda", request.param).eval()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _recording_inductor(seen: set):
    """inductor with mode="reduce-overhead" (CUDA graphs: exactly what that mode sets), recording the rana ops
    of each traced graph first."""
    from torch._inductor.compile_fx import compile_fx

    def backend(gm, example_inputs):
        seen.update(str(n.target).removesuffix(".default") for n in gm.graph.nodes if "rana" in str(n.target))
        return compile_fx(gm, example_inputs, config_patches=torch._inductor.list_mode_options("reduce-overhead"))

    return backend


def _teacher_forced_logits(model, fn, tokens: list[torch.Tensor], cache, counters_at: int | None = None):
    """Prefill, then one step of `fn` per token of `tokens` (the same inputs for eager and compiled);
    the logits of each step and, if asked, the compile counters after step `counters_at`."""
    from rana.evaluation import compile_counters
    from rana.evaluation.decode_step import mark_step, greedy_fn, prefill

    token, position = prefill(greedy_fn(model), PROMPT.cuda(), cache)
    logits, snapshot = [], None
    for i, tok in enumerate([token, *tokens[:-1]]):
        mark_step()
        logits.append(fn(tok, position, cache).float().clone())
        position += 1
        if i + 1 == counters_at:
            snapshot = compile_counters()
    return torch.stack(logits), snapshot


@torch.inference_mode()
def test_compiled_step_matches_eager_with_the_triton_op(model):
    from rana.evaluation import compile_counters
    from rana.evaluation.decode_step import logits_fn, new_cache, step_greedy

    eager_tokens = step_greedy(model, PROMPT.cuda(), STEPS)
    tokens = [eager_tokens[:, i:i + 1] for i in range(1, STEPS)]
    cache = new_cache(model, PROMPT.shape[1] + STEPS)
    ref, _ = _teacher_forced_logits(model, logits_fn(model), tokens, cache)
    seen: set[str] = set()
    step = torch.compile(logits_fn(model), fullgraph=True, backend=_recording_inductor(seen))
    got, warm = _teacher_forced_logits(model, step, tokens, cache, counters_at=WARM)
    after = compile_counters()
    assert "rana.decode_masked_triton" in seen, seen
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) <= TOLERANCE[model.dtype] * scale
    assert after["graphs"] == warm["graphs"], "the decode step recompiled"
    assert after["cudagraph_recorded_inputs"] == warm["cudagraph_recorded_inputs"], "CUDA graphs were re-recorded"
    assert after["graph_breaks"] == 0


@torch.inference_mode()
def test_compiled_step_is_inductor_reduce_overhead(model):
    """The harness's own compile settings on CUDA: inductor, CUDA graphs, fullgraph."""
    from rana.evaluation import step_compile_kwargs

    kwargs = step_compile_kwargs(model, "cuda")
    assert kwargs["backend"] == "inductor" and kwargs["mode"] == "reduce-overhead" and kwargs["fullgraph"]


@pytest.mark.parametrize("mode", ["step", "compiled"])
def test_harness_greedy_tokens_equal_eager(model, mode):
    from rana.evaluation import decode_latency

    ref = decode_latency(model, PROMPT, new_tokens=STEPS, warmup=0, repeats=1, mode="eager")["generated_ids"]
    r = decode_latency(model, PROMPT, new_tokens=STEPS, warmup=1, repeats=2, mode=mode)
    assert r["mode"] == mode and r["decode_tokens_per_s"] > 0
    assert r["generated_ids"][:TOKENS_EQUAL] == ref[:TOKENS_EQUAL]
    assert r["compile_warmup"]["graphs"] >= 1  # compiled in the warm-up round, not in a timed run
    assert r["compile_timed"] == {"graphs": 0, "graph_breaks": 0, "cudagraph_recorded_inputs": 0,
                                  "cudagraph_skips": 0}
