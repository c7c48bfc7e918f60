"""Up-front checks of what a command is given, run before any expensive work: each failure is a
`ValueError` whose message names the option or file and says how to fix it (the CLI prints it as
one line)."""
from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

from .data import check_source
from .io import is_rana_dir
from .io.models import ModelLoadError, model_config, resolve
from .errors import UserError

_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


class InputError(UserError):
    """An option or path that cannot work (user-facing; the message says what to do)."""


def _count(kind: str) -> int:
    """How many `kind` devices torch reports on this machine (0 for a type it knows but lacks here)."""
    import torch

    if kind == "cpu":
        return 1
    if kind == "mps":  # Apple GPUs show up as one device, never indexed
        return int(torch.backends.mps.is_available())
    module = getattr(torch, kind, None)  # torch.cuda, torch.xpu, ...; a backend torch was built without has none
    try:
        return int(module.device_count()) if module is not None and module.is_available() else 0
    except Exception:  # noqa: BLE001 - a half-installed backend: count it as absent
        return 0


def available_devices() -> list[str]:
    """The devices this machine can compute on, as `--device` takes them: cpu, every CUDA / XPU index,
    mps, and whatever other accelerator torch reports."""
    import torch

    kinds = ["cuda", "xpu", "mps"]
    other = getattr(torch, "accelerator", None)  # torch >= 2.6 names the current accelerator of any backend
    try:
        current = other.current_accelerator() if other is not None and other.is_available() else None
    except Exception:  # noqa: BLE001
        current = None
    if current is not None and current.type not in kinds:
        kinds.append(current.type)
    found = ["cpu"]
    for kind in kinds:
        n = _count(kind)
        found += ["mps"] * min(n, 1) if kind == "mps" else [f"{kind}:{i}" for i in range(n)]  # mps has no index
    return found


_LABELS = {"cuda": "CUDA", "mps": "MPS (Apple GPU)", "xpu": "XPU (Intel GPU)"}


def check_device(device: str) -> None:
    """Refuse a device torch does not know, or one this machine lacks (mps on Linux, an index out of
    range): checked against what torch reports, so the message lists the devices available here."""
    import torch

    here = ", ".join(available_devices())
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InputError(f"--device '{device}' is not a device: use one available here: {here}") from None
    count = _count(dev.type)
    label = _LABELS.get(dev.type, dev.type)
    if count == 0:
        raise InputError(f"--device {device}: no {label} device is available on this machine; available here: {here}")
    if dev.index is not None and dev.index >= count:
        raise InputError(f"--device {device}: this machine has {count} {label} device(s); available here: {here}")


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def check_writable_dir(path: str | Path, option: str = "--out", *, inside: bool = False) -> None:
    """`path` is a folder rana can create (or replace): its nearest existing ancestor is a folder in
    which a file can really be made (permissions, read-only mounts, /proc, a file in the way).
    With `inside`, an existing `path` is written into (a resumable sweep folder), so it is probed."""
    path = Path(os.path.expanduser(str(path)))
    if path.exists() and not path.is_dir():
        raise InputError(f"{option} '{path}' is a file, not a folder: choose another {option}")
    # outputs are written beside `path`, then renamed into place
    parent = path if inside and path.is_dir() else _nearest_existing(path.parent)
    if not parent.is_dir():
        raise InputError(f"{option} '{path}' cannot be created: '{parent}' is a file, not a folder; choose another "
                         f"{option}")
    _probe(parent, option, path)


def check_writable_file(path: str | Path, option: str = "--json") -> None:
    """`path` is a file that can be written once the work is done (checked now, not after it)."""
    path = Path(os.path.expanduser(str(path)))
    if path.is_dir():
        raise InputError(f"{option} '{path}' is a folder: name a file, e.g. {path / 'results.json'}")
    parent = _nearest_existing(path.parent)
    if not parent.is_dir():
        raise InputError(f"{option} '{path}' cannot be created: '{parent}' is a file, not a folder; choose another "
                         f"{option}")
    if path.exists() and not os.access(path, os.W_OK):
        raise InputError(f"{option} '{path}' exists and is read-only: choose another {option}")
    _probe(parent, option, path)


def _probe(folder: Path, option: str, target: Path) -> None:
    """Make (and remove) a temp folder in `folder`: the only test that also holds for root and read-only mounts."""
    try:
        probe = tempfile.mkdtemp(prefix=".rana-write-check-", dir=folder)
    except OSError as e:
        reason = {errno.EROFS: "it is on a read-only file system", errno.EACCES: "permission denied",
                  errno.EPERM: "permission denied", errno.ENOSPC: "no space left on the device"}.get(
            e.errno, e.strerror or type(e).__name__)
        raise InputError(f"{option} '{target}' cannot be written: '{folder}' is not writable ({reason}); choose "
                         f"another {option}") from None
    os.rmdir(probe)


def max_positions(reference: str) -> int | None:
    """The longest sequence `reference`'s config allows (None when unknown or unreadable: loading the
    model reports those problems itself)."""
    try:  # as the load reads it: an export's stock config, never code shipped in a folder (no prompt)
        config = model_config(reference)
    except Exception:  # noqa: BLE001 - unreadable here: the load itself says why
        return None
    config = getattr(config, "text_config", None) or config
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_seq_len(reference: str, seq_len: int, option: str = "--seq-len") -> None:
    """Refuse a window longer than the model's position table (it would silently run past it)."""
    limit = max_positions(reference)
    if limit is not None and seq_len > limit:
        raise InputError(f"{option} {seq_len} is longer than '{reference}' supports ({limit} positions, "
                         f"max_position_embeddings); pass {option} {limit} or less")


def check_available(reference: str) -> None:
    """Fail before any work on a model that cannot be found: an unknown alias or path (`resolve`), or a
    hub id that is neither cached while offline nor on the hub."""
    src = resolve(str(reference))
    if src.gguf_file or Path(src.path).exists():
        return
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(src.path, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ModelLoadError(f"'{reference}' is not a local folder and not in the Hugging Face cache, and "
                             "HF_HUB_OFFLINE=1 is set: check the path, or download the model first")
    try:
        from huggingface_hub import repo_exists

        exists = repo_exists(src.path)
    except Exception:  # noqa: BLE001 - no network or hub trouble: the load itself reports it
        return
    if not exists:
        raise ModelLoadError(f"'{reference}' is neither a local folder nor a model on the Hugging Face hub: check "
                             "the path or the hub id (owner/name)")


def check_inputs(*models: str, seq_len: int | None = None, out=None, json_out=None, data=(), data_option="--ppl-data",
                 offload_dir=None, out_inside: bool = False, data_tokens: int | None = None,
                 text_column: str | None = None) -> None:
    """Everything a command can check before loading a model: the models exist, the window fits their
    position table, data files are readable text (as far as a read of `data_tokens` tokens reaches; None:
    whole, as the read), and the outputs can be written."""
    for ref in models:
        if not is_rana_dir(ref):
            check_available(ref)
    for source in data:
        check_source(source, data_option, tokens=data_tokens, text_column=text_column)
    for ref in models:
        if seq_len is not None:
            check_seq_len(ref, seq_len)
    if out is not None:
        check_writable_dir(out, "--out", inside=out_inside)
    if offload_dir is not None:
        check_writable_dir(offload_dir, "--offload-dir")
    if json_out is not None:
        check_writable_file(json_out, "--json")
