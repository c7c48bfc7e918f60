"""The mask modes of the masked GEMV: the one table the Python code, the C kernel and the Triton kernels take
their integers from.

    "none"        every input kept (the dense GEMV; the threshold is not read)
    "square"      x_k² ≥ t              (RaNA's B-masker on the rank code)
    "abs_scaled"  |x_k| · scale_k ≥ t   (neuron thresholding, scale = the column norms ‖W[:, k]‖)
    "abs"         |x_k| ≥ t             (TEAL's magnitude sparsity)

Scores and comparisons are fp32 in every implementation. The ids are an ABI: the C source reads them from
`rana_modes.h` (:func:`c_header` writes it, and the build compiles what it writes, so the two cannot differ),
the Triton kernels from `triton_gemv.MODE_*`, which are made from this table. tests/test_kernel_modes.py
checks every copy.

Self-contained (stdlib only) so it ships with exported models.
"""
from __future__ import annotations

MODES = ("none", "square", "abs_scaled", "abs")
MODE_IDS = {name: i for i, name in enumerate(MODES)}
MASKING_MODES = MODES[1:]  # the modes that compare a score with a threshold

HEADER_NAME = "rana_modes.h"


def mode_id(mode: str) -> int:
    """The kernels' integer for `mode`; ValueError for anything else."""
    try:
        return MODE_IDS[mode]
    except (KeyError, TypeError):
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}") from None


def c_macro(mode: str) -> str:
    """The C macro naming `mode`'s id: "abs_scaled" -> RANA_MODE_ABS_SCALED."""
    return "RANA_MODE_" + mode.upper()


def c_header() -> str:
    """The text of rana_modes.h: one #define per mode."""
    lines = ["/* Generated from kernels/modes.py (python -m rana.kernels.modes): edit the table there. */",
             "#ifndef RANA_MODES_H", "#define RANA_MODES_H"]
    lines += [f"#define {c_macro(m)} {i}" for m, i in MODE_IDS.items()]
    lines += ["#endif", ""]
    return "\n".join(lines)


if __name__ == "__main__":  # regenerate kernels/rana_modes.h
    from pathlib import Path

    Path(__file__).with_name(HEADER_NAME).write_text(c_header(), encoding="utf-8")
