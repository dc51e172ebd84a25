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


def _hosts_cause(first: str, then: str) -> str:
    """Two host updates' causes ("hosts removed", "hosts added and removed") as one."""
    what = [w for w in ("added", "removed") if w in first.split() or w in then.split()]
    return "hosts " + " and ".join(what) if what else first


@dataclass
class ResetTracker:
    size: int = 0  # workers in the current round
    rounds: int = 0
    by_kind: Counter = field(default_factory=Counter)
    recovering: float = 0.0  # seconds from triggers to training again, summed
    timed: int = 0  # resets whose first step was reported (the others' rounds never trained)
    # Resets not closed yet, oldest first. More than one when a trigger ends a round whose
    # first step has not been reported yet (workers ship their events a little late): a host
    # update during a reset is a reset of its own, not folded into the previous one.
    _open: list[_Open] = field(default_factory=list)
    _done: list[str] = field(default_factory=list)

    def trigger(self, kind: str, cause: str, t: float) -> None:
        """A failure or a host update ends the current round (the first trigger counts; a
        second host update before the next round adds what it changed: "hosts removed", then
        a host added as well, is a reset for "hosts added and removed"; a failure after a host
        update makes it a failure's reset)."""
        if self.rounds > 0 and (not self._open or self._open[-1].round is not None):
            self._open.append(_Open(cause, kind, t, self.size))
        elif self._open and self._open[-1].round is None and kind == self._open[-1].kind == "hosts":
            self._open[-1].cause = _hosts_cause(self._open[-1].cause, cause)
        elif self._open and self._open[-1].round is None and kind == "failure" and self._open[-1].kind == "hosts":
            # A failure while the workers were still to act on a host update: the round ends in
            # a rollback, a failure's reset, timed from the failure (until then they trained).
            o = self._open[-1]
            o.cause, o.kind, o.start = f"{cause}; {o.cause} meanwhile", "failure", t

    def round_formed(self, round_: int, size: int) -> None:
        """Every round after the first is a reset (as the registry counts them): counted here,
        by the cause that ended the round before; timed when its first step is reported."""
        self.rounds += 1
        self.size = size
        if self._open and self._open[-1].round is None:
            self._open[-1].round, self._open[-1].to_size = round_, size
            self.by_kind[self._open[-1].kind] += 1
        elif self.rounds > 1:
            self.by_kind["other"] += 1

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
        self.recovering += seconds
        self.timed += 1
        first = mine[0].round if mine[0].round is not None else round_
        folded = f", through {round_ - first + 1} rounds" if first != round_ else ""
        line = (f"reset {round_} ({o.cause}): {o.from_size} -> {o.to_size} worker(s){folded}, "
                f"training again {seconds * 1000:.0f} ms after it")
        return {"line": line, "cause": o.cause, "trigger": o.kind, "round": round_, "from_size": o.from_size,
                "to_size": o.to_size, "seconds": seconds}

    def open_since(self) -> float | None:
        """When the oldest reset not closed yet began, once its next round has formed and not
        trained yet (None otherwise: before the round forms, the workers train on to their next
        commit, which may be minutes away)."""
        if not any(o.round is not None for o in self._open):
            return None
        return self._open[0].start

    def summary(self, blacklisted: list[str], back: list[str] | None = None, end: float | None = None) -> str:
        """``blacklisted``: hosts still kept out at the end; ``back``: hosts that were, and came
        back after their cooldown (named apart: the job used them again). ``end``: when the job
        ended; a reset still open then (its round never trained, or never formed: the job timed
        out or was stopped meanwhile) counts, with its time up to the end."""
        kinds_n = self.by_kind.copy()
        unformed = [o for o in self._open if o.round is None] if end is not None else []
        for o in unformed:  # (the formed ones are counted in by_kind already)
            kinds_n[o.kind] += 1
        resets = sum(kinds_n.values())
        names = {"failure": "after failures", "hosts": "after host changes", "other": "other"}
        kinds = ", ".join(f"{n} {names.get(k, k)}" for k, n in sorted(kinds_n.items())) or "none"
        black = ", ".join(blacklisted) or "none"
        untimed = resets - self.timed
        note = f" ({untimed} ended before training resumed)" if untimed > 0 else ""
        recovering = self.recovering + (sum(max(0.0, end - o.start) for o in self._open) if end is not None else 0.0)
        returned = f" (back after a cooldown: {', '.join(back)})" if back else ""
        return (f"{self.rounds} round(s), {resets} reset(s) ({kinds}), {recovering:.2f} s spent "
                f"recovering{note}; blacklisted hosts: {black}{returned}")
