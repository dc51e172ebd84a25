"""Bookkeeping of resets for the console and the event log (pure: times are passed in).

A reset starts at its *trigger* (the driver learning of a failure, or publishing a host
update), spans the formation of the next round, and ends when a worker of the new round
completes its first collective after re-syncing: training is moving again. The driver
prints one line per reset and a summary at exit; users see what each change cost.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class _Open:
    cause: str
    kind: str  # "failure" | "hosts"
    start: float
    from_size: int
    round: int | None = None
    to_size: int = 0


@dataclass
class ResetTracker:
    size: int = 0  # workers in the current round
    rounds: int = 0
    by_kind: Counter = field(default_factory=Counter)
    recovering: float = 0.0  # seconds from triggers to training again, summed
    # Resets not closed yet, oldest first. More than one when a trigger ends a round whose
    # first step has not been reported yet (workers ship their events a little late): a host
    # update during a reset is a reset of its own, not folded into the previous one.
    _open: list[_Open] = field(default_factory=list)
    _done: list[str] = field(default_factory=list)

    def trigger(self, kind: str, cause: str, t: float) -> None:
        """A failure or a host update ends the current round (the first trigger counts)."""
        if self.rounds > 0 and (not self._open or self._open[-1].round is not None):
            self._open.append(_Open(cause, kind, t, self.size))

    def round_formed(self, round_: int, size: int) -> None:
        self.rounds += 1
        self.size = size
        if self._open and self._open[-1].round is None:
            self._open[-1].round, self._open[-1].to_size = round_, size

    def first_step(self, round_: int, t: float) -> dict | None:
        """Training resumed in ``round_``: close the open reset and describe it (or None).

        Older resets whose round never trained (it was aborted, or ended by another update
        before its first step) end here too: they are folded into this one (first cause,
        first start, first size)."""
        mine = [o for o in self._open if o.round is not None and o.round <= round_]
        if not mine or mine[-1].round != round_:
            return None
        self._open = [o for o in self._open if all(o is not m for m in mine)]
        o = _Open(mine[0].cause, mine[0].kind, mine[0].start, mine[0].from_size, round_, mine[-1].to_size)
        seconds = max(0.0, t - o.start)
        self.by_kind[o.kind] += 1
        self.recovering += seconds
        n = sum(self.by_kind.values())
        line = (f"reset {n} ({o.cause}): {o.from_size} -> {o.to_size} worker(s), "
                f"training again {seconds * 1000:.0f} ms after it")
        return {"line": line, "cause": o.cause, "trigger": o.kind, "round": round_, "from_size": o.from_size,
                "to_size": o.to_size, "seconds": seconds}

    def summary(self, blacklisted: list[str]) -> str:
        resets = sum(self.by_kind.values())
        kinds = ", ".join(f"{n} after {'failures' if k == 'failure' else 'host changes'}"
                          for k, n in sorted(self.by_kind.items())) or "none"
        black = ", ".join(blacklisted) or "none"
        return (f"{self.rounds} round(s), {resets} reset(s) ({kinds}), {self.recovering:.2f} s spent "
                f"recovering; blacklisted hosts: {black}")
