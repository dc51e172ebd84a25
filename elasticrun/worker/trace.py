"""``hvd.start_timeline(path)`` / ``hvd.stop_timeline()``: a Chrome trace of this rank's collectives.

Horovod's timeline records the negotiation and execution phases of every tensor in its
background thread. elasticrun has no background thread: an operation runs from the moment it
is issued on the round's gloo group to the moment its wait returns, so each one is a single
complete event ("ph": "X") from issue to completion, on one track per round, with its shape,
dtype and bytes. Events are kept in memory and written when the timeline stops (or the
process exits), so recording costs the training thread one list append per operation. As
Horovod's, the file is rank 0's (every rank records; see :func:`writes`).
Open the file in ui.perfetto.dev or chrome://tracing; the job-wide picture of resets is
``elasticrun --events`` (``elasticrun timeline``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from typing import Any

from elasticrun.common.paths import open_user_file, planted

__all__ = ["Timeline", "active", "note_rank", "start", "stop", "writes"]

log = logging.getLogger("elasticrun.worker")


#: In a timeline's path, replaced by the rank: every rank writes its own file.
RANK_FIELD = "{rank}"


def writes(path: str, rank: int | None) -> bool:
    """Whether a worker of ``rank`` (None: never in a round) writes the timeline ``path``.

    As in Horovod, where every rank calls ``start_timeline(path)`` and rank 0 alone writes the
    file, one file per job: ranks sharing a path on one machine would otherwise overwrite each
    other's. A path with ``{rank}`` asks for every rank's own file."""
    return RANK_FIELD in path or rank in (None, 0)


def _check_writable(path: str) -> None:
    """Fail at start, not at the end, if ``path`` cannot be written (without touching it: on one
    machine another rank may be writing the same path)."""
    directory = os.path.dirname(path) or "."
    if os.path.isdir(path):
        raise IsADirectoryError(f"timeline {path}: is a directory")
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"timeline {path}: no directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"timeline {path}: not writable")
    why = planted(path)
    if why:
        raise PermissionError(f"timeline {path}: {why}; remove it or choose another path")


class Timeline:
    """Events of one recording. The worker that writes (:func:`writes`) streams them to its file
    every :attr:`FLUSH_EVERY` events and closes the JSON array at :meth:`close`; the others keep
    only their newest events (for the file they start if they become rank 0). Either way memory
    stays bounded however long the job runs, and a writer that is killed leaves every event up
    to its last flush on disk (an unclosed array, which Perfetto and chrome://tracing read)."""

    FLUSH_EVERY = 4096

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.path = os.path.abspath(path)
        _check_writable(self.path.replace(RANK_FIELD, "0"))
        self.mark_cycles = mark_cycles
        self.events: list[dict[str, Any]] = []  # not yet written
        self.rank: int | None = _rank  # this worker's rank in its newest round (note_rank)
        self.written_to: str | None = None  # the file, once this worker writes one
        self._file: Any = None
        self._count = 0  # events written
        self._rounds: set[int] = set()
        self._closed = False
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self.lost = 0  # events a failed write dropped
        self._warned = False

    def record(self, name: str, start: float, end: float, round_: int, **args: Any) -> None:
        """One operation, ``start``/``end`` from ``time.perf_counter()``."""
        self._add({"name": name, "ph": "X", "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6,
                   "pid": self._pid, "tid": round_, "args": args})

    def mark(self, name: str, round_: int) -> None:
        """An instant event (with ``mark_cycles``: each commit, the step boundary of an elastic loop)."""
        if self.mark_cycles:
            self._add({"name": name, "ph": "i", "s": "p", "ts": now() * 1e6, "pid": self._pid, "tid": round_})

    def _add(self, event: dict[str, Any]) -> None:
        self.events.append(event)
        if len(self.events) >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Write the pending events if this worker writes; otherwise keep only the newest.
        A write that fails (a full disk) drops them with one warning: the timeline describes
        the training, it must not stop it."""
        with self._lock:
            if self._file is None and not writes(self.path, self.rank):
                del self.events[:-self.FLUSH_EVERY // 2]
                return
            events, self.events = self.events, []
            try:
                self._write(events)
            except OSError as exc:
                self._lost(exc, len(events))

    def _lost(self, exc: OSError, n: int) -> None:
        self.lost += n
        if not self._warned:
            self._warned = True
            log.warning("cannot write the timeline %s: %s; training goes on (its events are dropped)",
                        self.written_to or self.path, exc.strerror or exc)

    def _write(self, events: list[dict[str, Any]]) -> None:
        if self._file is None:
            self.written_to = self.path.replace(RANK_FIELD, str(self.rank or 0))
            fd = open_user_file(self.written_to, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
            self._file = os.fdopen(fd, "w", encoding="utf-8")
            self._file.write("[\n")
        for event in events:
            self._file.write((",\n" if self._count else "") + json.dumps(event))
            self._count += 1
            if "tid" in event:
                self._rounds.add(event["tid"])
        self._file.flush()

    def close(self) -> str | None:
        """Write the rest and close the array, if this worker writes; the file's path, or None."""
        if self._closed:
            return self.written_to
        self.flush()
        with self._lock:
            self._closed = True
            if self._file is None and not writes(self.path, self.rank):
                return None
            name = f"rank {self.rank} (pid {self._pid})" if self.rank is not None else f"pid {self._pid}"
            meta = [{"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": name}}]
            meta += [{"name": "thread_name", "ph": "M", "pid": self._pid, "tid": r, "args": {"name": f"round {r}"}}
                     for r in sorted(self._rounds)]
            try:
                self._write(meta)
                self._file.write("\n]\n")
                self._file.close()
            except OSError as exc:
                self._lost(exc, len(meta))
                if self._file is not None:
                    try:
                        self._file.close()
                    except OSError:
                        pass
            self._file = None
            return self.written_to


_active: Timeline | None = None
_rank: int | None = None


def note_rank(rank: int) -> None:
    """This worker's rank in the round it just entered (the runtime, at every rendezvous):
    whether it writes a shared timeline path is decided by its rank when it has events to write."""
    global _rank
    _rank = rank
    t = _active
    if t is not None:
        t.rank = rank


def active() -> Timeline | None:
    return _active


def start(path: str, mark_cycles: bool = False) -> None:
    """Start recording into ``path`` (a running recording is stopped and written first)."""
    global _active
    stop()
    _active = Timeline(path, mark_cycles)


def stop() -> None:
    global _active
    t, _active = _active, None
    if t is not None:
        t.close()


def now() -> float:
    return time.perf_counter()


atexit.register(stop)
