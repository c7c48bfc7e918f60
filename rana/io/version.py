"""`FORMAT_VERSION`: the version of the rana folder format, stamped on `rana_config.json` and on every
recorded set of compress settings. A module of its own so that `format` (the folder) and
`compress_settings` (the settings it records) both read it without importing each other."""
from __future__ import annotations

FORMAT_VERSION = 1

__all__ = ["FORMAT_VERSION"]
