"""The wheel installs `cli/` and `kernels/` *inside* the rana package, never top-level; every install path
(a wheel, an editable install) puts the quantizer hook in site-packages; the hook imports the installed
rana, never a folder named `rana` in the working directory."""
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_maps_cli_and_kernels_under_rana(tmp_path):
    # from the tracked files only: a build/ folder left in the tree would lend the wheel stale modules
    src = _copy_source(tmp_path / "src")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation", "-q",
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
    # every package of the source tree ships (rana.quantize was once left out: `rana quantize` failed installed)
    sources = {f"rana/{d.parent.name}/__init__.py" for d in (ROOT / "rana").glob("*/__init__.py")}
    assert sources <= set(names), sorted(sources - set(names))
    code = ("import rana.cli.app, rana.kernels.route, rana.compress, rana.evaluation, rana.sweep, rana.export; "
            "import rana.quantize.run, rana.finetune.run; "
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


def _copy_source(dst: Path) -> Path:
    """The tracked project files (as a clean clone has them), so an install here builds nothing in the tree."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, listed.decode().split("\0")):
        if (ROOT / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    return dst


@pytest.fixture(scope="module")
def editable_venv(tmp_path_factory):
    """A fresh venv seeing this interpreter's packages (not rana's editable install), with rana installed by
    the README's own line, `pip install -e .` (no build isolation: no network at test time)."""
    tmp = tmp_path_factory.mktemp("editable")
    src = _copy_source(tmp / "src")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # this interpreter's site-packages (torch, transformers, setuptools) behind the venv's own, minus rana
    ours = [p for p in sys.path if p.endswith("site-packages")]
    Path(purelib, "outer.pth").write_text("\n".join(ours) + "\n")
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    res = subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q",
                          "--no-deps", "--no-build-isolation", "-e", str(src)], cwd=tmp, env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return venv, Path(purelib), src


def test_editable_install_writes_the_hook(editable_venv):
    """`pip install -e .` gets the hook too (it once did not: `transformers serve` of an export then said
    "pip install rana" although rana was installed)."""
    from rana.hf_hook import PTH, PTH_LINE

    venv, purelib, src = editable_venv
    assert (purelib / PTH).read_text() == PTH_LINE
    res = subprocess.run([str(venv / "bin" / "python"), "-c", "import rana; print(rana.__file__)"], cwd=venv,
                         capture_output=True, text=True)
    assert res.returncode == 0 and res.stdout.strip() == str(src / "rana" / "__init__.py"), res.stderr


def test_hook_ignores_a_folder_named_rana(editable_venv, tmp_path):
    """A folder named `rana` in the working directory (an output folder, say) is not the package: loading
    transformers' quantizer table (what any from_pretrained does) imports the installed rana and registers
    quant_method "rana" (it once half-imported the folder: "cannot import name '__version__' from 'rana'")."""
    venv, _, src = editable_venv
    (tmp_path / "rana").mkdir()
    (tmp_path / "rana" / "config.json").write_text("{}")
    code = ("import transformers.quantizers.auto as q, rana; "
            "print('rana' in q.AUTO_QUANTIZER_MAPPING, rana.__file__)")
    res = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "RANA_NO_HF_HOOK"})
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["True", str(src / "rana" / "__init__.py")], res.stdout + res.stderr[-2000:]
