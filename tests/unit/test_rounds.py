"""Round: the context the collectives take (group, abort check, timeout, first step), and the
polled wait of the collectives against it, with fake work objects (no gloo world needed)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from elasticrun.worker import issuing, rounds, waiting
from elasticrun.worker.exceptions import CollectiveTimeout, HorovodInternalError
from elasticrun.worker.host_updates import HostUpdates
from elasticrun.worker.rounds import Round

pytestmark = pytest.mark.timeout(30)


def make_round(number: int = 3, aborted: dict[int, str] | None = None, timeout: float = 5.0,
               events: list[tuple[str, dict[str, Any]]] | None = None, pg: Any = None) -> Round:
    log = events if events is not None else []
    return Round(number, 1, 4, collective_timeout=timeout, host_updates=HostUpdates(),
                 aborted=aborted if aborted is not None else {}, emit=lambda kind, **f: log.append((kind, f)), pg=pg)


def two_rank_gloo(timeout: float) -> dict[int, Any]:
    """A real two-rank gloo group in this process (one thread forms each rank): rank 0's
    collectives wait for a rank 1 that only joins when the test says so."""
    import torch.distributed as dist

    store = dist.HashStore()
    groups: dict[int, Any] = {}
    threads = [threading.Thread(target=lambda k=k: groups.__setitem__(
        k, dist.ProcessGroupGloo(store, k, 2, rounds.group_timeout(timeout)))) for k in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert set(groups) == {0, 1}, "the two-rank gloo group did not form"
    return groups


class Work:
    """A collective in flight: completes after ``after`` seconds, or raises at wait()."""

    def __init__(self, after: float = 0.0, error: Exception | None = None) -> None:
        self.done_at = time.monotonic() + after
        self.error = error
        self.waited = False

    def is_completed(self) -> bool:
        return time.monotonic() >= self.done_at

    def wait(self) -> None:
        self.waited = True
        if self.error is not None:
            raise self.error


def test_first_step_is_reported_once_after_a_reset() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    r = make_round(events=events)
    waiting.wait(r, Work(), "allreduce x")
    assert events == []  # no reset: nothing to report
    r.mark_reset()
    waiting.wait(r, Work(0.002), "allreduce y")
    waiting.wait(r, Work(), "allreduce z")
    assert events == [("first_step", {"what": "allreduce y"})]
    assert not r.awaiting_first_step


def test_an_aborted_round_abandons_the_wait_at_once() -> None:
    aborted: dict[int, str] = {}
    r = make_round(7, aborted, timeout=20)
    threading.Timer(0.05, aborted.__setitem__, (7, "rank 2 died")).start()
    started = time.monotonic()
    with pytest.raises(HorovodInternalError, match=r"allreduce x abandoned: round 7 was aborted \(rank 2 died\)"):
        waiting.wait(r, Work(60), "allreduce x")
    assert time.monotonic() - started < 5
    aborted[6] = "an older round"
    assert make_round(8, aborted).abort_reason() is None


def test_a_slow_collective_times_out() -> None:
    r = make_round(timeout=0.05)
    with pytest.raises(CollectiveTimeout, match=r"within the collective timeout \(0.05 s\)"):
        waiting.wait(r, Work(60), "broadcast b")


@pytest.mark.parametrize("environ, timeout, expected", [
    ({}, 1800, rounds.StallCheck(60.0, None)),  # Horovod's default: a warning after 60 s, no shutdown
    ({}, 30, rounds.StallCheck(15.0, None)),  # a short collective timeout: half of it
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "120"}, 1800, rounds.StallCheck(120.0, None)),
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "10", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "20"}, 1800,
     rounds.StallCheck(10.0, 20.0)),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "300"}, 1800, rounds.StallCheck(60.0, 300.0)),
    # Horovod's rule: a shutdown time below the warning time never shuts down; 0 is "never"
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "10", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "5"}, 1800,
     rounds.StallCheck(10.0, None)),
    ({"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "0"}, 1800, rounds.StallCheck(60.0, None)),
    # disabled: neither warning nor shutdown, whatever else is set
    ({"HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "300"}, 1800,
     rounds.StallCheck(None, None)),
    ({"HOROVOD_STALL_CHECK_DISABLE": "0"}, 1800, rounds.StallCheck(60.0, None)),
    # Horovod's 0 would warn at every wait; what is not a number leaves the default
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "0"}, 1800, rounds.StallCheck(1.0, None)),
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "soon", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "-5"}, 1800,
     rounds.StallCheck(60.0, None)),
    ({"HOROVOD_STALL_CHECK_TIME_SECONDS": "nan"}, 1800, rounds.StallCheck(60.0, None)),
])
def test_the_stall_check_follows_horovods_variables(environ: dict[str, str], timeout: float,
                                                   expected: rounds.StallCheck) -> None:
    assert rounds.stall_check(environ, timeout) == expected


def test_a_stalled_collective_warns_then_gives_up_at_the_stall_shutdown_time(
        caplog: pytest.LogCaptureFixture) -> None:
    r = Round(3, 1, 4, collective_timeout=20, host_updates=HostUpdates(), aborted={}, emit=lambda *a, **f: None,
              stall=rounds.StallCheck(0.05, 0.3))
    started = time.monotonic()
    with caplog.at_level("WARNING", logger="elasticrun.worker"), \
            pytest.raises(CollectiveTimeout, match=r"allreduce x waited 0.3 s for the other ranks, the stall "
                                                   r"check's shutdown time \(--stall-check-shutdown-time-seconds"):
        waiting.wait(r, Work(60), "allreduce x")
    assert 0.3 <= time.monotonic() - started < 5  # not the collective timeout's 20 s
    warned = [m for m in caplog.messages if "has waited" in m]
    assert len(warned) == 1 and "waiting up to --stall-check-shutdown-time-seconds 0.3 s" in warned[0], warned


def test_a_disabled_stall_check_says_nothing_and_waits_out_the_collective_timeout(
        caplog: pytest.LogCaptureFixture) -> None:
    r = Round(3, 1, 4, collective_timeout=0.3, host_updates=HostUpdates(), aborted={}, emit=lambda *a, **f: None,
              stall=rounds.StallCheck(None, None))
    with caplog.at_level("WARNING", logger="elasticrun.worker"), \
            pytest.raises(CollectiveTimeout, match=r"within the collective timeout \(0.3 s\)"):
        waiting.wait(r, Work(60), "broadcast b")
    assert not [m for m in caplog.messages if "has waited" in m]
    default = make_round(timeout=0.3)  # without a word from the job: half the collective timeout
    with caplog.at_level("WARNING", logger="elasticrun.worker"), pytest.raises(CollectiveTimeout):
        waiting.wait(default, Work(60), "broadcast c")
    assert [m for m in caplog.messages if "broadcast c has waited" in m]


def test_a_failed_collective_is_an_internal_error() -> None:
    events: list[tuple[str, dict[str, Any]]] = []
    r = make_round(events=events)
    r.mark_reset()
    with pytest.raises(HorovodInternalError, match="allgather g failed: connection reset"):
        waiting.wait(r, Work(error=RuntimeError("connection reset")), "allgather g")
    assert events == [] and r.awaiting_first_step  # a failure is not the first step


def test_a_work_that_gloo_timed_out_is_this_ranks_timeout() -> None:
    # gloo's words for its own timeout: only this rank knows, so it must tell the driver
    # (CollectiveTimeout), unlike a peer's death (above), which the driver sees itself.
    r = make_round(timeout=2)
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation "
                        "to complete")
    with pytest.raises(CollectiveTimeout, match=r"allreduce a did not complete within the collective timeout "
                                                r"\(2 s\); a peer is hung or unreachable \(.*Timed out waiting"):
        waiting.wait(r, Work(error=gloo), "allreduce a")


def test_a_rounds_gloo_group_times_out_after_the_wait_loop_does() -> None:
    """Real gloo, two ranks in this process, rank 1 never joins the allreduce: the wait loop
    gives up first, with its own words, whatever the machine's load (the group's timeout
    trails it by at least a second)."""
    import torch

    assert rounds.group_timeout(2.0).total_seconds() == 3.0
    assert rounds.group_timeout(60.0).total_seconds() == 66.0
    groups = two_rank_gloo(0.2)
    r = make_round(timeout=0.2, pg=groups[0])
    work = groups[0].allreduce([torch.ones(4)])
    started = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"allreduce x did not complete within the collective timeout "
                                                r"\(0.2 s\); a peer is hung or unreachable$"):
        waiting.wait(r, work, "allreduce x")
    assert time.monotonic() - started < 1.0
    try:  # gloo's own timeout follows a second later (the work left running fails then)
        work.wait()
    except Exception:
        pass


def test_issue_needs_a_group_and_a_live_round() -> None:
    with pytest.raises(HorovodInternalError, match="no process group"):
        issuing.issue(make_round(), lambda pg: pg, "x")
    aborted = {3: "driver said so"}
    with pytest.raises(HorovodInternalError, match="round 3 was aborted: driver said so"):
        issuing.issue(make_round(3, aborted, pg=object()), lambda pg: pg, "x")
    group = object()
    assert issuing.issue(make_round(pg=group), lambda pg: pg, "x") is group

    def broken(pg: Any) -> Any:
        raise ValueError("bad tensor")

    with pytest.raises(HorovodInternalError, match="x failed to start: bad tensor"):
        issuing.issue(make_round(pg=group), broken, "x")


def test_current_round() -> None:
    before = rounds._current
    try:
        rounds.uninstall()
        with pytest.raises(ValueError, match="call hvd.init"):
            rounds.current()
        a, b = make_round(1), make_round(2)
        rounds.install(a)
        assert rounds.current() is a
        rounds.uninstall(b)  # not the current one: no effect
        assert rounds.current() is a
        rounds.install(b)
        rounds.uninstall(b)
        with pytest.raises(ValueError):
            rounds.current()
    finally:
        rounds._current = before


def test_the_runtime_installs_a_round_per_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from elasticrun.worker import runtime

    for name in list(os.environ):
        if name.startswith("ELASTICRUN_"):
            monkeypatch.delenv(name)
    runtime.shutdown()
    rt = runtime.init()
    try:
        first = rt.current_round
        assert rounds.current() is first and (rt.round, rt.rank, rt.size) == (0, 0, 1) and rt.pg is first.pg
        assert first.host_updates is rt.host_updates
        second = rt.enter_round(1, 0, 1, first.pg)
        assert rounds.current() is second is rt.current_round and rt.round == 1
        rt._aborted[1] = "test"
        assert second.abort_reason() == rt.abort_reason() == "test" and first.abort_reason() is None
    finally:
        runtime.shutdown()
    with pytest.raises(ValueError, match="call hvd.init"):
        rounds.current()


def _alone(monkeypatch: pytest.MonkeyPatch) -> Any:
    import os

    from elasticrun.worker import runtime

    for name in list(os.environ):
        if name.startswith("ELASTICRUN_"):
            monkeypatch.delenv(name)
    runtime.shutdown()
    return runtime.init()


def test_a_world_of_one_agrees_and_broadcasts_without_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sync's collectives in a round of one rank need no group (none is given here), yet
    still end a reset and still fail on an aborted round."""
    import torch

    from elasticrun.worker import broadcast, reductions, runtime

    rt = _alone(monkeypatch)
    try:
        r = rt.enter_round(1, 0, 1, pg=None)
        t = torch.tensor([3, 7])
        reductions.allreduce_inplace(t, torch.distributed.ReduceOp.MAX, "state.newest_commit")
        obj = {"step": 4}
        assert t.tolist() == [3, 7] and broadcast.broadcast_object(obj, 0, trusted=True) is obj
        events: list[tuple[str, dict[str, Any]]] = []
        r._emit = lambda kind, **f: events.append((kind, f))
        r.mark_reset()
        reductions.allreduce_inplace(t, torch.distributed.ReduceOp.SUM, "check_host_updates")
        assert events == [("first_step", {"what": "check_host_updates"})]
        rt._aborted[1] = "127.0.0.1[0] exited with code -9"
        with pytest.raises(HorovodInternalError, match="round 1 was aborted"):
            reductions.allreduce_inplace(t, torch.distributed.ReduceOp.MAX, "state.newest_commit")
        with pytest.raises(HorovodInternalError, match="round 1 was aborted"):
            broadcast.broadcast_object(obj, 0, trusted=True)
    finally:
        runtime.shutdown()


