"""Where rana may write: the rules every command applies to its outputs before any work starts.

* An output never overlaps an input: not the same path, not a folder holding an input, not a
  folder inside one (`rana compress proj/model --out proj --overwrite` must not delete the model).
* `--overwrite` replaces only a folder rana itself wrote, recognised by its own files
  (`rana_config.json`, an export's `modeling_rana.py`, a sweep's `points/`, a fine-tune's
  `.checkpoints/`), or an empty folder; anything else is left alone with one line saying why.
* Work folders (`--offload-dir`, `--checkpoint-dir`) obey the same overlap rule.
* Temp folders beside an output carry the writing process's id and host; the next write beside
  that output removes those whose process is gone (a kill during save leaves nothing for good).
* What is written gets the user's umask (temp folders are created private, 0700).
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterable


class UnsafeOutputError(ValueError):
    """An output or work folder that would overwrite or overlap an input (user-facing)."""


class OutputExistsError(ValueError):
    """The output folder exists and --overwrite was not given (user-facing)."""


# files / folders that only rana writes, one set per kind of output
_SIGNATURES = {
    "rana folder": ("rana_config.json",),
    "exported model": ("modeling_rana.py", "configuration_rana.py"),
    "sweep folder": ("results.json", "points"),
    "fine-tune run": (".checkpoints",),
}
# sub-folders rana writes inside its outputs; any other folder inside means someone else's data
_OWN_SUBFOLDERS = {".checkpoints", "points", "models"}


def _abs(path: str | os.PathLike) -> Path:
    """Absolute path with symlinks resolved where they exist (so `a/../b` and links compare equal)."""
    return Path(os.path.expanduser(str(path))).resolve()


def overlaps(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """True when a and b are the same path or one contains the other."""
    a, b = _abs(a), _abs(b)
    return a == b or a in b.parents or b in a.parents


def local_inputs(*references: str | os.PathLike | None) -> list[Path]:
    """The local files / folders among model and data references (hub ids and dataset names are
    not local and are skipped). A `.gguf` reference counts as its file."""
    found = []
    for ref in references:
        if ref is None or str(ref) == "":
            continue
        p = Path(os.path.expanduser(str(ref)))
        if p.exists():
            found.append(p)
            continue
        # hub "name:config:split" data references and aliases: look for a local path prefix
        head = str(ref).split(":", 1)[0]
        if head != str(ref) and Path(os.path.expanduser(head)).exists():
            found.append(Path(os.path.expanduser(head)))
    return found


def rana_output_kind(path: str | os.PathLike) -> str | None:
    """Which kind of rana output the folder is, or None when rana did not write it."""
    p = Path(path)
    if not p.is_dir() or p.is_symlink():
        return None
    for kind, names in _SIGNATURES.items():
        if any((p / n).exists() for n in names):
            return kind
    return None


def check_no_overlap(path: str | os.PathLike, inputs: Iterable[str | os.PathLike], option: str = "--out") -> None:
    """Raise UnsafeOutputError when `path` is, contains or lies inside one of `inputs`."""
    for src in inputs:
        if overlaps(path, src):
            a, b = _abs(path), _abs(src)
            how = "is" if a == b else ("contains" if a in b.parents else "is inside")
            raise UnsafeOutputError(f"{option} '{path}' {how} the input '{src}'; choose a {option} outside every input "
                                    "(nothing was written)")


def check_output(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), *, overwrite: bool = False,
                 option: str = "--out", resumable: tuple[str, ...] = ()) -> None:
    """Validate an output folder before any work.

    Refused: overlap with an input; an existing path without `overwrite` (unless it is one of
    the `resumable` kinds of rana output, e.g. a sweep folder re-run to resume); with `overwrite`,
    a path rana did not write, or a rana folder holding folders rana does not write."""
    out_p = Path(os.path.expanduser(str(out)))
    inputs = list(inputs)
    check_no_overlap(out_p, inputs, option)
    if not out_p.exists() and not out_p.is_symlink():
        return
    if out_p.is_symlink() or not out_p.is_dir():
        raise UnsafeOutputError(f"{option} '{out}' exists and is not a folder; rana replaces only folders it wrote: "
                                f"choose another {option}")
    entries = list(out_p.iterdir())
    kind = rana_output_kind(out_p)
    if not overwrite:
        if resumable and (not entries or kind in resumable):
            return  # re-running into its own folder resumes
        if resumable:
            raise UnsafeOutputError(f"{option} '{out}' exists and is not a {resumable[0]} (nor empty); rana writes only "
                                    f"into its own folders: choose a new or empty {option}")
        raise OutputExistsError(f"output folder '{out}' already exists; choose another {option} or pass --overwrite")
    if not entries:
        return  # an empty folder: nothing to lose
    if kind is None:
        raise UnsafeOutputError(f"{option} '{out}' exists and was not written by rana (no rana_config.json, "
                                f"modeling_rana.py or results.json): --overwrite replaces only rana's own folders; "
                                f"choose another {option} or remove it yourself")
    foreign = sorted(e.name for e in entries if e.is_dir() and e.name not in _OWN_SUBFOLDERS)
    if foreign:
        raise UnsafeOutputError(f"{option} '{out}' holds folders rana did not write ({', '.join(foreign[:3])}); "
                                f"--overwrite would delete them: choose another {option} or move them out")


def check_work_dir(path: str | os.PathLike | None, inputs: Iterable[str | os.PathLike], option: str,
                   outputs: Iterable[str | os.PathLike] = ()) -> None:
    """A work folder (--offload-dir, --checkpoint-dir) must not overlap an input (nor an output
    that is replaced when the run finishes)."""
    if path is None:
        return
    check_no_overlap(path, inputs, option)
    for out in outputs:
        if overlaps(path, out):
            raise UnsafeOutputError(f"{option} '{path}' overlaps the output '{out}', which is replaced when the run "
                                    f"finishes; choose a separate {option}")


def check_output_file(path: str | os.PathLike | None, inputs: Iterable[str | os.PathLike], option: str) -> None:
    """An output file (e.g. --json) must not replace an input nor a file inside an input folder
    (a new file beside a model's files is fine)."""
    if path is None:
        return
    p = Path(os.path.expanduser(str(path)))
    for src in inputs:
        a, b = _abs(p), _abs(src)
        if a == b or b in a.parents and (p.exists() or p.is_symlink()) or a in b.parents:
            raise UnsafeOutputError(f"{option} '{path}' would overwrite the input '{src}' (or a file in it); choose "
                                    f"another {option} (nothing was written)")


# ------------------------------------------------------------------------------ temp folders


def _host_tag() -> str:
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]


