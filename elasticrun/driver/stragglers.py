"""Which hosts are stragglers: a pure decision (no clock, no socket), fed by heartbeats.

Every worker measures its own steps (``elasticrun/worker/pace.py``): how long each step took
and how long of it the rank waited in the gradient allreduce. In synchronous data parallel
every rank's step takes as long (they all wait for the slowest), so the step time names
nobody; its *compute* (step minus wait) does: the slow rank computes long and waits little,
the others compute quickly and wait for it. Each heartbeat carries the medians over the
rank's last ``window`` (20) steps of the current round (:class:`Pace`).

The rule (:meth:`StragglerDetector.evaluate`), over the members of the current round whose
window is full:

* a host's pace is its slowest worker's median compute per step (one slow GPU of a host
  drags the job as much as a slow host does);
* a host is a straggler when its pace exceeds ``ratio`` (1.5) times the median of the other
  hosts' paces, and by at least ``min_excess`` (5 ms) a step, and it is in the slower half
  (above the median of all): so at most half the hosts are ever named, and of hosts computing
  1, 10 and 10 ms the two at 10 are the norm, not two stragglers.

Why it does not flag noise: each figure is a median over 20 steps, so a host is named only
when at least half of its last 20 steps were slow: one slow step (a GC pause, a commit
written to disk, a page fault storm) moves no median. Windows start afresh in each round, so
the first steps after a reset (the sync, warm caches) never count, and a round must have run
20 steps before anyone is compared. The absolute margin keeps microsecond jitter of a tiny
model from being a "1.5x". In a 2-host job "the median of the others" is the one other host:
the comparison is symmetric (both cannot be 1.5x slower than the other), so it still names
the slower host only when it is clearly slower; whether evicting it *pays* is a separate
question (:func:`eviction_pays`): with 2 hosts of one slot, dropping one halves the samples
per step, so it pays only when the straggler more than doubles the step time.

A named host stays named (it is said once) until it has not been slow for ``hold`` (30 s) in
a row; its figures (:meth:`StragglerDetector.named`) are those of the latest evaluation. A
host named before (in the last ``repeat``, 10 minutes) is named again only after it has been
slow for ``hold`` in a row. The first naming waits for nothing but the window, so a real
straggler is named within its first 20 slow steps; the holds keep a host whose pace swings
with the load of a shared machine from being named and cleared every few seconds (each line
contradicting the one before, and each naming a possible eviction).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elasticrun.common.settings import STRAGGLER_WINDOW

#: A straggler computes more than this many times the median of the other hosts ...
RATIO = 1.5
#: ... and at least this much more per step (seconds).
MIN_EXCESS = 0.005
#: A named host is cleared, and a host cleared within REPEAT is named again, only once the new
#: verdict has held this long (seconds).
HOLD = 30.0
REPEAT = 600.0


@dataclass(frozen=True)
class Pace:
    """A worker's recent steps, as its heartbeat reports them: medians over the last
    ``steps`` steps of round ``round`` (seconds)."""

    round: int
    steps: int
    step: float  # median time per step
    wait: float  # median time waiting in the gradient allreduce
    compute: float  # median of (step - wait)

    def as_dict(self) -> dict[str, Any]:
        return {"round": self.round, "steps": self.steps, "step": self.step, "wait": self.wait,
                "compute": self.compute}

    @classmethod
    def parse(cls, body: Any) -> Pace | None:
        """A heartbeat's ``pace`` field, or None when it is absent or not well formed."""
        if not isinstance(body, dict):
            return None
        r, n = body.get("round"), body.get("steps")
        if not (isinstance(r, int) and isinstance(n, int)) or isinstance(r, bool) or isinstance(n, bool):
            return None
        values = [body.get(k) for k in ("step", "wait", "compute")]
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) != 3 or not all(math.isfinite(v) and 0 <= v < 1e6 for v in numbers):
            return None
        if not 0 < n <= 1_000_000:
            return None
        return cls(r, n, numbers[0], numbers[1], numbers[2])


@dataclass(frozen=True)
class Straggler:
    """A host named a straggler, with the figures that named it (seconds)."""

    host: str
    compute: float  # its slowest worker's median compute per step
    reference: float  # the median of the other hosts' paces
    step: float  # the job's median step time (every rank's is the same)
    steps: int  # the window the medians are over
    others: int  # how many other hosts were compared

    def fields(self) -> dict[str, Any]:
        """Its figures as an event's fields (ms), which ``words.straggler`` words."""
        return {"host": self.host, "compute_ms": round(self.compute * 1000, 2),
                "reference_ms": round(self.reference * 1000, 2), "step_ms": round(self.step * 1000, 2),
                "steps": self.steps, "others": self.others}


