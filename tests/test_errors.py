"""One user-error type: a `rana.errors.UserError` (or any subclass) is one line and exit code 2; anything
else, a bare ValueError included, is a bug and keeps its traceback."""
from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from rana.cli.common import friendly
from rana.compress import BudgetError, CalibrationError
from rana.data import DataError
from rana.errors import UserError
from rana.finetune import FinetuneError
from rana.io.models import ModelLoadError

runner = CliRunner()


def _app(exc: BaseException) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @friendly
    def boom() -> None:
        raise exc

    return app


@pytest.mark.parametrize("cls", [UserError, DataError, ModelLoadError, BudgetError, CalibrationError, FinetuneError])
def test_a_user_error_is_one_line_and_exit_code_2(cls, monkeypatch):
    monkeypatch.delenv("RANA_DEBUG", raising=False)
    res = runner.invoke(_app(cls("what is wrong; what to do\nsecond line")), [])
    assert res.exit_code == 2
    assert "what is wrong; what to do" in res.output and "second line" not in res.output
    assert "Traceback" not in res.output


@pytest.mark.parametrize("exc", [ValueError("an internal check"), KeyError("x"), RuntimeError("bug")])
def test_anything_else_is_a_bug_and_keeps_its_traceback(exc):
    res = runner.invoke(_app(exc), [])
    assert res.exit_code == 1 and res.exception is exc


def test_every_user_facing_error_class_is_a_user_error():
    from rana.archs import UnsupportedArchitectureError
    from rana.checks import InputError
    from rana.compress.memory import MemoryBudgetError
    from rana.io import OutputExistsError
    from rana.io.card import RecipeError
    from rana.quantize.run import QuantizeError

    for cls in (UnsupportedArchitectureError, InputError, MemoryBudgetError, OutputExistsError, RecipeError,
                QuantizeError, DataError, ModelLoadError, BudgetError, CalibrationError, FinetuneError):
        assert issubclass(cls, UserError), cls
