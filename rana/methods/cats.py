"""CATS (contextual activation thresholding): the gate stays dense; |act(gate·x)| below a
threshold switches off that neuron's row of up and column of down. MLP only."""
from __future__ import annotations

from ..archs import ArchSpec, set_submodule
from ..math.masks import subsample_rows, threshold_for_keep_fraction
from ..modules import CatsActivation
from .base import InputStats, LayerContext, MemoryNeed, Method, Step, adapter_entry, register, summary
from ..errors import UserError


def unsupported(spec: ArchSpec) -> str | None:
    """CATS thresholds act(gate·x) on its own: it needs a separate gate projection."""
    arch = spec.model_types[0]
    if spec.gate_up_fused:
        return (f"method 'cats' thresholds act(gate·x) computed on its own, so it needs a separate gate projection; "
                f"'{arch}' fuses gate and up in '{spec.gate_up_fused}' — use --method rana, rana-paper, svd or teal")
    if not spec.gate:
        return (f"method 'cats' needs a gated MLP (act(gate·x) ⊙ up·x); '{arch}' has a non-gated MLP "
                "— use --method rana, rana-paper, svd or teal")
    return None


def mlp(ctx: LayerContext, stats: dict[str, InputStats]) -> dict:
    spec = ctx.spec
    paths = spec.mlp_paths()
    if "gate" not in paths:
        raise UserError(unsupported(spec) or "CATS needs a gated MLP")
    gate, act = ctx.module(paths["gate"]), ctx.module(spec.act_path())
    inter, hidden = gate.weight.shape
    # gate dense (h·I) + kept rows of up and columns of down (2·h·k) = f · 3·h·I
    keep = (3 * ctx.fraction - 1) / 2
    x_fit = subsample_rows(stats["mlp_in"].fit, ctx.fit_sample_tokens)
    a = act(x_fit.float() @ gate.weight.float().T)
    t = threshold_for_keep_fraction(a.abs(), keep)
    set_submodule(ctx.layer, spec.act_path(), CatsActivation(act, t, hidden, inter))
    return summary({"act": adapter_entry("cats", spec.act_path(), inter, hidden, threshold=t,
                                         expected_active=keep * inter, expected_macs=hidden * inter * (1 + 2 * keep),
                                         dense_macs=3.0 * hidden * inter)})


register(Method(
    "cats", ("up", "gate", "down"), (Step(("mlp_in",), "mlp_in", (), mlp, "mlp"),), min_fraction=1 / 3 + 1e-3,
    description="CATS: dense gate, threshold on |act(gate)|, masked up/down (MLP only)",
    memory=MemoryNeed(decomposes=False), style=dict(color="tab:blue", marker="^"), unsupported=unsupported))
