"""`finetune()`: check the inputs → prepare the data → [lr sweep] → train → merge → write the rana folder."""
from __future__ import annotations

import gc
import json
import math
import shutil
import time
from pathlib import Path
from typing import Callable

import torch.nn as nn

from ..checks import check_available, check_seq_len
from ..io.format import write_json
from ..io import atomic_dir, save
from ..units import Progress
from .checkpoints import CHECKPOINTS, TRAIN_LOG, CheckpointFolder
from .config import SWEEP_FACTORS, FinetuneConfig, FinetuneResult, NonFiniteLossError, default_lr
from .data import prepare_blocks
from .source import Source, inspect_source, probe_tokenizer
from .trainer import LossFn, Trainer, TrainResult, make_accelerator, next_token_loss

SUMMARY = "finetune.json"


def finetune(config: FinetuneConfig, progress: Progress | None = None,
             on_log: Callable[[dict], None] | None = None, *, loss: LossFn = next_token_loss) -> FinetuneResult:
    """Fine-tune `config.source` and (with `config.out`) save a rana folder.

    `progress(what, done, total)` reports steps ("train", or "sweep lr=…" during a sweep) and
    `on_log(record)` receives each train_log record; both on the main process only. `loss(model, batch)`
    is the training loss of a (B, T) batch of token ids (default: the mean next-token loss). Raises
    FinetuneError / DataError for unusable inputs and NonFiniteLossError when training diverges.
    """
    config.validate()
    started_at = time.perf_counter()
    source = inspect_source(config)
    accelerator = make_accelerator(config)
    folder = CheckpointFolder(config, accelerator, on_log)
    # Every input is checked before the checkpoint folder is created: a run refused on its inputs
    # leaves nothing behind that would block the same command once they are fixed.
    resume_state = folder.check()
    check_seq_len(source.path, config.seq_len)
    for ref in (config.tokenizer, config.dense_model if config.self_guided_frac > 0 else None):
        if ref is not None:
            check_available(ref)

    # data (the tokenizer / vocabulary comes from the source; loading it is cheap next to training)
    tokenizer, vocab = probe_tokenizer(source, config)
    with accelerator.main_process_first():
        train_blocks, heldout_blocks = prepare_blocks(config, tokenizer, vocab)
    out_existed = folder.out is not None and folder.out.exists()
    folder.prepare(resume_state)
    trainer = Trainer(config, source, train_blocks, heldout_blocks, accelerator, folder,
                      log=resume_state.get("log", []) if resume_state is not None else (), loss=loss,
                      progress=progress, on_log=on_log, started_at=started_at)
    try:
        return _train_and_save(trainer, resume_state)
    except BaseException:
        folder.discard_if_unused(out_existed)
        raise


def _train_and_save(trainer: Trainer, resume_state: dict | None) -> FinetuneResult:
    config, acc, folder = trainer.config, trainer.accelerator, trainer.checkpoints
    total_steps = max(1, math.ceil(config.tokens / trainer.tokens_per_step))

    # learning rate: resumed, swept, or given
    if resume_state is not None:
        lr, sweep = float(resume_state["lr"]), resume_state.get("sweep")
    elif config.lr_sweep:
        lr, sweep = sweep_lr(trainer, total_steps)
    else:
        lr, sweep = default_lr(config), None

    result = trainer.run(lr, total_steps, resume_state=resume_state, sweep=sweep)
    summary = run_summary(trainer, result, lr=lr, sweep=sweep, total_steps=total_steps, resume_state=resume_state)
    if result.status == "stopped":
        acc.free_memory(*result.prepared)
        return FinetuneResult(model=None, tokenizer=result.tokenizer, summary=summary, log=trainer.records, out=None,
                              is_main_process=trainer.is_main)

    merged = trainer.merge(result.model)
    acc.free_memory(*result.prepared)
    out = None
    if merged is not None and trainer.is_main and folder.out is not None:
        out = write_output(folder, trainer.source, merged, result, summary, trainer.records)
    acc.wait_for_everyone()
    if folder.out is not None:
        out = folder.out  # an explicit --checkpoint-dir is left in place for the user
    return FinetuneResult(model=merged, tokenizer=result.tokenizer, summary=summary, log=trainer.records, out=out,
                          is_main_process=trainer.is_main)


def sweep_lr(trainer: Trainer, total_steps: int) -> tuple[float, list[dict]]:
    """Paper's procedure: a few learning rates on a short prefix of the budget, keep the best held-out loss."""
    cfg, acc = trainer.config, trainer.accelerator
    base = default_lr(cfg)
    lrs = list(cfg.sweep_lrs) or [base * f for f in SWEEP_FACTORS]
    steps = max(1, round(cfg.sweep_frac * total_steps))
    results = []
    for lr in lrs:
        label = f"sweep lr={lr:.3g}"
        try:
            trial = trainer.run(lr, steps, trial=label)
            loss = trial.final_eval["loss"]
            acc.free_memory(trial.model, *trial.prepared)
            del trial
        except NonFiniteLossError:
            loss = float("inf")
            acc.free_memory()
        gc.collect()
        results.append({"lr": lr, "steps": steps, "heldout_loss": loss,
                        "heldout_ppl": math.exp(min(loss, 700.0)) if math.isfinite(loss) else float("inf")})
        if trainer.is_main and trainer.on_log is not None:
            trainer.on_log({"sweep": results[-1]})
    finite = [r for r in results if math.isfinite(r["heldout_loss"])]
    if not finite:
        raise NonFiniteLossError(f"every learning rate of the sweep ({', '.join(f'{x:.3g}' for x in lrs)}) diverged; "
                                 "pass smaller --sweep-lrs")
    best = min(finite, key=lambda r: r["heldout_loss"])
    return best["lr"], results


