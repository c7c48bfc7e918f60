"""One mode table (kernels/modes.py) that the Python code, the C kernel and the Triton kernels take their
integers from; one list of ops (kernels/ops.py) that docs/gpu.md shows. Each check fails if a copy drifts."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rana.kernels import cpu_gemv as cg
from rana.kernels import modes, ops
from rana.kernels import triton_gemv as tg

KERNELS = Path(modes.__file__).resolve().parent
REPO = KERNELS.parent


def test_the_table():
    assert modes.MODES == ("none", "square", "abs_scaled", "abs")
    assert [modes.MODE_IDS[m] for m in modes.MODES] == list(range(len(modes.MODES)))
    assert modes.MASKING_MODES == tuple(m for m in modes.MODES if m != "none")
    with pytest.raises(ValueError, match="mode must be one of"):
        modes.mode_id("relu")


def test_the_committed_header_is_the_tables():
    """kernels/rana_modes.h (what an editor's cpu_gemv.c includes) is what `python -m rana.kernels.modes` writes."""
    assert (KERNELS / modes.HEADER_NAME).read_text(encoding="utf-8") == modes.c_header()
    for name, i in modes.MODE_IDS.items():
        assert f"#define {modes.c_macro(name)} {i}\n" in modes.c_header()


def test_the_c_source_reads_the_ids_from_the_header():
    """The C file names every mode through its macro and compares no mode with a literal; the unit that is
    compiled carries the table's header in place of the include."""
    c = (KERNELS / "cpu_gemv.c").read_text(encoding="utf-8")
    assert c.count(f'#include "{modes.HEADER_NAME}"') == 1
    code = re.sub(r"/\*.*?\*/", "", c, flags=re.S)  # comments may cite ids
    assert not re.search(r"\bmode\s*[=!]=\s*\d", code), "a mode compared with a literal"
    for name in modes.MODES:
        assert modes.c_macro(name) in code
    unit = cg.source()
    assert modes.c_header() in unit and f'#include "{modes.HEADER_NAME}"' not in unit


def test_the_compiled_kernel_masks_by_the_tables_ids():
    """Call the native kernel with each id of the table and compare with the mode it names."""
    if cg.native_kernel() is None:
        pytest.skip(cg.native_status())
    g = torch.Generator().manual_seed(0)
    K, N = 64, 16
    w_t, v = torch.randn(K, N, generator=g), torch.randn(1, K, generator=g)
    scale = torch.rand(K, generator=g) + 0.5
    t = 0.6
    score = {"none": torch.full((K,), float("inf")), "square": v[0] ** 2, "abs_scaled": v[0].abs() * scale,
             "abs": v[0].abs()}
    for name in modes.MODES:
        y = cg.NativeCall.bind(w_t, None, name, scale)(v, t, limit=K)  # limit K: the kernel's own sum
        keep = (score[name] >= t).double()
        torch.testing.assert_close(y.double(), (v.double() * keep) @ w_t.double(), atol=1e-4, rtol=0)


@pytest.mark.skipif(not tg.triton_available(), reason="triton is not installed")
def test_the_triton_kernels_read_the_ids_from_the_table():
    for name in modes.MODES:
        assert int(getattr(tg, "MODE_" + name.upper())) == modes.MODE_IDS[name]
    source = Path(tg.__file__).read_text(encoding="utf-8")  # every kernel and the helpers they call
    assert not re.search(r"\bMODE\s*==\s*\d", source), "a kernel compares MODE with a literal"
    for name in modes.MASKING_MODES:
        assert re.search(rf"\bMODE\s*==\s*MODE_{name.upper()}\b", source), f"no kernel tests MODE_{name.upper()}"


def test_docs_list_the_registered_ops():
    """docs/gpu.md's op table names exactly the ops kernels/ops.py registers (with triton)."""
    text = (REPO / "docs" / "gpu.md").read_text(encoding="utf-8")
    table = [line for line in text.splitlines() if line.startswith("| `rana::")]
    documented = {name for line in table for name in re.findall(r"`(rana::\w+)`", line.split("|")[1])}
    assert documented == set(ops.ALL_OP_NAMES)
    assert set(ops.OP_NAMES) <= set(ops.ALL_OP_NAMES)
