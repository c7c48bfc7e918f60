"""A command's options, generated from its settings dataclass (`rana.settings`).

`settings_command(app, "export", ExportConfig)` registers the decorated ``body(config)`` as ``rana
export``: every field of ``ExportConfig`` made with `rana.settings.setting` becomes a Typer option (or
argument) with the field's default, help text and spellings, and the parsed values are handed to the
body as one ``ExportConfig``. A command module holds no option of its own: it prints.

Paths are parsed as text and refused when empty, as every option's empty text is, before they become
`Path`s (``Path('')`` is '.', the current folder: `--offload-dir ''` would fill it); every other check
of a value is its field's (`rana.settings.Settings.validate`).
"""
from __future__ import annotations

import inspect
import typing
from dataclasses import MISSING, Field
from pathlib import Path
from typing import Callable

import typer

from rana.settings import cli_fields

from .common import friendly

# where a value came from, by name: typer may ship its own copy of click's ParameterSource enum
_TYPED = ("COMMANDLINE", "ENVIRONMENT", "PROMPT")


def _default(f: Field):
    m = f.metadata
    if m.get("required"):
        return ...
    if m.get("cli_default", MISSING) is not MISSING:
        return m["cli_default"]
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return ...


def parameter(f: Field, hints: dict) -> inspect.Parameter:
    """The Typer parameter of one settings field."""
    m = f.metadata
    help_text = m.get("help")
    if callable(help_text):  # computed when the CLI is built (e.g. the method names of the registry)
        help_text = help_text()
    annotation = m.get("cli_type") or hints[f.name]
    # a path is parsed as text, made a Path by the command once an empty one is refused: as a Path, '' would
    # already be '.', the current folder
    as_text = {"path_type": str} if _is_path(annotation) else {}
    if m.get("argument"):
        info = typer.Argument(_default(f), help=help_text, **as_text)
    else:
        info = typer.Option(_default(f), *m.get("flags", ()), help=help_text, **as_text)
    return inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info, annotation=annotation)


def _is_path(annotation) -> bool:
    return annotation is Path or Path in typing.get_args(annotation)


def settings_command(app: typer.Typer, name: str, settings_cls: type) -> Callable:
    """Register ``body(config: settings_cls)`` as the command `name`, its options generated from the fields."""
    hints = typing.get_type_hints(settings_cls)
    params = [parameter(f, hints) for f in cli_fields(settings_cls)]
    paths = {p.name for p in params if _is_path(p.annotation)}

    def decorate(body: Callable) -> Callable:
        def command(ctx: typer.Context, **options):
            given = frozenset(k for k in options if getattr(ctx.get_parameter_source(k), "name", None) in _TYPED)
            settings_cls.refuse_empty_options(options)  # `--dataset ''`, `--out ''`: never the current folder
            options = {k: Path(v) if k in paths and isinstance(v, str) else v for k, v in options.items()}
            return body(settings_cls.from_options(options, given))

        ctx = inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)
        command.__signature__ = inspect.Signature([ctx, *params], return_annotation=None)
        command.__annotations__ = {"ctx": typer.Context, **{p.name: p.annotation for p in params}, "return": None}
        command.__name__, command.__qualname__, command.__doc__ = body.__name__, body.__qualname__, body.__doc__
        command.settings_class = settings_cls  # what tests/test_settings_cli.py holds the options against
        app.command(name)(friendly(command))
        return body

    return decorate


__all__ = ["settings_command", "parameter"]
