"""How a worker waits for a collective it issued, and the handles of those in flight.

A blocked gloo collective cannot be interrupted (gloo's abort() does not unblock it), so every
collective is issued asynchronously (``issuing.py``) and waited on here, by polling: a
worker gives up the moment the driver says the round is dead, or when the collective timeout
passes, with :class:`HorovodInternalError`, never a hang. While it waits it also looks whether a
peer called ``join()`` (``worker/join.py``) and, if so, publishes the descriptors of the
operations that peer must take part in.
"""

from __future__ import annotations

import logging
import math
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elasticrun.worker import rounds, trace
from elasticrun.worker.descriptors import Op
from elasticrun.worker.exceptions import CollectiveTimeout, HorovodInternalError
from elasticrun.worker.rounds import Round

__all__ = ["DONE", "Done", "Handle", "Polled", "Works", "first_slice", "handle", "join_key", "learn", "look_for_join",
           "next_slice", "poll", "publish", "solo", "synchronize", "traced", "wait"]

_POLL = 0.0001
_SLOW_POLL = 0.001
_SLOW_AFTER = 0.05
# A gloo work is waited on in slices instead (a blocking wait with a timeout, woken as soon as
# it completes): no sleep overshoot on short collectives, and the abort and join checks still
# run at least every slice. A slice that ends early raises "timed out" and leaves the work
# running; a real failure shows as a completed work whose wait() raises (below). A slice
# costs its exception (tens of us): they grow with the wait, a quarter of it, from 1 to 4 ms,
# so that a long allreduce is not a stream of them (measured: 4 ranks on 2 cores, 1 ms slices
# throughout cost 3 to 5 % of a training step), while an abort is still seen within a quarter
# of the time waited.
_SLICES = tuple(timedelta(milliseconds=ms) for ms in (1, 2, 3, 4))
# Each slice that ends wakes the thread, though, and with more ranks than cores a wake takes a
# core from a rank that computes: a large gradient bucket waited on for ~18 ms (4 ranks on 2
# cores) woke ~6 times, and that cost 3-4 % of a step against DDP, which waits without waking
# (benchmarks/README.md, "Wait slices"). So a wait that took _LONG or more the last time it ran
# (by its name: a bucket is the same bucket every step) first sleeps up to twice that, at most
# _LONG_FIRST, and only past it is sliced as above. The cost is seeing an abort up to that much
# later in such a wait when its collective does not fail by itself (a dead peer's collective fails
# as its sockets close); short waits, the ones a small model's recovery races, keep their slices.
_LONG = 0.010
_LONG_FIRST = 0.025
_USUAL: dict[str, float] = {}  # what -> the seconds its last completed wait took
_USUAL_MAX = 4096  # names made up per call (a user's shape-named tensors) stop being learnt there
# A collective waiting this long looks (on the round's store) whether a peer called join()
# and now waits for descriptors; then again after as long as it has waited, at most 0.2 s.
_JOIN_CHECK = 0.01
_JOIN_CHECK_MAX = 0.2
#: A collective still waiting after its stall warning (``Round.stall``: Horovod's stall check)
#: says so again every STALL_REPEAT s: a rank busy outside collectives holds every other, and
#: that should not be silent, nor fill the log.
STALL_REPEAT = 300.0

log = logging.getLogger("elasticrun.worker")


def wait(r: Round, work: Any, what: str) -> None:
    """Wait for ``work``; give up when round ``r`` is aborted or the collective timeout passes."""
    start = time.monotonic()
    deadline = start + r.collective_timeout
    check = start + _JOIN_CHECK
    stall = start + r.stall.warning if r.stall.warning is not None else math.inf
    if r.stall.shutdown is not None and r.stall.shutdown < r.collective_timeout:
        deadline = start + r.stall.shutdown
    # A NCCL work's is_completed() takes its communicator's lock, which an abort (NCCL's takes
    # about a second) holds throughout: the abort is looked for first, so that the training
    # thread hears it at once instead of after the abort.
    polled = isinstance(work, Polled) or (isinstance(work, Works) and any(isinstance(w, Polled) for w in work.works))
    r.waiting_in = what
    r.waiting_since = start  # read by the heartbeat (worker/runtime.py): who waits, who is outside
    try:
        _wait(r, work, what, start, deadline, check, stall, polled)
    finally:
        r.waiting_since = None
    if r.awaiting_first_step:  # the first collective after a reset: training moves again
        r.step_completed(what)


