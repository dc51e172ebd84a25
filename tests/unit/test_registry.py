"""Unit tests for elasticrun.driver.registry.Registry, the pure round/worker state machine.

The registry is driven through its events (``discovered``, ``rendezvous``, ``exited``,
``failing``, ``heartbeat``, ``tick``) with an explicit clock and deterministic worker ids
``w0, w1, ...``; the tests assert the actions it asks the driver shell to carry out.

Bugs these tests found are kept as regression tests.
"""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from elasticrun.common.events import FIELDS, Cause, Reason
from elasticrun.discovery.host_manager import HostChange, HostManager, cooldown_delay
from elasticrun.driver import words
from elasticrun.driver.assignment import assign
from elasticrun.driver.stragglers import Pace
from elasticrun.driver.registry import (
    EXIT_GRACE,
    FORGET_AFTER,
    MOVES,
    AbortRound,
    Assign,
    Blacklist,
    Dismiss,
    Event,
    Finish,
    ForgetRounds,
    JudgeStragglers,
    Kill,
    Launch,
    Mark,
    Move,
    NewRound,
    Notify,
    Record,
    Refresh,
    Registry,
    RegistryConfig,
    WorkerState,
    _move,
)

pytestmark = pytest.mark.timeout(60)

LIVE_STATES = (WorkerState.LAUNCHING, WorkerState.WAITING, WorkerState.RUNNING)


# --- harness ---------------------------------------------------------------------------------
def of(acts, kind):
    return [a for a in acts if isinstance(a, kind)]


def control(acts):
    """Everything but log events."""
    return [a for a in acts if not isinstance(a, Event)]


def events(acts, kind):
    return [a for a in acts if isinstance(a, Event) and a.kind == kind]


def checked(acts):
    """Every decision can be worded and journaled: each event's fields are in its kind's
    schema, and every event and reason has words (a missing one raises here)."""
    for a in acts:
        if isinstance(a, Event):
            assert set(a.fields) <= set(FIELDS[a.kind]), (a.kind, sorted(set(a.fields) - set(FIELDS[a.kind])))
            assert words.event(a) and json.dumps(words.plain(a.fields), default=str)
        elif isinstance(a, (Finish, Dismiss, Kill, AbortRound)):
            assert words.reason(a.why)
    return acts


def text(event):
    """An event's console line (elasticrun/driver/words.py words every decision)."""
    return words.event(event)


def why(action):
    """The words of a Finish's, a Dismiss's or a Kill's reason."""
    return words.reason(action.why)


class Job:
    """A registry with an injected clock and worker ids w0, w1, ... in launch order."""

    def __init__(self, np=1, min_np=None, max_np=None, reset_limit=None, elastic_timeout=600.0,
                 start_timeout=30.0, cooldown=None, seed=0, heartbeat_timeout=None, evict_stragglers=False,
                 backend="auto", fixed_hosts=False):
        self.now = 0.0
        self._ids = itertools.count()
        self.hosts = HostManager(cooldown_range=cooldown, rng=random.Random(seed))
        self.config = RegistryConfig(np=np, min_np=np if min_np is None else min_np, max_np=max_np,
                                     reset_limit=reset_limit, elastic_timeout=elastic_timeout,
                                     start_timeout=start_timeout, heartbeat_timeout=heartbeat_timeout,
                                     evict_stragglers=evict_stragglers, backend=backend, fixed_hosts=fixed_hosts)
        self.reg = Registry(self.config, self.hosts, lambda: f"w{next(self._ids)}")

    def _at(self, at):
        if at is not None:
            assert at >= self.now, "the test clock must not go backwards"
            self.now = float(at)

    def discover(self, hosts, at=None):
        self._at(at)
        self.reg.discovered(dict(hosts), self.now)
        return checked(self.reg.decide(self.now))

    def rdv(self, wid, at=None, has_state=False, error=None, restored=False, gpus=()):
        self._at(at)
        self.reg.rendezvous(wid, self.now, error=error, restored=restored, has_state=has_state, gpus=gpus)
        return checked(self.reg.decide(self.now))

    def exit(self, wid, code=1, at=None, detail=""):
        self._at(at)
        self.reg.exited(wid, code, self.now, detail)
        return checked(self.reg.decide(self.now))

    def failing(self, wid, error="RuntimeError", at=None):
        self._at(at)
        self.reg.failing(wid, error, self.now)
        return checked(self.reg.decide(self.now))

    def tick(self, at):
        self._at(at)
        return checked(self.reg.decide(self.now))

    def paces(self, slow=(), compute=0.010, slow_compute=0.200, steps=20, at=None):
        """Every member of the current round sends a heartbeat with the pace of its last
        ``steps`` steps: hosts in ``slow`` compute ``slow_compute`` a step, the others
        ``compute``, and all steps take as long as the slowest's (they wait for it)."""
        self._at(at)
        members = [self.reg.workers[wid] for wid in self.reg.members.values()]
        step = (slow_compute if slow else compute) + 0.002
        for w in members:
            c = slow_compute if w.host in slow else compute
            self.reg.heartbeat(w.id, self.now, Pace(self.reg.round, steps, step, step - c, c))
        return checked(self.reg.decide(self.now))

    # queries
    def state(self, wid):
        return self.reg.workers[wid].state

    def rdv_all(self, wids, at=None):
        acts = []
        for wid in wids:
            acts += self.rdv(wid, at)
        return acts

    def start(self, hosts, at=None):
        """Discover ``hosts``, rendezvous every launched worker; return the Assigns of round 0."""
        launches = of(self.discover(hosts, at), Launch)
        assert launches
        acts = self.rdv_all([l.worker_id for l in launches])
        assigns = of(acts, Assign)
        assert assigns and self.reg.round == 0
        return assigns


def ranks(assigns):
    """{(host, slot): (worker_id, rank)} of a batch of Assign actions."""
    return {a.info.key: (a.worker_id, a.info.rank) for a in assigns}


# --- initial launch --------------------------------------------------------------------------
class TestInitialLaunch:
    def test_waits_for_np_slots_before_launching(self):
        job = Job(np=4, min_np=2)
        acts = job.discover({"a": 2}, at=0)
        assert of(acts, Launch) == []
        assert not of(acts, Finish)
        acts = job.discover({"a": 2, "b": 2}, at=5)
        launches = of(acts, Launch)
        assert [(l.worker_id, l.info.host, l.info.slot, l.info.rank, l.info.size) for l in launches] == [
            ("w0", "a", 0, 0, 4), ("w1", "a", 1, 1, 4), ("w2", "b", 0, 2, 4), ("w3", "b", 1, 3, 4)]
        assert all(job.state(l.worker_id) is WorkerState.LAUNCHING for l in launches)

    def test_launch_info_is_the_planned_assignment(self):
        job = Job(np=3)
        launches = of(job.discover({"x": 1, "y": 2}), Launch)
        assert [l.info for l in launches] == assign([("x", 1), ("y", 2)], None)

    def test_times_out_after_the_elastic_timeout_naming_the_flag(self):
        """Slots from discovery get --elastic-timeout, as horovodrun's first wait does (an
        autoscaled cluster's nodes take minutes to appear), not --start-timeout."""
        job = Job(np=4, start_timeout=30.0, elastic_timeout=600.0)
        job.discover({"a": 2}, at=10)
        assert job.reg.next_deadline() == 40.0  # the reminder
        assert not of(job.tick(40.0), Finish) and not of(job.tick(609.9), Finish)
        acts = job.tick(610.0)
        assert acts == [job.reg.finished]
        finish = acts[0]
        assert finish.ok is False
        assert "timed out after 600 s (--elastic-timeout)" in why(finish)
        assert "4 slots" in why(finish) and "a:2" in why(finish)

    def test_first_round_hosts_that_did_not_answer_wait_for_discovery_to_list_others(self):
        """Discovery lists a spot node that is gone (or not up yet): its SSH start is refused.
        The job ended 0.2 s after its start ("all workers failed ... exited with code 255") while
        discovery listed a usable host a few seconds later. Nothing ran, so it waits, as for any
        slot: up to --elastic-timeout from when it said so, the host out (blacklisted)."""
        job = Job(np=2, min_np=1, elastic_timeout=100.0)
        launches = of(job.discover({"a": 1, "b": 1}, at=0), Launch)
        assert len(launches) == 2
        job.exit("w0", 255, at=1, detail=words.never_started("cannot connect: refused", unreachable=True))
        acts = job.exit("w1", 255, at=2, detail=words.never_started("no answer within 5 s", unreachable=True))
        assert not of(acts, Finish), acts
        [said] = events(acts, "none_reached")
        assert text(said) == ("no listed host could be reached (a, b): waiting up to --elastic-timeout 100 s for "
                              "discovery to list others"), text(said)
        assert job.hosts.is_blacklisted("a") and job.hosts.is_blacklisted("b")
        assert not of(job.tick(50), Finish) and not events(job.tick(60), "none_reached")  # said once
        launches = of(job.discover({"a": 1, "b": 1, "c": 2}, at=70), Launch)
        assert [l.info.host for l in launches] == ["c", "c"]
        assert of(job.rdv_all([l.worker_id for l in launches], at=71), Assign) and job.reg.round == 0

    def test_the_wait_after_unreached_first_hosts_ends_at_the_elastic_timeout(self):
        job = Job(np=1, elastic_timeout=100.0)
        job.discover({"a": 1}, at=0)
        job.exit("w0", 255, at=5, detail=words.never_started("refused", unreachable=True))
        assert not of(job.tick(104.9), Finish)
        [finish] = of(job.tick(105), Finish)
        assert not finish.ok and "timed out after 100 s (--elastic-timeout)" in why(finish), why(finish)

    @pytest.mark.parametrize("case", ["not unreachable", "fixed hosts", "one unreachable, one script", "after a round"])
    def test_first_hosts_that_fail_otherwise_still_end_the_job_at_once(self, case):
        """A configuration that fails on every host (python missing there, a refused key, the
        script's own error) would fail the same after any wait; a fixed host list gets no others;
        a job that trained has its own rules (durable copies)."""
        job = Job(np=2, fixed_hosts=case == "fixed hosts")
        unreachable = words.never_started("refused", unreachable=True)
        if case == "after a round":
            job.start({"a": 1, "b": 1}, at=0)
            job.exit("w0", 255, at=1, detail=unreachable)
            acts = job.exit("w1", 255, at=1, detail=unreachable)
        else:
            job.discover({"a": 1, "b": 1}, at=0)
            first = words.never_started("'python3' was not found there") if case == "not unreachable" else unreachable
            job.exit("w0", 127 if case == "not unreachable" else 255, at=1, detail=first)
            acts = job.exit("w1", 1 if case.startswith("one") else 255, at=1,
                            detail="" if case.startswith("one") else unreachable)
        [finish] = of(acts, Finish)
        assert not finish.ok and why(finish).startswith("all workers failed"), why(finish)
        assert not events(acts, "none_reached")

    def test_a_fixed_list_short_of_np_fails_at_once(self):
        job = Job(np=4, start_timeout=30.0, fixed_hosts=True)
        [finish] = of(job.discover({"a": 2}, at=10), Finish)
        assert not finish.ok and finish.why.cause is Cause.NEVER_ENOUGH

    def test_timeout_with_no_hosts_at_all(self):
        job = Job(np=1, start_timeout=5.0, elastic_timeout=50.0)
        job.discover({}, at=0)
        assert not of(job.tick(49), Finish)
        finish = of(job.tick(50), Finish)[0]
        assert not finish.ok and "usable hosts: none" in why(finish)

    def test_enough_hosts_before_the_timeout(self):
        job = Job(np=2, start_timeout=30.0)
        job.discover({"a": 1}, at=0)
        acts = job.discover({"a": 1, "b": 1}, at=29)
        assert len(of(acts, Launch)) == 2
        # Enough slots: passing the original wait deadline does not fail the job.
        assert control(job.tick(30)) == []
        assert control(job.tick(58)) == []
        assert len(of(job.rdv_all(["w0", "w1"], at=58.5), Assign)) == 2

    def test_round_forms_only_when_every_target_slot_is_waiting(self):
        job = Job(np=3)
        launches = of(job.discover({"a": 2, "b": 1}), Launch)
        ids = [l.worker_id for l in launches]
        assert job.rdv(ids[2], at=1) == []
        assert job.rdv(ids[0], at=2) == []
        assert job.state(ids[0]) is WorkerState.WAITING
        acts = job.rdv(ids[1], at=3)
        assigns = of(acts, Assign)
        assert [(a.worker_id, a.round, a.info.rank) for a in assigns] == [("w0", 0, 0), ("w1", 0, 1), ("w2", 0, 2)]
        assert [a.info for a in assigns] == [l.info for l in launches]
        assert events(acts, "round_formed")
        assert job.reg.round == 0 and job.reg.reset_count == 0
        assert all(job.state(i) is WorkerState.RUNNING for i in ids)
        assert job.reg.members == {("a", 0): "w0", ("a", 1): "w1", ("b", 0): "w2"}

    def test_repeated_rendezvous_while_waiting_is_harmless(self):
        job = Job(np=2)
        job.discover({"a": 2})
        assert job.rdv("w0") == [] and job.rdv("w0") == []
        assert len(of(job.rdv("w1"), Assign)) == 2

    def test_max_np_caps_the_round(self):
        job = Job(np=2, max_np=3)
        launches = of(job.discover({"a": 2, "b": 2}), Launch)
        assert [(l.info.host, l.info.slot) for l in launches] == [("a", 0), ("a", 1), ("b", 0)]
        assigns = of(job.rdv_all([l.worker_id for l in launches]), Assign)
        assert len(assigns) == 3 and {a.info.size for a in assigns} == {3}

    def test_max_np_extra_host_during_round_launches_nothing(self):
        job = Job(np=2, max_np=2)
        job.start({"a": 2})
        acts = job.discover({"a": 2, "b": 4}, at=1)
        assert control(acts) == []
        assert events(acts, "host_added")
        assert control(job.tick(100)) == []

    def test_start_timeout_of_initial_launch(self):
        job = Job(np=2, start_timeout=30.0)
        job.discover({"a": 1, "b": 1}, at=0)
        job.rdv("w0", at=1)
        acts = job.tick(30)
        assert of(acts, Kill) == [Kill("w1", Reason(Cause.NEVER_CONTACTED, {"limit": 30.0}))]
        assert job.hosts.is_blacklisted("b") and not job.hosts.is_blacklisted("a")
        assert job.state("w1") is WorkerState.FAILED
        assert not of(acts, Finish)  # still waiting (for np=2) under --start-timeout


# --- unknown / gone workers ------------------------------------------------------------------
class TestStrangers:
    def test_unknown_worker_rendezvous_is_dismissed(self):
        job = Job(np=1)
        job.start({"a": 1})
        assert job.rdv("intruder") == [Dismiss("intruder", Reason(Cause.NOT_IN_JOB))]
        assert "intruder" not in job.reg.workers

    def test_unknown_worker_exit_is_ignored(self):
        job = Job(np=1)
        job.start({"a": 1})
        assert job.exit("nobody", 1) == []
        assert not job.hosts.is_blacklisted("a")

    def test_second_exit_report_is_ignored(self):
        job = Job(np=1, min_np=1)
        job.start({"a": 1})
        job.discover({"a": 1, "b": 1}, at=1)  # w1 launching on b
        first = job.exit("w1", 1, at=2)
        assert events(first, "worker_failed")
        assert job.exit("w1", 1, at=3) == []


