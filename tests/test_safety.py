"""Nothing lost, no stranger's code run, no silent garbage from files (issue 17, part A).

Each test reproduces one root cause: outputs that overlap inputs or replace folders rana did not
write; a planted native library; checkpoints that are incomplete, corrupt, point outside their
folder or carry non-finite thresholds; output modes, stale temp folders and success messages.
CLI cases assert a non-zero exit, one line, no traceback and the input folder byte-identical.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

import rana.io as rio
from helpers import byte_tokenizer, tiny_model, tiny_model_dir
from rana.cli.app import app
from rana.io.models import ModelLoadError, load_model
from rana.io.paths import UnsafeOutputError, check_output, remove_stale_temps, temp_prefix

runner = CliRunner()
SMALL = ["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4"]


# ----------------------------------------------------------------------------------- helpers


def tree_hash(folder: Path) -> str:
    """Names, modes and contents of everything under `folder`."""
    h = hashlib.sha256()
    for p in sorted(Path(folder).rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        h.update(oct(p.lstat().st_mode).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def assert_one_line_error(res, needle: str) -> None:
    assert res.exit_code not in (0, None), res.output
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)  # not a crash
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert needle in res.output, res.output


def make_rana_folder(path: Path, method: str = "teal", tokenizer: bool = True) -> Path:
    from rana.compress import CompressConfig, compress_model

    model = tiny_model("llama", vocab_size=257)
    ids = torch.randint(0, 257, (20, 32), generator=torch.Generator().manual_seed(0))
    cfg = CompressConfig(model="x", flops=0.7, method=method, calib_tokens=512, seq_len=32, batch_size=4,
                         search_tokens=128, fit_sample_tokens=256)
    compress_model(model, None, cfg, SimpleNamespace(fit=ids[:16], heldout=ids[16:]))
    rio.save(model, byte_tokenizer() if tokenizer else None, path, plan={"model": "tiny-dense"})
    return path


@pytest.fixture(scope="module")
def proj(tmp_path_factory):
    """proj/model (dense HF folder), proj/calib.txt, proj/rana (a rana folder), proj/notes.txt."""
    from rana.data import BUNDLED_CORPUS

    root = tmp_path_factory.mktemp("proj") / "proj"
    root.mkdir()
    tiny_model_dir(root / "model")
    (root / "calib.txt").write_text(BUNDLED_CORPUS.read_text()[:20000])
    make_rana_folder(root / "rana")
    (root / "notes.txt").write_text("precious")
    return root


# ----------------------------------------------------------------------------------- data loss


@pytest.mark.parametrize("case", ["out_is_parent", "out_is_input", "out_inside_input", "offload_is_input",
                                  "offload_is_out", "out_is_grandparent"])
def test_compress_never_touches_an_input(proj, tmp_path, case):
    model = proj / "model"
    args = ["compress", str(model), "--dataset", str(proj / "calib.txt"), *SMALL]
    out, needle = {
        "out_is_parent": (proj, "contains the input"),
        "out_is_input": (model, "is the input"),
        "out_inside_input": (model / "sub", "is inside the input"),
        "offload_is_input": (tmp_path / "o", "--offload-dir"),
        "offload_is_out": (tmp_path / "o", "overlaps the output"),
        "out_is_grandparent": (proj.parent, "contains the input"),
    }[case]
    args += ["--out", str(out), "--overwrite"]
    if case == "offload_is_input":
        args += ["--offload-dir", str(model)]
    if case == "offload_is_out":
        args += ["--offload-dir", str(out)]
    before = tree_hash(proj)
    res = runner.invoke(app, args)
    assert_one_line_error(res, needle)
    assert tree_hash(proj) == before
    assert not (tmp_path / "o").exists()


def test_overwrite_replaces_only_folders_rana_wrote(proj, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    before = tree_hash(mine)
    res = runner.invoke(app, ["compress", str(proj / "model"), "--out", str(mine), "--overwrite"])
    assert_one_line_error(res, "not written by rana")
    assert tree_hash(mine) == before
    # a rana folder someone put their own folder into: --overwrite would delete it
    rana_dir = make_rana_folder(tmp_path / "r")
    (rana_dir / "experiments").mkdir()
    with pytest.raises(UnsafeOutputError, match="experiments"):
        check_output(rana_dir, overwrite=True)
    with pytest.raises(UnsafeOutputError, match="experiments"):
        rio.save(tiny_model(), None, rana_dir, overwrite=True)
    assert (rana_dir / "experiments").is_dir()
    # a plain rana folder and an empty one are replaced
    shutil.rmtree(rana_dir / "experiments")
    rio.save(tiny_model(), None, rana_dir, overwrite=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    rio.save(tiny_model(), None, empty, overwrite=True)
    assert rio.is_rana_dir(rana_dir) and rio.is_rana_dir(empty)


def test_export_never_touches_its_source(proj, tmp_path):
    holder = tmp_path / "proj2"
    shutil.copytree(proj / "rana", holder / "src")
    before = tree_hash(holder)
    for out in (holder, holder / "src", holder / "src" / "inner"):
        res = runner.invoke(app, ["export", str(holder / "src"), "--out", str(out), "--overwrite"])
        assert_one_line_error(res, "input")
        assert tree_hash(holder) == before


def test_finetune_out_never_an_input(proj, tmp_path):
    before = tree_hash(proj)
    for out in (proj / "rana", proj):
        res = runner.invoke(app, ["finetune", str(proj / "rana"), "--data", str(proj / "calib.txt"), "--tokens", "2k",
                                  "--seq-len", "32", "--out", str(out), "--overwrite"])
        assert_one_line_error(res, "input")
    res = runner.invoke(app, ["finetune", str(proj / "rana"), "--data", str(proj / "calib.txt"), "--tokens", "2k",
                              "--seq-len", "32", "--out", str(tmp_path / "ft"), "--checkpoint-dir", str(proj / "rana" / "ck")])
    assert_one_line_error(res, "--checkpoint-dir")
    assert tree_hash(proj) == before and not (tmp_path / "ft").exists()


def test_sweep_out_never_a_model_folder(proj, tmp_path):
    other_model = tiny_model_dir(tmp_path / "other_model")
    before, before_other = tree_hash(proj), tree_hash(other_model)
    common = ["sweep", str(proj / "model"), "--ppl-data", str(proj / "calib.txt"), "--methods", "teal", "--flops", "0.7",
              *SMALL]
    res = runner.invoke(app, [*common, "--out", str(proj / "model")])
    assert_one_line_error(res, "is the input")
    res = runner.invoke(app, [*common, "--out", str(other_model)])
    assert_one_line_error(res, "not a sweep folder")
    assert tree_hash(proj) == before and tree_hash(other_model) == before_other


def test_eval_json_never_overwrites_an_input(proj):
    before = tree_hash(proj)
    res = runner.invoke(app, ["eval", str(proj / "rana"), "--ppl-data", str(proj / "calib.txt"),
                              "--json", str(proj / "rana" / "config.json"), "--seq-len", "64"])
    assert_one_line_error(res, "--json")
    res = runner.invoke(app, ["eval", str(proj / "rana"), "--ppl-data", str(proj / "calib.txt"),
                              "--json", str(proj / "calib.txt"), "--seq-len", "64"])
    assert_one_line_error(res, "--json")
    assert tree_hash(proj) == before


# ----------------------------------------------------------------------------------- foreign code

_PLANT_C = r"""
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE* f = fopen("%s", "w");
    if (f) { fputs("planted code ran", f); fclose(f); }
}
long rana_masked_gemv_f32(void) { return 0; }
"""

_PROBE = textwrap.dedent("""
    import importlib, pathlib, sys
    module_file = pathlib.Path(sys.argv[1])  # the kernel file inside its package (kernels/, an export's folder)
    sys.path.insert(0, str(module_file.parent.parent))
    cg = importlib.import_module(f"{module_file.parent.name}.{module_file.stem}")
    print(cg.native_status())
    print("native" if cg.native_kernel() is not None else "none")