def run_summary(trainer: Trainer, result: TrainResult, *, lr: float, sweep: list | None, total_steps: int,
                resume_state: dict | None) -> dict:
    """finetune.json: what trained, on how much data, the held-out loss before and after, speed, the config."""
    config, acc, trains = trainer.config, trainer.accelerator, result.trainables
    per_step_tokens = trainer.tokens_per_step
    before = next((r for r in trainer.records if r.get("step") == 0 and "heldout_ppl" in r), None)
    final_eval = result.final_eval
    resumed_step = int(resume_state["step"]) if resume_state else 0
    resumed_time = float(resume_state.get("train_time_s", 0)) if resume_state else 0.0
    return {
        "status": result.status,
        "source": config.source,
        "source_kind": trainer.source.kind,
        "mode": "full" if config.full else ("lora" if trains.peft else "laurel-only"),
        "lora_target_modules": trains.lora_targets,
        "laurel": trains.laurel.to_dict() if trains.laurel is not None else None,
        "trainable_params": trains.trainable_params,
        "lora_params": trains.lora_params,
        "laurel_params": trains.laurel_params,
        "total_params_while_training": trains.total_params,
        "steps": result.step,
        "total_steps": total_steps,
        "tokens_per_step": per_step_tokens,
        "tokens_trained": result.step * per_step_tokens,
        "train_blocks": len(trainer.train_blocks),
        "heldout_blocks": len(trainer.heldout_blocks),
        "epochs": round(result.step * per_step_tokens / config.seq_len / len(trainer.train_blocks), 4),
        "lr": lr,
        "lr_sweep": sweep,
        "heldout_loss_before": before["heldout_loss"] if before else None,
        "heldout_ppl_before": before["heldout_ppl"] if before else None,
        "heldout_loss_after": final_eval["loss"] if final_eval else None,
        "heldout_ppl_after": final_eval["ppl"] if final_eval else None,
        "heldout_tokens": final_eval["tokens"] if final_eval else None,
        "train_time_s": result.train_time_s,
        "tokens_per_s": (result.step - resumed_step) * per_step_tokens / max(result.train_time_s - resumed_time, 1e-9),
        "wall_time_s": time.perf_counter() - trainer.started_at,
        "num_processes": acc.num_processes,
        "distributed_type": str(acc.distributed_type).split(".")[-1],
        "mixed_precision": acc.mixed_precision,
        "device": str(acc.device),
        "self_guided_frac": config.self_guided_frac,
        "resumed_from_step": int(resume_state["step"]) if resume_state else None,
        "checkpoint": result.checkpoint,
        "config": config.to_dict(),
        "config_hash": config.config_hash(),
    }


def write_output(folder: CheckpointFolder, source: Source, model: nn.Module, result: TrainResult, summary: dict,
                 log: list[dict]) -> Path:
    """The fine-tuned rana folder at --out (atomically): weights, plan, train_log.jsonl, finetune.json;
    the run's own checkpoints inside it are spent and go."""
    out = folder.out
    model = model.to(source.save_dtype) if source.kind == "rana" else model
    # "weights" / "int8": written again from the merged model's own modules (an int8 source stays int8)
    extra = {k: v for k, v in source.meta.items()
             if k not in ("format_version", "dtype", "adapters", "laurel", "weights", "int8")}
    if result.trainables.laurel is not None:
        extra["laurel"] = result.trainables.laurel.to_dict()
    extra["finetune"] = {k: summary[k] for k in ("mode", "laurel", "tokens_trained", "lr", "heldout_ppl_before",
                                                "heldout_ppl_after", "config_hash")}
    if source.meta.get("weights", "none") == "int8" and result.trainables.peft:
        # rana.finetune.int8_lora: the LoRA terms merged into the int8 base, each target requantized
        extra["finetune"]["int8_merge"] = {"requantized_modules": result.trainables.lora_targets,
                                           "scales": "max-abs per output channel, float32"}
    ckpt_dir = folder.path
    inside = ckpt_dir is not None and ckpt_dir == out / CHECKPOINTS
    with atomic_dir(out, overwrite=True) as tmp:
        save(model, result.tokenizer, tmp, plan=source.plan, extra=extra, overwrite=True)
        (tmp / TRAIN_LOG).write_text("".join(json.dumps(r, default=float) + "\n" for r in log))
        write_json(tmp / SUMMARY, summary)
        if inside and ckpt_dir.exists():
            shutil.rmtree(ckpt_dir, ignore_errors=True)  # the run finished: its checkpoints are spent
    return out
