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
    # a mixture-of-experts MLP: `experts` experts of `intermediate` neurons each, `top_k` of them run per
    # token (0: a dense MLP)
    experts: int = 0
    top_k: int = 0

    @property
    def active_experts(self) -> int:
        """How many experts' (or the one dense MLP's) projections one token runs through."""
        return self.top_k if self.experts else 1

    @property
    def stored_experts(self) -> int:
        """How many experts' weights the layer stores (1 for a dense MLP)."""
        return self.experts or 1

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
    """Per-token MACs of one dense decoder layer, by component. A mixture of experts counts the
    `top_k` experts a token is routed to (the active parameters), plus the router's E·H."""
    ctx = average_context(seq_len, d.sliding_window)
    mlp = float(d.active_experts * d.intermediate * d.hidden)
    macs = {
        "q": float(d.q_out * d.hidden),
        "k": float(d.kv_out * d.hidden),
        "v": float(d.kv_out * d.hidden),
        "o": float(d.hidden * d.q_out),
        "attn_products": float(2 * d.n_heads * d.head_dim * ctx),
        "up": mlp,
        "gate": mlp if d.gated else 0.0,
        "down": mlp,
    }
    if d.experts:  # the router stays dense (routing unchanged); no key for dense MLPs (plans stay as they were)
        macs["router"] = float(d.experts * d.hidden)
    return macs


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
