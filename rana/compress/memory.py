"""Compressing models bigger than memory: where the decoder layers live while `compress_model`
walks them, and how much compute-device memory that needs.

Two homes for the weights between layers:

* **CPU** (default): the model is loaded normally; each decoder layer moves to the compute device
  only while it is processed (`--device cuda`, weights in host RAM).
* **disk** (`--offload-dir DIR`, or implied by `--max-memory` on a CPU device when the checkpoint
  is bigger than the cap): the model is built on the meta device and only the modules outside the
  decoder stack (embeddings, final norm, LM head) are read. Each decoder layer is materialised from
  the checkpoint's safetensors shards (memory-mapped) onto the compute device when its turn comes,
  compressed, written to `DIR/layers/` and dropped, so the process never holds more than one layer.
  The calibration hidden states are spilled to memory-mapped files in `DIR/activations/` between
  layers. `rana.io.save` then writes the folder sharded (one file per layer plus the rest) with a
  `model.safetensors.index.json`; `rana.io.load` reads both layouts.

`--max-memory` (e.g. "2GB", "80GiB") bounds the compute device's memory: before any work the
peak need of one layer (weights, the adapters being built, float64 decomposition workspace,
second moments, one batch of activations) plus what stays resident (embeddings / LM head; on a CPU
device also the calibration activations and sample rows) is estimated from the config and the run
fails with a breakdown if it does not fit. On CUDA the cap is also enforced
(`torch.cuda.set_per_process_memory_fraction`). The plan records the estimate and the measured peak.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn

from . import distributed
from .archs import ArchSpec, decoder_layers, get_arch
from .units import DTYPES, dtype_bytes, fmt_bytes, parse_memory

INDEX = "model.safetensors.index.json"


class MemoryBudgetError(ValueError):
    """--max-memory is too small for one layer of this model (user-facing)."""


# ------------------------------------------------------------------------------ memory estimate


@dataclass
class MemoryEstimate:
    """Peak compute-device bytes of compressing one layer, by part."""

    parts: dict[str, float]
    device: str

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def describe(self) -> str:
        return ", ".join(f"{k} {fmt_bytes(v)}" for k, v in self.parts.items() if v)

    def to_dict(self) -> dict:
        return {"device": self.device, "total_bytes": self.total, "parts_bytes": dict(self.parts)}


def layer_weight_bytes(model_config, dtype: str = "float32") -> float:
    """Bytes of the largest decoder layer's projection weights (norms and biases are negligible)."""
    from .accounting import layer_dims

    e = dtype_bytes(dtype)
    return max(e * (2 * d.q_out * d.hidden + 2 * d.kv_out * d.hidden + (3 if d.gated else 2) * d.intermediate * d.hidden)
               for d in layer_dims(model_config))


def model_weight_bytes(model_config, dtype: str = "float32") -> float:
    from .accounting import layer_dims

    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    e = dtype_bytes(dtype)
    dims = layer_dims(model_config)
    embed = text.vocab_size * text.hidden_size * e * (1 if getattr(text, "tie_word_embeddings", False) else 2)
    return len(dims) * layer_weight_bytes(model_config, dtype) + embed


