"""Batch-1 decoding on a GPU, dense vs rana, with models that need no download.

Builds Llama-2-7B-shaped (hidden 4096, intermediate 11008, 32 layers, 32 KV heads, vocabulary 32000)
and Llama-3-8B-shaped (intermediate 14336, 8 KV heads, vocabulary 128256) models with random weights.
Compressing all 32 layers per budget would dominate the run, so `--compress-layers` layers (default 2)
of a model of the same widths are compressed with rana's own `compress_model` on the GPU (bf16) at
each budget F, and their adapters are repeated over the 32 layers of a copy of the dense model. When
compression on the GPU fails (see the note in the output), it runs on the CPU in float32 and the
adapters are moved to the GPU. The per-layer budget is what F sets (the calibration model's vocabulary
is tiny, so its embedding and head weigh nothing in F); the end-to-end model keeps a dense LM head.

Timings come from `rana.evaluation.latency_ratio`, the harness of `rana eval --latency`: dense and rana
interleaved, each under eager `generate` (dynamic cache) and under static cache + torch.compile
(CUDA graphs), a fresh StaticCache per run. Writes benchmarks/results/decode_gpu.md + .json.

    python benchmarks/bench_decode_gpu.py                         # on a CUDA machine (~80 GB GPU)
    python benchmarks/bench_decode_gpu.py --smoke --out /tmp/d    # tiny shapes on CPU: code paths only
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch

BUDGETS = [0.85, 0.70, 0.58]
SHAPES = {
    "llama-2-7b-shaped": dict(hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                              num_key_value_heads=32, vocab_size=32000),
    "llama-3-8b-shaped": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                              num_key_value_heads=8, vocab_size=128256),
}
SMOKE_SHAPES = {"tiny-llama": dict(hidden_size=64, intermediate_size=160, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128)}


def _config(shape: dict, layers: int, vocab: int | None = None):
    from transformers import LlamaConfig

    kw = dict(shape, num_hidden_layers=layers, max_position_embeddings=4096)
    if vocab is not None:
        kw["vocab_size"] = vocab
    return LlamaConfig(**kw)


def _build(config, dtype, device, seed=0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def compressed_layers(shape: dict, budget: float, n_layers: int, dtype, device, smoke: bool, notes: list):
    """`n_layers` decoder layers compressed by rana at `budget` (on the GPU if it works, else CPU float32)."""
    from rana.compress import CompressConfig, compress_model

    vocab = 64
    calib = torch.randint(0, vocab, (24 if smoke else 72, 16 if smoke else 128), generator=torch.Generator().manual_seed(1))
    data = SimpleNamespace(fit=calib[: -4], heldout=calib[-4:])
    tokens = calib[:-4].numel()
    attempts = [(device, dtype)] + ([] if (torch.device(device).type == "cpu" and dtype == torch.float32) else [("cpu", torch.float32)])
    for dev, dt in attempts:
        model = _build(_config(shape, n_layers, vocab), dt, dev)
        cfg = CompressConfig(model="random", flops=budget, method="rana", calib_tokens=tokens, seq_len=calib.shape[1],
                             batch_size=4, search_tokens=min(512, tokens // 2), fit_sample_tokens=min(1024, tokens),
                             dtype={torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dt],
                             device=str(dev))
        start = time.perf_counter()
        try:
            compress_model(model, None, cfg, data)
        except Exception as exc:  # compression on the GPU / in bf16 is another issue's work: say so, fall back
            notes.append(f"compress on {dev} {dt} failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}); "
                         "falling back")
            continue
        notes.append(f"F={budget}: {n_layers} layers compressed on {dev} in {dt} in {time.perf_counter() - start:.0f} s")
        return [layer.to(device=device, dtype=dtype) for layer in model.model.layers]
    raise RuntimeError("compression failed on every device")


def rana_model(dense, layers):
    """A copy of `dense` whose decoder layers are copies of the compressed `layers`, repeated in turn."""
    from rana.modules import relink

    model = copy.deepcopy(dense)
    for i in range(len(model.model.layers)):
        layer = copy.deepcopy(layers[i % len(layers)])
        relink(layer)  # each copy's q/k/v (shared code, or grouped siblings) and gate/up use their own weights
        layer.self_attn.layer_idx = i
        model.model.layers[i] = layer
    return model.eval()


def run(args) -> dict:
    from rana.evaluation import latency_ratio

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    layers = 2 if args.smoke else 32
    budgets = [0.7] if args.smoke else args.budgets
    harnesses = ["eager", "compiled"]
    prompt = torch.randint(0, 64, (1, 8 if args.smoke else 64), generator=torch.Generator().manual_seed(2))
    records, notes = [], []
    for name, shape in shapes.items():
        dense = _build(_config(shape, layers), dtype, device)
        for budget in budgets:
            compressed = compressed_layers(shape, budget, args.compress_layers, dtype, device, args.smoke, notes)
            model = rana_model(dense, compressed)
            for harness in harnesses:
                r = latency_ratio(model, dense, prompt, new_tokens=args.new_tokens, warmup=args.warmup,
                                  repeats=args.repeats, mode=harness)
                records.append({"model": name, "budget": budget, "harness": harness,
                                "dense_ms_per_token": 1e3 / r["dense_decode_tokens_per_s"],
                                "rana_ms_per_token": 1e3 / r["decode_tokens_per_s"],
                                "speedup": r["decode_tokens_per_s"] / r["dense_decode_tokens_per_s"],
                                "limit": 1 / budget, "raw": r})
                torch._dynamo.reset()
            del model, compressed
            if device.type == "cuda":
                torch.cuda.empty_cache()
        del dense
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
            "torch": torch.__version__, "smoke": args.smoke, "dtype": str(dtype), "new_tokens": args.new_tokens,
            "prompt_tokens": prompt.shape[1], "compress_layers": args.compress_layers, "notes": notes,
            "records": records}


def markdown(result: dict) -> str:
    lines = [f"# Batch-1 decoding, dense vs rana, on {result['device']} (torch {result['torch']}, {result['dtype']})", "",
             f"{result['prompt_tokens']}-token prompt, {result['new_tokens']} new tokens, decode ms/token (prefill removed); "
             f"{result['compress_layers']} compressed layers repeated over the stack. Limit: 1/F (memory bound).",
             "Generated by `python benchmarks/bench_decode_gpu.py`.", "",
             "| model | F | harness | dense ms/token | rana ms/token | rana speed vs dense | limit |", "|---|---|---|---|---|---|---|"]
    for r in result["records"]:
        lines.append(f"| {r['model']} | {r['budget']} | {r['harness']} | {r['dense_ms_per_token']:.2f} | "
                     f"{r['rana_ms_per_token']:.2f} | {r['speedup']:.2f}x | {r['limit']:.2f}x |")
    lines += ["", "Notes:", *[f"- {n}" for n in result["notes"]]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model on CPU: exercise the code, no numbers")
    p.add_argument("--budgets", nargs="+", type=float, default=BUDGETS)
    p.add_argument("--compress-layers", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="output stem (default benchmarks/results/decode_gpu)")
    args = p.parse_args(argv)
    if args.smoke:
        if args.out is None:
            p.error("--smoke needs --out (smoke numbers never go into benchmarks/results)")
        args.new_tokens, args.warmup, args.repeats = min(args.new_tokens, 4), 0, 1
    elif not torch.cuda.is_available():
        p.error("needs a CUDA GPU (or --smoke)")
    out = args.out or (Path(__file__).resolve().parent / "results" / "decode_gpu")
    result = run(args)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
