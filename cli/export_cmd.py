"""`rana export DIR --out OUT [--format quantizer|remote-code]`: a folder that loads with plain transformers."""
from __future__ import annotations

import typer

from rana.export.config import ExportConfig

from .common import console
from .common import out as stdout
from .options import settings_command

# how each format loads (rana installed for the quantizer format)
_LOAD_FLAG = {"quantizer": "", "remote-code": ", trust_remote_code=True"}


def register(app: typer.Typer) -> None:
    @settings_command(app, "export", ExportConfig)
    def export(config: ExportConfig) -> None:
        """Export a compressed model as a folder that loads in plain transformers, without rana installed."""
        from transformers.utils import logging as hf_logging

        from rana.export import export_folder

        hf_logging.disable_progress_bar()  # save_pretrained's shard bar; the status line says what runs
        config.validate()  # every option, before the status line (export_folder checks the folders)
        with console.status(f"exporting {config.src}"):
            path = export_folder(config)
        shards = sorted(path.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in shards) / 1e6
        stdout.print(f"wrote {path}/ ({len(shards)} safetensors shard{'s' if len(shards) != 1 else ''}, {size:.1f} MB); "
                     f"load with AutoModelForCausalLM.from_pretrained('{path}'{_LOAD_FLAG[config.format]})",
                     highlight=False, soft_wrap=True)
