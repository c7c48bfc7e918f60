"""`ExportConfig`: what `rana export` is asked to do, each option written once (`rana.settings`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..settings import Settings, setting
from ..units import parse_file_size

FORMATS = ("quantizer", "remote-code")  # the first is the default


@dataclass
class ExportConfig(Settings):
    src: Path = setting(help="rana folder written by `rana compress` / `rana finetune`", argument=True, required=True)
    out: Path = setting(None, "output folder (no '.' in its name; must not exist unless --overwrite)",
                        flags=("--out", "-o"), required=True)
    overwrite: bool = setting(False, "replace an existing --out folder")
    # text as the command line gives it ("2GB"), or bytes from a library caller: either goes to the writer as is
    max_shard_size: str | int = setting("2GB", "split the safetensors weights past this size (e.g. 500MB, 2GB)",
                                        flags=("--max-shard-size",), cli_type=str)
    format: str = setting(FORMATS[0], "quantizer: the stock model class with quant_method 'rana' (loads wherever "
                          "rana is installed, no remote code; the remote code ships as the fallback); remote-code: "
                          "loads with trust_remote_code=True without rana", flags=("--format",))

    def validate(self) -> None:
        """Every field's type (`Settings.validate`), then the shard size: a positive size in the units the
        safetensors writer reads (KB, MB, GB, TB), or a positive number of bytes."""
        super().validate()
        parse_file_size(self.max_shard_size, "--max-shard-size")


__all__ = ["ExportConfig", "FORMATS"]
