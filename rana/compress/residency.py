"""Where the decoder layers live while `compress_model` walks them.

* **CPU** (default): the model is loaded normally; each decoder layer moves to the compute device
  only while it is processed (`--device cuda`, weights in host RAM).
* **disk** (a model from `rana.compress.streaming.load_lazy`): each decoder layer is materialised
  from the checkpoint onto the compute device when its turn comes, compressed, written to
  `DIR/layers/` and dropped, so the process never holds more than one layer. The calibration hidden
  states are spilled to memory-mapped files in `DIR/activations/` between layers. `finish` returns
  the written layers (`rana.io.OffloadedLayers`), which `rana.io.save` writes as a sharded folder
  with a `model.safetensors.index.json`; `rana.io.load` reads both layouts.

An --offload-dir obeys rana's ownership rule (rana.io.paths): new, empty, or an offload folder rana
wrote, every file unchanged (checked by the pre-flight, and here again for `compress_model` called
without it). It is claimed with a manifest of kind "offload folder" that records each layer file as
it is written (size and sha256), so a re-run reuses it and no other command mistakes it for its own;
`activations/` is rana's scratch space, from which only rana's own spill files are ever removed.
"""
from __future__ import annotations

import os
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from safetensors.torch import save_file

from . import distributed
from ..accounting import metered_modules
from ..archs import ArchSpec, decoder_layers
from ..io.folder import OffloadedLayers
from ..io.format import adapter_specs
from ..io.paths import OFFLOAD_KIND, check_work_dir, claim_folder, update_manifest
from .memory import MemoryEstimate, check_memory, peak_memory_bytes
from .resources import Resources
from .streaming import LazyWeights, free_layer, named_tensors, set_tensor


SCRATCH, LAYERS = "activations", "layers"  # the offload folder's parts
SPILL_PREFIX, SPILL_SUFFIX = "act-", ".bin"


