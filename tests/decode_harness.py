"""Greedy single-token decoding under transformers' StaticCache, eager vs torch.compile(fullgraph=True).

torch + transformers only (no rana): exported models use it in a process that cannot import rana.
"""
from __future__ import annotations

import torch
from transformers import StaticCache

PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8]])
STEPS = 4
CACHE_LEN = 16


def greedy_static(model, step):
    """Prefill eagerly, then STEPS single-token steps through `step` with a fresh StaticCache."""
    cache = StaticCache(config=model.config, max_cache_len=CACHE_LEN)
    n = PROMPT.shape[1]
    with torch.no_grad():
        out = model(PROMPT, past_key_values=cache, use_cache=True, cache_position=torch.arange(n))
        tok, tokens, logits = out.logits[:, -1:].argmax(-1), [], []
        for i in range(STEPS):
            pos = n + i
            # a mask of the cache's full length: one shape for every step, so one compiled graph
            mask = (torch.arange(CACHE_LEN) <= pos).long().unsqueeze(0)
            step_logits = step(model, tok, cache, torch.tensor([pos]), mask)
            logits.append(step_logits)
            tok = step_logits[:, -1:].argmax(-1)
            tokens.append(tok)
    return torch.cat(logits, 1), torch.cat(tokens, 1)


def decode_step(model, tok, cache, pos, mask):
    return model(tok, attention_mask=mask, past_key_values=cache, use_cache=True, cache_position=pos).logits


def compiled_matches(model, backend="eager") -> set[str]:
    """Compile the decode step with fullgraph=True; assert eager logits/tokens; return the rana ops traced."""
    ref_logits, ref_tokens = greedy_static(model, decode_step)
    seen: set[str] = set()

    def recording(gm, example_inputs):
        seen.update(str(n.target).removesuffix(".default") for n in gm.graph.nodes if "rana" in str(n.target))
        if backend == "eager":
            return gm.forward
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    torch._dynamo.reset()
    step = torch.compile(decode_step, fullgraph=True, backend=recording)
    logits, tokens = greedy_static(model, step)
    torch._dynamo.reset()
    scale = float(ref_logits.abs().max())
    assert float((logits - ref_logits).abs().max()) <= 1e-5 * scale
    assert torch.equal(tokens, ref_tokens)
    return seen


def traced_targets(step, *args) -> set[str]:
    """Compile `step` with fullgraph=True, once recording the graph and once with aot_eager (which checks the ops'
    fake implementations); assert both give step(*args)'s eager outputs; return the call targets of the graph."""
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    eager = step(*args)
    for backend in (recording, "aot_eager"):
        torch._dynamo.reset()
        out = torch.compile(step, fullgraph=True, backend=backend)(*args)
        for o, e in zip(out, eager):
            torch.testing.assert_close(o, e, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    return {str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"}
