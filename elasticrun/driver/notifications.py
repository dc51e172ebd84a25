"""Host-update notifications: their timestamps and the replay list (pure; wall time passed in).

Workers interrupt when they see an update newer than the last one they handled, so the
timestamps must strictly increase even within one clock tick or when the clock steps back.
A notification can miss a worker (sent before the driver knew its connection, which it learns
from the worker's first heartbeat, or dropped on a full queue), so heartbeat replies repeat
the most recent ones: a worker learns of every update within one heartbeat.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Update:
    ts: float  # seconds since the epoch, strictly increasing within a job
    added: bool
    removed: bool

    def as_list(self) -> list[float | bool]:
        return [self.ts, self.added, self.removed]


class Notifications:
    """The updates published so far: the newest timestamp and the last ``keep`` for replay."""

    def __init__(self, keep: int = 16):
        self._recent: deque[Update] = deque(maxlen=keep)
        self.last_ts = 0.0  # 0: none yet; new rounds tell workers the newest one they include

    def publish(self, added: bool, removed: bool, wall: float) -> Update:
        """A new update stamped ``wall`` (or just after the previous one, if the clock disagrees)."""
        self.last_ts = max(wall, self.last_ts + 1e-6)
        update = Update(self.last_ts, added, removed)
        self._recent.append(update)
        return update

    def recent(self) -> list[list[float | bool]]:
        """The updates heartbeat replies repeat, oldest first."""
        return [u.as_list() for u in self._recent]
