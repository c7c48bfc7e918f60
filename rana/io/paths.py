"""Where rana may write: the rules every command applies to its outputs and work folders before any work starts.

* An output never overlaps an input: not the same path, not a folder holding an input, not a
  folder inside one (`rana compress proj/model --out proj --overwrite` must not delete the model).
* One ownership rule for every folder rana writes into or deletes from (an --out it replaces, an
  --offload-dir, a --checkpoint-dir): it is new, empty, or proven rana's, checked before any work.
  The proof is the manifest rana writes into the folder (`.rana-manifest.json`: each file with its
  size and sha256; a work folder's also what rana writes as it goes): every file there must be listed
  and unchanged by content, else one line names the first that is not and says what to do. A
  fine-tune's checkpoint folder is proven by rana's own checkpoint records (`checkpoints_problem`).
  A file with one of rana's names proves nothing (a user's `results.json`, a Hugging Face
  `checkpoint-1/`); a folder of an older rana (no manifest, or one of sizes only) is left to the user.
  An empty folder is used too: nothing to lose. Manifests are read with a size and depth bound
  (rana.io.jsonfile): an unreadable one makes nothing rana's.
* An output is replaced whole, so it is never the working directory or a folder holding it, and is
  named by its own name (not '..'): its temp folder, beside it, must not land inside it.
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
import stat
from pathlib import Path
from typing import Iterable
from ..errors import UserError
from .jsonfile import MAX_BYTES, JsonFileError, read_json


class UnsafeOutputError(UserError):
    """An output or work folder that would overwrite or overlap an input (user-facing)."""


class OutputExistsError(UserError):
    """The output folder exists and --overwrite was not given (user-facing)."""


# what rana wrote into a folder: {"written_by": "rana", "format": 2, "kind", "files": {relative path: {"size",
# "sha256"}}, "dirs": [...], "growing": [files or folders rana writes as it goes: rana's whatever they hold]}
# (format 1, of an older rana: "files": {relative path: size}, read but never trusted to replace a folder)
MANIFEST = ".rana-manifest.json"
_MANIFEST_TMP = f".{MANIFEST}.tmp"  # the manifest's next version, renamed over it (a kill may leave it)
MANIFEST_FORMAT = 2
MANIFEST_MAX_BYTES = MAX_BYTES  # a manifest lists one entry (~120 bytes) per file: 16 MiB is ~100,000 files
SWEEP_KIND = "sweep folder"  # a folder `rana sweep` writes into as it goes (resumable)
OFFLOAD_KIND = "offload folder"  # --offload-dir: compressed layers and spilled activations (reused by a re-run)
CHECKPOINT_KIND = "checkpoint folder"  # --checkpoint-dir (or OUT/.checkpoints): a fine-tune's checkpoints
# the kind of work folder each option names (rana.io.paths.check_work_dir)
WORK_FOLDER_KINDS = {"--offload-dir": OFFLOAD_KIND, "--checkpoint-dir": CHECKPOINT_KIND}

# files / folders that rana wrote before it wrote manifests: only used to word a refusal, never to decide
_SIGNATURES = {
    "rana folder": ("rana_config.json",),
    "exported model": ("modeling_rana.py", "configuration_rana.py"),
    "sweep folder": ("results.json", "points"),
    "fine-tune run": (".checkpoints",),
}
# a fine-tune's checkpoint folder (names as in rana.finetune.checkpoints)
CHECKPOINTS, CKPT_PREFIX, TRAINER_STATE, TRAIN_LOG = ".checkpoints", "checkpoint-", "trainer_state.json", "train_log.jsonl"
# a trainer state holds the run's log so far, one record (~250 bytes) per optimizer step: bounded, but far
# above rana.io.jsonfile's default, so a run of about a million steps still resumes
TRAINER_STATE_MAX_BYTES = 256 * 2**20


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


def _tree(folder: Path, skip: Iterable[str] = ()) -> tuple[dict[str, int], set[str]]:
    """Every file (with its size) and every folder under `folder`, as relative paths, but for the
    top-level names in `skip`; links are files here (never followed: a link is never deleted through)."""
    files, dirs, skip = {}, set(), set(skip)
    for root, dirnames, filenames in os.walk(folder):
        rel = Path(root).relative_to(folder)
        for d in list(dirnames):
            if rel == Path(".") and d in skip:
                dirnames.remove(d)
            elif os.path.islink(os.path.join(root, d)):
                dirnames.remove(d)
                filenames.append(d)
            else:
                dirs.add((rel / d).as_posix())
        for f in filenames:
            if rel == Path(".") and f in skip:
                continue
            files[(rel / f).as_posix()] = os.lstat(os.path.join(root, f)).st_size
    return files, dirs


_DIGESTS: dict[tuple, str] = {}  # (device, inode, size, mtime, ctime) -> sha256: one process hashes a file once


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's content; of a link's target name (never followed); a marker for anything
    else (a pipe is never opened: reading it would block). Cached per process by the file's identity and
    times, so checking a folder twice (before the work and before the swap) reads it once."""
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        return "link:" + hashlib.sha256(os.fsencode(os.readlink(path))).hexdigest()
    if not stat.S_ISREG(st.st_mode):
        return f"not a regular file ({stat.filemode(st.st_mode)})"
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    if key not in _DIGESTS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 22), b""):
                h.update(block)
        if len(_DIGESTS) > 4096:
            _DIGESTS.clear()
        _DIGESTS[key] = h.hexdigest()
    return _DIGESTS[key]


