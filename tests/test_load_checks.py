"""One schema and one set of tensor checks, run by every loader (issue 39, cause 2): `rana.load`, the transformers
quantizer (plain `from_pretrained` of a quantizer-format export, rana installed) and the remote code an export
ships (`trust_remote_code=True`, in a fresh process that cannot import rana) all refuse the same broken files
with one line saying what is wrong — a weight tensor missing (transformers left it at its random init), an
extra one, a format from a newer rana, an `adapters` record of the wrong shape, NaN / inf int8 scales, int8 codes
stored as float32 or uint8 — and a valid int8 export loads through the remote code with `rana.load`'s logits
(its config conversion used to drop the int8 record: garbage logits).
"""
from __future__ import annotations

import json
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
from transformers import AutoModelForCausalLM

import rana.io as rio
from helpers import byte_tokenizer, tiny_model
from rana.cli.app import app
from rana.compress import CompressConfig, compress_model
from rana.errors import UserError
from rana.export import export
from rana.quantize import quantize_model
from test_export import assert_close, isolated_env

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = torch.tensor([[5, 17, 99, 3, 42, 8, 77, 120]])
CODES = "model.layers.0.self_attn.q_proj.linear.qweight"
SCALES = "model.layers.0.mlp.down_proj.linear.weight_scale"
DROPPED = "model.layers.0.mlp.down_proj.linear.weight"


def _edit_weights(folder: Path, edit) -> None:
    (f,) = sorted(folder.glob("*.safetensors"))  # one file: the tiny models are never sharded
    state = load_file(str(f))
    edit(state)
    save_file(state, str(f), metadata={"format": "pt"})


def _edit_record(folder: Path, edit) -> None:
    """Edit the record the rebuild reads: rana_config.json, a quantizer-format export's quantization_config, or a
    remote-code export's rana_* fields."""
    meta = folder / rio.RANA_CONFIG
    if meta.is_file():
        doc = json.loads(meta.read_text())
        edit(doc)
        meta.write_text(json.dumps(doc))
        return
    config = json.loads((folder / "config.json").read_text())
    if "quantization_config" in config:
        edit(config["quantization_config"])
    else:
        record = {k.removeprefix("rana_"): v for k, v in config.items() if k.startswith("rana_")}
        edit(record)
        config.update({f"rana_{k}": v for k, v in record.items()})
    (folder / "config.json").write_text(json.dumps(config))


def _set_adapter_in(doc):
    doc["adapters"][0]["in"] = "64"


# name: (the folder it damages: "full" or "int8", weight edit, record edit, what the one line says)
CASES = {
    "missing_tensor": ("full", lambda s: s.pop(DROPPED), None, f"1 missing ['{DROPPED}']"),
    "extra_tensor": ("full", lambda s: s.update({"extra.weight": torch.zeros(3)}), None, "1 unexpected ['extra.weight']"),
    "newer_format": ("full", None, lambda d: d.update(format_version=99), "'format_version' 99 is newer"),
    "no_adapters": ("full", None, lambda d: d.update(adapters=[]), "do not match"),
    "adapters_not_a_list": ("full", None, lambda d: d.update(adapters="x"), "'adapters' must be a list, got 'x'"),
    "adapter_in_a_string": ("full", None, _set_adapter_in, "'in' must be a positive integer, got '64'"),
    "nan_scale": ("int8", lambda s: s[SCALES].__setitem__(3, float("nan")), None, "scales must be finite positive"),
    "inf_scale": ("int8", lambda s: s[SCALES].__setitem__(0, float("inf")), None, "scales must be finite positive"),
    "codes_float32": ("int8", lambda s: s.update({CODES: s[CODES].float()}), None, "stored as F32; it must be int8"),
    "codes_uint8": ("int8", lambda s: s.update({CODES: s[CODES].view(torch.uint8)}), None,
                    "stored as U8; it must be int8"),
}
FORMATS = {"quantizer": "q", "remote-code": "r"}


