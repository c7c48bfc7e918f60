"""`CompressSettings`: what one compression runs with, each option written once, as a field
(`rana.settings.setting`: default, help text, spelling on the command line).

`rana compress`'s options are generated from these fields (plus the command's own `--out`,
`--overwrite` and `--recipe`, which `rana.compress.CompressConfig` adds), in field order, which is
the order folders have always recorded the settings in (a new setting goes last); the fields
made with ``cli=False`` travel only in recipes and library calls. Folders record the settings
(`to_dict`: plan.json's `config`, rana_config.json's `compress_config`, recipe.json), and the recipe's
equivalent command line is built from the same fields (`rana.io.card`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from ..settings import Settings, setting
from .version import FORMAT_VERSION


def _method_help() -> str:
    from ..methods import names  # the registry, current when the command line is built

    return f"{' | '.join(names(ablations=False))} (ablations: {', '.join(names(ablations=True))})"


@dataclass
class CompressSettings(Settings):
    """What one compression was run with, as plan.json (`config`), rana_config.json
    (`compress_config`) and recipe.json record it; `rana.compress.CompressConfig` adds the checks."""

    model: str = setting(help="alias (smollm2-135m, llama2-7b, …), hub id, local folder or .gguf file (may be omitted "
                              "with --recipe)", argument=True, cli_default=None)
    flops: float = setting(0.58, "fraction of the dense model's per-token FLOPs to keep, in (0, 1]", flags=("--flops",))
    method: str = setting("rana", _method_help)
    dataset: str | None = setting(None, "calibration text: hub dataset name or local .txt/.jsonl/.parquet file or "
                                        "folder (default: bundled corpus)")
    dataset_config: str | None = setting(None, "hub dataset config name")
    split: str = setting("train", "hub dataset split")
    text_column: str = setting("text", "text column for json/parquet/hub data")
    calib_tokens: int = setting(32768, "calibration tokens (fit + held-aside slice)")
    seq_len: int = setting(512, "calibration sequence length")
    heldout_fraction: float = setting(0.125, cli=False)  # share of the calibration windows held aside (errors, FLOPs)
    batch_size: int = setting(8, "sequences per calibration forward")
    dtype: str = setting("float32", "float32 | bfloat16 | float16")
    device: str = setting("cpu", "compute device (cpu, cuda, cuda:1, …)")
    offload_device: str = setting("cpu", cli=False)  # where the decoder stack waits between its layers' turns
    grid_step: float = setting(0.125, "MLP budget-split grid step (paper's grid search)")
    fit_sample_tokens: int = setting(1024, cli=False)  # fit tokens sampled for the thresholds' searches
    search_tokens: int = setting(1024, cli=False)  # held-aside tokens the searches measure errors on
    seed: int = setting(0)
    allocation: str = setting("uniform", "FLOP allocation across layers: uniform (paper) | global (by measured "
                                         "sensitivity)")
    max_memory: str | None = setting(None, "cap on the compute device's memory, e.g. 2GB or 80GiB: checked against "
                                           "one layer's need before any work; on a CPU device a bigger checkpoint is "
                                           "streamed from disk", flags=("--max-memory",))
    offload_dir: str | None = setting(None, "stream the decoder layers from the checkpoint's safetensors one at a "
                                            "time; compressed layers and calibration activations are kept here",
                                      flags=("--offload-dir",), cli_type=Path)
    # folders record the resolved value (rana.compress.lm_head), never "auto"; older ones hold "dense"
    lm_head: str = setting("auto", "auto: the method's choice (rana: sparse; the peers as published: dense) | dense: "
                                   "the LM head stays dense and the layers absorb the whole cut | sparse: input sparsity "
                                   "|x_j| ≥ t on the head's input, the same fraction of its MACs as every adapted "
                                   "projection (tied embeddings stay tied)", flags=("--lm-head",))
    weights: str = setting("none", "none: full-precision weights | int8: quantize every linear of the decoder and the "
                                   "LM head last (per-output-channel int8, fp32 scales), thresholds refit on the "
                                   "quantized model", flags=("--weights",))

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, **{f.name: getattr(self, f.name) for f in recorded_fields()}}

    @classmethod
    def from_dict(cls, d: dict):
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def recorded_fields() -> list:
    """The fields of `CompressSettings` in the order folders record them (`to_dict`, and the schema that
    checks a folder's record): field order, which is also the order of `rana compress`'s options."""
    return list(fields(CompressSettings))


__all__ = ["CompressSettings", "recorded_fields"]