def _entry(path: Path) -> dict:
    return {"size": os.lstat(path).st_size, "sha256": file_sha256(path)}


def _parents(rel: str) -> list[str]:
    parts = rel.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _store(folder: Path, manifest: dict) -> Path:
    """Write `manifest` as the folder's, replaced whole (a kill never leaves half a manifest)."""
    manifest = {"written_by": "rana", "format": MANIFEST_FORMAT, "kind": manifest.get("kind", "rana output"),
                "files": dict(sorted(manifest.get("files", {}).items())), "dirs": sorted(set(manifest.get("dirs", []))),
                "growing": sorted(set(manifest.get("growing", [])))}
    path, tmp = folder / MANIFEST, folder / _MANIFEST_TMP
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def write_manifest(folder: str | os.PathLike, kind: str = "rana output") -> Path:
    """List everything in `folder`, each file with its size and sha256, as rana's own (call it only on
    a folder rana just filled: its temp folder before the rename). Written last, so a folder with a
    manifest is complete."""
    folder = Path(folder)
    files, dirs = _tree(folder, skip=(MANIFEST, _MANIFEST_TMP))
    return _store(folder, {"kind": kind, "files": {rel: _entry(folder / rel) for rel in files}, "dirs": dirs})


def _valid_manifest(m) -> bool:
    def entry(e) -> bool:  # format 2: {"size", "sha256"}; format 1 (older rana): the size alone
        return (isinstance(e, int) and not isinstance(e, bool)) or (
            isinstance(e, dict) and isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str))

    return (isinstance(m, dict) and isinstance(m.get("files"), dict) and all(map(entry, m["files"].values()))
            and all(isinstance(m.get(k, []), list) and all(isinstance(x, str) for x in m.get(k, []))
                    for k in ("dirs", "growing")))


def _load_manifest(folder: Path) -> tuple[dict | None, str | None]:
    """(the folder's manifest, None), or (None, why not) when it has none (why: None) or one rana cannot
    read: too large, too deep, not JSON, not a manifest (read with rana.io.jsonfile's bounds, so a
    125 MB or 100,000-deep file costs one line, not the process). An unreadable manifest makes
    nothing rana's."""
    path = Path(folder) / MANIFEST
    if not path.is_file() or path.is_symlink():
        return None, None
    try:
        m = read_json(path, MANIFEST, max_bytes=MANIFEST_MAX_BYTES)
    except JsonFileError as e:
        return None, str(e)
    return (m, None) if _valid_manifest(m) else (None, f"{MANIFEST} is not a manifest rana wrote")


def read_manifest(folder: str | os.PathLike) -> dict | None:
    """The folder's manifest, None when it has none or one rana cannot read (then nothing is rana's)."""
    return _load_manifest(Path(folder))[0]