def _damage(src: Path, dst: Path, case: str) -> Path:
    _, weights, record, _ = CASES[case]
    shutil.copytree(src, dst)
    if weights:
        _edit_weights(dst, weights)
    if record:
        _edit_record(dst, record)
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{("full" | "int8", "" | "q" | "r"): folder}: a tiny compressed llama (teal) and its int8 copy, each as a rana
    folder and as both export formats; plus every damaged copy, keyed (case, "" | "q" | "r")."""
    tmp = tmp_path_factory.mktemp("loadchecks")
    model = tiny_model("llama", seed=3, vocab_size=257)  # the byte tokenizer's vocabulary
    ids = torch.randint(0, 257, (20, 32), generator=torch.Generator().manual_seed(0))
    cfg = CompressConfig(model="x", flops=0.7, method="teal", calib_tokens=512, seq_len=32, batch_size=4,
                         search_tokens=128, fit_sample_tokens=256)
    compress_model(model, None, cfg, SimpleNamespace(fit=ids[:16], heldout=ids[16:]))
    out = {("full", ""): rio.save(model, byte_tokenizer(), tmp / "full")}
    quantize_model(model)  # max-abs scales (no calibration): fast, and int8 all the same
    out["int8", ""] = rio.save(model, byte_tokenizer(), tmp / "int8")
    for kind in ("full", "int8"):
        for fmt, tag in FORMATS.items():
            out[kind, tag] = export(out[kind, ""], tmp / f"{kind}_{tag}", format=fmt)
    for case, (kind, *_rest) in CASES.items():
        for tag in ("", "q", "r"):
            out[case, tag] = _damage(out[kind, tag], tmp / f"{case}_{tag or 'rana'}", case)
    return out


# Runs in a fresh interpreter (rana importable or not: jobs["blocked"]): loads each folder with trust_remote_code
# and returns its logits, or the exception it raised.
REMOTE = textwrap.dedent(r'''
    import importlib.abc, json, sys

    jobs = json.loads(sys.argv[1])
    sys.meta_path[:] = [f for f in sys.meta_path if not getattr(f, "__module__", "").startswith("__editable__")
                        or "rana" not in jobs["blocked"]]
    BLOCKED = tuple(jobs["blocked"])

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")

    sys.meta_path.insert(0, Block())
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(jobs["threads"])
    results = {}
    for name, folder in jobs["folders"].items():
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
            with torch.no_grad():
                results[name] = {"logits": model(torch.tensor(jobs["prompt"])).logits}
        except Exception as e:
            results[name] = {"error": type(e).__name__, "message": str(e), "value_error": isinstance(e, ValueError)}
    results["rana imported"] = sorted(m for m in sys.modules if m.split(".")[0] == "rana")
    torch.save(results, jobs["out"])
''')


def run_remote(folders: dict[str, Path], tmp: Path, *, rana_installed: bool) -> dict:
    script, out = tmp / "remote.py", tmp / "remote.pt"
    script.write_text(REMOTE)
    jobs = {"folders": {k: str(v) for k, v in folders.items()}, "prompt": PROMPT.tolist(), "out": str(out),
            "blocked": ["triton"] if rana_installed else ["rana", "triton"], "threads": torch.get_num_threads()}
    env = isolated_env(tmp)
    if rana_installed:
        env.pop("RANA_NO_HF_HOOK")
    proc = subprocess.run([sys.executable, "-I", str(script), json.dumps(jobs)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def remote(folders, tmp_path_factory):
    """What the shipped remote code makes of every damaged export and of the valid int8 one, without rana."""
    tmp = tmp_path_factory.mktemp("remote")
    wanted = {f"{case}_{tag}": folders[case, tag] for case in CASES for tag in FORMATS.values()}
    wanted["int8_q"] = folders["int8", "q"]
    return run_remote(wanted, tmp, rana_installed=False)


def _one_line(e: BaseException, needle: str) -> None:
    assert isinstance(e, UserError), repr(e)
    assert "\n" not in str(e) and needle in str(e), str(e)


@pytest.mark.parametrize("case", list(CASES))
def test_rana_load_and_the_quantizer_refuse(folders, case):
    """rana.load of the rana folder, and plain from_pretrained of its quantizer-format export with rana installed
    (its quantizer registered): the same one line. (rana.load refused some of these before; the quantizer none.)"""
    with pytest.raises(UserError) as e:
        rio.load(folders[case, ""])
    _one_line(e.value, CASES[case][3])
    with pytest.raises(UserError) as e:
        AutoModelForCausalLM.from_pretrained(folders[case, "q"])
    _one_line(e.value, CASES[case][3])


@pytest.mark.parametrize("tag", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("case", list(CASES))
def test_remote_code_refuses_without_rana(remote, case, tag):
    """The shipped code, rana not importable: a ValueError saying what is wrong, never a model."""
    got = remote[f"{case}_{tag}"]
    assert "logits" not in got, f"{case}: loaded (logits {got['logits'].flatten()[:4].tolist()})"
    assert got["value_error"] and CASES[case][3] in got["message"], got
    assert got["error"] == "ModelLoadError" and "\n" not in got["message"], got


@pytest.fixture(scope="module")
def int8_reference(folders):
    model, _ = rio.load(folders["int8", ""])
    with torch.no_grad():
        return model(PROMPT).logits


def test_int8_export_through_remote_code_matches_rana_load(remote, int8_reference):
    """A quantizer-format int8 export with trust_remote_code=True: its config conversion used to drop the int8
    record (the int8 codes were then never loaded: garbage logits)."""
    assert remote["rana imported"] == []
    got = remote["int8_q"]
    assert "logits" in got, got
    assert_close(got["logits"], int8_reference)


def test_int8_export_through_remote_code_with_rana_installed(folders, int8_reference, tmp_path):
    """trust_remote_code=True where rana is installed (its start-up hook on): the shipped code all the same, with
    the int8 record kept, and the same refusals."""
    results = run_remote({"int8": folders["int8", "q"], "codes": folders["codes_uint8", "q"]}, tmp_path,
                         rana_installed=True)
    assert "logits" in results["int8"], results["int8"]
    assert_close(results["int8"]["logits"], int8_reference)
    assert "stored as U8" in results["codes"].get("message", ""), results["codes"]


@pytest.mark.parametrize("case", ["nan_scale", "codes_uint8"])
def test_eval_stops_in_one_line(folders, tmp_path, case):
    """`rana eval` used to measure a folder with NaN scales or uint8 codes and exit 0."""
    data = tmp_path / "data.txt"
    data.write_text("some text to measure the model on. " * 200)
    res = CliRunner().invoke(app, ["eval", str(folders[case, ""]), "--ppl-data", str(data), "--seq-len", "32"])
    assert res.exit_code not in (0, None), res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in res.output, res.output
    assert CASES[case][3] in " ".join(res.output.split()), res.output
