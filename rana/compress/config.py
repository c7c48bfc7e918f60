"""`CompressConfig`: the settings of one compression, versioned and JSON round-trippable (the CLI,
plan.json's `config`, rana_config.json's `compress_config` and recipe.json all hold it)."""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..checks import check_device
from ..io.format import WEIGHT_FORMATS, CompressSettings
from ..units import parse_memory

from ..methods import METHODS  # the registry names, current when read
from ..methods.base import RENAMED, get_method
from .head import check_lm_head, resolve_lm_head


# Thresholds are quantiles of activation statistics: fewer fitting tokens than this give noisy,
# unrepeatable masks (8 tokens were once accepted silently).
MIN_FIT_TOKENS = 256
MAX_CALIB_TOKENS = 100_000_000  # activations of every calibration token are held while fitting


def min_calib_tokens(seq_len: int, heldout_fraction: float = 0.125) -> int:
    """The smallest --calib-tokens (a whole number of windows) that leaves MIN_FIT_TOKENS to fit on."""
    n_seq = 2
    while (n_seq - max(1, round(n_seq * heldout_fraction))) * seq_len < MIN_FIT_TOKENS:
        n_seq += 1
    return n_seq * seq_len


@dataclass
class CompressConfig(CompressSettings):
    """The settings of one compression (fields, defaults and JSON form: `rana.io.format.CompressSettings`,
    which folders and recipes record), checked by `validate` before any work."""

    def resolved(self) -> CompressConfig:
        """This config with "auto" settings replaced by the method's own choices (validate first):
        what runs, and what plan.json, the folder and the recipe record."""
        return replace(self, lm_head=resolve_lm_head(self.lm_head, get_method(self.method).lm_head))

    def validate(self) -> None:
        if not 0.0 < self.flops <= 1.0:
            raise ValueError(f"--flops must be in (0, 1], got {self.flops}: it is the fraction of the dense model's FLOPs to keep")
        if self.method not in METHODS:
            renamed = f"renamed '{RENAMED[self.method]}'; " if self.method in RENAMED else ""
            raise ValueError(f"unknown method '{self.method}' ({renamed}choose from {', '.join(METHODS)})")
        if self.allocation not in ("uniform", "global"):
            raise ValueError(f"unknown allocation '{self.allocation}' (choose uniform or global)")
        check_lm_head(self.lm_head)
        if self.max_memory is not None:
            parse_memory(self.max_memory)
        if self.seq_len < 8:
            raise ValueError(f"--seq-len must be at least 8, got {self.seq_len}")
        if self.calib_tokens < 2 * self.seq_len:
            raise ValueError(f"--calib-tokens ({self.calib_tokens}) must be at least two sequences (2 × --seq-len = {2 * self.seq_len})")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ValueError("heldout fraction must be in (0, 1)")
        n_seq = self.calib_tokens // self.seq_len
        fit_tokens = (n_seq - max(1, round(n_seq * self.heldout_fraction))) * self.seq_len
        if fit_tokens < MIN_FIT_TOKENS:
            raise ValueError(f"--calib-tokens {self.calib_tokens} leaves {fit_tokens} tokens to fit thresholds on (after the "
                             f"held-aside slice), too few for stable statistics: pass --calib-tokens "
                             f"{min_calib_tokens(self.seq_len, self.heldout_fraction)} or more")
        if self.calib_tokens > MAX_CALIB_TOKENS:
            raise ValueError(f"--calib-tokens {self.calib_tokens} is beyond any useful calibration set (at most "
                             f"{MAX_CALIB_TOKENS:,}; the paper uses about 32k)")
        for name in ("batch_size", "fit_sample_tokens", "search_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if not 0.0 < self.grid_step <= 1.0:
            raise ValueError(f"--grid-step must be in (0, 1] (a share of the MLP budget), got {self.grid_step}")
        check_device(self.device)
        check_device(self.offload_device)
        if self.weights not in WEIGHT_FORMATS:
            raise ValueError(f"unknown --weights '{self.weights}' (choose {' or '.join(WEIGHT_FORMATS)})")
        if self.weights == "int8" and self.offload_dir:
            raise ValueError("--weights int8 does not work with layers streamed from disk (--offload-dir); compress "
                             "in memory, or compress first and run `rana quantize` on the folder")