def claim_folder(folder: str | os.PathLike, kind: str, *, dirs: Iterable[str] = (),
                 growing: Iterable[str] = ()) -> None:
    """Create a folder rana fills as it goes (a sweep, an offload folder) and mark it as rana's `kind`:
    called after the checks found it new, empty or already of that kind. A new manifest lists only
    `dirs` (folders rana will make) and `growing` (what rana writes as it goes); what rana writes later
    it records with `update_manifest`, so a later --overwrite by another command refuses what is not."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    manifest = read_manifest(folder)
    if manifest is None or manifest.get("kind") != kind:
        manifest = {"kind": kind, "files": {}, "dirs": [], "growing": []}
    _store(folder, {**manifest, "dirs": [*manifest.get("dirs", []), *dirs],
                    "growing": [*manifest.get("growing", []), *growing]})


def update_manifest(folder: str | os.PathLike, kind: str, *, written: Iterable[str] = (), growing: Iterable[str] = (),
                    dirs: Iterable[str] = (), forget: Iterable[str] = ()) -> None:
    """Record in a claimed folder's manifest what rana just did (relative paths): `written` files (their
    size and sha256 now: no longer growing), `growing` files or folders it is about to write (rana's
    whatever they hold if a kill stops it mid-write), `dirs` it made, and `forget` what it removed."""
    folder = Path(folder)
    m = read_manifest(folder) or {"kind": kind}
    files, listed_dirs, grow = dict(m.get("files", {})), set(m.get("dirs", [])), set(m.get("growing", []))
    gone = set(forget)  # and everything under them
    files = {k: v for k, v in files.items() if not _under(k, gone)}
    listed_dirs = {d for d in listed_dirs if not _under(d, gone)}
    grow = {g for g in grow if not _under(g, gone)}
    for rel in [*dirs, *growing, *written]:
        listed_dirs.update(_parents(rel))
    listed_dirs.update(dirs)
    grow.update(growing)
    for rel in written:
        files[rel] = _entry(folder / rel)
        grow.discard(rel)
    _store(folder, {**m, "files": files, "dirs": listed_dirs, "growing": grow})


def _under(rel: str, roots: set[str]) -> bool:
    return rel in roots or any(rel.startswith(r + "/") for r in roots)


def _foreign(folder: Path, files: dict[str, int], dirs: set[str], manifest: dict) -> str | None:
    """The first path (sorted) that is not listed, or a listed file whose content changed (size, then
    sha256); what the manifest calls growing is rana's whatever it holds."""
    listed, listed_dirs, growing = manifest["files"], set(manifest.get("dirs", [])), set(manifest.get("growing", []))
    for rel in sorted(set(files) | dirs):
        if _under(rel, growing):
            continue
        if rel in dirs:
            if rel not in listed_dirs:
                return f"holds '{rel}/', which rana did not write: move it out"
        elif rel not in listed:
            return f"holds '{rel}', which rana did not write: move it out"
        elif files[rel] != listed[rel]["size"]:
            return (f"holds '{rel}', changed since rana wrote it ({files[rel]} bytes, {listed[rel]['size']} written): "
                    "move it out")
        elif file_sha256(folder / rel) != listed[rel]["sha256"]:
            return f"holds '{rel}', changed since rana wrote it (same size, other content): move it out"
    return None


def _sizes_only(manifest: dict) -> bool:
    """A manifest of an older rana (format 1): sizes, no content hashes."""
    return any(isinstance(e, int) for e in manifest["files"].values())


def _owned_problem(folder: Path, manifest: dict, skip: Iterable[str] = ()) -> str | None:
    """None when everything in `folder` (but `skip`) is what its manifest lists, each file unchanged by
    content; else what is not, as one phrase."""
    if _sizes_only(manifest):
        # An older rana recorded sizes only: a model card edited to the same length would pass a size
        # check and be lost. Refusing costs a user one `rm -r`; guessing could cost their edit.
        return (f"was written by an older rana, whose {MANIFEST} records sizes and not contents, so rana cannot tell "
                "a file you edited from its own: delete it yourself")
    files, dirs = _tree(folder, skip=(MANIFEST, _MANIFEST_TMP, *skip))
    return _foreign(folder, files, dirs, manifest)


