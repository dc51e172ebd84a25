"""The driver's console: every line the driver prints, its own and its workers', goes through
one queue to one writer thread, in the order it was put there.

Why: a console that is not read (Ctrl-S in a terminal, a stalled SSH session to the login
node, a log pipe whose reader paused) blocks whoever writes to it. When that was the driver's
loop, it stopped answering its workers' heartbeats; after 5 s every worker concluded that the
driver was gone, and the job failed with every host blacklisted. Now the loop only queues its
lines. A worker's line waits for room (its own pipe then fills and the worker waits, as under
any launcher); the driver's own lines never wait: past a reserve of their own they are
dropped and counted, and the count is said once the console is read again.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import IO

#: Bytes queued before a worker's line waits for room.
CAPACITY = 4 << 20
#: Room kept beyond that for the driver's own lines, which never wait: past it they are dropped.
RESERVE = 1 << 20


class Console:
    """A writer thread for ``streams`` ({"stdout": ..., "stderr": ...}; None: a stream that is
    gone). :meth:`write` from any thread; :meth:`close` writes what is queued, then stops.
    ``capacity`` and ``reserve`` are in characters queued, so memory stays bounded whatever
    the lines' lengths."""

    def __init__(self, streams: dict[str, IO[str] | None], capacity: int = CAPACITY, reserve: int = RESERVE):
        self._streams = dict(streams)
        self._gone = {k for k, v in self._streams.items() if v is None}
        self._capacity, self._reserve = capacity, reserve
        self._queue: collections.deque[tuple[str, str]] = collections.deque()
        self._bytes = 0  # queued (characters, as written)
        self._cond = threading.Condition()
        self._dropped = 0
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="elasticrun-console", daemon=True)
        self._thread.start()

    def gone(self, stream: str) -> bool:
        """Whether ``stream`` can no longer be written (closed by its reader)."""
        return stream in self._gone

    def write(self, stream: str, text: str, wait: bool) -> None:
        """Queue ``text`` for ``stream``. ``wait``: wait for room (a worker's line); otherwise a
        line past the reserve is dropped and counted (the driver's own)."""
        with self._cond:
            if not self._thread.is_alive():  # closed: written here, as without a console
                self._put_now(stream, text)
                return
            if wait:
                while self._bytes >= self._capacity and self._thread.is_alive():
                    self._cond.wait(1.0)
            elif self._bytes + len(text) > self._capacity + self._reserve:
                self._dropped += 1
                return
            self._queue.append((stream, text))
            self._bytes += len(text)
            self._cond.notify_all()

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (at most ``timeout`` seconds: a console nobody reads must not
        hold the driver's exit for good), then stop the thread."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:  # closing, and everything written
                    return
                batch = list(self._queue)
                self._queue.clear()
                self._bytes = 0
                dropped, self._dropped = self._dropped, 0
                self._cond.notify_all()  # room again for lines that wait
            if dropped:
                batch.append(("stderr", f"[elasticrun] {dropped} line(s) of the driver's own were not printed: "
                                        f"the console was not read meanwhile\n"))
            self._write(batch)

    def _write(self, batch: list[tuple[str, str]]) -> None:
        """Write a batch, a stream's run of lines at once; a stream that fails is gone."""
        i = 0
        while i < len(batch):
            stream = batch[i][0]
            j = i
            while j < len(batch) and batch[j][0] == stream:
                j += 1
            self._put_now(stream, "".join(text for _, text in batch[i:j]))
            i = j

    def _put_now(self, stream: str, text: str) -> None:
        if stream in self._gone:
            return
        out = self._streams.get(stream)
        try:
            assert out is not None
            out.write(text)
            out.flush()
        except (OSError, ValueError, AssertionError):  # closed by whoever reads it
            self._gone.add(stream)


class ConsoleHandler(logging.Handler):
    """The driver's log lines, queued on a :class:`Console` without ever waiting."""

    def __init__(self, console: Console, stream: str = "stderr"):
        super().__init__()
        self._console, self._stream = console, stream

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._console.write(self._stream, self.format(record) + "\n", wait=False)
        except Exception:
            self.handleError(record)


_current: Console | None = None


def install(console: Console | None) -> None:
    """Make ``console`` the one the driver's output sink writes through (None: direct writes)."""
    global _current
    _current = console


def current() -> Console | None:
    return _current
