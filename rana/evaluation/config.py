"""`EvalConfig`: what `rana eval` (and a library call of `evaluate_model` / `evaluate_models`) is asked
to measure, each option written once (`rana.settings`), with the checks of its values.

Library callers may pass the settings as keywords instead of an `EvalConfig`; three of them keep the
names the library used before the settings object existed (`LIBRARY_NAMES`: ``ppl_sources``,
``max_tokens``, ``latency_new_tokens``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Optional

from ..checks import check_device
from ..errors import UserError
from ..settings import Settings, setting
from ..units import DTYPES
from .perplexity import PPL_PRESET_HELP, PplProtocol, ppl_preset
from .serving import SERVE_MODE, serve_unavailable

AUTO = "auto"  # the latency harness chosen by device: compiled on CUDA, eager elsewhere
LATENCY_MODE_CHOICES = (AUTO, "compiled", "step", "eager", SERVE_MODE)
# keyword names library callers used before EvalConfig → the field they set
LIBRARY_NAMES = {"ppl_sources": "ppl_data", "max_tokens": "eval_tokens", "latency_new_tokens": "latency_tokens"}


@dataclass
class EvalConfig(Settings):
    """What to measure and how. ``ppl_data`` may also hold, for library callers, pre-tokenised 1-D
    streams or a {label: source} mapping, and ``tasks`` a list instead of a comma list."""

    models: List[str] = setting(help="rana folder(s) or dense model(s): alias, hub id, local folder, .gguf",
                                default_factory=list, argument=True, required=True)
    compare: List[str] = setting(help="more models for the same table (repeatable, or comma list)",
                                 default_factory=list, flags=("--compare",))
    ppl_data: Any = setting(help="perplexity text (repeatable): local .txt/.raw/.jsonl/.parquet or hub "
                                 "name[:config[:split]]", default_factory=list, flags=("--ppl-data",), cli_type=List[str])
    ppl_protocol: str = setting("rana", f"perplexity protocol preset: {PPL_PRESET_HELP}")
    seq_len: Optional[int] = setting(None, "perplexity window length, also the attention context for FLOPs (default: "
                                           "the --ppl-protocol preset's; for teal, the context before the 512 scored "
                                           "tokens)", min=2)
    batch_size: int = setting(4, "windows per perplexity forward", min=1)
    eval_tokens: Optional[int] = setting(None, "score only the first N tokens of each text's stream (default: all, as "
                                               "every preset)", min=1)
    text_column: str = setting("text", "text column for json/parquet/hub data")
    tasks: Any = setting(None, "comma list of lm-eval tasks (hellaswag,lambada_openai; offline: "
                               "hellaswag_local,lambada_openai_local with --task-data)", cli_type=Optional[str])
    include_path: Optional[Path] = setting(None, "folder of extra lm-eval task YAMLs")
    task_data: Optional[Path] = setting(None, "data folder for the bundled *_local tasks (holds eval/…jsonl), e.g. "
                                              "../shared/data")
    limit: Optional[float] = setting(None, "lm-eval examples per task (a number, or a fraction < 1)", above=0)
    num_fewshot: int = setting(0, "lm-eval few-shot examples", min=0)
    latency: bool = setting(False, "batch-1 decode tokens/s, timed interleaved with the dense model",
                            flags=("--latency",))
    dense: Optional[str] = setting(None, "dense model for --latency / --layer-errors (default: plan.json's model)",
                                   flags=("--dense",))
    latency_tokens: int = setting(64, "tokens generated per latency run", min=1)
    latency_repeats: int = setting(5, "timed latency runs (median)", min=1)
    latency_warmup: int = setting(2, "untimed latency runs first", cli=False, min=0)
    latency_mode: Optional[str] = setting(
        AUTO, "latency harness: compiled (generate, static cache + torch.compile) | step (gpt-fast style: compiled "
              "one-token step, no generate overhead) | eager | serve (streamed completions through `transformers "
              "serve`, the rana folder exported, the dense model saved; TTFT too) | auto (compiled on CUDA, eager "
              "elsewhere)", cli_type=str)
    layer_errors: bool = setting(False, "per-layer relative output error of QKV/o/MLP vs the dense model on the "
                                        "first --ppl-data text", flags=("--layer-errors",))
    layer_error_tokens: int = setting(8192, "tokens for --layer-errors", min=2)
    json_out: Optional[Path] = setting(None, "write machine-readable results here", flags=("--json",))
    dtype: str = setting("float32", "float32 | bfloat16 | float16")
    device: str = setting("cpu", "compute device (cpu, cuda, …)")

    @classmethod
    def from_options(cls, options: dict, given: frozenset = frozenset()) -> "EvalConfig":
        """The command line types --limit as a float: a whole number ≥ 1 is a count of examples."""
        config = super().from_options(options, given)
        value = config.limit
        if value is not None and math.isfinite(value) and value >= 1 and float(value).is_integer():
            config.limit = int(value)
        return config

    @classmethod
    def merged(cls, config: "EvalConfig | None", settings: dict) -> "EvalConfig":
        """`config` (default: every default) with the keyword `settings` of a library call on top
        (field names, or the older names of `LIBRARY_NAMES`)."""
        renamed = {LIBRARY_NAMES.get(k, k): v for k, v in settings.items()}
        return dataclasses.replace(config or cls(), **renamed)

    # ------------------------------------------------------------------ derived values
    @property
    def references(self) -> list[str]:
        """Every model to evaluate: the arguments, then --compare (repeated, or comma lists)."""
        return list(self.models) + [c.strip() for item in self.compare for c in item.split(",") if c.strip()]

    @property
    def task_list(self) -> list[str]:
        if isinstance(self.tasks, str):
            return [t.strip() for t in self.tasks.split(",") if t.strip()]
        return list(self.tasks or ())

    @property
    def harness_mode(self) -> str | None:
        """The latency harness to ask for (None: the device's default)."""
        return None if self.latency_mode in (None, AUTO) else self.latency_mode

    @property
    def protocol(self) -> PplProtocol:
        """The perplexity protocol: the preset, its window replaced by --seq-len (a bad name: one UserError)."""
        return ppl_preset(self.ppl_protocol, self.seq_len)

    # ------------------------------------------------------------------ checks
    def validate(self) -> None:
        """Every field's type and range (`Settings.validate`), then, in the order `rana eval` has always
        checked them, what they mean together (one UserError each)."""
        super().validate()
        check_request(ppl_sources=self.ppl_data, tasks=self.task_list, latency=self.latency,
                      layer_errors=self.layer_errors)
        if self.latency_mode not in LATENCY_MODE_CHOICES:
            raise UserError(f"--latency-mode must be auto, compiled, step, eager or serve, got {self.latency_mode!r}")
        if self.latency and self.latency_mode == SERVE_MODE:
            check_serve_available()  # `transformers serve` installed: one line before any work
        self._check_eval_tokens(self.protocol.window)
        if self.dtype not in DTYPES:
            raise UserError(f"--dtype must be one of float32, bfloat16, float16, got '{self.dtype}'")
        check_device(self.device)

    def _check_eval_tokens(self, window: int) -> None:
        if self.eval_tokens is not None and self.eval_tokens < window:
            raise UserError(f"--eval-tokens ({self.eval_tokens}) must be at least one perplexity window ({window} "
                            "tokens)")


def check_request(*, ppl_sources=(), tasks=(), latency: bool = False, layer_errors: bool = False) -> None:
    """Something to measure, and a text for the per-layer errors (checked before any model loads)."""
    if not ppl_sources and not tasks and not latency:
        raise UserError("nothing to evaluate: pass --ppl-data FILE (perplexity + measured FLOPs), --tasks and/or "
                        "--latency")
    if layer_errors and not ppl_sources:
        raise UserError("--layer-errors runs on the first --ppl-data text: pass one")


def check_serve_available() -> None:
    """The serve latency mode can run: `transformers serve` is installed here."""
    reason = serve_unavailable()
    if reason:
        raise UserError(f"--latency-mode serve: {reason}")


__all__ = ["EvalConfig", "LATENCY_MODE_CHOICES", "LIBRARY_NAMES", "check_request", "check_serve_available"]
