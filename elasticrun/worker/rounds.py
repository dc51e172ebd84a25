"""The round a worker is in, as the code that communicates in it sees it.

A *round* is one membership of the job: its number, this worker's rank and the world size,
the gloo process group formed for it (and, for CUDA tensors, its NCCL groups: see
``worker/devices.py``), whether the driver aborted it, and whether its first step after a
reset is still to come. The runtime makes a new :class:`Round` at every
rendezvous and installs it here; the collectives, the DistributedOptimizer and the broadcasts
look it up once per operation (:func:`current`) instead of asking the runtime. So they depend
on this small module only, and the runtime can call them (``check_host_updates``) without an
import cycle.

No torch at import time and no threads: the runtime's control thread writes abort reasons
into the mapping a Round reads, one ``dict.get`` per poll.
"""

from __future__ import annotations

import collections
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

from elasticrun.common.events import Kind
from elasticrun.common.settings import DEFAULT_STALL_WARNING
from elasticrun.worker import trace
from elasticrun.worker.descriptors import Op

if TYPE_CHECKING:
    import torch.distributed as dist

    from elasticrun.worker.capacities import Capacities
    from elasticrun.worker.durable import CopyRequests
    from elasticrun.worker.host_updates import HostUpdates

__all__ = ["Round", "StallCheck", "completed", "current", "defer", "install", "placed", "stall_check", "uninstall"]

#: How many recent operations a round remembers for ``join()``: more than any rank issues
#: before it waits for one (the DistributedOptimizer's buckets of one step).
_LOG = 4096

#: How much longer than the collective timeout a gloo group's own timeout runs (at least; 10 %
#: of long timeouts). The wait loop (worker/waiting.py) gives up at the collective timeout with
#: CollectiveTimeout, which this rank reports so that the driver aborts the round for every
#: peer. A gloo group with the very same timeout raced it: when gloo failed the work first,
#: the failure looked like any other (a dead peer, which the driver sees itself), the round was
#: not aborted, and the peers blocked with this rank waited out timeouts of their own.
GROUP_TIMEOUT_SLACK = 1.0


STALL_WARNING = DEFAULT_STALL_WARNING  # (or half the collective timeout): see stall_check()
#: The shortest warning time taken from the environment: Horovod's 0 would name every wait.
_STALL_WARNING_MIN = 1.0


@dataclass(frozen=True)
class StallCheck:
    """When a collective that waits for other ranks says so (``warning``), and when it gives up
    (``shutdown``) before the collective timeout; None: never."""

    warning: float | None
    shutdown: float | None = None


def stall_check(environ: Mapping[str, str], collective_timeout: float) -> StallCheck:
    """Horovod's stall check from Horovod's variables (which horovodrun's ``--no-stall-check``
    and ``--stall-check-*-time-seconds`` set, and elasticrun's too): disabled by
    ``HOROVOD_STALL_CHECK_DISABLE`` > 0; a warning after ``HOROVOD_STALL_CHECK_TIME_SECONDS``
    (else 60 s, or half the collective timeout); a shutdown after
    ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` when it is positive and not below the warning time,
    as Horovod's rule is. A value that is not a number is ignored (the default holds)."""

    def number(name: str) -> float | None:
        try:
            value = float(environ.get(name, "").strip())
        except ValueError:
            return None
        return value if math.isfinite(value) and value >= 0 else None

    disable = number("HOROVOD_STALL_CHECK_DISABLE")
    if disable is not None and disable >= 1:
        return StallCheck(None, None)
    given = number("HOROVOD_STALL_CHECK_TIME_SECONDS")
    warning = max(_STALL_WARNING_MIN, given) if given is not None else min(STALL_WARNING, collective_timeout / 2)
    shutdown = number("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS")
    if not shutdown or shutdown < warning:
        shutdown = None
    return StallCheck(warning, shutdown)


def group_timeout(collective_timeout: float) -> timedelta:
    """The timeout a round's gloo groups are formed with: past the collective timeout, so that
    the wait loop's own deadline (and its report to the driver) always comes first."""
    return timedelta(seconds=collective_timeout + max(GROUP_TIMEOUT_SLACK, 0.1 * collective_timeout))


