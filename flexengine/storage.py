"""The run's files on disk, kept safe: checksummed manifests, temp dirs of dead processes, free space, and an
output directory that never receives a second run.

Ground-level helpers (only `errors` below them): checkpoint.py builds checkpoints from them, run.py checks the
output directory, and any layer may write JSON atomically.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import socket
from pathlib import Path
from typing import Optional, Sequence

from flexengine.errors import UserError, os_error_message

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # under the run's output directory
MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
GIB = 2**30
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


def _files_under(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(directory: Path, step: int) -> dict:
    """directory/manifest.json: {file: {bytes, sha256}} for every file below directory; returns it."""
    files = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)}
             for p in _files_under(directory)}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    write_json_atomic(directory / MANIFEST, manifest)
    return manifest


def verify_manifest(directory: Path, required: Sequence[str] = ()) -> Optional[str]:
    """None if every file of directory/manifest.json is present with its size and checksum (and the manifest
    lists each `required` file), else what is wrong."""
    path = directory / MANIFEST
    if not path.is_file():
        return f"no {MANIFEST} (the save did not finish, or an older flexengine wrote it)"
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{path} is not a valid manifest ({e})"
    for name, expected in files.items():
        f = directory / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != expected["bytes"]:
            return f"{f} has {f.stat().st_size} bytes, the manifest says {expected['bytes']}"
        if sha256_file(f) != expected["sha256"]:
            return f"{f} does not match its checksum (the file changed after it was saved)"
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



def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


def _tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def clean_stale_temp_dirs(root: Path) -> list[Path]:
    """Remove `.tmp_step_*` directories left by dead processes of this host; returns what was removed.

    A temp dir of another host cannot be judged from here (its process may be writing): it is reported, not
    touched.
    """
    removed = []
    if not root.is_dir():
        return removed
    host = socket.gethostname()
    for p in sorted(root.iterdir()):
        m = _TMP_DIR.match(p.name)
        if not m or not p.is_dir():
            continue
        size = _tree_bytes(p)
        if m["host"] != host:
            log.warning("checkpoint: %s (%.2f GiB) was left by host %s; remove it if no job there writes it",
                        p, size / GIB, m["host"])
        elif int(m["pid"]) != os.getpid() and not _pid_alive(int(m["pid"])):
            shutil.rmtree(p, ignore_errors=True)
            log.warning("checkpoint: removed %s (%.2f GiB), the unfinished save of a dead process", p, size / GIB)
            removed.append(p)
    return removed



def disk_full_message(path: Path, needed: int, free: int) -> str:
    """The one wording of a full disk, with numbers."""
    return (f"disk full at {path} (needs {needed / GIB:.2f} GiB, {free / GIB:.2f} free). Free some space or set "
            "train.output_dir to a larger disk; the previous checkpoint (if any) is intact.")


def check_free_space(root: Path, needed: int) -> None:
    """Raise UserError (disk full at PATH ...) unless `needed` bytes are free under root."""
    free = shutil.disk_usage(root).free
    if free < needed:
        raise UserError(disk_full_message(root, needed, free))



def move_aside(path: Path) -> Path:
    """Move a damaged checkpoint aside (kept for inspection, out of the way of the resumed run's saves)."""
    target = path.with_name(path.name + ".corrupt")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt{n}")
    os.replace(path, target)
    return target



def _earlier_run_files(out_dir: Path) -> list[str]:
    """What in out_dir belongs to a run: checkpoints, its summary, its TensorBoard events."""
    found = [f"{CHECKPOINTS}/{p.name}" for _, p in list_checkpoints(out_dir / CHECKPOINTS)]
    if (out_dir / "summary.json").is_file():
        found.append("summary.json")
    if any((out_dir / "tb").glob("events.out.tfevents.*")):
        found.append("tb/ events")
    return found


def check_output_dir(out_dir: Path, resume: Optional[str]) -> None:
    """Make sure out_dir is a writable directory this run may use: never one holding another run's files.

    resume=None needs a directory without a run in it; resume=auto continues the run that is there (and a
    requeued job that was stopped before its first checkpoint starts again, unless that run had finished);
    resume=<path> inside out_dir continues this run from that step only if no later step would be overwritten.
    """
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"the output directory {out_dir} is a file, not a directory; set train.output_dir to a "
                        "directory (it is created if missing).")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write_test_{socket.gethostname()}_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise UserError(os_error_message(e, f"preparing the output directory {out_dir}")) from None
    earlier = _earlier_run_files(out_dir)
    steps = list_checkpoints(out_dir / CHECKPOINTS)
    advice = ("flexengine never overwrites or mixes runs: continue that run with train.resume=auto, or choose a new "
              "train.output_dir.")
    if resume is None and earlier:
        raise UserError(f"train.output_dir={out_dir} already holds a run ({', '.join(earlier[:4])}). {advice}")
    if resume == "auto" and not steps and "summary.json" in earlier:
        raise UserError(f"train.resume=auto: {out_dir} holds a finished run without checkpoints (summary.json), "
                        "so there is nothing to resume and a new run would overwrite it; choose a new "
                        "train.output_dir.")
    if resume not in (None, "auto"):
        path = Path(resume).resolve()
        if path.parent == (out_dir / CHECKPOINTS).resolve():
            start = int(m.group(1)) if (m := _STEP_DIR.match(path.name)) else -1
            later = [p.name for s, p in steps if s > start]
            if later:
                raise UserError(
                    f"train.resume={resume}: this run already has later checkpoints ({', '.join(later[:4])}) that "
                    "resuming from an earlier step would overwrite. Resume in a new train.output_dir (the "
                    "checkpoint is read from where it is), or move the later steps away."
                )
        elif earlier:
            raise UserError(f"train.resume={resume} starts from another run's checkpoint, but train.output_dir="
                            f"{out_dir} already holds a run ({', '.join(earlier[:4])}). {advice}")



def write_json_atomic(path: Path, data: dict) -> None:
    """json.dump through a temp file + rename."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)