def _wait(r: Round, work: Any, what: str, start: float, deadline: float, check: float, stall: float,
          polled: bool) -> None:
    first = first_slice(_USUAL.get(what, 0.0))
    while not ((not polled or not r.abort_reason()) and work.is_completed()):
        reason = r.abort_reason()
        if reason:
            raise HorovodInternalError(f"{what} abandoned: round {r.number} was aborted ({reason})")
        now = time.monotonic()
        if now > deadline:
            raise _timeout(r, what, stalled=now - start)
        if now > check:
            check = now + min(_JOIN_CHECK_MAX, now - start)
            look_for_join(r)
            if now > stall:
                stall = now + STALL_REPEAT
                _stalled(r, what, now - start)
        target = work.pending() if isinstance(work, Works) else work
        if isinstance(target, dist.Work):
            try:
                target.wait(next_slice(now - start, first))
            except Exception:  # the slice ended (or the work failed: is_completed() says so)
                pass
        else:
            time.sleep(_POLL if now - start < _SLOW_AFTER else _SLOW_POLL)
    learn(what, time.monotonic() - start)
    try:
        work.wait()
    except Exception as exc:  # gloo reports a dead peer as RuntimeError / DistBackendError
        if _timed_out(exc):
            # The group's own timeout (rounds.group_timeout) runs past ours, so this is rare
            # (this thread held up past both): still only this rank knows, so it must say so.
            raise _timeout(r, what, f" ({exc})") from exc
        raise HorovodInternalError(f"{what} failed: {peer_words(exc)}") from exc


def first_slice(usual: float) -> float:
    """Seconds a wait sleeps before its first look for an abort, given how long the last wait of
    the same name took: none for a short one, twice that (at most _LONG_FIRST) for a long one."""
    return min(_LONG_FIRST, 2 * usual) if usual >= _LONG else 0.0


def next_slice(waited: float, first: float) -> timedelta:
    """The next slice of a wait that has waited ``waited`` s: the rest of its first slice (at
    least 1 ms: gloo takes whole milliseconds, and 0 would not be a slice), then 1 to 4 ms
    growing with the time waited past it."""
    if waited < first:
        return timedelta(seconds=max(0.001, first - waited))
    return _SLICES[min(3, int((waited - first) * 250))]


def learn(what: str, seconds: float) -> None:
    """Remember how long a completed wait of this name took (bounded: _USUAL_MAX names)."""
    if what in _USUAL or len(_USUAL) < _USUAL_MAX:
        _USUAL[what] = seconds


def peer_words(exc: BaseException) -> str:
    """gloo's error as a user reads it: without its source file and its advice (``[.../pair.cc:553]
    Connection closed by peer [127.0.0.1]:33460. This is typically caused by a remote worker
    crashing. ... GLHF!``): the peer that closed, and that the driver's log names the cause."""
    text = str(exc).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    cut = text.find(" This is typically caused by")
    if cut >= 0:
        text = text[:cut].rstrip(".") + " (that rank's process ended or lost the network: the driver's log says which)"
    return text[:500]


def gives_up(r: Round) -> str:
    """What ends a wait in round ``r`` that nothing else ends, as the flag that set it: the stall
    shutdown when it comes first, else the collective timeout. The heartbeat carries it once
    stalled, so the driver's line names the limit the workers keep, not the one it assumes."""
    shutdown = r.stall.shutdown
    if shutdown is not None and shutdown < r.collective_timeout:
        return f"--stall-check-shutdown-time-seconds {shutdown:g}"
    return f"--collective-timeout {r.collective_timeout:g}"


def _stalled(r: Round, what: str, waited: float) -> None:
    log.warning("rank %d: %s has waited %.0f s for the other ranks: one of them is busy outside collectives "
                "(evaluating or saving alone?), in another collective (the driver's line says which) or stuck; "
                "waiting up to %s s", r.rank, what, waited, gives_up(r))


def solo(r: Round, what: str) -> None:
    """An operation a world of one completes without its group (nothing to send, nothing to
    wait for): it still fails on an aborted round and still ends a reset, as a collective would."""
    reason = r.abort_reason()
    if reason:
        raise HorovodInternalError(f"round {r.number} was aborted: {reason}")
    if r.awaiting_first_step:
        r.step_completed(what)


def _timeout(r: Round, what: str, detail: str = "", stalled: float = 0.0) -> CollectiveTimeout:
    shutdown = r.stall.shutdown
    if shutdown is not None and shutdown < r.collective_timeout and stalled >= shutdown:
        return CollectiveTimeout(f"{what} waited {shutdown:g} s for the other ranks, the stall check's shutdown "
                                 f"time (--stall-check-shutdown-time-seconds, HOROVOD_STALL_SHUTDOWN_TIME_SECONDS): "
                                 f"a peer is busy outside collectives, hung or unreachable")
    return CollectiveTimeout(f"{what} did not complete within the collective timeout ({r.collective_timeout:g} s); "
                             f"a peer is hung or unreachable{detail}")


