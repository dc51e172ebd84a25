"""The registry's indexes (state counts, busy slots, holders, timeout floors, the host
manager's refresh) change what a decision costs, never what it decides.

A decision while thousands of workers trickle into a round used to look at each of them
several times (11 ms at 4,096 workers on a 2-core machine; 1.2 ms with the indexes). Here a
registry with the indexes and one that looks at everything before every decision (its floors
reset, its host manager rebuilt) take the same random events and must answer the same
actions, while the indexes match a recount after every step.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from elasticrun.discovery.host_manager import HostManager
from elasticrun.driver.registry import Kill, Launch, Registry, RegistryConfig, WorkerState

HOSTS = ["h0", "h1", "h2", "h3", "h4"]


class _FullRefresh(HostManager):
    """A host manager that rebuilds its host order on every refresh (no shortcut)."""

    def refresh(self, now):
        return self.update(self._discovered, now)


class _LooksAtEverything(Registry):
    """The same decisions, every one of them after a look at every worker."""

    def decide(self, now, heard_until=None):
        self._rescan()
        return super().decide(now, heard_until)


def _pair(np_, min_np, max_np, cooldown, seed, heartbeat_timeout):
    config = RegistryConfig(np=np_, min_np=min_np, max_np=max_np, reset_limit=None, elastic_timeout=100.0,
                            start_timeout=30.0, heartbeat_timeout=heartbeat_timeout)
    regs = []
    for cls, hm in ((Registry, HostManager), (_LooksAtEverything, _FullRefresh)):
        ids = itertools.count()
        regs.append(cls(config, hm(cooldown_range=cooldown, rng=random.Random(seed)),
                        lambda ids=ids: f"w{next(ids)}"))
    return regs


def _pick(reg: Registry, k: int) -> str:
    """Worker ``k``: mostly one whose process runs (k < 30), else any, even one gone."""
    every = sorted(reg.workers, key=lambda w: int(w[1:]))
    if not every:
        return "w999"  # a stranger
    running = [w for w in every if not reg.workers[w].exited] or every
    pool = running if k < 30 else every
    return pool[k % len(pool)]


def _check_indexes(reg: Registry) -> None:
    workers = reg.workers.values()
    assert reg._in == {s: sum(1 for w in workers if w.state is s) for s in WorkerState}
    assert reg._busy == dict(Counter(w.key for w in workers if not w.exited))
    assert reg._holding == sum(1 for w in workers if w.holds)
    heard, now = reg._floors()
    assert reg._heard_floor <= heard and reg._now_floor <= now  # lower bounds, never late


events = st.one_of(
    st.tuples(st.just("discover"), st.dictionaries(st.sampled_from(HOSTS), st.integers(1, 2), max_size=5)),
    st.tuples(st.just("rdv"), st.integers(0, 40), st.booleans(), st.booleans()),
    st.tuples(st.just("rdv"), st.integers(0, 29), st.just(False), st.just(False)),
    st.tuples(st.just("hb"), st.integers(0, 40), st.sampled_from([None, None, None, "exit", "shutdown"])),
    st.tuples(st.just("hb"), st.integers(0, 29), st.just(None)),
    st.tuples(st.just("exit"), st.integers(0, 40), st.sampled_from([0, 1, -9])),
    st.tuples(st.just("failing"), st.integers(0, 40)),
    st.tuples(st.just("durable"), st.integers(1, 50)),
    st.tuples(st.just("tick"), st.sampled_from([0.1, 1.0, 3.0, 6.0, 31.0, 61.0])),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# A holder that failed, forgotten a minute later: the holders' count forgot it too.
@example(np_=1, extra_min=0, max_np=None, cooldown=None, seed=0, heartbeat_timeout=5.0,
         script=[("rdv", 1, True, False), ("exit", 1, 1), ("tick", 61.0)])
@given(np_=st.integers(1, 4), extra_min=st.integers(0, 3), max_np=st.sampled_from([None, 2, 3, 6]),
       cooldown=st.sampled_from([None, (5.0, 20.0)]), seed=st.integers(0, 3),
       heartbeat_timeout=st.sampled_from([5.0, None]), script=st.lists(events, min_size=1, max_size=60))
def test_the_indexes_never_change_a_decision(np_, extra_min, max_np, cooldown, seed, heartbeat_timeout, script):
    min_np = max(1, np_ - extra_min)
    fast, full = _pair(np_, min_np, max_np, cooldown, seed, heartbeat_timeout)
    now = 0.0
    for ev in [("discover", {"h0": 2, "h1": 1})] + script:
        now += 0.05
        kind = ev[0]
        for reg in (fast, full):
            pick = (lambda k, reg=reg: _pick(reg, k))
            if kind == "discover":
                reg.discovered(ev[1], now)
            elif kind == "rdv":
                reg.rendezvous(pick(ev[1]), now, error="RuntimeError" if ev[3] else None, restored=ev[3],
                               has_state=ev[2])
            elif kind == "hb":
                reg.heartbeat(pick(ev[1]), now, bye=ev[2])
            elif kind == "exit":
                reg.exited(pick(ev[1]), ev[2], now)
            elif kind == "failing":
                reg.failing(pick(ev[1]), "RuntimeError", now)
            elif kind == "durable":
                reg.durable(ev[1])
        _check_indexes(fast)  # also before the decision: what the events recorded
        if kind == "tick":
            now += ev[1]
        a, b = fast.decide(now), full.decide(now)
        assert repr(a) == repr(b), ev
        _check_indexes(fast)
        deadline, exact = fast.next_deadline(), full.next_deadline()
        if exact is not None:
            assert deadline is not None and deadline <= exact  # early at worst, never late
        if fast.finished is not None:  # (the same Finish: it was among the actions compared)
            break


def test_a_plain_jobs_first_contact_puts_the_others_start_timeout_back():
    """Workers of a job taken for plain processes are not held to --start-timeout (they run
    to their end); once one of them reaches the driver, the others are again, on time, even
    with no heartbeat timeout to make the registry look at them for another reason."""
    fast, full = _pair(3, 3, None, None, 0, None)
    for reg in (fast, full):
        reg.discovered({"a": 3}, 0.0)
        assert sum(isinstance(a, Launch) for a in reg.decide(0.0)) == 3
        reg.exited("w0", 0, 1.0)  # ended without hvd.init(): a plain command, so far
        reg.decide(1.0)
        assert reg.plain
        reg.rendezvous("w1", 2.0)  # but this one is elastic; w0 has ended, so the job stays plain
        reg.decide(2.0)
        assert reg.decide(29.9) == [] and reg.next_deadline() <= 30.0
        kills = [a for a in reg.decide(30.0) if isinstance(a, Kill)]
        assert [(k.worker_id, k.why.cause.name) for k in kills][:1] == [("w2", "NEVER_CONTACTED")]
