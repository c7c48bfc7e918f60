"""The training loop of `rana finetune`, one process's view of it (the lr-sweep trials and the main run).

`Trainer` is built whole from what it uses: the config, the source, the training and held-out blocks,
the accelerator, the checkpoint folder and the loss function. `Trainer.run` trains one schedule: build
the model and the optimizer, then step after step (one optimizer step over ``grad_accum`` micro-batches,
then evaluate / log / checkpoint), and returns a `TrainResult`.

The same code runs in one process or under ``accelerate launch`` (DDP; FSDP / DeepSpeed from an
accelerate config): model, optimizer, data loader and scheduler go through ``Accelerator.prepare``,
checkpoints are ``accelerator.save_state`` folders plus a ``trainer_state.json``, logging and file
writes happen on the main process only. Resuming only has to skip the batches already consumed
(``accelerator.skip_first_batches``, the block order being fixed by the seed); optimizer, scheduler
and RNG states come from ``load_state``, so a resumed run reproduces the uninterrupted one.
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from ..modules.laurel import laurel_parameters
from ..units import Progress
from .checkpoints import CheckpointFolder
from .config import FinetuneConfig, FinetuneError, NonFiniteLossError
from .data import OrderedBlocks
from .guidance import SelfGuidance, check_guided, dense_weights
from .source import Source, dense_reference, load_source
from .targets import Trainables, make_trainable, merge_trained, sync_neuron_norms, unique_parameters

LossFn = Callable[[nn.Module, torch.Tensor], torch.Tensor]


def next_token_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of a (B, T) batch: the default training loss."""
    return model(input_ids=batch, labels=batch, use_cache=False).loss


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warm-up, cosine decay."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_accelerator(config: FinetuneConfig):
    """The run's `Accelerator`: mixed precision from --precision, CPU mode when several processes find no GPU.

    Create it before anything else touches accelerate's state: an earlier `PartialState()` /
    `Accelerator()` fixes the state to one process."""
    from accelerate import Accelerator

    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    # Several processes and no GPU (`accelerate launch --multi_gpu` / torchrun on a CPU box): DDP over gloo.
    cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or (
        world > 1 and not torch.cuda.is_available())
    if config.precision == "auto":
        if os.environ.get("ACCELERATE_MIXED_PRECISION") not in (None, "", "no"):
            mp = None  # `accelerate launch --mixed_precision ...` decides
        elif torch.cuda.is_available() and torch.cuda.is_bf16_supported() and not cpu:
            mp = "bf16"
        else:
            mp = "no"
    else:
        mp = config.precision
    acc = Accelerator(gradient_accumulation_steps=config.grad_accum, mixed_precision=mp,
                      step_scheduler_with_optimizer=False, cpu=cpu)
    if world > 1 and acc.num_processes == 1:
        raise FinetuneError(
            f"launched as {world} processes, but accelerate's state was already set up for one (PartialState() "
            "or Accelerator() ran before finetune(), without cpu=True on a machine with no GPU); let finetune() "
            "create the first Accelerator, or set ACCELERATE_USE_CPU=1")
    return acc


@dataclass
class TrainResult:
    """What one `Trainer.run` leaves."""

    model: nn.Module  # as accelerate prepared it (wrapped, LoRA not merged): `Trainer.merge` makes it plain
    tokenizer: Any
    trainables: Trainables
    status: str  # "completed" | "stopped" (--stop-after)
    step: int  # optimizer steps done, counted from the start of the run (a resumed run included)
    train_time_s: float  # time in optimizer steps, the resumed run's included
    checkpoint: str | None  # the newest checkpoint written (or resumed from)
    final_eval: dict | None  # held-out {"loss", "ppl", "tokens"} after the last step (None when stopped early)
    prepared: tuple  # (optimizer, scheduler, loader) as prepared: release with accelerator.free_memory


@dataclass
class _Schedule:
    """One call of `Trainer.run`: its settings, and how far it has come."""

    lr: float
    total_steps: int
    trial: str | None  # an lr-sweep trial's label (no log, no checkpoints); None: the main run
    sweep: list | None  # the sweep's results, kept in checkpoints
    n_trainable: int
    eval_every: int
    save_every: int
    stop_at: int | None
    step: int
    train_time: float
    checkpoint: str | None
    final_eval: dict | None = None

    @property
    def label(self) -> str:
        return self.trial or "train"


