"""Files written only for a person to read later (the event log, per-rank output files):
a write that fails (a full disk, ``--events /dev/full``, a vanished directory) is a warning,
never the end of the training it describes.

A :class:`DiagnosticFile` says its first failure in one line and counts the rest into a
:class:`~elasticrun.common.ratelimit.LimitedLog` (summarized at most once per interval by its
owner's flushes); when writing works again it says so once. Lines are written with one
``os.write`` each on an ``O_APPEND`` descriptor: no buffer holds a half-written line that a
later flush or close would fail on again.
"""

from __future__ import annotations

import logging
import os
import threading

from elasticrun.common.ratelimit import LimitedLog

log = logging.getLogger("elasticrun")

CATEGORY = "failed diagnostic writes"


class DiagnosticFile:
    """Append-only ``path`` (``what`` names it in messages: "the event log"); thread-safe."""

    def __init__(self, path: str, what: str, limited: LimitedLog | None = None, mode: int = 0o644):
        self.path = path
        self.what = what
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
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, self._mode)
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
