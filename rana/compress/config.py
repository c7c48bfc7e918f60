"""`CompressConfig`: what `rana compress` is asked to do: the settings folders record
(`rana.io.compress_settings.CompressSettings`) plus the command's own `--out`, `--overwrite` and
`--recipe`, which are never recorded. `validate` checks every value before any work;
`from_options` builds it from the command line, merged into a recipe when `--recipe` names one."""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

from ..checks import check_device
from ..errors import UserError
from ..io.card import RECIPE, RECIPE_VERSION, RecipeError
from ..io.compress_settings import CompressSettings, recipe_settings
from ..io.jsonfile import read_json
from ..io.format import WEIGHT_FORMATS
from ..io.paths import OutputExistsError
from ..settings import refuse_empty_text, setting
from ..units import parse_memory

from ..methods import METHODS  # the registry names, current when read
from ..methods.base import get_method, renamed_hint
from .lm_head import check_lm_head, resolve_lm_head


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
    """The settings of one compression (`CompressSettings`: what folders and recipes record) and where
    its folder goes; checked by `validate`, then by `rana.compress.preflight`, before any work."""

    out: Path | None = setting(None, "output folder (must not exist unless --overwrite)", flags=("--out", "-o"),
                               required=True)
    overwrite: bool = setting(False, "replace an existing --out folder")
    recipe: Path | None = setting(None, "re-run a recipe.json (or the folder holding one) written with every "
                                        "compressed model; options given here override its values", flags=("--recipe",))

    @classmethod
    def from_options(cls, options: dict, given: frozenset = frozenset()) -> CompressConfig:
        """The config the command line asks for: without --recipe the options as parsed; with one, the
        recipe's values overridden by the options actually typed (`given`). An existing --out is reported
        first, before the recipe is read."""
        refuse_existing_out(options.get("out"), options.get("overwrite", False))
        recipe = options.get("recipe")
        if recipe is None:
            if options.get("model") is None:
                raise UserError("missing MODEL: pass a model (alias, hub id, folder or .gguf) or --recipe FILE")
            return super().from_options(options, given)
        own = {k: options[k] for k in ("out", "overwrite", "recipe") if k in options}
        settings = {**own, **read_recipe(recipe), **{k: v for k, v in options.items() if k in given}}
        if not settings.get("model"):
            raise UserError(f"recipe {recipe} names no model: pass MODEL")
        return super().from_options(settings, given)

    def resolved(self) -> CompressConfig:
        """This config with "auto" settings replaced by the method's own choices (validate first):
        what runs, and what plan.json, the folder and the recipe record."""
        return replace(self, lm_head=resolve_lm_head(self.lm_head, get_method(self.method).lm_head))

    def validate(self) -> None:
        """One UserError naming the option for the first value that cannot work: each field's type and
        range (`Settings.validate`), then what they mean together."""
        super().validate()
        if self.method not in METHODS:
            hint = renamed_hint(self.method)
            raise UserError(f"unknown method '{self.method}' ({f'{hint}; ' if hint else ''}choose from {', '.join(METHODS)})")
        if self.allocation not in ("uniform", "global"):
            raise UserError(f"unknown allocation '{self.allocation}' (choose uniform or global)")
        check_lm_head(self.lm_head)
        parse_memory(self.max_memory)  # refuses what is not a memory size (rana.compress.Resources keeps the bytes)
        if self.calib_tokens < 2 * self.seq_len:
            raise UserError(f"--calib-tokens ({self.calib_tokens}) must be at least two sequences (2 × --seq-len = {2 * self.seq_len})")
        n_seq = self.calib_tokens // self.seq_len
        fit_tokens = (n_seq - max(1, round(n_seq * self.heldout_fraction))) * self.seq_len
        if fit_tokens < MIN_FIT_TOKENS:
            raise UserError(f"--calib-tokens {self.calib_tokens} leaves {fit_tokens} tokens to fit thresholds on (after the "
                            f"held-aside slice), too few for stable statistics: pass --calib-tokens "
                            f"{min_calib_tokens(self.seq_len, self.heldout_fraction)} or more")
        if self.calib_tokens > MAX_CALIB_TOKENS:
            raise UserError(f"--calib-tokens {self.calib_tokens} is beyond any useful calibration set (at most "
                            f"{MAX_CALIB_TOKENS:,}; the paper uses about 32k)")
        check_device(self.device)
        check_device(self.offload_device)
        if self.weights not in WEIGHT_FORMATS:
            raise UserError(f"unknown --weights '{self.weights}' (choose {' or '.join(WEIGHT_FORMATS)})")
        if self.weights == "int8" and self.offload_dir:
            raise UserError("--weights int8 does not work with layers streamed from disk (--offload-dir); compress "
                            "in memory, or compress first and run `rana quantize` on the folder")


def read_recipe(path: str | os.PathLike) -> dict:
    """The settings of recipe file `path` (or of the recipe.json in the rana folder / export `path`), read
    with a size and depth bound (`rana.io.jsonfile`: 100,000 nested brackets are one line, not a
    RecursionError) and checked by `recipe_settings`: from this rana or an older one, each value of its
    setting's type."""
    path = Path(os.path.expanduser(str(path)))
    if path.is_dir():
        path = path / RECIPE
    if not path.is_file():
        raise RecipeError(f"recipe not found: {path} (pass a recipe.json or a folder written by `rana compress`)")
    return recipe_settings(read_json(path, f"recipe {path}"), f"recipe {path}", RECIPE_VERSION, RecipeError)


def refuse_existing_out(out, overwrite: bool) -> None:
    """An existing --out without --overwrite: the first thing `rana compress` reports (check_output then
    looks closer: overlaps with the inputs, and what --overwrite may replace). An empty --out is no
    folder: '' would be the current one, which exists."""
    refuse_empty_text(out, "--out")
    if out is not None and Path(out).exists() and not overwrite:
        raise OutputExistsError(f"output folder '{out}' already exists; choose another --out or pass --overwrite")


__all__ = ["CompressConfig", "METHODS", "MIN_FIT_TOKENS", "MAX_CALIB_TOKENS", "min_calib_tokens", "read_recipe",
           "refuse_existing_out"]