def test_a_worker_alone_again_keeps_its_group_and_gets_a_new_store(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from elasticrun.worker import runtime

    rt = _alone(monkeypatch)
    try:
        rt._client = object()  # (a world of one never talks to the driver to form its group)
        rt.enter_round(5, 0, 1)
        rt._form_group()
        first = rt.current_round
        rt.enter_round(6, 0, 1)
        rt._form_group()
        second = rt.current_round
        assert second.pg is first.pg is not None and second.store is not first.store
        assert not any(first.pg in (h[0] if h else ()) for _t, h in runtime._pending_drops)  # not torn down
        t = torch.ones(2)
        second.pg.allreduce([t]).wait()
        assert t.tolist() == [1.0, 1.0]
    finally:
        rt._client = None
        runtime.shutdown()


class Flag:
    """A work whose completion the test sets."""

    def __init__(self, done: bool = False) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done


class Broken:
    def is_completed(self) -> bool:
        raise RuntimeError("the work's group is gone")


def test_a_round_holds_every_work_until_it_completes_and_lets_go_of_completed_ones():
    r = make_round()
    first, second, third = Flag(), Flag(), Flag()
    for w in (first, second, third):
        r.track(w)
    assert list(r.works) == [first, second, third]
    second.done = True
    middle = Flag()
    r.track(middle)  # the first still runs: nothing is looked at past it
    assert list(r.works) == [first, second, third, middle]
    first.done = True
    fourth = Flag()
    r.track(fourth)  # completed ones at the front go
    assert list(r.works) == [third, middle, fourth]


def test_past_the_bound_a_round_forgets_every_completed_work_not_only_those_in_front():
    r = make_round()
    stuck = Flag()
    r.track(stuck)
    done = [Flag(True) for _ in range(rounds._HELD)]
    for w in done:
        r.track(w)
    assert list(r.works) == [stuck]  # the 65th held work made it look past the stuck one
    assert len(r.works) <= rounds._HELD


def test_at_a_rounds_end_the_works_still_running_are_handed_over_and_the_round_holds_none():
    r = make_round()
    running, finished, broken = Flag(), Flag(True), Broken()
    for w in (running, finished, broken):
        r.works.append(w)
    assert r.unfinished() == [running]  # a work that cannot say whether it ended has ended
    assert list(r.works) == []
    assert rounds.completed(broken) and not rounds.completed(running)


def test_issue_holds_the_work_it_started():
    r = make_round(pg=object())
    work = Flag()
    assert issuing.issue(r, lambda pg: work, "op") is work
    assert list(r.works) == [work]


def test_gloos_peer_errors_are_worded_without_its_source_file_and_advice():
    """A rank's line quoted gloo whole: its source path, its advice and "GLHF! 🏖️"."""
    from elasticrun.worker.waiting import peer_words

    gloo = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
                        "peer [127.0.0.1]:33460. This is typically caused by a remote worker crashing. Check the logs "
                        "of the remote worker before reporting an error. GLHF! \U0001f3d6\ufe0f")
    assert peer_words(gloo) == ("Connection closed by peer [127.0.0.1]:33460 (that rank's process ended or lost the "
                                "network: the driver's log says which)")
    assert peer_words(RuntimeError("[pair.cc:537] Read error [127.0.0.1]:6577: Connection reset by peer. This is "
                                   "typically caused by a remote worker hanging")).startswith(
        "Read error [127.0.0.1]:6577: Connection reset by peer (that rank's")
    assert peer_words(RuntimeError("Timed out waiting 5000ms")) == "Timed out waiting 5000ms"


