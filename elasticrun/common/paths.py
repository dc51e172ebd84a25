"""Checks that a job can write where it was told to, made before anything is launched.

A path the job cannot write (``--events /proc/x/y``, ``--output-filename /dev/null/out``)
used to surface as a traceback once the driver started; checked up front it is one line
naming the flag and the reason. The checks create missing parent directories exactly as
the job would (it would create them anyway) and leave no file behind.
"""

from __future__ import annotations

import os
import tempfile


def _reason(exc: OSError) -> str:
    text = exc.strerror or str(exc)
    return text[:1].lower() + text[1:]


def _make_dirs(path: str, flag: str, given: str) -> None:
    """Create directory ``path`` and its missing parents; ValueError says why it cannot."""
    if os.path.isdir(path):
        return
    existing = path
    while not os.path.lexists(existing):  # the deepest part of the path that is there
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {given}: {existing} is not a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        where = exc.filename if isinstance(exc.filename, str) else path
        raise ValueError(f"{flag} {given}: cannot create directory {where}: {_reason(exc)}") from None


def check_writable_file(path: str, flag: str) -> None:
    """Make sure the job can append to file ``path``: its directory exists (created if
    missing) and the file can be opened for writing. Raises ValueError with one line
    ("--events /x/y: cannot create directory /x: permission denied")."""
    full = os.path.abspath(path)
    if os.path.isdir(full):
        raise ValueError(f"{flag} {path}: is a directory")
    _make_dirs(os.path.dirname(full), flag, path)
    # O_NONBLOCK: opening a FIFO with no reader fails at once instead of waiting for one.
    flags = os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK | os.O_CLOEXEC
    created = False
    try:
        try:
            fd = os.open(full, flags | os.O_CREAT | os.O_EXCL, 0o666)
            created = True
        except FileExistsError:
            fd = os.open(full, flags)
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write to it: {_reason(exc)}") from None
    os.close(fd)
    if created:  # the job creates it when it starts; a run refused later leaves nothing
        os.unlink(full)


def check_writable_dir(path: str, flag: str) -> None:
    """Make sure the job can create files in directory ``path`` (created if missing, with
    its parents). Raises ValueError with one line naming ``flag`` and the reason."""
    full = os.path.abspath(path)
    _make_dirs(full, flag, path)
    try:
        with tempfile.TemporaryFile(dir=full):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write in it: {_reason(exc)}") from None
