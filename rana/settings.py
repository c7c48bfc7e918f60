"""Settings objects: one dataclass per command, each option written once, as a field.

A field made with `setting(...)` carries its default, its help text, how the command line spells
it and which values it takes; `rana.cli.options` generates the command's options from the fields, so
an option lives in its dataclass and nowhere else (as llm-compressor's argument dataclasses and
mlx-lm's CONFIG_DEFAULTS do). A leaf: imports nothing of rana but `rana.errors`.

What `setting` records in the field's metadata:

* ``help``: the option's help text (None: no help, as for ``--seed``);
* ``flags``: the option's spellings when they are not the field name's (``("--out", "-o")``,
  ``("--eval-at-start/--no-eval-at-start",)``, ``("--latency",)`` for a bare flag);
* ``argument``: a positional argument instead of an option;
* ``required``: the command line must give it (a field may still default to None for library callers);
* ``cli``: False for a setting only library callers set (e.g. compress's ``heldout_fraction``);
* ``cli_type``: what the command line parses when it is not the field's type (``Path`` for a path
  kept as ``str``, ``str`` for a comma list the dataclass splits);
* ``cli_default``: the default the command line shows when it is not the field's (``"2M"`` tokens);
* ``range``: the numbers it takes (`Range`, from ``min=`` / ``max=``, inclusive, and ``above=`` /
  ``below=``, exclusive), checked for a number and for each number of a list.

`Settings.validate` checks every field against its annotation and its range (`check_setting`), whatever
built the object (the command line, a recipe, a library call): an ``int`` is an int (not a bool, a
float or a string), a ``float`` a finite number, a text or path is not empty (an empty path would
mean the current folder), a list holds what its annotation says. A subclass adds, after it, what
no single field can say (choices, one field against another).

A command made of other commands' settings (the sweep: a compression and an evaluation per point)
takes their fields with `borrowed`: default, help, spellings and range come from the owner's field, so
none of them is defined twice; the borrowing class changes only what its command line says differently.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import types
import typing
from dataclasses import MISSING, Field
from pathlib import Path, PurePath
from typing import Any, NamedTuple

from .errors import UserError

# numpy's seed range, the narrowest of what rana seeds (accelerate's `set_seed` seeds numpy as well as
# torch, whose generators take any 64-bit value)
MAX_SEED = 2**32 - 1


class Range(NamedTuple):
    """The numbers a setting takes: `low` / `high` bounds (None: unbounded), each inclusive unless `open`."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, x: float) -> bool:
        if self.low is not None and (x <= self.low if self.low_open else x < self.low):
            return False
        return self.high is None or (x < self.high if self.high_open else x <= self.high)

    def describe(self, integer: bool) -> str:
        """What "must be …" says: "a positive integer", "≥ 0", "at least 8", "in (0, 1]"."""
        low, high = self.low, self.high
        if high is None:
            if low == 0:
                return "positive" if self.low_open else "≥ 0"
            if low == 1 and integer and not self.low_open:
                return "a positive integer"
            return f"greater than {low}" if self.low_open else f"at least {low}"
        if low is None:
            return f"below {high}" if self.high_open else f"at most {high}"
        return f"in {'(' if self.low_open else '['}{low}, {high}{')' if self.high_open else ']'}"


def setting(default: Any = MISSING, help: str | None = None, *, default_factory: Any = MISSING, flags: tuple = (),
            argument: bool = False, required: bool = False, cli: bool = True, cli_type: Any = None,
            cli_default: Any = MISSING, min: float | None = None, max: float | None = None,
            above: float | None = None, below: float | None = None) -> Any:
    """A dataclass field with its command-line description and the numbers it takes (see the module
    docstring): ``min`` / ``max`` inclusive, ``above`` / ``below`` exclusive."""
    metadata = {"help": help, "flags": tuple(flags), "argument": argument, "required": required, "cli": cli,
                "cli_type": cli_type, "cli_default": cli_default, "range": _range(min, max, above, below)}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def _range(min: float | None, max: float | None, above: float | None, below: float | None) -> Range | None:
    if min is not None and above is not None or max is not None and below is not None:
        raise TypeError("a setting has one lower bound (min= or above=) and one upper bound (max= or below=)")
    if (min, max, above, below) == (None, None, None, None):
        return None
    return Range(min if above is None else above, max if below is None else below, above is not None,
                 below is not None)


def borrowed(owner: type, name: str, **changes: Any) -> Any:
    """Field `name` of settings class `owner`, taken whole (default, help text, spellings, range), with
    `changes` to its command-line description (e.g. ``help=``: what the borrowing command does with it).
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


def setting_name(f: Field) -> str:
    """How a message names field `f`: its option, or, for a setting only library callers set, its name."""
    return option_name(f) if f.metadata.get("cli", True) else f"'{f.name}'"


# --------------------------------------------------------------------------- checking one value


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The annotations of settings class `cls`, evaluated (its modules use postponed annotations)."""
    return typing.get_type_hints(cls)


