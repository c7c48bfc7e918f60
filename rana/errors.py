"""The one exception type for "the input is wrong": `UserError`.

A command reports a `UserError` (or any subclass: `DataError`, `ModelLoadError`, `BudgetError`, …) as
one line and a non-zero exit, without a traceback; anything else that escapes is a bug and keeps its
traceback (`rana.cli.common.friendly`). It subclasses `ValueError` so that library callers that
caught the older `ValueError`s keep working. A leaf: imports nothing of rana.
"""
from __future__ import annotations


class UserError(ValueError):
    """A request that cannot run as given: the message says what is wrong and what to do instead."""


__all__ = ["UserError"]