class Round:
    """One round: what its collectives need, replaced (not mutated) at every rendezvous.

    ``pg`` is None until the round's group is formed (and stays None if formation failed).
    ``awaiting_first_step`` is read by the collectives after every completed operation, a
    plain attribute so that the common case costs no call.
    """

    __slots__ = ("number", "rank", "size", "pg", "collective_timeout", "stall", "host_updates", "copy_requests", "copy_busy",
                 "step_done", "awaiting_first_step", "store", "subgroups", "calls", "log", "join_gen", "join_active",
                 "joined", "capacities", "device_backend", "device_groups", "form_device_group", "in_flight",
                 "works", "waiting_since", "waiting_in", "_aborted", "_emit", "__weakref__")

    def __init__(self, number: int, rank: int, size: int, *, collective_timeout: float,
                 host_updates: HostUpdates, aborted: Mapping[int, str],
                 emit: Callable[..., None], pg: dist.ProcessGroupGloo | None = None,
                 copy_requests: CopyRequests | None = None, copy_busy: Callable[[], bool] = lambda: False,
                 step_done: Callable[[float], None] | None = None, stall: StallCheck | None = None) -> None:
        self.number = number
        self.rank = rank
        self.size = size
        self.pg = pg
        self.collective_timeout = collective_timeout
        #: When a collective waiting for other ranks says so, and gives up early (the job's stall check).
        self.stall = stall if stall is not None else StallCheck(min(STALL_WARNING, collective_timeout / 2))
        #: The job's host updates (they outlive rounds): the gradient allreduce carries their flags.
        self.host_updates = host_updates
        #: The driver's requests for a durable copy (job-wide too): the same bucket carries their flags.
        self.copy_requests = copy_requests
        self.copy_busy = copy_busy  # this rank's previous shard is still being sent
        #: Called by the DistributedOptimizer once the gradients of a step are reduced, before
        #: they are applied, with the seconds it waited for them: the runtime counts and times
        #: steps there, and takes a host update agreed in that very allreduce at once (see
        #: Runtime.step_done).
        self.step_done = step_done
        self.awaiting_first_step = False
        #: The round's key/value store (namespaced to this round), once the group is formed:
        #: process sets form their groups on it, ``join()`` passes the ops to mirror through it.
        self.store: dist.Store | None = None
        #: Gloo groups of the process sets used in this round, by their ranks (formed on first use).
        self.subgroups: dict[tuple[int, ...], Any] = {}
        #: What carries CUDA tensors in this round ("nccl" or "gloo"), as the driver told every
        #: member (worker/devices.py).
        self.device_backend = "gloo"
        #: The round's NCCL groups, by members (() for the whole round's), formed at first use
        #: by ``form_device_group(round, members, device)`` (the runtime's).
        self.device_groups: dict[tuple[int, ...], Any] = {}
        self.form_device_group: Callable[[Round, tuple[int, ...], Any], Any] | None = None
        #: Operations issued on the round's groups so far, and the recent ones as (seq,
        #: descriptor, device kind): what a rank that called ``join()`` needs to take part in
        #: them (see worker/join.py).
        self.calls = 0
        self.log: collections.deque[tuple[int, Op, str]] = collections.deque(maxlen=_LOG)
        #: The user's names of this round's asynchronous collectives not synchronized yet
        #: (Horovod refuses a second one of the same name meanwhile).
        self.in_flight: set[str] = set()
        self.join_gen = 0  # join() calls completed in this round
        self.join_active = False  # some rank has joined: publish every operation's descriptor
        self.joined = False  # this rank is in join(), mirroring the others' operations
        #: Agreed row capacities of the variable-size collectives, per group (() for the
        #: round's, the member ranks for a process set's): see worker/capacities.py.
        self.capacities: dict[tuple[int, ...], Capacities] = {}
        #: The works of this round's collectives that may still be running (see :meth:`track`).
        self.works: collections.deque[Any] = collections.deque()
        #: When this rank began waiting in the collective it waits in now (monotonic; None: in
        #: none). Heartbeats carry it: when one rank's wait grows past the stall warning, the
        #: driver names the members outside every collective, whom the others wait for.
        self.waiting_since: float | None = None
        self.waiting_in: str = ""  # the collective waited in then (the heartbeat names it once stalled)
        self._aborted = aborted  # round number -> reason, written by the runtime's control thread
        self._emit = emit

    def abort_reason(self) -> str | None:
        """Why the driver aborted this round, or None while it is healthy."""
        return self._aborted.get(self.number)

    def mark_reset(self) -> None:
        """This round was entered by a reset that is now complete (state restored and synced):
        its next completed collective is the first training step."""
        self.awaiting_first_step = True

    def step_completed(self, what: str) -> None:
        """A collective of this round completed; the first one after :meth:`mark_reset` ends
        the reset (event ``first_step``)."""
        if self.awaiting_first_step:
            self.awaiting_first_step = False
            self._emit(Kind.FIRST_STEP, what=what)

    def track(self, work: Any) -> None:
        """Hold ``work`` (a collective just issued in this round) until it has completed.

        Why: a collective abandoned when its round is aborted still runs on gloo's (or NCCL's)
        thread until its peer's sockets close or its timeout passes. Had Python let go of it,
        that thread would drop the last reference and free the collective's tensors itself,
        taking the GIL to do so; if the interpreter starts finalizing meanwhile (the script
        ended), the thread cannot take the GIL back inside that C++ destructor, and the process
        dies with "terminate called without an active exception" (exit -6), its training done.
        Held here, then by the runtime past the round's end (:meth:`unfinished`), the last
        reference is always Python's. Completed works are let go from the front (collectives
        complete in about the order they were issued), all of them past :data:`_HELD`.
        """
        works = self.works
        while works and completed(works[0]):
            works.popleft()
        works.append(work)
        if len(works) > _HELD:
            self.works = collections.deque(w for w in works if not completed(w))

    def unfinished(self) -> list[Any]:
        """The works of this round still running (and forget the rest): at the round's end.
        With NCCL groups, every work, unasked: a NCCL work's is_completed() waits for its
        communicator's abort (about a second), and the caller is the training thread; whoever
        releases them asks later, off that thread."""
        left = list(self.works) if self.device_groups else [w for w in self.works if not completed(w)]
        self.works = collections.deque()
        return left

    def __repr__(self) -> str:
        return f"Round({self.number}, rank {self.rank} of {self.size})"


