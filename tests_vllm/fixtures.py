"""Tiny rana exports (quantizer format) for the vLLM tests, built in-process from random HF models.

vLLM's CPU attention takes head sizes of 32, 64, 80, 96, 112, 128, ...: the tiny configs use 64 (rana's unit-test
configs use 16). Each export is compressed on random tokens (a tiny random model has no text to calibrate on)."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

VLLM_TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=257, max_position_embeddings=256, head_dim=64)


def build_export(out: Path, arch: str, method: str = "rana", *, seed: int = 0, tied: bool = False,
                 weights: str | None = None, activations: str = "float", laurel: str | None = None,
                 flops: float = 0.7) -> Path:
    """A tiny `arch` model compressed with `method` (None: left dense), then int8 with `weights="int8"`, exported
    to `out`."""
    from helpers import byte_tokenizer, tiny_model

    import rana.io as rio
    from rana.compress import CompressConfig, compress_model
    from rana.export import export

    out = Path(out)
    work = out.parent / f"{out.name}.rana"
    model = tiny_model(arch, seed=seed, tie_word_embeddings=tied, **VLLM_TINY)
    if arch == "qwen2":  # q/k/v biases that matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    ids = torch.randint(0, VLLM_TINY["vocab_size"], (20, 32), generator=torch.Generator().manual_seed(seed))
    cfg = CompressConfig(model="x", flops=flops, method=method or "rana", calib_tokens=512, seq_len=32, batch_size=4,
                         search_tokens=128, fit_sample_tokens=256)
    plan = {}
    if method is not None:
        result = compress_model(model, None, cfg, SimpleNamespace(fit=ids[:16], heldout=ids[16:]))
        model, plan = result.model.eval(), dict(result.plan)
    if weights == "int8":
        from rana.quantize import quantize_model
        plan.update(weights="int8", quantization=quantize_model(model, ids[:16], batch_size=4, activations=activations))
    extra = None
    if laurel:
        from rana.modules.laurel import LaurelConfig, apply_laurel
        lcfg = LaurelConfig(variant=laurel, rank=4, history=3)
        apply_laurel(model, lcfg)
        extra = {"laurel": lcfg.to_dict()}
    rio.save(model, byte_tokenizer(), work, plan=plan, extra=extra)
    export(work, out, format="quantizer")
    return out
