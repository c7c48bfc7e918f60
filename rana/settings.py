"""Settings objects: one dataclass per command, each option written once, as a field.

A field made with `setting(...)` carries its default, its help text and how the command line spells
it; `rana.cli.options` generates the command's options from the fields, so an option lives in its
dataclass and nowhere else (as llm-compressor's argument dataclasses and mlx-lm's CONFIG_DEFAULTS do).
A leaf: imports nothing of rana.

What `setting` records in the field's metadata:

* ``help``: the option's help text (None: no help, as for ``--seed``);
* ``flags``: the option's spellings when they are not the field name's (``("--out", "-o")``,
  ``("--eval-at-start/--no-eval-at-start",)``, ``("--latency",)`` for a bare flag);
* ``argument``: a positional argument instead of an option;
* ``required``: the command line must give it (a field may still default to None for library callers);
* ``cli``: False for a setting only library callers set (e.g. compress's ``heldout_fraction``);
* ``cli_type``: what the command line parses when it is not the field's type (``Path`` for a path
  kept as ``str``, ``str`` for a comma list the dataclass splits);
* ``cli_default``: the default the command line shows when it is not the field's (``"2M"`` tokens).

A command made of other commands' settings (the sweep: a compression and an evaluation per point)
takes their fields with `borrowed`: default, help and spellings come from the owner's field, so none of
them is defined twice; the borrowing class changes only what its command line says differently.
"""
from __future__ import annotations

import dataclasses
from dataclasses import MISSING, Field
from pathlib import PurePath
from typing import Any


def setting(default: Any = MISSING, help: str | None = None, *, default_factory: Any = MISSING, flags: tuple = (),
            argument: bool = False, required: bool = False, cli: bool = True, cli_type: Any = None,
            cli_default: Any = MISSING) -> Any:
    """A dataclass field with its command-line description (see the module docstring)."""
    metadata = {"help": help, "flags": tuple(flags), "argument": argument, "required": required, "cli": cli,
                "cli_type": cli_type, "cli_default": cli_default}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def borrowed(owner: type, name: str, **changes: Any) -> Any:
    """Field `name` of settings class `owner`, taken whole (default, help text, spellings), with `changes` to
    its command-line description (e.g. ``help=``: what the borrowing command does with it).
    `Settings.borrowed_values(owner)` gives the values to build an `owner` from."""
    source = {f.name: f for f in dataclasses.fields(owner)}[name]
    metadata = {**source.metadata, **changes, "borrowed": (owner, name)}
    return dataclasses.field(default=source.default, default_factory=source.default_factory, metadata=metadata)


def cli_fields(cls) -> list[Field]:
    """The fields of settings class `cls` that are command-line options or arguments, in field order."""
    return [f for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def option_name(f: Field) -> str:
    """How the command line spells field `f` (its first long flag, else --name-with-dashes; arguments by name)."""
    if f.metadata.get("argument"):
        return f.name.upper()
    for flag in f.metadata.get("flags", ()):
        if flag.startswith("--"):
            return flag.split("/")[0]
    return "--" + f.name.replace("_", "-")


class Settings:
    """Base of the per-command settings dataclasses: built from the parsed command line by `from_options`,
    checked by `validate` (one `rana.errors.UserError` per problem) before any work starts."""

    @classmethod
    def from_options(cls, options: dict, given: frozenset = frozenset()):
        """The settings for the values the command line parsed (`given`: the names typed on it, which a
        subclass may let override a file of settings, as compress's --recipe). Paths become strings
        where the field keeps a string."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        return cls(**{k: _plain(v, names[k]) for k, v in options.items() if k in names})

    def validate(self) -> None:
        """Check every setting (one UserError naming the option); the base has nothing to check."""

    def borrowed_values(self, owner: type) -> dict:
        """The values of the fields borrowed from `owner` (`borrowed`), by the owner's field names."""
        return {f.metadata["borrowed"][1]: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("borrowed", (None,))[0] is owner}


def _plain(value: Any, f: Field) -> Any:
    if isinstance(value, PurePath) and "Path" not in str(f.type):
        return str(value)
    return value


__all__ = ["setting", "borrowed", "cli_fields", "option_name", "Settings"]