def temp_prefix(out: Path, what: str = "tmp") -> str:
    """`.NAME.rana-tmp-HOST-PID-`: a temp name next to `out` that says who made it."""
    return f".{out.name}.rana-{what}-{_host_tag()}-{os.getpid()}-"


_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.rana-(?:tmp|old)-(?P<host>[0-9a-f]{6})-(?P<pid>\d+)-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(out: Path) -> list[Path]:
    """Remove temp folders beside `out` left by killed runs on this host (a live run's are kept)."""
    out = Path(out)
    removed = []
    if not out.parent.is_dir():
        return removed
    host = _host_tag()
    for p in out.parent.glob(f".{glob_escape(out.name)}.rana-*"):
        m = _TEMP_RE.match(p.name)
        if not m or m.group("name") != out.name or m.group("host") != host:
            continue
        pid = int(m.group("pid"))
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def apply_umask(folder: Path) -> None:
    """Give a folder written through a private temp folder the modes of ordinary files: 0777 / 0666
    minus the user's umask (mkdtemp makes 0700, some writers 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    dir_mode, file_mode = 0o777 & ~umask, 0o666 & ~umask
    for root, dirs, files in os.walk(folder):
        os.chmod(root, dir_mode)
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                os.chmod(p, file_mode)


def written_files(folder: Path) -> str:
    """The files a finished output folder really holds, for the success message."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(folder).iterdir())
    return ", ".join(names)


__all__ = ["UnsafeOutputError", "OutputExistsError", "overlaps", "local_inputs", "rana_output_kind", "check_no_overlap",
           "check_output", "check_output_file", "check_work_dir", "temp_prefix", "remove_stale_temps", "apply_umask", "written_files"]