def estimate_memory(model_config, config, *, method: str | None = None, device: str | None = None,
                    streamed: bool = False) -> MemoryEstimate:
    """Peak bytes on the compute device while one layer is compressed (see the module docstring).

    Activations are counted for one calibration batch in float32 (the hooks' upcast), attention
    scores as materialised by eager attention (an upper bound for SDPA). The sample / held-aside
    rows the searches keep are on the compute device (rana.placement); on a CPU device the
    calibration hidden states of all tokens (unless spilled to disk) are in the same memory too."""
    from .accounting import layer_dims

    method = method or config.method
    device = device or config.device
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    d = max(layer_dims(model_config), key=lambda d: d.intermediate * d.hidden + d.q_out * d.hidden)
    e = dtype_bytes(config.dtype)
    h, inter, qkv = d.hidden, d.intermediate, d.q_out + 2 * d.kv_out
    w_layer = layer_weight_bytes(model_config, config.dtype)
    b, s = config.batch_size, config.seq_len
    # the largest matrix decomposed in float64 (W, U, B_full) and its input's moment (+ eigh workspace)
    up_rows = 2 * inter if get_arch(model_config).gate_up_fused else inter  # fused gate_up: one stacked matrix
    mats = [(qkv, h), (up_rows if method != "svd" else inter, h)]
    if method == "svd":
        mats.append((h, inter))
    workspace = max(8 * (3 * o * i + 3 * i * i) for o, i in mats)
    moments = 8 * h * h * 2 if method != "svd" else 8 * (2 * h * h + inter * inter)
    if method in ("teal", "cats"):
        workspace, moments = 4 * max(o * i for o, i in mats), 0.0
    acts = 4 * b * s * (4 * h + qkv + 3 * inter) + 4 * b * d.n_heads * s * s
    resident = text.vocab_size * h * e * (1 if getattr(text, "tie_word_embeddings", False) else 2)
    # grid search (rana and its ablations, rana-paper): each projection's adapted outputs on the fit
    # sample and the search tokens, cached per budget share tried, plus h and its masks for down
    search = 0.0
    if method.startswith("rana"):
        n_tok = config.fit_sample_tokens + config.search_tokens
        n_budgets = round(1 / config.grid_step) + 4
        search = 4 * n_tok * inter * ((2 if d.gated else 1) * n_budgets + 6) + 8 * n_tok * h
    parts = {"layer weights": w_layer, "adapters being built": w_layer, "decomposition workspace": workspace,
             "second moments": moments, "search buffers": search, "batch activations": acts,
             "embeddings/lm_head": resident}
    # the searches' sample / held-aside rows live on the compute device (rana.placement)
    tokens = config.calib_tokens
    held = tokens * config.heldout_fraction
    fit_sample = tokens * (1 - config.heldout_fraction) * distributed.THRESHOLD_FRACTION
    widest_in = inter if method in ("svd", "teal") else h
    parts["sample rows"] = 4 * (held + fit_sample) * (h + widest_in)
    if torch.device(device).type == "cpu":
        if streamed:  # the shard's pages, mapped while the layer is read
            parts["checkpoint pages"] = w_layer
        parts["calibration hidden states"] = 0.0 if streamed else 2 * tokens * h * e
    return MemoryEstimate(parts=parts, device=str(device))


def check_memory(model_config, config, *, streamed: bool = False) -> MemoryEstimate | None:
    """Raise MemoryBudgetError when --max-memory cannot hold one layer's compression."""
    cap = parse_memory(getattr(config, "max_memory", None))
    if cap is None:
        return None
    est = estimate_memory(model_config, config, streamed=streamed)
    if torch.device(config.device).type == "cpu" and not streamed:  # the other layers share the same RAM
        est.parts["rest of the model (in RAM)"] = max(0.0, model_weight_bytes(model_config, config.dtype)
                                                      - layer_weight_bytes(model_config, config.dtype))
    if est.total > cap:
        raise MemoryBudgetError(
            f"--max-memory {config.max_memory} is too small: compressing one decoder layer of this model needs about "
            f"{fmt_bytes(est.total)} on {est.device} ({est.describe()}); raise --max-memory, lower --batch-size or "
            f"--seq-len (activations), use --dtype bfloat16 (weights), or --offload-dir to keep activations on disk")
    return est


# ------------------------------------------------------------------------------ lazy checkpoint


