"""`rana compress MODEL --flops F --out DIR`."""
from __future__ import annotations

import typer
from rich.table import Table

from rana.compress import CompressConfig

from .common import LazyProgress, console
from .common import out as stdout
from .options import settings_command


def plan_table(plan: dict) -> Table:
    """One row per layer: what was done to QKV and to each MLP projection, and the errors."""
    t = Table(title=f"{plan['method']} @ target {plan['target_flops']:.3f} → measured {plan['measured_flops']:.4f} of dense FLOPs",
              show_lines=False)
    for col in ("layer", "attention", "attn err", "mlp", "mlp split", "mlp err"):
        t.add_column(col, justify="right" if col in ("layer", "attn err", "mlp err") else "left")

    def describe(comps: dict) -> str:
        parts = []
        for name, c in comps.items():
            active = c.get("measured_active", c.get("expected_active"))
            if c["kind"] == "rank":
                parts.append(f"{name} r={c['rank']} k̄={active:.0f}" if active is not None else f"{name} r={c['rank']}")
            elif c["kind"] == "dense":
                parts.append(f"{name} dense")
            else:
                parts.append(f"{name} k̄={active:.0f}/{c['in_features'] if c['kind'] != 'cats' else c['out_features']}")
        return ", ".join(parts)

    for entry in plan["layers"]:
        att, mlp = entry.get("attention"), entry.get("mlp")
        t.add_row(str(entry["layer"]),
                  describe(att["components"]) if att else "dense", f"{att['heldout_error']:.4f}" if att else "-",
                  describe(mlp["components"]) if mlp else "dense",
                  "/".join(f"{s:.2f}" for s in mlp["shares"]) if mlp and mlp.get("shares") else "",
                  f"{mlp['heldout_error']:.4f}" if mlp else "-")
    return t


def report_budget(budget: dict) -> None:
    """Before calibration: what the adapted projections, the layers and the LM head keep (one
    line), and one warning line when that is harsh (rana.compress.lm_head)."""
    from rana.compress.lm_head import describe_budget, harsh_budget_warning

    console.print(describe_budget(budget), highlight=False, soft_wrap=True)
    if (warning := harsh_budget_warning(budget)) is not None:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)


def print_summary(plan: dict, out) -> None:
    """After saving: the LM head's and the int8 weights' lines, then the FLOPs measured and what was written."""
    from rana.io.paths import written_files

    if (head := plan.get("lm_head", {})).get("kind", "dense") != "dense":
        stdout.print(f"LM head: input sparsity, k̄={head['measured_active']:.0f}/{head['in_features']} inputs kept on "
                     f"held-aside tokens, logits error {head['heldout_error']:.4f}", highlight=False, soft_wrap=True)
    if (q := plan.get("quantization")) is not None:
        errors = [m["relative_error"] for m in q["modules"]]
        stdout.print(f"int8 weights: {len(errors)} modules, relative output error mean "
                     f"{sum(errors) / max(len(errors), 1):.2e}, max {max(errors, default=0.0):.2e}; "
                     f"{len(q.get('refit') or {})} thresholds refit on the quantized model", highlight=False,
                     soft_wrap=True)
    stdout.print(f"target FLOPs {plan['target_flops']:.3f}, measured {plan['measured_flops']:.4f} on {plan['measured_on']}; "
                 f"wrote {out}/ ({written_files(out)}) in {plan['wall_time_s']:.0f}s", highlight=False, soft_wrap=True)
    if abs(plan["measured_flops"] - plan["target_flops"]) > 0.01:
        console.print("[yellow]warning:[/] measured FLOPs differ from the target by more than 0.01")


def _note(text: str) -> None:
    console.print(f"[yellow]note:[/] {text}")


def register(app: typer.Typer) -> None:
    @settings_command(app, "compress", CompressConfig)
    def compress(config: CompressConfig) -> None:
        """Compress a model with RaNA adapters to a model-level FLOP budget."""
        import rana.compress  # looked up when called: tests stand in for rana.compress.compress
        from rana.compress.distributed import is_main_process
        from rana.io import save

        job = rana.compress.preflight(config, on_note=_note)  # every check, before any work starts
        with LazyProgress(f"compressing {job.config.model}") as progress:
            result = rana.compress.compress(job, progress=progress, on_budget=report_budget)
        if not is_main_process():  # `accelerate launch`: every process holds the same model; one writes it
            return
        save(result.model, result.tokenizer, config.out, plan=result.plan, overwrite=config.overwrite,
             offloaded=result.offloaded, extra={"method": job.config.method, "compress_config": job.config.to_dict()})
        stdout.print(plan_table(result.plan))
        print_summary(result.plan, config.out)