def _timed_out(exc: BaseException) -> bool:
    """Whether a failed work failed on gloo's own timeout ("Timed out waiting 2000ms for recv
    operation to complete"), not on a peer's death ("Connection closed by peer")."""
    return "timed out" in str(exc).lower()


def join_key(name: str) -> str:
    """A key of the round's store used by join() (namespaced away from gloo's own keys)."""
    return f"elasticrun/join/{name}"


def look_for_join(r: Round) -> None:
    """Called while a collective waits: if a peer has joined (it waits for descriptors on the
    store), publish this rank's descriptors of every operation since then, and of every later
    one as it is issued, so the joined peer can take part in them."""
    if r.join_active or r.joined or r.store is None or r.size == 1:
        return
    key = join_key(f"{r.join_gen}/first")
    try:
        if not r.store.check([key]):
            return
        first = int(r.store.get(key))
    except Exception:  # an aborted round's store refuses: the wait sees the abort next
        return
    r.join_active = True
    if r.log and r.log[0][0] > first:
        raise HorovodInternalError(f"a peer joined at operation {first}, but this rank only remembers operations "
                                   f"from {r.log[0][0]} on")
    for seq, desc, kind in list(r.log):
        if seq >= first:
            publish(r, seq, desc, kind)


def publish(r: Round, seq: int, desc: Op, kind: str) -> None:
    assert r.store is not None
    try:
        r.store.set(join_key(f"op{seq}"), pickle.dumps((desc, kind)))  # type: ignore[arg-type]  # stub: str; bytes work
    except Exception as exc:
        raise HorovodInternalError(f"could not publish operation {seq} for the joined ranks: {exc}") from exc


class Done:
    """The work of an operation that needed no communication (or completed already)."""

    @staticmethod
    def is_completed() -> bool:
        return True

    @staticmethod
    def wait() -> None:
        return None


DONE = Done()


class Polled:
    """A NCCL work: its completion is polled (its ``wait()`` makes the caller's CUDA stream
    wait, not the host), then ``wait()`` orders the caller's stream after it."""

    __slots__ = ("work",)

    def __init__(self, work: Any) -> None:
        self.work = work

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def wait(self) -> None:
        self.work.wait()


class Works:
    """Several works waited on as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self.works)

    def pending(self) -> Any:
        """The first work still running (waited on in slices like a single one)."""
        return next((w for w in self.works if not w.is_completed()), None)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


@dataclass(eq=False)  # compared and hashed by identity: Horovod's handles are ints, used as dict keys
class Handle:
    """An asynchronous collective in flight; pass it to :func:`synchronize` (or call it)."""

    work: Any
    what: str
    finish: Callable[[], Any]
    done: bool = False
    result: Any = None
    started: float = 0.0  # for the timeline (only set while one records)
    name: str | None = None  # the user's name for it, in flight until synchronized

    def __call__(self) -> Any:
        """``handle()`` == ``synchronize(handle)`` (Horovod's sparse allreduce returns a function)."""
        return synchronize(self)


def handle(work: Any, what: str, finish: Callable[[], Any], name: str | None = None) -> Handle:
    """A handle for ``work``; a ``name`` given is in flight until the handle is synchronized."""
    if name is not None:
        rounds.current().in_flight.add(name)
    return Handle(work, what, finish, started=trace.now() if trace.active() is not None else 0.0, name=name)


def poll(handle: Handle) -> bool:
    """True when the collective has completed (successfully or not)."""
    return handle.done or bool(handle.work.is_completed())


def synchronize(handle: Handle) -> Any:
    """Wait for an asynchronous collective and return its output (a tensor; a list of them for
    grouped operations; ``(output, received_splits)`` for alltoall)."""
    if not handle.done:
        if handle.name is not None:
            rounds.current().in_flight.discard(handle.name)
        wait(rounds.current(), handle.work, handle.what)
        handle.result = handle.finish()
        handle.done = True
        timeline = trace.active()
        if timeline is not None and handle.started:
            timeline.record(handle.what, handle.started, trace.now(), rounds.current().number)
    return handle.result


def traced(r: Round, what: str, started: float) -> None:
    timeline = trace.active()
    if timeline is not None:
        timeline.record(what, started, trace.now(), r.number)
