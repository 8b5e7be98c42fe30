"""The run's files on disk, kept safe: checksummed manifests, temp dirs of dead processes, free space, and an
output directory that never receives a second run.

Ground-level helpers (only `errors` below them): checkpoint.py builds checkpoints from them, run.py checks the
output directory, and any layer may write JSON atomically.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import stat
from pathlib import Path
from typing import IO, Iterator, Optional, Sequence

from flexengine.core.errors import OutputDirTaken, UserError, os_error_message
from flexengine.core.units import GiB, MiB

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # under the run's output directory
MANIFEST = "manifest.json"
RUN_LOCK = ".lock"  # in the output directory: held (flock) by the live run's rank 0
MANIFEST_FORMAT = 1
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp_step_(\d+)_(?P<host>.+)_(?P<pid>\d+)$")
_HASH_CHUNK = 16 << 20


def temp_dir_name(step: int) -> str:
    """Where this process writes step_<step> before renaming it into place (host + pid: see clean_stale_temp_dirs)."""
    return f".tmp_step_{step}_{socket.gethostname()}_{os.getpid()}"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 16 MiB chunks (~1-2 GB/s: seconds per GB-sized shard, see README)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _relative_files(directory: Path) -> list[str]:
    """Every file below directory but the manifest, as a path relative to directory."""
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


# open()'s modes as os.open flags, for the files an output directory holds
_OPEN_FLAGS = {
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


def open_output(path: Path, mode: str = "w") -> IO[str]:
    """open(path, mode) for a file inside an output directory ("a", "a+", "w" or "x"), following no symbolic link and
    writing nothing but a regular file: anyone who can write a shared output directory could otherwise plant a
    link there and have the training user (often root) truncate or append to any file it can write. UserError
    naming the path when it is a link or not a regular file."""
    # O_NONBLOCK: opening a FIFO for writing would wait for a reader; cleared again once the file is known regular
    flags = _OPEN_FLAGS[mode] | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or (e.errno == errno.ENXIO and not path.is_symlink()):
            raise UserError(_not_written_message(path)) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UserError(_not_written_message(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def _not_written_message(path: Path) -> str:
    what = "a symbolic link" if path.is_symlink() else "not a regular file"
    return (
        f"{path} is {what}: flexengine writes its run files only as regular files of the output directory, never "
        "through a link (whoever can write a shared directory could point it at any file this user can write). "
        "Check what put it there, remove it, and start again."
    )


def refuse_link(path: Path) -> None:
    """UserError if path is a symbolic link: a directory the engine writes into (tb/) is its own, not a link."""
    if path.is_symlink():
        raise UserError(_not_written_message(path))


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)  # a directory too: its entries (a rename, a new file) reach the disk
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def seal_files(directory: Path, names: Sequence[str]) -> dict:
    """fsync each file (its data is on disk before any rename publishes it) and return its manifest entries
    {name: {bytes, sha256}}. Every rank seals the files it wrote, so the hashing is spread over the ranks."""
    entries = {}
    for name in names:
        path = directory / name
        _fsync(path)
        entries[name] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return entries


def write_manifest(directory: Path, step: int, sealed: Optional[dict] = None, **facts: object) -> dict:
    """directory/manifest.json: {file: {bytes, sha256}} for every file below directory (the entries in `sealed`
    were hashed by the rank that wrote them; the rest are sealed here), plus `facts`; then fsyncs the directory
    tree, so a rename of directory publishes complete files. Returns the manifest."""
    sealed = dict(sealed or {})
    rest = [name for name in _relative_files(directory) if name not in sealed]
    files = {**sealed, **seal_files(directory, rest)}
    manifest = {"format": MANIFEST_FORMAT, "step": step, **facts, "files": dict(sorted(files.items()))}
    write_json_atomic(directory / MANIFEST, manifest)
    for sub in sorted((p for p in directory.rglob("*") if p.is_dir()), reverse=True):
        _fsync(sub)
    _fsync(directory)
    return manifest


def older_format_message(directory: Path) -> str:
    """What a step directory without a manifest is, and how its weights can still be used."""
    return (
        f"{directory} has no {MANIFEST}: an older flexengine wrote it (or it was copied without its manifest), "
        "so it cannot be verified or resumed exactly. Its weights can start a new run: "
        f"model.path={directory} with a new train.output_dir"
    )


def has_manifest(directory: Path) -> bool:
    """Whether directory was written by a flexengine that checksums its checkpoints."""
    return (directory / MANIFEST).is_file()


def read_manifest(directory: Path) -> dict:
    """directory/manifest.json, parsed and checked for shape; UserError if it is missing or malformed."""
    path = directory / MANIFEST
    if not path.is_file():
        raise UserError(older_format_message(directory))
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        ):
            raise TypeError("every file needs {bytes, sha256}")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{path} is not a valid manifest ({type(e).__name__}: {e})") from None
    outside = [name for name in files if not inside_directory(name)]
    if outside:
        raise UserError(
            f"{path} names files outside its checkpoint ({', '.join(map(repr, outside[:3]))}): a manifest lists the "
            "checkpoint's own files by relative path only. It was edited or forged; resume from a checkpoint you "
            "trust."
        )
    return manifest


def inside_directory(name: str) -> bool:
    """Whether a file name a listing gives (a manifest's, a weight index's) stays inside its directory: relative,
    no `..`, no empty or `.` part."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(p not in ("", ".", "..") for p in parts)


