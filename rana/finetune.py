"""`rana finetune`: LoRA / LAuReL / full fine-tuning of a compressed (or dense) model.

The flow (method.md §6-8)::

    rana folder (or dense checkpoint with --full / --lora-targets)
      → [LAuReL: learned residuals, identity at init]        --laurel rw+lr
      → [peft LoRA on the adapters' A/B/linear children]      --lora-targets adapters|all|names
      → AdamW + warm-up/cosine, grad accumulation, checkpointing, bf16 autocast on CUDA
      → [self-guided start: α·dense + (1−α)·adapted, α → 0]   --self-guided-frac 0.1
      → merge LoRA, refresh neuron norms → rana folder + train_log.jsonl + finetune.json

The same code runs in one process or under ``accelerate launch`` (DDP; FSDP / DeepSpeed from an
accelerate config): model, optimizer, data loader and scheduler go through ``Accelerator.prepare``,
checkpoints are ``accelerator.save_state`` folders plus a ``trainer_state.json``, logging and file
writes happen on the main process only.

Launching several processes: ``accelerate launch --num_processes N -m rana.cli finetune ...`` (GPUs: DDP; an
accelerate config file selects FSDP — with ``use_orig_params: true``, LoRA leaves most weights frozen — or
DeepSpeed; those two paths are written to accelerate's API but untested here). On a machine without GPUs
accelerate's ``--cpu`` launcher starts a single process unless MPI is set up; use
``accelerate launch --multi_gpu --num_processes N ...`` (or ``torchrun``) instead: when several processes find
no GPU, finetune switches accelerate to CPU mode itself (DDP over gloo). Do not create a ``PartialState`` /
``Accelerator`` before calling :func:`finetune` in such a job (it would fix the state to one process).

Data order is fixed by ``seed``: the training blocks are shuffled once per epoch (each epoch's
permutation drawn from ``seed`` and the epoch number when the loader reaches it), and the prepared
loader walks that sequence. Resuming therefore only has to skip
the batches already consumed (``accelerator.skip_first_batches``); optimizer, scheduler and RNG states
come from ``load_state``, so a resumed run reproduces the uninterrupted one. Checkpoints hold the
trainable parameters only (the frozen base comes from the source folder again).
"""
from __future__ import annotations

import errno
import gc
import hashlib
import json
import math
import os

import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from .data import DataError, load_texts, pack_blocks, tokenize_stream
from .units import DTYPES, parse_tokens
from .modules import InputSparseLinear, NeuronThresholdLinear, RankAdapterLinear, RankSliceLinear, SharedRankCode
from .modules.laurel import LaurelConfig, apply_laurel, get_laurel_config, laurel_parameters, parse_variant

__all__ = [
    "FinetuneConfig",
    "FinetuneError",
    "FinetuneResult",
    "NonFiniteLossError",
    "adapter_linear_names",
    "finetune",
    "resolve_lora_targets",
]

ADAPTER_TYPES = (RankAdapterLinear, SharedRankCode, RankSliceLinear, NeuronThresholdLinear, InputSparseLinear)
CHECKPOINTS = ".checkpoints"
CKPT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"
TRAIN_LOG = "train_log.jsonl"
SUMMARY = "finetune.json"
LAUREL_CHOICES = ("none", "rw", "lr", "rw+lr", "rw+lr+pa", "pa", "lr+pa", "rw+pa", "skip", "skip+lr")
PRECISIONS = ("auto", "no", "bf16", "fp16")
DEFAULT_LR = {"lora": 2e-4, "full": 2e-5, "laurel": 1e-3}
SWEEP_FACTORS = (0.25, 1.0, 4.0)

# Fields that do not change what is computed (paths, bookkeeping, memory knobs): left out of the
# config hash, so a resume may change them.
_UNHASHED = {"out", "checkpoint_dir", "resume", "overwrite", "save_every", "keep_checkpoints", "stop_after",
             "eval_every", "eval_at_start", "gradient_checkpointing", "eval_batch_size"}

class FinetuneError(ValueError):
    """A fine-tuning request that cannot run as given (user-facing; the message says what to do)."""

class NonFiniteLossError(RuntimeError):
    """The training loss (or gradient norm) became NaN/inf; training stopped, nothing was written to --out."""

# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------

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

@dataclass
class FinetuneResult:
    model: nn.Module | None  # merged, unwrapped, eval mode (None when stopped early or on non-main processes of FSDP)
    tokenizer: Any
    summary: dict
    log: list[dict] = field(default_factory=list)
    out: Path | None = None
    is_main_process: bool = True

# --------------------------------------------------------------------------------------------------
# Model surgery helpers (pure functions on nn.Modules)
# --------------------------------------------------------------------------------------------------

