"""`Resources`: where one compression runs and within what memory, decided once and handed down.
The type lives in `rana.compress.resource_types`, below the modules that read it, and is re-exported
here; this module decides its values.

`decide_resources(config)` (the last step of `rana.compress.preflight`) fixes, before any weight is
read: this process's compute device (its own GPU under `accelerate launch`), the --max-memory cap in
bytes, the --offload-dir work folder, whether the decoder layers are streamed from the checkpoint
(`rana.compress.streaming`), and the one-layer memory estimate checked against the cap
(`rana.compress.memory`). The loader, the memory check and `Residency` read these values instead of
re-deriving them from the config.
"""
from __future__ import annotations

from dataclasses import replace

from transformers import AutoConfig

from ..archs import get_arch
from ..io.models import resolve
from .distributed import setup_from_env
from .memory import check_memory, estimate_memory
from .resource_types import Resources
from .streaming import checkpoint_folder


def setup_distributed(config):
    """Under `accelerate launch` / `torchrun` (WORLD_SIZE > 1): join the process group and give
    this process its own device; the calibration batches are then split across processes."""
    device = setup_from_env(config.device)
    return config if device == config.device else replace(config, device=device)


def streams(resources: Resources, checkpoint_bytes: float) -> bool:
    """Stream from disk: asked for (--offload-dir), or a CPU run whose checkpoint exceeds --max-memory."""
    if resources.work_dir is not None:
        return True
    if resources.cap is None or resources.device.type != "cpu":
        return False
    return checkpoint_bytes > resources.cap


def decide_resources(config) -> Resources:
    """The resources of a validated config on this process's device (`setup_distributed` first): with
    --max-memory or --offload-dir and a safetensors checkpoint, whether to stream its layers and the
    memory estimate, checked against the cap before any weight is read (MemoryBudgetError). A GGUF
    file, or a run without either option, is loaded into host RAM; its estimate, if a cap asks for
    one, is made on the loaded model (`Residency`)."""
    resources = Resources.of(config)
    if not (config.max_memory or config.offload_dir) or resolve(config.model, dense=True).gguf_file:
        return resources
    folder = checkpoint_folder(config.model)
    model_config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    get_arch(model_config)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    stream = streams(resources, size)
    if not stream and resources.cap is not None and resources.device.type == "cpu":
        # in RAM the whole model sits beside the working set: stream when both do not fit
        stream = size + estimate_memory(model_config, config).total > resources.cap
    estimate = check_memory(model_config, config, resources, streamed=stream)
    return replace(resources, stream_from=folder if stream else None, estimate=estimate)


__all__ = ["Resources", "setup_distributed", "streams", "decide_resources"]
