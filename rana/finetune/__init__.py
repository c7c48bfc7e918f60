"""`rana finetune`: LoRA / LAuReL / full fine-tuning of a compressed (or dense) model.

The flow (docs/method.md §6-8)::

    rana folder (or dense checkpoint with --full / --lora-targets)
      → [LAuReL: learned residuals, identity at init]        --laurel rw+lr
      → [peft LoRA on the adapters' A/B/linear children]      --lora-targets adapters|all|names
      → AdamW + warm-up/cosine, grad accumulation, checkpointing, bf16 autocast on CUDA
      → [self-guided start: α·dense + (1−α)·adapted, α → 0]   --self-guided-frac 0.1
      → merge LoRA, refresh neuron norms → rana folder + train_log.jsonl + finetune.json

An int8 folder (`rana quantize`) trains LoRA on its frozen int8 base and is merged back by requantizing
(`int8_lora`); it is written as an int8 folder again (--full is refused: int8 codes have no gradient).

Where each part lives: `run.finetune` wires the flow; `config` (what a run is asked to do), `source`
(the model, tokenizer and dense reference it starts from), `data` (its blocks), `targets` (what trains,
the merge), `guidance` (the self-guided start), `trainer` (the loop), `checkpoints` (save, verify, resume).

Launching several processes: ``accelerate launch --num_processes N -m rana.cli finetune ...`` (GPUs: DDP; an
accelerate config file selects FSDP — with ``use_orig_params: true``, LoRA leaves most weights frozen — or
DeepSpeed; those two paths are written to accelerate's API but untested here). On a machine without GPUs
accelerate's ``--cpu`` launcher starts a single process unless MPI is set up; use
``accelerate launch --multi_gpu --num_processes N ...`` (or ``torchrun``) instead: when several processes find
no GPU, finetune switches accelerate to CPU mode itself (DDP over gloo). Do not create a ``PartialState`` /
``Accelerator`` before calling :func:`finetune` in such a job (it would fix the state to one process).
"""
from .checkpoints import CHECKPOINTS
from .config import FinetuneConfig, FinetuneError, FinetuneResult, NonFiniteLossError
from .run import finetune
from .targets import adapter_linear_names, resolve_lora_targets, sync_neuron_norms
from .trainer import Trainer, TrainResult, next_token_loss

__all__ = [
    "CHECKPOINTS",
    "FinetuneConfig",
    "FinetuneError",
    "FinetuneResult",
    "NonFiniteLossError",
    "TrainResult",
    "Trainer",
    "adapter_linear_names",
    "finetune",
    "next_token_loss",
    "resolve_lora_targets",
    "sync_neuron_norms",
]