def _first_entry(folder: Path) -> str:
    first = min(folder.iterdir(), key=lambda p: p.name)
    return first.name + ("/" if first.is_dir() and not first.is_symlink() else "")


# ------------------------------------------------------------------------------ a fine-tune's checkpoint folder
# It grows while the run trains. Its manifest (kind CHECKPOINT_KIND, written when the run claims it) records
# the checkpoints rana renamed into place ("dirs") and what it writes as it goes ("growing": the train log, a
# checkpoint being saved); each checkpoint lists its own files, with size and sha256, in its trainer_state.json
# (rana.finetune.checkpoints).


def _real_dir(p: Path) -> bool:
    return p.is_dir() and not p.is_symlink()


def _checkpoint_state(checkpoint: Path) -> dict | None:
    """A checkpoint's trainer state, None when unreadable (read with rana.io.jsonfile's bounds)."""
    try:
        state = read_json(checkpoint / TRAINER_STATE, TRAINER_STATE, max_bytes=TRAINER_STATE_MAX_BYTES)
    except JsonFileError:
        return None
    return state if isinstance(state, dict) else None


def _listed_files(state: dict | None) -> dict[str, list] | None:
    """The {file: [size, sha256]} a trainer state lists, None when it lists none in that form."""
    files = (state or {}).get("files")
    ok = isinstance(files, dict) and all(
        isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and isinstance(v[1], str) for v in files.values())
    return files if ok else None


def _checkpoint_problem(checkpoint: Path, recorded: bool) -> str | None:
    """None when the checkpoint folder is rana's, else what is not, as one phrase (relative names).

    Recorded in the folder's manifest: rana renamed it into place, so only a file its trainer state
    does not list is foreign; a listed file that changed, or an unreadable trainer state, makes it a
    damaged checkpoint of rana's (verify_checkpoint reports it and a resume falls back past it).
    Not recorded (a folder of an older rana, without a manifest): its trainer state must prove it:
    rana's fields and every file listed with its sha256, each unchanged. A Hugging Face Trainer's
    `checkpoint-N` has a trainer_state.json too, with none of these."""
    state = _checkpoint_state(checkpoint)
    listed = _listed_files(state)
    files, _ = _tree(checkpoint)
    if listed is None and recorded:
        return None  # a damaged trainer state: which files are the checkpoint's cannot be told
    ranas = listed is not None and isinstance(state.get("step"), int) and (
        state.get("written_by") == "rana" or "config_hash" in state)  # an older rana wrote no mark
    if not (recorded or ranas):
        return f"holds '{checkpoint.name}/', which rana did not write: move it out"
    extra = sorted(set(files) - set(listed) - {TRAINER_STATE})
    if extra:
        return f"holds '{checkpoint.name}/{extra[0]}', which rana did not write: move it out"
    if recorded:
        return None
    for name, (size, digest) in sorted(listed.items()):
        if files.get(name) != size or file_sha256(checkpoint / name) != digest:
            return (f"holds '{checkpoint.name}/{name}', missing or changed since rana wrote it (a checkpoint of an "
                    "older rana counts as rana's only while unchanged): move it out")
    return None


def _checkpoint_manifest(folder: Path) -> tuple[dict | None, str | None]:
    """(the checkpoint folder's manifest or None, why it cannot be used: another kind, unreadable)."""
    manifest, why = _load_manifest(folder)
    if manifest is not None and manifest.get("kind") != CHECKPOINT_KIND:
        return None, f"was written by rana as '{manifest.get('kind')}', not as '{CHECKPOINT_KIND}': empty it"
    return manifest, (f"has a {MANIFEST} rana cannot read ({why}): move it out" if why else None)


