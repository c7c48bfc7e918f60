"""What a fine-tuning run is asked to do: `FinetuneConfig` (checked once by `validate`, JSON round trip,
the hash a resumed run must match), what it returns, its errors and its defaults."""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch.nn as nn

from ..modules.laurel import LaurelConfig, parse_variant
from ..units import parse_tokens
from ..errors import UserError

PRECISIONS = ("auto", "no", "bf16", "fp16")
DEFAULT_LR = {"lora": 2e-4, "full": 2e-5, "laurel": 1e-3}
SWEEP_FACTORS = (0.25, 1.0, 4.0)

# Fields that do not change what is computed (paths, bookkeeping, memory knobs): left out of the
# config hash, so a resume may change them.
_UNHASHED = {"out", "checkpoint_dir", "resume", "overwrite", "save_every", "keep_checkpoints", "stop_after",
             "eval_every", "eval_at_start", "gradient_checkpointing", "eval_batch_size"}


class FinetuneError(UserError):
    """A fine-tuning request that cannot run as given (user-facing; the message says what to do)."""


class NonFiniteLossError(RuntimeError):
    """The training loss (or gradient norm) became NaN/inf; training stopped, nothing was written to --out."""


@dataclass
class FinetuneConfig:
    """Everything `finetune` needs; JSON round-trips through `to_dict` / `from_dict`.

    Batch arithmetic: one optimizer step consumes ``batch_size × seq_len × grad_accum × processes``
    tokens (``batch_size`` is per process); the run takes ``ceil(tokens / that)`` steps.
    """

    source: str  # rana folder, or (with full / explicit lora_targets) a dense checkpoint: alias, hub id, folder, .gguf
    out: str | None = None  # output rana folder (None: train and return the model, write nothing but checkpoints)
    # data
    data: str | None = None  # hub dataset, local .txt/.jsonl/.json/.parquet file or folder, or .pt/.npy token ids
    eval_data: str | None = None  # held-out data (same kinds); default: the tail of `data`
    dataset_config: str | None = None
    split: str = "train"
    text_column: str = "text"
    tokenizer: str | None = None  # where to take the tokenizer from when the source has none
    heldout_fraction: float = 0.05  # of the training blocks, when eval_data is not given
    eval_tokens: int = 65536  # at most this many held-out tokens are scored
    # budget / optimisation
    tokens: int = 2_000_000
    seq_len: int = 512
    batch_size: int = 4
    grad_accum: int = 1
    lr: float | None = None  # default: 2e-4 LoRA, 2e-5 full, 1e-3 LAuReL only
    lr_sweep: bool = False
    sweep_lrs: tuple = ()  # default: lr × (0.25, 1, 4)
    sweep_frac: float = 0.1  # share of the budget each sweep trial trains for
    warmup: float = 0.05  # warm-up steps as a share of all steps
    min_lr_ratio: float = 0.1  # cosine floor, as a share of lr
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    max_grad_norm: float = 1.0
    # what trains
    full: bool = False
    lora_targets: str | None = None  # adapters | all | none | comma list of module names (default: adapters)
    lora_r: int = 16
    lora_alpha: float = 32.0
    lora_dropout: float = 0.0
    laurel: str = "none"
    laurel_rank: int = 16
    laurel_history: int = 2
    self_guided_frac: float = 0.0  # share of the steps over which α decays from 1 to 0 (0: off)
    dense_model: str | None = None  # dense weights for the self-guided start (default: plan.json's config.model)
    # runtime
    precision: str = "auto"  # auto (bf16 on CUDA with bf16, else fp32) | no | bf16 | fp16
    dtype: str = "float32"  # weights while training (bfloat16 halves a frozen base's memory)
    gradient_checkpointing: bool = False
    seed: int = 0
    eval_every: int = 0  # steps between held-out evaluations (0: about 10 over the run)
    eval_at_start: bool = True  # score the held-out set before the first step ("before" perplexity)
    eval_batch_size: int = 0  # 0: batch_size
    save_every: int | None = None  # steps between checkpoints (None: about 5 over the run, 0: none)
    checkpoint_dir: str | None = None  # default OUT/.checkpoints
    keep_checkpoints: int = 2  # newest checkpoints kept while training
    resume: bool = False  # continue from the newest checkpoint in checkpoint_dir
    stop_after: int | None = None  # stop (with a checkpoint) after this many steps; resume later
    overwrite: bool = False

    def __post_init__(self):
        if isinstance(self.tokens, str):
            self.tokens = parse_tokens(self.tokens)
        if isinstance(self.sweep_lrs, str):
            self.sweep_lrs = tuple(x for x in self.sweep_lrs.split(",") if x.strip())
        try:
            self.sweep_lrs = tuple(float(x) for x in (self.sweep_lrs or ()))
        except ValueError:
            raise FinetuneError(f"--sweep-lrs takes comma-separated numbers like 5e-5,2e-4,8e-4, got "
                                f"{','.join(map(str, self.sweep_lrs))!r}") from None
        self.betas = tuple(float(x) for x in self.betas)
        if self.laurel is None:
            self.laurel = "none"
        self.laurel = str(self.laurel).lower()

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        def positive(name, value, kind=int):
            if not isinstance(value, kind) or isinstance(value, bool) or value < 1:
                raise FinetuneError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")

        parse_tokens(self.tokens)
        positive("seq_len", self.seq_len)
        if self.seq_len < 2:
            raise FinetuneError(f"--seq-len must be at least 2, got {self.seq_len}")
        positive("batch_size", self.batch_size)
        positive("grad_accum", self.grad_accum)
        positive("lora_r", self.lora_r)
        positive("eval_tokens", self.eval_tokens)
        if not (self.lora_alpha > 0 and math.isfinite(self.lora_alpha)):
            raise FinetuneError(f"--lora-alpha must be a positive number, got {self.lora_alpha!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise FinetuneError(f"--lora-dropout is a probability in [0, 1), got {self.lora_dropout!r}")
        if not (self.weight_decay >= 0 and math.isfinite(self.weight_decay)):
            raise FinetuneError(f"--weight-decay must be ≥ 0, got {self.weight_decay!r}")
        if not (self.max_grad_norm >= 0 and math.isfinite(self.max_grad_norm)):
            raise FinetuneError(f"--max-grad-norm must be ≥ 0 (0: no clipping), got {self.max_grad_norm!r}")
        if self.eval_every < 0:
            raise FinetuneError(f"--eval-every must be ≥ 0 (0: about 10 evaluations per run), got {self.eval_every}")
        if self.eval_batch_size < 0:
            raise FinetuneError(f"eval_batch_size must be ≥ 0 (0: batch_size), got {self.eval_batch_size}")
        if self.lr is not None and not (self.lr > 0 and math.isfinite(self.lr)):
            raise FinetuneError(f"--lr must be a positive number, got {self.lr!r}")
        if any(not (x > 0 and math.isfinite(x)) for x in self.sweep_lrs):
            raise FinetuneError(f"--sweep-lrs must be positive numbers, got {self.sweep_lrs!r}")
        if not 0.0 < self.sweep_frac <= 1.0:
            raise FinetuneError(f"--sweep-frac must be in (0, 1], got {self.sweep_frac}")
        if not 0.0 <= self.warmup < 1.0:
            raise FinetuneError(f"--warmup is a share of the steps in [0, 1), got {self.warmup}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise FinetuneError(f"--min-lr-ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise FinetuneError(f"--heldout-fraction must be in (0, 1), got {self.heldout_fraction}")
        if not 0.0 <= self.self_guided_frac <= 1.0:
            raise FinetuneError(f"--self-guided-frac must be in [0, 1], got {self.self_guided_frac}")
        if self.precision not in PRECISIONS:
            raise FinetuneError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise FinetuneError(f"--dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.laurel != "none":
            try:
                parse_variant(self.laurel)
                LaurelConfig(variant=self.laurel, rank=self.laurel_rank, history=self.laurel_history)
            except ValueError as e:
                raise FinetuneError(f"--laurel: {e}") from None
        if self.full and self.lora_targets not in (None, "none"):
            raise FinetuneError("--full trains every weight; it cannot be combined with --lora-targets")
        if self.save_every is not None and self.save_every < 0:
            raise FinetuneError(f"--save-every must be ≥ 0, got {self.save_every}")
        if self.stop_after is not None and self.stop_after < 1:
            raise FinetuneError(f"--stop-after must be ≥ 1, got {self.stop_after}")
        if self.keep_checkpoints < 1:
            raise FinetuneError(f"--keep-checkpoints must be ≥ 1, got {self.keep_checkpoints}")
        if self.out is None and self.checkpoint_dir is None and (self.resume or self.stop_after):
            raise FinetuneError("--resume / --stop-after need checkpoints: pass --out or --checkpoint-dir")

    # ------------------------------------------------------------------ (de)serialisation
    def to_dict(self) -> dict:
        d = asdict(self)
        d["sweep_lrs"] = list(self.sweep_lrs)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "FinetuneConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown FinetuneConfig keys: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FinetuneConfig":
        return cls.from_dict(json.loads(text))

    def hashed_fields(self) -> dict:
        d = {k: v for k, v in self.to_dict().items() if k not in _UNHASHED}
        for key in ("source", "data", "eval_data", "tokenizer", "dense_model"):
            if d.get(key) is not None and Path(os.path.expanduser(str(d[key]))).exists():
                d[key] = str(Path(os.path.expanduser(str(d[key]))).resolve())
        return d

    def config_hash(self) -> str:
        """What a checkpoint must match to be resumed (everything that changes the computation)."""
        blob = json.dumps(self.hashed_fields(), sort_keys=True, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_lr(config: FinetuneConfig) -> float:
    """The peak learning rate when no sweep picks one: `config.lr`, else the default for what trains."""
    if config.lr is not None:
        return config.lr
    if config.full:
        return DEFAULT_LR["full"]
    if config.lora_targets == "none":
        return DEFAULT_LR["laurel"]
    return DEFAULT_LR["lora"]


@dataclass
class FinetuneResult:
    model: nn.Module | None  # merged, unwrapped, eval mode (None when stopped early or on non-main processes of FSDP)
    tokenizer: Any
    summary: dict
    log: list[dict] = field(default_factory=list)
    out: Path | None = None
    is_main_process: bool = True
