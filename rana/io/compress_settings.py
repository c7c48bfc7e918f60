"""`CompressSettings`: what one compression runs with, each option written once, as a field
(`rana.settings.setting`: default, help text, spelling on the command line).

`rana compress`'s options are generated from these fields (plus the command's own `--out`,
`--overwrite` and `--recipe`, which `rana.compress.CompressConfig` adds), in field order, which is
the order folders have always recorded the settings in (a new setting goes last); the fields
made with ``cli=False`` travel only in recipes and library calls. Folders record the settings
(`to_dict`: plan.json's `config`, rana_config.json's `compress_config`, recipe.json), and the recipe's
equivalent command line is built from the same fields (`rana.io.card`).

`recipe_settings` checks a recipe read back for `rana compress --recipe`: from this rana or an older
one, each value of its field's type (`rana.settings.check_setting`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from packaging.version import InvalidVersion, Version

from .. import __version__
from ..errors import UserError
from ..settings import MAX_SEED, Settings, check_setting, setting
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
    flops: float = setting(0.58, "fraction of the dense model's per-token FLOPs to keep, in (0, 1]", flags=("--flops",),
                           above=0, max=1)
    method: str = setting("rana", _method_help)
    dataset: str | None = setting(None, "calibration text: hub dataset name or local .txt/.jsonl/.parquet file or "
                                        "folder (default: bundled corpus)")
    dataset_config: str | None = setting(None, "hub dataset config name")
    split: str = setting("train", "hub dataset split")
    text_column: str = setting("text", "text column for json/parquet/hub data")
    calib_tokens: int = setting(32768, "calibration tokens (fit + held-aside slice)", min=1)
    seq_len: int = setting(512, "calibration sequence length", min=8)
    # the share of the calibration windows held aside (errors, FLOPs)
    heldout_fraction: float = setting(0.125, cli=False, above=0, below=1)
    batch_size: int = setting(8, "sequences per calibration forward", min=1)
    dtype: str = setting("float32", "float32 | bfloat16 | float16")
    device: str = setting("cpu", "compute device (cpu, cuda, cuda:1, …)")
    offload_device: str = setting("cpu", cli=False)  # where the decoder stack waits between its layers' turns
    grid_step: float = setting(0.125, "MLP budget-split grid step (paper's grid search)", above=0, max=1)
    fit_sample_tokens: int = setting(1024, cli=False, min=1)  # fit tokens sampled for the thresholds' searches
    search_tokens: int = setting(1024, cli=False, min=1)  # held-aside tokens the searches measure errors on
    seed: int = setting(0, min=0, max=MAX_SEED)
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


def recipe_settings(doc, where: str, recipe_version: int, error: type[UserError]) -> dict:
    """The `CompressSettings` values of a parsed recipe document `doc` (`where`: "recipe PATH", for the
    messages), checked before any is used; one `error` (rana.io.card's RecipeError) otherwise: written by
    this rana or an older one (`recipe_version`: the newest recipe format this rana reads), for `rana
    compress`, no unknown setting (a typo in a hand-written recipe is not ignored), each value of its
    field's type and never an empty text (`rana.settings.check_setting`). Ranges are checked by `validate`
    once the command line's options are merged in (they may override a value)."""
    if not isinstance(doc, dict):
        raise error(f"{where} must hold a JSON object")
    settings = doc.get("config", doc)
    if not isinstance(settings, dict):
        raise error(f"{where}: 'config' must be an object")
    _refuse_newer(doc, settings, where, recipe_version, error)
    if doc.get("command", "compress") != "compress":
        raise error(f"{where} is for `rana {doc['command']}`, not `rana compress`")
    known = {f.name: f for f in fields(CompressSettings)}
    ignored = {"rana_recipe", "command", "rana_version", "equivalent_command", "format_version"}
    unknown = sorted(set(settings) - set(known) - ignored)
    if unknown:
        raise error(f"{where} has unknown setting(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    for name, value in settings.items():
        if name in known:
            check_setting(CompressSettings, known[name], value, f"{where}: '{name}'", ranges=False, error=error)
    return {k: v for k, v in settings.items() if k in known}


def _refuse_newer(doc: dict, settings: dict, where: str, recipe_version: int, error: type) -> None:
    """An `error` (rana.io.card's RecipeError) when the recipe `doc` (its `settings`) comes from a newer rana
    than this one: a newer recipe format (``rana_recipe``), settings format (``format_version``) or rana
    version (``rana_version``), whose settings this rana may read differently or not know at all. A recipe
    without them (written by hand) is taken as this rana's."""
    for record, key, newest in ((doc, "rana_recipe", recipe_version), (settings, "format_version", FORMAT_VERSION)):
        version = record.get(key, newest)
        if not isinstance(version, int) or isinstance(version, bool):
            raise error(f"{where}: '{key}' must be an integer, got {version!r}")
        if version > newest:
            raise error(f"{where} was written by a newer rana ('{key}' {version}; rana {__version__} reads up to "
                        f"{newest}): upgrade rana to re-run it")
    written_by = doc.get("rana_version")
    if written_by is None:
        return
    try:
        newer = Version(str(written_by)) > Version(__version__)
    except InvalidVersion:
        raise error(f"{where}: 'rana_version' {written_by!r} is not a version number") from None
    if newer:
        raise error(f"{where} was written by rana {written_by}, newer than this rana {__version__}: upgrade rana to "
                    "re-run it")


def recorded_fields() -> list:
    """The fields of `CompressSettings` in the order folders record them (`to_dict`, and the schema that
    checks a folder's record): field order, which is also the order of `rana compress`'s options."""
    return list(fields(CompressSettings))


__all__ = ["CompressSettings", "recorded_fields", "recipe_settings"]
