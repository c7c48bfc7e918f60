"""`SweepConfig`: what `rana sweep` is asked to do. A sweep is a compression and an evaluation per point,
so its options are the compress and eval settings' own fields, borrowed (`rana.settings.borrowed`:
default, help and spelling from `CompressConfig` / `EvalConfig`; the sweep says only where its help
differs), plus its own: which methods and budgets, the dense row, the figures. `compress_config` and
`eval_config` build the per-point settings from them."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from ..compress import CompressConfig
from ..compress.lm_head import check_lm_head, resolve_lm_head
from ..errors import UserError
from ..evaluation import EvalConfig
from ..evaluation.perplexity import PplProtocol, ppl_preset
from ..methods import METHODS, get_method, names
from ..settings import Settings, borrowed, refuse_empty_text, setting
from .report import DENSE

DEFAULT_METHODS = ("rana", "cats", "svd", "teal")
DEFAULT_FLOPS = (0.85, 0.7, 0.58)


@dataclass
class SweepConfig(Settings):
    model: str = setting(help="dense model: alias (smollm2-135m, …), hub id, local folder or .gguf file", argument=True,
                         required=True)
    out: Path = setting(help="output folder (re-running with it resumes: finished points are skipped)",
                        flags=("--out", "-o"), required=True)
    ppl_data: list[str] = borrowed(EvalConfig, "ppl_data", required=True, help="evaluation text (repeatable): local "
                                   ".txt/.raw/.jsonl/.parquet or hub name[:config[:split]]")
    methods: list[str] = setting(default_factory=lambda: list(DEFAULT_METHODS), cli_type=str,
                                 cli_default=",".join(DEFAULT_METHODS), help=lambda: f"comma list of: dense, {', '.join(names())}")
    flops: list[float] = setting(default_factory=lambda: list(DEFAULT_FLOPS), cli_type=str,
                                 cli_default=",".join(map(str, DEFAULT_FLOPS)),
                                 help="comma list of FLOP budgets (fractions of dense)", above=0, max=1)
    dense: bool = setting(True, "also evaluate the dense model (the baseline row)", flags=("--dense/--no-dense",))
    dataset: str | None = borrowed(CompressConfig, "dataset", help="calibration text: hub dataset or local file/folder "
                                                                    "(default: bundled corpus)")
    dataset_config: str | None = borrowed(CompressConfig, "dataset_config")
    split: str = borrowed(CompressConfig, "split", help="hub dataset split (calibration)")
    text_column: str = borrowed(CompressConfig, "text_column")
    calib_tokens: int = borrowed(CompressConfig, "calib_tokens", help="calibration tokens (computed once, shared by all "
                                                                      "points)")
    eval_tokens: int | None = borrowed(EvalConfig, "eval_tokens", help="cap on the tokens of each evaluation text "
                                                                       "(default: all)")
    ppl_protocol: str = borrowed(EvalConfig, "ppl_protocol", help="perplexity preset: rana (--seq-len windows) | gptq | "
                                                                  "teal (as `rana eval --ppl-protocol`)")
    seq_len: int = borrowed(CompressConfig, "seq_len", help="calibration and perplexity window length")
    batch_size: int = borrowed(CompressConfig, "batch_size")  # calibration forward
    eval_batch_size: int = borrowed(EvalConfig, "batch_size")
    figure_flops: float | None = setting(None, "budget for the per-layer figures (default: the smallest)")
    # tokens of the first text for the rank-contribution histograms
    histogram_tokens: int = setting(2048, cli=False, min=1)
    dtype: str = borrowed(CompressConfig, "dtype")
    device: str = borrowed(CompressConfig, "device", help="compute device (cpu, cuda, …)")
    grid_step: float = borrowed(CompressConfig, "grid_step", help="MLP budget-split grid step")
    allocation: str = borrowed(CompressConfig, "allocation")
    lm_head: str = borrowed(CompressConfig, "lm_head", help="auto (each method's own) | dense | sparse: the LM head "
                                                            "adapted like every projection (as `rana compress --lm-head`)")
    seed: int = borrowed(CompressConfig, "seed")
    save_models: bool = setting(False, "also save each compressed model under OUT/models/", flags=("--save-models",))

    def __post_init__(self) -> None:
        refuse_empty_text(self.out, "--out")  # as a Path, '' would be '.': the current folder
        self.out = Path(self.out)
        methods = [m.strip() for m in self.methods if m.strip()]
        if DENSE in methods:
            self.dense = True
        self.methods = [m for m in dict.fromkeys(methods) if m != DENSE]
        self.flops = [float(f) for f in dict.fromkeys(self.flops)]
        self.ppl_data = [str(p) for p in self.ppl_data]

    @classmethod
    def from_options(cls, options: dict, given: frozenset = frozenset()) -> SweepConfig:
        """The command line gives --methods and --flops as comma lists."""
        options = {**options, "methods": options["methods"].split(","), "flops": _floats(options["flops"])}
        return super().from_options(options, given)

    def validate(self) -> None:
        """Every field's type and range (`Settings.validate`), then what they mean together, then one
        point's compression settings."""
        super().validate()
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise UserError(f"unknown method(s) {', '.join(bad)} (choose from dense, {', '.join(METHODS)})")
        if not self.methods and not self.dense:
            raise UserError("nothing to run: pass --methods (and/or --dense)")
        if self.methods and not self.flops:
            raise UserError("pass at least one --flops budget")
        if not self.ppl_data:
            raise UserError("pass at least one --ppl-data text to evaluate on (never the calibration text)")
        check_lm_head(self.lm_head)
        window = self.eval_protocol().window
        if self.eval_tokens is not None and self.eval_tokens < window:
            raise UserError(f"--eval-tokens ({self.eval_tokens}) must be at least one perplexity window ({window} tokens)")
        if self.figure_flops is not None and self.methods and not any(abs(self.figure_flops - f) < 1e-9 for f in self.flops):
            raise UserError(f"--figure-flops {self.figure_flops} is not one of the --flops budgets")
        self.compress_config(self.methods[0] if self.methods else "rana", self.flops[0] if self.flops else 1.0).validate()

    # ------------------------------------------------------------------ the settings of one point
    def compress_config(self, method: str, flops: float) -> CompressConfig:
        """One point's compression: the borrowed compress settings, this method and budget."""
        return CompressConfig(model=self.model, flops=flops, method=method, **self.borrowed_values(CompressConfig))

    def eval_config(self, texts) -> EvalConfig:
        """How every point is evaluated: on `texts` (the --ppl-data texts, tokenised once and cut to
        --eval-tokens), with the preset's windows, `rana`'s of --seq-len tokens."""
        return EvalConfig(ppl_data=texts, ppl_protocol=self.ppl_protocol,
                          seq_len=self.seq_len if self.ppl_protocol == "rana" else None, batch_size=self.eval_batch_size)

    def eval_protocol(self) -> PplProtocol:
        """The perplexity protocol: `rana` windows are `seq_len` long, the other presets keep their own."""
        return ppl_preset(self.ppl_protocol, self.seq_len if self.ppl_protocol == "rana" else None)

    # ------------------------------------------------------------------ what a stored point must match
    def eval_settings(self) -> dict:
        """What a point's evaluation depends on (a stored point is reused only if these match)."""
        settings = {"model": self.model, "ppl_data": self.ppl_data, "eval_tokens": self.eval_tokens,
                    "seq_len": self.seq_len, "dtype": self.dtype}
        if self.ppl_protocol != "rana":  # points stored before presets existed stay valid for rana
            settings["ppl_protocol"] = self.ppl_protocol
        return settings

    def compress_settings(self, method: str) -> dict:
        """What a point's compression depends on, besides method and budget."""
        settings = {"dataset": self.dataset, "dataset_config": self.dataset_config, "split": self.split,
                    "text_column": self.text_column, "calib_tokens": self.calib_tokens, "grid_step": self.grid_step,
                    "allocation": self.allocation, "seed": self.seed}
        lm_head = resolve_lm_head(self.lm_head, get_method(method).lm_head)
        if lm_head != "dense":  # points stored before --lm-head existed stay valid for a dense head
            settings["lm_head"] = lm_head
        return settings

    def figure_budget(self) -> float | None:
        if self.figure_flops is not None:
            return self.figure_flops
        return min(self.flops) if self.flops else None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["out"] = str(self.out)
        return d


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"--flops takes comma-separated numbers like 0.85,0.7,0.58, got '{text}'") from None


__all__ = ["SweepConfig", "DEFAULT_METHODS", "DEFAULT_FLOPS"]
