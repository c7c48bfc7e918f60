"""`rana finetune DIR --data train.txt --tokens 2M --laurel rw+lr --out OUT` (also under `accelerate launch`)."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rana.finetune import FinetuneConfig

from .common import console, fail, friendly
from .common import out as stdout


def summary_table(s: dict) -> Table:
    t = Table(title=f"rana finetune ({s['mode']}{' + LAuReL ' + s['laurel']['variant'] if s.get('laurel') else ''})")
    t.add_column("")
    t.add_column("value", justify="right")

    def ppl(x):
        return "-" if x is None else f"{x:.3f}"

    rows = [
        ("held-out ppl before", ppl(s["heldout_ppl_before"])),
        ("held-out ppl after", ppl(s["heldout_ppl_after"])),
        ("tokens trained", f"{s['tokens_trained']:,} ({s['steps']} steps × {s['tokens_per_step']:,}, {s['epochs']:.2f} epochs)"),
        ("learning rate", f"{s['lr']:.3g}" + (" (swept)" if s.get("lr_sweep") else "")),
        ("trainable params", f"{s['trainable_params']:,}"),
        ("  of which LoRA / LAuReL", f"{s['lora_params']:,} / {s['laurel_params']:,}"),
        ("train tokens/s", f"{s['tokens_per_s']:,.0f}"),
        ("processes / precision", f"{s['num_processes']} × {s['device']} / {s['mixed_precision']}"),
        ("wall time", f"{s['wall_time_s']:.0f} s"),
    ]
    for r in s.get("lr_sweep") or []:
        rows.append((f"  sweep lr {r['lr']:.3g}", f"held-out ppl {ppl(r['heldout_ppl'])}"))
    for k, v in rows:
        t.add_row(k, v)
    return t


def register(app: typer.Typer) -> None:
    @app.command("finetune")
    @friendly
    def finetune_cmd(
        source: str = typer.Argument(..., help="rana folder from `rana compress` (or, with --full / --lora-targets, a dense model)"),
        out: Optional[Path] = typer.Option(None, "--out", "-o", help="output rana folder (must not exist unless --overwrite)"),
        data: Optional[str] = typer.Option(None, help="training text: hub dataset, local .txt/.jsonl/.json/.parquet file or folder, or .pt/.npy token ids (default: bundled corpus)"),
        eval_data: Optional[str] = typer.Option(None, help="held-out data (same kinds; default: the tail of --data)"),
        dataset_config: Optional[str] = typer.Option(None, help="hub dataset config name"),
        split: str = typer.Option(FinetuneConfig.split, help="hub dataset split"),
        text_column: str = typer.Option(FinetuneConfig.text_column, help="text column for json/parquet/hub data"),
        tokenizer: Optional[str] = typer.Option(None, help="take the tokenizer from this model when the source has none"),
        tokens: str = typer.Option("2M", help="training token budget, e.g. 2M, 500k, 1.5e6"),
        seq_len: int = typer.Option(FinetuneConfig.seq_len, help="tokens per packed training block"),
        batch_size: int = typer.Option(FinetuneConfig.batch_size, help="blocks per micro-batch, per process"),
        grad_accum: int = typer.Option(FinetuneConfig.grad_accum, help="micro-batches per optimizer step"),
        lr: Optional[float] = typer.Option(None, help="peak learning rate (default 2e-4 LoRA, 2e-5 full, 1e-3 LAuReL only)"),
        lr_sweep: bool = typer.Option(FinetuneConfig.lr_sweep, "--lr-sweep", help="try a few learning rates on a short prefix, keep the best held-out loss"),
        sweep_lrs: Optional[str] = typer.Option(None, help="comma list of learning rates for --lr-sweep (default lr × 0.25, 1, 4)"),
        sweep_frac: float = typer.Option(FinetuneConfig.sweep_frac, help="share of the budget each sweep trial trains for"),
        warmup: float = typer.Option(FinetuneConfig.warmup, help="warm-up share of the steps (then cosine decay)"),
        min_lr_ratio: float = typer.Option(FinetuneConfig.min_lr_ratio, help="cosine floor as a share of the peak lr"),
        weight_decay: float = typer.Option(FinetuneConfig.weight_decay, help="AdamW weight decay (matrices only)"),
        max_grad_norm: float = typer.Option(FinetuneConfig.max_grad_norm, help="gradient clipping (0: off)"),
        full: bool = typer.Option(FinetuneConfig.full, "--full", help="full fine-tuning of every weight"),
        lora_targets: Optional[str] = typer.Option(None, help="adapters (default) | all (adapters + unadapted projections) | none | comma list of module names"),
        lora_r: int = typer.Option(FinetuneConfig.lora_r, help="LoRA rank"),
        lora_alpha: float = typer.Option(FinetuneConfig.lora_alpha, help="LoRA alpha"),
        lora_dropout: float = typer.Option(FinetuneConfig.lora_dropout, help="LoRA dropout"),
        laurel: str = typer.Option(FinetuneConfig.laurel, help="LAuReL residuals: none | rw | lr | rw+lr | rw+lr+pa (any '+' mix of rw, skip, lr, pa)"),
        laurel_rank: int = typer.Option(FinetuneConfig.laurel_rank, help="rank of LAuReL's low-rank map (lr)"),
        laurel_history: int = typer.Option(FinetuneConfig.laurel_history, help="previous activations mixed by LAuReL-PA"),
        self_guided_frac: float = typer.Option(FinetuneConfig.self_guided_frac, help="self-guided start: α·dense + (1−α)·adapted, α → 0 over this share of the steps"),
        dense_model: Optional[str] = typer.Option(None, help="dense model for --self-guided-frac (default: plan.json's model)"),
        precision: str = typer.Option(FinetuneConfig.precision, help="auto (bf16 on CUDA with bf16, else fp32) | no | bf16 | fp16"),
        dtype: str = typer.Option(FinetuneConfig.dtype, help="weight dtype while training: float32 | bfloat16 | float16"),
        gradient_checkpointing: bool = typer.Option(FinetuneConfig.gradient_checkpointing, "--gradient-checkpointing", help="recompute activations in backward (less memory)"),
        seed: int = typer.Option(FinetuneConfig.seed),
        eval_every: int = typer.Option(FinetuneConfig.eval_every, help="steps between held-out evaluations (0: about 10 per run)"),
        eval_tokens: int = typer.Option(FinetuneConfig.eval_tokens, help="held-out tokens scored per evaluation (at most)"),
        eval_at_start: bool = typer.Option(FinetuneConfig.eval_at_start, "--eval-at-start/--no-eval-at-start", help="score the held-out set before training"),
        heldout_fraction: float = typer.Option(FinetuneConfig.heldout_fraction, help="share of --data held out when --eval-data is not given"),
        save_every: Optional[int] = typer.Option(None, help="steps between checkpoints (default: about 5 per run; 0: none)"),
        checkpoint_dir: Optional[Path] = typer.Option(None, help="checkpoint folder (default OUT/.checkpoints, removed when the run finishes)"),
        keep_checkpoints: int = typer.Option(FinetuneConfig.keep_checkpoints, help="newest checkpoints kept"),
        resume: bool = typer.Option(FinetuneConfig.resume, "--resume", help="continue from the newest checkpoint (same settings required)"),
        stop_after: Optional[int] = typer.Option(None, help="stop after this many steps, with a checkpoint, to --resume later"),
        overwrite: bool = typer.Option(FinetuneConfig.overwrite, help="replace an existing --out folder / start over its checkpoints"),
    ) -> None:
        """Fine-tune a compressed model: LoRA on the RaNA adapters, LAuReL residuals, or full training."""
        from rana.finetune import NonFiniteLossError, finetune
        from rana.units import parse_tokens

        if out is None and checkpoint_dir is None:
            fail("pass --out OUT (where the fine-tuned rana folder goes)")
        if out is not None and "." in out.name:
            console.print(f"[yellow]note:[/] '{out.name}' contains a '.', which breaks `rana export` remote-code loading; "
                          "prefer names without dots")
        config = FinetuneConfig(
            source=source, out=str(out) if out else None, data=data, eval_data=eval_data, dataset_config=dataset_config,
            split=split, text_column=text_column, tokenizer=tokenizer, tokens=parse_tokens(tokens), seq_len=seq_len,
            batch_size=batch_size, grad_accum=grad_accum, lr=lr, lr_sweep=lr_sweep, sweep_lrs=sweep_lrs or (),
            sweep_frac=sweep_frac, warmup=warmup, min_lr_ratio=min_lr_ratio, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, full=full, lora_targets=lora_targets, lora_r=lora_r, lora_alpha=lora_alpha,
            lora_dropout=lora_dropout, laurel=laurel, laurel_rank=laurel_rank, laurel_history=laurel_history,
            self_guided_frac=self_guided_frac, dense_model=dense_model, precision=precision, dtype=dtype,
            gradient_checkpointing=gradient_checkpointing, seed=seed, eval_every=eval_every, eval_tokens=eval_tokens, eval_at_start=eval_at_start,
            heldout_fraction=heldout_fraction, save_every=save_every,
            checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None, keep_checkpoints=keep_checkpoints,
            resume=resume, stop_after=stop_after, overwrite=overwrite)
        config.validate()

        # Not PartialState(): initialising accelerate's state here (before finetune picks CPU/GPU mode) would fix it
        # to single-process on CPU-only machines.
        main = int(os.environ.get("RANK", "0") or 0) == 0
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), TimeRemainingColumn(), console=console, transient=False, disable=not main) as bar:
            tasks: dict[str, int] = {}
            last: dict = {}

            def progress(what: str, done: int, total: int) -> None:
                if what not in tasks:
                    tasks[what] = bar.add_task(what, total=total, info="")
                bar.update(tasks[what], completed=done, total=total, info=_info(last))

            def on_log(record: dict) -> None:
                if "warning" in record:
                    console.print(f"[yellow]warning:[/] {record['warning']}", highlight=False, soft_wrap=True)
                elif "sweep" in record:
                    r = record["sweep"]
                    console.print(f"sweep lr {r['lr']:.3g}: held-out ppl {r['heldout_ppl']:.3f}")
                else:
                    last.update(record)

            try:
                result = finetune(config, progress=progress, on_log=on_log)
            except NonFiniteLossError as e:
                if not main:
                    raise typer.Exit(3)
                fail(str(e), 3)
        if not result.is_main_process:
            return
        s = result.summary
        if s["status"] == "stopped":
            stdout.print(f"stopped after step {s['steps']} of {s['total_steps']} as asked (--stop-after); checkpoint "
                         f"{s['checkpoint']}; continue with the same command plus --resume")
            return
        stdout.print(summary_table(s))
        if result.out is not None:
            stdout.print(f"wrote {result.out}/ (rana folder + train_log.jsonl + finetune.json)")


def _info(record: dict) -> str:
    parts = []
    if "loss" in record:
        parts.append(f"loss {record['loss']:.4f}")
    if record.get("heldout_ppl") is not None:
        parts.append(f"held-out ppl {record['heldout_ppl']:.3f}")
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:,.0f} tok/s")
    return "  ".join(parts)