class Trainer:
    """One process's view of a fine-tuning job (the sweep trials and the main run).

    `log` is the train log so far (a resumed run's); `loss(model, batch)` gives the loss of a (B, T)
    batch of token ids; `progress(what, done, total)` and `on_log(record)` are called on the main
    process only; `started_at` (a `time.perf_counter()` value) is when the job started.
    """

    def __init__(self, config: FinetuneConfig, source: Source, train_blocks: torch.Tensor,
                 heldout_blocks: torch.Tensor, accelerator, checkpoints: CheckpointFolder, *,
                 log: Iterable[dict] = (), loss: LossFn = next_token_loss,
                 progress: Progress | None = None,
                 on_log: Callable[[dict], None] | None = None, started_at: float | None = None):
        from accelerate.utils import DistributedType

        self.config = config
        self.source = source
        self.train_blocks = train_blocks
        self.heldout_blocks = heldout_blocks
        self.accelerator = accelerator
        self.checkpoints = checkpoints
        self.records = list(log)
        self.loss = loss
        self.progress = progress
        self.on_log = on_log
        self.started_at = time.perf_counter() if started_at is None else started_at
        self.sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        self.is_main = accelerator.is_main_process
        self.blocks_per_step = config.batch_size * config.grad_accum * accelerator.num_processes
        self.tokens_per_step = self.blocks_per_step * config.seq_len
        self._dense = None  # the self-guided start's dense weights: loaded once, shared by the sweep trials

    # ------------------------------------------------------------------ helpers
    def log(self, record: dict) -> None:
        self.records.append(record)
        self.checkpoints.append_log(record)
        if self.is_main and self.on_log is not None:
            self.on_log(record)

    def _progress(self, what: str, done: int, total: int) -> None:
        if self.progress is not None and self.is_main:
            self.progress(what, done, total)

    # ------------------------------------------------------------------ model
    def build_model(self):
        """(model, tokenizer, Trainables): a fresh model from the source, with LAuReL / LoRA / trainable
        flags set (not yet prepared)."""
        from accelerate.utils import set_seed

        set_seed(self.config.seed)
        model, tokenizer = load_source(self.source, self.config)
        model, trainables = make_trainable(model, self.config)
        return model, tokenizer, trainables

    def merge(self, model) -> nn.Module | None:
        """The trained model as a plain (merged, unwrapped) module on the main process (None elsewhere
        when the model is sharded)."""
        acc = self.accelerator
        if self.sharded:
            state = acc.get_state_dict(model)  # collective: full state dict on the main process
            if not self.is_main:
                return None
            fresh, _, _ = self.build_model()
            fresh.load_state_dict(state, strict=False)
            model = fresh
        else:
            model = acc.unwrap_model(model, keep_fp32_wrapper=False)
        return merge_trained(model, gradient_checkpointing=self.config.gradient_checkpointing)

    def _self_guidance(self, model, total_steps: int, start_step: int) -> SelfGuidance | None:
        cfg = self.config
        if cfg.self_guided_frac <= 0:
            return None
        phase = max(1, round(cfg.self_guided_frac * total_steps))
        if start_step >= phase:
            return None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        # before the dense model is looked for or loaded, and before any step: a folder whose adapters
        # self-guidance does not hook would otherwise train unguided without a word
        check_guided(base, self.source.path)
        if self._dense is None:
            ref = dense_reference(self.source, cfg)
            if ref is None:
                raise FinetuneError("--self-guided-frac needs the dense model: plan.json names none; pass --dense-model")
            ref_param = next(base.parameters())
            with self.accelerator.main_process_first():
                self._dense = dense_weights(base, ref, self.accelerator.device, ref_param.dtype)
        return SelfGuidance(base, dict(self._dense), phase)

    # ------------------------------------------------------------------ one training run
    def run(self, lr: float, total_steps: int, *, trial: str | None = None, resume_state: dict | None = None,
            sweep: list | None = None) -> TrainResult:
        """Train `total_steps` optimizer steps at peak `lr`.

        The main run (`trial` None) scores the held-out set before the first step, logs every step,
        checkpoints (with `sweep`, the lr sweep's results) and stops at --stop-after; a sweep trial
        (`trial` = its label) only trains and evaluates. `resume_state` continues a checkpoint.
        """
        cfg, acc = self.config, self.accelerator
        model, tokenizer, trainables = self.build_model()
        start_step = int(resume_state["step"]) if resume_state else 0
        guide = self._self_guidance(model, total_steps, start_step)
        model, optimizer, scheduler, loader = self._build_optimizer(model, lr, total_steps)
        n_trainable = sum(1 for _, p in model.named_parameters() if p.requires_grad)
        if resume_state is not None:
            loader = self._resume(model, loader, resume_state, n_trainable)
        acc.step = 0
        run = _Schedule(
            lr=lr, total_steps=total_steps, trial=trial, sweep=sweep, n_trainable=n_trainable,
            eval_every=cfg.eval_every or max(1, total_steps // 10),
            save_every=cfg.save_every if cfg.save_every is not None else max(1, math.ceil(total_steps / 5)),
            stop_at=cfg.stop_after if (trial is None and cfg.stop_after) else None, step=start_step,
            train_time=float(resume_state.get("train_time_s", 0.0)) if resume_state else 0.0,
            checkpoint=resume_state["path"] if resume_state else None)

        if trial is None and run.step == 0 and cfg.eval_at_start:
            ev = self.evaluate(model)
            self.log({"step": 0, "tokens": 0, "heldout_loss": ev["loss"], "heldout_ppl": ev["ppl"], "lr": 0.0,
                      **({"alpha": guide.alpha_at(0)} if guide else {})})
        self._progress(run.label, run.step, total_steps)
        batches = iter(loader)
        status = "completed"
        while run.step < total_steps:
            alpha = guide.set_step(run.step) if guide is not None and guide.active else None
            t0 = time.perf_counter()
            lr_now = optimizer.param_groups[0]["lr"]
            loss, grad_norm = self._step(model, optimizer, scheduler, batches, run, lr_now)
            run.step += 1
            seconds = time.perf_counter() - t0
            run.train_time += seconds
            record = {"step": run.step, "tokens": run.step * self.tokens_per_step,
                      "epoch": round(run.step * self.blocks_per_step / len(self.train_blocks), 4),
                      "loss": loss, "lr": lr_now, "grad_norm": grad_norm, "tokens_per_s": self.tokens_per_step / seconds,
                      "elapsed_s": time.perf_counter() - self.started_at}
            if alpha is not None:
                record["alpha"] = alpha
            self._after_step(model, guide, run, record)
            if run.stop_at is not None and run.step == run.stop_at and run.step < total_steps:
                status = "stopped"
                break
        if guide is not None:
            guide.remove()
        return TrainResult(model=model, tokenizer=tokenizer, trainables=trainables, status=status, step=run.step,
                           train_time_s=run.train_time, checkpoint=run.checkpoint, final_eval=run.final_eval,
                           prepared=(optimizer, scheduler, loader))

    def _build_optimizer(self, model, lr: float, total_steps: int):
        """(model, optimizer, scheduler, loader), prepared by accelerate: AdamW (no weight decay on
        vectors and LAuReL), warm-up + cosine to `total_steps`, the seeded block order."""
        cfg, acc = self.config, self.accelerator
        params_decay, params_plain = [], []
        laurel_ids = {id(p) for p in laurel_parameters(model)}
        for p in unique_parameters(model.parameters()):
            if p.requires_grad:
                (params_decay if p.dim() >= 2 and id(p) not in laurel_ids else params_plain).append(p)
        groups = [{"params": params_decay, "weight_decay": cfg.weight_decay}]
        if params_plain:
            groups.append({"params": params_plain, "weight_decay": 0.0})
        model.train()
        dataset = OrderedBlocks(self.train_blocks, total_steps * self.blocks_per_step, cfg.seed)
        # Own generator: starting an iterator draws a worker seed, which must not consume the global RNG
        # (a resumed run starts its iterator after the RNG state is restored).
        loader = DataLoader(dataset, batch_size=cfg.batch_size, shuffle=False, drop_last=False, num_workers=0,
                            generator=torch.Generator().manual_seed(cfg.seed))
        warmup = round(cfg.warmup * total_steps)
        fsdp = acc.distributed_type.name == "FSDP"
        if fsdp:  # FSDP: wrap first, then build the optimizer over the (flattened) trainable parameters
            model = acc.prepare(model)
            groups = [{"params": [p for p in model.parameters() if p.requires_grad], "weight_decay": cfg.weight_decay}]
        optimizer = torch.optim.AdamW(groups, lr=lr, betas=cfg.betas)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: lr_factor(s, total_steps, warmup, cfg.min_lr_ratio))
        if fsdp:
            optimizer, loader, scheduler = acc.prepare(optimizer, loader, scheduler)
        else:
            model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
        return model, optimizer, scheduler, loader

    def _resume(self, model, loader, state: dict, n_trainable: int):
        """Load a checkpoint's trainable tensors, optimizer, scheduler and RNG states; returns the loader
        past the batches already consumed."""
        acc = self.accelerator
        if state.get("trainable") != n_trainable:
            raise FinetuneError(f"--resume: the checkpoint holds {state.get('trainable')} trainable tensors, "
                                f"this run has {n_trainable}; was it written by another version?")
        acc.load_state(state["path"], strict=False)
        if not self.sharded:
            sync_neuron_norms(acc.unwrap_model(model))
        return acc.skip_first_batches(loader, int(state["step"]) * self.config.grad_accum)

    def _step(self, model, optimizer, scheduler, batches, run: _Schedule, lr_now: float):
        """One optimizer step over ``grad_accum`` micro-batches: (loss averaged over processes, gradient
        norm before clipping, or None without clipping). A non-finite one stops training."""
        cfg, acc = self.config, self.accelerator
        losses = []
        grad_norm = None
        for _ in range(cfg.grad_accum):
            batch = next(batches)
            with acc.accumulate(model):
                loss = self.loss(model, batch)
                acc.backward(loss)
                losses.append(loss.detach().float())
                if acc.sync_gradients:
                    step_loss = float(acc.reduce(torch.stack(losses).mean(), reduction="mean"))
                    if cfg.max_grad_norm and cfg.max_grad_norm > 0:
                        grad_norm = acc.clip_grad_norm_([p for p in model.parameters() if p.requires_grad],
                                                        cfg.max_grad_norm)
                        grad_norm = float(grad_norm) if grad_norm is not None else None
                    bad = not math.isfinite(step_loss) or (grad_norm is not None and not math.isfinite(grad_norm))
                    if bad:
                        optimizer.zero_grad(set_to_none=True)
                        self._nonfinite(run.step + 1, step_loss, grad_norm, lr_now, run)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
        if not self.sharded:
            sync_neuron_norms(acc.unwrap_model(model))
        return step_loss, grad_norm

    def _after_step(self, model, guide: SelfGuidance | None, run: _Schedule, record: dict) -> None:
        """Hand over from the dense model when the self-guided phase ends; evaluate, log, report
        progress and checkpoint as the schedule says."""
        if guide is not None and guide.active and guide.alpha_at(run.step) <= 0.0:
            guide.remove()  # the phase is over: drop the dense weights
            if run.trial is None:
                self._dense = None
        if run.step == run.total_steps or run.step % run.eval_every == 0:
            ev = self.evaluate(model)
            record.update(heldout_loss=ev["loss"], heldout_ppl=ev["ppl"])
            if run.step == run.total_steps:
                run.final_eval = ev
        if run.trial is None:
            self.log(record)
        self._progress(run.label, run.step, run.total_steps)
        if run.trial is None and self.checkpoints.path is not None and run.step < run.total_steps and (
                (run.save_every and run.step % run.save_every == 0) or run.step == run.stop_at):
            run.checkpoint = self.checkpoints.save(run.step, lr=run.lr, train_time=run.train_time,
                                                   n_trainable=run.n_trainable, sweep=run.sweep, log=self.records)

    def _nonfinite(self, step: int, loss: float, grad_norm: float | None, lr: float, run: _Schedule):
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        value = loss if what == "loss" else grad_norm
        if run.trial is not None:
            raise NonFiniteLossError(f"{what} became {value} at step {step} of sweep trial {run.trial}")
        keep = (f"the last good checkpoint is kept in '{run.checkpoint}'; lower --lr (or --max-grad-norm, or raise "
                "--warmup) and start over with --overwrite (--resume repeats the same settings)"
                if run.checkpoint else "no checkpoint was written before it; lower --lr (or --max-grad-norm, or "
                "raise --warmup) and start over with --overwrite")
        msg = (f"training stopped: the {what} became {value} at step {step} (lr {lr:.3g}); nothing was written to "
               f"--out; {keep}")
        self.checkpoints.append_log({"step": step, "error": msg})
        raise NonFiniteLossError(msg)

    @torch.no_grad()
    def evaluate(self, model) -> dict:
        """Held-out mean NLL over all predicted tokens (sharded over processes, padded to equal work)."""
        acc, cfg = self.accelerator, self.config
        blocks = self.heldout_blocks
        n, world, rank = len(blocks), acc.num_processes, acc.process_index
        per = math.ceil(n / world)
        idx = list(range(rank, n, world))
        valid = [True] * len(idx) + [False] * (per - len(idx))
        idx = idx + [idx[0] if idx else 0] * (per - len(idx))
        bs = cfg.eval_batch_size or cfg.batch_size
        eval_model = model if self.sharded else acc.unwrap_model(model)
        was_training = eval_model.training
        eval_model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=acc.device)
        try:
            for s in range(0, per, bs):
                ids = blocks[idx[s:s + bs]].to(acc.device)
                ok = torch.tensor(valid[s:s + bs], device=acc.device)
                labels = ids.masked_fill(~ok[:, None], -100)
                count = int(ok.sum()) * (ids.shape[1] - 1)
                loss = eval_model(input_ids=ids, labels=labels, use_cache=False).loss
                if count:
                    total[0] += loss.double() * count
                    total[1] += count
        finally:
            eval_model.train(was_training)
        total = acc.reduce(total, reduction="sum")
        nll = float(total[0] / total[1])
        return {"loss": nll, "ppl": math.exp(min(nll, 700.0)), "tokens": int(total[1])}