def adapter_linear_names(model: nn.Module) -> list[str]:
    """Dotted names of the nn.Linear children of every RaNA adapter (their B / A / linear)."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, ADAPTER_TYPES):
            for child_name, child in m.named_children():
                if _is_linear(child):
                    names.append(f"{name}.{child_name}" if name else child_name)
    return names

def _is_linear(module: nn.Module) -> bool:
    """An nn.Linear, or a peft LoRA wrapper around one."""
    return isinstance(module, nn.Linear) or isinstance(getattr(module, "base_layer", None), nn.Linear)

def _layer_roots(model: nn.Module) -> list[str]:
    """Names of the decoder-layer containers (LoRA 'all' stays inside them: no embeddings / lm_head)."""
    try:
        from .archs import get_arch

        return [get_arch(model.config).layers]
    except Exception:  # noqa: BLE001 - unknown architecture: any ModuleList named like layers
        return [n for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.split(".")[-1] in ("layers", "h")]

def _dense_projection_names(model: nn.Module) -> list[str]:
    """nn.Linear modules inside the decoder layers that are not part of an adapter."""
    roots = _layer_roots(model)
    inside_adapter = set()
    for name, m in model.named_modules():
        if isinstance(m, ADAPTER_TYPES):
            inside_adapter.update(f"{name}.{c}" for c, _ in m.named_modules() if c)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear) and name not in inside_adapter and any(name.startswith(r + ".") for r in roots):
            if ".laurel_" not in name:
                out.append(name)
    return out

def resolve_lora_targets(model: nn.Module, spec: str | None) -> list[str]:
    """Full module names for peft from ``adapters`` | ``all`` | ``none`` | ``name,name,...``.

    A name selects every module whose dotted path ends with it (``o_proj``, ``mlp.down_proj``); an
    adapter module contributes its linear children, a plain nn.Linear itself; ``adapters`` may appear in
    the list.
    """
    spec = (spec or "adapters").strip()
    adapters = adapter_linear_names(model)
    if spec == "none":
        return []
    if spec == "adapters":
        if not adapters:
            raise FinetuneError("--lora-targets adapters: this model has no RaNA adapters; use --lora-targets all, "
                                "a list of module names (e.g. q_proj,v_proj) or --full")
        return adapters
    if spec == "all":
        return adapters + _dense_projection_names(model)
    modules = dict(model.named_modules())
    chosen: list[str] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        if item == "adapters":
            chosen += adapters
            continue
        hits = [n for n in modules if n == item or n.endswith("." + item)]
        found = []
        for n in hits:
            m = modules[n]
            if isinstance(m, ADAPTER_TYPES):
                found += [f"{n}.{c}" for c, ch in m.named_children() if isinstance(ch, nn.Linear)]
            elif isinstance(m, nn.Linear):
                found.append(n)
        if not found:
            leaves = sorted({n.split(".")[-1] for n in _dense_projection_names(model)} |
                            {n.split(".")[-2] for n in adapters})
            raise FinetuneError(f"--lora-targets: no linear or adapter module named {item!r}; available: "
                                f"{', '.join(leaves)} (or adapters / all)")
        chosen += found
    return list(dict.fromkeys(chosen))

def _restore_column_major(model: nn.Module) -> None:
    """Adapter weights are stored column-major for the masked-GEMV kernels; keep it that way."""
    for m in model.modules():
        if isinstance(m, ADAPTER_TYPES):
            for child in m.children():
                if isinstance(child, nn.Linear) and not child.weight.t().is_contiguous():
                    w = child.weight
                    child.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)

def _refresh_norms(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, NeuronThresholdLinear):
            m.refresh_norms()

@torch.no_grad()
def sync_neuron_norms(model: nn.Module) -> None:
    """Point every NeuronThresholdLinear's mask criterion ``|h_i|·‖W[:, i]‖`` at the weight it really
    applies: the trained weight, or with LoRA the effective ``W + ΔW``. Called after each optimizer step,
    so training sees the masks the merged model will use (merged == unmerged)."""
    for m in model.modules():
        if isinstance(m, NeuronThresholdLinear):
            lin = m.linear
            base = getattr(lin, "base_layer", None)
            if isinstance(base, nn.Linear) and hasattr(lin, "get_delta_weight"):
                w = base.weight
                for name in getattr(lin, "active_adapters", []):
                    if name in getattr(lin, "lora_A", {}) and not lin.merged:
                        w = w + lin.get_delta_weight(name)
                m.column_norms.copy_(w.float().norm(dim=0))
            else:
                m.refresh_norms()

# --------------------------------------------------------------------------------------------------
# Self-guided start (method.md §7)
# --------------------------------------------------------------------------------------------------

class SelfGuidance:
    """``o = α·dense(x) + (1−α)·adapted(x)`` on every adapted projection, α: 1 → 0 on a cosine over
    the first ``phase_steps`` steps, then the hooks and the dense weights are dropped.

    The dense path of a rank adapter (RankAdapterLinear, one q/k/v RankSliceLinear) is the original
    dense weight (frozen, not a parameter, never checkpointed); that of a masked linear
    (NeuronThresholdLinear, InputSparseLinear) is its own weight without the mask. Implemented as
    forward hooks, so module names, peft targets and state_dict keys are unchanged.
    """

    def __init__(self, model: nn.Module, dense: dict[str, tuple[torch.Tensor, torch.Tensor | None]], phase_steps: int):
        self.phase_steps = int(phase_steps)
        self.alpha = 1.0
        self.dense = dense
        self.handles = []
        self.sites = 0
        for name, m in model.named_modules():
            if isinstance(m, (RankAdapterLinear, RankSliceLinear)) and name in dense:
                self.handles.append(m.register_forward_hook(self._rank_hook(name)))
                self.sites += 1
            elif isinstance(m, (NeuronThresholdLinear, InputSparseLinear)):
                self.handles.append(m.register_forward_hook(self._masked_hook))
                self.sites += 1

    def alpha_at(self, step: int) -> float:
        if step >= self.phase_steps:
            return 0.0
        return 0.5 * (1.0 + math.cos(math.pi * step / self.phase_steps))

    def set_step(self, step: int) -> float:
        self.alpha = self.alpha_at(step)
        return self.alpha

    @property
    def active(self) -> bool:
        return bool(self.handles)

    def _mix(self, dense_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        a = self.alpha
        return a * dense_out.to(out.dtype) + (1.0 - a) * out

    def _rank_hook(self, name):
        def hook(module, args, out):
            if self.alpha <= 0.0:
                return None
            w, b = self.dense[name]
            x = args[0]
            return self._mix(F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype)), out)

        return hook

    def _masked_hook(self, module, args, out):
        if self.alpha <= 0.0:
            return None
        return self._mix(module.linear(args[0]), out)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self.dense.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

def _dense_weights(model: nn.Module, reference: str, device, dtype) -> dict:
    """The original dense weights of every rank-adapted projection, from the model `reference`."""
    wanted = {n: m for n, m in model.named_modules() if isinstance(m, (RankAdapterLinear, RankSliceLinear))}
    if not wanted:
        return {}
    try:
        dense, _ = _load_dense(reference, "float32")
    except Exception as e:  # noqa: BLE001 - any load failure is reported the same way
        raise FinetuneError(
            f"the self-guided start needs the dense weights of the original model {reference!r}, which could not "
            f"be loaded ({str(e).splitlines()[0] if str(e) else type(e).__name__}); pass --dense-model PATH or "
            "--self-guided-frac 0") from None
    out = {}
    for name, m in wanted.items():
        try:
            d = dense.get_submodule(name)
        except AttributeError:
            d = None
        shape = (m.out_features, m.in_features)
        if not isinstance(d, nn.Linear) or tuple(d.weight.shape) != shape:
            raise FinetuneError(f"--dense-model {reference!r} does not match this model: {name} should be a "
                                f"{shape[0]}×{shape[1]} linear there")
        out[name] = (d.weight.detach().to(device=device, dtype=dtype).clone(),
                     None if d.bias is None else d.bias.detach().to(device=device, dtype=dtype).clone())
    del dense
    gc.collect()
    return out

# --------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------

def _load_token_ids(path: Path, vocab_size: int | None) -> torch.Tensor:
    try:
        if path.suffix == ".npy":
            import numpy as np

            ids = torch.from_numpy(np.load(path)).long()
        else:
            obj = torch.load(path, map_location="cpu", weights_only=True)
            ids = torch.as_tensor(obj).long()
    except Exception as e:  # noqa: BLE001 - numpy/torch/pickle raise many types for a damaged file
        from .data import root_cause

        kind = "a NumPy array" if path.suffix == ".npy" else "a tensor saved with torch.save"
        raise DataError(f"could not read token ids from '{path}' ({root_cause(e)}): it must hold {kind} of "
                        "integer token ids") from None
    if ids.dim() != 1:
        ids = ids.reshape(-1)
    if ids.numel() == 0:
        raise DataError(f"{path} holds no token ids")
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        raise DataError(f"token ids in {path} must lie in [0, {vocab_size}) for this model's vocabulary, "
                        f"found [{int(ids.min())}, {int(ids.max())}]")
    return ids

def _token_stream(source: str | None, config: FinetuneConfig, tokenizer, vocab_size: int | None) -> torch.Tensor:
    if source is not None:
        p = Path(os.path.expanduser(str(source)))
        if p.suffix in (".pt", ".npy"):
            if not p.is_file():
                raise DataError(f"token file not found: {source}")
            return _load_token_ids(p, vocab_size)
    if tokenizer is None:
        raise DataError("the model folder has no tokenizer to read text data with; pass --tokenizer (a model "
                        "folder, alias or hub id whose tokenizer to use) or pre-tokenised ids (.pt/.npy)")
    texts = load_texts(source, config=config.dataset_config, split=config.split, text_column=config.text_column)
    return tokenize_stream(texts, tokenizer)

def _prepare_blocks(config: FinetuneConfig, tokenizer, vocab_size) -> tuple[torch.Tensor, torch.Tensor]:
    """(train_blocks, heldout_blocks), each (n, seq_len)."""
    stream = _token_stream(config.data, config, tokenizer, vocab_size)
    max_eval = max(1, config.eval_tokens // config.seq_len)
    if config.eval_data is not None:
        train = pack_blocks(stream, config.seq_len)
        held = pack_blocks(_token_stream(config.eval_data, config, tokenizer, vocab_size), config.seq_len)[:max_eval]
        return train, held
    n = stream.numel() // config.seq_len
    if n < 2:
        raise DataError(
            f"training data too short: {stream.numel()} tokens make {n} block(s) of --seq-len {config.seq_len}; "
            "need at least 2 (one to train on, one held out): pass more data, a smaller --seq-len, or --eval-data")
    blocks = pack_blocks(stream, config.seq_len)
    n_held = min(max(1, round(n * config.heldout_fraction)), max_eval, n - 1)
    return blocks[: n - n_held], blocks[n - n_held:]  # held-out = the tail of the stream

class _OrderedBlocks(torch.utils.data.Dataset):
    """The whole run's sequence of training blocks: epoch after epoch, each a seeded shuffle.

    Item `i` is block `perm(i // n)[i % n]` of epoch `i // n`; the permutation is drawn when an
    epoch is first reached (one epoch's order is held at a time), so memory does not grow with
    the token budget."""

    def __init__(self, blocks: torch.Tensor, n_items: int, seed: int):
        self.blocks = blocks
        self.n_items = int(n_items)
        self.seed = int(seed)
        self.epochs = self.n_items / len(blocks)
        self._epoch, self._perm = -1, None

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(len(self.blocks), generator=g)
        return self._perm

    def __len__(self) -> int:
        return self.n_items

    def __getitem__(self, i: int) -> torch.Tensor:
        if not 0 <= i < self.n_items:
            raise IndexError(i)
        epoch, pos = divmod(int(i), len(self.blocks))
        return self.blocks[self.permutation(epoch)[pos]]

# --------------------------------------------------------------------------------------------------
# Schedule
# --------------------------------------------------------------------------------------------------

def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based): linear warm-up, cosine decay."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

# --------------------------------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------------------------------

def _compute_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss of a (B, T) batch (module-level so tests can inject failures)."""
    return model(input_ids=batch, labels=batch, use_cache=False).loss

@dataclass
class _Source:
    kind: str  # "rana" | "dense"
    path: str
    meta: dict
    plan: dict | None
    save_dtype: torch.dtype

def _inspect_source(config: FinetuneConfig) -> _Source:
    from .io import check_folder, is_rana_dir, read_meta, read_plan

    src = os.path.expanduser(config.source)
    if is_rana_dir(src):
        check_folder(src)  # schema, index and headers: one line before any work
        meta, plan = read_meta(Path(src)), read_plan(src)
        return _Source("rana", src, meta, plan, getattr(torch, meta.get("dtype", "float32")))
    if not config.full and config.lora_targets in (None, "adapters"):
        raise FinetuneError(
            f"'{config.source}' is a dense checkpoint, not a rana folder (no rana_config.json): there are no RaNA "
            "adapters to fine-tune. Compress it first (`rana compress MODEL --out DIR`) and fine-tune DIR, or fine-tune "
            "the dense model itself with --full (all weights) or --lora-targets all|q_proj,v_proj,... (LoRA)")
    return _Source("dense", src, {}, None, torch.float32)

def _load_source(source: _Source, config: FinetuneConfig):
    from .io import load as rana_load

    dtype = DTYPES[config.dtype]
    if source.kind == "rana":
        model, tokenizer = rana_load(source.path, dtype=dtype)
    else:
        model, tokenizer = _load_dense(source.path, config.dtype)
    if tokenizer is None and config.tokenizer is not None:
        tokenizer = _load_tokenizer(config.tokenizer)
    return model, tokenizer

def _load_dense(reference: str, dtype: str = "float32"):
    """(model, tokenizer or None) for a dense checkpoint; unlike `load_model`, a missing tokenizer is fine
    (pre-tokenised data needs none)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .io.models import ModelLoadError, check_loading_info, check_weight_files, clear_gguf_quantizer, resolve

    src = resolve(reference, dense=True)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    if not src.gguf_file and Path(src.path).is_dir():
        check_weight_files(Path(src.path))
    try:
        model, info = AutoModelForCausalLM.from_pretrained(src.path, dtype=DTYPES[dtype], output_loading_info=True, **kw)
    except OSError as e:
        raise ModelLoadError(f"could not load '{reference}': {str(e).splitlines()[0]}") from None
    check_loading_info(reference, info)  # missing tensors would train from random weights
    clear_gguf_quantizer(model)
    model = model.to(DTYPES[dtype])
    try:
        tokenizer = AutoTokenizer.from_pretrained(src.path, **kw)
    except Exception:  # noqa: BLE001 - no tokenizer files
        tokenizer = None
    return model.eval(), tokenizer

def _load_tokenizer(reference: str):
    from transformers import AutoTokenizer

    from .io.models import resolve

    src = resolve(reference)
    kw = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    return AutoTokenizer.from_pretrained(src.path, **kw)

def _default_lr(config: FinetuneConfig) -> float:
    if config.lr is not None:
        return config.lr
    if config.full:
        return DEFAULT_LR["full"]
    if config.lora_targets == "none":
        return DEFAULT_LR["laurel"]
    return DEFAULT_LR["lora"]

class _Trainer:
    """One process's view of a fine-tuning job (the sweep trials and the main run)."""

    def __init__(self, config: FinetuneConfig, progress, on_log):
        from accelerate import Accelerator
        from accelerate.utils import DistributedType

        self.config = config
        self.progress = progress
        self.on_log = on_log
        self.t_start = time.perf_counter()
        self.source = _inspect_source(config)
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
        self.accelerator = Accelerator(gradient_accumulation_steps=config.grad_accum, mixed_precision=mp,
                                       step_scheduler_with_optimizer=False, cpu=cpu)
        acc = self.accelerator
        if world > 1 and acc.num_processes == 1:
            raise FinetuneError(
                f"launched as {world} processes, but accelerate's state was already set up for one (PartialState() "
                "or Accelerator() ran before finetune(), without cpu=True on a machine with no GPU); let finetune() "
                "create the first Accelerator, or set ACCELERATE_USE_CPU=1")
        self.sharded = acc.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        self.is_main = acc.is_main_process
        self._save_hook = acc.register_save_state_pre_hook(_keep_trainable_only)
        # paths
        self.out = Path(os.path.expanduser(config.out)) if config.out else None
        if config.checkpoint_dir:
            self.ckpt_dir = Path(os.path.expanduser(config.checkpoint_dir))
        elif self.out is not None:
            self.ckpt_dir = self.out / CHECKPOINTS
        else:
            self.ckpt_dir = None

    # ------------------------------------------------------------------ helpers
    def log(self, record: dict) -> None:
        self.records.append(record)
        if self.is_main:
            if self.ckpt_dir is not None:
                with open(self.ckpt_dir / TRAIN_LOG, "a") as f:
                    f.write(json.dumps(record) + "\n")
            if self.on_log is not None:
                self.on_log(record)

    def _progress(self, what: str, done: int, total: int) -> None:
        if self.progress is not None and self.is_main:
            self.progress(what, done, total)

    # ------------------------------------------------------------------ setup
    def check_paths(self) -> dict | None:
        """Validate --out / the checkpoint folder without touching them; return the trainer state to
        resume from (or None). Only a checkpoint that verifies counts: a folder with none (a run that
        failed on its inputs, or was killed before its first save) never blocks a fresh start."""
        from .checks import check_writable_dir

        cfg, out = self.config, self.out
        _check_no_input_overlap(cfg, out, self.ckpt_dir)
        if out is not None and out.exists():
            others = [p.name for p in out.iterdir() if p.name != CHECKPOINTS] if out.is_dir() else [out.name]
            if others and not cfg.overwrite:
                from .io import OutputExistsError

                raise OutputExistsError(f"output folder '{out}' already exists; choose another --out or pass --overwrite")
        if out is not None:
            check_writable_dir(out, "--out")
        if self.ckpt_dir is not None and self.ckpt_dir != (out / CHECKPOINTS if out is not None else None):
            check_writable_dir(self.ckpt_dir, "--checkpoint-dir")
        default_dir = out is not None and self.ckpt_dir == out / CHECKPOINTS
        usable = None
        if self.ckpt_dir is not None and self.ckpt_dir.is_dir() and (cfg.resume or (default_dir and not cfg.overwrite)):
            usable = self._newest_usable_checkpoint()
        if not cfg.resume:
            if usable is not None:  # (an explicit --checkpoint-dir keeps what it holds; new checkpoints go beside)
                raise FinetuneError(f"'{self.ckpt_dir}' holds checkpoints of an unfinished run (newest: {usable[0].name}): "
                                    "pass --resume to continue it, or --overwrite to start over")
            return None
        if self.ckpt_dir is None or not self.ckpt_dir.is_dir():
            raise FinetuneError(f"--resume: no checkpoint folder at '{self.ckpt_dir}'; pass --checkpoint-dir (or the "
                                "--out of the run to continue)")
        if usable is None:
            raise FinetuneError(f"--resume: no usable checkpoint in '{self.ckpt_dir}' (the run saved none, or they are "
                                "damaged); start without --resume")
        latest, state = usable
        if state.get("config_hash") != cfg.config_hash():
            theirs = FinetuneConfig.from_dict(state["config"]).hashed_fields() if "config" in state else {}
            diff = sorted(k for k, v in cfg.hashed_fields().items() if theirs.get(k) != v)
            raise FinetuneError(
                f"--resume: the checkpoints in '{self.ckpt_dir}' were written by a different run (config hash "
                f"{state.get('config_hash')} vs {cfg.config_hash()}; differs in: {', '.join(diff) or 'unknown'}); "
                "resume with the same settings, or choose another --checkpoint-dir / --out")
        if state.get("num_processes") != self.accelerator.num_processes:
            raise FinetuneError(
                f"--resume: the checkpoint was written by {state.get('num_processes')} process(es), this run has "
                f"{self.accelerator.num_processes}; the data order and batch depend on it: launch with the same "
                "number of processes")
        state["path"] = str(latest)
        return state

    def _newest_usable_checkpoint(self) -> tuple[Path, dict] | None:
        """The newest checkpoint that verifies, warning (one line each) about damaged newer ones."""
        for path in reversed(_checkpoints(self.ckpt_dir)):
            problem, state = _verify_checkpoint(path)
            if problem is None:
                return path, state
            self.warn(f"checkpoint '{path}' is damaged ({problem}); trying the previous one")
        return None

    def warn(self, message: str) -> None:
        if not self.is_main:
            return
        if self.on_log is not None:
            self.on_log({"warning": message})
        else:
            import warnings

            warnings.warn(message, stacklevel=3)

    def prepare_checkpoint_dir(self, state: dict | None) -> bool:
        """Create (or clear) the checkpoint folder once the inputs have been checked; True if this run
        created it (so a failure before the first checkpoint can take it away again)."""
        cfg = self.config
        created = False
        self.accelerator.wait_for_everyone()  # every process has checked the folders before any is touched
        if self.is_main and self.ckpt_dir is not None:
            if cfg.overwrite and not cfg.resume and self.ckpt_dir.exists():
                shutil.rmtree(self.ckpt_dir)
            created = not self.ckpt_dir.exists()
            self.ckpt_dir.mkdir(parents=True, exist_ok=True)
            for stale in self.ckpt_dir.glob(f".tmp-{CKPT_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            if state is None and self.out is not None and self.ckpt_dir == self.out / CHECKPOINTS:
                for old in _checkpoints(self.ckpt_dir):  # a fresh start in OUT: only damaged ones can be left here
                    shutil.rmtree(old, ignore_errors=True)
            log_path = self.ckpt_dir / TRAIN_LOG
            if state is not None:
                log_path.write_text("".join(json.dumps(r) + "\n" for r in state.get("log", [])))
            elif log_path.exists():
                log_path.unlink()
        self.accelerator.wait_for_everyone()
        return created

    def discard_unused_checkpoint_dir(self, out_existed: bool) -> None:
        """After a failure: remove the checkpoint folder this run created if it holds no checkpoint (and
        --out if it was made only to hold it), so the same command can simply be run again."""
        if not self.is_main or self.ckpt_dir is None or not self.ckpt_dir.is_dir() or _checkpoints(self.ckpt_dir):
            return
        shutil.rmtree(self.ckpt_dir, ignore_errors=True)
        if self.out is not None and not out_existed and self.out.is_dir() and not any(self.out.iterdir()):
            self.out.rmdir()

    def build_model(self):
        """Fresh model from the source, with LAuReL / LoRA / trainable flags set (not yet prepared)."""
        from accelerate.utils import set_seed

        cfg = self.config
        set_seed(cfg.seed)
        model, tokenizer = _load_source(self.source, cfg)
        existing = get_laurel_config(model)
        laurel_cfg = None
        if cfg.laurel != "none":
            laurel_cfg = LaurelConfig(variant=cfg.laurel, rank=cfg.laurel_rank, history=cfg.laurel_history)
            if existing is not None:
                if existing.components != laurel_cfg.components or existing.rank != laurel_cfg.rank:
                    raise FinetuneError(f"the source already has LAuReL {existing.variant} (rank {existing.rank}); "
                                        f"--laurel {cfg.laurel} would add a second one: pass --laurel {existing.variant} "
                                        f"--laurel-rank {existing.rank} to keep training it, or --laurel none")
                laurel_cfg = existing
            else:
                apply_laurel(model, laurel_cfg, dtype=torch.float32 if cfg.dtype != "float32" else None)
        elif existing is not None:
            laurel_cfg = existing  # kept (frozen) and saved again
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        targets = [] if cfg.full else resolve_lora_targets(model, cfg.lora_targets)
        peft_on = bool(targets)
        if cfg.full:
            for p in model.parameters():
                p.requires_grad_(True)
        elif peft_on:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                              target_modules=targets, bias="none")
            model = get_peft_model(model, lora)
        else:
            for p in model.parameters():
                p.requires_grad_(False)
        if cfg.laurel != "none":
            for p in laurel_parameters(model):
                p.requires_grad_(True)
        trainable = [p for p in model.parameters() if p.requires_grad]
        if not trainable:
            raise FinetuneError("nothing to train: --lora-targets none without --laurel; pick LoRA targets, a LAuReL "
                                "variant or --full")
        if hasattr(model, "config"):
            model.config.use_cache = False
        info = {
            "peft": peft_on,
            "lora_targets": len(targets),
            "laurel": laurel_cfg,
            "trainable_params": sum(p.numel() for p in _unique(trainable)),
            "laurel_params": sum(p.numel() for p in laurel_parameters(model)),
            "lora_params": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n),
            "total_params": sum(p.numel() for p in _unique(model.parameters())),
        }
        return model, tokenizer, info

    def self_guidance(self, model, total_steps: int, start_step: int) -> SelfGuidance | None:
        cfg = self.config
        if cfg.self_guided_frac <= 0:
            return None
        phase = max(1, round(cfg.self_guided_frac * total_steps))
        if start_step >= phase:
            return None
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        if not any(isinstance(m, ADAPTER_TYPES) for m in base.modules()):
            raise FinetuneError("--self-guided-frac needs RaNA adapters (a rana folder); this model has none")
        if self._dense is None:
            ref = cfg.dense_model
            if ref is None and self.source.plan is not None:
                ref = (self.source.plan.get("config") or {}).get("model") or self.source.plan.get("model")
            if ref is None:
                raise FinetuneError("--self-guided-frac needs the dense model: plan.json names none; pass --dense-model")
            ref_param = next(base.parameters())
            with self.accelerator.main_process_first():
                self._dense = _dense_weights(base, ref, self.accelerator.device, ref_param.dtype)
        return SelfGuidance(base, dict(self._dense), phase)

    # ------------------------------------------------------------------ one training run
    def run(self, lr: float, total_steps: int, *, trial: str | None = None, resume_state: dict | None = None):
        """Train `total_steps` optimizer steps at peak `lr`. Returns (model, tokenizer, info, final_eval)."""
        from torch.utils.data import DataLoader

        cfg, acc = self.config, self.accelerator
        model, tokenizer, info = self.build_model()
        start_step = int(resume_state["step"]) if resume_state else 0
        guide = self.self_guidance(model, total_steps, start_step)
        params_decay, params_plain = [], []
        laurel_ids = {id(p) for p in laurel_parameters(model)}
        for p in _unique(model.parameters()):
            if p.requires_grad:
                (params_decay if p.dim() >= 2 and id(p) not in laurel_ids else params_plain).append(p)
        groups = [{"params": params_decay, "weight_decay": cfg.weight_decay}]
        if params_plain:
            groups.append({"params": params_plain, "weight_decay": 0.0})
        model.train()
        per_step = cfg.batch_size * cfg.grad_accum * acc.num_processes
        dataset = _OrderedBlocks(self.train_blocks, total_steps * per_step, cfg.seed)
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
        trainable_names = sorted(n for n, p in model.named_parameters() if p.requires_grad)
        step = start_step
        if resume_state is not None:
            if resume_state.get("trainable") != len(trainable_names):
                raise FinetuneError(f"--resume: the checkpoint holds {resume_state.get('trainable')} trainable tensors, "
                                    f"this run has {len(trainable_names)}; was it written by another version?")
            acc.load_state(resume_state["path"], strict=False)
            if not self.sharded:
                sync_neuron_norms(acc.unwrap_model(model))
            loader = acc.skip_first_batches(loader, step * cfg.grad_accum)
        acc.step = 0
        tokens_per_step = per_step * cfg.seq_len
        label = trial or "train"
        last_ckpt = resume_state["path"] if resume_state else None
        eval_every = cfg.eval_every or max(1, total_steps // 10)
        save_every = cfg.save_every if cfg.save_every is not None else max(1, math.ceil(total_steps / 5))
        stop_at = cfg.stop_after if (trial is None and cfg.stop_after) else None
        train_time = float(resume_state.get("train_time_s", 0.0)) if resume_state else 0.0

        if trial is None and step == 0 and cfg.eval_at_start:
            ev = self.evaluate(model)
            self.log({"step": 0, "tokens": 0, "heldout_loss": ev["loss"], "heldout_ppl": ev["ppl"], "lr": 0.0,
                      **({"alpha": guide.alpha_at(0)} if guide else {})})
        self._progress(label, step, total_steps)
        it = iter(loader)
        final_eval = None
        status = "completed"
        while step < total_steps:
            alpha = guide.set_step(step) if guide is not None and guide.active else None
            t0 = time.perf_counter()
            cur_lr = optimizer.param_groups[0]["lr"]
            losses = []
            grad_norm = None
            for _ in range(cfg.grad_accum):
                batch = next(it)
                with acc.accumulate(model):
                    loss = _compute_loss(model, batch)
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
                            self._nonfinite(step + 1, step_loss, grad_norm, cur_lr, last_ckpt, trial)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
            if not self.sharded:
                sync_neuron_norms(acc.unwrap_model(model))
            step += 1
            dt = time.perf_counter() - t0
            train_time += dt
            if guide is not None and guide.active and guide.alpha_at(step) <= 0.0:
                guide.remove()  # the phase is over: drop the dense weights
                if trial is None:
                    self._dense = None
            record = {"step": step, "tokens": step * tokens_per_step, "epoch": round(step * per_step / len(self.train_blocks), 4),
                      "loss": step_loss, "lr": cur_lr, "grad_norm": grad_norm, "tokens_per_s": tokens_per_step / dt,
                      "elapsed_s": time.perf_counter() - self.t_start}
            if alpha is not None:
                record["alpha"] = alpha
            if step == total_steps or step % eval_every == 0:
                ev = self.evaluate(model)
                record.update(heldout_loss=ev["loss"], heldout_ppl=ev["ppl"])
                if step == total_steps:
                    final_eval = ev
            if trial is None:
                self.log(record)
            self._progress(label, step, total_steps)
            if trial is None and self.ckpt_dir is not None and step < total_steps and (
                    (save_every and step % save_every == 0) or step == stop_at):
                last_ckpt = self.save_checkpoint(step, lr, train_time, len(trainable_names))
            if stop_at is not None and step == stop_at and step < total_steps:
                status = "stopped"
                break
        if guide is not None:
            guide.remove()
        info.update(train_time_s=train_time, status=status, checkpoint=last_ckpt, step=step)
        return model, tokenizer, info, final_eval, (optimizer, scheduler, loader)

    def _nonfinite(self, step, loss, grad_norm, lr, last_ckpt, trial):
        what = "loss" if not math.isfinite(loss) else "gradient norm"
        value = loss if what == "loss" else grad_norm
        if trial is not None:
            raise NonFiniteLossError(f"{what} became {value} at step {step} of sweep trial {trial}")
        keep = (f"the last good checkpoint is kept in '{last_ckpt}'; lower --lr (or --max-grad-norm, or raise "
                "--warmup) and start over with --overwrite (--resume repeats the same settings)"
                if last_ckpt else "no checkpoint was written before it; lower --lr (or --max-grad-norm, or raise "
                "--warmup) and start over with --overwrite")
        msg = (f"training stopped: the {what} became {value} at step {step} (lr {lr:.3g}); nothing was written to "
               f"--out; {keep}")
        if self.is_main and self.ckpt_dir is not None:
            with open(self.ckpt_dir / TRAIN_LOG, "a") as f:
                f.write(json.dumps({"step": step, "error": msg}) + "\n")
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

    def save_checkpoint(self, step: int, lr: float, train_time: float, n_trainable: int) -> str:
        acc = self.accelerator
        final = self.ckpt_dir / f"{CKPT_PREFIX}{step:08d}"
        tmp = self.ckpt_dir / f".tmp-{CKPT_PREFIX}{step:08d}"
        if self.is_main and tmp.exists():
            shutil.rmtree(tmp)
        acc.wait_for_everyone()
        try:
            acc.save_state(str(tmp))
        except Exception as e:
            full = _device_full(self.ckpt_dir)  # torch.save reports a full disk only as a stream-position mismatch
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise OSError(errno.ENOSPC, "No space left on device", str(tmp)) from e
            raise
        acc.wait_for_everyone()
        if self.is_main:
            state = {"step": step, "lr": lr, "config_hash": self.config.config_hash(), "config": self.config.to_dict(),
                     "num_processes": acc.num_processes, "train_time_s": train_time, "trainable": n_trainable,
                     "sweep": self.sweep, "log": self.records, "files": _manifest(tmp)}
            (tmp / TRAINER_STATE).write_text(json.dumps(state, indent=1, default=float))
            if final.exists():
                shutil.rmtree(final)
            tmp.rename(final)
            for old in _checkpoints(self.ckpt_dir)[: -self.config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        acc.wait_for_everyone()
        return str(final)

def _unique(params):
    seen = set()
    for p in params:
        if id(p) not in seen:
            seen.add(id(p))
            yield p

def _keep_trainable_only(models, weights, output_dir) -> None:
    """accelerate save_state pre-hook: checkpoint only trainable tensors (the frozen base is reloaded
    from the source), stored contiguously for safetensors."""
    for model, sd in zip(models, weights):
        keep = {n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}
        for k in list(sd.keys()):
            if k not in keep:
                del sd[k]
            elif not sd[k].is_contiguous():
                sd[k] = sd[k].contiguous()

def _checkpoints(folder: Path) -> list[Path]:
    found = [p for p in folder.glob(f"{CKPT_PREFIX}*") if (p / TRAINER_STATE).is_file()]
    return sorted(found, key=lambda p: int(p.name[len(CKPT_PREFIX):]) if p.name[len(CKPT_PREFIX):].isdigit() else -1)

def _device_full(folder: Path) -> bool:
    """Nearly no space left where `folder` lives (a failed write that filled it has left a partial file)."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < 64 * 2**20

def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()

def _manifest(folder: Path) -> dict[str, list]:
    """{relative path: [size, sha256]} of every file of a checkpoint (verified before it is resumed)."""
    return {str(p.relative_to(folder)): [p.stat().st_size, _file_digest(p)]
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != TRAINER_STATE}

def _verify_checkpoint(path: Path) -> tuple[str | None, dict | None]:
    """(None, trainer state) for a sound checkpoint, else (what is wrong, None): an unreadable state
    file, or a file missing, truncated or changed since it was written."""
    try:
        state = json.loads((path / TRAINER_STATE).read_text())
        if not isinstance(state, dict) or not isinstance(state.get("step"), int):
            return f"{TRAINER_STATE} has no step", None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"unreadable {TRAINER_STATE}: {str(e).splitlines()[0]}", None
    for name, (size, digest) in (state.get("files") or {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing", None
        if f.stat().st_size != size:
            return f"{name} is {f.stat().st_size} bytes, {size} were written", None
        if _file_digest(f) != digest:
            return f"{name} changed since it was written", None
    return None, state

# --------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------

def finetune(config: FinetuneConfig, progress: Callable[[str, int, int], None] | None = None,
             on_log: Callable[[dict], None] | None = None) -> FinetuneResult:
    """Fine-tune `config.source` and (with `config.out`) save a rana folder.

    `progress(what, done, total)` reports steps ("train", or "sweep lr=…" during a sweep) and
    `on_log(record)` receives each train_log record; both on the main process only. Raises
    FinetuneError / DataError for unusable inputs and NonFiniteLossError when training diverges.
    """
    config.validate()
    tr = _Trainer(config, progress, on_log)
    acc = tr.accelerator
    tr.records, tr.sweep, tr._dense = [], None, None
    # Every input is checked before the checkpoint folder is created: a run refused on its inputs
    # leaves nothing behind that would block the same command once they are fixed.
    resume_state = tr.check_paths()
    if resume_state is not None:
        tr.records = list(resume_state.get("log", []))
    from .checks import check_available, check_seq_len

    check_seq_len(tr.source.path, config.seq_len)
    for ref in (config.tokenizer, config.dense_model if config.self_guided_frac > 0 else None):
        if ref is not None:
            check_available(ref)

    # data (the tokenizer / vocabulary comes from the source; loading it is cheap next to training)
    model_probe_tok, vocab = _probe_tokenizer(tr.source, config)
    with acc.main_process_first():
        tr.train_blocks, tr.heldout_blocks = _prepare_blocks(config, model_probe_tok, vocab)
    out_existed = tr.out is not None and tr.out.exists()
    tr.prepare_checkpoint_dir(resume_state)
    try:
        return _train_and_save(tr, config, resume_state)
    except BaseException:
        tr.discard_unused_checkpoint_dir(out_existed)
        raise

def _train_and_save(tr: "_Trainer", config: FinetuneConfig, resume_state: dict | None) -> FinetuneResult:
    acc = tr.accelerator
    per_step_tokens = config.batch_size * config.grad_accum * acc.num_processes * config.seq_len
    total_steps = max(1, math.ceil(config.tokens / per_step_tokens))

    # learning rate: given, resumed, or swept
    if resume_state is not None:
        lr = float(resume_state["lr"])
        tr.sweep = resume_state.get("sweep")
    elif config.lr_sweep:
        lr, tr.sweep = _sweep(tr, total_steps)
    else:
        lr = _default_lr(config)

    model, tokenizer, info, final_eval, prepared = tr.run(lr, total_steps, resume_state=resume_state)
    before = next((r for r in tr.records if r.get("step") == 0 and "heldout_ppl" in r), None)
    summary = {
        "status": info["status"],
        "source": config.source,
        "source_kind": tr.source.kind,
        "mode": "full" if config.full else ("lora" if info["peft"] else "laurel-only"),
        "lora_target_modules": info["lora_targets"],
        "laurel": info["laurel"].to_dict() if info["laurel"] is not None else None,
        "trainable_params": info["trainable_params"],
        "lora_params": info["lora_params"],
        "laurel_params": info["laurel_params"],
        "total_params_while_training": info["total_params"],
        "steps": info["step"],
        "total_steps": total_steps,
        "tokens_per_step": per_step_tokens,
        "tokens_trained": info["step"] * per_step_tokens,
        "train_blocks": len(tr.train_blocks),
        "heldout_blocks": len(tr.heldout_blocks),
        "epochs": round(info["step"] * per_step_tokens / config.seq_len / len(tr.train_blocks), 4),
        "lr": lr,
        "lr_sweep": tr.sweep,
        "heldout_loss_before": before["heldout_loss"] if before else None,
        "heldout_ppl_before": before["heldout_ppl"] if before else None,
        "heldout_loss_after": final_eval["loss"] if final_eval else None,
        "heldout_ppl_after": final_eval["ppl"] if final_eval else None,
        "heldout_tokens": final_eval["tokens"] if final_eval else None,
        "train_time_s": info["train_time_s"],
        "tokens_per_s": (info["step"] - (int(resume_state["step"]) if resume_state else 0)) * per_step_tokens
        / max(info["train_time_s"] - (float(resume_state.get("train_time_s", 0)) if resume_state else 0.0), 1e-9),
        "wall_time_s": time.perf_counter() - tr.t_start,
        "num_processes": acc.num_processes,
        "distributed_type": str(acc.distributed_type).split(".")[-1],
        "mixed_precision": acc.mixed_precision,
        "device": str(acc.device),
        "self_guided_frac": config.self_guided_frac,
        "resumed_from_step": int(resume_state["step"]) if resume_state else None,
        "checkpoint": info["checkpoint"],
        "config": config.to_dict(),
        "config_hash": config.config_hash(),
    }
    if info["status"] == "stopped":
        acc.free_memory(*prepared)
        tr._save_hook.remove()
        return FinetuneResult(model=None, tokenizer=tokenizer, summary=summary, log=tr.records, out=None,
                              is_main_process=tr.is_main)

    merged = _merge(tr, model)
    acc.free_memory(*prepared)
    tr._save_hook.remove()
    out = None
    if merged is not None and tr.is_main and tr.out is not None:
        out = _write_output(tr, merged, tokenizer, info, summary)
    acc.wait_for_everyone()
    if tr.out is not None:
        out = tr.out  # an explicit --checkpoint-dir is left in place for the user
    return FinetuneResult(model=merged, tokenizer=tokenizer, summary=summary, log=tr.records, out=out,
                          is_main_process=tr.is_main)

def _probe_tokenizer(source: _Source, config: FinetuneConfig):
    """(tokenizer or None, vocab size) without loading the weights."""
    from transformers import AutoConfig, AutoTokenizer

    tok, vocab = None, None
    if config.tokenizer is not None:
        tok = _load_tokenizer(config.tokenizer)
    if source.kind == "rana":
        path = Path(source.path)
        vocab = getattr(AutoConfig.from_pretrained(path), "vocab_size", None)
        if tok is None and (path / "tokenizer_config.json").exists():
            tok = AutoTokenizer.from_pretrained(path)
    elif tok is None:
        needs_text = not all(str(s).endswith((".pt", ".npy")) for s in (config.data, config.eval_data) if s is not None) \
            or config.data is None
        if needs_text:
            tok = _load_tokenizer(source.path)
    if vocab is None and tok is not None:
        vocab = len(tok)
    return tok, vocab

def _sweep(tr: _Trainer, total_steps: int) -> tuple[float, list[dict]]:
    """Paper's procedure: a few learning rates on a short prefix of the budget, keep the best held-out loss."""
    cfg, acc = tr.config, tr.accelerator
    base = _default_lr(cfg)
    lrs = list(cfg.sweep_lrs) or [base * f for f in SWEEP_FACTORS]
    steps = max(1, round(cfg.sweep_frac * total_steps))
    results = []
    for lr in lrs:
        label = f"sweep lr={lr:.3g}"
        try:
            model, _, _, ev, prepared = tr.run(lr, steps, trial=label)
            loss = ev["loss"]
            acc.free_memory(model, *prepared)
            del model, prepared
        except NonFiniteLossError:
            loss = float("inf")
            acc.free_memory()
        gc.collect()
        results.append({"lr": lr, "steps": steps, "heldout_loss": loss,
                        "heldout_ppl": math.exp(min(loss, 700.0)) if math.isfinite(loss) else float("inf")})
        if tr.is_main and tr.on_log is not None:
            tr.on_log({"sweep": results[-1]})
    finite = [r for r in results if math.isfinite(r["heldout_loss"])]
    if not finite:
        raise NonFiniteLossError(f"every learning rate of the sweep ({', '.join(f'{x:.3g}' for x in lrs)}) diverged; "
                                 "pass smaller --sweep-lrs")
    best = min(finite, key=lambda r: r["heldout_loss"])
    return best["lr"], results

def _merge(tr: _Trainer, model) -> nn.Module | None:
    """The trained model as a plain (merged, unwrapped) module on the main process."""
    acc = tr.accelerator
    if tr.sharded:
        state = acc.get_state_dict(model)  # collective: full state dict on the main process
        if not tr.is_main:
            return None
        fresh, _, _ = tr.build_model()
        fresh.load_state_dict(state, strict=False)
        model = fresh
    else:
        model = acc.unwrap_model(model, keep_fp32_wrapper=False)
    if hasattr(model, "merge_and_unload"):
        model = model.merge_and_unload()
    if hasattr(model, "gradient_checkpointing_disable") and tr.config.gradient_checkpointing:
        model.gradient_checkpointing_disable()
    for p in model.parameters():
        p.requires_grad_(False)
    _restore_column_major(model)
    _refresh_norms(model)
    if hasattr(model, "config"):
        model.config.use_cache = True
    return model.eval()

def _check_no_input_overlap(cfg: FinetuneConfig, out: Path | None, ckpt_dir: Path | None) -> None:
    """--out and --checkpoint-dir never overlap an input; --overwrite replaces only rana's own folders."""
    from .io.models import model_inputs
    from .io.paths import check_output, check_work_dir, local_inputs

    inputs = model_inputs(cfg.source) + local_inputs(cfg.data, cfg.eval_data) + model_inputs(cfg.tokenizer)
    inputs += model_inputs(cfg.dense_model)
    if out is not None and cfg.overwrite and not cfg.resume:
        check_output(out, inputs, overwrite=True)
    elif out is not None:  # an existing folder without --overwrite: check_paths says what to do (resume / overwrite)
        check_work_dir(out, inputs, "--out")
    if ckpt_dir is not None and cfg.checkpoint_dir:
        check_work_dir(ckpt_dir, inputs, "--checkpoint-dir")

def _write_output(tr: _Trainer, model, tokenizer, info, summary) -> Path:
    from .io.format import write_json
    from .io import atomic_dir, save

    out = tr.out
    model = model.to(tr.source.save_dtype) if tr.source.kind == "rana" else model
    extra = {k: v for k, v in tr.source.meta.items() if k not in ("format_version", "dtype", "adapters", "laurel")}
    if info["laurel"] is not None:
        extra["laurel"] = info["laurel"].to_dict()
    extra["finetune"] = {k: summary[k] for k in ("mode", "laurel", "tokens_trained", "lr", "heldout_ppl_before",
                                                "heldout_ppl_after", "config_hash")}
    inside = tr.ckpt_dir is not None and tr.ckpt_dir == out / CHECKPOINTS
    with atomic_dir(out, overwrite=True) as tmp:
        save(model, tokenizer, tmp, plan=tr.source.plan, extra=extra, overwrite=True)
        (tmp / TRAIN_LOG).write_text("".join(json.dumps(r, default=float) + "\n" for r in tr.records))
        write_json(tmp / SUMMARY, summary)
        if inside and tr.ckpt_dir.exists():
            shutil.rmtree(tr.ckpt_dir, ignore_errors=True)  # the run finished: its checkpoints are spent
    return out
