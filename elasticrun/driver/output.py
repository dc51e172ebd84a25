"""Worker output: rank-prefixed lines on the console and per-rank log files.

The prefix is the worker's rank *now* (ranks change across resets), looked up per line, so
the console always reads like the current job. Per-rank files are opened in append mode,
so a worker restarted into a rank never truncates what an earlier one wrote.

Output is a diagnostic: a per-rank file that cannot be written (a full disk) is a warning,
and a console that is gone (``elasticrun ... | head``) drops lines. Neither ends the pump:
a pump that died would leave the worker blocked on a full pipe.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from typing import IO, Callable, Protocol

from elasticrun.common.diagnostics import DiagnosticFile
from elasticrun.common.lines import lines
from elasticrun.common.ratelimit import LimitedLog
from elasticrun.driver import console

log = logging.getLogger("elasticrun")


class Output(Protocol):
    """Where a launcher writes its workers' output, line by line (from any thread)."""

    def write(self, worker_id: str, stream: str, line: str) -> None: ...


class OutputSink:
    def __init__(self, rank_of: Callable[[str], int], directory: str | None = None,
                 stdout: IO[str] | None = None, stderr: IO[str] | None = None, timestamps: bool = False,
                 limited: LimitedLog | None = None):
        self._rank_of = rank_of
        self._timestamps = timestamps  # --prefix-output-with-timestamp: horovodrun's line format
        self._dir = directory
        self._console = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        self._files: dict[tuple[int, str], DiagnosticFile] = {}
        self._limited = limited
        # A driver started with a stream closed (``>&-``) has None there: a console gone from the start.
        self._console_gone: set[str] = {k for k, v in self._console.items() if v is None}
        self._lock = threading.Lock()

    def write(self, worker_id: str, stream: str, line: str) -> None:
        rank = self._rank_of(worker_id)
        text = line if line.endswith("\n") else line + "\n"
        queue = console.current()
        if queue is not None:  # the driver's console thread: in order with the driver's own lines
            if not queue.gone(stream):
                stamp = time.asctime() if self._timestamps else ""
                queue.write(stream, f"{stamp}[{rank}]<{stream}>:{text}", wait=True)
        with self._lock:
            if queue is None and stream not in self._console_gone:
                out = self._console[stream]
                stamp = time.asctime() if self._timestamps else ""
                try:
                    out.write(f"{stamp}[{rank}]<{stream}>:{text}")
                    out.flush()
                except (OSError, ValueError):  # closed by whoever reads it: the files still get it
                    self._console_gone.add(stream)
            if self._dir is not None and rank >= 0:
                self._file(rank, stream).write(text)

    def _file(self, rank: int, stream: str) -> DiagnosticFile:
        f = self._files.get((rank, stream))
        if f is None:  # (rank.N and its file: never through a link planted in a shared directory)
            directory = self._dir or "."
            f = DiagnosticFile(os.path.join(directory, f"rank.{rank}", stream), f"rank {rank}'s {stream} file",
                               self._limited, beneath=directory)
            self._files[(rank, stream)] = f
        return f

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()


def pump(pipe: IO[bytes], worker_id: str, stream: str, sink: Output,
         done: Callable[[], None] | None = None) -> threading.Thread:
    """Copy ``pipe`` line by line into ``sink`` on a daemon thread (ends at EOF); a line over
    :data:`~elasticrun.common.lines.LINE_LIMIT` bytes in pieces. ``done`` is called at its end,
    once every line is out (the launcher then forgets the worker)."""

    def run() -> None:
        said = False
        try:
            with pipe:
                for line in lines(pipe):
                    try:
                        sink.write(worker_id, stream, line)
                    except Exception:  # never stop reading: the worker would block on a full pipe, or die of EPIPE
                        if not said:
                            said = True
                            log.exception("%s's %s: a line could not be written (later failures go unsaid)",
                                          worker_id, stream)
        finally:
            if done is not None:
                done()

    thread = threading.Thread(target=run, name=f"elasticrun-output-{worker_id}-{stream}", daemon=True)
    thread.start()
    return thread
