"""`rana quantize DIR --weights int8 --out DIR2`: int8 weights for an existing rana folder."""
from __future__ import annotations

from pathlib import Path

import typer

from rana.quantize.config import QuantizeConfig

from .common import LazyProgress
from .common import out as stdout
from .options import settings_command


def register(app: typer.Typer) -> None:
    @settings_command(app, "quantize", QuantizeConfig)
    def quantize(config: QuantizeConfig) -> None:
        """Quantize a rana folder's weights (int8), refitting its thresholds on the quantized model."""
        from rana.quantize import quantize_folder

        config.validate()  # every option first, as every command checks its own (quantize_folder checks again)
        with LazyProgress(f"quantizing {config.src}") as progress:
            path, report = quantize_folder(config, progress=progress)  # checks everything before loading
        errors = [m["relative_error"] for m in report["modules"]]
        size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) / 1e6
        refit = report.get("refit") or {}
        worst = max((abs(r["fraction_after"] - r["fraction_before"]) for r in refit.values()
                     if r.get("fraction_after") is not None), default=0.0)
        stdout.print(f"wrote {path}/ ({size:.1f} MB): {len(errors)} int8 modules, relative output error mean "
                     f"{sum(errors) / max(len(errors), 1):.2e}, max {max(errors, default=0.0):.2e}"
                     + (f"; {len(refit)} thresholds refit on {report['calibration_tokens']} tokens (active fraction "
                        f"within {worst:.4f} of before)" if refit else "; thresholds kept (no calibration)")
                     + ("; the LM head was untied from the input embedding" if report.get("untied_head") else ""),
                     highlight=False, soft_wrap=True)
