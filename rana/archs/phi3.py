"""Phi-3: fused `qkv_proj` (rows q, then k, then v) and fused `gate_up_proj` (rows gate, then up:
`gate, up = gate_up_proj(x).chunk(2, -1)`, `h = activation_fn(gate) * up`). The fused gate/up is
adapted as one stacked rank adapter (like stacked QKV); CATS, which needs the gate alone, is not
available."""
from .base import ArchSpec, register

PHI3 = register(ArchSpec(
    model_types=("phi3",),
    q=None,
    k=None,
    v=None,
    qkv_fused="qkv_proj",
    o="o_proj",
    up=None,
    gate=None,
    gate_up_fused="gate_up_proj",
    down="down_proj",
    act="activation_fn",
    notes="fused qkv and gate_up (gate rows first)",
))