# --- host added during a round ---------------------------------------------------------------
class TestHostAdded:
    def test_launch_first_notify_after_newcomers_rendezvous_then_reform(self):
        job = Job(np=2, min_np=1)
        round0 = ranks(job.start({"a": 2}, at=0))
        acts = job.discover({"a": 2, "b": 1}, at=10)
        assert events(acts, "host_added")
        launches = of(acts, Launch)
        assert [(l.worker_id, l.info.host, l.info.slot, l.info.rank) for l in launches] == [("w2", "b", 0, 2)]
        assert not of(acts, Notify)
        assert not of(job.tick(20), Notify)  # newcomer has not checked in yet

        acts = job.rdv("w2", at=21)
        assert of(acts, Notify) == [Notify(added=True, removed=False)]
        assert events(acts, "hosts_updated")
        assert not of(acts, Assign)
        assert job.state("w0") is WorkerState.RUNNING  # survivors keep training
        assert not of(job.tick(22), Notify)  # notified once only
        assert not of(job.discover({"a": 2, "b": 1}, at=23), Notify)

        assert job.rdv("w1", at=24) == []  # w0 still running
        acts = job.rdv("w0", at=25)
        round1 = ranks(of(acts, Assign))
        assert round1 == {("a", 0): ("w0", 0), ("a", 1): ("w1", 1), ("b", 0): ("w2", 2)}
        for key, (wid, rank) in round0.items():
            assert round1[key] == (wid, rank)  # survivors keep their ranks
        assert {a.round for a in of(acts, Assign)} == {1}
        assert job.reg.round == 1 and job.reg.reset_count == 1

    def test_rank0_stays_on_the_oldest_host_even_if_listed_last(self):
        job = Job(np=1, min_np=1)
        job.start({"zeta": 1})
        launches = of(job.discover({"alpha": 1, "beta": 1, "zeta": 1}, at=1), Launch)
        assert [l.info.host for l in launches] == ["alpha", "beta"]
        assert [l.info.rank for l in launches] == [1, 2]
        job.rdv_all([l.worker_id for l in launches], at=2)
        assigns = of(job.rdv("w0", at=3), Assign)
        assert ranks(assigns)[("zeta", 0)] == ("w0", 0)

    def test_newcomer_that_never_checks_in_is_killed_and_blacklisted(self):
        job = Job(np=1, min_np=1, start_timeout=30.0)
        job.start({"a": 1}, at=0)
        job.discover({"a": 1, "b": 1}, at=5)
        assert job.reg.next_deadline() == 35.0
        assert control(job.tick(34.9)) == []
        acts = job.tick(35.0)
        assert of(acts, Kill) == [Kill("w1", Reason(Cause.NEVER_CONTACTED, {"limit": 30.0}))]
        failed = events(acts, "worker_failed")
        assert failed and "--start-timeout 30" in text(failed[0])
        assert events(acts, "host_blacklisted")
        assert not of(acts, AbortRound)  # it was not a member of the running round
        assert not of(acts, Notify)
        assert job.hosts.is_blacklisted("b")
        assert job.state("w1") is WorkerState.FAILED and job.state("w0") is WorkerState.RUNNING
        # The killed process's exit is expected, not news.
        assert job.exit("w1", -9, at=36) == []

    def test_only_workers_launched_into_a_running_job_defer_their_place(self):
        job = Job(np=2, min_np=1)
        launches = of(job.discover({"a": 2}, at=0), Launch)
        assert [l.joining for l in launches] == [False, False]  # round 0 forms at their hvd.init()
        job.rdv_all([l.worker_id for l in launches], at=1)
        assert [l.joining for l in of(job.discover({"a": 2, "b": 1}, at=2), Launch)] == [True]

    def test_newcomers_count_as_starting_then_joining_until_they_ask_for_a_place(self):
        """The status line's "+N joining" are those that reached the driver (as
        docs/troubleshooting.md says); one that has not is "+N starting"."""
        job = Job(np=1, min_np=1)
        job.discover({"a": 1}, at=0)
        assert job.reg.joining() == job.reg.starting() == 0  # round 0 has not formed
        job.rdv("w0", at=1)
        job.discover({"a": 1, "b": 2}, at=2)
        assert (job.reg.starting(), job.reg.joining()) == (2, 0)
        job.reg.heartbeat("w1", 2.5)
        assert (job.reg.starting(), job.reg.joining()) == (1, 1)
        job.rdv("w1", at=3)
        assert (job.reg.starting(), job.reg.joining()) == (1, 0)

    def test_a_preparing_newcomer_is_bounded_by_its_heartbeats_not_start_timeout(self):
        """A newcomer that reached the driver builds its model before it asks for a place: it
        may take longer than --start-timeout (the survivors train meanwhile), but once silent
        for --heartbeat-timeout it is hung."""
        job = Job(np=1, min_np=1, start_timeout=30.0, heartbeat_timeout=5.0)
        job.start({"a": 1}, at=0)
        job.reg.heartbeat("w0", 4.0)
        job.discover({"a": 1, "b": 1}, at=5)
        for t in range(6, 100, 2):  # preparing for 94 s, heartbeating
            job.reg.heartbeat("w1", float(t))
            job.reg.heartbeat("w0", float(t))
            assert control(job.tick(t + 0.5)) == [], t
            # Due by w1's silence, never later; it may be earlier (a worker heard since the
            # registry last looked at each of them moves its deadline later), never already past.
            assert t + 0.5 < job.reg.next_deadline() <= t + 5.0
        assert job.state("w1") is WorkerState.LAUNCHING
        job.reg.heartbeat("w0", 102.0)
        acts = job.tick(103.0)  # w1 silent since 98
        assert [(k.worker_id, k.why.cause) for k in of(acts, Kill)] == [("w1", Cause.SILENT)]
        assert job.state("w1") is WorkerState.FAILED and job.state("w0") is WorkerState.RUNNING
        assert not of(acts, AbortRound) and not of(acts, Notify)

    def test_newcomer_crash_before_rendezvous_blacklists_without_abort(self):
        job = Job(np=1, min_np=1)
        job.start({"a": 1})
        job.discover({"a": 1, "b": 1}, at=1)
        acts = job.exit("w1", 2, at=2)
        assert job.hosts.is_blacklisted("b")
        assert not of(acts, AbortRound) and not of(acts, Notify)
        assert job.state("w0") is WorkerState.RUNNING

    def test_newcomer_removed_again_before_checking_in_is_killed(self):
        job = Job(np=1, min_np=1)
        job.start({"a": 1})
        job.discover({"a": 1, "b": 1}, at=1)
        acts = job.discover({"a": 1}, at=2)
        assert [(k.worker_id, k.why.cause) for k in of(acts, Kill)] == [("w1", Cause.NOT_NEEDED)]
        assert job.state("w1") is WorkerState.LEFT
        assert not of(acts, Notify)
        # Its exit after the kill is ignored: no blacklisting.
        assert control(job.exit("w1", -15, at=3)) == []
        assert not job.hosts.is_blacklisted("b")

    def test_resize_up_launches_new_slots(self):
        job = Job(np=1, min_np=1)
        job.start({"a": 1})
        acts = job.discover({"a": 3}, at=1)
        assert events(acts, "host_resized")
        assert [(l.info.host, l.info.slot) for l in of(acts, Launch)] == [("a", 1), ("a", 2)]


# --- host removed during a round -------------------------------------------------------------
class TestHostRemoved:
    def test_notify_immediately_and_dismiss_at_next_formation(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 1, "b": 1, "c": 1})
        acts = job.discover({"a": 1, "c": 1}, at=1)
        assert events(acts, "host_removed")
        assert of(acts, Notify) == [Notify(added=False, removed=True)]
        assert not of(acts, Dismiss) and not of(acts, Kill)

        assert job.rdv("w1", at=2) == []  # the removed worker waits like the rest
        assert job.rdv("w2", at=3) == []
        acts = job.rdv("w0", at=4)
        dismisses = of(acts, Dismiss)
        assert [d.worker_id for d in dismisses] == ["w1"]
        assert "no place" in why(dismisses[0])
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0), ("c", 0): ("w2", 1)}
        assert acts.index(dismisses[0]) < acts.index(of(acts, Assign)[0])
        assert job.state("w1") is WorkerState.LEFT

        # The dismissed worker exits; that is not a failure and blacklists nothing.
        assert job.exit("w1", 0, at=5) == []
        assert job.exit("w1", 1, at=5) == []
        assert not job.hosts.is_blacklisted("b")
        assert job.state("w0") is WorkerState.RUNNING

    def test_dismissed_worker_asking_again_is_dismissed(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.discover({"a": 1}, at=1)
        job.rdv_all(["w1", "w0"], at=2)
        acts = job.rdv("w1", at=3)
        assert acts == [Dismiss("w1", Reason(Cause.NO_PLACE_ANY_MORE))]

    def test_failed_exit_of_left_worker_is_ignored(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.discover({"a": 1}, at=1)
        job.rdv_all(["w1", "w0"], at=2)
        assert job.state("w1") is WorkerState.LEFT
        acts = job.exit("w1", 1, at=3)
        assert acts == []
        assert not job.hosts.is_blacklisted("b")
        assert job.reg.round == 1 and not job.reg.aborted

    def test_removal_and_addition_together(self):
        """The removal is not held back by the newcomer still starting (issue 11.2): it is
        notified at once, the next round forms without the newcomer, which joins later."""
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        acts = job.discover({"a": 1, "c": 1}, at=1)
        assert [l.info.key for l in of(acts, Launch)] == [("c", 0)]
        assert of(acts, Notify) == [Notify(added=False, removed=True)]
        job.rdv("w1", at=2, has_state=True)
        acts = job.rdv("w0", at=3, has_state=True)
        assert [d.worker_id for d in of(acts, Dismiss)] == ["w1"]
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)}
        acts = job.rdv("w2", at=4)  # the newcomer is ready: an addition, the usual way
        assert of(acts, Notify) == [Notify(added=True, removed=False)]
        acts = job.rdv("w0", at=5, has_state=True)
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0), ("c", 0): ("w2", 1)}

    def test_removal_is_not_held_back_by_a_newcomer_that_never_starts(self):
        """Issue 11.2: the removed host's worker must not train on until the job ends."""
        job = Job(np=2, min_np=1, start_timeout=30.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.discover({"a": 1, "b": 1, "c": 1}, at=1)  # c starts (and never checks in)
        acts = job.discover({"a": 1, "c": 1}, at=2)
        assert of(acts, Notify) == [Notify(added=False, removed=True)]
        job.rdv_all(["w1", "w0"], at=3)
        assert job.state("w1") is WorkerState.LEFT and job.reg.round == 1
        acts = job.tick(31)  # c gives up at --start-timeout, as a failed host
        assert [(k.worker_id, k.why.cause) for k in of(acts, Kill)] == [("w2", Cause.NEVER_CONTACTED)]
        assert job.hosts.is_blacklisted("c") and not of(acts, AbortRound)
        assert job.state("w0") is WorkerState.RUNNING

    def test_resize_down(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 3})
        acts = job.discover({"a": 1}, at=1)
        assert of(acts, Notify) == [Notify(added=False, removed=True)]
        job.rdv_all(["w2", "w1"], at=2)
        acts = job.rdv("w0", at=3)
        assert sorted(d.worker_id for d in of(acts, Dismiss)) == ["w1", "w2"]
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)}

    def test_removed_host_rank0_moves_to_next_oldest(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 1, "b": 1, "c": 1})
        job.discover({"b": 1, "c": 1}, at=1)
        job.rdv_all(["w0", "w2"], at=2)
        acts = job.rdv("w1", at=3)
        assert ranks(of(acts, Assign)) == {("b", 0): ("w1", 0), ("c", 0): ("w2", 1)}


# --- failures --------------------------------------------------------------------------------
class TestFailures:
    def test_failure_blacklists_host_and_aborts_once(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 1, "b": 1, "c": 1})
        acts = job.exit("w1", 1, at=1, detail="CUDA error")
        assert [(a.round, why(a)) for a in of(acts, AbortRound)] == [(0, "b[0] exited with code 1: CUDA error")]
        # Blacklisted at once; said once the round has settled (it may be one of many losses).
        assert events(acts, "worker_failed") and not events(acts, "host_blacklisted")
        assert job.hosts.is_blacklisted("b")
        assert job.state("w1") is WorkerState.FAILED
        assert job.reg.aborted

        acts = job.exit("w2", 137, at=2)
        assert not of(acts, AbortRound)  # not twice in the same round
        assert job.hosts.is_blacklisted("c") and not events(acts, "host_blacklisted")

        acts = job.rdv("w0", at=3)
        assert [text(e) for e in events(acts, "host_blacklisted")] == ["host b blacklisted permanently",
                                                                        "host c blacklisted permanently"]
        assert acts.index(events(acts, "host_blacklisted")[-1]) < acts.index(of(acts, Assign)[0])
        assigns = of(acts, Assign)
        assert ranks(assigns) == {("a", 0): ("w0", 0)}
        assert {a.round for a in assigns} == {1} and assigns[0].info.size == 1
        assert job.reg.reset_count == 1 and not job.reg.aborted

    def test_next_round_forms_only_when_all_survivors_rendezvous(self):
        job = Job(np=4, min_np=1)
        job.start({"a": 2, "b": 2})
        acts = job.exit("w2", 1, at=1)
        assert len(of(acts, AbortRound)) == 1
        assert control(job.rdv("w1", at=2)) == []
        # w3 is on the blacklisted host; it still has to report before the round is decided.
        assert control(job.rdv("w0", at=3)) == []
        acts = job.rdv("w3", at=4)
        assert [d.worker_id for d in of(acts, Dismiss)] == ["w3"]
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0), ("a", 1): ("w1", 1)}

    def test_members_that_do_not_leave_an_aborted_round_are_named_every_30_s(self):
        """A member held where no abort reaches (inside NCCL's group formation, a long step of
        its own) held the whole job without a line: the survivors' rendezvous waited for it."""
        job = Job(np=4, min_np=1)
        job.start({"a": 2, "b": 2})
        job.exit("w2", 1, at=1)
        job.rdv("w1", at=2)
        assert job.reg.next_deadline() == pytest.approx(31.0)
        assert not events(job.tick(30), "abort_pending")
        acts = job.tick(31)
        assert [text(e) for e in events(acts, "abort_pending")] == [
            "round 0 was aborted 30 s ago (b[0] exited with code 1); still waiting for rank 0 (a[0]), rank 3 (b[1]) "
            "to leave it, at their next collective or commit: one stuck where no abort reaches holds the job (see "
            "docs/troubleshooting.md)"]
        assert not events(job.tick(40), "abort_pending")
        job.rdv("w3", at=50)
        [again] = events(job.tick(61), "abort_pending")
        assert again.fields["ranks"] == [[0, "a[0]"]] and again.fields["seconds"] == pytest.approx(60)
        acts = job.rdv("w0", at=62)
        assert of(acts, Assign) and not job.reg.aborted
        assert not events(job.tick(200), "abort_pending") and job.reg.next_deadline() is None

    def test_survivor_on_blacklisted_host_that_exits_does_not_block(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 2})
        job.exit("w1", 1, at=1)
        job.rdv("w0", at=2)
        acts = job.exit("w2", 1, at=3)  # torn down with its host
        assert not of(acts, AbortRound)
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)}

    def test_abort_is_per_round(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 1, "b": 1, "c": 1})
        assert len(of(job.exit("w2", 1, at=1), AbortRound)) == 1
        job.rdv_all(["w0", "w1"], at=2)
        assert job.reg.round == 1
        acts = job.exit("w1", 1, at=3)
        assert [(a.round, why(a)) for a in of(acts, AbortRound)] == [(1, "b[0] exited with code 1")]

    def test_all_workers_failed_names_the_failures_of_the_last_round_only(self):
        """Failures recovered from in earlier rounds are not why the job ended."""
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.exit("w1", -9, at=1)  # round 0: b's worker killed; the job goes on with a
        job.rdv_all(["w0"], at=2)
        assert job.reg.round == 1
        finish = of(job.exit("w0", -9, at=3), Finish)
        assert len(finish) == 1 and why(finish[0]) == "all workers failed (a[0] exited with code -9)"

    def test_all_workers_failed_names_the_cause_before_its_consequences(self):
        """Rank 1's script exits 3; rank 0's collective fails for it, and its report comes first
        (the peer's connection closes before its exit is seen): the cause still leads the line."""
        job = Job(np=2, min_np=2)
        job.start({"a": 1, "b": 1})
        job.failing("w0", "HorovodInternalError: allreduce failed: Connection closed by peer", at=1)
        job.exit("w0", 1, at=1)
        finish = of(job.exit("w1", 3, at=2), Finish)
        assert len(finish) == 1 and why(finish[0]) == (
            "all workers failed (b[0] exited with code 3; a[0] failed: HorovodInternalError: allreduce failed: "
            "Connection closed by peer)")

    def test_member_failure_after_notify_still_aborts(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.discover({"a": 1, "b": 1, "c": 1}, at=1)
        job.rdv("w2", at=2)  # Notify
        acts = job.exit("w1", 1, at=3)
        assert len(of(acts, AbortRound)) == 1
        job.rdv("w0", at=4)
        assert job.reg.round == 1
        assert set(job.reg.members) == {("a", 0), ("c", 0)}

    def test_all_workers_failed(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.exit("w0", 1, at=1)
        acts = job.exit("w1", 3, at=2)
        finish = of(acts, Finish)
        assert len(finish) == 1 and finish[0].ok is False
        assert why(finish[0]).startswith("all workers failed")
        assert "a[0] exited with code 1" in why(finish[0]) and "b[0] exited with code 3" in why(finish[0])
        assert acts[-1] is finish[0]
        assert job.reg.finished == finish[0]

    def test_every_host_blacklisted_permanent(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 2})
        job.exit("w0", 1, at=1)
        acts = job.rdv("w1", at=2)
        finish = of(acts, Finish)
        assert len(finish) == 1 and not finish[0].ok
        assert "blacklisted" in why(finish[0]) and "a" in why(finish[0])
        assert not of(acts, Assign) and not of(acts, Launch)

    def test_failure_after_success_fails_the_job_naming_it(self):
        """Horovod's rule: one worker's success ends the job; but the others of its round run to
        their end, and one that fails then fails the job (as horovodrun's exit status says)."""
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.exit("w0", 0, at=1)
        acts = job.exit("w1", 3, at=2)
        [finish] = of(acts, Finish)
        assert not finish.ok and why(finish) == "rank 1 (b[0]) exited with code 3, after rank 0 finished"


# --- cooldown --------------------------------------------------------------------------------
class TestCooldown:
    def test_blacklisted_host_returns_after_cooldown_and_is_launched_on(self):
        low, high, seed = 10.0, 100.0, 5
        job = Job(np=2, min_np=1, cooldown=(low, high), seed=seed, elastic_timeout=600.0)
        job.start({"a": 1, "b": 1}, at=0)
        acts = job.exit("w1", 1, at=1)
        expected_until = 1 + cooldown_delay(1, low, high, random.Random(seed).random())
        assert job.hosts.next_expiry() == pytest.approx(expected_until)
        acts = job.rdv("w0", at=2)
        assert "for " in text(events(acts, "host_blacklisted")[0])
        assert job.reg.round == 1 and set(job.reg.members) == {("a", 0)}

        assert job.reg.next_deadline() == pytest.approx(expected_until)
        assert control(job.tick(expected_until - 0.01)) == []
        acts = job.tick(expected_until)
        assert events(acts, "host_whitelisted")
        launches = of(acts, Launch)
        assert [(l.worker_id, l.info.key, l.info.rank) for l in launches] == [("w2", ("b", 0), 1)]
        acts = job.rdv("w2", at=expected_until + 1)
        assert of(acts, Notify) == [Notify(added=True, removed=False)]
        acts = job.rdv("w0", at=expected_until + 2)
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0), ("b", 0): ("w2", 1)}

    def test_cooldown_doubles_on_second_failure(self):
        job = Job(np=2, min_np=1, cooldown=(10.0, 1000.0), seed=3, elastic_timeout=1e6)
        twin = random.Random(3)
        job.start({"a": 1, "b": 1}, at=0)
        job.exit("w1", 1, at=1)
        first = cooldown_delay(1, 10.0, 1000.0, twin.random())
        assert job.hosts.next_expiry() == pytest.approx(1 + first)
        job.rdv("w0", at=2)
        launches = of(job.tick(1 + first), Launch)
        assert [l.info.key for l in launches] == [("b", 0)]
        job.rdv(launches[0].worker_id, at=1 + first)
        job.rdv("w0", at=1 + first)
        assert job.reg.members == {("a", 0): "w0", ("b", 0): launches[0].worker_id}
        job.exit(launches[0].worker_id, 1, at=100)
        second = cooldown_delay(2, 10.0, 1000.0, twin.random())
        assert second >= 20.0
        assert job.hosts.next_expiry() == pytest.approx(100 + second)
        assert job.reg.next_deadline() == pytest.approx(100 + second)