""")


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _plant(cache: Path, marker: Path, tmp_path: Path, *, sidecar: str | None = None) -> list[Path]:
    """A library whose constructor writes `marker`, under every name the kernel loader looks for."""
    from rana.kernels import cpu_gemv as cg

    src = tmp_path / "plant.c"
    src.write_text(_PLANT_C % marker)
    lib = tmp_path / "plant.so"
    subprocess.run([_compiler(), "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    cache.mkdir(parents=True, exist_ok=True)
    compiler = shutil.which(os.environ["CC"]) if os.environ.get("CC") else (
        shutil.which("cc") or shutil.which("gcc") or shutil.which("clang"))
    planted = []
    for flags in cg.BUILD_ATTEMPTS:
        target = cache / cg.library_name(compiler, flags)
        shutil.copy(lib, target)
        if sidecar is not None:
            (cache / (target.name + ".sha256")).write_text(sidecar or hashlib.sha256(lib.read_bytes()).hexdigest())
        planted.append(target)
    return planted


def _probe(module_file: Path, cache: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "RANA_KERNEL_CACHE": str(cache)}
    env.pop("RANA_NATIVE_CPU", None)
    return subprocess.run([sys.executable, "-c", _PROBE, str(module_file)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


def _kernel_file() -> Path:
    from rana.kernels import cpu_gemv as cg

    return Path(cg.__file__)


needs_cc = pytest.mark.skipif(_compiler() is None or sys.platform == "win32", reason="needs a C compiler (POSIX)")


@needs_cc
@pytest.mark.parametrize("how", ["world_writable", "group_writable", "other_owner", "unsafe_parent"])
def test_planted_library_in_an_unsafe_cache_never_runs(tmp_path, how):
    marker = tmp_path / "ran.txt"
    cache = tmp_path / "base" / "cache"
    cache.mkdir(parents=True)
    planted = _plant(cache, marker, tmp_path, sidecar="")  # even with a matching recorded hash
    if how == "world_writable":
        cache.chmod(0o777)
    elif how == "group_writable":
        cache.chmod(0o770)
    elif how == "other_owner":
        if os.getuid() != 0:
            pytest.skip("needs root to give the folder to another user")
        cache.chmod(0o700)
        os.chown(cache, 65534, 65534)
    else:
        cache.chmod(0o700)
        (tmp_path / "base").chmod(0o777)  # not sticky: anyone could swap `cache` for their own folder
    out = _probe(_kernel_file(), cache, tmp_path)
    assert out.returncode == 0, out.stderr
    assert not marker.exists(), "the planted library's constructor ran"
    status = out.stdout.splitlines()
    assert status[-1] == "none" and status[0].startswith("torch fallback (not loading the native kernel: ")
    assert len(status) == 2, out.stdout
    # control: loading the planted file does run its constructor (so the check above can fail)
    subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(planted[0])], check=True)
    assert marker.exists()


@needs_cc
@pytest.mark.parametrize("sidecar", [None, "0" * 64])
def test_planted_library_without_its_recorded_hash_is_rebuilt_not_loaded(tmp_path, sidecar):
    marker = tmp_path / "ran.txt"
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    planted = _plant(cache, marker, tmp_path, sidecar=sidecar)
    planted_hash = hashlib.sha256(planted[0].read_bytes()).hexdigest()
    out = _probe(_kernel_file(), cache, tmp_path)
    assert out.returncode == 0, out.stderr
    assert not marker.exists(), "the planted library's constructor ran"
    assert out.stdout.splitlines()[-1] == "native" and "rebuilt" in out.stdout
    built = next(p for p in planted if p.with_name(p.name + ".sha256").is_file()
                 and p.with_name(p.name + ".sha256").read_text().strip() != "0" * 64)
    assert hashlib.sha256(built.read_bytes()).hexdigest() != planted_hash
    # the next process loads the verified cache without rebuilding
    again = _probe(_kernel_file(), cache, tmp_path)
    assert again.stdout.splitlines()[-1] == "native" and "rebuilt" not in again.stdout


@needs_cc
def test_cache_is_created_private(tmp_path):
    cache = tmp_path / "new" / "cache"
    out = _probe(_kernel_file(), cache, tmp_path)
    assert out.stdout.splitlines()[-1] == "native", out.stdout + out.stderr
    assert (cache.stat().st_mode & 0o777) == 0o700


@needs_cc
def test_exported_kernel_copy_follows_the_same_rules(tmp_path):
    """The export ships cpu_gemv.py flat (its C source inlined, modes.py beside it): it imports nothing from rana
    and refuses the same plant."""
    from rana.export import SHIPPED_MODULES, module_source, rewrite_imports
    from rana.export.render import inline_c_source

    source = inline_c_source(rewrite_imports("rana.kernels.cpu_gemv", module_source("rana.kernels.cpu_gemv"),
                                              SHIPPED_MODULES))
    assert "rana" not in "".join(line for line in source.splitlines() if line.lstrip().startswith(("import", "from")))
    shipped = tmp_path / "export" / "cpu_gemv.py"
    shipped.parent.mkdir()
    shipped.write_text(source)
    (shipped.parent / "__init__.py").write_text("")
    (shipped.parent / "modes.py").write_text(module_source("rana.kernels.modes"))
    marker = tmp_path / "ran.txt"
    cache = tmp_path / "cache"
    _plant(cache, marker, tmp_path, sidecar="")
    cache.chmod(0o777)
    out = _probe(shipped, cache, tmp_path)
    assert out.returncode == 0 and not marker.exists() and out.stdout.splitlines()[-1] == "none", out.stdout


# ----------------------------------------------------------------------------------- silent garbage


def _edit_weights(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path), metadata={"format": "pt"})


def test_dense_checkpoint_missing_a_layer_is_refused(proj, tmp_path):
    broken = Path(shutil.copytree(proj / "model", tmp_path / "broken"))
    _edit_weights(broken, lambda s: [s.pop(k) for k in [k for k in s if ".layers.1." in k]])
    with pytest.raises(ModelLoadError, match="missing"):
        load_model(str(broken))
    before = tree_hash(broken)
    res = runner.invoke(app, ["compress", str(broken), "--out", str(tmp_path / "o"), "--dataset",
                              str(proj / "calib.txt"), *SMALL])
    assert_one_line_error(res, "missing")
    assert tree_hash(broken) == before and not (tmp_path / "o").exists()


def test_dense_checkpoint_with_unexpected_tensors_is_refused(proj, tmp_path):
    broken = Path(shutil.copytree(proj / "model", tmp_path / "broken"))
    _edit_weights(broken, lambda s: s.update({"model.layers.7.mlp.up_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ModelLoadError, match="unexpected"):
        load_model(str(broken))


def test_rana_folder_where_a_dense_model_is_expected(proj, tmp_path):
    for cmd in (["compress", str(proj / "rana"), "--out", str(tmp_path / "o")],
                ["sweep", str(proj / "rana"), "--out", str(tmp_path / "o"), "--ppl-data", str(proj / "calib.txt")]):
        res = runner.invoke(app, cmd)
        assert_one_line_error(res, "is a rana folder")
        assert "tiny-dense" in res.output  # names the model it came from
    with pytest.raises(ModelLoadError, match="rana folder"):
        load_model(str(proj / "rana"))


def _index_dense(tmp_path: Path) -> Path:
    folder = tmp_path / "sharded"
    tiny_model(vocab_size=257).save_pretrained(folder, max_shard_size="100KB")
    byte_tokenizer().save_pretrained(folder)
    assert (folder / "model.safetensors.index.json").is_file()
    return folder


@pytest.mark.parametrize("target", ["../outside.safetensors", "/etc/outside.safetensors", "sub/x.safetensors"])
def test_weight_index_pointing_outside_the_folder_is_refused(tmp_path, target):
    dense = _index_dense(tmp_path)
    shutil.copy(next(dense.glob("model-*.safetensors")), tmp_path / "outside.safetensors")
    index = json.loads((dense / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = target
    (dense / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match="not a plain file inside"):
        load_model(str(dense))
    rana_dir = make_rana_folder(tmp_path / "r")
    state = load_file(str(rana_dir / "model.safetensors"))
    save_file(state, str(rana_dir / "model-00001-of-00001.safetensors"))
    (rana_dir / "model.safetensors").unlink()
    weight_map = {k: "model-00001-of-00001.safetensors" for k in state}
    weight_map[next(iter(weight_map))] = target
    (rana_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelLoadError, match="not a plain file inside"):
        rio.load(rana_dir)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_safetensors_are_one_line(proj, tmp_path, damage):
    rana_dir = Path(shutil.copytree(proj / "rana", tmp_path / "r"))
    dense = Path(shutil.copytree(proj / "model", tmp_path / "d"))
    for folder in (rana_dir, dense):
        f = folder / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes({"truncated": data[: len(data) - 100], "garbage": b"\xff" * 64, "empty": b""}[damage])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        rio.load(rana_dir)
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(str(dense))
    before = tree_hash(rana_dir)
    res = runner.invoke(app, ["eval", str(rana_dir), "--ppl-data", str(proj / "calib.txt"), "--seq-len", "64"])
    assert_one_line_error(res, "model.safetensors")
    res = runner.invoke(app, ["export", str(rana_dir), "--out", str(tmp_path / "x")])
    assert_one_line_error(res, "model.safetensors")
    assert tree_hash(rana_dir) == before and not (tmp_path / "x").exists()


def _threshold_key(folder: Path) -> str:
    return next(k for k in load_file(str(folder / "model.safetensors")) if k.endswith("threshold"))


@pytest.mark.parametrize("value, needle", [(math.nan, "NaN"), (math.inf, "differs"), (123.0, "differs")])
def test_bad_threshold_in_the_weights_is_refused(proj, tmp_path, value, needle):
    rana_dir = Path(shutil.copytree(proj / "rana", tmp_path / "r"))
    key = _threshold_key(rana_dir)
    _edit_weights(rana_dir, lambda s: s[key].fill_(value))
    with pytest.raises(ModelLoadError, match=needle):
        rio.load(rana_dir)


def test_infinite_thresholds_round_trip(tmp_path):
    """+inf (nothing active, e.g. CATS at tiny budgets) is written as "inf", -inf as null."""
    from rana.modules import InputSparseLinear

    rana_dir = make_rana_folder(tmp_path / "r")
    model, _ = rio.load(rana_dir)
    sparse = [m for m in model.modules() if isinstance(m, InputSparseLinear)]
    sparse[0].threshold.fill_(math.inf)
    sparse[1].threshold.fill_(-math.inf)
    rio.save(model, None, tmp_path / "again")
    meta = json.loads((tmp_path / "again" / rio.RANA_CONFIG).read_text())
    assert [a["threshold"] for a in meta["adapters"][:2]] == ["inf", None]
    again, _ = rio.load(tmp_path / "again")
    loaded = [m for m in again.modules() if isinstance(m, InputSparseLinear)]
    assert float(loaded[0].threshold) == math.inf and float(loaded[1].threshold) == -math.inf


def _set(meta, **kw):
    meta["adapters"][0].update(kw)


@pytest.mark.parametrize("edit, needle", [
    (lambda m: "{not json", "rana_config.json' is invalid"),
    (lambda m: m.pop("adapters") and m, "'adapters' must be a list"),
    (lambda m: _set(m, threshold=float("nan")) or m, "not a finite number"),
    (lambda m: _set(m, threshold=float("inf")) or m, "not a finite number"),
    (lambda m: _set(m, threshold="high") or m, "not a finite number"),
    (lambda m: _set(m, type="magic") or m, "unknown type"),
    (lambda m: _set(m, out="abc") or m, "positive integer"),
    (lambda m: _set(m, path="model.layers.9.mlp.up_proj") or m, "does not fit the model"),
    (lambda m: _set(m, out=7) or m, "its 'out' is 7, the model's Linear has"),  # checked before the weights
    (lambda m: m.update(dtype="float8") or m, "dtype"),
    (lambda m: m.update(format_version=99) or m, "newer"),
])
def test_rana_config_schema_errors_are_one_line(proj, tmp_path, edit, needle):
    rana_dir = Path(shutil.copytree(proj / "rana", tmp_path / "r"))
    meta = json.loads((rana_dir / rio.RANA_CONFIG).read_text())
    new = edit(meta)
    (rana_dir / rio.RANA_CONFIG).write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(ModelLoadError, match=needle):
        rio.load(rana_dir)
    res = runner.invoke(app, ["export", str(rana_dir), "--out", str(tmp_path / "x")])
    assert_one_line_error(res, needle.split("'")[0] if "'" in needle else needle)


# ----------------------------------------------------------------------------------- outputs


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_outputs_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        out = rio.save(tiny_model(), byte_tokenizer(), tmp_path / "out")
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o777 & ~umask
    for f in out.iterdir():
        assert (f.stat().st_mode & 0o777) == 0o666 & ~umask, f


def test_temp_folders_of_killed_saves_are_removed(tmp_path):
    out = tmp_path / "out"
    # a save killed with SIGKILL: its temp folder stays, named after a process that is gone
    code = textwrap.dedent(f"""
        import os, signal, rana.io as rio
        from helpers import tiny_model
        with rio.atomic_dir(__import__('pathlib').Path({str(out)!r})) as tmp:
            (tmp / 'half.bin').write_bytes(b'x' * 100)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    subprocess.run([sys.executable, "-c", code], env=env, timeout=120)
    stale = [p for p in tmp_path.iterdir() if p.name.startswith(".out.rana-tmp-")]
    assert len(stale) == 1 and not out.exists()
    live = tmp_path / (temp_prefix(out).rsplit("-", 2)[0] + f"-{os.getppid()}-live")  # a running process's
    live.mkdir()
    rio.save(tiny_model(), None, out)
    assert not stale[0].exists() and live.is_dir()
    assert remove_stale_temps(out) == [] and live.is_dir()


def test_compress_success_message_names_only_written_files(proj, tmp_path):
    out = tmp_path / "out"
    res = runner.invoke(app, ["compress", str(proj / "model"), "--flops", "0.8", "--method", "teal", "--out", str(out),
                              "--dataset", str(proj / "calib.txt"), *SMALL])
    assert res.exit_code == 0, res.output
    listed = re.search(r"wrote \S+ \((.*?)\) in \d", " ".join(res.output.split())).group(1).split(", ")
    assert sorted(listed) == sorted(p.name for p in out.iterdir())
    assert "model.safetensors" in listed and "plan.json" in listed
    # and the rana folder it wrote can be replaced by the next run with --overwrite
    res = runner.invoke(app, ["compress", str(proj / "model"), "--flops", "0.8", "--method", "teal", "--out", str(out),
                              "--dataset", str(proj / "calib.txt"), "--overwrite", *SMALL])
    assert res.exit_code == 0, res.output
