"""Bounded logging of problems that strangers or broken input can repeat without end.

Anyone who can reach the driver's port can send it garbage frames, and a broken discovery
script can print thousands of bad lines every second: logging each one turns a flood of
input into a flood of log lines (50,000 frames were 50,000 lines). :class:`LogLimiter` says
the first few occurrences of a category in full, then at most one summary line per interval
with counts by reason, and forgets a category once it has been quiet for a whole interval
(so a new burst is shown in full again). Its memory is bounded: at most ``max_categories``
categories and ``max_reasons`` reasons each; the excess is counted under "other".

The limiter is pure (no threads, no clock, no I/O): callers pass the time and log the lines
it returns. :class:`LimitedLog` is the thin shell that does both for a logger.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

#: Occurrences of a category said in full before counting starts.
FIRST = 5
#: Seconds between two summary lines of one category.
INTERVAL = 10.0
MAX_CATEGORIES = 64
MAX_REASONS = 8
OTHER = "other"
#: Where occurrences go when every category place holds something still to be summarized.
OVERFLOW = "other problems"


@dataclass
class _Category:
    last_hit: float
    shown: int = 0  # said in full since the category was (re)created
    since: float = 0.0  # first occurrence counted since the last summary
    last_summary: float | None = None
    pending: dict[str, int] = field(default_factory=dict)  # counted, not summarized yet: reason -> n


class LogLimiter:
    """Decides which lines to log for repeated problems (see the module docstring).

    ``hit`` never returns a summary: summaries come from ``flush``, which callers run after
    each batch of input (a drained socket, a discovery run) and when they stop, so counts
    are never lost. The first summary of a category may come at once (e.g. right after the
    discovery run that caused it); later ones at least ``interval`` seconds apart.
    """

    def __init__(self, first: int = FIRST, interval: float = INTERVAL, max_categories: int = MAX_CATEGORIES,
                 max_reasons: int = MAX_REASONS):
        if max_categories < 1 or max_reasons < 1:
            raise ValueError("max_categories and max_reasons must be at least 1")
        self.first = first
        self.interval = interval
        self.max_categories = max_categories
        self.max_reasons = max_reasons
        self._categories: dict[str, _Category] = {}

    def hit(self, category: str, message: str, now: float, reason: str = OTHER) -> list[str]:
        """One occurrence of ``category`` (``reason``: a short, fixed text for the summary's
        counts, never the variable details). Returns the lines to log now: ``[message]`` or []."""
        name, c = self._category(category, now)
        c.last_hit = now
        if c.shown < self.first and not c.pending:
            c.shown += 1
            return [message]
        self._count(c, reason if name == category else category, 1, now)
        return []

    def count(self, category: str, n: int, now: float, reason: str = OTHER) -> None:
        """``n`` occurrences known only by number (their details were not kept): summarized, never shown."""
        if n > 0:
            name, c = self._category(category, now)
            c.last_hit = now
            self._count(c, reason if name == category else category, n, now)

    def flush(self, now: float, force: bool = False) -> list[str]:
        """Summary lines that are due (all pending ones with ``force``: when the job ends).

        Also forgets categories with nothing pending that were quiet for ``interval``."""
        lines: list[str] = []
        for name in list(self._categories):
            c = self._categories[name]
            if c.pending and (force or c.last_summary is None or now - c.last_summary >= self.interval):
                lines.append(self._summary(name, c, now))
                c.pending = {}
                c.last_summary = now
            elif not c.pending and now - c.last_hit >= self.interval and (
                    c.last_summary is None or now - c.last_summary >= self.interval):
                del self._categories[name]
        return lines

    def __len__(self) -> int:
        return len(self._categories)

    # --- internals -----------------------------------------------------------------------
    def _category(self, name: str, now: float) -> tuple[str, _Category]:
        """The category called ``name``, or the overflow one when there is no room for it."""
        c = self._categories.get(name)
        if c is not None:
            return name, c
        if len(self._categories) >= self.max_categories:
            idle = [k for k, v in self._categories.items() if not v.pending and k != OVERFLOW]
            if idle:  # the longest quiet one makes room: it has nothing left to say
                del self._categories[min(idle, key=lambda k: self._categories[k].last_hit)]
            else:
                if OVERFLOW not in self._categories:  # keep the cap: fold the oldest into the overflow
                    oldest = min(self._categories, key=lambda k: self._categories[k].last_hit)
                    folded = self._categories.pop(oldest)
                    overflow = self._categories[OVERFLOW] = _Category(last_hit=now, shown=self.first)
                    self._count(overflow, oldest, sum(folded.pending.values()), folded.since)
                return OVERFLOW, self._categories[OVERFLOW]
        c = self._categories[name] = _Category(last_hit=now)
        return name, c

    def _count(self, c: _Category, reason: str, n: int, now: float) -> None:
        if not c.pending:
            c.since = now
        if reason not in c.pending and len(c.pending) >= self.max_reasons - 1:
            reason = OTHER  # the last place is kept for everything else
        c.pending[reason] = c.pending.get(reason, 0) + n

    @staticmethod
    def _summary(name: str, c: _Category, now: float) -> str:
        total = sum(c.pending.values())
        seconds = max(0.0, now - c.since)
        span = "" if seconds < 1 else f" in the last {seconds:.0f} s" if seconds >= 10 else f" in the last {seconds:.1f} s"
        reasons = ", ".join(f"{n:,} {r}" for r, n in sorted(c.pending.items(), key=lambda kv: -kv[1]))
        return f"{total:,} more {name}{span}: {reasons}"


class LimitedLog:
    """A :class:`LogLimiter` bound to a logger and a clock (thread-safe).

    Usage: ``limited.warn("dropped control frames", f"dropped a control frame: {exc}", exc.reason)``
    for each occurrence, ``limited.flush()`` after each batch, ``limited.flush(force=True)`` at the end.
    """

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING,
                 clock: Callable[[], float] = time.monotonic, limiter: LogLimiter | None = None):
        self._log = logger
        self._level = level
        self._clock = clock
        self._limiter = limiter if limiter is not None else LogLimiter()
        self._lock = threading.Lock()

    def warn(self, category: str, message: str, reason: str = OTHER) -> None:
        with self._lock:
            lines = self._limiter.hit(category, message, self._clock(), reason)
        for line in lines:
            self._log.log(self._level, "%s", line)

    def count(self, category: str, n: int, reason: str = OTHER) -> None:
        with self._lock:
            self._limiter.count(category, n, self._clock(), reason)

    def flush(self, force: bool = False) -> None:
        with self._lock:
            if not len(self._limiter):
                return
            lines = self._limiter.flush(self._clock(), force)
        for line in lines:
            self._log.log(self._level, "%s", line)