def test_survivor_on_a_blacklisted_host_hands_the_state_over_before_it_leaves():
    """A blacklisted host's healthy worker holds the job's state: it is kept (not dismissed,
    which used to fail the job "no worker is left to continue from") until a newcomer has
    synced from it as rank 0; only the round after that lets it go."""
    job = Job(np=2, min_np=1, cooldown=(100.0, 100.0), elastic_timeout=600.0)
    job.start({"a": 2}, at=0)
    job.exit("w0", 1, at=1)   # a blacklisted until t=101; w1 on a[1] is healthy
    acts = job.rdv("w1", at=2, has_state=True)
    assert not of(acts, Dismiss) and not of(acts, Finish)
    assert events(acts, "waiting_for_slots")
    assert job.state("w1") is WorkerState.WAITING
    acts = job.discover({"a": 2, "b": 1}, at=3)
    assert [l.info.key for l in of(acts, Launch)] == [("b", 0)]
    acts = job.rdv("w2", at=4)
    assert ranks(of(acts, Assign)) == {("a", 1): ("w1", 0), ("b", 0): ("w2", 1)}  # the hand-over round
    assert all(a.must_sync for a in of(acts, Assign))
    assert of(acts, Notify) == []
    acts = job.tick(4.5)  # the holder leaves once the newcomer has synced: notified at once
    assert of(acts, Notify) == [Notify(added=False, removed=True)]
    job.rdv("w2", at=5, has_state=True)
    acts = job.rdv("w1", at=6, has_state=True)
    assert [d.worker_id for d in of(acts, Dismiss)] == ["w1"]
    assert ranks(of(acts, Assign)) == {("b", 0): ("w2", 0)}
    assert not events(acts, "state_lost")


def test_no_relaunch_on_a_slot_whose_failed_process_is_alive():
    job = Job(np=2, min_np=1, cooldown=(5.0, 5.0))
    job.start({"a": 1, "b": 1}, at=0)
    job.failing("w1", "RuntimeError: CUDA error", at=1)  # b blacklisted until 6; w1 still running
    job.rdv("w0", at=2)                                  # round 1 on a only
    acts = job.tick(6)
    # actual: Launch(w2) on b[0] while w1 (FAILED, not exited) still occupies it
    assert not [l for l in of(acts, Launch) if l.info.key == ("b", 0)]
    acts = job.exit("w1", 1, at=7)
    assert [l.info.key for l in of(acts, Launch)] == [("b", 0)]


# --- failure reports and heartbeats ----------------------------------------------------------
class TestFailingReport:
    def test_member_failing_aborts_and_its_exit_is_only_recorded(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        acts = job.failing("w1", "RuntimeError: NCCL timeout", at=1)
        assert [(a.round, why(a)) for a in of(acts, AbortRound)] == [(0, "b[0] failed: RuntimeError: NCCL timeout")]
        assert job.hosts.is_blacklisted("b")
        assert job.state("w1") is WorkerState.FAILED and not job.reg.workers["w1"].exited
        assert job.failing("w1", "again", at=2) == []
        acts = job.exit("w1", 1, at=3)
        assert not events(acts, "worker_failed") and not of(acts, AbortRound)
        assert job.reg.workers["w1"].exited and job.reg.workers["w1"].exit_code == 1
        acts = job.rdv("w0", at=4)
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)}

    def test_failing_then_all_failed_names_the_error(self):
        job = Job(np=1)
        job.start({"a": 1})
        acts = job.failing("w0", "ValueError: bad batch", at=1)
        finish = of(acts, Finish)
        assert finish and not finish[0].ok and "ValueError: bad batch" in why(finish[0])

    def test_failing_of_unknown_or_gone_worker_is_ignored(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        assert job.failing("ghost", "x") == []
        job.discover({"a": 1}, at=1)
        job.rdv_all(["w1", "w0"], at=2)  # w1 dismissed
        assert job.failing("w1", "x", at=3) == []
        assert not job.hosts.is_blacklisted("b")

    def test_launching_worker_failing_does_not_abort(self):
        job = Job(np=1, min_np=1)
        job.start({"a": 1})
        job.discover({"a": 1, "b": 1}, at=1)
        acts = job.failing("w1", "ImportError: torch", at=2)
        assert not of(acts, AbortRound)
        assert job.hosts.is_blacklisted("b")


class TestHeartbeat:
    def test_silent_member_is_killed_and_round_aborted(self):
        job = Job(np=2, min_np=1, heartbeat_timeout=10.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.heartbeat("w0", 5.0)
        assert job.reg.next_deadline() == 10.0
        acts = job.tick(10.0)
        assert [(k.worker_id, k.why.cause) for k in of(acts, Kill)] == [("w1", Cause.SILENT)]
        assert "--heartbeat-timeout 10" in text(events(acts, "worker_failed")[0])
        assert len(of(acts, AbortRound)) == 1
        assert job.hosts.is_blacklisted("b") and job.state("w1") is WorkerState.FAILED
        assert job.state("w0") is WorkerState.RUNNING
        assert job.reg.next_deadline() == 15.0
        acts = job.rdv("w0", at=11)  # a rendezvous is also a sign of life
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)}
        assert job.reg.next_deadline() == 21.0

    def test_heartbeats_keep_a_worker_alive(self):
        job = Job(np=1, heartbeat_timeout=10.0)
        job.start({"a": 1}, at=0)
        for t in range(5, 100, 5):
            job.reg.heartbeat("w0", float(t))
            assert control(job.tick(t + 9.9)) == []

    def test_no_timeout_configured(self):
        job = Job(np=1)
        job.start({"a": 1}, at=0)
        assert control(job.tick(1e6)) == []
        assert job.reg.next_deadline() is None

    def test_heartbeat_from_unknown_worker_is_harmless(self):
        job = Job(np=1, heartbeat_timeout=10.0)
        job.start({"a": 1}, at=0)
        assert job.reg.heartbeat("ghost", 1.0) is None
        assert "ghost" not in job.reg.workers


class TestManyHosts:
    def test_a_listing_of_thousands_of_hosts_names_a_few_and_counts_the_rest(self):
        """A line per host per listing: 5,000 hosts listed (or coming and going at every run)
        printed 5,000 lines each time."""
        job = Job(np=1, max_np=2)
        acts = job.discover({f"n{i}": 1 for i in range(5000)}, at=0)
        assert len(events(acts, "host_added")) == 8
        [more] = events(acts, "hosts_more")
        assert text(more) == "and in the same listing, not named: 4992 more host(s) added"
        acts = job.discover({**{f"n{i}": 1 for i in range(2, 4000)}, "n0": 1, "n1": 2, "m": 1}, at=1)
        assert len(events(acts, "host_removed")) == 8 and len(events(acts, "host_added")) == 1
        assert [e.fields for e in events(acts, "host_resized")] == [{"host": "n1", "slots": 2}]
        [more] = events(acts, "hosts_more")
        assert text(more) == "and in the same listing, not named: 992 more host(s) removed"

    def test_a_few_hosts_are_each_named_and_nothing_is_counted(self):
        job = Job(np=1, max_np=2)
        acts = job.discover({f"n{i}": 1 for i in range(8)}, at=0)
        assert len(events(acts, "host_added")) == 8 and not events(acts, "hosts_more")


class TestStalls:
    """Members in no collective while another has waited in one past the stall warning are
    named: a waiting worker cannot tell which rank holds it (gloo does not say)."""

    @staticmethod
    def beat(job, at, **waits):
        """A heartbeat from each named worker: ``w0=61.0`` waiting 61 s (stalled past 60),
        ``w1=0.2`` waiting briefly, ``w2=None`` in no collective."""
        job._at(at)
        for wid, waiting in waits.items():
            job.reg.heartbeat(wid, job.now, waiting=waiting, stalled=waiting is not None and waiting >= 60)
        return checked(job.reg.decide(job.now))

    def test_the_members_outside_every_collective_are_named_once_then_every_300_s(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 2, "b": 1}, at=0)
        assert not events(self.beat(job, 10, w0=59.5, w1=59.0, w2=None), "round_stalled")
        acts = self.beat(job, 11, w0=60.5, w1=60.0, w2=None)
        assert [text(e) for e in events(acts, "round_stalled")] == [
            "round 0: 2 rank(s) have waited 60 s in a collective for rank 2 (b[0]), which is in none: busy alone "
            "(evaluating, saving or loading data on one rank, a print blocked on a console or SSH channel nobody "
            "reads) or stuck; the round waits (see docs/troubleshooting.md)"]
        assert events(acts, "round_stalled")[0].level == "warning"
        assert not events(self.beat(job, 12, w0=61.5, w1=61.0, w2=None), "round_stalled")
        assert job.reg.next_deadline() == pytest.approx(311.0)
        [again] = events(self.beat(job, 311, w0=360.5, w1=360.0, w2=None), "round_stalled")
        assert again.fields["ranks"] == [[2, "b[0]"]] and again.fields["waited"] == pytest.approx(360.5)
        # It enters the collective: the round moves on, and nothing more is said or awaited.
        assert not events(self.beat(job, 312, w2=0.1), "round_stalled")
        assert not events(self.beat(job, 313, w0=None, w1=None, w2=None), "round_stalled")
        assert job.reg.next_deadline() is None
        # A new stall later is a new episode: said at once.
        self.beat(job, 400, w0=None, w1=None, w2=None)
        [new] = events(self.beat(job, 470, w0=None, w1=None, w2=65.0), "round_stalled")
        assert new.fields["ranks"] == [[0, "a[0]"], [1, "a[1]"]] and new.fields["waiting"] == 1
        assert "for rank 0 (a[0]), rank 1 (a[1]), which are in none" in text(new)

    def test_no_line_before_the_stall_warning_nor_when_every_member_waits(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 2, "b": 1}, at=0)
        for t in range(1, 50):  # training: members in and out of collectives at every heartbeat
            waits = {f"w{i}": (0.01 if (t + i) % 2 else None) for i in range(3)}
            assert not events(self.beat(job, t, **waits), "round_stalled")
        # Every member waits (their collectives do not match, or the network is stuck): each
        # worker's own line says what it waits in; the driver has nobody to name.
        assert not events(self.beat(job, 100, w0=70.0, w1=65.0, w2=61.0), "round_stalled")
        assert job.reg.next_deadline() is not None  # (the line is due again if one leaves)
        [e] = events(self.beat(job, 101, w1=None), "round_stalled")
        assert e.fields["ranks"] == [[1, "a[1]"]]

    def test_ranks_stalled_in_different_collectives_are_named_with_what_each_waits_in(self):
        """Every member in a collective past its stall warning, but not the same one (a commit
        on some ranks only, steps counted apart after join()): each worker's own line said only
        that "one of them is busy outside collectives", which none was."""
        job = Job(np=3, min_np=1)
        job.start({"a": 2, "b": 1}, at=0)
        waits = {"w0": "sampler.processed_indices.size", "w1": "allreduce gradient bucket 0",
                 "w2": "allreduce gradient bucket 0"}

        def beat(at, waited, until=None):
            job._at(at)
            for wid, op in waits.items():
                job.reg.heartbeat(wid, job.now, waiting=waited, stalled=True, op=op, until=until)
            return checked(job.reg.decide(job.now))

        [e] = events(beat(100, 70.0), "round_diverged")
        assert text(e) == (
            "round 0: every rank has waited 70 s in a collective, but not the same one: rank 0 in "
            "sampler.processed_indices.size; ranks 1, 2 in allreduce gradient bucket 0. The ranks' scripts took "
            "different paths (a commit or a collective on some ranks only, steps counted apart after join(), a process "
            "set registered with other ranks); each waits up to its --collective-timeout (see docs/troubleshooting.md)")
        assert e.level == "warning" and not events([e], "round_stalled")
        assert not events(beat(101, 71.0), "round_diverged")  # said once, then every 300 s
        # The limit each worker keeps, as its heartbeat names it: a stall shutdown below the
        # collective timeout ends the waits first (the line said "until --collective-timeout").
        [e] = events(beat(401, 371.0, until="--stall-check-shutdown-time-seconds 400"), "round_diverged")
        assert text(e).endswith("each waits up to --stall-check-shutdown-time-seconds 400 s (see docs/troubleshooting.md)")
        waits["w0"] = "allreduce gradient bucket 0"  # all in the same one: nobody to name
        assert not events(beat(402, 5.0), "round_diverged")

    def test_heartbeats_of_a_training_job_ask_for_no_decision(self):
        """Membership of a collective flips at every heartbeat while a job trains: only a
        stalled wait (or, during one, a member entering or leaving collectives) asks for a
        decision, so that 4,096 workers' heartbeats cost no decision each."""
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1}, at=0)
        job.tick(1)
        for t in range(2, 20):
            job.reg.heartbeat("w0", float(t), waiting=0.01 if t % 2 else None)
            job.reg.heartbeat("w1", float(t), waiting=None if t % 2 else 0.02)
            assert not job.reg.dirty
        job.reg.heartbeat("w0", 20.0, waiting=61.0, stalled=True)
        assert job.reg.dirty

    def test_an_aborted_round_says_who_has_not_left_it_instead(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 2, "b": 1}, at=0)
        self.beat(job, 61, w0=61.0, w1=None, w2=61.0)
        acts = job.exit("w2", 1, at=62)
        assert of(acts, AbortRound)
        assert not events(self.beat(job, 63, w0=62.0, w1=None), "round_stalled")
        acts = job.rdv("w0", at=64)
        acts += job.rdv("w1", at=65)
        assert of(acts, Assign) and job.reg.round == 1
        # What they said of round 0's collectives is not held against round 1.
        assert not events(job.tick(66), "round_stalled") and job.reg.next_deadline() is None
        assert not any(w.stalled for w in job.reg.workers.values())


