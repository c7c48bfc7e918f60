"""`QuantizeConfig`: what `rana quantize` is asked to do, each option written once (`rana.settings`); the
command's `QuantizeError` and `DEFAULT_CALIB_TOKENS`, which run.py builds on (and re-exports)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..settings import MAX_SEED, Settings, setting

DEFAULT_CALIB_TOKENS = 8192  # --calib-tokens' default (also bench_int8's)
# --activations' default: int8 (W8A8) decoded SmolLM2 in 0.74-0.80x float's (W8A16) time at 1 thread, perplexity
# +0.0-0.8 % above it (benchmarks/results/int8_cpu.md)
DEFAULT_ACTIVATIONS = "int8"
ACTIVATION_CHOICES = ("int8", "float")  # kernels/cpu_gemv.py ACTIVATIONS, the default first (torch-free here)
# --activation-block's default: the inputs of a token quantized per fp32 scale (W8A8). 32 kept SmolLM2-135M's W8A8
# sparse perplexity within 1 % of fp32 sparse at F = 0.85 / 0.70 / 0.58 on both held-out texts, where 64 had +1.46 %
# and +1.11 % on pydoc at 0.70 / 0.58, and decodes as fast (benchmarks/results/int8_cpu.md, kernels_w8a8_cpu.md)
DEFAULT_ACTIVATION_BLOCK = 32
MAX_ACTIVATION_BLOCK = 64  # kernels/cpu_gemv.py A8_BLOCK_MAX


class QuantizeError(UserError):
    """A model or folder that cannot be quantized (user-facing: one line)."""


@dataclass
class QuantizeConfig(Settings):
    src: Path = setting(help="rana folder written by `rana compress` / `rana finetune`", argument=True, required=True)
    weights: str = setting("int8", "int8: symmetric per-output-channel int8 for every linear of the decoder and the LM "
                                   "head, fp32 scales, thresholds refit on the quantized model's activations",
                           flags=("--weights",), required=True)
    out: Path = setting(None, "output folder (must not exist unless --overwrite)", flags=("--out", "-o"), required=True)
    activations: str = setting(DEFAULT_ACTIVATIONS, "how the int8 layers multiply a token: int8 (W8A8: its kept inputs "
                                                    "quantized per block, int8 x int8 sums) or float (W8A16)",
                               flags=("--activations",))
    activation_block: int = setting(DEFAULT_ACTIVATION_BLOCK, "W8A8: a token's inputs quantized per fp32 scale (smaller: "
                                                              "closer to float, more scales to apply)",
                                    flags=("--activation-block",), min=1, max=MAX_ACTIVATION_BLOCK)
    dataset: str | None = setting(None, "calibration text: local .txt/.jsonl/.parquet file or folder, or a hub dataset "
                                        "(default: bundled corpus)")
    calib_tokens: int = setting(DEFAULT_CALIB_TOKENS, "calibration tokens for the scales and the threshold refit (0: "
                                                      "max-abs scales, thresholds kept)", flags=("--calib-tokens",),
                                min=0)
    seq_len: int | None = setting(None, "calibration window (default: the folder's compression setting, else 512)",
                                  flags=("--seq-len",), min=2)
    batch_size: int = setting(8, "windows per calibration forward", flags=("--batch-size",), min=1)
    seed: int = setting(0, min=0, max=MAX_SEED)
    overwrite: bool = setting(False, "replace an existing --out folder")

    error = QuantizeError

    def validate(self) -> None:
        """Every field's type and range (`Settings.validate`), then the choices (QuantizeError).
        `rana.quantize.quantize_folder` checks --weights first, then the folders, then these."""
        super().validate()
        if self.activations not in ACTIVATION_CHOICES:
            raise QuantizeError(f"--activations must be one of {', '.join(ACTIVATION_CHOICES)}, "
                                f"got {self.activations!r}")


__all__ = ["DEFAULT_CALIB_TOKENS", "DEFAULT_ACTIVATIONS", "DEFAULT_ACTIVATION_BLOCK", "QuantizeConfig", "QuantizeError"]
