"""`rana compress MODEL --flops F --out DIR`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from rana.compress import CompressConfig
from rana.methods import names

from rana.checks import check_inputs

from .common import LazyProgress, console, friendly
from .common import out as stdout


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
    line), and one warning line when that is harsh (rana.compress.head)."""
    from rana.compress.head import describe_budget, harsh_budget_warning

    console.print(describe_budget(budget), highlight=False, soft_wrap=True)
    if (warning := harsh_budget_warning(budget)) is not None:
        console.print(f"[yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)


def _with_recipe(ctx: typer.Context, options: dict, recipe: Optional[Path]) -> dict:
    """The settings to run: without a recipe the options as given; with one, the recipe's
    values overridden by the options actually typed on the command line."""
    if recipe is None:
        if options["model"] is None:
            raise ValueError("missing MODEL: pass a model (alias, hub id, folder or .gguf) or --recipe FILE")
        return options
    from rana.io.card import load_recipe

    settings = load_recipe(recipe)
    # by name: typer may ship its own copy of click's ParameterSource enum
    explicit = {k: v for k, v in options.items()
                if getattr(ctx.get_parameter_source(k), "name", None) in ("COMMANDLINE", "ENVIRONMENT", "PROMPT")}
    settings.update(explicit)
    if not settings.get("model"):
        raise ValueError(f"recipe {recipe} names no model: pass MODEL")
    return settings


def register(app: typer.Typer) -> None:
    @app.command("compress")
    @friendly
    def compress(
        ctx: typer.Context,
        model: Optional[str] = typer.Argument(None, help="alias (smollm2-135m, llama2-7b, …), hub id, local folder or .gguf file "
                                              "(may be omitted with --recipe)"),
        flops: float = typer.Option(CompressConfig.flops, "--flops", help="fraction of the dense model's per-token FLOPs to keep, in (0, 1]"),
        out: Path = typer.Option(..., "--out", "-o", help="output folder (must not exist unless --overwrite)"),
        method: str = typer.Option(CompressConfig.method, help=f"{' | '.join(names(ablations=False))} (ablations: {', '.join(names(ablations=True))})"),
        allocation: str = typer.Option(CompressConfig.allocation, help="FLOP allocation across layers: uniform (paper) | global (by measured sensitivity)"),
        lm_head: str = typer.Option(CompressConfig.lm_head, "--lm-head", help="auto: the method's choice (rana: sparse; the "
                                    "peers as published: dense) | dense: the LM head stays dense and the layers absorb the whole cut "
                                    "| sparse: input sparsity |x_j| ≥ t on the head's input, the same fraction of its MACs as every "
                                    "adapted projection (tied embeddings stay tied)"),
        recipe: Optional[Path] = typer.Option(None, "--recipe", help="re-run a recipe.json (or the folder holding one) written with "
                                              "every compressed model; options given here override its values"),
        dataset: Optional[str] = typer.Option(None, help="calibration text: hub dataset name or local .txt/.jsonl/.parquet file or folder (default: bundled corpus)"),
        dataset_config: Optional[str] = typer.Option(None, help="hub dataset config name"),
        split: str = typer.Option(CompressConfig.split, help="hub dataset split"),
        text_column: str = typer.Option(CompressConfig.text_column, help="text column for json/parquet/hub data"),
        calib_tokens: int = typer.Option(CompressConfig.calib_tokens, help="calibration tokens (fit + held-aside slice)"),
        seq_len: int = typer.Option(CompressConfig.seq_len, help="calibration sequence length"),
        batch_size: int = typer.Option(CompressConfig.batch_size, help="sequences per calibration forward"),
        dtype: str = typer.Option(CompressConfig.dtype, help="float32 | bfloat16 | float16"),
        device: str = typer.Option(CompressConfig.device, help="compute device (cpu, cuda, cuda:1, …)"),
        grid_step: float = typer.Option(CompressConfig.grid_step, help="MLP budget-split grid step (paper's grid search)"),
        seed: int = typer.Option(CompressConfig.seed),
        overwrite: bool = typer.Option(False, help="replace an existing --out folder"),
        max_memory: Optional[str] = typer.Option(None, "--max-memory", help="cap on the compute device's memory, e.g. 2GB or 80GiB: "
                                                 "checked against one layer's need before any work; on a CPU device a bigger checkpoint is streamed from disk"),
        weights: str = typer.Option(CompressConfig.weights, "--weights", help="none: full-precision weights | int8: "
                                    "quantize every linear of the decoder and the LM head last (per-output-channel "
                                    "int8, fp32 scales), thresholds refit on the quantized model"),
        offload_dir: Optional[Path] = typer.Option(None, "--offload-dir", help="stream the decoder layers from the checkpoint's safetensors "
                                                   "one at a time; compressed layers and calibration activations are kept here"),
    ) -> None:
        """Compress a model with RaNA adapters to a model-level FLOP budget."""
        from rana.compress import compress as run
        from rana.compress.distributed import is_main_process
        from rana.io import OutputExistsError, save
        from rana.io.models import model_inputs, resolve
        from rana.io.paths import check_output, check_work_dir, local_inputs, written_files

        if out.exists() and not overwrite:
            raise OutputExistsError(f"output folder '{out}' already exists; choose another --out or pass --overwrite")
        options = dict(model=model, flops=flops, method=method, allocation=allocation, lm_head=lm_head, dataset=dataset,
                       dataset_config=dataset_config, split=split, text_column=text_column, calib_tokens=calib_tokens,
                       seq_len=seq_len, batch_size=batch_size, dtype=dtype, device=device, grid_step=grid_step, seed=seed,
                       max_memory=max_memory, offload_dir=str(offload_dir) if offload_dir else None, weights=weights)
        config = CompressConfig(**_with_recipe(ctx, options, recipe))
        config.validate()
        config = config.resolved()  # the folder and its recipe record what ran, not "auto"
        offload_dir = Path(config.offload_dir) if config.offload_dir else None
        inputs = model_inputs(config.model) + local_inputs(config.dataset)
        check_output(out, inputs, overwrite=overwrite)
        check_work_dir(offload_dir, inputs, "--offload-dir", outputs=[out])
        if "." in out.name:
            console.print(f"[yellow]note:[/] '{out.name}' contains a '.', which breaks `rana export` remote-code loading; "
                          "prefer names without dots")
        resolve(config.model, dense=True)  # fail fast on an unknown model (or a rana folder), before any work starts
        check_inputs(config.model, seq_len=config.seq_len, out=out, data=[config.dataset], data_option="--dataset",
                     offload_dir=offload_dir)  # before any work starts
        with LazyProgress(f"compressing {config.model}") as progress:
            result = run(config, progress=progress, on_budget=report_budget)
        if not is_main_process():  # `accelerate launch`: every process holds the same model; one writes it
            return
        save(result.model, result.tokenizer, out, plan=result.plan, overwrite=overwrite, offloaded=result.offloaded,
             extra={"method": config.method, "compress_config": config.to_dict()})
        stdout.print(plan_table(result.plan))
        p = result.plan
        if (head := p.get("lm_head", {})).get("kind", "dense") != "dense":
            stdout.print(f"LM head: input sparsity, k̄={head['measured_active']:.0f}/{head['in_features']} inputs kept on "
                         f"held-aside tokens, logits error {head['heldout_error']:.4f}", highlight=False, soft_wrap=True)
        if (q := p.get("quantization")) is not None:
            errors = [m["relative_error"] for m in q["modules"]]
            stdout.print(f"int8 weights: {len(errors)} modules, relative output error mean "
                         f"{sum(errors) / max(len(errors), 1):.2e}, max {max(errors, default=0.0):.2e}; "
                         f"{len(q.get('refit') or {})} thresholds refit on the quantized model", highlight=False,
                         soft_wrap=True)
        stdout.print(f"target FLOPs {p['target_flops']:.3f}, measured {p['measured_flops']:.4f} on {p['measured_on']}; "
                     f"wrote {out}/ ({written_files(out)}) in {p['wall_time_s']:.0f}s", highlight=False, soft_wrap=True)
        if abs(p["measured_flops"] - p["target_flops"]) > 0.01:
            console.print("[yellow]warning:[/] measured FLOPs differ from the target by more than 0.01")
