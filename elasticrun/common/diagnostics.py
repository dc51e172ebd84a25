"""Files written only for a person to read later (the event log, per-rank output files):
a write that fails (a full disk, ``--events /dev/full``, a vanished directory) is a warning,
never the end of the training it describes.

A :class:`DiagnosticFile` says its first failure in one line and counts the rest into a
:class:`~elasticrun.common.ratelimit.LimitedLog` (summarized at most once per interval by its
owner's flushes); when writing works again it says so once. Lines are written with one
``os.write`` each on an ``O_APPEND`` descriptor: no buffer holds a half-written line that a
later flush or close would fail on again.

Files elasticrun names inside a directory the user gave (``--output-filename DIR``: its
``rank.N/stdout`` and ``events.jsonl``) are opened with :func:`open_beneath`: never through a
symbolic link below that directory, and only when a regular file. A log directory is often
shared with a team (group-writable); a link planted there would point the job's appends at
another of the user's files, and a FIFO would block the writer, and with it the job's output.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Sequence

from elasticrun.common.paths import open_user_file, path_problem
from elasticrun.common.ratelimit import LimitedLog

log = logging.getLogger("elasticrun")

CATEGORY = "failed diagnostic writes"


_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
_BENEATH = os.O_NOFOLLOW | os.O_CLOEXEC


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def open_beneath(directory: str, names: Sequence[str], mode: int = 0o644) -> int:
    """Open ``directory/names[0]/.../names[-1]`` for appending, creating the missing directories
    and the file, without following a symbolic link anywhere below ``directory`` (``directory``
    itself is the user's choice and may be one), and only if it is a regular file. OSError
    otherwise, with a ``strerror`` that says which. ``directory`` is refused (EPERM) where
    someone else could choose what it is (:func:`path_problem`: a link or a directory a
    neighbour made in /tmp)."""
    why = path_problem(os.path.abspath(directory), "they choose where the job's output goes")
    if why:
        raise OSError(errno.EPERM, why)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for i, name in enumerate(names):
            last = i == len(names) - 1
            if not last:
                try:
                    os.mkdir(name, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                # O_NONBLOCK: a FIFO fails (no reader) or opens without waiting, and is refused below.
                flags = (_APPEND | os.O_NONBLOCK) if last else (os.O_RDONLY | os.O_DIRECTORY)
                inner = os.open(name, flags | _BENEATH, mode, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EMLINK) or (exc.errno == errno.ENOTDIR and _is_link(name, fd)):
                    raise OSError(exc.errno, f"{name} is a symbolic link (not followed)") from None  # O_NOFOLLOW
                if exc.errno == errno.ENXIO:
                    raise OSError(exc.errno, f"{name} is not a regular file") from None
                raise
            os.close(fd)
            fd = inner
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, f"{names[-1]} is not a regular file")
        if st.st_nlink > 1:  # a hard link someone made to another file of yours: appends would land there
            raise OSError(errno.EPERM, f"{names[-1]} has other hard links (not written)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


class DiagnosticFile:
    """Append-only ``path`` (``what`` names it in messages: "the event log"); thread-safe.
    With ``beneath``, ``path`` lies in that directory and is opened by :func:`open_beneath`."""

    def __init__(self, path: str, what: str, limited: LimitedLog | None = None, mode: int = 0o644,
                 beneath: str | None = None):
        self.path = path
        self.what = what
        self._beneath = beneath
        self._limited = limited if limited is not None else LimitedLog(log)
        self._mode = mode
        self._lock = threading.Lock()
        self._fd = -1
        self._failing = False
        self.dropped = 0  # lines lost to failed writes (tests, the summary)
        with self._lock:
            self._open()

    def _open(self) -> bool:
        if self._fd >= 0:
            return True
        try:
            if self._beneath is None:
                self._fd = open_user_file(self.path, _APPEND, self._mode)
            else:
                names = os.path.relpath(self.path, self._beneath).split(os.sep)
                self._fd = open_beneath(self._beneath, names, self._mode)
            return True
        except OSError as exc:
            self._failed(exc)
            return False

    def _failed(self, exc: OSError) -> None:
        self.dropped += 1
        if not self._failing:
            self._failing = True
            self._limited.warn(CATEGORY, f"cannot write {self.what} {self.path}: {exc.strerror or exc}; "
                               "training goes on (lines that cannot be written are counted, not kept)", self.what)
        else:
            self._limited.count(CATEGORY, 1, f"lines of {self.what}")

    def write(self, text: str) -> bool:
        """Append ``text`` (whole lines); False when it was dropped."""
        data = text.encode("utf-8", errors="replace")
        with self._lock:
            if not self._open():
                return False
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(self._fd, view):]
            except OSError as exc:
                self._failed(exc)
                return False
            if self._failing:
                self._failing = False
                log.warning("writing %s %s works again (%d line(s) were lost)", self.what, self.path, self.dropped)
            return True

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                try:
                    os.close(self._fd)
                except OSError:
                    pass
                self._fd = -1
