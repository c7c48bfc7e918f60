"""`rana export DIR --out OUT [--format quantizer|remote-code]`: a folder that loads with plain transformers."""
from __future__ import annotations

from pathlib import Path

import typer

from .common import console, friendly
from .common import out as stdout


# how each format loads (rana installed for the quantizer format)
_LOAD_FLAG = {"quantizer": "", "remote-code": ", trust_remote_code=True"}


def register(app: typer.Typer) -> None:
    @app.command("export")
    @friendly
    def export(
        src: Path = typer.Argument(..., help="rana folder written by `rana compress` / `rana finetune`"),
        out: Path = typer.Option(..., "--out", "-o", help="output folder (no '.' in its name; must not exist unless --overwrite)"),
        overwrite: bool = typer.Option(False, help="replace an existing --out folder"),
        max_shard_size: str = typer.Option("2GB", "--max-shard-size", help="split the safetensors weights past this size (e.g. 500MB, 2GB)"),
        format: str = typer.Option("quantizer", "--format", help="quantizer: the stock model class with quant_method "
                                   "'rana' (loads wherever rana is installed, no remote code; the remote code ships as "
                                   "the fallback); remote-code: loads with trust_remote_code=True without rana"),
    ) -> None:
        """Export a compressed model as a folder that loads in plain transformers, without rana installed."""
        from transformers.utils import logging as hf_logging

        from rana.checks import check_writable_dir
        from rana.export import export as run

        check_writable_dir(out, "--out")

        hf_logging.disable_progress_bar()  # save_pretrained's shard bar; the status line says what runs
        with console.status(f"exporting {src}"):
            path = run(src, out, overwrite=overwrite, max_shard_size=max_shard_size, format=format)
        shards = sorted(path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in shards) / 1e6
        stdout.print(f"wrote {path}/ ({len(shards)} safetensors shard{'s' if len(shards) != 1 else ''}, {size:.1f} MB); "
                     f"load with AutoModelForCausalLM.from_pretrained('{path}'{_LOAD_FLAG[format]})", highlight=False,
                     soft_wrap=True)
