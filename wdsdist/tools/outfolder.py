"""Folders we write into (shards, run directories): made on first use, and a place we cannot
write to is one error line with its owner and the fix, not a PermissionError traceback.

The common way to get there: a container running as another uid than the owner of a mounted
data/ or outputs/ (``./run docker`` run by root with an image user of 1000, or the reverse)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

from wdsdist.errors import UserError


def make_output_folder(folder: str, what: str) -> None:
    """Create ``folder`` (and its parents) if missing and check that this process can write
    into it; otherwise a UserError naming ``what`` (the key or option that chose the folder)."""
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UserError(unwritable(folder, what, exc.strerror or str(exc))) from None
    # access() and not a test file: it answers for this uid without leaving anything behind, and
    # it reports a read-only mount (EROFS) even to root.
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(unwritable(folder, what, "permission denied"))


def unwritable(folder: str, what: str, reason: str) -> str:
    """The one line for a folder we cannot write: which folder, who owns the part that exists,
    who we are, and what to do about it."""
    uid, gid = os.getuid(), os.getgid()
    # The nearest part that exists, named as the user named it: relative stays relative, so
    # inside a container (cwd /app = the checkout) the fix names the host's folder too.
    there = os.path.normpath(folder)
    while not os.path.lexists(there) and os.path.dirname(there) not in ("", there):
        there = os.path.dirname(there)
    if not os.path.lexists(there) and not os.path.isabs(there):
        there = "."
    head = f"{what}: cannot write to {folder}/ ({reason.lower()})"
    if os.path.lexists(there) and not os.path.isdir(there):
        return f"{head}: {there} is a file, not a folder; fix: remove it, or choose another folder"
    try:
        st = os.stat(there)
    except OSError:
        return f"{head}; fix: choose a folder you can write to"
    if st.st_uid != uid:
        return (
            f"{head}: {there} is owned by uid {st.st_uid}, you are uid {uid}; "
            f"fix: sudo chown -R {uid}:{gid} {there}, run as uid {st.st_uid}, or choose another folder"
        )
    return (
        f"{head}: {there} is yours but not writable (mode {st.st_mode & 0o777:o}, or a read-only mount); "
        f"fix: chmod u+rwx {there}, or choose another folder"
    )


@contextlib.contextmanager
def written_whole(path: str) -> Iterator[str]:
    """A temporary name beside ``path`` (PATH.tmpPID) for the block to write; renamed over ``path``
    when the block ends, removed when it fails: a reader finds the old file or the new one whole,
    and a killed writer leaves only the temporary file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def write_text(path: str, text: str) -> None:
    """``text`` into ``path`` (UTF-8), written whole."""
    with written_whole(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)


def check_local_output(path: str, what: str) -> None:
    """Refuse an output that is not a plain local path: webdataset's gopen would run ``pipe:``
    as a shell command and hand URLs (http:, s3:, file:, ...) to its tools, and outputs are
    local files only, whatever data.allow_pipe says."""
    if _SCHEME.match(path):
        raise UserError(
            f"{what}: shards are written to a local folder only, not to pipe: commands or URLs "
            f"(for a local name with a colon write ./{path})"
        )