def median_without(ordered: list[float], i: int) -> float:
    """The median of sorted ``ordered`` without its element at index ``i`` (at least 2 elements)."""
    m = len(ordered) - 1

    def at(k: int) -> float:
        return ordered[k] if k < i else ordered[k + 1]

    return (at((m - 1) // 2) + at(m // 2)) / 2


def eviction_pays(workers: int, leaving: int, step: float, compute: float, next_slowest: float) -> bool:
    """Whether the job trains more samples per second without ``leaving`` of its ``workers``.

    Samples per step are proportional to the workers; the step time without the stragglers
    is estimated as today's less the drag (their compute less that of the slowest host that
    stays, who sets the pace then): ``(workers - leaving) / step' > workers / step``.
    """
    if leaving >= workers:
        return False
    after = max(step - max(0.0, compute - next_slowest), 1e-9)
    return (workers - leaving) * step > workers * after


class StragglerDetector:
    """Paces reported by workers -> the hosts that are stragglers (see the module docstring).

    :meth:`report` only records (O(1), once per heartbeat) and says whether a decision may be
    due; :meth:`evaluate` decides, in O(H log H) for H hosts.
    """

    def __init__(self, window: int = STRAGGLER_WINDOW, ratio: float = RATIO, min_excess: float = MIN_EXCESS,
                 hold: float = HOLD, repeat: float = REPEAT):
        self.window = window
        self.ratio = ratio
        self.min_excess = min_excess
        self.hold = hold
        self.repeat = repeat
        # host -> since when the evidence has disagreed with its verdict, where a change waits for
        # ``hold``; host -> when it was last cleared.
        self._pending: dict[str, float] = {}
        self._cleared: dict[str, float] = {}
        self._paces: dict[str, tuple[str, Pace]] = {}  # worker -> (host, its latest pace)
        self._named: dict[str, Straggler] = {}
        # Per host, the compute above which it would be a straggler, as of the last evaluation
        # (inf: nobody to compare it with): a report crossing it asks for a decision now.
        self._threshold: dict[str, float] = {}
        self._fresh = False  # reports arrived since the last evaluation
        self._host_paces: dict[str, float] = {}  # host -> its pace, as of the last evaluation

    def report(self, worker: str, host: str, pace: Pace) -> bool:
        """Record a worker's pace; True when it may change a verdict (decide soon)."""
        self._paces[worker] = (host, pace)
        self._fresh = True
        if pace.steps < self.window:
            return False
        threshold = self._threshold.get(host)
        if threshold is None:
            return True
        return (pace.compute > threshold) != (host in self._named)

    def named(self) -> dict[str, Straggler]:
        """The hosts named stragglers now."""
        return dict(self._named)

    def paces(self) -> dict[str, float]:
        """Each compared host's pace (its slowest worker's median compute), as of the last evaluation."""
        return dict(self._host_paces)

    def evaluate(self, round_: int, members: Mapping[str, str],
                 now: float = 0.0) -> tuple[list[Straggler], list[str]]:
        """The verdicts for round ``round_`` of ``members`` (worker -> host) at time ``now``:
        the hosts newly named stragglers, and those that no longer are. Paces of other rounds,
        or of workers no longer members, are dropped."""
        if self._named:
            hosts = set(members.values())
            for h in [h for h in self._named if h not in hosts]:
                del self._named[h]  # gone from the round: nothing to say (it is judged afresh if it comes back)
        if not self._fresh:
            return [], []
        self._fresh = False
        for w in [w for w, (_, p) in self._paces.items() if w not in members or p.round != round_]:
            del self._paces[w]
        pace: dict[str, float] = {}
        step: dict[str, float] = {}
        for w, (host, p) in self._paces.items():
            if p.steps >= self.window and members.get(w) == host and p.compute >= pace.get(host, -1.0):
                pace[host], step[host] = p.compute, p.step
        self._threshold = {h: math.inf for h in pace}
        self._host_paces = pace
        for h in [h for h in self._pending if h not in pace]:
            del self._pending[h]  # no full window to judge it by: a hold starts again
        if len(pace) < 2:
            self._pending.clear()
            return [], []
        ordered = sorted(pace.items(), key=lambda hp: hp[1])
        values = [v for _, v in ordered]
        middle = (values[(len(values) - 1) // 2] + values[len(values) // 2]) / 2  # the median of all of them
        newly: list[Straggler] = []
        recovered: list[str] = []
        for i, (host, compute) in enumerate(ordered):
            reference = median_without(values, i)
            # Only the slower half can drag "the rest": of hosts 1, 10, 10 the odd one is fast.
            self._threshold[host] = max(self.ratio * reference, reference + self.min_excess, middle)
            slow = compute > self._threshold[host]
            named = host in self._named
            if slow != named and (named or now - self._cleared.get(host, -math.inf) < self.repeat):
                since = self._pending.setdefault(host, now)
                if now - since < self.hold:
                    continue  # the verdict holds a while yet
            self._pending.pop(host, None)
            if slow:
                s = Straggler(host, compute, reference, step[host], self.window, len(values) - 1)
                if not named:
                    newly.append(s)
                # The latest figures, also for a host named before: whether evicting it pays is
                # judged on them (a host named at 1.6x that now computes 10x longer must go).
                self._named[host] = s
            elif named:
                del self._named[host]
                self._cleared[host] = now
                recovered.append(host)
        return newly, recovered
