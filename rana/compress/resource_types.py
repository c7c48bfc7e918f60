"""The values the pre-flight of `rana compress` hands down: `Resources` (where one compression runs
and within what memory) and the `MemoryEstimate` it carries.

Types only, below every module that fills or reads them: `rana.compress.resources` decides them,
`rana.compress.memory` makes the estimate, `rana.compress.streaming` and `rana.compress.residency`
read them, and none of those needs another for a type hint. `rana.compress.resources` re-exports
`Resources`, `rana.compress.memory` `MemoryEstimate`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..units import fmt_bytes, parse_memory


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


@dataclass(frozen=True)
class Resources:
    """What one compression may use (see `rana.compress.resources`)."""

    device: torch.device  # the compute device
    offload: torch.device  # where the decoder stack waits between its layers' turns (host RAM)
    max_memory: str | None  # --max-memory as given (for messages and plan.json)
    cap: float | None  # the same in bytes
    work_dir: Path | None  # --offload-dir: compressed layers and spilled activations
    stream_from: Path | None = None  # the checkpoint folder the decoder layers are streamed from, if they are
    estimate: MemoryEstimate | None = None  # one layer's peak need, checked against `cap` (None: not checked yet)

    @classmethod
    def of(cls, config) -> Resources:
        """The resources a validated config names, before anything is known of the model."""
        return cls(device=torch.device(config.device), offload=torch.device(config.offload_device),
                   max_memory=config.max_memory, cap=parse_memory(config.max_memory),
                   work_dir=Path(config.offload_dir) if config.offload_dir else None)


__all__ = ["MemoryEstimate", "Resources"]
