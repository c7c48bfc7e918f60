"""`CompressJob`: a compression that passed its pre-flight (`preflight`): everything checked, and
the resources decided, before any weight is read or any calibration text tokenized (`rana compress`
runs it before its progress bar; `rana.compress.compress` runs it itself when handed a bare config)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..checks import check_inputs
from ..io.models import model_inputs, resolve
from ..io.paths import check_output, check_work_dir, local_inputs
from .config import CompressConfig, refuse_existing_out
from .resources import Resources, decide_resources, setup_distributed


@dataclass(frozen=True)
class CompressJob:
    """A compression that passed the pre-flight."""

    config: CompressConfig  # validated, "auto" resolved: what the folder and its recipe record
    run_config: CompressConfig  # the same on this process's own device (`accelerate launch`): plan.json's `config`
    resources: Resources


def preflight(config: CompressConfig, on_note: Callable[[str], None] | None = None) -> CompressJob:
    """Check `config` and everything it names (the output folder when it has one, the work folder, the
    model, the data as far as the calibration budget reads it), in this order, then decide its resources:
    one `UserError` for the first problem.
    `on_note`: called with advice that stops nothing (a '.' in the folder's name)."""
    out = Path(config.out) if config.out is not None else None
    refuse_existing_out(out, config.overwrite)
    config.validate()
    config = config.resolved()
    work_dir = Path(config.offload_dir) if config.offload_dir else None
    inputs = model_inputs(config.model) + local_inputs(config.dataset)
    if out is not None:
        check_output(out, inputs, overwrite=config.overwrite)
    check_work_dir(work_dir, inputs, "--offload-dir", outputs=[out] if out is not None else [])
    if out is not None and "." in out.name and on_note is not None:
        on_note(f"'{out.name}' contains a '.', which breaks `rana export` remote-code loading; prefer names without dots")
    resolve(config.model, dense=True)  # an unknown model (or a compressed one: a rana folder, an export) fails here
    # the calibration text as far as `calib_tokens` reads it, not the whole file (it may be 100 MB)
    check_inputs(config.model, seq_len=config.seq_len, out=out, data=[config.dataset], data_option="--dataset",
                 data_tokens=config.calib_tokens, text_column=config.text_column, offload_dir=work_dir)
    run_config = setup_distributed(config)
    return CompressJob(config=config, run_config=run_config, resources=decide_resources(run_config))


__all__ = ["CompressJob", "preflight"]
