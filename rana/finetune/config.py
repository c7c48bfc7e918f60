"""What a fine-tuning run is asked to do: `FinetuneConfig` (checked once by `validate`, JSON round trip,
the hash a resumed run must match), what it returns, its errors and its defaults."""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

import torch.nn as nn

from ..modules.laurel import LaurelConfig, parse_variant
from ..units import parse_tokens
from ..errors import UserError
from ..io.jsonfile import MAX_DEPTH, nesting_depth
from ..settings import MAX_SEED, Settings, setting

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
class FinetuneConfig(Settings):
    """Everything `finetune` needs, each option written once with its `rana finetune` help (`rana.settings`);
    JSON round-trips through `to_dict` / `from_dict`. The field order is the order of `to_dict`, which
    finetune.json and the checkpoints record, so it is also the order `--help` lists the options in.

    Batch arithmetic: one optimizer step consumes ``batch_size × seq_len × grad_accum × processes``
    tokens (``batch_size`` is per process); the run takes ``ceil(tokens / that)`` steps.

    For library callers: ``out=None`` trains and returns the model, writing nothing but checkpoints;
    ``tokens`` and ``sweep_lrs`` may be given as text ("2M", "5e-5,2e-4"), as the command line gives them.
    """

    error = FinetuneError

    source: str = setting(help="rana folder from `rana compress` (or, with --full / --lora-targets, a dense model)",
                          argument=True, required=True)
    out: str | None = setting(None, "output rana folder (must not exist unless --overwrite)", flags=("--out", "-o"),
                              cli_type=Optional[Path])
    # data
    data: str | None = setting(None, "training text: hub dataset, local .txt/.jsonl/.json/.parquet file or folder, "
                                     "or .pt/.npy token ids (default: bundled corpus)")
    eval_data: str | None = setting(None, "held-out data (same kinds; default: the tail of --data)")
    dataset_config: str | None = setting(None, "hub dataset config name")
    split: str = setting("train", "hub dataset split")
    text_column: str = setting("text", "text column for json/parquet/hub data")
    tokenizer: str | None = setting(None, "take the tokenizer from this model when the source has none")
    heldout_fraction: float = setting(0.05, "share of --data held out when --eval-data is not given", above=0,
                                      below=1)
    eval_tokens: int = setting(65536, "held-out tokens scored per evaluation (at most)", min=1)
    # budget / optimisation
    tokens: int = setting(2_000_000, "training token budget, e.g. 2M, 500k, 1.5e6", cli_type=str, cli_default="2M")
    seq_len: int = setting(512, "tokens per packed training block", min=2)
    batch_size: int = setting(4, "blocks per micro-batch, per process", min=1)
    grad_accum: int = setting(1, "micro-batches per optimizer step", min=1)
    lr: float | None = setting(None, "peak learning rate (default 2e-4 LoRA, 2e-5 full, 1e-3 LAuReL only)", above=0)
    lr_sweep: bool = setting(False, "try a few learning rates on a short prefix, keep the best held-out loss",
                             flags=("--lr-sweep",))
    sweep_lrs: tuple = setting((), "comma list of learning rates for --lr-sweep (default lr × 0.25, 1, 4)",
                               cli_type=Optional[str], cli_default=None)
    sweep_frac: float = setting(0.1, "share of the budget each sweep trial trains for", above=0, max=1)
    warmup: float = setting(0.05, "warm-up share of the steps (then cosine decay)", min=0, below=1)
    min_lr_ratio: float = setting(0.1, "cosine floor as a share of the peak lr", min=0, max=1)
    weight_decay: float = setting(0.0, "AdamW weight decay (matrices only)", min=0)
    betas: tuple = setting((0.9, 0.999), "AdamW betas", cli=False)
    max_grad_norm: float = setting(1.0, "gradient clipping (0: off)", min=0)
    # what trains
    full: bool = setting(False, "full fine-tuning of every weight", flags=("--full",))
    lora_targets: str | None = setting(None, "adapters (default) | all (adapters + unadapted projections) | none | "
                                             "comma list of module names")
    lora_r: int = setting(16, "LoRA rank", min=1)
    lora_alpha: float = setting(32.0, "LoRA alpha", above=0)
    lora_dropout: float = setting(0.0, "LoRA dropout", min=0, below=1)
    laurel: str = setting("none", "LAuReL residuals: none | rw | lr | rw+lr | rw+lr+pa (any '+' mix of rw, skip, lr, "
                                  "pa)")
    laurel_rank: int = setting(16, "rank of LAuReL's low-rank map (lr)", min=1)
    laurel_history: int = setting(2, "previous activations mixed by LAuReL-PA", min=1)
    self_guided_frac: float = setting(0.0, "self-guided start: α·dense + (1−α)·adapted, α → 0 over this share of the "
                                           "steps", min=0, max=1)
    dense_model: str | None = setting(None, "dense model for --self-guided-frac (default: plan.json's model)")
    # runtime
    precision: str = setting("auto", "auto (bf16 on CUDA with bf16, else fp32) | no | bf16 | fp16")
    dtype: str = setting("float32", "weight dtype while training: float32 | bfloat16 | float16")
    gradient_checkpointing: bool = setting(False, "recompute activations in backward (less memory)",
                                           flags=("--gradient-checkpointing",))
    seed: int = setting(0, min=0, max=MAX_SEED)
    eval_every: int = setting(0, "steps between held-out evaluations (0: about 10 per run)", min=0)
    eval_at_start: bool = setting(True, "score the held-out set before training",
                                  flags=("--eval-at-start/--no-eval-at-start",))
    eval_batch_size: int = setting(0, "held-out blocks per forward (0: batch_size)", cli=False, min=0)
    save_every: int | None = setting(None, "steps between checkpoints (default: about 5 per run; 0: none)", min=0)
    checkpoint_dir: str | None = setting(None, "checkpoint folder (default OUT/.checkpoints, removed when the run "
                                               "finishes)", cli_type=Optional[Path])
    keep_checkpoints: int = setting(2, "newest checkpoints kept", min=1)
    resume: bool = setting(False, "continue from the newest checkpoint (same settings required)", flags=("--resume",))
    stop_after: int | None = setting(None, "stop after this many steps, with a checkpoint, to --resume later", min=1)
    overwrite: bool = setting(False, "replace an existing --out folder / start over its checkpoints")

    @classmethod
    def from_options(cls, options: dict, given: frozenset = frozenset()) -> "FinetuneConfig":
        """The settings of `rana finetune`'s command line, which writes a folder: it needs --out (or a
        --checkpoint-dir for a run stopped early), checked before anything else."""
        if options.get("out") is None and options.get("checkpoint_dir") is None:
            raise FinetuneError("pass --out OUT (where the fine-tuned rana folder goes)")
        return super().from_options(options, given)

    def __post_init__(self):
        if not isinstance(self.tokens, int) or isinstance(self.tokens, bool):  # "2M", 1.5e6: a whole budget
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
        """Every field's type and range (`Settings.validate`), then the budget and what the fields mean
        together (one FinetuneError, or UserError, each)."""
        super().validate()
        parse_tokens(self.tokens)
        if any(not (x > 0 and math.isfinite(x)) for x in self.sweep_lrs):
            raise FinetuneError(f"--sweep-lrs must be positive numbers, got {self.sweep_lrs!r}")
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
        if not isinstance(d, dict):
            raise FinetuneError(f"a FinetuneConfig is a JSON object of settings, got {type(d).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise FinetuneError(f"unknown FinetuneConfig keys: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "FinetuneConfig":
        """The config of `to_json`'s text; nested deeper than any config (the parser recurses): one error."""
        if nesting_depth(text) > MAX_DEPTH:
            raise FinetuneError(f"a FinetuneConfig's JSON nests deeper than the {MAX_DEPTH} levels rana reads")
        try:
            d = json.loads(text)
        except ValueError as e:
            raise FinetuneError(f"a FinetuneConfig's JSON is not valid JSON ({e})") from None
        return cls.from_dict(d)

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