def checkpoints_problem(folder: str | os.PathLike, prefix: str = "") -> str | None:
    """None when `folder` holds only what a fine-tune of rana's wrote into its checkpoint folder: what
    its manifest records (checkpoints, the train log, a save a kill interrupted); in a folder of an
    older rana (no manifest), checkpoints their trainer state proves rana's, and beside them that run's
    train log and interrupted saves. Else the first entry that is not, as one phrase (`prefix` before
    the names: '.checkpoints/' when judged inside an --out)."""
    folder = Path(folder)
    manifest, why = _checkpoint_manifest(folder)
    if why is not None:
        return why
    recorded = set(manifest["dirs"]) if manifest else set()
    growing = set(manifest.get("growing", [])) if manifest else set()
    entries = sorted(folder.iterdir(), key=lambda p: p.name)
    verdicts = {e.name: _checkpoint_problem(e, e.name in recorded) for e in entries
                if _real_dir(e) and e.name.startswith(CKPT_PREFIX) and e.name not in growing}
    # an older rana's run is known by its checkpoints; its train log and interrupted saves lie beside them
    older_run = manifest is None and any(v is None for v in verdicts.values())
    for e in entries:
        name = e.name
        if name in verdicts:
            problem = verdicts[name]
        elif name in growing or (manifest is not None and name in (MANIFEST, _MANIFEST_TMP) and e.is_file()):
            problem = None
        elif older_run and ((name == TRAIN_LOG and e.is_file() and not e.is_symlink())
                            or (_real_dir(e) and name.startswith(f".tmp-{CKPT_PREFIX}"))):
            problem = None
        else:
            problem = f"holds '{name}{'/' if _real_dir(e) else ''}', which rana did not write: move it out"
        if problem is not None:
            return problem.replace("holds '", f"holds '{prefix}", 1)
    return None


def rana_checkpoints(folder: str | os.PathLike) -> list[Path]:
    """The checkpoints in `folder` that rana wrote (recorded in its manifest, or proven by their trainer
    state in a folder of an older rana), in no order: the only ones a run resumes, prunes or replaces."""
    folder = Path(folder)
    if not _real_dir(folder):
        return []
    manifest, why = _checkpoint_manifest(folder)
    if why is not None:
        return []
    recorded = set(manifest["dirs"]) if manifest else None
    return [e for e in folder.iterdir() if _real_dir(e) and e.name.startswith(CKPT_PREFIX)
            and (recorded is None or e.name in recorded) and _checkpoint_problem(e, recorded is not None) is None]


# ------------------------------------------------------------------------------ who owns a folder


def ownership_problem(folder: str | os.PathLike) -> str | None:
    """None when everything in `folder` is rana's: listed in its manifest, unchanged by content (plus a
    fine-tune's checkpoint folder, which grows while it trains); else what is not, as one phrase."""
    folder = Path(folder)
    ckpt = folder / CHECKPOINTS
    if _real_dir(ckpt):  # judged by its own rules; the manifest of the finished run does not list it
        problem = checkpoints_problem(ckpt, prefix=CHECKPOINTS + "/")
        if problem is not None:
            return problem
    manifest, why = _load_manifest(folder)
    if manifest is None:
        if all(p.name == CHECKPOINTS and _real_dir(p) for p in folder.iterdir()):
            return None  # only an unfinished fine-tune's checkpoints
        if why is not None:
            return (f"has a {MANIFEST} rana cannot read ({why}), so rana cannot tell its files from yours: delete it "
                    "yourself")
        # a folder of an older rana (no manifest) is told apart from a user's by nothing but guessing
        return (f"has no {MANIFEST}: not written by rana, or by an older rana that did not list its files, so rana "
                "cannot tell its files from yours: delete it yourself")
    return _owned_problem(folder, manifest, skip=(CHECKPOINTS,))


