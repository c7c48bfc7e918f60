"""The wheel installs `cli/` and `kernels/` *inside* the rana package, never top-level."""
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_maps_cli_and_kernels_under_rana(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, cwd=tmp_path)
    wheel = next(tmp_path.glob("rana-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert "cli" not in tops and "kernels" not in tops
    assert "rana/cli/app.py" in names and "rana/kernels/route.py" in names
    assert any(n.startswith("rana/assets/") for n in names)  # bundled calibration corpus
    # the command packages, the remote-code templates every export renders, the offline lm-eval task templates
    assert {"rana/evaluation/run.py", "rana/sweep/run.py", "rana/export/run.py", "rana/export/template/modeling_rana.py",
            "rana/export/template/configuration_rana.py", "rana/tasks/hellaswag_local.yaml",
            "rana/kernels/gemv_configs.json", "rana/kernels/gemv_tune.py",  # + the GPU tuning table
            "rana/kernels/cpu_gemv.c", "rana/kernels/rana_modes.h"} <= set(names)  # + the native CPU kernel's C
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    assert not (target / "cli").exists() and not (target / "kernels").exists()
    code = ("import rana.cli.app, rana.kernels.route, rana.compress, rana.evaluation, rana.sweep, rana.export; "
            "assert (rana.export.render.TEMPLATE_DIR / 'modeling_rana.py').is_file(); "
            "assert 'rana_masked_gemv' in rana.kernels.cpu_gemv.source(); print(rana.cli.app.__file__)")
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": ""},
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().startswith(str(target))
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "rana = rana.cli.app:main" in zipfile.ZipFile(wheel).read(entry).decode()
    # the start-up hook that registers the transformers quantizer sits at site-packages' root
    from rana.hf_hook import PTH, PTH_LINE

    assert PTH in names and zipfile.ZipFile(wheel).read(PTH).decode() == PTH_LINE
