"""``hvd.start_timeline(path)`` / ``hvd.stop_timeline()``: a Chrome trace of this rank's collectives.

Horovod's timeline records the negotiation and execution phases of every tensor in its
background thread. elasticrun has no background thread: an operation runs from the moment it
is issued on the round's gloo group to the moment its wait returns, so each one is a single
complete event ("ph": "X") from issue to completion, on one track per round, with its shape,
dtype and bytes. Events are kept in memory and written when the timeline stops (or the
process exits), so recording costs the training thread one list append per operation.
Open the file in ui.perfetto.dev or chrome://tracing; the job-wide picture of resets is
``elasticrun --events`` (``elasticrun timeline``).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

__all__ = ["Timeline", "active", "start", "stop"]


class Timeline:
    """Events of one recording, written to ``path`` as a JSON array at :meth:`close`."""

    def __init__(self, path: str, mark_cycles: bool = False) -> None:
        self.path = os.path.abspath(path)
        with open(self.path, "w", encoding="utf-8") as f:  # fail now, not at the end, if it cannot be written
            f.write("[]\n")
        self.mark_cycles = mark_cycles
        self.events: list[dict[str, Any]] = []
        self._pid = os.getpid()
        self._lock = threading.Lock()

    def record(self, name: str, start: float, end: float, round_: int, **args: Any) -> None:
        """One operation, ``start``/``end`` from ``time.perf_counter()``."""
        self.events.append({"name": name, "ph": "X", "ts": start * 1e6, "dur": max(0.0, end - start) * 1e6,
                            "pid": self._pid, "tid": round_, "args": args})

    def close(self) -> None:
        with self._lock:
            rounds = sorted({e["tid"] for e in self.events})
            meta = [{"name": "process_name", "ph": "M", "pid": self._pid, "args": {"name": f"rank (pid {self._pid})"}}]
            meta += [{"name": "thread_name", "ph": "M", "pid": self._pid, "tid": r, "args": {"name": f"round {r}"}}
                     for r in rounds]
            tmp = self.path + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(meta + self.events, f)
            os.replace(tmp, self.path)


_active: Timeline | None = None


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