def verify_manifest(directory: Path, required: Sequence[str] = ()) -> Optional[str]:
    """None if every file of directory/manifest.json is present with its size and checksum, no file is there
    that the manifest does not list, and the manifest lists each `required` file; else what is wrong."""
    try:
        files = read_manifest(directory)["files"]
    except UserError as e:
        return str(e)
    for name, expected in files.items():
        f = directory / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != expected["bytes"]:
            return f"{f} has {f.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if sha256_file(f) != expected["sha256"]:
            return f"{f} does not match its checksum (the file changed after it was saved)"
    # a file added later would be read too (loaders glob *.safetensors, HF follows an index .json)
    unlisted = [name for name in _relative_files(directory) if name not in files]
    if unlisted:
        more = f", and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
        return (
            f"{directory / unlisted[0]} is not in the manifest (added after the save{more}); remove it if you "
            "put it there"
        )
    missing = [name for name in required if name not in files]
    if missing:
        return f"the manifest lists no {', '.join(missing)}"
    return None


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step_<N> directory under root, newest first."""
    if not root.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return sorted(steps, reverse=True)


def pid_alive(pid: int) -> bool:
    """Whether a process of this host has this pid (someone else's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def tree_bytes(path: Path) -> int:
    """Bytes of all files below path."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def unfinished_saves(root: Path) -> list[tuple[Path, str, int, int]]:
    """(path, host, pid, bytes) of every `.tmp_step_*` directory under root."""
    if not root.is_dir():
        return []
    dirs = [(p, m) for p in sorted(root.iterdir()) if (m := _TMP_DIR.match(p.name)) and p.is_dir()]
    return [(p, m["host"], int(m["pid"]), tree_bytes(p)) for p, m in dirs]


def clean_stale_temp_dirs(root: Path, owned: bool = False) -> list[Path]:
    """Remove the `.tmp_step_*` directories of unfinished saves that no live process writes; returns them.

    Call it at start-up, before this process saves anything: a directory named with this host and this pid is
    then a leftover of an earlier process that had the same pid (in a container the trainer is often PID 1 on
    every start), and one of a dead pid is a killed save. A directory of another host cannot be judged from
    here, unless `owned` (train.resume=auto: this job continues the run in this directory, e.g. a Slurm or K8s
    requeue that landed on another node, so nothing else writes there); otherwise it is only reported.
    """
    host, removed = socket.gethostname(), []
    for p, its_host, pid, size in unfinished_saves(root):
        if its_host == host and pid != os.getpid() and pid_alive(pid):
            continue  # a live process of this host is writing it
        if its_host != host and not owned:
            log.warning(
                "checkpoint: %s (%s) was left by host %s; remove it if no job there writes it "
                "(train.resume=auto removes it)",
                p,
                size_text(size),
                its_host,
            )
            continue
        shutil.rmtree(p, ignore_errors=True)
        log.warning("checkpoint: removed %s (%s), the unfinished save of a process that is gone", p, size_text(size))
        removed.append(p)
    return removed


def size_text(n: int) -> str:
    """Bytes as a person reads them on a nearly full disk: GiB from 1 GiB up, MiB below ("0.01 GiB" said nothing)."""
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.0f} MiB" if n >= 10 * MiB else f"{n / MiB:.1f} MiB"


def disk_full_message(path: Path, needed: int, free: int) -> str:
    """The one wording of a full disk, with numbers (and the space unfinished saves still hold there)."""
    mine = (socket.gethostname(), os.getpid())  # this process's own failed save is being removed
    held = [(p, size) for p, host, pid, size in unfinished_saves(path) if (host, pid) != mine]
    held_note = ""
    if held:
        held_note = (
            f"; {size_text(sum(s for _, s in held))} of it is held by unfinished saves ("
            + ", ".join(p.name for p, _ in held[:3])
            + "): remove them if no job writes there"
        )
    return (
        f"disk full at {path} (needs {size_text(needed)}, {size_text(free)} free{held_note}). Free some "
        "space or set train.output_dir to a larger disk; the previous checkpoint (if any) is intact."
    )


def check_free_space(root: Path, needed: int) -> None:
    """Raise UserError (disk full at PATH ...) unless `needed` bytes are free under root."""
    free = shutil.disk_usage(root).free
    if free < needed:
        raise UserError(disk_full_message(root, needed, free))


def move_aside(path: Path, suffix: str = ".corrupt") -> Path:
    """Move a damaged checkpoint aside (kept for inspection, out of the way of the resumed run's saves)."""
    target = path.with_name(path.name + suffix)
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}{suffix}{n}")
    os.replace(path, target)
    return target


def _earlier_run_files(out_dir: Path) -> list[str]:
    """What in out_dir belongs to a run: checkpoints, its summary and metrics, its TensorBoard events."""
    found = [f"{CHECKPOINTS}/{p.name}" for _, p in list_checkpoints(out_dir / CHECKPOINTS)]
    found += [name for name in ("summary.json", "metrics.jsonl") if (out_dir / name).is_file()]
    if any((out_dir / "tb").glob("events.out.tfevents.*")):
        found.append("tb/ events")
    return found


def _writable_dir(out_dir: Path) -> None:
    """Create out_dir if missing and prove this process can write there (UserError naming the path)."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(
            f"the output directory {out_dir} is a file, not a directory; set train.output_dir to a "
            "directory (it is created if missing)."
        )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write_test_{socket.gethostname()}_{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            probe.unlink()  # a leftover, or a link planted at this predictable name: never written through
        open_output(probe, "x").close()
        probe.unlink()
    except OSError as e:
        raise UserError(os_error_message(e, f"preparing the output directory {out_dir}")) from None


@contextlib.contextmanager
def hold_output_dir(out_dir: Path, resume: Optional[str], enabled: bool = True) -> Iterator[None]:
    """Hold an advisory lock on out_dir/.lock for the run's life: a second run on the same directory (started
    beside it, or a train.resume=auto requeued while it still runs) is refused before it writes or removes
    anything. The kernel drops the lock when the process ends, however it ends, so a killed run never leaves a
    stale lock. enabled=False (ranks > 0 of a torchrun job; rank 0 holds it for the job) holds nothing; nor does a
    filesystem without flock (a warning says so once)."""
    if not enabled:
        yield
        return
    _writable_dir(out_dir)
    path = out_dir / RUN_LOCK
    # closing releases the lock (the file stays: removing it would race with the next run's open)
    with open_output(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a process that has not written its pid yet"
            raise OutputDirTaken(_in_use_message(out_dir, resume, holder)) from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            _warn_unlocked(out_dir, e)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        handle.flush()
        yield


# flock's answers on a filesystem that keeps no locks: NFSv3 without lockd (ENOLCK), Lustre mounted noflock,
# FUSE and object-store mounts (ENOSYS, EOPNOTSUPP, EINVAL)
_NO_LOCKS = frozenset({errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})
_warned_unlocked: set[Path] = set()


def _warn_unlocked(out_dir: Path, e: OSError) -> None:
    """Say once per directory that its run goes unlocked. No O_EXCL pid file instead: a killed run would leave it
    behind and block its own train.resume=auto requeue, and a pid cannot be checked from another node."""
    if out_dir in _warned_unlocked:
        return
    _warned_unlocked.add(out_dir)
    log.warning(
        "output dir %s: its filesystem has no locks (flock: %s), so two runs on it are not prevented; "
        "this run goes on unlocked (do not start a second run, or a requeue, there while it lives)",
        out_dir,
        os.strerror(e.errno) if e.errno is not None else str(e),
    )


def _in_use_message(out_dir: Path, resume: Optional[str], holder: str) -> str:
    if resume == "auto":
        what = f"train.resume={resume}: the run in {out_dir} is still running"
        harm = "resuming it now would truncate its metrics and load a checkpoint it is about to supersede"
    else:
        what = f"train.output_dir={out_dir} is in use by a live run"
        harm = "two runs in one directory would mix their checkpoints and metrics.jsonl"
    return (
        f"{what} ({holder} holds {out_dir / RUN_LOCK}); {harm}. Wait for it to end or stop it (a stopped run "
        "resumes with train.resume=auto), or choose a new train.output_dir."
    )


def check_output_dir(out_dir: Path, resume: Optional[str]) -> None:
    """Make sure out_dir is a writable directory this run may use: never one holding another run's files.

    resume=None needs a directory without a run in it; resume=auto continues the run that is there (and a
    requeued job that was stopped before its first checkpoint starts again, unless that run had finished);
    resume=<path> inside out_dir continues this run from that step only if no later step would be overwritten.
    A live run in the directory is refused by hold_output_dir, which the run takes before this check.
    """
    _writable_dir(out_dir)
    earlier = _earlier_run_files(out_dir)
    steps = list_checkpoints(out_dir / CHECKPOINTS)
    advice = (
        "flexengine never overwrites or mixes runs: continue that run with train.resume=auto, or choose a new "
        "train.output_dir."
    )
    if resume is None and earlier:
        raise OutputDirTaken(f"train.output_dir={out_dir} already holds a run ({', '.join(earlier[:4])}). {advice}")
    if resume == "auto" and not steps and "summary.json" in earlier:
        raise OutputDirTaken(
            f"train.resume=auto: {out_dir} holds a finished run without checkpoints (summary.json), "
            "so there is nothing to resume and a new run would overwrite it; choose a new "
            "train.output_dir."
        )
    if resume not in (None, "auto"):
        path = Path(resume).resolve()
        if path.parent == (out_dir / CHECKPOINTS).resolve():
            start = int(m.group(1)) if (m := _STEP_DIR.match(path.name)) else -1
            later = [p.name for s, p in steps if s > start]
            if later:
                raise OutputDirTaken(
                    f"train.resume={resume}: this run already has later checkpoints ({', '.join(later[:4])}) that "
                    "resuming from an earlier step would overwrite. Resume in a new train.output_dir (the "
                    "checkpoint is read from where it is), or move the later steps away."
                )
        elif earlier:
            raise OutputDirTaken(
                f"train.resume={resume} starts from another run's checkpoint, but train.output_dir="
                f"{out_dir} already holds a run ({', '.join(earlier[:4])}). {advice}"
            )


def write_json_atomic(path: Path, data: dict) -> None:
    """json.dump through a temp file, fsynced, renamed into place, and the directory fsynced: after a crash the
    file is either the old one or the whole new one."""
    write_text_atomic(path, json.dumps(data, indent=2, default=str))


def write_text_atomic(path: Path, text: str) -> None:
    """Write text through a temp file, fsynced, renamed into place, and the directory fsynced (see
    write_json_atomic)."""
    tmp = path.with_name(f".{path.name}.tmp_{socket.gethostname()}_{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()  # this process's name: a leftover (or a planted link) goes; the final rename replaces a name
    with open_output(tmp, "x") as f:  # created here, so written through no link
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new entry in directory durable."""
    _fsync(directory)
