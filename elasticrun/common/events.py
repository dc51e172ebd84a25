"""The job's event log: one JSON object per line, written by the driver.

Workers do not write files: they queue events in memory (no I/O on the training path) and
their control thread ships them to the driver, which appends them to the same file. Every
event carries the wall-clock time it happened (``t``, seconds since the epoch, taken where it
happened), its ``kind`` and ``source`` ("driver" or "worker"), and where known the round, host
and rank, so that a reset can be split into phases after the fact (benchmarks/recovery.py).

Kinds (driver): discovery, host_added, host_removed, host_resized, host_blacklisted,
host_whitelisted, worker_started, worker_exited, worker_failed, worker_succeeded,
notification_sent, round_aborted, round_formed, reset, job_end.
Kinds (worker): rendezvous_complete, group_formed, notification_received, interrupt,
failure_detected, restore, sync_done, first_step.
"""

from __future__ import annotations

import json
import threading
import time
from typing import IO, Any


class EventLog:
    """Appends events to a JSON-lines file (thread-safe); a no-op without a path."""

    def __init__(self, path: str | None):
        self._file: IO[str] | None = open(path, "a", buffering=1, encoding="utf-8") if path else None
        self._lock = threading.Lock()

    def write(self, kind: str, source: str = "driver", t: float | None = None, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"t": time.time() if t is None else t, "kind": kind, "source": source}
        record.update({k: v for k, v in fields.items() if v is not None})
        line = json.dumps(record, separators=(",", ":"), default=str)
        with self._lock:
            if self._file is not None:
                self._file.write(line + "\n")

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_events(path: str) -> list[dict[str, Any]]:
    """Load an event log, ordered by time (workers' events arrive a little late)."""
    with open(path, encoding="utf-8") as f:
        events = [json.loads(line) for line in f if line.strip()]
    return sorted(events, key=lambda e: e["t"])
