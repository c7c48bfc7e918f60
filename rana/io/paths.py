"""Where rana may write: the rules every command applies to its outputs before any work starts.

* An output never overlaps an input: not the same path, not a folder holding an input, not a
  folder inside one (`rana compress proj/model --out proj --overwrite` must not delete the model).
* `--overwrite` replaces only a folder rana itself wrote, proven by the manifest rana writes last
  into every folder it creates (`.rana-manifest.json`: each file with its size): every file there
  must be listed and unchanged, else one line names the first that is not. A file with one of
  rana's names proves nothing (a user's `results.json`); a folder of an older rana (no manifest)
  is left to the user. An empty folder is replaced too: nothing to lose.
* Work folders (`--offload-dir`, `--checkpoint-dir`) obey the same overlap rule.
* Temp folders beside an output carry the writing process's id and host; the next write beside
  that output removes those whose process is gone (a kill during save leaves nothing for good).
  Their names (~35 bytes longer than the output's) are checked against the file system's limit
  up front, not after the work.
* What is written gets the user's umask (temp folders are created private, 0700).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Iterable
from ..errors import UserError


class UnsafeOutputError(UserError):
    """An output or work folder that would overwrite or overlap an input (user-facing)."""


class OutputExistsError(UserError):
    """The output folder exists and --overwrite was not given (user-facing)."""


MANIFEST = ".rana-manifest.json"  # what rana wrote into a folder: {"kind", "files": {relative path: size}, "dirs"}
SWEEP_KIND = "sweep folder"  # a folder `rana sweep` writes into as it goes (resumable)

# files / folders that rana wrote before it wrote manifests: only used to word a refusal, never to decide
_SIGNATURES = {
    "rana folder": ("rana_config.json",),
    "exported model": ("modeling_rana.py", "configuration_rana.py"),
    "sweep folder": ("results.json", "points"),
    "fine-tune run": (".checkpoints",),
}
# a fine-tune's checkpoint folder grows while it trains, so it carries no manifest of its own: each
# checkpoint lists its files in trainer_state.json (names as in rana.finetune.checkpoints)
CHECKPOINTS, CKPT_PREFIX, TRAINER_STATE, TRAIN_LOG = ".checkpoints", "checkpoint-", "trainer_state.json", "train_log.jsonl"


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


# ------------------------------------------------------------------------------ the manifest


def _tree(folder: Path) -> tuple[dict[str, int], set[str]]:
    """Every file (with its size) and every folder under `folder`, as relative paths; links are
    files here (never followed: a link is never deleted through)."""
    files, dirs = {}, set()
    for root, dirnames, filenames in os.walk(folder):
        rel = Path(root).relative_to(folder)
        for d in list(dirnames):
            if os.path.islink(os.path.join(root, d)):
                dirnames.remove(d)
                filenames.append(d)
            else:
                dirs.add((rel / d).as_posix())
        for f in filenames:
            files[(rel / f).as_posix()] = os.lstat(os.path.join(root, f)).st_size
    return files, dirs


def write_manifest(folder: str | os.PathLike, kind: str = "rana output") -> Path:
    """List everything in `folder` as rana's own (call it only on a folder rana just filled: its
    temp folder before the rename). Written last, so a folder with a manifest is complete."""
    folder = Path(folder)
    files, dirs = _tree(folder)
    files.pop(MANIFEST, None)
    path = folder / MANIFEST
    tmp = folder / f".{MANIFEST}.tmp"  # replaced whole: a kill never leaves half a manifest
    tmp.write_text(json.dumps({"written_by": "rana", "kind": kind, "files": files, "dirs": sorted(dirs)}, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The folder's manifest, None when it has none or one rana cannot read (then nothing is rana's)."""
    try:
        m = json.loads((Path(folder) / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    ok = isinstance(m, dict) and isinstance(m.get("files"), dict) and isinstance(m.get("dirs", []), list)
    return m if ok else None


def claim_folder(folder: str | os.PathLike, kind: str) -> None:
    """Create a folder rana fills as it goes (a sweep, resumable) and mark it as rana's `kind`, once:
    called after check_output found it new, empty or already of that kind. Its manifest lists what
    was there then (nothing), so a later --overwrite by another command still refuses it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if read_manifest(folder) is None:
        write_manifest(folder, kind)


def _foreign(files: dict[str, int], dirs: set[str], listed: dict, listed_dirs: set) -> str | None:
    """The first path (sorted) that is not listed, or a listed file whose size changed."""
    for rel in sorted(set(files) | dirs):
        if rel in dirs:
            if rel not in listed_dirs:
                return f"holds '{rel}/', which rana did not write: move it out"
        elif rel not in listed:
            return f"holds '{rel}', which rana did not write: move it out"
        elif listed[rel] != files[rel]:
            return f"holds '{rel}', changed since rana wrote it ({files[rel]} bytes, {listed[rel]} written): move it out"
    return None


def _checkpoint_files(checkpoint: Path) -> set[str]:
    """The files a finished checkpoint lists in its trainer_state.json (empty when unreadable)."""
    try:
        listed = json.loads((checkpoint / TRAINER_STATE).read_text(encoding="utf-8")).get("files")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return set()
    return set(listed) | {TRAINER_STATE} if isinstance(listed, dict) else set()


def checkpoints_problem(folder: str | os.PathLike) -> str | None:
    """None when `folder` holds only what a fine-tune writes into its checkpoint folder: its train
    log, temp checkpoints of a killed save, and checkpoints whose every file their trainer state
    lists (sizes are verify_checkpoint's business: a damaged checkpoint is still rana's)."""
    folder = Path(folder)
    for entry in sorted(folder.iterdir()):
        name, is_dir = entry.name, entry.is_dir() and not entry.is_symlink()
        if (name == TRAIN_LOG and entry.is_file() and not entry.is_symlink()) or \
                (is_dir and name.startswith(f".tmp-{CKPT_PREFIX}")):
            continue
        if not (is_dir and name.startswith(CKPT_PREFIX)):
            return f"holds '{folder.name}/{name}', which rana did not write: move it out"
        files, _ = _tree(entry)
        extra = sorted(set(files) - _checkpoint_files(entry))
        if extra:
            return f"holds '{folder.name}/{name}/{extra[0]}', which rana did not write: move it out"
    return None


def ownership_problem(folder: str | os.PathLike) -> str | None:
    """None when everything in `folder` is rana's: listed in its manifest, unchanged in size (plus a
    fine-tune's checkpoint folder, which grows while it trains); else what is not, as one phrase."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    files, dirs = _tree(folder)
    files.pop(MANIFEST, None)
    ckpt = folder / CHECKPOINTS
    if CHECKPOINTS in dirs:  # judged by its own rules; the manifest of the finished run does not list it
        problem = checkpoints_problem(ckpt)
        if problem is not None:
            return problem
        files = {k: v for k, v in files.items() if not k.startswith(CHECKPOINTS + "/")}
        dirs = {d for d in dirs if d != CHECKPOINTS and not d.startswith(CHECKPOINTS + "/")}
    if manifest is None:
        if not files and not dirs:
            return None  # only an unfinished fine-tune's checkpoints
        # a folder of an older rana (no manifest) is told apart from a user's by nothing but guessing
        return (f"has no {MANIFEST}: not written by rana, or by an older rana that did not list its files, so rana "
                "cannot tell its files from yours: delete it yourself")
    return _foreign(files, dirs, manifest["files"], set(manifest.get("dirs", [])))


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

    Refused: overlap with an input; a name whose temp folder is too long; an existing path without
    `overwrite` (unless its manifest says it is one of the `resumable` kinds, e.g. a sweep folder
    re-run to resume); with `overwrite`, a folder holding anything rana did not write."""
    out_p = Path(os.path.expanduser(str(out)))
    check_no_overlap(out_p, list(inputs), option)
    check_temp_name(out_p, option)
    if not out_p.exists() and not out_p.is_symlink():
        return
    if out_p.is_symlink() or not out_p.is_dir():
        raise UnsafeOutputError(f"{option} '{out}' exists and is not a folder; rana replaces only folders it wrote: "
                                f"choose another {option}")
    empty = not any(out_p.iterdir())
    if not overwrite:
        if resumable and (empty or (read_manifest(out_p) or {}).get("kind") in resumable):
            return  # re-running into its own folder resumes
        if resumable:
            older = f" (a {resumable[0]} of an older rana, without {MANIFEST}, cannot be resumed)" \
                if rana_output_kind(out_p) == resumable[0] else ""
            raise UnsafeOutputError(f"{option} '{out}' exists and is not a {resumable[0]} (nor empty){older}; rana writes "
                                    f"only into its own folders: choose a new or empty {option}")
        raise OutputExistsError(f"output folder '{out}' already exists; choose another {option} or pass --overwrite")
    if empty:
        return  # nothing to lose
    problem = ownership_problem(out_p)
    if problem is not None:
        raise UnsafeOutputError(f"{option} '{out}' {problem} or choose another {option} (--overwrite replaces only "
                                "what rana wrote)")


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


MKDTEMP_SUFFIX = 8  # random characters tempfile.mkdtemp appends to the prefix


def _name_max(folder: Path) -> int:
    """The longest file name (bytes) the file system holding `folder` (or its nearest existing parent) allows."""
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return os.pathconf(p, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_temp_name(out: str | os.PathLike, option: str = "--out", depth: int = 1) -> None:
    """The temp folders rana writes beside `out` (`depth` nested: a fine-tune saves inside one) fit
    the file system's name limit; checked up front, or the work would fail only when it is saved."""
    out = Path(os.path.expanduser(str(out)))
    if not out.name:
        return
    longest = out.name
    for _ in range(depth):
        longest = temp_prefix(Path(longest)) + "x" * MKDTEMP_SUFFIX
    size, limit = len(os.fsencode(longest)), _name_max(out.parent)
    if size > limit:
        room = limit - (size - len(os.fsencode(out.name)))
        raise UnsafeOutputError(f"{option} '{out}' is too long a name: the temp folder rana writes beside it takes "
                                f"{size} bytes, over this file system's {limit} per name; choose a name of at most "
                                f"{max(room, 1)} bytes (nothing was written)")


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


__all__ = ["UnsafeOutputError", "OutputExistsError", "MANIFEST", "SWEEP_KIND", "overlaps", "local_inputs", "rana_output_kind",
           "write_manifest", "read_manifest", "claim_folder", "ownership_problem", "checkpoints_problem", "check_no_overlap", "check_output",
           "check_output_file", "check_work_dir", "check_temp_name", "temp_prefix", "remove_stale_temps", "apply_umask",
           "written_files"]
