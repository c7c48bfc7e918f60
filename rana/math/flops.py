"""FLOP accounting of docs/method.md §3, in multiply-accumulates (MACs) per token.

Counted: every linear layer (adapted or not; o_proj and lm_head stay dense unless a method
adapts them), the maskers' own products (the B-masker *is* `B x`), and attention's score and
value products at the average context length of decoding a `seq_len`-token sequence.
Not counted: norms, activations, rotary embeddings, mask comparisons and the embedding lookup
(no multiply-accumulates, or negligible next to the above). FLOPs = 2 × MACs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerDims:
    hidden: int
    q_out: int  # n_heads · head_dim
    kv_out: int  # n_kv_heads · head_dim (each of k and v)
    intermediate: int
    gated: bool
    n_heads: int
    head_dim: int
    sliding_window: int | None = None

    @property
    def qkv_out(self) -> int:
        return self.q_out + 2 * self.kv_out


def average_context(seq_len: int = 512, window: int | None = None) -> float:
    """Mean number of attended positions when decoding positions 1..seq_len."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    # positions 1..window attend to themselves and all before; later ones to `window`
    full = window * (window + 1) / 2
    return (full + (seq_len - window) * window) / seq_len


def dense_layer_macs(d: LayerDims, seq_len: int = 512) -> dict[str, float]:
    """Per-token MACs of one dense decoder layer, by component."""
    ctx = average_context(seq_len, d.sliding_window)
    return {
        "q": float(d.q_out * d.hidden),
        "k": float(d.kv_out * d.hidden),
        "v": float(d.kv_out * d.hidden),
        "o": float(d.hidden * d.q_out),
        "attn_products": float(2 * d.n_heads * d.head_dim * ctx),
        "up": float(d.intermediate * d.hidden),
        "gate": float(d.intermediate * d.hidden) if d.gated else 0.0,
        "down": float(d.hidden * d.intermediate),
    }


def dense_model_macs(layers: list[LayerDims], vocab_size: int, seq_len: int = 512) -> dict[str, float]:
    """Per-token MACs of the dense model: layers summed by component, plus lm_head."""
    total: dict[str, float] = {}
    for d in layers:
        for k, v in dense_layer_macs(d, seq_len).items():
            total[k] = total.get(k, 0.0) + v
    total["lm_head"] = float(vocab_size * layers[0].hidden)
    total["total"] = sum(total.values())
    return total


def adapted_fraction(target: float, dense_total: float, adapted_dense: float) -> float:
    """The fraction f the adapted components must spend so the whole model spends `target`.

    target·dense_total = (dense_total − adapted_dense) + f·adapted_dense.
    """
    if adapted_dense <= 0:
        raise ValueError("no adapted components")
    return (target * dense_total - (dense_total - adapted_dense)) / adapted_dense
