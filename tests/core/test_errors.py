"""A user's mistake as one paragraph (flexengine/core/errors.py): os_error_message says what failed, where, why and
what to do."""

from __future__ import annotations

import errno

import pytest

from flexengine.core.errors import OutputDirTaken, UserError, os_error_message


def test_os_error_message_names_both_paths():
    e = OSError(errno.EACCES, "Permission denied", "/a", None, "/b")
    assert os_error_message(e, "renaming") == (
        "renaming failed at /a -> /b: Permission denied; check its "
        "permissions, or choose a directory you can write (e.g. "
        "train.output_dir=...)."
    )


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (errno.ENOSPC, "the disk is full; free some space or use a larger disk"),
        (errno.ENOENT, "it does not exist; check the path"),
        (errno.EROFS, "the file system is read-only"),
        (errno.EIO, "check the path and the disk"),  # no advice of its own: the general one
    ],
)
def test_os_error_message_gives_the_advice_for_its_errno(code, advice):
    message = os_error_message(OSError(code, "why", "/d/f"), "writing")
    assert message.startswith("writing failed at /d/f: why; ") and advice in message and message.endswith(".")


def test_os_error_message_without_path_or_strerror_still_says_something():
    assert os_error_message(OSError(errno.ENOSPC, None), "saving") == (
        "saving failed at (unknown path): No space left on device; the disk is full; free some space or use a "
        "larger disk."
    )
    bare = OSError("no errno at all")
    expected = "reading failed at (unknown path): no errno at all; check the path and the disk."
    assert os_error_message(bare, "reading") == expected


def test_a_taken_output_dir_is_a_user_error():
    assert issubclass(OutputDirTaken, UserError)  # entry points print every UserError as a paragraph, this one too
