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
    """Exception types that mean "the input is wrong", reported without a traceback: rana's own
    `UserError` (every user-facing error class derives from it) and a missing file. Anything else, a bare
    `ValueError` included, is a bug and keeps its traceback."""
    from rana.errors import UserError

    return (UserError, FileNotFoundError)


# OSErrors about a path the user named (permissions, read-only file systems, a file where a folder
# should be): one line, like any other user error.
_FILE_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG,
                errno.EDQUOT, errno.ELOOP}


def _disk_full(e: BaseException) -> bool:
    """A write that failed because the device is full, where a library (safetensors) hid the OSError."""
    return "No space left on device" in str(e) or "os error 28" in str(e)


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
            if e.errno in _FILE_ERRNOS and not os.environ.get("RANA_DEBUG"):
                fail(f"{e.strerror or e}: '{e.filename}'; check the path and its permissions" if e.filename else str(e))
            raise
        except user_errors() as e:
            if os.environ.get("RANA_DEBUG"):
                raise
            fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
        except Exception as e:
            if _disk_full(e) and not os.environ.get("RANA_DEBUG"):  # safetensors / torch.save wrap ENOSPC
                fail("no space left on device while writing the weights; free some space or choose another --out; "
                     "nothing was left half-written")
            raise

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


def print_wide(console, renderable) -> None:
    """Tables are wide: in a terminal fit it, elsewhere (logs, pipes) do not squeeze to 80 columns."""
    if console.is_terminal:
        console.print(renderable)
        return
    old = console.width
    console.width = max(old, 220)
    try:
        console.print(renderable)
    finally:
        console.width = old


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
