"""`rana quantize DIR --weights int8 --out DIR2`: int8 weights for an existing rana folder."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import LazyProgress, friendly
from .common import out as stdout


def register(app: typer.Typer) -> None:
    from rana.quantize import DEFAULT_CALIB_TOKENS

    @app.command("quantize")
    @friendly
    def quantize(
        src: Path = typer.Argument(..., help="rana folder written by `rana compress` / `rana finetune`"),
        weights: str = typer.Option(..., "--weights", help="int8: symmetric per-output-channel int8 for every linear "
                                    "of the decoder and the LM head, fp32 scales, thresholds refit on the quantized "
                                    "model's activations"),
        out: Path = typer.Option(..., "--out", "-o", help="output folder (must not exist unless --overwrite)"),
        dataset: Optional[str] = typer.Option(None, help="calibration text: local .txt/.jsonl/.parquet file or folder, or "
                                              "a hub dataset (default: bundled corpus)"),
        calib_tokens: int = typer.Option(DEFAULT_CALIB_TOKENS, "--calib-tokens", help="calibration tokens for the scales "
                                         "and the threshold refit (0: max-abs scales, thresholds kept)"),
        seq_len: Optional[int] = typer.Option(None, "--seq-len", help="calibration window (default: the folder's "
                                              "compression setting, else 512)"),
        batch_size: int = typer.Option(8, "--batch-size", help="windows per calibration forward"),
        seed: int = typer.Option(0),
        overwrite: bool = typer.Option(False, help="replace an existing --out folder"),
    ) -> None:
        """Quantize a rana folder's weights (int8), refitting its thresholds on the quantized model."""
        from rana.checks import check_writable_dir
        from rana.quantize import check_weights, quantize_folder

        check_weights(weights)
        check_writable_dir(out, "--out")
        with LazyProgress(f"quantizing {src}") as progress:
            path, report = quantize_folder(src, out, weights=weights, dataset=dataset, calib_tokens=calib_tokens,
                                           seq_len=seq_len, batch_size=batch_size, seed=seed, overwrite=overwrite,
                                           progress=progress)
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