def work_folder_problem(path: str | os.PathLike, kind: str) -> str | None:
    """None when rana may write into (and delete from) the work folder `path` of `kind` (OFFLOAD_KIND,
    CHECKPOINT_KIND): it is new, empty, or rana's as that kind (its manifest lists every file, each
    unchanged; a checkpoint folder: rana's own checkpoint records). Else what is wrong, as one phrase
    naming the first foreign entry."""
    p = Path(os.path.expanduser(str(path)))
    if not p.exists() and not p.is_symlink():
        return None
    if not p.is_dir():
        return "exists and is not a folder"
    if not any(p.iterdir()):
        return None
    if kind == CHECKPOINT_KIND:
        return checkpoints_problem(p)
    manifest, why = _load_manifest(p)
    if why is not None:
        return f"has a {MANIFEST} rana cannot read ({why}): move it out"
    if manifest is None:
        return f"holds '{_first_entry(p)}', which rana did not write: move it out"
    if manifest.get("kind") != kind:
        return f"was written by rana as '{manifest.get('kind')}', not as '{kind}': empty it"
    return _owned_problem(p, manifest)


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

    Refused: overlap with an input; a folder replaced whole that is the working directory (or holds
    it) or is named by '..'; a name whose temp folder is too long; an existing path without
    `overwrite` (unless its manifest says it is one of the `resumable` kinds, e.g. a sweep folder
    re-run to resume); with `overwrite`, a folder holding anything rana did not write."""
    out_p = Path(os.path.expanduser(str(out)))
    check_no_overlap(out_p, list(inputs), option)
    if overwrite or not resumable:  # replaced whole (a resumed folder is written into)
        check_replaceable(out_p, option)
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


def check_replaceable(out: Path, option: str = "--out") -> None:
    """An output rana replaces whole (its temp folder is written beside it, then renamed into its place)
    is not the working directory nor a folder holding it (that would pull it from under the user, and
    `.`'s temp folder would land inside it: `--out .` was refused only after the work), and is named by
    its own name, not '..'. Checked before any work."""
    if out.name == "..":
        raise UnsafeOutputError(f"{option} '{out}' ends in '..': name the folder itself, by a path that ends in its "
                                "own name (nothing was written)")
    try:
        here, target = Path.cwd(), _abs(out)
    except OSError:  # the working directory was removed: nothing of it to protect
        return
    if target == here or target in here.parents:
        holds = "" if target == here else " or holds it"
        raise UnsafeOutputError(f"{option} '{out}' is the folder you are working in{holds}: rana writes its output "
                                f"beside {option} and then puts it in its place, which it cannot do to the working "
                                f"directory; name a new folder, e.g. {option} {os.path.join(str(out), 'rana-out')} "
                                "(nothing was written)")


def check_work_dir(path: str | os.PathLike | None, inputs: Iterable[str | os.PathLike], option: str,
                   outputs: Iterable[str | os.PathLike] = (), kind: str | None = None) -> None:
    """A work folder (--offload-dir, --checkpoint-dir) must not overlap an input (nor an output that is
    replaced when the run finishes), and, being written into and deleted from, must be new, empty or
    rana's as its `kind` (default: the kind its option names, WORK_FOLDER_KINDS): checked before any
    work, one line naming the first file that is not rana's."""
    if path is None:
        return
    check_no_overlap(path, inputs, option)
    for out in outputs:
        if overlaps(path, out):
            raise UnsafeOutputError(f"{option} '{path}' overlaps the output '{out}', which is replaced when the run "
                                    f"finishes; choose a separate {option}")
    kind = kind or WORK_FOLDER_KINDS.get(option)
    problem = work_folder_problem(path, kind) if kind is not None else None
    if problem is not None:
        raise UnsafeOutputError(f"{option} '{path}' {problem} or choose another {option} (rana writes only into a new "
                                f"or empty folder, or one it wrote as its {kind}; nothing was written)")


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


__all__ = ["UnsafeOutputError", "OutputExistsError", "MANIFEST", "MANIFEST_FORMAT", "SWEEP_KIND", "OFFLOAD_KIND",
           "CHECKPOINT_KIND", "WORK_FOLDER_KINDS", "overlaps", "local_inputs", "rana_output_kind", "file_sha256",
           "write_manifest", "read_manifest", "claim_folder", "update_manifest", "ownership_problem",
           "work_folder_problem",
           "checkpoints_problem", "rana_checkpoints", "check_no_overlap", "check_output", "check_replaceable",
           "check_output_file", "check_work_dir", "check_temp_name", "temp_prefix", "remove_stale_temps", "apply_umask",
           "written_files"]
