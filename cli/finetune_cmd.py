"""`rana finetune DIR --data train.txt --tokens 2M --laurel rw+lr --out OUT` (also under `accelerate launch`).

The options are `rana.finetune.FinetuneConfig`'s fields; `rana.finetune.finetune` checks them and every
input before any work. This module shows the run (a progress bar, warnings) and prints its summary."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from rana.finetune import FinetuneConfig
from rana.units import Progress as ProgressCallback  # rich's Progress is the bar

from .common import console, fail
from .common import out as stdout
from .options import settings_command


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
    @settings_command(app, "finetune", FinetuneConfig)
    def finetune_cmd(config: FinetuneConfig) -> None:
        """Fine-tune a compressed model: LoRA on the RaNA adapters, LAuReL residuals, or full training."""
        from rana.finetune import NonFiniteLossError, finetune

        if config.out is not None and "." in Path(config.out).name:
            console.print(f"[yellow]note:[/] '{Path(config.out).name}' contains a '.', which breaks `rana export` "
                          "remote-code loading; prefer names without dots")
        config.validate()  # before the bar starts: a bad option is one line, nothing above it (finetune checks again)
        # Not PartialState(): initialising accelerate's state here (before finetune picks CPU/GPU mode) would fix it
        # to single-process on CPU-only machines.
        main = int(os.environ.get("RANK", "0") or 0) == 0
        with _progress_bar(main) as bar:
            progress, on_log = _reporters(bar)
            try:
                result = finetune(config, progress=progress, on_log=on_log)
            except NonFiniteLossError as e:
                if not main:
                    raise typer.Exit(3)
                fail(str(e), 3)
        if result.is_main_process:
            print_result(result)


def _progress_bar(main: bool) -> Progress:
    """The training bar: steps, the latest loss / held-out perplexity / speed, time left (main process only)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TimeRemainingColumn(), console=console,
                    transient=False, disable=not main)


def _reporters(bar: Progress) -> tuple[ProgressCallback, Callable[[dict], None]]:
    """`progress(what, done, total)` and `on_log(record)` for `finetune`: one bar per stage, showing the
    latest train_log record; warnings and sweep results printed as they come."""
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

    return progress, on_log


def print_result(result) -> None:
    """The summary table and where the folder went, or how to continue a run stopped by --stop-after."""
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
