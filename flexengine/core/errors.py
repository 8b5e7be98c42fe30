"""The one exception type for a user's mistake: printed as a paragraph, never as a traceback."""

from __future__ import annotations

import errno
import os
from typing import Optional


class UserError(Exception):
    """A problem with the user's config or input files, with what to do about it in the message."""


class OutputDirTaken(UserError):
    """train.output_dir belongs to another run (finished, or live): this run writes nothing there, not even its
    error record."""


_ADVICE: dict[Optional[int], str] = {  # by OSError.errno (None: not set)
    errno.EACCES: "check its permissions, or choose a directory you can write (e.g. train.output_dir=...)",
    errno.EPERM: "check its permissions, or choose a directory you can write (e.g. train.output_dir=...)",
    errno.EROFS: "the file system is read-only; choose a writable directory (e.g. train.output_dir=...)",
    errno.ENOTDIR: "a path component is a file, not a directory; choose another path",
    errno.EEXIST: "something already exists there; choose another path",
    errno.ENOSPC: "the disk is full; free some space or use a larger disk",
    errno.EDQUOT: "your disk quota is used up; free some space or use another disk",
    errno.ENOENT: "it does not exist; check the path",
}


def os_error_message(e: OSError, doing: str) -> str:
    """One paragraph for a filesystem error: what failed, at which path, why, and what to do."""
    path = e.filename if e.filename is not None else "(unknown path)"
    if e.filename2 is not None:
        path = f"{path} -> {e.filename2}"
    reason = (e.strerror or os.strerror(e.errno)) if e.errno else str(e)
    advice = _ADVICE.get(e.errno, "check the path and the disk")
    return f"{doing} failed at {path}: {reason}; {advice}."