def _set_tensor(module: nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    parent_path, _, name = dotted.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    if name in parent._parameters:
        parent._parameters[name] = nn.Parameter(tensor, requires_grad=False)
    else:
        parent._buffers[name] = tensor


class LazyWeights:
    """A safetensors checkpoint folder read tensor by tensor (memory-mapped), under the model's
    parameter names (simple renames of transformers' checkpoint conversion mapping applied, e.g.
    GPT-NeoX `embed_out` → `lm_head`)."""

    def __init__(self, folder: Path, model: nn.Module | None = None):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / INDEX
        if index.exists():
            from .loading import ModelLoadError
            from .weightfiles import check_safetensors_folder, index_shards

            weight_map = index_shards(self.folder, error=ModelLoadError)  # no file outside the folder
            check_safetensors_folder(self.folder, error=ModelLoadError)
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise ValueError(f"'{folder}' has no .safetensors weights; streaming layers from disk needs them "
                                 "(re-save the model with save_pretrained, or drop --offload-dir/--max-memory)")
            weight_map = {}
            from .loading import ModelLoadError
            from .weightfiles import check_safetensors_file

            for f in files:
                check_safetensors_file(f, error=ModelLoadError)
                with safe_open(str(f), framework="pt") as st:
                    weight_map.update({k: f.name for k in st.keys()})
        self.files = {}  # model key -> (file, checkpoint key)
        renames = _simple_renames(model) if model is not None else []
        for key, fname in weight_map.items():
            target = key
            for src, dst in renames:
                target = re.sub(src, dst, target)
            self.files[target] = (fname, key)
        self.total_bytes = sum((self.folder / f).stat().st_size for f in set(weight_map.values()))

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def load(self, keys: list[str], device, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """The named tensors on `device` (in `dtype` when floating), one file opening per shard."""
        from safetensors import safe_open

        missing = [k for k in keys if k not in self.files]
        if missing:
            raise ValueError(f"the checkpoint in '{self.folder}' lacks {len(missing)} tensors the model needs "
                             f"(e.g. {missing[:3]}); streaming from disk reads tensors under the model's own names: "
                             "re-save the model with save_pretrained, or drop --offload-dir/--max-memory")
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.files[k][0], []).append(k)
        out = {}
        for fname, ks in by_file.items():
            with safe_open(str(self.folder / fname), framework="pt", device="cpu") as st:
                for k in ks:
                    t = st.get_tensor(self.files[k][1])
                    if dtype is not None and t.is_floating_point():
                        t = t.to(dtype)
                    out[k] = t.to(device)
        return out


def _simple_renames(model: nn.Module) -> list[tuple[str, str]]:
    """(regex, replacement) pairs of the pure renames in transformers' conversion mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming

        pairs = []
        for t in get_model_conversion_mapping(model):
            if type(t) is WeightRenaming and len(t.source_patterns) == 1 and len(t.target_patterns) == 1:
                pairs.append((t.source_patterns[0], t.target_patterns[0]))
        return pairs
    except Exception:  # noqa: BLE001 - older/newer transformers: plain names only
        return []


def checkpoint_folder(reference: str) -> Path:
    """Local folder with config + safetensors for a model reference (alias, folder, hub id)."""
    from .loading import ModelLoadError, resolve

    src = resolve(reference, dense=True)
    if src.gguf_file:
        raise ModelLoadError(f"'{reference}' is a GGUF file: streaming layers from disk needs safetensors weights; "
                             "drop --offload-dir/--max-memory or convert the model with save_pretrained")
    p = Path(src.path)
    if p.is_dir():
        return p
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(src.path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                                "*.txt"]))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not fetch '{reference}' for streaming: {str(e).splitlines()[0]}") from None


def load_lazy(reference: str | Path, *, dtype: str = "float32", with_tokenizer: bool = True):
    """(model, tokenizer) with the decoder layers left on the meta device: only the modules
    outside the decoder stack are read; `Residency` streams each layer in when its turn comes."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer


    folder = checkpoint_folder(str(reference))
    config = AutoConfig.from_pretrained(folder)
    spec = get_arch(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    weights = LazyWeights(folder, model)
    prefix = spec.layers + "."
    tied = _tied_keys(model)
    params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(k for k in params if k not in tied and k not in weights)
    if missing:  # found now, not when the layer's turn comes after the earlier layers' work
        from .loading import ModelLoadError

        raise ModelLoadError(f"the checkpoint '{folder}' lacks {len(missing)} tensors its config.json needs (e.g. "
                             f"{', '.join(missing[:3])}); it is incomplete or from another model: re-download or re-save it")
    keys = [k for k, _ in _named_tensors(model) if not k.startswith(prefix) and k not in tied
            and (k in params or k in weights)]  # buffers absent from the checkpoint keep their init
    for k, t in weights.load(keys, "cpu", DTYPES[dtype]).items():
        _set_tensor(model, k, t)
    if tied:
        model.tie_weights()
    model.eval()
    model._rana_lazy = weights
    tokenizer = None
    if with_tokenizer and any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def _named_tensors(module: nn.Module):
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers()


def _free_layer(layer: nn.Module) -> None:
    """Parameters and persistent buffers to the meta device (memory freed); non-persistent
    buffers, which no checkpoint holds (e.g. rotary tables), to the CPU."""
    for module in layer.modules():
        for n, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
        for n, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[n] = b.cpu() if n in module._non_persistent_buffers_set else torch.empty_like(b, device="meta")
    release_host_memory()


def _tied_keys(model: nn.Module) -> set[str]:
    """Parameter names that tie_weights() fills from the input embedding (e.g. lm_head.weight)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not getattr(text, "tie_word_embeddings", False):
        return set()
    out = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is out), None)
    return {f"{name}.weight"} if name is not None else set()


def should_stream(config, folder_bytes: float | None = None) -> bool:
    if getattr(config, "offload_dir", None):
        return True
    cap = parse_memory(getattr(config, "max_memory", None))
    if cap is None or torch.device(config.device).type != "cpu":
        return False
    if folder_bytes is None:
        try:
            folder_bytes = sum(f.stat().st_size for f in checkpoint_folder(config.model).glob("*.safetensors"))
        except Exception:  # noqa: BLE001 - GGUF or unresolvable: load normally
            return False
    return folder_bytes > cap


def load_for_compression(config):
    """(model, tokenizer) for `compress`: streamed from disk when `should_stream`, else loaded
    into host memory as before. Checks --max-memory against the config before reading weights."""
    from transformers import AutoConfig

    from .loading import load_model, resolve

    from .paths import check_work_dir, local_inputs, model_inputs

    check_work_dir(getattr(config, "offload_dir", None), model_inputs(config.model) + local_inputs(config.dataset),
                   "--offload-dir")
    if getattr(config, "max_memory", None) or getattr(config, "offload_dir", None):
        src = resolve(config.model, dense=True)
        if not src.gguf_file:
            folder = checkpoint_folder(config.model)
            model_config = AutoConfig.from_pretrained(folder)
            get_arch(model_config)
            size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
            cap = parse_memory(config.max_memory)
            stream = should_stream(config, size)
            if not stream and cap is not None and torch.device(config.device).type == "cpu":
                # in RAM the whole model sits beside the working set: stream when both do not fit
                stream = size + estimate_memory(model_config, config).total > cap
            check_memory(model_config, config, streamed=stream)
            if stream:
                return load_lazy(folder, dtype=config.dtype)
    model, tokenizer, _ = load_model(config.model, dtype=config.dtype, device="cpu")
    return model, tokenizer


# ------------------------------------------------------------------------------ activations on disk


def disk_spill(folder: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """Copy a tensor into a memory-mapped file under `folder` (unlinked at once: the mapping keeps
    it alive until the tensor is freed), so idle calibration activations are file-backed pages the
    OS can evict instead of anonymous memory."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    def spill(t: torch.Tensor) -> torch.Tensor:
        path = folder / f"act-{uuid.uuid4().hex}.bin"
        m = torch.from_file(str(path), shared=True, size=t.numel(), dtype=t.dtype)
        os.unlink(path)
        m.copy_(t.reshape(-1))
        return m.view(t.shape)

    return spill


# ------------------------------------------------------------------------------ layer residency


def release_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps freed large blocks in its arenas once its
    dynamic mmap threshold has grown, so a layer-by-layer loop's RSS would creep up otherwise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_memory_bytes(device: torch.device) -> float:
    if device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(device))
    import resource

    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: kB


class Residency:
    """Moves decoder layers to the compute device and back around `compress_model`'s loop
    (`bring` / `release`), places everything else, spills activations, checks --max-memory.

    Default: the whole model lives on `offload` (host RAM) and each layer visits the device.
    Streaming (model from `load_lazy`): layers come from the checkpoint and leave to `offload_dir`."""

    def __init__(self, model: nn.Module, spec: ArchSpec, config, device: torch.device, offload: torch.device):
        self.model, self.spec, self.config = model, spec, config
        self.device, self.offload = device, offload
        self.lazy: LazyWeights | None = getattr(model, "_rana_lazy", None)
        self.layers = decoder_layers(model, spec)
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self.estimate: MemoryEstimate | None = None
        self.dir: Path | None = None
        self.written: dict[int, tuple[str, list[dict]]] = {}
        if self.lazy is not None or getattr(config, "offload_dir", None):
            self.dir = Path(config.offload_dir) if getattr(config, "offload_dir", None) else Path(
                tempfile.mkdtemp(prefix="rana-offload-"))
            self._cleanup = weakref.finalize(self, shutil.rmtree, str(self.dir / "activations"), True)

    @classmethod
    def create(cls, model: nn.Module, spec: ArchSpec, config, device: torch.device, offload: torch.device) -> "Residency":
        r = cls(model, spec, config, device, offload)
        r.estimate = check_memory(model.config, config, streamed=r.lazy is not None)
        cap = parse_memory(getattr(config, "max_memory", None))
        if cap is not None and device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        r.place()
        return r

    # -- placement
    def _outside_layers(self):
        prefix = self.spec.layers + "."
        for name, module in self.model.named_modules():
            if name == self.spec.layers or name.startswith(prefix):
                continue
            yield module

    def place(self) -> None:
        """Everything but the decoder stack on the device (without moving the stack through it)."""
        for module in self._outside_layers():
            for name, p in module.named_parameters(recurse=False):
                if p.device != self.device:
                    p.data = p.data.to(self.device)
            for name, b in module.named_buffers(recurse=False):
                if b.device != self.device:
                    module._buffers[name] = b.to(self.device)
        if self.lazy is None:
            self.layers.to(self.offload)

    def adopt(self, inputs):
        """Calibration activations kept between layers: spilled to disk when streaming."""
        if self.dir is None:
            return inputs
        spill = disk_spill(self.dir / "activations" / f"{distributed.rank()}")
        inputs.hidden = [spill(h) for h in inputs.hidden]
        inputs.spill = spill
        return inputs

    # -- the loop
    def bring(self, idx: int, layer: nn.Module) -> None:
        if self.lazy is None:
            layer.to(self.device)
            return
        prefix = f"{self.spec.layers}.{idx}."
        names = [n for n, _ in _named_tensors(layer)]
        params = {n for n, _ in layer.named_parameters()}
        wanted = [n for n in names if n in params or prefix + n in self.lazy]
        loaded = self.lazy.load([prefix + n for n in wanted], self.device, self.dtype)
        for n in wanted:
            _set_tensor(layer, n, loaded[prefix + n])
        for n, b in layer.named_buffers():  # non-persistent buffers built at init (e.g. rotary)
            if n not in wanted and b.device != self.device:
                _set_tensor(layer, n, b.to(self.device))

    def release(self, idx: int, layer: nn.Module) -> None:
        distributed.sync_meters(layer)
        if self.dir is None:
            layer.to(self.offload)
            return
        if distributed.is_main_process():
            self._write_layer(idx, layer)
        _free_layer(layer)

    def drop(self, idx: int, layer: nn.Module) -> None:
        """Send a layer back without keeping what was done to it (e.g. after a profiling pass
        that only measured it): host RAM, or nothing at all when streaming (re-read on `bring`)."""
        if self.lazy is None:
            layer.to(self.offload)
            return
        _free_layer(layer)

    def _write_layer(self, idx: int, layer: nn.Module) -> None:
        from safetensors.torch import save_file

        from .io import adapter_specs

        prefix = f"{self.spec.layers}.{idx}."
        folder = self.dir / "layers"
        folder.mkdir(parents=True, exist_ok=True)
        fname = f"layer-{idx:05d}.safetensors"
        state = {prefix + k: v.detach().contiguous().cpu() for k, v in layer.state_dict().items()}
        save_file(state, str(folder / fname), metadata={"format": "pt"})
        specs = []
        for s in adapter_specs(layer):
            s = dict(s, path=prefix + s["path"])
            if "code" in s:
                s["code"] = prefix + s["code"]
            specs.append(s)
        self.written[idx] = (fname, specs)

    def finish(self, model: nn.Module, plan: dict) -> None:
        peak = peak_memory_bytes(self.device)
        peak = distributed.all_reduce_max(peak)
        if distributed.active():  # the meters were summed over processes: say so
            from .accounting import metered_modules

            tokens = max((m._tokens for m in metered_modules(model).values()), default=0)
            plan["measured_on"] = (f"{tokens} held-aside calibration tokens over {distributed.world_size()} processes "
                                   "(not used to fit thresholds)")
        plan["memory"] = {
            "device": str(self.device),
            "weights_home": "disk (streamed layer by layer)" if self.lazy is not None else str(self.offload),
            "max_memory": getattr(self.config, "max_memory", None),
            "estimate": self.estimate.to_dict() if self.estimate else None,
            "measured_peak_bytes": peak,
            "measured_peak": "torch.cuda.max_memory_allocated" if self.device.type == "cuda" else "process peak RSS",
        }
        if self.dir is not None:
            self._cleanup()
        if self.lazy is not None:
            for module in self._outside_layers():  # the layers are on disk; free the device
                for name, p in module.named_parameters(recurse=False):
                    p.data = p.data.to("cpu")
            model._rana_offloaded = OffloadedLayers(self.spec, self.dir / "layers", dict(self.written))
            return
        cap = parse_memory(getattr(self.config, "max_memory", None))
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        if cap is not None and size > cap:
            plan["memory"]["model_left_on"] = str(self.offload)  # the compressed model does not fit the cap
            return
        model.to(self.device)


@dataclass
class OffloadedLayers:
    """Compressed decoder layers written layer by layer; `rana.io.save` writes a sharded folder."""

    spec: ArchSpec
    folder: Path
    layers: dict[int, tuple[str, list[dict]]] = field(default_factory=dict)

    def adapter_specs(self) -> list[dict]:
        return [s for idx in sorted(self.layers) for s in self.layers[idx][1]]

    def write_weights(self, out: Path, rest: dict[str, torch.Tensor]) -> None:
        """Layer files (hard-linked or copied) + `rest` (everything outside the decoder stack) + index."""
        from safetensors import safe_open
        from safetensors.torch import save_file

        out = Path(out)
        prefix = self.spec.layers + "."
        rest = {k: v for k, v in rest.items() if not k.startswith(prefix)}
        n = len(self.layers) + 1
        weight_map = {}
        rest_name = f"model-{n:05d}-of-{n:05d}.safetensors"
        save_file(rest, str(out / rest_name), metadata={"format": "pt"})
        weight_map.update({k: rest_name for k in rest})
        for i, idx in enumerate(sorted(self.layers), start=1):
            src = self.folder / self.layers[idx][0]
            name = f"model-{i:05d}-of-{n:05d}.safetensors"
            try:
                os.link(src, out / name)
            except OSError:
                shutil.copyfile(src, out / name)
            with safe_open(str(src), framework="pt") as st:
                weight_map.update({k: name for k in st.keys()})
        (out / INDEX).write_text(json.dumps({"metadata": {"format": "rana-sharded"}, "weight_map": weight_map}, indent=1))


def layer_bytes_on_device(layer: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for _, t in _named_tensors(layer) if t.device.type != "meta")


__all__ = ["parse_memory", "MemoryBudgetError", "MemoryEstimate", "estimate_memory", "check_memory", "LazyWeights",
           "load_lazy", "load_for_compression", "should_stream", "Residency", "OffloadedLayers", "disk_spill",
           "peak_memory_bytes", "model_weight_bytes", "layer_weight_bytes"]
