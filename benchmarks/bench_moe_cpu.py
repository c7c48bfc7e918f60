"""Batch-1 CPU decode time of a compressed mixture of experts against its dense model (not a test).

    python benchmarks/bench_moe_cpu.py                      # Mixtral-style random MoE, 8 experts, top 2
    python benchmarks/bench_moe_cpu.py --quick              # a smaller model, fewer tokens (smoke run)
    python benchmarks/bench_moe_cpu.py --flops 0.7 0.5 --threads 2 --new-tokens 64

A random Mixtral config (no checkpoint, no data: calibration on random token ids) is compressed with
`--method` (default rana: per-expert input sparsity, attention as for dense models) at each F. Each
model then decodes the same prompt greedily, one token per forward with a KV cache (the batch-1 path:
the routed experts through rana::expert_masked_gemv), dense and compressed runs interleaved; the
median seconds per decoded token and the ratio compressed / dense are printed and written to
benchmarks/results/moe_decode_cpu.{md,json}. Random weights: the ratios say what the kernels do at
these sparsities, not what a trained MoE's quality would be.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from types import SimpleNamespace

import torch

from _paths import RESULTS
from rana.compress import CompressConfig, compress_model

FULL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
            vocab_size=8192, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=1024)
QUICK = dict(FULL, hidden_size=256, intermediate_size=512, num_hidden_layers=2, vocab_size=2048)


def random_moe(dims: dict, seed: int = 0):
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**dims)).eval()


def compress(dense, flops: float, method: str, dims: dict, calib_seqs: int):
    ids = torch.randint(0, dims["vocab_size"], (calib_seqs + 4, 64), generator=torch.Generator().manual_seed(1))
    cfg = CompressConfig(model="random-moe", flops=flops, method=method, calib_tokens=64 * calib_seqs, seq_len=64,
                         batch_size=4, search_tokens=256, fit_sample_tokens=1024)
    result = compress_model(copy.deepcopy(dense), None, cfg, SimpleNamespace(fit=ids[:calib_seqs], heldout=ids[calib_seqs:]))
    return result.model.eval(), result.plan["measured_flops"]


@torch.no_grad()
def seconds_per_token(model, prompt: torch.Tensor, new_tokens: int) -> float:
    """Prefill, then `new_tokens` single-token greedy steps; the median step time."""
    out = model(prompt, use_cache=True)
    cache, tok, times = out.past_key_values, out.logits[:, -1:].argmax(-1), []
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        out = model(tok, past_key_values=cache, use_cache=True)
        times.append(time.perf_counter() - t0)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return statistics.median(times)


def interleaved(models: dict, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict[str, float]:
    """Median over `repeats` rounds of each model's median step time, the models alternating per round."""
    runs = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            runs[name].append(seconds_per_token(model, prompt, new_tokens))
    return {name: statistics.median(v) for name, v in runs.items()}


def report(dims: dict, args, measured: dict, times: dict) -> str:
    dense = times["dense"]
    lines = [f"# Batch-1 CPU decode, random Mixtral-style MoE ({dims['num_local_experts']} experts, top "
             f"{dims['num_experts_per_tok']}, hidden {dims['hidden_size']}, expert width {dims['intermediate_size']}, "
             f"{dims['num_hidden_layers']} layers), {args.threads} thread(s), method {args.method}", "",
             "| model | measured F | ms / token | ratio to dense |", "|---|---|---|---|",
             f"| dense | 1.000 | {1e3 * dense:.3f} | 1.000 |"]
    for name, f in measured.items():
        lines.append(f"| {name} | {f:.3f} | {1e3 * times[name]:.3f} | {times[name] / dense:.3f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flops", type=float, nargs="+", default=[0.7, 0.5])
    ap.add_argument("--method", default="rana")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smaller model, 8 tokens, 2 repeats (smoke run)")
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dims = QUICK if args.quick else FULL
    new_tokens, repeats = (8, 2) if args.quick else (args.new_tokens, args.repeats)
    dense = random_moe(dims)
    models, measured = {"dense": dense}, {}
    for f in args.flops:
        name = f"F={f:.2f}"
        models[name], measured[name] = compress(dense, f, args.method, dims, calib_seqs=16 if args.quick else 48)
    prompt = torch.randint(0, dims["vocab_size"], (1, 16), generator=torch.Generator().manual_seed(2))
    times = interleaved(models, prompt, new_tokens, repeats)
    text = report(dims, args, measured, times)
    print(text)
    if not args.no_write:
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / "moe_decode_cpu.md").write_text(text)
        (RESULTS / "moe_decode_cpu.json").write_text(json.dumps(
            {"dims": dims, "method": args.method, "threads": args.threads, "new_tokens": new_tokens,
             "repeats": repeats, "seconds_per_token": times, "measured_flops": measured}, indent=2))


if __name__ == "__main__":
    main()