def test_a_wait_that_is_long_as_a_rule_sleeps_through_its_first_slices_and_a_short_one_does_not() -> None:
    """A large bucket's wait (tens of ms where ranks share cores) is not woken every millisecond
    to look for an abort: it first sleeps up to twice what it took last time (at most 25 ms),
    then slices as a short wait does from its start: 1 ms, growing to 4 ms."""
    assert waiting.first_slice(0.0) == waiting.first_slice(0.004) == waiting.first_slice(0.0099) == 0.0
    assert waiting.first_slice(0.010) == pytest.approx(0.020)
    assert waiting.first_slice(0.012) == pytest.approx(0.024)
    assert waiting.first_slice(0.5) == waiting.first_slice(60.0) == pytest.approx(0.025)
    ms = lambda waited, first: waiting.next_slice(waited, first).total_seconds() * 1000  # noqa: E731
    assert [ms(w, 0.0) for w in (0.0, 0.0039, 0.004, 0.008, 0.012, 5.0)] == [1, 1, 2, 3, 4, 4]
    assert ms(0.0, 0.024) == pytest.approx(24) and ms(0.02, 0.024) == pytest.approx(4)
    assert ms(0.0238, 0.024) == 1  # never under a millisecond: gloo's wait takes whole ones
    assert [ms(0.024 + w, 0.024) for w in (0.0, 0.004, 0.008, 0.012)] == [1, 2, 3, 4]