class TestGoodbye:
    """A worker's last heartbeat says goodbye: its silence after it is no hang."""

    def test_ending_process_gets_its_teardown_then_finishes(self):
        job = Job(np=2, heartbeat_timeout=5.0)
        job.start({"a": 1, "b": 1}, at=0)
        for w in ("w0", "w1"):
            job.reg.heartbeat(w, 1.0, bye="exit")
        assert job.reg.next_deadline() == 1.0 + EXIT_GRACE  # no heartbeat deadline any more
        assert control(job.tick(20.0)) == []  # 19 s of teardown: no "sent no heartbeat"
        job.exit("w0", 0, at=21.0)
        acts = job.exit("w1", 0, at=22.0)
        finish = of(acts, Finish)
        assert finish and finish[0].ok and finish[0].complete

    def test_ending_process_stuck_in_teardown_is_killed_and_said(self):
        job = Job(np=2, heartbeat_timeout=5.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.heartbeat("w0", 1.0, bye="exit")
        job.reg.heartbeat("w1", 1.0)
        job.exit("w1", 0, at=2.0)
        assert control(job.tick(1.0 + EXIT_GRACE - 0.1)) == []
        acts = job.tick(1.0 + EXIT_GRACE)
        assert [(k.worker_id, k.why.cause) for k in of(acts, Kill)] == [("w0", Cause.STUCK_EXITING)]
        message = text(events(acts, "worker_failed")[0])
        assert "did not exit within" in message and "teardown" in message
        assert job.state("w0") is WorkerState.FAILED

    def test_a_worker_that_called_shutdown_runs_on_unwatched(self):
        job = Job(np=1, heartbeat_timeout=5.0)
        job.start({"a": 1}, at=0)
        job.reg.heartbeat("w0", 1.0, bye="shutdown")
        assert job.reg.next_deadline() is None
        assert control(job.tick(3600.0)) == []  # the user's post-processing, however long
        assert job.state("w0") is WorkerState.RUNNING
        finish = of(job.exit("w0", 0, at=3601.0), Finish)
        assert finish and finish[0].ok

    def test_silence_without_goodbye_is_still_a_hang(self):
        job = Job(np=1, heartbeat_timeout=5.0)
        job.start({"a": 1}, at=0)
        job.reg.heartbeat("w0", 1.0, bye="later")  # not a goodbye this driver knows
        assert of(job.tick(6.0), Kill) == [Kill("w0", Reason(Cause.SILENT, {"silent_s": 5.0, "limit": 5.0}))]


# --- limits and timeouts ---------------------------------------------------------------------
class TestResetLimit:
    @pytest.mark.parametrize("limit", [0, 1, 2, 3])
    def test_n_resets_allowed_then_fail(self, limit):
        hosts = {f"h{i}": 1 for i in range(limit + 2)}
        job = Job(np=len(hosts), min_np=1, reset_limit=limit)
        job.start(hosts)
        t = 0
        for n in range(limit):
            victim = job.reg.members[(f"h{n + 1}", 0)]
            t += 1
            job.exit(victim, 1, at=t)
            acts = job.rdv_all([wid for wid in job.reg.members.values()
                                if job.state(wid) is WorkerState.RUNNING], at=t)
            assert not of(acts, Finish), f"reset {n + 1} of {limit} must be allowed"
            assert job.reg.round == n + 1 and job.reg.reset_count == n + 1
        victim = job.reg.members[(f"h{limit + 1}", 0)]
        job.exit(victim, 1, at=t + 1)
        acts = job.rdv(job.reg.members[("h0", 0)], at=t + 2)
        finish = of(acts, Finish)
        assert len(finish) == 1 and not finish[0].ok
        assert f"reset limit {limit}" in why(finish[0]) and "--reset-limit" in why(finish[0])
        assert not of(acts, Assign)

    def test_graceful_host_change_counts_as_reset(self):
        job = Job(np=1, min_np=1, reset_limit=0)
        job.start({"a": 1})
        job.discover({"a": 1, "b": 1}, at=1)
        job.rdv("w1", at=2)
        acts = job.rdv("w0", at=3)
        finish = of(acts, Finish)
        assert finish and not finish[0].ok and "reset limit 0" in why(finish[0])

    def test_no_limit(self):
        hosts = {f"h{i}": 1 for i in range(6)}
        job = Job(np=6, min_np=1, reset_limit=None)
        job.start(hosts)
        for n in range(1, 6):
            job.exit(job.reg.members[(f"h{n}", 0)], 1, at=n)
            acts = job.rdv_all([wid for wid in job.reg.members.values()
                                if job.state(wid) is WorkerState.RUNNING], at=n)
            assert not of(acts, Finish)
            assert job.reg.round == n
        assert job.reg.reset_count == 5


class TestElasticTimeout:
    def test_survivors_on_a_blacklisted_host_are_not_counted_as_ready(self):
        """One host, one of its three workers fails: the host is blacklisted, and its two
        survivors wait for its cooldown. The line said 'waiting for 2 ready worker(s) (have 2'."""
        job = Job(np=3, min_np=2, cooldown=(4.0, 4.0))
        job.start({"a": 3}, at=0)
        job.exit("w1", 1, at=10)
        job.rdv("w0", at=11)
        acts = job.rdv("w2", at=11)
        said = events(acts, "waiting_for_slots")
        assert said and "waiting for 2 ready worker(s) (have 0;" in text(said[0]), text(said[0])

    def test_the_first_wait_for_np_from_discovery_starts_with_min_np_slots_when_it_runs_out(self):
        """-np 3 --min-np 2, discovery lists 2 slots: the job used to fail at --elastic-timeout
        (horovodrun's way) with the slots --min-np allows idle. It starts with them, as the
        wait's line says, and a host listed later joins the running job."""
        job = Job(np=3, min_np=2, max_np=3, elastic_timeout=60.0)
        acts = job.discover({"a": 1, "b": 1}, at=0)
        [said] = events(acts, "waiting_for_slots")
        assert text(said).endswith("in 60 s (--elastic-timeout) the job starts with the slots usable then if they are "
                                   "--min-np 2 or more, else gives up")
        assert not of(acts, Launch) and not of(job.tick(59.9), Finish)
        acts = job.tick(60)
        assert [text(e) for e in events(acts, "np_not_met")] == [
            "discovery listed 2 usable slot(s), not -np 3, within --elastic-timeout 60 s: starting with 2 (--min-np 2); "
            "hosts listed later join the job"]
        assert sorted(l.info.key for l in of(acts, Launch)) == [("a", 0), ("b", 0)] and not of(acts, Finish)
        job.rdv("w0", at=61)
        acts = job.rdv("w1", at=61.5)  # round 0 forms with both, and waits for nobody more
        assert job.reg.round == 0 and len(of(acts, Assign)) == 2
        assert not events(job.tick(200), "np_not_met") and not of(job.tick(300), Finish)
        launch = of(job.discover({"a": 1, "b": 1, "c": 1}, at=301), Launch)
        assert [l.info.key for l in launch] == [("c", 0)]

    def test_the_first_wait_for_np_gives_up_below_min_np_and_with_a_fixed_host_list(self):
        job = Job(np=3, min_np=2, elastic_timeout=60.0)
        job.discover({"a": 1}, at=0)
        [finish] = of(job.tick(60), Finish)
        assert why(finish).startswith("timed out after 60 s (--elastic-timeout)") and not finish.ok
        job = Job(np=3, min_np=3, elastic_timeout=60.0)  # (no --min-np below -np: horovodrun's wait)
        [said] = events(job.discover({"a": 1, "b": 1}, at=0), "waiting_for_slots")
        assert "giving up in 60 s (--elastic-timeout)" in text(said)
        assert of(job.tick(60), Finish)

    def test_times_out_below_min_np(self):
        job = Job(np=2, min_np=2, elastic_timeout=60.0, start_timeout=30.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.exit("w1", 1, at=10)
        acts = job.rdv("w0", at=11)
        assert control(acts) == []
        said = events(acts, "waiting_for_slots")  # what it waits for, and until when
        assert said and "waiting for 2 ready worker(s) (have 1" in text(said[0])
        assert "giving up in 60 s (--elastic-timeout)" in text(said[0]) and said[0].level == "warning"
        assert job.reg.next_deadline() == 41.0  # said again every 30 s
        assert not events(job.tick(40.9), "waiting_for_slots")
        acts = job.tick(41)
        assert control(acts) == [] and "giving up in 30 s" in text(events(acts, "waiting_for_slots")[0])
        assert job.reg.next_deadline() == 71.0
        assert control(job.tick(70.9)) == []
        acts = job.tick(71.0)
        finish = of(acts, Finish)
        assert len(finish) == 1 and not finish[0].ok
        assert why(finish[0]).startswith("timed out after 60 s (--elastic-timeout)")
        assert "2 slots" in why(finish[0]) and "usable hosts: a:1" in why(finish[0])

    def test_recovers_when_a_host_arrives_in_time(self):
        job = Job(np=2, min_np=2, elastic_timeout=60.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.exit("w1", 1, at=10)
        job.rdv("w0", at=11)
        launches = of(job.discover({"a": 1, "b": 1, "c": 1}, at=50), Launch)
        assert [l.info.key for l in launches] == [("c", 0)]
        acts = job.rdv("w2", at=55)
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0), ("c", 0): ("w2", 1)}
        assert job.reg.next_deadline() is None
        assert control(job.tick(1000)) == []

    def test_min_np_satisfied_reforms_smaller(self):
        job = Job(np=3, min_np=2, elastic_timeout=60.0)
        job.start({"a": 1, "b": 1, "c": 1}, at=0)
        job.exit("w2", 1, at=1)
        job.rdv("w0", at=2)
        acts = job.rdv("w1", at=3)
        assert len(of(acts, Assign)) == 2


# --- success ---------------------------------------------------------------------------------
class TestSuccess:
    def test_waiting_dismissed_launching_killed_finish_when_none_running(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 2}, at=0)
        job.discover({"a": 2, "b": 1}, at=1)  # w2 launching
        job.rdv("w2", at=2)                   # w2 waiting, Notify sent
        job.discover({"a": 2, "b": 1, "c": 1}, at=3)  # w3 launching
        assert job.state("w3") is WorkerState.LAUNCHING

        acts = job.exit("w0", 0, at=4)
        assert events(acts, "worker_succeeded")
        assert Dismiss("w2", Reason(Cause.JOB_FINISHED)) in acts
        assert Kill("w3", Reason(Cause.JOB_FINISHED)) in acts
        assert not of(acts, Finish)  # w1 still running
        assert job.state("w2") is WorkerState.LEFT and job.state("w3") is WorkerState.LEFT

        acts = job.exit("w1", 0, at=5)
        finish = of(acts, Finish)
        assert [(f.ok, why(f)) for f in finish] == [(True, "training finished after 1 round(s), 0 reset(s)")]
        assert acts[-1] == finish[0]

    def test_member_rendezvous_after_success_is_dismissed(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 2})
        job.exit("w0", 0, at=1)
        acts = job.rdv("w1", at=2)
        # w1 was still RUNNING: it is now waiting, and is dismissed because the job finished.
        assert Dismiss("w1", Reason(Cause.JOB_FINISHED)) in acts
        assert of(acts, Finish) and of(acts, Finish)[0].ok

    def test_a_rank_that_succeeds_while_others_train_is_named_and_the_end_is_not_finished(self):
        """Horovod's rule (one success ends the job) stands, but the reason names who returned
        early, at which step, and who never finished: not "training finished"."""
        job = Job(np=3, min_np=1)
        job.start({"a": 3})
        job.reg.heartbeat("w1", 1.0, steps=5)
        job.exit("w1", 0, at=2)
        job.rdv("w0", at=3)  # its collective failed: it asks for the next round, and is dismissed
        [finish] = of(job.exit("w2", 0, at=4), Finish)
        assert finish.ok and not finish.complete
        assert why(finish).startswith("rank 1 exited 0 at step 5 while 2 ranks were training: the job ends there")
        assert "rank(s) 0 did not finish training" in why(finish)

    def test_ranks_that_all_finish_a_little_apart_are_a_finished_job(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 2})
        job.reg.heartbeat("w0", 1.0, steps=40)
        job.exit("w0", 0, at=2)
        [finish] = of(job.exit("w1", 0, at=3), Finish)
        assert (finish.ok, why(finish)) == (True, "training finished after 1 round(s), 0 reset(s)")

    def test_after_finish_only_replies(self):
        job = Job(np=1)
        job.start({"a": 1})
        acts = job.exit("w0", 0, at=1)
        assert of(acts, Finish) == [job.reg.finished]
        assert job.rdv("w0", at=2) == [Dismiss("w0", Reason(Cause.JOB_FINISHED))]
        assert job.rdv("ghost", at=2) == [Dismiss("ghost", Reason(Cause.NOT_IN_JOB))]
        assert control(job.discover({"a": 1, "b": 4}, at=3)) == []
        assert control(job.tick(1e9)) == []
        assert job.reg.next_deadline() is None

    def test_counts_rounds_and_resets(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.exit("w1", 1, at=1)
        job.rdv("w0", at=2)
        finish = of(job.exit("w0", 0, at=3), Finish)
        assert [(f.ok, why(f)) for f in finish] == [(True, "training finished after 2 round(s), 1 reset(s)")]


# --- next_deadline ---------------------------------------------------------------------------
def test_next_deadline_none_when_idle():
    job = Job(np=1)
    assert job.reg.next_deadline() is None
    job.start({"a": 1})
    assert job.reg.next_deadline() is None


def test_next_deadline_is_earliest_of_launch_timeouts():
    job = Job(np=1, min_np=1, start_timeout=30.0)
    job.start({"a": 1}, at=0)
    job.discover({"a": 1, "b": 1}, at=5)
    job.discover({"a": 1, "b": 1, "c": 1}, at=7)
    assert job.reg.next_deadline() == 35.0


# --- rank 0 stays on a survivor ----------------------------------------------------------------
def test_rank0_survives_a_discovery_flap_of_the_only_member_host():
    job = Job(np=1, min_np=1)
    job.start({"a": 1}, at=0)               # w0 on a, rank 0
    job.discover({"a": 1, "c": 1}, at=1)    # w1 launching on c
    job.discover({"c": 1}, at=2)            # a drops out of one discovery run ...
    job.discover({"c": 1, "a": 1}, at=3)    # ... and is back; w0 never stopped
    job.rdv("w1", at=4)
    acts = job.rdv("w0", at=5)
    assigned = ranks(of(acts, Assign))
    # a is behind c in the host manager's join order, but its worker survived: it keeps rank 0.
    assert [h for h, _ in job.hosts.available()] == ["c", "a"]
    assert assigned == {("a", 0): ("w0", 0), ("c", 0): ("w1", 1)}
    assert {a.must_sync for a in of(acts, Assign)} == {True}  # w1 is new


def test_rank0_stays_with_the_lowest_ranked_survivor_host():
    job = Job(np=2, min_np=1)
    job.start({"a": 1, "b": 1}, at=0)        # w0 rank 0 on a, w1 rank 1 on b
    job.discover({"a": 1, "b": 1, "c": 1}, at=1)
    job.discover({"b": 1, "c": 1}, at=2)     # both a and b flap: order becomes c, a, b ...
    job.discover({"b": 1, "c": 1, "a": 1}, at=3)
    job.discover({"c": 1, "a": 1}, at=4)
    job.discover({"c": 1, "a": 1, "b": 1}, at=5)
    assert [h for h, _ in job.hosts.available()] == ["c", "a", "b"]
    job.rdv("w2", at=6)
    job.rdv_all(["w1", "w0"], at=7)
    assert job.reg.round == 1
    assert {k: job.reg.workers[w].rank for k, w in job.reg.members.items()} == {
        ("a", 0): 0, ("b", 0): 1, ("c", 0): 2}


def test_same_members_reform_without_a_sync():
    job = Job(np=2, min_np=1)
    job.start({"a": 1, "b": 1})
    job.discover({"a": 1, "b": 1, "c": 1}, at=1)
    job.discover({"a": 1, "b": 1}, at=2)      # c killed before it checked in
    acts = job.rdv_all(["w0", "w1"], at=3)    # e.g. both hit an error and re-rendezvous
    assigns = of(acts, Assign)
    assert ranks(assigns) == {("a", 0): ("w0", 0), ("b", 0): ("w1", 1)}
    assert {a.must_sync for a in assigns} == {False}  # no newcomer, an interrupt, and nobody rolled back


def test_a_rank_that_rolled_back_makes_everyone_sync():
    """Some ranks took the host-update interrupt (their state is the newest commit), one
    rolled back after a failed collective: a rank-local choice would leave some of them in
    sync() and the others in training, pairing unrelated collectives."""
    job = Job(np=2, min_np=1)
    job.start({"a": 1, "b": 1})
    job.discover({"a": 1, "b": 1, "c": 1}, at=1)
    job.discover({"a": 1, "b": 1}, at=2)
    acts = job.rdv("w0", at=3) + job.rdv("w1", restored=True)
    assigns = of(acts, Assign)
    assert len(assigns) == 2
    assert {a.must_sync for a in assigns} == {True}


def test_the_round_after_a_failure_syncs_even_without_newcomers():
    job = Job(np=2, min_np=1)
    job.start({"a": 1, "b": 1, "c": 1})
    acts = job.exit("w2", 137, at=1)
    assert of(acts, AbortRound)
    acts = job.rdv_all(["w0", "w1"], at=2)  # neither reports a roll-back (e.g. both were interrupted)
    assigns = of(acts, Assign)
    assert ranks(assigns) == {("a", 0): ("w0", 0), ("b", 0): ("w1", 1)}
    assert {a.must_sync for a in assigns} == {True}


def test_rank0_survives_cooldown_return_of_the_only_member_host():
    job = Job(np=2, min_np=1, cooldown=(5.0, 5.0))
    job.start({"a": 2}, at=0)                 # w0 on a[0] rank 0, w1 on a[1] rank 1
    job.discover({"a": 2, "c": 1}, at=1)      # w2 launching on c
    job.exit("w0", 1, at=2)                   # a blacklisted until 7; round 0 aborted
    job.rdv("w2", at=3)
    job.tick(7)                               # a is back (after c in join order)
    acts = job.rdv("w1", at=8)                # the survivor reports; a[0] is relaunched
    assert [(l.worker_id, l.info.key) for l in of(acts, Launch)] == [("w3", ("a", 0))]
    # The round forms of the ready workers at once (w3 joins later, by an addition): the
    # survivor keeps rank 0.
    assert ranks(of(acts, Assign)) == {("a", 1): ("w1", 0), ("c", 0): ("w2", 1)}
    assert of(job.rdv("w3", at=9), Notify) == [Notify(added=True, removed=False)]
    assert len(of(job.rdv_all(["w2", "w1"], at=10), Assign)) == 3
    members = {k: (w, job.reg.workers[w].rank) for k, w in job.reg.members.items()}
    assert members[("a", 1)] == ("w1", 0)  # once: w3, the process just launched on a[0]
    assert members[("a", 0)][0] == "w3" and job.reg.round == 2


# --- randomized state machine ----------------------------------------------------------------
class RegistryMachine(RuleBasedStateMachine):
    """Random discovery changes, failures, rendezvous calls and clock advances.

    Invariants are checked on every action list and on the registry state after every step.
    """

    FRESH_HOSTS_ONLY = False  # True: a host that left discovery never comes back
    COOLDOWN = True           # allow blacklist cooldowns (hosts return after a failure)
    COOLDOWN_ONLY = False     # always use a cooldown
    # Two invariants (rank 0 stays on a survivor; no relaunch on a slot whose process has not
    # exited) once broke with a cooldown only; CooldownMachine checks them with one always on.
    STRICT_WITH_COOLDOWN = False

    @initialize(data=st.data())
    def setup(self, data):
        np_ = data.draw(st.integers(1, 4), label="np")
        min_np = data.draw(st.integers(1, np_), label="min_np")
        max_np = data.draw(st.one_of(st.none(), st.integers(np_, 6)), label="max_np")
        reset_limit = data.draw(st.one_of(st.none(), st.integers(0, 3)), label="reset_limit")
        cooldowns = st.none()
        if self.COOLDOWN:
            cooldowns = st.just((5.0, 40.0)) if self.COOLDOWN_ONLY else st.one_of(st.none(), st.just((5.0, 40.0)))
        cooldown = data.draw(cooldowns, label="cooldown")
        self.job = Job(np=np_, min_np=min_np, max_np=max_np, reset_limit=reset_limit,
                       elastic_timeout=data.draw(st.sampled_from([60.0, 20.0]), label="elastic_timeout"),
                       start_timeout=data.draw(st.sampled_from([30.0, 10.0]), label="start_timeout"),
                       cooldown=cooldown, seed=data.draw(st.integers(0, 100), label="seed"),
                       heartbeat_timeout=data.draw(st.sampled_from([None, 40.0]), label="heartbeat_timeout"),
                       evict_stragglers=data.draw(st.booleans(), label="evict_stragglers"))
        self.reg = self.job.reg
        self.cfg = self.job.config
        self.strict = cooldown is None or self.STRICT_WITH_COOLDOWN
        self.finished = None
        self.last_round = -1
        self.local_ranks: dict[str, int] = {}  # worker -> its local rank (it must never change)
        self.prev_members: set[str] = set()
        self.aborts: Counter = Counter()
        self.launched: set[str] = set()
        self.fresh = itertools.count()
        self.current_hosts: dict[str, int] = {}
        # The test's own model of who holds the job's newest state: every member of a round
        # that no holder joined, and every member that synced in a round (reported has_state).
        self.holders: set[str] = set()
        self.before: set[str] = set()  # holders alive before the event under test
        for name in ("discover", "rdv", "exit", "failing", "tick"):
            def snapshot(*args, _call=getattr(self.job, name), **kwargs):
                self.before = {wid for wid in self.holders if self._live(wid)}
                return _call(*args, **kwargs)
            setattr(self.job, name, snapshot)
        # Usually start with enough slots for np (a job whose hosts never come is tested above).
        if data.draw(st.booleans(), label="initial discovery"):
            names = [f"n{next(self.fresh)}" for _ in range(np_)] if self.FRESH_HOSTS_ONLY \
                else ["h0", "h1", "h2", "h3"][:np_]
            slots = data.draw(st.lists(st.integers(1, 2), min_size=len(names), max_size=len(names)),
                              label="initial slots")
            self.current_hosts = dict(zip(names, slots))
            self.step(self.job.discover(self.current_hosts))

    # -- rules ----------------------------------------------------------------------------
    @rule(data=st.data(), dt=st.integers(0, 5))
    def discover(self, data, dt):
        if self.FRESH_HOSTS_ONLY:
            hosts = {h: s for h, s in self.current_hosts.items() if not data.draw(st.booleans(), label=f"drop {h}")}
            for _ in range(data.draw(st.integers(0, 2), label="new hosts")):
                hosts[f"n{next(self.fresh)}"] = data.draw(st.integers(1, 3), label="slots")
            for h in list(hosts):
                if data.draw(st.integers(0, 4), label=f"resize {h}") == 0:
                    hosts[h] = data.draw(st.integers(1, 3), label="new slots")
        else:
            pool = ["h0", "h1", "h2", "h3"]
            hosts = dict(self.current_hosts)
            op = data.draw(st.sampled_from(["add", "remove", "resize", "same", "random", "flap"]), label="op")
            if op == "flap" and hosts:
                # One discovery run misses a host; the next one lists it again.
                gone = data.draw(st.sampled_from(sorted(hosts)), label="flap")
                self.step(self.job.discover({h: n for h, n in hosts.items() if h != gone},
                                            at=self.job.now + dt))
            elif op == "add" and len(hosts) < len(pool):
                hosts[data.draw(st.sampled_from([h for h in pool if h not in hosts]), label="add")] = \
                    data.draw(st.integers(1, 3), label="slots")
            elif op == "remove" and hosts:
                del hosts[data.draw(st.sampled_from(sorted(hosts)), label="remove")]
            elif op == "resize" and hosts:
                hosts[data.draw(st.sampled_from(sorted(hosts)), label="resize")] = \
                    data.draw(st.integers(1, 3), label="slots")
            elif op == "random":
                hosts = data.draw(st.dictionaries(st.sampled_from(pool), st.integers(1, 3), max_size=4),
                                  label="hosts")
        self.current_hosts = hosts
        self.step(self.job.discover(hosts, at=self.job.now + dt))

    def _alive(self):
        return sorted(w.id for w in self.reg.workers.values() if not w.exited)

    def _rdv(self, data, wid, dt):
        """A worker asks for its next round. A member of the current round has synced (so
        holds the state) if that round ended gracefully; after a failure, maybe not."""
        w = self.reg.workers.get(wid)
        member = w is not None and w.state is WorkerState.RUNNING and self.reg.members.get(w.key) == wid
        has_state = member and data.draw(st.booleans(), label=f"{wid} synced")
        if has_state:
            self.holders.add(wid)
        self.step(self.job.rdv(wid, at=self.job.now + dt, has_state=has_state))

    @precondition(lambda self: any(not w.exited for w in self.reg.workers.values()))
    @rule(data=st.data(), dt=st.integers(0, 5))
    def rendezvous(self, data, dt):
        wid = data.draw(st.sampled_from(self._alive()), label="rendezvous")
        self._rdv(data, wid, dt)

    @precondition(lambda self: any(not w.exited and w.state is not WorkerState.LEFT
                                   for w in self.reg.workers.values()))
    @rule(data=st.data(), dt=st.integers(0, 3))
    def rendezvous_group(self, data, dt):
        """Several workers check in one after the other (e.g. all newcomers, or all after a Notify)."""
        candidates = sorted(w.id for w in self.reg.workers.values()
                            if not w.exited and w.state is not WorkerState.LEFT)
        group = data.draw(st.one_of(st.just(candidates), st.permutations(candidates),
                                    st.lists(st.sampled_from(candidates), unique=True, min_size=1)),
                          label="group")
        for wid in group:
            self._rdv(data, wid, dt)

    def _live(self, wid):
        """(A record of a worker that failed or left is forgotten a minute after its exit.)"""
        w = self.reg.workers.get(wid)
        return w is not None and w.state in LIVE_STATES

    @precondition(lambda self: any(not w.exited for w in self.reg.workers.values()))
    @rule(data=st.data(), dt=st.integers(0, 5))
    def exit(self, data, dt):
        wid = data.draw(st.sampled_from(self._alive()), label="exit")
        state = self.reg.workers[wid].state
        codes = [1, 137, 0] if state in (WorkerState.RUNNING, WorkerState.LEFT) else [1, 137]
        code = data.draw(st.sampled_from(codes), label="code")
        self.step(self.job.exit(wid, code, at=self.job.now + dt))

    @precondition(lambda self: any(w.state in LIVE_STATES for w in self.reg.workers.values()))
    @rule(data=st.data(), dt=st.integers(0, 5))
    def failing(self, data, dt):
        """A worker reports an error before it exits (its exit comes later, or never)."""
        wid = data.draw(st.sampled_from(sorted(w.id for w in self.reg.workers.values()
                                               if w.state in LIVE_STATES)), label="failing")
        self.step(self.job.failing(wid, "RuntimeError: boom", at=self.job.now + dt))

    @precondition(lambda self: any(w.state in LIVE_STATES for w in self.reg.workers.values()))
    @rule(data=st.data(), dt=st.integers(0, 5))
    def heartbeat(self, data, dt):
        """Some live workers send a sign of life (heartbeats never produce actions)."""
        alive = sorted(w.id for w in self.reg.workers.values() if w.state in LIVE_STATES)
        self.job._at(self.job.now + dt)
        for wid in data.draw(st.one_of(st.just(alive), st.lists(st.sampled_from(alive), unique=True)),
                             label="heartbeat"):
            bye = data.draw(st.sampled_from([None, None, None, "exit", "shutdown"]), label="bye")
            assert self.reg.heartbeat(wid, self.job.now, bye=bye) is None
        self.check_state()

    @precondition(lambda self: any(w.state in LIVE_STATES for w in self.reg.workers.values()))
    @rule(data=st.data(), dt=st.integers(0, 3))
    def leaving(self, data, dt):
        """A worker gets SIGTERM: its host is going."""
        wid = data.draw(st.sampled_from(sorted(w.id for w in self.reg.workers.values() if w.state in LIVE_STATES)),
                        label="sigterm")
        self.job._at(self.job.now + dt)
        self.before = {w for w in self.holders if self._live(w)}
        self.reg.leaving(wid, "SIGTERM", self.job.now)
        self.step(checked(self.reg.decide(self.job.now)))

    @precondition(lambda self: bool(self.current_hosts))
    @rule(data=st.data(), dt=st.integers(0, 3))
    def drain_notice(self, data, dt):
        """Discovery lists some hosts as draining."""
        draining = data.draw(st.sets(st.sampled_from(sorted(self.current_hosts))), label="draining")
        self.job._at(self.job.now + dt)
        self.before = {w for w in self.holders if self._live(w)}
        self.reg.discovered(self.current_hosts, self.job.now, draining)
        self.step(checked(self.reg.decide(self.job.now)))

    @precondition(lambda self: any(w.state is WorkerState.RUNNING for w in self.reg.workers.values()))
    @rule(data=st.data(), dt=st.integers(0, 3))
    def straggler(self, data, dt):
        """The members report their paces: one host computes 20x slower than the others."""
        slow = data.draw(st.sampled_from(sorted({self.reg.workers[wid].host for wid in self.reg.members.values()})),
                         label="straggler")
        self.before = {w for w in self.holders if self._live(w)}
        acts = self.job.paces(slow={slow}, at=self.job.now + dt)
        self.step(acts)
        evicted = {e.fields["host"] for e in events(acts, "straggler") if e.fields["action"] == "evicted"}
        if evicted:
            assert self.cfg.evict_stragglers and evicted == {slow}
            assert not of(acts, AbortRound)  # graceful: no rollback
            left = [w for w in self.reg.workers.values() if w.state is WorkerState.RUNNING and w.host not in evicted]
            assert len(left) >= self.cfg.min_np

    @rule(commit=st.integers(1, 100))
    def durable_copy(self, commit):
        self.reg.durable(commit)

    @rule(dt=st.sampled_from([1, 3, 10, 30]))
    def tick(self, dt):
        self.step(self.job.tick(self.job.now + dt))

    @rule(dt=st.integers(0, 5))
    def stranger(self, dt):
        acts = self.job.rdv("stranger", at=self.job.now + dt)
        assert Dismiss("stranger", Reason(Cause.NOT_IN_JOB)) in acts
        assert "stranger" not in self.reg.workers
        self.step([a for a in acts if a != Dismiss("stranger", Reason(Cause.NOT_IN_JOB))])

    # -- checks on every action list ------------------------------------------------------
    def step(self, acts):
        for a in acts:
            assert isinstance(a, (Launch, Assign, Dismiss, Kill, Notify, AbortRound, ForgetRounds, Event, Finish)), a
        if self.finished is not None:
            # Only log events and replies to rendezvous calls after the end.
            assert all(isinstance(a, (Event, Dismiss)) for a in acts), acts
            assert all(why(d) == "the job has finished" or "not part" in why(d)
                       or "no place" in why(d) for d in of(acts, Dismiss))
            return
        finishes = of(acts, Finish)
        assert len(finishes) <= 1
        if finishes:
            assert acts[-1] is finishes[0], "Finish must be the last action"
            self.finished = finishes[0]
            assert self.reg.finished == finishes[0]
            if finishes[0].ok:
                assert any(w.state is WorkerState.SUCCEEDED for w in self.reg.workers.values())

        for launch in of(acts, Launch):
            assert launch.worker_id not in self.launched
            assert launch.info.host not in self.reg.hosts.draining(), f"launched on draining {launch.info.host}"
            self.launched.add(launch.worker_id)

        round_now = self.last_round
        assigns: list[Assign] = []
        for a in acts:
            if isinstance(a, AbortRound):
                assert a.round == round_now
                self.aborts[a.round] += 1
                assert self.aborts[a.round] == 1, f"AbortRound twice for round {a.round}"
            elif isinstance(a, Assign):
                if not assigns:
                    round_now += 1
                assert a.round == round_now
                assigns.append(a)
        if assigns:
            self.check_formation(assigns)
        self.check_state()

    def check_formation(self, assigns):
        size = len(assigns)
        assert [a.info.rank for a in assigns] == list(range(size))
        assert all(a.info.size == size for a in assigns)
        assert len({a.worker_id for a in assigns}) == size
        assert len({a.info.key for a in assigns}) == size
        first = self.last_round < 0
        # (The first round's wait for -np ran out with --min-np usable: it starts with those.)
        assert size >= (self.cfg.np if first and not self.reg._np_relaxed else self.cfg.min_np)
        if self.cfg.max_np is not None:
            assert size <= self.cfg.max_np
        # Ranks are host by host; a local rank is the worker's slot (for its life), under local_size.
        hosts = [a.info.host for a in assigns]
        assert hosts == sorted(hosts, key=hosts.index), "a host's ranks are not contiguous"
        for h in set(hosts):
            mine = [a.info for a in assigns if a.info.host == h]
            assert all(i.local_rank == i.slot for i in mine)
            local_size = max(len(mine), max(i.slot for i in mine) + 1)
            assert all(i.local_size == local_size and i.local_rank < local_size for i in mine)
        for a in assigns:  # a process's local rank never changes
            seen = self.local_ranks.setdefault(a.worker_id, a.info.local_rank)
            assert seen == a.info.local_rank, f"{a.worker_id}: local rank {seen} then {a.info.local_rank}"
        available = dict(self.job.hosts.available())
        new_ids = {a.worker_id for a in assigns}
        # Holders alive when the event came (a holder dismissed by this very decision counts).
        alive_holders = {wid for wid in self.before
                         if self.reg.workers[wid].state is not WorkerState.FAILED and not self.reg.workers[wid].exited}
        outside = [a for a in assigns if a.info.host not in available or a.info.slot >= available[a.info.host]]
        if alive_holders:
            # The rule: while a holder is alive, no round forms without one; rank 0 is one.
            assert assigns[0].worker_id in alive_holders, (
                f"round {assigns[0].round} formed with rank 0 on {assigns[0].worker_id}, not on a holder "
                f"of the state ({sorted(alive_holders)})")
            # Only a holder handing the state over may be on a host that is not usable now, or
            # holders that all are on hosts going (draining, leaving) with nobody to hand over to:
            # they keep training in a round of their own.
            assert all(a.worker_id in alive_holders for a in outside)
            draining = self.job.hosts.draining()
            assert len(outside) <= 1 or (len(outside) == size and all(a.info.host in draining for a in assigns))
        else:
            assert not outside
            if self.reg.durable_commit is None:  # a round without holders: they all start from the script's
                self.holders |= new_ids  # state (from a durable copy: once they report a sync)
        # Rank 0 restores the durable copy exactly when no holder joined and a copy exists.
        assert [a.restore for a in assigns] == [not alive_holders and self.reg.durable_commit is not None] + \
            [False] * (size - 1)
        if first:  # the first round is the whole target
            total = sum(available.values())
            assert size == (total if self.cfg.max_np is None else min(total, self.cfg.max_np))
        # New members must sync.
        assert len({a.must_sync for a in assigns}) == 1
        if new_ids - self.prev_members:
            assert assigns[0].must_sync
        if self.strict and new_ids & self.prev_members and not outside:
            assert assigns[0].worker_id in self.prev_members, (
                f"rank 0 went to {assigns[0].worker_id} ({assigns[0].info.host}) although "
                f"{sorted(new_ids & self.prev_members)} survived from round {self.last_round}")
        self.prev_members = new_ids
        self.last_round = assigns[0].round
        if self.cfg.reset_limit is not None:
            assert self.reg.reset_count <= self.cfg.reset_limit

    def check_state(self):
        reg = self.reg
        # At most one live, non-LEFT worker per (host, slot). With a cooldown a FAILED process that
        # has not exited yet is left out: see test_no_relaunch_on_a_slot_whose_failed_process_is_alive.
        ignore_failed = not self.strict
        keys = [w.key for w in reg.workers.values()
                if not w.exited and w.state is not WorkerState.LEFT
                and not (ignore_failed and w.state is WorkerState.FAILED)]
        dupes = [k for k, n in Counter(keys).items() if n > 1]
        assert not dupes, dupes
        # Success is only ever learnt from an exit.
        for w in reg.workers.values():
            if w.state is WorkerState.SUCCEEDED:
                assert w.exited and w.exit_code == 0
        # Members of the current round have ranks 0..size-1.
        if reg.round >= 0:
            members = [reg.workers[wid] for wid in reg.members.values()]
            assert sorted(w.rank for w in members) == list(range(len(members)))
            assert all(w.round == reg.round for w in members)
            assert {w.key for w in members} == set(reg.members)
        # Every RUNNING worker belongs to the current round.
        for w in reg.workers.values():
            if w.state is WorkerState.RUNNING:
                assert reg.members.get(w.key) == w.id and w.round == reg.round
        assert reg.round == self.last_round
        if self.finished is not None:
            assert not any(w.state is WorkerState.RUNNING for w in reg.workers.values())
        if self.cfg.reset_limit is not None:
            assert reg.reset_count <= self.cfg.reset_limit


class FreshHostsMachine(RegistryMachine):
    """A host that leaves discovery never comes back: new names only, many hosts over time."""

    FRESH_HOSTS_ONLY = True


class RollingReplacementMachine(FreshHostsMachine):
    """Spot capacity rolling over: every host is replaced by new ones, often before the
    newcomers have checked in (issue 11: training must never restart from scratch)."""

    @rule(data=st.data(), dt=st.integers(0, 3))
    def replace_all(self, data, dt):
        hosts = {f"n{next(self.fresh)}": data.draw(st.integers(1, 2), label="slots")
                 for _ in range(data.draw(st.integers(1, 2), label="new hosts"))}
        if data.draw(st.booleans(), label="overlap first"):  # new capacity arrives, then the old leaves
            self.step(self.job.discover(dict(self.current_hosts, **hosts), at=self.job.now + dt))
        self.current_hosts = hosts
        self.step(self.job.discover(hosts, at=self.job.now + dt))


class CooldownMachine(RegistryMachine):
    """Always a blacklist cooldown, with every invariant checked."""

    COOLDOWN_ONLY = True
    STRICT_WITH_COOLDOWN = True


_machine_settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = _machine_settings

TestFreshHostsMachine = FreshHostsMachine.TestCase
TestFreshHostsMachine.settings = _machine_settings

TestRollingReplacementMachine = RollingReplacementMachine.TestCase
TestRollingReplacementMachine.settings = _machine_settings

TestCooldownMachine = CooldownMachine.TestCase
TestCooldownMachine.settings = settings(
    _machine_settings, max_examples=300, derandomize=True, database=None, phases=[Phase.generate],
    report_multiple_bugs=False, print_blob=False)


def test_a_listing_after_the_cooldown_says_the_host_is_back_not_added():
    """Whether the deadline's decision or the next discovery run notices the end of a
    cooldown first, the console and the event log say the same thing."""
    job = Job(np=2, min_np=1, cooldown=(1.0, 1.0))
    job.start({"a": 1, "b": 1}, at=0)
    job.exit("w1", 1, at=1)  # b blacklisted until 2
    acts = job.discover({"a": 1, "b": 1}, at=2.5)  # a discovery run comes before any tick
    assert events(acts, "host_whitelisted") and not events(acts, "host_added")


class TestPoliciesOfTheCore:
    """Rules that used to live in the driver shell (issue 13)."""

    def test_an_empty_listing_keeps_the_last_hosts_and_says_so_once(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        acts = job.discover({}, at=1)
        assert control(acts) == [] and job.hosts.discovered() == {"a": 1, "b": 1}
        said = events(acts, "discovery_empty")
        assert said and said[0].level == "warning" and "keeping the last known hosts" in text(said[0])
        assert not events(job.discover({}, at=2), "discovery_empty")  # said once per streak
        job.discover({"a": 1, "b": 1}, at=3)
        assert events(job.discover({}, at=4), "discovery_empty")

    def test_an_empty_first_listing_is_just_no_hosts_yet(self):
        job = Job(np=1)
        assert not events(job.discover({}, at=0), "discovery_empty")

    def test_the_abort_reason_is_kept_until_the_next_round(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        assert job.reg.abort_reason is None
        job.exit("w1", 137, at=1)
        assert job.reg.aborted and words.reason(job.reg.abort_reason) == "b[0] exited with code 137"
        job.rdv("w0", at=2)
        assert job.reg.round == 1 and not job.reg.aborted and job.reg.abort_reason is None

    def test_a_formed_round_forgets_the_store_of_the_others(self):
        job = Job(np=2)
        acts = of(job.discover({"a": 2}), Launch)
        acts = job.rdv_all([l.worker_id for l in acts])
        forget = of(acts, ForgetRounds)
        assert forget == [ForgetRounds(0)]
        assert acts.index(forget[0]) < acts.index(of(acts, Assign)[0])  # before any worker uses the store


class TestGoingAway:
    """Issue 14: hosts about to go (discovery's `draining`, a worker's SIGTERM) leave gracefully."""

    def test_a_draining_host_leaves_at_once_and_gets_no_new_worker(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.reg.discovered({"a": 1, "b": 1}, 1.0, draining={"b"})
        acts = job.tick(1)
        assert of(acts, Notify) == [Notify(added=False, removed=True)]
        assert events(acts, "host_draining") and not events(acts, "host_removed")
        acts = job.rdv_all(["w1", "w0"], at=2)
        assert [d.worker_id for d in of(acts, Dismiss)] == ["w1"] and not of(acts, Launch)
        acts = job.exit("w1", 0, at=3)  # its exit frees the slot, but b is still draining
        assert not of(acts, Launch)
        acts = job.discover({"a": 1, "b": 1}, at=4)  # listed without the word: usable again
        assert [l.info.key for l in of(acts, Launch)] == [("b", 0)]

    def test_a_worker_told_to_stop_takes_its_host_out(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 1, "b": 2})
        job.reg.leaving("w1", "SIGTERM", 1.0)
        acts = job.tick(1)
        assert [text(e) for e in events(acts, "host_leaving")] == ["host b leaving (SIGTERM)"]
        assert of(acts, Notify) == [Notify(added=False, removed=True)]
        acts = job.rdv_all(["w1", "w2", "w0"], at=2)
        assert sorted(d.worker_id for d in of(acts, Dismiss)) == ["w1", "w2"]
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)}
        job.exit("w1", 0, at=3), job.exit("w2", 0, at=3)
        assert not of(job.discover({"a": 1, "b": 2}, at=4), Launch)  # still listed: still going
        job.discover({"a": 1}, at=5)  # gone from the listing ...
        assert len(of(job.discover({"a": 1, "b": 2}, at=6), Launch)) == 2  # ... and back: a new host

    @pytest.mark.parametrize("code", [-15, 143])
    def test_a_newcomer_that_dies_of_sigterm_before_init_takes_its_host_out_unblamed(self, code):
        """Reclaimed while it imports torch or loads data: no handler to say "leaving" yet. The
        news is the same as a leave's: the host goes, without a blacklisting, and is new once
        discovery lists it again (a Kubernetes pod back under its name)."""
        job = Job(np=1, min_np=1)
        job.start({"a": 1})
        job.discover({"a": 1, "b": 1}, at=1)
        acts = checked(job.exit("w1", code, at=2))
        assert [text(e) for e in events(acts, "worker_failed")] == [f"b[0] (rank 1) exited with code {code}"]
        assert [text(e) for e in events(acts, "host_leaving")] == ["host b leaving (SIGTERM)"]
        assert not job.hosts.is_blacklisted("b") and "b" in job.hosts.draining()
        assert not of(acts, AbortRound) and not of(acts, Notify) and not of(acts, Launch)
        assert job.state("w0") is WorkerState.RUNNING
        assert not of(job.discover({"a": 1, "b": 1}, at=3), Launch)  # still listed: still going
        job.discover({"a": 1}, at=4)
        assert [l.info.key for l in of(job.discover({"a": 1, "b": 1}, at=5), Launch)] == [("b", 0)]

    def test_holders_all_leaving_one_after_the_other_keep_training_in_a_round_of_their_own(self):
        """A whole pool reclaimed: b says "leaving" first (a removal: notified), then a. With
        nobody to hand the state to, they said "they keep training", but they were parked in
        the rendezvous the first removal sent them to, idle until their --sigterm-grace ran out.
        They get a round of their own; the hand-over line is said (and a copy asked) once."""
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.reg.leaving("w1", "SIGTERM", 1.0)
        assert of(job.tick(1), Notify) == [Notify(added=False, removed=True)]
        job.reg.leaving("w0", "SIGTERM", 1.1)
        acts = job.tick(1.1)
        assert len(events(acts, "handover_pending")) == 1 and job.reg.handover_pending
        assert job.reg.kept == ("handover", ("a", "b"))  # (the status line repeats it)
        acts = job.rdv_all(["w1", "w0"], at=2)  # both at their next commit: the interrupt
        assert not of(acts, Dismiss)
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0), ("b", 0): ("w1", 1)}
        assert job.reg.round == 1 and job.reg.handover_pending
        acts = job.tick(3)
        assert not events(acts, "handover_pending") and not of(acts, Notify)  # said once; no reset loop
        assert job.reg.kept == ("handover", ("a", "b"))
        job.discover({"a": 1, "b": 1, "c": 1}, at=4)  # new capacity: the hand-over goes on as before
        acts = job.rdv("w2", at=5)
        assert of(acts, Notify) and job.reg.round == 1 and job.reg.kept is None

    def test_a_sigterm_to_one_worker_of_a_host_nobody_can_replace_is_still_a_leave(self):
        """-H a:2, SIGTERM to rank 1 only: its host counts as leaving, every holder is on it and
        no newcomer can come. Both were kept "until new workers are ready", so rank 1 trained on
        until its --sigterm-grace ran out: killed, the round aborted and rolled back. Rank 1
        leaves at its next commit, rank 0 trains on."""
        job = Job(np=2, min_np=1, fixed_hosts=True)
        job.start({"a": 2})
        job.reg.leaving("w1", "SIGTERM", 1.0)
        acts = job.tick(1)
        assert of(acts, Notify) == [Notify(added=False, removed=True)]
        assert [text(e) for e in events(acts, "hosts_updated")] == ["membership changing from 2 to 1 worker(s)"]
        acts = job.rdv_all(["w1", "w0"], at=2)  # both at their next commit: the interrupt
        assert [d.worker_id for d in of(acts, Dismiss)] == ["w1"] and not of(acts, AbortRound)
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)} and job.reg.round == 1
        [said] = events(job.tick(2.5), "handover_pending")  # rank 0's host is going too: said, in -H words
        assert "a leaving (a worker there got SIGTERM: no new worker starts there)" in text(said)
        assert not of(job.exit("w1", 0, at=3), AbortRound) and job.state("w0") is WorkerState.RUNNING
        # Below --min-np without it, the signalled worker is kept as before (no round could form).
        job = Job(np=2, min_np=2, fixed_hosts=True)
        job.start({"a": 2})
        job.reg.leaving("w1", "SIGTERM", 1.0)
        acts = job.tick(1)
        assert not of(acts, Notify) and events(acts, "handover_pending")

    def test_hosts_kept_for_min_np_are_noted_while_they_are_kept(self):
        """Discovery drops c, but without it fewer than --min-np would train: the warning is said
        once a round, and ``kept`` (the status line's words) says so until a newcomer is ready."""
        job = Job(np=3, min_np=3, max_np=3)
        job.start({"a": 1, "b": 1, "c": 1})
        acts = job.discover({"a": 1, "b": 1}, at=1)
        assert len(events(acts, "removal_held")) == 1 and not of(acts, Notify)
        assert job.reg.kept == ("min_np", ("c",))
        assert words.kept(job.reg.kept, 3) == ("; host(s) c still in, for --min-np 3, until enough new workers "
                                               "are ready")
        assert not events(job.tick(2), "removal_held") and job.reg.kept == ("min_np", ("c",))
        launch = of(job.discover({"a": 1, "b": 1, "d": 1}, at=3), Launch)
        acts = job.rdv(launch[0].worker_id, at=4)  # the newcomer is ready: c can go
        assert of(acts, Notify) == [Notify(added=True, removed=True)] and job.reg.kept is None
        assert words.kept(None, 3) == ""

    def test_listed_hosts_the_round_does_not_use_are_named_on_the_status_line(self):
        """A soak run trained for minutes on 2 of the 4 hosts discovery listed (one blacklisted,
        one left after a SIGTERM): its status lines said only "2 worker(s) on 2 host(s)"."""
        job = Job(np=3, min_np=2)
        job.start({"a": 1, "b": 1, "c": 1})
        assert words.held_out(job.reg.held_out(), job.reg.kept) == ""
        job.exit("w2", -9, at=1)
        job.rdv_all(["w0", "w1"], at=2)
        job.discover({"a": 1, "b": 1, "c": 1}, at=3)
        assert words.held_out(job.reg.held_out(), job.reg.kept) == "; listed but not used: c blacklisted", \
            job.reg.held_out()

    def test_a_leaving_host_stays_out_when_its_notice_drops_out_of_the_next_listing(self):
        """Discovery said `draining`, then the worker got SIGTERM; the next listing lacks the word
        (a spot script that could not read the notice as the machine shut down). The host used
        to be usable again: its leaving worker got a place, died at --sigterm-grace, and the
        round rolled back, against "nothing is rolled back"."""
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.reg.discovered({"a": 1, "b": 1}, 1.0, draining={"b"})
        job.tick(1)
        job.reg.leaving("w1", "SIGTERM", 2.0)
        job.tick(2)
        job.reg.discovered({"a": 1, "b": 1}, 3.0, draining=set())
        acts = job.tick(3)
        assert not events(acts, "host_added") and not of(acts, Launch)
        acts = job.rdv_all(["w0", "w1"], at=4)
        assert [d.worker_id for d in of(acts, Dismiss)] == ["w1"]
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)}

    def test_a_leaving_host_that_discovery_misses_for_a_moment_stays_out_while_its_worker_runs(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.reg.leaving("w1", "SIGTERM", 1.0)
        job.tick(1)
        job.discover({"a": 1}, at=2)  # one listing misses it (an API's lag) ...
        acts = job.discover({"a": 1, "b": 1}, at=3)  # ... the next has it: its worker still leaves
        assert not events(acts, "host_added") and not of(acts, Launch)
        acts = job.rdv_all(["w0", "w1"], at=4)
        assert [d.worker_id for d in of(acts, Dismiss)] == ["w1"]
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)}
        job.exit("w1", 0, at=5)  # gone: from now on the host is new once discovery drops it
        assert not of(job.discover({"a": 1, "b": 1}, at=6), Launch)
        job.discover({"a": 1}, at=7)
        assert [l.info.key for l in of(job.discover({"a": 1, "b": 1}, at=8), Launch)] == [("b", 0)]

    @pytest.mark.parametrize("notice", ["sigterm", "discovery"])
    @pytest.mark.parametrize("code", [-9, 255])
    def test_a_host_that_said_it_was_going_and_died_first_is_not_blamed(self, notice, code):
        """Powered off before its workers could leave (-9; 255 when its SSH session dropped):
        the notice came true. The round rolls back (a member died mid-step), but the host is not
        blacklisted, so a new machine under its name (a spot instance given its IP) is used."""
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        if notice == "sigterm":
            job.reg.leaving("w1", "SIGTERM", 1.0)
        else:
            job.reg.discovered({"a": 1, "b": 1}, 1.0, draining={"b"})
        job.tick(1)
        acts = job.exit("w1", code, at=2)
        assert [why(a) for a in of(acts, AbortRound)] == [f"b[0] exited with code {code}"]
        acts = job.rdv("w0", at=3, has_state=True, restored=True)
        assert not events(acts, "host_blacklisted") and not job.hosts.blacklisted()
        job.discover({"a": 1}, at=4)
        assert [l.info.key for l in of(job.discover({"a": 1, "b": 1}, at=300), Launch)] == [("b", 0)]

    def test_a_script_error_on_a_draining_host_still_blacklists_it(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.reg.discovered({"a": 1, "b": 1}, 1.0, draining={"b"})
        job.tick(1)
        job.failing("w1", "RuntimeError: CUDA error", at=2)
        assert job.hosts.is_blacklisted("b")

    def test_a_member_that_dies_of_sigterm_aborts_the_round_and_its_host_leaves_unblamed(self):
        """Past --sigterm-grace (exit 143), or a script that put SIGTERM's default back: the
        member died mid-step, so the round is aborted (the survivors roll back), but its host
        is going, not bad: its other worker leaves, and no blacklisting is said."""
        job = Job(np=3, min_np=1)
        job.start({"a": 1, "b": 2})
        acts = checked(job.exit("w1", 143, at=1))
        assert [why(a) for a in of(acts, AbortRound)] == ["b[0] exited with code 143"]
        assert [text(e) for e in events(acts, "host_leaving")] == ["host b leaving (SIGTERM)"]
        assert job.state("w1") is WorkerState.FAILED
        acts = checked(job.rdv_all(["w2", "w0"], at=2))
        assert [d.worker_id for d in of(acts, Dismiss)] == ["w2"]
        assert ranks(of(acts, Assign)) == {("a", 0): ("w0", 0)}
        assert not events(acts, "host_blacklisted") and not job.hosts.blacklisted()


class TestDurableCopies:
    """Issue 14: with a durable copy, losing every worker to the infrastructure is survived."""

    def test_every_worker_killed_then_resumed_from_the_durable_copy(self):
        job = Job(np=2, min_np=2, elastic_timeout=60.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.durable(7)
        job.exit("w0", -9, at=1)
        acts = job.exit("w1", -9, at=1)
        assert not of(acts, Finish)
        assert events(acts, "workers_lost") and not job.hosts.blacklisted()  # nobody to blame
        launches = of(acts, Launch)
        assert sorted(l.info.key for l in launches) == [("a", 0), ("b", 0)]
        acts = job.rdv_all([l.worker_id for l in launches], at=3)
        assigns = of(acts, Assign)
        assert [(a.info.rank, a.restore, a.must_sync) for a in assigns] == [(0, True, True), (1, False, True)]
        assert not events(acts, "state_lost")

    def test_losing_every_worker_at_once_never_says_a_host_was_blacklisted(self):
        """The console must not say "host a blacklisted permanently" and then take it back: the
        blacklistings of an aborted round's failures are said once the round has settled, and
        a loss of every worker lifts them unsaid."""
        job = Job(np=2, min_np=2, elastic_timeout=60.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.durable(7)
        acts = job.exit("w0", -9, at=1) + job.exit("w1", -9, at=1.01)
        assert not events(acts, "host_blacklisted") and not events(acts, "host_whitelisted")
        assert events(acts, "workers_lost") and not job.hosts.blacklisted()

    def test_every_worker_lost_but_after_a_host_failed_on_its_own(self):
        """A host that failed in an earlier round was said blacklisted; a later collapse of the
        job lets only this round's hosts back, and says so for none it never named."""
        job = Job(np=2, min_np=1, elastic_timeout=60.0, cooldown=(100.0, 100.0))
        job.start({"a": 1, "b": 1, "c": 1}, at=0)
        job.exit("w1", 1, at=1)  # b fails alone
        acts = job.rdv_all(["w0", "w2"], at=2)
        assert [text(e) for e in events(acts, "host_blacklisted")] == ["host b blacklisted for 99.0 s"]  # from 1
        job.reg.durable(9)
        acts = job.exit("w0", -9, at=3) + job.exit("w2", -9, at=3)
        assert not events(acts, "host_blacklisted") and not events(acts, "host_whitelisted")
        assert events(acts, "workers_lost")
        assert job.hosts.is_blacklisted("b") and not job.hosts.is_blacklisted("a")

    def test_a_blacklisting_said_late_says_the_time_it_has_left_or_that_it_is_over(self):
        """The line is held until the round settles (a stopped peer can take its heartbeat
        timeout), but the cooldown runs from the failure: the line said the whole cooldown,
        and the host was back before the time it had just printed."""
        job = Job(np=3, min_np=1, elastic_timeout=60.0, cooldown=(4.0, 4.0))
        job.start({"a": 1, "b": 1, "c": 1}, at=0)
        job.exit("w1", 1, at=1)  # b fails
        acts = job.rdv("w0", at=3)
        assert not events(acts, "host_blacklisted")  # w2 has not settled yet
        acts = job.rdv("w2", at=6)  # after b's cooldown
        said = [text(e) for e in events(acts, "host_whitelisted") + events(acts, "host_blacklisted")]
        assert said == ["host b is back after its blacklist cooldown",
                        "host b was blacklisted for 4.0 s (that cooldown is already over)"], said
        job2 = Job(np=3, min_np=1, elastic_timeout=60.0, cooldown=(4.0, 4.0))
        job2.start({"a": 1, "b": 1, "c": 1}, at=0)
        job2.exit("w1", 1, at=1)
        job2.rdv("w0", at=2)
        acts = job2.rdv("w2", at=2.5)
        assert [text(e) for e in events(acts, "host_blacklisted")] == ["host b blacklisted for 2.5 s"]

    def test_a_host_named_blacklisted_is_let_back_when_the_rest_of_its_round_is_lost_later(self):
        """Hosts reclaimed seconds apart: the first is named blacklisted once the survivor has
        settled; when the survivor is lost too (the round never re-formed: --min-np), the job
        lets the first back and says why without claiming they were lost at once."""
        job = Job(np=2, min_np=2, elastic_timeout=60.0, cooldown=(100.0, 100.0))
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.durable(9)
        job.exit("w0", -9, at=1)
        acts = job.rdv_all(["w1"], at=1.1)  # b settles: a's line is said; no round without a
        assert [text(e) for e in events(acts, "host_blacklisted")] == ["host a blacklisted for 99.9 s"]
        assert job.reg.round == 0
        acts = job.exit("w1", -9, at=4)
        assert [text(e) for e in events(acts, "host_whitelisted")] == [
            "host a is let back: since it failed, every other worker has been lost too, which is no one host's fault"]
        assert not events(acts, "host_blacklisted") and events(acts, "workers_lost")
        assert not job.hosts.blacklisted()

    def test_a_newcomer_stuck_before_asking_for_its_place_holds_the_survivors_no_longer_than_the_timeout(self):
        """Below --min-np without a newcomer that reached the driver but never asks for its
        place (stuck in its script; its heartbeats come from a thread): the survivors used to
        wait for it with no deadline, and nothing was said."""
        job = Job(np=2, min_np=2, elastic_timeout=60.0, heartbeat_timeout=None)
        job.start({"a": 1, "b": 1}, at=0)
        job.exit("w1", 1, at=1)  # b fails: blacklisted
        job.rdv("w0", at=2, has_state=True, restored=True)  # the survivor, alone: below --min-np
        acts = job.discover({"a": 1, "c": 1}, at=4)  # a new host: a newcomer there
        [launch] = of(acts, Launch)
        job.reg.heartbeat(launch.worker_id, 5.0)  # it reached the driver, and never asks for a place
        acts = job.tick(6)
        assert not of(acts, Assign) and not of(acts, Finish)
        job.reg.heartbeat(launch.worker_id, 50.0)
        assert not of(job.tick(61), Finish)
        [finish] = of(job.tick(70), Finish)
        assert why(finish).startswith("timed out after 60 s (--elastic-timeout) waiting for 2 ready worker(s) (had 1: "
                                  "the others started did not ask for a place in time"), why(finish)

    def test_the_wait_promised_after_every_worker_is_lost_counts_from_then(self):
        """Two hosts reclaimed; the survivor waits for --min-np; 490 s later it is lost too. The
        line "waiting up to --elastic-timeout 600 s" must hold from then: it used to give up
        110 s later, at the end of the survivor's wait."""
        job = Job(np=3, min_np=2, elastic_timeout=600.0)
        job.start({"a": 1, "b": 1, "c": 1}, at=0)
        job.reg.durable(7)
        job.exit("w0", -9, at=10)
        job.exit("w1", -9, at=10)
        job.rdv("w2", at=10.5, has_state=True, restored=True)
        job.discover({"c": 1}, at=11)
        acts = job.exit("w2", -9, at=500)
        assert [text(e) for e in events(acts, "workers_lost")] == [
            "every worker is gone; waiting up to --elastic-timeout 600 s for --min-np 2 slots to resume from the "
            "durable copy of commit 7"]
        assert [e.fields["left_s"] for e in events(acts, "waiting_for_slots")] == [600.0]
        assert not of(job.tick(1099), Finish)
        [finish] = of(job.tick(1100.5), Finish)
        assert why(finish).startswith("timed out after 600 s (--elastic-timeout)")

    def test_a_copy_finished_after_every_worker_was_lost_is_named_once_it_is_whole(self):
        """Every worker lost while the copy of commit 9 was still being written: the line named
        commit 7, and the resume then used 9. The console says so when 9 is whole, and not for
        an older copy, nor once a round has formed."""
        job = Job(np=2, min_np=2, elastic_timeout=600.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.durable(7)
        job.exit("w0", -9, at=10)
        acts = job.exit("w1", -9, at=10)
        assert [text(e) for e in events(acts, "workers_lost")] == [
            "every worker is gone; waiting up to --elastic-timeout 600 s for --min-np 2 slots to resume from the "
            "durable copy of commit 7"]
        job.reg.durable(9)
        acts = job.tick(11)
        assert [text(e) for e in events(acts, "workers_lost")] == [
            "the durable copy of commit 9 is now whole: the job resumes from it, not from commit 7"]
        job.reg.durable(8)  # (never older in practice; nothing to say if it were)
        assert not events(job.tick(12), "workers_lost")

    def test_a_copy_written_while_workers_train_says_nothing_of_a_resume(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.durable(7)
        job.reg.durable(9)
        assert not events(job.tick(1), "workers_lost")

    def test_after_every_worker_is_lost_the_old_hosts_failing_again_do_not_end_the_wait(self):
        """Every host lost at once (SSH sessions dropped), discovery still listing them: they are
        let back and tried again, and fail again (the machines are gone). The job used to end at
        once, "every host is blacklisted", 570 s before the wait it had promised was over."""
        job = Job(np=2, min_np=1, elastic_timeout=600.0, start_timeout=30.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.durable(7)
        job.exit("w0", 255, at=10)
        acts = job.exit("w1", 255, at=10)
        assert events(acts, "workers_lost") and len(of(acts, Launch)) == 2
        job.exit("w2", 255, at=40)
        acts = job.tick(41)
        assert not of(acts, Finish) and job.hosts.all_blacklisted()
        acts = job.discover({"a": 1, "b": 1, "c": 1}, at=300)  # a new machine, within the wait
        assert [l.info.key for l in of(acts, Launch)] == [("c", 0)] and not of(acts, Finish)

    def test_every_worker_lost_without_a_copy_names_the_blacklisted_hosts_before_the_end(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1}, at=0)
        acts = job.exit("w0", -9, at=1) + job.exit("w1", -9, at=1)
        names = [text(e) for e in events(acts, "host_blacklisted")]
        assert names == ["host a blacklisted permanently", "host b blacklisted permanently"]
        assert acts.index(events(acts, "host_blacklisted")[-1]) < acts.index(of(acts, Finish)[0])

    def test_every_worker_failing_by_its_own_exception_fails_the_job(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.durable(7)
        job.failing("w0", "ValueError: bad batch", at=1)
        acts = job.failing("w1", "ValueError: bad batch", at=1)
        assert of(acts, Finish) and "all workers failed" in why(of(acts, Finish)[0])

    def test_without_a_durable_copy_losing_everything_fails_as_before(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1}, at=0)
        job.exit("w0", -9, at=1)
        assert "all workers failed" in why(of(job.exit("w1", -9, at=1), Finish)[0])

    def test_a_job_started_with_a_durable_copy_restores_it_in_round_0(self):
        job = Job(np=2)
        job.reg.durable(3)
        assigns = job.start({"a": 2})
        assert [(a.info.rank, a.restore) for a in assigns] == [(0, True), (1, False)]

    def test_a_resume_whose_rank_0_dies_before_the_sync_restores_again(self):
        """Rank 0 of the round that resumes from the copy loads it; the sync sends it to the
        others. Rank 0 killed before that sync left them with the script's initial state, yet
        they counted as holders: the next round restored nothing and said nothing, the job
        trained from step 0 and the copy rotation replaced the copy it had resumed from."""
        job = Job(np=2, min_np=1)
        job.reg.durable(2142)
        assigns = job.start({"a": 1, "b": 1})
        assert [(a.worker_id, a.restore) for a in assigns] == [("w0", True), ("w1", False)]
        assert job.reg.holders() == []  # nobody holds the copy before a sync
        job.exit("w0", -9, at=1)
        acts = job.rdv("w1", at=2, error="connection closed by peer")  # its sync failed: has_state=False
        assigns = of(acts, Assign)
        assert [(a.worker_id, a.info.rank, a.restore) for a in assigns] == [("w1", 0, True)], acts
        assert not events(acts, "state_lost")

    def test_a_resume_that_synced_holds_the_state_and_does_not_restore_again(self):
        job = Job(np=2, min_np=1)
        job.reg.durable(7)
        job.start({"a": 1, "b": 1})
        job.exit("w1", -9, at=1)
        assigns = of(job.rdv("w0", at=2, has_state=True, error="peer died"), Assign)
        assert [(a.worker_id, a.restore) for a in assigns] == [("w0", False)]

    def test_a_round_with_a_holder_does_not_restore(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.reg.durable(5)
        job.exit("w1", -9, at=1)
        assigns = of(job.rdv("w0", at=2), Assign)
        assert [a.restore for a in assigns] == [False]


class TestStragglers:
    """Issue 16: hosts that drag every step are named, and with --evict-stragglers moved out
    like a discovery removal (the next step, no rollback) and blacklisted with the cooldown."""

    def test_a_straggler_is_named_and_nothing_else_happens_without_the_flag(self):
        job = Job(np=4, min_np=2)
        job.start({"a": 1, "b": 1, "c": 1, "d": 1})
        acts = job.paces(slow={"c"})
        [said] = events(acts, "straggler")
        assert text(said) == ("host c is a straggler: 200 ms of compute per step against 10 ms (median of the "
                                "others) over the last 20 steps (--evict-stragglers would move it out)")
        assert said.level == "warning" and said.fields["action"] == "named" and said.fields["compute_ms"] == 200.0
        assert control(acts) == [] and not job.hosts.blacklisted()
        assert not events(job.paces(slow={"c"}), "straggler")  # said once

    def test_a_heartbeat_that_names_a_straggler_asks_for_a_decision(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.reg.decide(job.now)
        assert not job.reg.dirty
        job.reg.heartbeat("w0", 1.0, Pace(0, 20, 0.2, 0.19, 0.01))
        job.reg.heartbeat("w1", 1.0, Pace(0, 20, 0.2, 0.0, 0.2))
        assert job.reg.dirty
        job.reg.decide(1.0)
        job.reg.heartbeat("w1", 1.5, Pace(0, 20, 0.2, 0.0, 0.2))  # nothing new
        assert not job.reg.dirty

    def test_paces_of_an_old_round_or_while_aborted_name_nobody(self):
        job = Job(np=3, min_np=1)
        job.start({"a": 1, "b": 1, "c": 1})
        for wid, c in (("w0", 0.01), ("w1", 0.01), ("w2", 0.3)):
            job.reg.heartbeat(wid, 1.0, Pace(-1, 20, 0.31, 0.31 - c, c))
        assert not events(job.tick(1), "straggler")
        job.exit("w0", 1, at=2)  # the round is aborted
        for wid, c in (("w1", 0.01), ("w2", 0.3)):
            job.reg.heartbeat(wid, 2.5, Pace(0, 20, 0.31, 0.31 - c, c))
        assert not events(job.tick(3), "straggler")

    def test_evicted_at_the_next_step_without_a_rollback_and_blacklisted_with_the_cooldown(self):
        job = Job(np=4, min_np=2, cooldown=(30.0, 300.0), evict_stragglers=True)
        job.start({"a": 1, "b": 1, "c": 1, "d": 1})
        acts = job.paces(slow={"c"}, at=5)
        [said] = events(acts, "straggler")
        assert text(said).endswith("; evicting it (--evict-stragglers): its workers leave at their next commit, "
                                     "without a rollback") and said.fields["action"] == "evicted"
        [black] = events(acts, "host_blacklisted")
        assert text(black).startswith("host c blacklisted for ") and text(black).endswith(" s (a straggler)")
        assert of(acts, Notify) == [Notify(added=False, removed=True)] and not of(acts, AbortRound)
        acts = job.rdv_all(["w0", "w1", "w2", "w3"], at=6)  # the interrupt at the next commit
        assert [d.worker_id for d in of(acts, Dismiss)] == ["w2"]
        assigns = of(acts, Assign)
        assert ranks(assigns) == {("a", 0): ("w0", 0), ("b", 0): ("w1", 1), ("d", 0): ("w3", 2)}
        assert not any(a.must_sync or a.restore for a in assigns)  # a removal only: nothing to sync
        assert not events(job.exit("w2", 0, at=7), "worker_failed")
        # The cooldown ends: c is back, a new worker starts there and joins.
        acts = job.tick(job.hosts.next_expiry() + 0.1)
        assert events(acts, "host_whitelisted") and [l.info.key for l in of(acts, Launch)] == [("c", 0)]

    def test_evicting_the_host_of_rank_0_keeps_the_state(self):
        """The registry's hand-over rule: a survivor that holds the state becomes rank 0."""
        job = Job(np=3, min_np=1, evict_stragglers=True)
        job.start({"a": 1, "b": 1, "c": 1})
        acts = job.paces(slow={"a"})
        assert events(acts, "host_blacklisted") and of(acts, Notify)
        acts = job.rdv_all(["w0", "w1", "w2"], at=1)
        assigns = of(acts, Assign)
        assert ranks(assigns) == {("b", 0): ("w1", 0), ("c", 0): ("w2", 1)}
        assert not events(acts, "state_lost") and not any(a.restore for a in assigns)

    def test_never_below_min_np(self):
        job = Job(np=3, min_np=3, evict_stragglers=True)
        job.start({"a": 1, "b": 1, "c": 1})
        acts = job.paces(slow={"c"})
        [said] = events(acts, "straggler")
        assert text(said).endswith("; not evicted: without it 2 worker(s) would be left, fewer than --min-np 3")
        assert said.fields["action"] == "kept"
        assert control(acts) == [] and not job.hosts.blacklisted()

    def test_a_straggler_kept_for_min_np_goes_once_it_can(self):
        job = Job(np=3, min_np=3, max_np=4, evict_stragglers=True)
        job.start({"a": 1, "b": 1, "c": 1})
        job.paces(slow={"c"})
        launch = of(job.discover({"a": 1, "b": 1, "c": 1, "d": 1}, at=1), Launch)
        acts = job.rdv(launch[0].worker_id, at=2)  # the newcomer is ready: everyone re-forms
        assert of(acts, Notify)
        acts = job.rdv_all(["w0", "w1", "w2"], at=3)
        assert job.reg.round == 1 and len(of(acts, Assign)) == 4
        acts = job.paces(slow={"c"}, at=4)  # still slow in the new round: now it can go
        assert [e.fields["action"] for e in events(acts, "straggler")] == ["evicted"]
        assert of(acts, Notify) == [Notify(added=False, removed=True)]

    def test_two_hosts_eviction_must_pay(self):
        """With 2 hosts of one slot, evicting one halves the samples per step: at 1.6x it would
        not pay and the straggler is only named; at 20x it goes."""
        job = Job(np=2, min_np=1, evict_stragglers=True)
        job.start({"a": 1, "b": 1})
        acts = job.paces(slow={"b"}, compute=0.100, slow_compute=0.160)
        [said] = events(acts, "straggler")
        assert "against 100 ms (the other host)" in text(said)
        assert text(said).endswith("; not evicted: without it, 1 worker(s) at about 102 ms a step would train "
                                     "fewer samples per second than 2 at 162 ms")
        assert control(acts) == []
        job2 = Job(np=2, min_np=1, evict_stragglers=True)
        job2.start({"a": 1, "b": 1})
        assert of(job2.paces(slow={"b"}), Notify)

    def test_a_straggler_kept_because_it_did_not_pay_goes_once_it_drags_more(self):
        """Whether eviction pays is judged on the latest figures, not those it was named with."""
        job = Job(np=2, min_np=1, evict_stragglers=True)
        job.start({"a": 1, "b": 1})
        assert [e.fields["action"] for e in events(job.paces(slow={"b"}, compute=0.100, slow_compute=0.160),
                                                   "straggler")] == ["kept"]
        assert control(job.paces(slow={"b"}, compute=0.100, slow_compute=0.170, at=1)) == []  # still does not pay
        acts = job.paces(slow={"b"}, compute=0.100, slow_compute=0.400, at=2)
        [said] = events(acts, "straggler")
        assert said.fields["action"] == "evicted" and said.fields["compute_ms"] == 400.0
        assert "400 ms of compute per step against 100 ms (the other host)" in text(said)
        assert of(acts, Notify) == [Notify(added=False, removed=True)] and events(acts, "host_blacklisted")

    def test_paces_of_unknown_or_idle_workers_are_not_kept(self):
        """What the driver keeps is bounded by the round's members, whatever heartbeats say."""
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        for i in range(1000):
            job.reg.heartbeat(f"nobody-{i}", 1.0, Pace(0, 20, 0.2, 0.0, 0.2))
        assert job.reg.stragglers._paces == {} and not job.reg.dirty
        job.reg.heartbeat("w0", 1.0, Pace(0, 20, 0.2, 0.0, 0.2))
        job.reg.heartbeat("w0", 1.1, Pace(0, 20, 0.2, 0.0, 0.3))
        assert list(job.reg.stragglers._paces) == ["w0"]  # the latest pace only

    def test_a_permanent_blacklist_without_a_cooldown(self):
        job = Job(np=3, min_np=1, evict_stragglers=True)
        job.start({"a": 1, "b": 1, "c": 1})
        acts = job.paces(slow={"b"})
        assert [text(e) for e in events(acts, "host_blacklisted")] == ["host b blacklisted permanently (a straggler)"]


# --- what carries CUDA tensors ---------------------------------------------------------------------
class TestDeviceBackend:
    """The driver picks NCCL or gloo per round, the same for every member (a rank on NCCL and a
    peer on gloo would wait for each other forever)."""

    @pytest.mark.parametrize("requested, members, expected", [
        ("gloo", [("a", 0, ("G0",)), ("b", 0, ("G1",))], ("gloo", "--backend gloo")),
        ("auto", [("a", 0, ("G0",)), ("b", 0, ("G1",))], ("nccl", "one GPU per worker")),
        ("auto", [("a", 0, ("G0", "G1")), ("a", 1, ("G0", "G1"))], ("nccl", "one GPU per worker")),
        ("auto", [("a", 0, ("G0",)), ("a", 1, ("G0",))], ("gloo", "a[0] and a[1] would share one GPU")),
        # one machine playing two hosts: the same GPU, seen by both
        ("auto", [("localhost", 0, ("G0",)), ("127.0.0.1", 0, ("G0",))],
         ("gloo", "localhost[0] and 127.0.0.1[0] would share one GPU")),
        ("auto", [("a", 0, ("G0",)), ("b", 0, ())], ("gloo", "b[0] has no GPU NCCL can use")),
        ("nccl", [("a", 0, ("G0",)), ("b", 0, ())], (None, "b[0] has no GPU NCCL can use")),
        ("nccl", [("a", 0, ("G0",)), ("b", 0, ("G1",))], ("nccl", "--backend nccl")),
    ])
    def test_the_rule(self, requested, members, expected):
        from elasticrun.driver.registry import device_backend

        backend, why = device_backend(requested, members)
        assert (backend, words.reason(why)) == expected

    def test_every_member_is_told_the_same_and_the_console_hears_it_once(self):
        job = Job(np=2, min_np=1)
        launches = of(job.discover({"a": 1, "b": 1}), Launch)
        acts = job.rdv(launches[0].worker_id, gpus=("G0",)) + job.rdv(launches[1].worker_id, gpus=("G1",))
        assert {a.device_backend for a in of(acts, Assign)} == {"nccl"}
        [said] = events(acts, "device_backend")
        assert text(said) == "CUDA tensors go over NCCL in round 0 (one GPU per worker)"
        job.exit(launches[1].worker_id, 1, at=1)  # b fails; a rolls back and re-forms alone
        acts = job.rdv(launches[0].worker_id, at=2, gpus=("G0",))
        assert of(acts, Assign)[0].device_backend == "nccl" and not events(acts, "device_backend")

    def test_a_cpu_job_hears_nothing_about_devices(self):
        job = Job(np=2)
        acts = []
        for launch in of(job.discover({"a": 2}), Launch):
            acts += job.rdv(launch.worker_id)
        assert {a.device_backend for a in of(acts, Assign)} == {"gloo"} and not events(acts, "device_backend")

    def test_backend_nccl_that_cannot_run_ends_the_job_saying_why(self):
        job = Job(np=2, backend="nccl")
        acts = []
        for launch in of(job.discover({"a": 2}), Launch):
            acts += job.rdv(launch.worker_id, gpus=("G0",))
        [finish] = of(acts, Finish)
        assert not finish.ok and "--backend nccl cannot run round 0: a[0] and a[1] would share one GPU" in why(finish)
        assert not of(acts, Assign)


# --- plain commands -----------------------------------------------------------------------------
class TestPlainCommands:
    """Processes that never call hvd.init() (``bash -c ...``): run as horovodrun runs them."""

    def launch(self, job, hosts, at=0):
        return [l.worker_id for l in of(job.discover(hosts, at), Launch)]

    def test_every_process_runs_to_its_end_and_a_failure_fails_the_job(self):
        job = Job(np=2, start_timeout=30)
        w0, w1 = self.launch(job, {"a": 2})
        acts = job.exit(w0, 0, at=1)  # rank 0 is done: rank 1 is not stopped
        assert job.reg.plain and not of(acts, Kill) and not of(acts, Finish)
        acts = job.exit(w1, 3, at=3)
        [finish] = of(acts, Finish)
        assert not finish.ok and why(finish) == "rank 1 (a[1]) exited with code 3"
        assert not events(acts, "host_blacklisted")

    def test_a_failure_of_its_own_as_the_job_ends_is_named_and_a_stopped_process_is_not(self):
        job = Job(np=3, max_np=3, start_timeout=30, fixed_hosts=True)  # -np 3 -H a:3
        w0, w1, w2 = self.launch(job, {"a": 3})
        acts = job.exit(w1, 3, at=1)
        assert {k.worker_id for k in of(acts, Kill)} == {w0, w2}
        assert why(of(acts, Finish)[0]) == "rank 1 (a[1]) exited with code 3"
        acts = job.exit(w0, 3, at=1.01)  # its own failure, at the same moment
        assert [text(e) for e in events(acts, "worker_failed")] == ["a[0] (rank 0) exited with code 3"]
        assert why(job.reg.finished) == "rank 0 (a[0]) exited with code 3; rank 1 (a[1]) exited with code 3"
        job.exit(w2, -15, at=1.02)  # the stop's SIGTERM
        assert job.state(w2) is WorkerState.LEFT and job.state(w0) is WorkerState.FAILED
        assert why(job.reg.finished).count("exited with code") == 2

    @pytest.mark.parametrize("fixed,min_np,max_np,plain", [
        (True, None, 2, True),  # -np 2 -H a:1,b:1: a job that cannot change size
        (True, 1, 2, False),  # --min-np: elastic, the host is blacklisted and the job goes on
        (True, None, None, False),  # --max-np unbounded (elastic)
        (False, None, 2, False),  # hosts from discovery
    ])
    def test_an_early_failure_in_a_job_that_cannot_change_size_fails_it_at_once(self, fixed, min_np, max_np, plain):
        job = Job(np=2, min_np=min_np, max_np=max_np, start_timeout=30, fixed_hosts=fixed)
        w0, w1 = self.launch(job, {"a": 1, "b": 1})
        acts = job.exit(w1, 3, at=1)  # before any worker reached the driver
        assert job.reg.plain == plain
        if plain:
            assert Kill(w0, Reason(Cause.PEER_FAILED)) in acts and not events(acts, "host_blacklisted")
            [finish] = of(acts, Finish)
            assert not finish.ok and why(finish) == "rank 1 (b[0]) exited with code 3"
            return
        assert events(acts, "host_blacklisted")
        if fixed and min_np is None:  # --min-np 2 on a:1 alone: never again, once a's start is known
            assert not of(acts, Finish)
            [finish] = of(job.rdv(w0, at=2), Finish)
            assert finish.why.cause is Cause.NEVER_ENOUGH
        elif fixed:  # --min-np 1: round 0 starts with a alone, and says why
            assert not of(acts, Finish) and events(acts, "np_never")
        else:  # discovery may list more hosts: wait
            assert not of(acts, Finish) and not events(acts, "np_never")

    def test_a_fixed_list_short_for_good_names_a_leaving_host_and_advice_that_fits(self):
        """A reclaimed host (its worker SIGTERMed) on a fixed list never comes back: it is named
        as leaving, and a cooldown (for failed hosts) is not offered as the way out."""
        job = Job(np=2, start_timeout=30, fixed_hosts=True)
        w0, w1 = self.launch(job, {"a": 1, "b": 1})
        job.rdv_all([w0, w1], at=1)
        job.exit(w1, -15, at=2)  # a reclaim: the round rolls back, b is leaving
        acts = job.rdv(w0, at=3, has_state=True, restored=True)  # the survivor asks for the next round
        [finish] = of(acts, Finish)
        assert finish.why.cause is Cause.NEVER_ENOUGH
        assert "(blacklisted: none; leaving: b)" in why(finish) and "cooldown" not in why(finish), why(finish)

    @pytest.mark.parametrize("first", ["sigterm", "success"])
    def test_a_process_killed_by_sigterm_fails_the_job(self, first):
        """As under horovodrun, SIGTERM's exit too, also when it comes before anything tells
        the job is plain (an elastic job's worker would have left: its host is drained)."""
        job = Job(np=2, start_timeout=30)
        w0, w1 = self.launch(job, {"a": 1, "b": 1})
        if first == "sigterm":
            job.exit(w1, -15, at=1)
            acts = job.exit(w0, 0, at=2)
        else:
            job.exit(w0, 0, at=1)
            acts = job.exit(w1, -15, at=2)
        assert job.reg.plain
        [finish] = of(acts, Finish)
        assert not finish.ok and why(finish) == "rank 1 (b[0]) exited with code -15"

    def test_all_exit_0_is_success(self):
        job = Job(np=2)
        w0, w1 = self.launch(job, {"a": 2})
        job.exit(w0, 0, at=1)
        [finish] = of(job.exit(w1, 0, at=2), Finish)
        assert (finish.ok, why(finish)) == (True, "all 2 process(es) exited 0")

    def test_a_failure_stops_the_others(self):
        job = Job(np=3)
        w0, w1, w2 = self.launch(job, {"a": 3})
        job.exit(w0, 0, at=1)
        acts = job.exit(w1, 1, at=2)
        assert Kill(w2, Reason(Cause.PEER_FAILED)) in acts and not of(acts, Finish)[0].ok

    def test_outliving_the_start_timeout_is_no_failure_when_nobody_called_init(self):
        job = Job(np=2, start_timeout=5)
        w0, w1 = self.launch(job, {"a": 2})
        acts = job.tick(6)
        assert job.reg.plain and not of(acts, Kill) and events(acts, "plain_command")
        assert job.reg.next_deadline() is None  # nothing to time out: no busy decisions
        job.exit(w0, 0, at=40)
        assert of(job.exit(w1, 0, at=50), Finish)[0].ok

    def test_a_late_hvd_init_makes_the_job_elastic_again(self):
        job = Job(np=2, start_timeout=5)
        w0, w1 = self.launch(job, {"a": 2})
        job.tick(6)
        assert job.reg.plain
        acts = job.rdv(w0, at=7)  # a slow import, after all
        assert not job.reg.plain
        [said] = events(acts, "elastic_after_all")  # the console said otherwise: it takes that back
        assert said.fields["seconds"] == 7
        acts = job.rdv(w1, at=8)
        assert len(of(acts, Assign)) == 2

    def test_a_worker_that_calls_init_is_elastic_and_the_silent_one_times_out(self):
        job = Job(np=2, min_np=1, start_timeout=5)
        w0, w1 = self.launch(job, {"a": 1, "b": 1})
        job.rdv(w0, at=1)
        acts = job.tick(6)
        assert not job.reg.plain and Kill(w1, Reason(Cause.NEVER_CONTACTED, {"limit": 5.0})) in acts


# --- the lifecycle ---------------------------------------------------------------------------
class TestLifecycle:
    def test_a_gone_worker_never_moves_again(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1})
        job.exit("w1", 1, at=1)
        assert job.state("w1") is WorkerState.FAILED
        with pytest.raises(AssertionError, match="illegal_move"):
            _move(job.reg.workers["w1"], WorkerState.WAITING)
        assert job.state("w1") is WorkerState.FAILED

    def test_a_running_worker_is_not_released(self):
        job = Job(np=1)
        job.start({"a": 1})
        with pytest.raises(AssertionError, match="illegal_move"):
            _move(job.reg.workers["w0"], WorkerState.LEFT)

    def test_host_changes_go_unsaid_once_the_job_is_ending(self):
        """On Ray a node lists a worker's slot again only once Ray has freed it: the listings
        right after the workers' ends said "host removed" for a job that succeeded."""
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1}, at=0)
        job.exit("w0", 0, at=1)
        acts = job.discover({"a": 1}, at=2) + job.discover({"a": 1, "c": 2}, at=3)
        assert not [a for a in acts if isinstance(a, Event) and a.kind.startswith("host")], acts
        assert not of(acts, Launch)
        assert of(job.exit("w1", 0, at=4), Finish)[0].ok

    def test_the_table_is_the_documented_lifecycle(self):
        gone = {WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.LEFT}
        assert set(MOVES) == set(WorkerState)
        assert all(not MOVES[s] for s in gone)
        assert WorkerState.RUNNING in MOVES[WorkerState.WAITING] and WorkerState.RUNNING not in MOVES[WorkerState.LAUNCHING]


class TestForgetting:
    """A job that replaces workers for days keeps no record of each: every decision reads them
    all (with 10,000 records a reset's decisions took 15 ms more)."""

    @staticmethod
    def flap(job, times, start=1.0, every=1.0):
        """Host b leaves and comes back ``times`` times; the workers do at once what the driver
        asks (a notified or aborted member asks for the next round, a newcomer joins, a
        dismissed or killed one exits)."""
        at = start
        for _ in range(times):
            for hosts in ({"a": 1}, {"a": 1, "b": 1}):
                queue = job.discover(hosts, at=at)
                while queue:
                    act = queue.pop(0)
                    if isinstance(act, Launch):
                        queue += job.rdv(act.worker_id, at=at)
                    elif isinstance(act, (Kill, Dismiss)) and not job.reg.workers[act.worker_id].exited:
                        queue += job.exit(act.worker_id, 0 if isinstance(act, Dismiss) else -15, at=at)
                    elif isinstance(act, (Notify, AbortRound)):
                        for w in list(job.reg.workers.values()):
                            if w.state is WorkerState.RUNNING:
                                queue += job.rdv(w.id, at=at, has_state=True)
                at += every
        return at

    def test_a_worker_that_left_is_forgotten_a_minute_after_its_exit(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1}, at=0)
        at = self.flap(job, 1)
        assert job.state("w1") is WorkerState.LEFT and job.reg.workers["w1"].ended_at is not None
        gone = job.reg.workers["w1"].ended_at
        job.tick(gone + FORGET_AFTER - 1)
        assert "w1" in job.reg.workers
        job.tick(max(at, gone + 2 * FORGET_AFTER))  # (looked for once a minute)
        assert "w1" not in job.reg.workers  # forgotten; the members are not
        assert set(job.reg.members.values()) <= set(job.reg.workers) and "w0" in job.reg.workers
        job.reg.exited("w1", 1, job.now)  # a late word of it is nothing
        assert not of(job.tick(job.now + 1), Finish)

    def test_a_thousand_flaps_keep_a_minutes_records_and_the_same_decisions(self):
        job = Job(np=2, min_np=1)
        job.start({"a": 1, "b": 1}, at=0)
        self.flap(job, 1000)
        assert job.reg.reset_count >= 1999
        assert len(job.reg.workers) <= 2 + 2 * FORGET_AFTER  # at most two minutes' (one leaves a second)
        assert sorted(w.rank for w in job.reg.final_round()) == [0, 1]
        assert job.reg.final_round()[0].id == "w0"  # the survivor kept rank 0 throughout

    def test_a_failed_member_of_the_round_is_kept_and_named_when_the_job_ends(self):
        job = Job(np=2, min_np=2, elastic_timeout=1000.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.exit("w1", 1, at=1)
        job.exit("w0", 1, at=2)
        job.tick(200)  # long past FORGET_AFTER: the round's members are still its members
        assert {"w0", "w1"} <= set(job.reg.workers)

    def test_a_plain_jobs_records_are_all_kept(self):
        job = Job(np=2)
        job.discover({"a": 2}, at=0)
        job.exit("w0", 0, at=1)
        job.tick(1 + 2 * FORGET_AFTER)
        assert "w0" in job.reg.workers and job.reg.plain


# --- a driver behind its inbox -----------------------------------------------------------------
class TestBehindItsInbox:
    """Silence is judged on what the driver has read: heartbeats still queued are no hang."""

    def test_no_worker_is_hung_while_its_heartbeats_may_wait_in_the_queue(self):
        job = Job(np=2, min_np=1, heartbeat_timeout=5.0)
        job.start({"a": 1, "b": 1}, at=0)
        job.reg.heartbeat("w0", 1.0)
        job.reg.heartbeat("w1", 1.0)
        # 7 s later, but the driver last found its inbox empty at 2.0: nothing is known past it.
        acts = checked(job.reg.decide(8.0, heard_until=2.0))
        assert not of(acts, Kill) and job.state("w1") is WorkerState.RUNNING
        # The deadline moves by as much as the driver is behind, so it does not spin on it.
        assert job.reg.next_deadline() == 1.0 + 5.0 + 6.0
        # Caught up: the silence was real.
        acts = checked(job.reg.decide(8.0, heard_until=8.0))
        assert sorted(k.worker_id for k in of(acts, Kill)) == ["w0", "w1"]
        assert said_silent(acts) == 7.0

    def test_a_first_contact_waiting_in_the_queue_is_no_start_timeout(self):
        job = Job(np=2, start_timeout=30.0)
        job.discover({"a": 1, "b": 1}, at=0)
        job.rdv("w0", at=1)
        assert not of(checked(job.reg.decide(31.0, heard_until=29.0)), Kill)
        acts = checked(job.reg.decide(31.0, heard_until=31.0))
        assert [(k.worker_id, k.why.cause) for k in of(acts, Kill)] == [("w1", Cause.NEVER_CONTACTED)]


def said_silent(acts):
    return {k.why.fields["silent_s"] for k in of(acts, Kill)}.pop()


# --- a decision reads; only _apply changes the registry ----------------------------------------
def _fingerprint(reg):
    """Everything a decision could change, as text."""
    return repr((sorted((k, repr(w)) for k, w in reg.workers.items()), reg.round, sorted(reg.members.items()),
                 reg.aborted, reg.abort_reason, reg.reset_count, reg.finished, reg._notified_target,
                 reg._wait_started, reg._wait_reminder, sorted(reg._said), reg._device_said, reg.plain,
                 repr(reg.hosts), repr(vars(reg.stragglers))))


def _read_only(reg, now):
    """Run a decision without applying its steps (answers as if nothing changed); its steps."""
    decision, steps, answer = reg._decision(now, now), [], None
    try:
        while True:
            step = decision.send(answer)
            steps.append(step)
            answer = (HostChange() if isinstance(step, Refresh) else ([], []) if isinstance(step, JudgeStragglers)
                      else None if isinstance(step, Blacklist) else None)
    except StopIteration:
        return steps


class TestDecisionsOnlyRead:
    """``decide`` = a decision that reads the registry and yields steps + ``_apply``, the one
    place they change it. Run alone, a decision leaves the registry as it found it."""

    def situations(self):
        forming = Job(np=2)
        forming.discover({"a": 1, "b": 1}, at=0)
        forming.rdv("w0", at=1)
        forming.rdv("w1", at=1)  # (decided: round 0 formed)
        forming.reg.rendezvous("w0", 2.0, error="boom")  # recorded, not yet decided
        yield "an error to abort for", forming, 2.0
        silent = Job(np=2, min_np=1, heartbeat_timeout=5.0)
        silent.start({"a": 1, "b": 1}, at=0)
        silent.reg.heartbeat("w0", 9.0)
        yield "a worker silent past --heartbeat-timeout", silent, 10.0
        starting = Job(np=4)
        starting.reg.discovered({"a": 2, "b": 2}, 0.0)
        yield "round 0 to launch", starting, 0.0
        waiting = Job(np=2, min_np=2)
        waiting.start({"a": 1, "b": 1}, at=0)
        waiting.reg.discovered({"a": 1}, 1.0)
        yield "a host removed below --min-np", waiting, 1.0
        ending = Job(np=2)
        ending.start({"a": 1, "b": 1}, at=0)
        ending.reg.exited("w0", 0, 1.0)
        ending.reg.exited("w1", 0, 1.0)
        yield "every rank finished", ending, 1.0

    def test_a_decision_alone_changes_nothing(self):
        for what, job, now in self.situations():
            before = _fingerprint(job.reg)
            steps = _read_only(job.reg, now)
            assert steps, what
            assert _fingerprint(job.reg) == before, what

    def test_applied_it_is_the_decision_the_driver_gets(self):
        for what, job, now in self.situations():
            acts = checked(job.reg.decide(now))
            assert acts and all(not isinstance(a, (Move, Record, NewRound, Mark)) for a in acts), what

