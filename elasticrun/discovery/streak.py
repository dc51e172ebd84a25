"""Discovery runs that fail in a row: how long it has lasted, said now and then (pure).

The driver says each distinct failure once (a script failing every second would otherwise
print a line a second). But a discovery that has failed for hours then shows only its first
line, and the job runs on hosts that may be long gone, with nothing on the console saying
so: this says how long the failures have lasted every :data:`REMINDER` seconds, and when
they end.
"""

from __future__ import annotations

__all__ = ["REMINDER", "FailureStreak"]

#: How often a streak of failed discovery runs is said again.
REMINDER = 600.0


class FailureStreak:
    """Fed every run's outcome; returns the line to say, if any (no clock inside)."""

    def __init__(self) -> None:
        self.count = 0
        self.since: float | None = None
        self._next = 0.0

    def failed(self, now: float, why: str) -> str | None:
        self.count += 1
        if self.since is None:  # the first: the caller says the failure itself
            self.since, self._next = now, now + REMINDER
            return None
        if now < self._next:
            return None
        self._next = now + REMINDER
        return (f"discovery has failed {self.count} run(s) in a row, for {now - self.since:.0f} s (the last: "
                f"{why[:300]}); the job keeps the hosts it last found")

    def succeeded(self, now: float) -> str | None:
        if self.since is None:
            return None
        line = f"discovery works again, after {self.count} failed run(s) in {now - self.since:.0f} s"
        self.count, self.since = 0, None
        return line
