"""This rank's recent steps: how long each took, and how long of it was spent waiting in the
gradient allreduce. The driver names stragglers from them (``elasticrun/driver/stragglers.py``).

In synchronous data parallel every rank's step takes as long as the slowest rank's, so a
step's *compute* (its time less the wait) is what tells the slow rank apart: it computes long
and waits little. The training thread records two numbers per step into fixed rings (no
allocation beyond two floats, no lock); the control thread reads the rings for each
heartbeat and sends medians over the window (:meth:`StepPace.summary`). Both threads run
under the GIL: a summary read while a step is recorded may mix that one step's two numbers,
which a median over 20 does not notice; a summary that straddles a new round is dropped.

No torch, no I/O.
"""

from __future__ import annotations

import statistics
from typing import Any

from elasticrun.common.settings import STRAGGLER_WINDOW

__all__ = ["StepPace"]


class StepPace:
    """Ring of the last ``window`` steps of the current round: step time and allreduce wait."""

    __slots__ = ("_count", "_generation", "_last", "_steps", "_waits", "round", "window")

    def __init__(self, window: int = STRAGGLER_WINDOW) -> None:
        self.window = window
        self.round = -1
        self._steps = [0.0] * window
        self._waits = [0.0] * window
        self._count = 0  # steps recorded in this round
        self._last: float | None = None  # when the previous step of this round ended
        self._generation = 0  # bumped by new_round: a reader straddling it drops its summary

    def new_round(self, number: int) -> None:
        """A new round: its first step, which follows the sync, starts a fresh window."""
        self._generation += 1
        self.round = number
        self._count = 0
        self._last = None

    def record(self, now: float, wait: float) -> None:
        """A step ended at ``now`` (perf_counter seconds), after waiting ``wait`` s for its
        gradients. The first step of a round only sets the clock."""
        last = self._last
        self._last = now
        if last is not None:
            i = self._count % self.window
            self._steps[i] = now - last
            self._waits[i] = wait
            self._count += 1

    def summary(self) -> dict[str, Any] | None:
        """Medians over the window (seconds), as a heartbeat carries them; None before the
        round's second step ended."""
        generation, number, count = self._generation, self.round, self._count
        n = min(count, self.window)
        if n == 0:
            return None
        steps, waits = self._steps[:], self._waits[:]  # copies: the training thread goes on
        if self._generation != generation:
            return None
        if n < self.window:
            steps, waits = steps[:n], waits[:n]
        compute = [max(0.0, s - w) for s, w in zip(steps, waits)]
        return {"round": number, "steps": n, "step": statistics.median(steps), "wait": statistics.median(waits),
                "compute": statistics.median(compute)}
