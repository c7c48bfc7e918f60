"""Streaming a checkpoint layer by layer: models bigger than memory are built on the meta device,
only the modules outside the decoder stack are read, and each decoder layer is materialised from
the checkpoint's safetensors shards (memory-mapped) when its turn comes (`rana.compress.residency`).

Streaming is chosen by `--offload-dir DIR`, or implied by `--max-memory` on a CPU device when the
checkpoint is bigger than the cap (decided up front: `rana.compress.resources`); otherwise the model
is loaded into host RAM.
"""
from __future__ import annotations

import ctypes
import re
from pathlib import Path

import torch
import torch.nn as nn
from huggingface_hub import snapshot_download
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..archs import get_arch
from ..io.format import WEIGHTS_INDEX, ModelLoadError, tied_keys
from ..io.models import load_model, resolve
from ..io.weightfiles import check_safetensors_file, check_safetensors_folder, index_shards
from ..units import DTYPES
from .resource_types import Resources


def set_tensor(module: nn.Module, dotted: str, tensor: torch.Tensor) -> None:
    """Put `tensor` in place of the parameter (frozen) or buffer named `dotted` inside `module`."""
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
        self.folder = Path(folder)
        index = self.folder / WEIGHTS_INDEX
        if index.exists():
            weight_map = index_shards(self.folder, error=ModelLoadError)  # no file outside the folder
            check_safetensors_folder(self.folder, error=ModelLoadError)
        else:
            files = sorted(self.folder.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"'{folder}' has no .safetensors weights; streaming layers from disk needs them "
                                 "(re-save the model with save_pretrained, or drop --offload-dir/--max-memory)")
            weight_map = {}
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
        missing = [k for k in keys if k not in self.files]
        if missing:
            raise ModelLoadError(f"the checkpoint in '{self.folder}' lacks {len(missing)} tensors the model needs "
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
    src = resolve(reference, dense=True)
    if src.gguf_file:
        raise ModelLoadError(f"'{reference}' is a GGUF file: streaming layers from disk needs safetensors weights; "
                             "drop --offload-dir/--max-memory or convert the model with save_pretrained")
    p = Path(src.path)
    if p.is_dir():
        return p
    try:
        return Path(snapshot_download(src.path, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model",
                                                                "*.txt"]))
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"could not fetch '{reference}' for streaming: {str(e).splitlines()[0]}") from None


def load_lazy(reference: str | Path, *, dtype: str = "float32",
              with_tokenizer: bool = True) -> tuple[nn.Module, object, LazyWeights]:
    """(model, tokenizer, weights) with the decoder layers left on the meta device: only the
    modules outside the decoder stack are read; pass `weights` to `compress_model(...,
    lazy_weights=weights)`, whose `Residency` streams each layer in from them when its turn comes."""
    from accelerate import init_empty_weights  # optional dependency: streaming only

    folder = checkpoint_folder(str(reference))
    config = AutoConfig.from_pretrained(folder, trust_remote_code=False)  # rana runs no code from a model folder
    spec = get_arch(config)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
    weights = LazyWeights(folder, model)
    prefix = spec.layers + "."
    tied = tied_keys(model)
    params = {k for k, _ in model.named_parameters(remove_duplicate=False)}
    missing = sorted(k for k in params if k not in tied and k not in weights)
    if missing:  # found now, not when the layer's turn comes after the earlier layers' work
        raise ModelLoadError(f"the checkpoint '{folder}' lacks {len(missing)} tensors its config.json needs (e.g. "
                             f"{', '.join(missing[:3])}); it is incomplete or from another model: re-download or re-save it")
    keys = [k for k, _ in named_tensors(model) if not k.startswith(prefix) and k not in tied
            and (k in params or k in weights)]  # buffers absent from the checkpoint keep their init
    for k, t in weights.load(keys, "cpu", DTYPES[dtype]).items():
        set_tensor(model, k, t)
    if tied:
        model.tie_weights()
    model.eval()
    tokenizer = None
    if with_tokenizer and any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    return model, tokenizer, weights


def named_tensors(module: nn.Module):
    """Every parameter (tied ones under each name) and buffer of `module`, by dotted name."""
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers()


def free_layer(layer: nn.Module) -> None:
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


def load_for_compression(config, resources: Resources) -> tuple[nn.Module, object, LazyWeights | None]:
    """(model, tokenizer, lazy weights) for `compress`: streamed from the checkpoint folder the resources
    name (`resources.stream_from`, decided up front by `rana.compress.resources`; the lazy weights then
    feed the layers), else loaded into host memory (lazy weights None)."""
    if resources.stream_from is not None:
        return load_lazy(resources.stream_from, dtype=config.dtype)
    model, tokenizer, _ = load_model(config.model, dtype=config.dtype, device="cpu")
    return model, tokenizer, None


def release_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc keeps freed large blocks in its arenas once its
    dynamic mmap threshold has grown, so a layer-by-layer loop's RSS would creep up otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


__all__ = ["LazyWeights", "checkpoint_folder", "load_lazy", "load_for_compression", "set_tensor",
           "named_tensors", "free_layer", "release_host_memory"]
