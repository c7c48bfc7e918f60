"""A command's options, generated from its settings dataclass (`rana.settings`).

`settings_command(app, "export", ExportConfig)` registers the decorated ``body(config)`` as ``rana
export``: every field of ``ExportConfig`` made with `rana.settings.setting` becomes a Typer option (or
argument) with the field's default, help text and spellings, and the parsed values are handed to the
body as one ``ExportConfig``. A command module holds no option of its own: it prints.
"""
from __future__ import annotations

import inspect
import typing
from dataclasses import MISSING, Field
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
    if m.get("argument"):
        info = typer.Argument(_default(f), help=help_text)
    else:
        info = typer.Option(_default(f), *m.get("flags", ()), help=help_text)
    annotation = m.get("cli_type") or hints[f.name]
    return inspect.Parameter(f.name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=info, annotation=annotation)


def settings_command(app: typer.Typer, name: str, settings_cls: type) -> Callable:
    """Register ``body(config: settings_cls)`` as the command `name`, its options generated from the fields."""
    hints = typing.get_type_hints(settings_cls)
    params = [parameter(f, hints) for f in cli_fields(settings_cls)]

    def decorate(body: Callable) -> Callable:
        def command(ctx: typer.Context, **options):
            given = frozenset(k for k in options if getattr(ctx.get_parameter_source(k), "name", None) in _TYPED)
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
