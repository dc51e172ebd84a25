"""HostUpdates: which host updates a worker has seen, and when every rank agrees on them.

Three kinds of tests: examples of each method; a comparison, on any sequence of calls, with
the straightforward model it replaced (a dict of every update, scanned at every question);
and a simulation of several ranks hearing of the driver's updates at different moments,
checking that at every check point all ranks decide the same (interrupt or not, sync or not)
whichever way they agree (flags in the gradient allreduce, or a MAX allreduce of their
proposals), and that no update is ever missed.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.worker.host_updates import HostUpdates

# --------------------------------------------------------------------------- examples


def test_nothing_seen_nothing_pending() -> None:
    u = HostUpdates()
    assert u.local_flags() == (False, False)
    assert u.proposal() == (0.0, False)
    assert u.take_agreed(0) is None
    assert not u.settle(0.0)
    assert u.handled_ts == 0.0


def test_record_reports_each_update_once() -> None:
    u = HostUpdates()
    assert u.record(5.0, added=False)
    assert not u.record(5.0, added=False)  # repeated by a heartbeat reply
    assert u.record(3.0, added=True)  # an older one that arrived late is still new here
    assert u.local_flags() == (True, True)
    assert u.proposal() == (5.0, True)


def test_removals_only_pending() -> None:
    u = HostUpdates()
    u.record(1.0, added=False)
    u.record(2.0, added=False)
    assert u.local_flags() == (True, False)
    assert u.proposal() == (2.0, False)


def test_rendezvous_handles_updates_up_to_the_drivers_latest() -> None:
    u = HostUpdates()
    u.record(1.0, added=True)
    u.record(2.0, added=False)
    u.handled(1.0)
    assert u.local_flags() == (True, False)  # 2.0 is still pending, and it only removed
    u.handled(2.0)
    assert u.local_flags() == (False, False)
    u.handled(0.5)  # never backwards
    assert u.handled_ts == 2.0
    assert u.proposal() == (2.0, False)


def test_settle_interrupts_once_per_newer_timestamp() -> None:
    u = HostUpdates()
    assert u.settle(4.0)  # another rank knew of 4.0
    assert u.handled_ts == 4.0
    assert not u.settle(4.0)
    u.record(3.0, added=True)  # arrives late: already covered by the agreement on 4.0
    assert u.local_flags() == (False, False)


def test_agreed_flags_are_taken_once_and_only_in_their_round() -> None:
    u = HostUpdates()
    u.record(7.0, added=True)
    u.agreed(3, pending=True, added=True)
    assert u.take_agreed(4) is None  # agreed in an older round: the check point agrees anew
    assert u.local_flags() == (True, True)
    u.agreed(4, pending=True, added=False)
    assert u.take_agreed(4) == (True, False)
    assert u.handled_ts == 7.0  # an interrupt: everything seen counts as handled
    assert u.take_agreed(4) is None  # consumed
    u.agreed(4, pending=False, added=False)
    assert u.take_agreed(4) == (False, False)
    assert u.handled_ts == 7.0


def test_a_reader_never_sees_half_an_update() -> None:
    """The control thread records while the training thread reads the flags: an "added"
    flag never comes without its "pending" flag."""
    u = HostUpdates()
    stop = threading.Event()
    bad: list[tuple[bool, bool]] = []

    def read() -> None:  # the training thread: it alone reads the flags and marks updates handled
        turn = 0
        while not stop.is_set():
            turn += 1
            pending, added = u.local_flags()
            if added and not pending:
                bad.append((pending, added))
            handled = u.handled_ts
            latest, added = u.proposal()
            if added and latest <= handled:
                bad.append((False, added))
            if turn % 7 == 0:
                u.handled(latest)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(1, 20_000):  # the control thread
            u.record(float(i), added=i % 3 == 0)
    finally:
        stop.set()
        reader.join(10)
    assert not reader.is_alive() and not bad


# --------------------------------------------------------------------------- against the old model


class DictModel:
    """The logic HostUpdates replaced: every update in a dict, scanned at every question."""

    def __init__(self) -> None:
        self.updates: dict[float, bool] = {}
        self.handled = 0.0
        self.agreed_: tuple[int, bool, bool] | None = None

    def record(self, ts: float, added: bool) -> bool:
        new = ts not in self.updates
        self.updates[ts] = added
        return new

    def handled_at(self, ts: float) -> None:
        self.handled = max(self.handled, ts)

    def local_flags(self) -> tuple[bool, bool]:
        newer = [a for ts, a in self.updates.items() if ts > self.handled]
        return bool(newer), any(newer)

    def proposal(self) -> tuple[float, bool]:
        newer = {ts: a for ts, a in self.updates.items() if ts > self.handled}
        return max(newer, default=self.handled), any(newer.values())

    def agreed(self, round_: int, pending: bool, added: bool) -> None:
        self.agreed_ = (round_, pending, added)

    def take_agreed(self, round_: int) -> tuple[bool, bool] | None:
        agreed, self.agreed_ = self.agreed_, None
        if agreed is None or agreed[0] != round_:
            return None
        if agreed[1]:
            self.handled = max([self.handled, *self.updates])
        return agreed[1], agreed[2]

    def settle(self, ts: float) -> bool:
        if ts > self.handled:
            self.handled = ts
            return True
        return False


timestamps = st.integers(1, 12).map(float)
ops = st.one_of(
    st.tuples(st.just("record"), timestamps),
    st.tuples(st.just("handled"), timestamps),
    st.tuples(st.just("local_flags")),
    st.tuples(st.just("proposal")),
    st.tuples(st.just("agreed"), st.integers(0, 2), st.booleans(), st.booleans()),
    st.tuples(st.just("take_agreed"), st.integers(0, 2)),
    st.tuples(st.just("settle"), timestamps),
)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.booleans(), min_size=13, max_size=13), st.lists(ops, max_size=40))
def test_same_answers_as_the_dict_model(adds: list[bool], calls: list[tuple]) -> None:
    u, m = HostUpdates(), DictModel()
    for call in calls:
        name, args = call[0], call[1:]
        if name == "record":  # the driver never changes an update's flags
            ts = args[0]
            assert u.record(ts, adds[int(ts)]) == m.record(ts, adds[int(ts)])
        elif name == "handled":
            u.handled(*args)
            m.handled_at(*args)
        else:
            assert getattr(u, name)(*args) == getattr(m, name)(*args), call
        assert u.handled_ts == m.handled


# --------------------------------------------------------------------------- ranks agreeing


@dataclass
class Job:
    """The driver's updates and the ranks of the current round."""

    ranks: list[HostUpdates]
    adds: list[bool]
    published: int = 0  # updates 1..published exist (ts = their number)
    round_: int = 0
    seen: list[set[int]] = field(default_factory=list)

    def check_point(self, via_gradients: bool) -> tuple[bool, bool]:
        """Every rank at the same check point; asserts they all decide the same."""
        if via_gradients:  # flags summed in the first gradient bucket: any rank's flag wins
            flags = [r.local_flags() for r in self.ranks]
            pending, added = any(p for p, _ in flags), any(a for _, a in flags)
            for r in self.ranks:
                r.agreed(self.round_, pending, added)
            verdicts = [r.take_agreed(self.round_) for r in self.ranks]
        else:
            proposals = [r.proposal() for r in self.ranks]
            latest, added = max(ts for ts, _ in proposals), any(a for _, a in proposals)
            verdicts = [(r.settle(latest), added) for r in self.ranks]
        assert all(v == verdicts[0] for v in verdicts), verdicts
        assert verdicts[0] is not None
        interrupt, added = verdicts[0]
        return interrupt, added

    def rendezvous(self) -> None:
        """A reset: the driver forms the next round and tells every rank its latest update."""
        self.round_ += 1
        for r in self.ranks:
            r.handled(float(self.published))