def check_setting(cls: type, f: Field, value: Any, name: str | None = None, *, ranges: bool = True,
                  error: type[UserError] | None = None) -> None:
    """One `error` (default: the class's, `Settings.error`) naming `name` (default: the option) when `value`
    is not what field `f` of settings class `cls` holds: of its annotation's type, never an empty text, a
    finite number within its range (`ranges` False: the type only, as for a recipe's values, which the
    command line may override)."""
    name, error = name or setting_name(f), error or getattr(cls, "error", UserError)
    refuse_empty_text(value, name, error)
    hint = field_types(cls)[f.name]
    if value is None and (f.default is None or _optional(hint)):
        return
    problem = _type_problem(hint, value)
    if problem:
        what, got = problem
        raise error(f"{name} must be {what}, got {got!r}")
    limits = f.metadata.get("range")
    if ranges and limits is not None:
        for x in value if isinstance(value, (list, tuple)) else (value,):
            if x not in limits:
                raise error(f"{name} must be {limits.describe(integer=_kind(hint) is int)}, got {x}")


def refuse_empty_text(value: Any, name: str, error: type[UserError] = UserError) -> None:
    """A text, or a text in a list, that is empty or blank: never a value a setting means (an empty path
    is the current folder, which `--dataset ''` would read whole, `--offload-dir ''` fill)."""
    for item in value if isinstance(value, (list, tuple)) else (value,):
        if isinstance(item, str) and not item.strip():
            raise error(f"{name} is empty ({item!r}): pass a value (for a path, '.' names the current folder)")


def _optional(hint: Any) -> bool:
    return hint is Any or type(None) in typing.get_args(hint)


def _kind(hint: Any) -> Any:
    """The one type of number or text a hint holds (Optional stripped, a list's element), or None when it
    holds several."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return _kind(args[0]) if len(args) == 1 else None
    if typing.get_origin(hint) is list:
        return _kind(args[0]) if args else None
    return hint


def _type_problem(hint: Any, value: Any) -> tuple[str, Any] | None:
    """None when `value` is of type `hint`; else what it must be ("an integer", "a list", …) and the value
    that is not (an element, for a list)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        problems = [_type_problem(a, value) for a in options]
        return None if any(p is None for p in problems) else (" or ".join(p[0] for p in problems), value)
    if origin is list:
        if not isinstance(value, (list, tuple)):
            return "a list", value
        (element,) = typing.get_args(hint) or (Any,)
        return next(filter(None, (_type_problem(element, v) for v in value)), None)
    what = _what_is_not(hint, value)
    return None if what is None else (what, value)


def _what_is_not(hint: Any, value: Any) -> str | None:
    """What `value` must be to be a `hint` (bool, int, float, str, Path), or None when it is (or when the
    hint says nothing a value can be checked against: Any, tuple, …)."""
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:  # numpy's and torch's sizes too; never a bool, whatever Python says
        return None if isinstance(value, numbers.Integral) and not isinstance(value, bool) else "an integer"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return "a number"
        return None if math.isfinite(value) else "a finite number"
    if hint is str or hint is Path:
        return None if isinstance(value, (str, os.PathLike)) else ("a path" if hint is Path else "text")
    return None  # Any, tuple, …: what the class's own checks look at


# --------------------------------------------------------------------------- the base class


class Settings:
    """Base of the per-command settings dataclasses: built from the parsed command line by `from_options`,
    checked by `validate` (one `rana.errors.UserError` per problem) before any work starts."""

    error: type[UserError] = UserError  # what its checks raise: a command's own UserError subclass where it has one

    @classmethod
    def from_options(cls, options: dict, given: frozenset = frozenset()):
        """The settings for the values the command line parsed (`given`: the names typed on it, which a
        subclass may let override a file of settings, as compress's --recipe). Paths become strings
        where the field keeps a string."""
        names = {f.name: f for f in dataclasses.fields(cls)}
        return cls(**{k: _plain(v, names[k]) for k, v in options.items() if k in names})

    @classmethod
    def refuse_empty_options(cls, options: dict) -> None:
        """An empty text given for any field (`refuse_empty_text`): what the command line checks before it
        makes a `Path` of a value (`Path('')` is '.', the current folder, no longer empty)."""
        for f in dataclasses.fields(cls):
            if f.name in options:
                refuse_empty_text(options[f.name], setting_name(f), cls.error)

    def validate(self) -> None:
        """Every field against its annotation and range (`check_setting`), in field order: one UserError
        naming the option. A subclass checks what fields alone cannot say after calling this."""
        for f in dataclasses.fields(self):
            check_setting(type(self), f, getattr(self, f.name))

    def borrowed_values(self, owner: type) -> dict:
        """The values of the fields borrowed from `owner` (`borrowed`), by the owner's field names."""
        return {f.metadata["borrowed"][1]: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.metadata.get("borrowed", (None,))[0] is owner}


def _plain(value: Any, f: Field) -> Any:
    if isinstance(value, PurePath) and "Path" not in str(f.type):
        return str(value)
    return value


__all__ = ["setting", "borrowed", "cli_fields", "option_name", "setting_name", "check_setting", "refuse_empty_text",
           "field_types", "Range", "MAX_SEED", "Settings"]