def disk_spill(folder: Path) -> Callable[[torch.Tensor], torch.Tensor]:
    """Copy a tensor into a memory-mapped file under `folder` (unlinked at once: the mapping keeps
    it alive until the tensor is freed), so idle calibration activations are file-backed pages the
    OS can evict instead of anonymous memory."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)

    def spill(t: torch.Tensor) -> torch.Tensor:
        path = folder / f"{SPILL_PREFIX}{uuid.uuid4().hex}{SPILL_SUFFIX}"
        m = torch.from_file(str(path), shared=True, size=t.numel(), dtype=t.dtype)
        os.unlink(path)
        m.copy_(t.reshape(-1))
        return m.view(t.shape)

    return spill


def remove_spill(folder: Path) -> None:
    """Remove what `disk_spill` left under `folder`: its files (each unlinked at once, so only a kill
    leaves one) and the folders then empty; nothing else (a file of anyone else's stays)."""
    for root, _dirs, files in os.walk(folder, topdown=False):
        for name in files:
            if name.startswith(SPILL_PREFIX) and name.endswith(SPILL_SUFFIX):
                Path(root, name).unlink(missing_ok=True)
        try:
            os.rmdir(root)
        except OSError:  # not empty (someone else's file) or already gone
            pass


class Residency:
    """Moves decoder layers to the compute device and back around `compress_model`'s loop
    (`bring` / `release`), places everything else, spills activations, checks --max-memory.

    Default: the whole model lives on `offload` (host RAM) and each layer visits the device.
    Streaming (`lazy` weights from `load_lazy`): layers come from the checkpoint and leave to
    `offload_dir`."""

    def __init__(self, model: nn.Module, spec: ArchSpec, resources: Resources, lazy: LazyWeights | None = None):
        self.model, self.spec, self.resources = model, spec, resources
        self.device, self.offload = resources.device, resources.offload
        self.lazy = lazy
        self.layers = decoder_layers(model, spec)
        self.dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        self.estimate: MemoryEstimate | None = resources.estimate
        self.dir: Path | None = None
        self.owned = resources.work_dir is not None  # an --offload-dir, with its manifest (else a private temp folder)
        self.written: dict[int, tuple[str, list[dict]]] = {}
        if self.owned:
            self.dir = Path(resources.work_dir)
            self._claim()
        elif self.lazy is not None:
            self.dir = Path(tempfile.mkdtemp(prefix="rana-offload-"))
        if self.dir is not None:
            self._cleanup = weakref.finalize(self, remove_spill, self.dir / SCRATCH)

    def _claim(self) -> None:
        """Check the --offload-dir is new, empty or an offload folder of rana's (again: `compress_model`
        may be called without the pre-flight; under `accelerate launch` the pre-flight checked it on
        every process, and another process may already be spilling into it), then mark it as rana's."""
        if not distributed.is_main_process():
            return
        if not distributed.active():
            check_work_dir(self.dir, (), "--offload-dir", kind=OFFLOAD_KIND)
        claim_folder(self.dir, OFFLOAD_KIND, dirs=[LAYERS], growing=[SCRATCH])

    @classmethod
    def create(cls, model: nn.Module, spec: ArchSpec, config, resources: Resources,
               lazy: LazyWeights | None = None) -> "Residency":
        """Place the model for the loop; --max-memory checked on the model in hand unless the resources
        were checked up front (`rana.compress.resources`), and enforced on CUDA."""
        r = cls(model, spec, resources, lazy)
        if r.estimate is None:
            r.estimate = check_memory(model.config, config, resources, streamed=r.lazy is not None)
        if resources.cap is not None and r.device.type == "cuda":
            total = torch.cuda.get_device_properties(r.device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, resources.cap / total), r.device)
        if r.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(r.device)
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
        spill = disk_spill(self.dir / SCRATCH / f"{distributed.rank()}")
        inputs.hidden = [spill(h) for h in inputs.hidden]
        inputs.spill = spill
        return inputs

    # -- the loop
    def bring(self, idx: int, layer: nn.Module) -> None:
        if self.lazy is None:
            layer.to(self.device)
            return
        prefix = f"{self.spec.layers}.{idx}."
        names = [n for n, _ in named_tensors(layer)]
        params = {n for n, _ in layer.named_parameters()}
        wanted = [n for n in names if n in params or prefix + n in self.lazy]
        loaded = self.lazy.load([prefix + n for n in wanted], self.device, self.dtype)
        for n in wanted:
            set_tensor(layer, n, loaded[prefix + n])
        for n, b in layer.named_buffers():  # non-persistent buffers built at init (e.g. rotary)
            if n not in wanted and b.device != self.device:
                set_tensor(layer, n, b.to(self.device))

    def release(self, idx: int, layer: nn.Module) -> None:
        distributed.sync_meters(layer)
        if self.dir is None:
            layer.to(self.offload)
            return
        if distributed.is_main_process():
            self._write_layer(idx, layer)
        free_layer(layer)

    def drop(self, idx: int, layer: nn.Module) -> None:
        """Send a layer back without keeping what was done to it (e.g. after a profiling pass
        that only measured it): host RAM, or nothing at all when streaming (re-read on `bring`)."""
        if self.lazy is None:
            layer.to(self.offload)
            return
        free_layer(layer)

    def _write_layer(self, idx: int, layer: nn.Module) -> None:
        prefix = f"{self.spec.layers}.{idx}."
        folder = self.dir / LAYERS
        folder.mkdir(parents=True, exist_ok=True)
        fname = f"layer-{idx:05d}.safetensors"
        state = {prefix + k: v.detach().contiguous().cpu() for k, v in layer.state_dict().items()}
        rel = f"{LAYERS}/{fname}"
        if self.owned:  # rana's whatever it holds if a kill stops the write; its sha256 once written
            update_manifest(self.dir, OFFLOAD_KIND, growing=[rel])
        # a new file, not the old one rewritten: a folder saved from an earlier run may hard-link it
        (folder / fname).unlink(missing_ok=True)
        save_file(state, str(folder / fname), metadata={"format": "pt"})
        if self.owned:
            update_manifest(self.dir, OFFLOAD_KIND, written=[rel])
        specs = []
        for s in adapter_specs(layer):
            s = dict(s, path=prefix + s["path"])
            if "code" in s:
                s["code"] = prefix + s["code"]
            specs.append(s)
        self.written[idx] = (fname, specs)

    def finish(self, model: nn.Module, plan: dict) -> OffloadedLayers | None:
        """Record the memory use in `plan` and place the compressed model: on the device, or, when
        streamed, left on disk as the returned layers (for `rana.io.save(..., offloaded=...)`)."""
        peak = peak_memory_bytes(self.device)
        peak = distributed.all_reduce_max(peak)
        if distributed.active():  # the meters were summed over processes: say so
            tokens = max((m._tokens for m in metered_modules(model).values()), default=0)
            plan["measured_on"] = (f"{tokens} held-aside calibration tokens over {distributed.world_size()} processes "
                                   "(not used to fit thresholds)")
        plan["memory"] = {
            "device": str(self.device),
            "weights_home": "disk (streamed layer by layer)" if self.lazy is not None else str(self.offload),
            "max_memory": self.resources.max_memory,
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
            return OffloadedLayers(self.spec, self.dir / "layers", dict(self.written))
        cap = self.resources.cap
        size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        if cap is not None and size > cap:
            plan["memory"]["model_left_on"] = str(self.offload)  # the compressed model does not fit the cap
            return None
        model.to(self.device)
        return None


__all__ = ["disk_spill", "Residency"]