steps = st.one_of(
    st.tuples(st.just("publish"), st.booleans()),
    st.tuples(st.just("hear"), st.integers(0, 3), st.integers(1, 12)),
    st.tuples(st.just("check"), st.booleans()),
)


@settings(max_examples=400, deadline=None)
@given(st.integers(2, 4), st.lists(st.booleans(), min_size=13, max_size=13), st.lists(steps, max_size=50))
def test_every_rank_decides_the_same_and_no_update_is_missed(n: int, adds: list[bool], script: list[tuple]) -> None:
    job = Job([HostUpdates() for _ in range(n)], adds, seen=[set() for _ in range(n)])
    handled = 0  # the job's view: updates up to this one were followed by a reset
    for step in script:
        if step[0] == "publish" and job.published < 12:
            job.published += 1
        elif step[0] == "hear":  # PUB or a heartbeat reply; any order, maybe never
            rank, which = step[1] % n, step[2]
            if which <= job.published:
                job.ranks[rank].record(float(which), adds[which])
                job.seen[rank].add(which)
        elif step[0] == "check":
            unhandled = {u for s in job.seen for u in s if u > handled}
            interrupt, added = job.check_point(via_gradients=step[1])
            assert interrupt == bool(unhandled)  # some rank knows of an unhandled update
            if interrupt:
                # A sync is skipped only if no unhandled update any rank knows of added hosts
                # (the driver may still ask for one: it sees all updates).
                assert added == any(adds[u] for u in unhandled)
                job.rendezvous()
                handled = job.published
    # In the end every rank hears of everything: the next check point catches what is left.
    for rank in range(n):
        for which in range(1, job.published + 1):
            job.ranks[rank].record(float(which), adds[which])
    interrupt, added = job.check_point(via_gradients=False)
    assert interrupt == (job.published > handled)
    if interrupt:
        assert added == any(adds[u] for u in range(handled + 1, job.published + 1))
