"""Issue 27, root cause 7: a device this machine lacks (`--device mps` on Linux, xpu, a CUDA index out
of range, a device type torch knows but cannot compute on) is one line naming the devices available
here, before any model loads, in every command that takes --device (compress, eval, sweep; finetune
and the demo take none: accelerate picks the device)."""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from rana.checks import InputError, available_devices, check_device
from rana.cli.app import app

runner = CliRunner()
SMALL = ["--calib-tokens", "1024", "--seq-len", "64", "--batch-size", "4"]


def _missing() -> list[str]:
    """Device strings torch parses that name nothing on this machine."""
    here = set(available_devices())
    wanted = ["mps", "mps:0", "xpu", "xpu:0", "meta", "hpu", f"cuda:{torch.cuda.device_count() + 3}"]
    if not torch.cuda.is_available():
        wanted.append("cuda")
    return [d for d in wanted if d not in here]


MISSING = _missing()




def _one_line(res) -> str:
    assert res.exit_code not in (0, None), res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.output
    return " ".join(res.output[res.output.index("error:"):].split())  # rich wraps long lines


def test_available_devices_are_what_torch_reports():
    here = available_devices()
    assert here[0] == "cpu"
    assert [d for d in here if d.startswith("cuda")] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert ("mps" in here) == torch.backends.mps.is_available()
    for device in here:
        check_device(device)  # every listed device passes
    check_device("cpu:0")


@pytest.mark.parametrize("device", MISSING)
def test_a_device_this_machine_lacks_names_what_is_here(device):
    with pytest.raises(InputError) as e:
        check_device(device)
    msg = str(e.value)
    assert "\n" not in msg and f"--device {device}" in msg
    assert "available here: " + ", ".join(available_devices()) in msg


def test_unknown_device_strings_stay_one_line():
    for device in ("gpu0", "warp-drive", "cuda:-1", ""):
        with pytest.raises(InputError, match="is not a device"):
            check_device(device)


@pytest.mark.parametrize("device", ["mps", "xpu", "cuda:9"])
@pytest.mark.parametrize("command", ["compress", "eval", "sweep"])
def test_every_command_with_device_refuses_it_in_one_line(command, device, model_dir, calib_file, tmp_path,
                                                          no_model_load):
    if device in available_devices():
        pytest.skip(f"this machine has {device}")
    args = {"compress": ["compress", str(model_dir), "--flops", "0.8", "--out", str(tmp_path / "o"),
                         "--dataset", str(calib_file), *SMALL],
            "eval": ["eval", str(model_dir), "--ppl-data", str(calib_file), "--seq-len", "64"],
            "sweep": ["sweep", str(model_dir), "--out", str(tmp_path / "s"), "--ppl-data", str(calib_file),
                      "--dataset", str(calib_file), "--methods", "teal", "--flops", "0.8", *SMALL]}[command]
    text = _one_line(runner.invoke(app, [*args, "--device", device]))
    assert f"--device {device}" in text and "available here: cpu" in text
    assert not (tmp_path / "o").exists() and not (tmp_path / "s").exists()
