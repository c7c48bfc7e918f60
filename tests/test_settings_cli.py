"""Every command's options are generated from its settings dataclass (`rana.settings`): every field
meant for the command line is an option, every option is a field, with the field's default and help."""
from __future__ import annotations

import dataclasses

import pytest
from typer.main import get_command

from rana.cli.app import app
from rana.settings import cli_fields

COMMANDS = ("compress", "eval", "sweep", "finetune", "export", "quantize")


def _command(name: str):
    return get_command(app).commands[name]


def _settings_class(name: str):
    callback = _command(name).callback
    while not hasattr(callback, "settings_class") and hasattr(callback, "__wrapped__"):
        callback = callback.__wrapped__
    return getattr(callback, "settings_class", None)


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_a_field_and_every_field_an_option(name):
    cls = _settings_class(name)
    assert cls is not None, f"`rana {name}` is not generated from a settings dataclass"
    options = [p.name for p in _command(name).params]
    fields = [f.name for f in cli_fields(cls)]
    assert options == fields


@pytest.mark.parametrize("name", COMMANDS)
def test_each_option_carries_its_fields_default_and_help(name):
    cls = _settings_class(name)
    params = {p.name: p for p in _command(name).params}
    for f in cli_fields(cls):
        p = params[f.name]
        help_text = f.metadata.get("help")
        if callable(help_text):
            help_text = help_text()
        assert getattr(p, "help", None) == help_text, f.name
        if f.metadata.get("required"):
            assert p.required, f.name
        elif f.metadata.get("cli_default", dataclasses.MISSING) is not dataclasses.MISSING:
            assert p.default == f.metadata["cli_default"], f.name
        elif f.default is not dataclasses.MISSING:
            assert p.default == f.default, f.name


def test_a_settings_object_round_trips_the_parsed_options():
    from rana.export.config import ExportConfig

    config = ExportConfig.from_options({"src": "a", "out": "b", "overwrite": True, "max_shard_size": "1GB",
                                        "format": "remote-code"})
    assert (config.src, config.out, config.overwrite, config.format) == ("a", "b", True, "remote-code")
