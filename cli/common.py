"""What every command shares: one-line errors for user mistakes, rich console, JSON output."""
from __future__ import annotations

import errno
import functools
import os
import sys
from typing import Callable

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

console = Console(stderr=True)
out = Console()


def user_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the input is wrong", reported without a traceback."""
    from rana.archs import UnsupportedArchitectureError
    from rana.calibrate import CalibrationError
    from rana.compress import BudgetError
    from rana.data import DataError
    from rana.io import OutputExistsError
    from rana.loading import ModelLoadError

    return (UnsupportedArchitectureError, CalibrationError, BudgetError, DataError, OutputExistsError, ModelLoadError,
            ValueError, FileNotFoundError)


def fail(message: str, code: int = 2) -> None:
    console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def friendly(fn: Callable) -> Callable:
    """Turn user errors into one clear line and a non-zero exit; keep tracebacks for bugs
    (set RANA_DEBUG=1 to see them for user errors too)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except KeyboardInterrupt:
            fail("interrupted; nothing was written", 130)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                fail(f"no space left on device while writing ({e.filename or 'output'}); free some space or choose "
                     "another --out; nothing was left half-written")
            if isinstance(e, FileNotFoundError):
                fail(str(e))
            raise
        except user_errors() as e:
            if os.environ.get("RANA_DEBUG"):
                raise
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)

    return wrapper


class LazyProgress:
    """A rich progress bar that appears on the first report, so errors raised before any
    work starts print as one clean line. Call it as `progress(what, done, total)`."""

    def __init__(self, description: str):
        self.description = description
        self._bar: Progress | None = None
        self._tasks: dict[str, int] = {}

    def __enter__(self) -> "LazyProgress":
        return self

    def __call__(self, what: str, done: int, total: int | None) -> None:
        if self._bar is None:
            self._bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console)
            self._bar.start()
        if what not in self._tasks:
            self._tasks[what] = self._bar.add_task(f"{self.description}: {what}", total=total)
        self._bar.update(self._tasks[what], completed=done, total=total)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()


def setup_environment() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not sys.warnoptions:
        import warnings

        warnings.filterwarnings("ignore")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except Exception:  # pragma: no cover
        pass