def test_what_waits_took_is_learnt_by_name_and_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waiting, "_USUAL", {})
    monkeypatch.setattr(waiting, "_USUAL_MAX", 3)
    r = make_round()
    waiting.wait(r, Work(0.012), "allreduce (0,)")  # a completed wait is learnt under its name
    assert 0.012 <= waiting._USUAL["allreduce (0,)"] < 5
    for k in range(5):
        waiting.learn(f"allreduce ({k},)", 0.02)
    assert set(waiting._USUAL) == {"allreduce (0,)", "allreduce (1,)", "allreduce (2,)"}
    waiting.learn("allreduce (1,)", 0.001)  # a name already known is still updated
    assert waiting._USUAL["allreduce (1,)"] == 0.001
    waiting.wait(r, Work(0.001), "allreduce (9,)")  # a wait of a name past the bound is not learnt
    assert "allreduce (9,)" not in waiting._USUAL


def test_an_abort_during_a_long_waits_first_slice_is_seen_when_it_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real gloo, two ranks in this process, rank 1 never joins: the name's last wait took 0.2 s,
    so this one sleeps 25 ms before it looks; an abort 5 ms in is seen then, not at the timeout."""
    import torch

    groups = two_rank_gloo(20.0)
    monkeypatch.setattr(waiting, "_USUAL", {"allreduce bucket": 0.2})
    aborted: dict[int, str] = {}
    r = make_round(7, aborted, timeout=20, pg=groups[0])
    work = groups[0].allreduce([torch.ones(4)])
    threading.Timer(0.005, aborted.__setitem__, (7, "rank 1 died")).start()
    started = time.monotonic()
    with pytest.raises(HorovodInternalError, match=r"allreduce bucket abandoned: round 7 was aborted \(rank 1 died\)"):
        waiting.wait(r, work, "allreduce bucket")
    took = time.monotonic() - started
    assert 0.02 <= took < 2.0, took  # at the first slice's end (25 ms), not at once and not at the timeout
    assert waiting._USUAL["allreduce bucket"] == 0.2  # an abandoned wait teaches nothing
    groups[1].allreduce([torch.ones(4)]).wait()  # rank 1 joins at last: the work left running ends
    work.wait()