#: Works a round holds before it looks past the first one still running (see Round.track).
_HELD = 64


def completed(work: Any) -> bool:
    """Whether ``work`` has ended (succeeded or failed); a work that cannot say has ended."""
    try:
        return bool(work.is_completed())
    except Exception:
        return True


_current: Round | None = None
# A worker joining a running job (runtime.init) takes its place when it first needs it: until
# then ``_pending`` is the place it was launched for and ``_join`` asks the driver for one.
_pending: Round | None = None
_join: Callable[[], object] | None = None


def current() -> Round:
    """The round this process is in; raises until ``hvd.init()`` has joined the job. A worker
    that deferred its place (see :func:`defer`) joins the job's next round here, at its first
    collective."""
    r = _current
    if r is None:
        join = _join
        if join is not None:
            join()  # installs the round it joined (or raises: the rendezvous failed)
            r = _current
        if r is None:
            raise ValueError("elasticrun has not been initialized; call hvd.init() first")
    return r


def installed() -> Round | None:
    """The current round, or None (never joins: for threads beside training)."""
    return _current


def deferred() -> bool:
    """Whether this worker was launched into a running job and has not taken its place yet."""
    return _current is None and _join is not None


def placed() -> Round:
    """The current round, or the place a worker that has not joined yet was launched for
    (``hvd.rank()``/``hvd.size()`` before its first collective): never joins."""
    r = _current if _current is not None else _pending
    if r is None:
        raise ValueError("elasticrun has not been initialized; call hvd.init() first")
    return r


def defer(provisional: Round, join: Callable[[], object]) -> None:
    """No round yet: :func:`placed` answers with ``provisional`` and :func:`current` calls
    ``join`` (which must :func:`install` the round it joined) when a round is first needed."""
    global _pending, _join
    _pending, _join = provisional, join
    trace.note_rank(provisional.rank)


def install(r: Round) -> None:
    """Make ``r`` the current round (the runtime, at every rendezvous)."""
    global _current, _pending, _join
    _current = r
    _pending = _join = None
    trace.note_rank(r.rank)


def uninstall(r: Any = None) -> None:
    """No current round any more (shutdown); with ``r``, only if ``r`` is the current one."""
    global _current, _pending, _join
    if r is None or _current is r or (_current is None and _pending is r):
        _current = None
        _pending = _join = None
