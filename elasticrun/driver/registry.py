"""The worker registry and round decisions: a pure state machine (no threads, sockets or clocks).

Events (``discovered``, ``rendezvous``, ``heartbeat``, ``exited``, ``failing``) only *record*
what happened, with the current time (``now``, monotonic seconds). One method, :meth:`decide`,
looks at everything recorded and returns the actions for the driver shell to carry out
(launch, reply with an assignment, dismiss, kill, notify, abort a round, finish). The driver
calls it once per batch of events and whenever :meth:`next_deadline` passes; the unit tests
call it the same way, so they run the path production runs.

A decision only reads: it is a generator that yields *steps*, the actions for the shell and
the *changes* for the registry itself (a worker's move along its lifecycle, a record for a
launch, a blacklisting, a new round's bookkeeping, a timer). ``_drive`` applies each step
through :meth:`Registry._apply`, the one place the registry changes as it decides, before the
decision reads on, so later steps see the earlier ones' effects; what the driver gets are the
actions. Event recorders note what happened (a heartbeat's time, an exit code) themselves; the
moves, failures, aborts and ends they cause go through ``_apply`` too. The console's words are
not here: events and reasons are data, worded by ``words.py``. This keeps all decisions in one
place that tests can drive exhaustively, in the style of torch.distributed.elastic's dynamic
rendezvous.

Lifecycle of a worker process::

    LAUNCHING --rendezvous--> WAITING --assigned--> RUNNING --rendezvous--> WAITING ...
        \\                         \\                   \\
         exit / start timeout       exit               exit 0 -> SUCCEEDED, else FAILED
         (heartbeat timeout once it has reached the driver)
    (dismissed or killed on purpose -> LEFT; its exit is then ignored)

Holders of the state
--------------------
A worker *holds* the job's newest committed state once it has synced in a round that held
it (it reports ``has_state`` at its next rendezvous), and every member of a round that no
holder joined (round 0, or after every holder was lost) holds what that round started from.
Live workers are in every round since they joined, and every round ends with its members at
the same commit, so all live holders hold the same, newest state. The rule that keeps it:
**while a holder is alive, no round forms without one.** When every holder is leaving (its
host removed from discovery, or blacklisted after a peer's failure), the next round is a
*hand-over*: the lowest-ranked holder joins the ready newcomers as rank 0, they sync from it,
and only the round after that lets it go. Until newcomers are ready, holders keep training.

Decisions
---------
A round ends when no worker is RUNNING in it: every member has reported (asked for the next
round after an interrupt or error, succeeded, or failed). Then:

* any worker succeeded       -> the job finishes when the others have finished;
* no live worker is left     -> the job fails ("all workers failed");
* every host is blacklisted  -> the job fails (unless blacklisting has a cooldown);
* ``reset_limit`` reached    -> the job fails naming the limit;
* fewer than ``min_np`` slots can ever be had (a fixed host list, permanent blacklisting)
                             -> the job fails at once, naming what is left;
* otherwise wait up to ``elastic_timeout`` for ``min_np`` ready workers (saying what it waits
  for every 30 s) and form the next round of the workers that are ready; workers still
  starting join later, by a host-update notification.

During a round, host changes do not stop it until they can take effect:

* a removal is notified at once, whatever else is pending: the next round is formed of the
  ready workers (a newcomer still starting joins later);
* an addition is notified only when every newcomer has asked for its place, so the survivors
  keep training while the newcomers import torch, and all of them join in one reset. A worker
  launched after round 0 formed (``Launch.joining``) asks at its first collective or first
  ``sync()``, not at ``hvd.init()``: building its model and loading its data are off the
  survivors' clock too. Until then it is LAUNCHING but reachable: its heartbeats bound it,
  not ``--start-timeout`` (it may prepare for as long as it needs).
"""

from __future__ import annotations

import collections
import enum
import signal
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Generator, Mapping, Union, get_args

from elasticrun.common.events import Cause, Kind, Reason
from elasticrun.discovery.host_manager import LEAVING, NOTICE, HostManager
from elasticrun.driver.assignment import SlotInfo, assign, assign_keys
from elasticrun.driver.stragglers import Pace, Straggler, StragglerDetector, eviction_pays
from elasticrun.driver.words import UNREACHABLE


class WorkerState(enum.Enum):
    LAUNCHING = "launching"
    WAITING = "waiting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LEFT = "left"


#: Exit codes of a worker that SIGTERM ended: killed by it, or exited 128 + 15 (a shell's way of
#: saying so; a worker stopping at --sigterm-grace or a second SIGTERM exits so itself).
SIGTERM_EXITS = frozenset({-signal.SIGTERM, 128 + signal.SIGTERM})
#: How a process the driver stopped exits (SIGTERM, or SIGKILL after the grace; a shell's 128+N).
STOP_EXITS = SIGTERM_EXITS | {-signal.SIGKILL, 128 + signal.SIGKILL}

#: How a worker's report names the error a collective raises when a peer fails (the worker's
#: exception class: the driver does not import the worker's modules).
_INTERNAL_ERROR = "HorovodInternalError"

_GONE = (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.LEFT)

#: The lifecycle above as data: the states each state may move to. Every change of a worker's
#: state goes through :func:`_move`, which refuses any other (a decision bug, not the user's).
MOVES: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.LAUNCHING: frozenset({WorkerState.WAITING, WorkerState.SUCCEEDED, WorkerState.FAILED,
                                      WorkerState.LEFT}),
    WorkerState.WAITING: frozenset({WorkerState.WAITING, WorkerState.RUNNING, WorkerState.SUCCEEDED,
                                    WorkerState.FAILED, WorkerState.LEFT}),
    WorkerState.RUNNING: frozenset({WorkerState.WAITING, WorkerState.SUCCEEDED, WorkerState.FAILED}),
    WorkerState.SUCCEEDED: frozenset(),
    WorkerState.FAILED: frozenset(),
    WorkerState.LEFT: frozenset(),
}
_LIVE = (WorkerState.WAITING, WorkerState.RUNNING)
# States whose silence is a hang: a launching worker that has reached the driver is preparing
# (building its model before it asks for a place) and heartbeats meanwhile.
_BEATING = (WorkerState.LAUNCHING, *_LIVE)

#: Hosts named on the console per listing and kind of change (added, removed, resized, back
#: after a cooldown); the rest are counted in one line.
HOSTS_NAMED = 8

#: How often a wait for slots is reported on the console.
WAIT_REMINDER = 30.0

#: How often a round that stands still on members outside every collective is reported again
#: (as often as each waiting worker repeats its own stall line: worker/waiting.py).
STALL_REPEAT = 300.0

#: How long a worker whose script ended may take to exit (the interpreter's teardown: freeing
#: memory, CUDA contexts, library destructors; seconds when many share a machine's cores)
#: before it is killed as stuck.
EXIT_GRACE = 30.0

#: How long the record of a worker that failed or left is kept after its exit. A job that
#: replaces workers for days would otherwise keep every one, and every decision reads them all:
#: with 10,000 such records a reset's decisions took 15 ms more. By then its output is copied
#: out (its rank prefixes the last lines) and no decision reads it (the failures that end a job
#: are the last round's; every member of the current round is kept).
FORGET_AFTER = 60.0


@dataclass
class WorkerRecord:
    id: str
    host: str
    slot: int
    state: WorkerState
    started_at: float
    round: int = -1
    rank: int = -1
    exit_code: int | None = None
    exited: bool = False
    ended_at: float | None = None  # when its exit was heard
    why: Reason | None = None  # how it failed, for the job's failure message
    last_seen: float | None = None  # last heartbeat or request; None until the first contact
    restored: bool = False  # it rolled back to its last commit before asking for this round
    holds: bool = False  # it holds the job's newest committed state (see the module docstring)
    script_error: bool = False  # it failed with a Python exception of its own (not the machine's doing)
    steps: int = -1  # optimizer steps it reported last (-1: none yet)
    gpus: tuple[str, ...] = ()  # the GPUs NCCL could use there (their UUIDs, in device order), as it reported
    # Its last heartbeat said goodbye: "exit" (its script ended; only the interpreter's teardown
    # is left) or "shutdown" (hvd.shutdown(): its process goes on without the job). No more
    # heartbeats come; ``bye_at`` is when it said it.
    bye: str | None = None
    bye_at: float = 0.0
    leaving: bool = False  # it said it got SIGTERM: it leaves at its next commit; its host is going
    # Its last heartbeat: how long it had waited in the collective it was in (None: in none),
    # and whether that wait was past its stall warning.
    waiting: float | None = None
    stalled: bool = False
    waiting_in: str | None = None  # the collective it waits in, as its last heartbeat named it once stalled
    waiting_until: str | None = None  # and the flag that ends that wait (its collective timeout or stall shutdown)
    # (host, slot): a plain attribute, not a property; every decision reads it for each worker.
    key: tuple[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.key = (self.host, self.slot)

    @property
    def label(self) -> str:
        return f"{self.host}[{self.slot}]"


def _move(w: WorkerRecord, to: WorkerState) -> None:
    """The one place a worker's state changes, along :data:`MOVES` only."""
    if to not in MOVES[w.state]:
        raise AssertionError("illegal_move", w.label, w.state.value, to.value)
    w.state = to


# --- actions -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    worker_id: str
    info: SlotInfo  # the planned place, given to the process as its launch environment
    # The job's rounds have begun: the worker asks for its place when it first needs one (its
    # first collective or sync), not at hvd.init(), so the survivors train while it prepares.
    joining: bool = False


@dataclass(frozen=True)
class Assign:
    worker_id: str
    round: int
    info: SlotInfo
    # The state must be synced: new members, or the previous round failed or some member
    # rolled back (then ranks that took a host-update interrupt hold a newer commit).
    must_sync: bool = True
    # Load the newest durable copy before the sync (rank 0 of a round that no holder joined).
    restore: bool = False
    # What carries CUDA tensors in this round: "nccl" or "gloo", the same for every member.
    device_backend: str = "gloo"


@dataclass(frozen=True)
class Dismiss:
    """Reply to a waiting worker that it has no place: it exits 0."""

    worker_id: str
    why: Reason


@dataclass(frozen=True)
class Kill:
    worker_id: str
    why: Reason


@dataclass(frozen=True)
class Notify:
    """Tell every worker that hosts changed: they interrupt at the same step and re-form."""

    added: bool
    removed: bool


@dataclass(frozen=True)
class AbortRound:
    """A member of ``round`` failed: every worker must abandon its collectives now."""

    round: int
    why: Reason


@dataclass(frozen=True)
class ForgetRounds:
    """``round`` has formed: store keys and waiters of every other round are dead."""

    round: int


@dataclass(frozen=True)
class Event:
    """Something worth telling the user or the event log (``level``: how loudly): what
    happened as data (its kind and figures); ``words.event`` words it for the console."""

    kind: Kind
    fields: Mapping[str, Any] = field(default_factory=dict)
    level: str = "info"  # "info" | "warning"


@dataclass(frozen=True)
class Finish:
    ok: bool
    why: Reason
    complete: bool = True  # False: a success that ended the job before every rank finished


Action = Union[Launch, Assign, Dismiss, Kill, Notify, AbortRound, ForgetRounds, Event, Finish]


# --- changes: what a decision does to the registry itself -----------------------------------
# A decision reads the registry and yields actions for the shell and these changes for the
# registry; :meth:`Registry._apply` is the one place either changes its state (the actions
# that carry a change, AbortRound, Assign and Finish, are applied there too). Some changes
# answer the decision (a blacklisting's end, a straggler verdict), sent back into it.
@dataclass(frozen=True)
class Move:
    """A worker moves along its lifecycle (``why``: how it failed)."""

    worker_id: str
    to: WorkerState
    why: Reason | None = None


@dataclass(frozen=True)
class Record:
    """A worker to be launched: its record, LAUNCHING from ``now``."""

    worker_id: str
    info: SlotInfo
    now: float


@dataclass(frozen=True)
class Blacklist:
    """Blacklist a host; answers when it may come back (None: never)."""

    host: str
    now: float


@dataclass(frozen=True)
class Drain:
    """A host is going (one of its workers got SIGTERM): nothing starts there until discovery
    lists it anew, and its workers leave at their next commit. ``hold``: a worker that said so
    still runs there (see ``HostManager.drain``)."""

    host: str
    now: float
    hold: bool = False


@dataclass(frozen=True)
class Pardon:
    """Forget a host's blacklisting (every worker was lost at once)."""

    host: str
    now: float


@dataclass(frozen=True)
class Refresh:
    """Let hosts whose cooldown ended back in; answers the HostChange."""

    now: float


def _consequence(why: Reason | None) -> bool:
    """Whether a worker's failure is another's consequence: its script let a
    HorovodInternalError escape (a collective failed because a peer died, or its round was
    aborted for another's failure), not an error or an exit of its own."""
    return (why is not None and why.cause is Cause.SCRIPT_ERROR
            and str(why.fields.get("error", "")).startswith(_INTERNAL_ERROR))


@dataclass(frozen=True)
class JudgeStragglers:
    """Let the straggler detector judge this round's members; answers (newly named, recovered)."""

    round: int
    members: Mapping[str, str]
    now: float = 0.0  # a verdict changes back only after holding a while (stragglers.HOLD)


@dataclass(frozen=True)
class NewRound:
    """Round ``round`` forms: the previous round's bookkeeping is cleared; ``holders``: the
    members that start holding the state (a round that no holder joined)."""

    round: int
    holders: tuple[str, ...] = ()


@dataclass(frozen=True)
class Mark:
    """One of the registry's own notes: ``plain``, the wait's timers, the target notified, a
    line said once this round, the device backend told (see ``Registry._MARKS``)."""

    name: str
    value: Any


Change = Union[Move, Record, Blacklist, Drain, Pardon, Refresh, JudgeStragglers, NewRound, Mark]
Step = Union[Action, Change]
#: A decision: yields actions and changes, is sent the answers of the changes that have one.
Decision = Generator[Step, Any, None]
_ACTIONS = get_args(Action)


def _just(*steps: Step) -> Decision:
    """A decision of a few fixed steps (an event recorder's abort or finish)."""
    yield from steps


def _as_of(event: Event, until: float | None, now: float) -> Event:
    """A held blacklisting's line as said at ``now``: the time its cooldown has left, or, where
    it is over already (its host said to be back), how long it was."""
    if until is None:
        return event
    if until > now:
        return Event(event.kind, dict(event.fields, seconds=until - now), event.level)
    return Event(event.kind, dict(event.fields, over=True), event.level)


@dataclass(frozen=True)
class RegistryConfig:
    np: int
    min_np: int
    max_np: int | None
    reset_limit: int | None
    elastic_timeout: float
    start_timeout: float
    heartbeat_timeout: float | None = None  # None: never declare a silent worker hung
    fixed_hosts: bool = False  # -H / --hostfile: no host ever appears that is not listed now
    evict_stragglers: bool = False  # move straggler hosts out (and blacklist them), not only name them
    backend: str = "auto"  # --backend: what carries CUDA tensors (see device_backend)


class Registry:
    """Workers, rounds and the decisions between them: record events, then :meth:`decide`."""

    def __init__(self, config: RegistryConfig, hosts: HostManager, new_id: Callable[[], str]):
        self.config = config
        self.hosts = hosts
        self._new_id = new_id
        self.workers: dict[str, WorkerRecord] = {}
        self.round = -1
        self.members: dict[tuple[str, int], str] = {}
        self.aborted = False
        self.abort_reason: Reason | None = None  # why the current round was aborted (workers hear it with heartbeats)
        self.reset_count = 0
        self.finished: Finish | None = None
        self._outbox: list[Action] = []  # what events produced, returned by the next decide()
        self._behind = 0.0  # now - heard_until at the last decision: how far behind its inbox the driver was
        self._dirty = True
        self._notified_target: frozenset[tuple[str, int]] | None = None
        self._wait_started: float | None = None
        self._wait_reminder: float | None = None  # when the next "still waiting" line is due
        # An aborted round: when it was first seen aborted, and when the next line naming the
        # members that have not left it is due.
        self._aborted_at: float | None = None
        self._abort_reminder: float | None = None
        # A member's heartbeat said it has waited in a collective past the stall warning; and
        # the members then named as outside every collective, with when to name them again.
        self._stalls = False
        self._stall_said: tuple[frozenset[str], float] | None = None
        self._said: set[str] = set()  # one-time messages of the current round
        # Hosts the round keeps although they are going (discovery dropped them, a notice, a
        # blacklisting), and why: "handover" (every holder of the state is on them and no
        # newcomer is ready) or "min_np" (without them fewer than --min-np would train). The
        # line saying so comes once a round; the status line repeats it while it holds.
        self.kept: tuple[str, tuple[str, ...]] | None = None
        # The first round's wait for -np slots from discovery ran out with --min-np of them
        # usable: round 0 starts with what there is (hosts that appear later join it).
        self._np_relaxed = False
        # The blacklistings that failures in an aborted round caused, said once the round has
        # settled (every member reported or failed): if every worker turned out to be lost at
        # once, they are lifted instead, and the console never said otherwise.
        self._held: list[tuple[Event, float | None]] = []  # (a blacklisting's line, when it ends)
        self._empty_said = False  # an empty discovery listing was reported (until a non-empty one)
        self.durable_commit: int | None = None  # the commit of the newest durable copy (--checkpoint-dir)
        # Who ended the job early: rank, steps and how many were training (Cause.ENDED_EARLY).
        self._ended_early: dict[str, int] | None = None
        self._device_said: tuple[str, Reason] | None = None  # the last (backend, why) told
        # Some worker has reached the driver (called hvd.init()). Until one does, a worker that
        # ends, or outlives --start-timeout, makes this a job of plain processes (``plain``).
        self._contacted = False
        self.plain = False
        self._first_success: int | None = None  # the rank of the first worker that finished
        self.stragglers = StragglerDetector()  # the workers' paces -> hosts that drag the job
        # (inputs, result) of the last _target(): (host order, max_np, survivors) -> places
        self._target_cache: tuple[tuple[list[tuple[str, int]], int | None, dict[tuple[str, int], int]],
                                  list[SlotInfo], frozenset[tuple[str, int]]] | None = None
        # Indexes kept as the registry changes, so that a decision while thousands of workers
        # trickle into a round need not scan them all for what it asks of each one:
        self._in: dict[WorkerState, int] = dict.fromkeys(WorkerState, 0)  # workers in each state
        self._busy: dict[tuple[str, int], int] = {}  # slot -> its processes that have not exited
        self._holding = 0  # workers with ``holds`` (never cleared while the record is kept)
        # Lower bounds of when a timeout can trip: silence and --start-timeout are judged on
        # ``heard`` time, a goodbye's EXIT_GRACE on ``now``. ``_timeouts`` scans the workers
        # only once one has passed and sets them exact; anything that makes a deadline lowers them.
        self._heard_floor = float("-inf")
        self._now_floor = float("-inf")
        self._forget_due = FORGET_AFTER  # when the records of ended workers are next looked at

    # --- events: they only record ----------------------------------------------------------
    def discovered(self, hosts: Mapping[str, int], now: float, draining: Collection[str] = ()) -> None:
        """A discovery result. An empty one keeps the last hosts: removing every host would
        end the job and discard its state, and a script that lists nothing is far more often
        broken than a cluster that is truly empty."""
        self._dirty = True
        if not hosts and self.hosts.discovered():
            if not self._empty_said:
                self._empty_said = True
                self._outbox.append(Event(Kind.DISCOVERY_EMPTY, {}, level="warning"))
            return
        self._empty_said = False
        before = self.hosts.discovered()
        was_draining = self.hosts.draining()
        change = self.hosts.update(hosts, now, draining)
        if self.finished is not None or self._succeeded():
            # The job is ending: its hosts no longer matter, and a line would read as news. (On
            # Ray, a node shows a worker's slot again only once Ray has freed it, a moment after
            # the worker's end: the last listings said "host removed" for a job that succeeded.)
            return
        for h in sorted(set(draining) & set(hosts)):
            if h not in was_draining:
                self._outbox.append(Event(Kind.HOST_DRAINING, {"host": h}))
        served = set(self.hosts.blacklisted())  # every host ever blacklisted (entries outlive cooldowns)
        # Each host is named up to HOSTS_NAMED a listing (per kind of change), the rest counted
        # in one line: a listing of thousands of hosts, or one whose hosts come and go at every
        # run, must not print a line per host per run.
        named: collections.Counter[str] = collections.Counter()
        unnamed: collections.Counter[str] = collections.Counter()

        def say(event: Event, kind: str) -> None:
            if named[kind] < HOSTS_NAMED:
                named[kind] += 1
                self._outbox.append(event)
            else:
                unnamed[kind] += 1

        for h in change.added:
            if h in served and h in before:  # its cooldown ended just before this listing came
                say(Event(Kind.HOST_WHITELISTED, {"host": h, "because": "cooldown"}), "whitelisted")
            else:
                say(Event(Kind.HOST_ADDED, {"host": h, "slots": hosts[h]}), "added")
        for h in change.removed:
            if h not in self.hosts.draining():
                say(Event(Kind.HOST_REMOVED, {"host": h}), "removed")
        for h in change.resized:
            say(Event(Kind.HOST_RESIZED, {"host": h, "slots": hosts[h]}), "resized")
        if unnamed:
            self._outbox.append(Event(Kind.HOSTS_MORE, {k: unnamed[k] for k in ("added", "removed", "resized",
                                                                                "whitelisted") if unnamed[k]}))

    def rendezvous(self, worker_id: str, now: float, error: str | None = None, restored: bool = False,
                   has_state: bool = False, gpus: tuple[str, ...] = ()) -> None:
        """A worker asks for its place in the next round (first time, after an interrupt, or
        after ``error``: a collective failed on its side). ``restored``: it rolled back to its
        last commit (after any failed collective). ``has_state``: it has synced in a round
        since it joined, so it holds the state that round held."""
        self._dirty = True
        w = self.workers.get(worker_id)
        if w is None:
            self._outbox.append(Dismiss(worker_id, Reason(Cause.NOT_IN_JOB)))
            return
        if w.state in _GONE:
            self._outbox.append(Dismiss(worker_id, Reason(Cause.JOB_FINISHED if self.finished or self._succeeded()
                                                          else Cause.NO_PLACE_ANY_MORE)))
            return
        self._contact(w, now)
        if error and w.state is WorkerState.RUNNING and w.round == self.round and not self.aborted:
            # Its peers may be blocked in a collective with it (e.g. it gave up on its own
            # collective timeout): without an abort they would wait out theirs.
            self._outbox += self._drive(_just(AbortRound(self.round, Reason(Cause.LEFT_AFTER_ERROR, {
                "label": w.label, "round": self.round, "error": error}))))
        self._apply(Move(w.id, WorkerState.WAITING))
        w.last_seen, w.restored = now, restored
        self._beat_deadline(now)
        if has_state and not w.holds:
            w.holds = True
            self._holding += 1
        w.gpus = tuple(gpus)[:1024]

    def leaving(self, worker_id: str, why: str, now: float) -> None:
        """A worker was told it will be stopped (SIGTERM: a reclaim, a pod deletion, scancel).
        Its host goes like a discovery removal: its workers leave at their next commit, without
        a rollback, and nothing starts there until discovery lists it anew."""
        w = self.workers.get(worker_id)
        if w is None or w.state in _GONE:
            return
        self._dirty = True
        w.leaving = True
        self._outbox += self._drive(self._drain(w.host, why, now, hold=True))

    def restore_failed(self, worker_id: str, error: str) -> None:
        """The durable copy does not fit the script's state (a changed model): the job stops,
        rather than start over from scratch behind the user's back."""
        if self.finished is None:
            self._outbox += self._drive(_just(Finish(False, Reason(Cause.CANNOT_RESUME, {"error": error}))))
        self._dirty = True

    def durable(self, commit: int) -> None:
        """A durable copy of ``commit`` exists (written now, or found at start with --checkpoint-dir):
        a round that no holder of the state joins starts from it instead of from scratch."""
        if "collapse" in self._said and self.durable_commit is not None and commit > self.durable_commit:
            # Every worker was lost while this copy was being finished: the line that named the
            # older copy would be contradicted by the resume, so say which one it will be.
            self._outbox.append(Event(Kind.WORKERS_LOST, {
                "limit": self.config.elastic_timeout, "min_np": self.config.min_np, "commit": commit,
                "was": self.durable_commit}, level="warning"))
        self.durable_commit = commit
        self._dirty = True

    def heartbeat(self, worker_id: str, now: float, pace: Pace | None = None, steps: int | None = None,
                  bye: str | None = None, waiting: float | None = None, stalled: bool = False,
                  op: str | None = None, until: str | None = None) -> None:
        """A sign of life from a worker, with its step count and the pace of its recent steps in
        this round (a decision follows only when that pace may name a straggler, or when it stops).
        ``bye``: its last one (see :attr:`WorkerRecord.bye`): silence is then no sign of a hang.
        ``waiting``/``stalled``: how long it has waited in its current collective (None: in
        none), and whether past the stall warning (a decision follows when that may name the
        members the round waits for: see :meth:`_stalled`); ``op``: which collective, and
        ``until``: the flag that ends its wait, once stalled."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.last_seen = now
            self._beat_deadline(now)
            self._first_contact()
            if steps is not None:
                w.steps = steps
            if (stalled != w.stalled or (self._stalls and (waiting is None) != (w.waiting is None))
                    or op != w.waiting_in):
                self._dirty = True
            w.waiting, w.stalled, w.waiting_in, w.waiting_until = waiting, stalled, op, until
            if stalled:
                self._stalls = True
            if bye in ("exit", "shutdown") and w.bye is None:
                w.bye, w.bye_at = bye, now
                self._now_floor = min(self._now_floor, now + EXIT_GRACE)
                self._dirty = True
            if (pace is not None and pace.round == self.round and w.state is WorkerState.RUNNING
                    and w.round == self.round and self.stragglers.report(w.id, w.host, pace)):
                self._dirty = True

    def exited(self, worker_id: str, code: int, now: float, detail: str = "") -> None:
        w = self.workers.get(worker_id)
        if w is None or w.exited:
            return
        self._dirty = True
        w.exited, w.exit_code, w.ended_at = True, code, now
        if w.leaving and not any(o.leaving and not o.exited and o.host == w.host for o in self.workers.values()):
            self.hosts.release(w.host, now)  # (its host stays going until discovery drops it)
        self._busy[w.key] -= 1
        if not self._busy[w.key]:
            del self._busy[w.key]
        if w.state in (WorkerState.LEFT, WorkerState.FAILED):  # already accounted for
            return
        if (not self._contacted and self.round < 0 and not self.plain
                and (code == 0 or (0 < code < 126 and self._static()))):
            # It ran and ended without ever calling hvd.init(), and so has every other worker so
            # far: a plain command (``bash -c ...``, a script without elasticrun), run as
            # horovodrun runs one: every process to its end, the job failing if any fails. In a
            # job that cannot change size, a process's own failure before any worker reached the
            # driver is the same news (horovodrun fails such a job at once, naming the rank):
            # its host is not blacklisted, and the others are stopped now, not after their end or
            # --start-timeout. (Not 126/127, a command that could not run there, nor SSH's 255:
            # the host's problem, handled as a failed start.)
            self.plain = True
            self._rescan()
        if self.plain and self.finished is not None and not self.finished.ok and code != 0:
            # Stopped after another's failure ended the job: by that stop's signal, or by a
            # failure of its own that came at the same time (then the job's reason names both).
            if code in STOP_EXITS:
                self._apply(Move(w.id, WorkerState.LEFT, Reason(Cause.PEER_FAILED)))
                return
            self._apply(Move(w.id, WorkerState.FAILED, Reason(Cause.EXITED, {"code": code, "detail": detail})))
            self._outbox.append(Event(Kind.WORKER_FAILED, {"host": w.host, "label": w.label, "rank": w.rank,
                                                           "why": w.why}))
            failed = [o for o in self.workers.values() if o.state is WorkerState.FAILED]
            self.finished = Finish(False, Reason(Cause.PROCESSES_FAILED, {"failed": self._failures(failed)}))
            return
        if self.plain:
            self._apply(Move(w.id, WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED,
                             Reason(Cause.EXITED, {"code": code, "detail": detail})))
            if code == 0:
                self._outbox.append(Event(Kind.WORKER_SUCCEEDED, {"host": w.host, "label": w.label, "rank": w.rank,
                                                                  "plain": True}))
            else:
                self._outbox.append(Event(Kind.WORKER_FAILED, {"host": w.host, "label": w.label, "rank": w.rank,
                                                               "why": w.why}))
            return
        if code == 0:
            # (Checked in this order: when a whole job ends every worker exits, and counting the
            # members on each exit would cost O(N^2).)
            if (self._ended_early is None and w.round == self.round
                    and any(wid != w.id and self.workers[wid].state in _LIVE for wid in self.members.values())):
                # Horovod's rule stands (one worker's success ends the job), but the summary
                # must not read as if everyone finished.
                n = sum(1 for m in self._live_members() if m is not w)
                self._ended_early = {"rank": w.rank, "steps": w.steps, "training": n}
            self._apply(Move(w.id, WorkerState.SUCCEEDED))
            if self._first_success is None:
                self._first_success = w.rank
            self._outbox.append(Event(Kind.WORKER_SUCCEEDED, {"host": w.host, "label": w.label, "rank": w.rank}))
            return
        self._outbox += self._drive(self._failure(w, Reason(Cause.EXITED, {"code": code, "detail": detail}), now))

    def failing(self, worker_id: str, error: str, now: float) -> None:
        """A worker reports it is failing (before its exit, which is then only recorded)."""
        w = self.workers.get(worker_id)
        if w is None or w.state in _GONE:
            return
        self._dirty = True
        w.script_error = True
        self._outbox += self._drive(self._failure(w, Reason(Cause.SCRIPT_ERROR, {"error": error}), now))

    @property
    def dirty(self) -> bool:
        """Events arrived that no decision has looked at yet."""
        return self._dirty

    # --- the decision ------------------------------------------------------------------------
    def decide(self, now: float, heard_until: float | None = None) -> list[Action]:
        """Everything the recorded events and the passing of time call for, as actions.

        ``heard_until``: every message that reached the driver before then has been recorded
        (default ``now``). A driver behind its inbox passes when it last found the inbox empty:
        silence is judged up to then only, so that heartbeats still waiting in the queue never
        make a healthy worker look hung (and its host blacklisted)."""
        acts, self._outbox = self._outbox, []
        heard = now if heard_until is None else min(now, heard_until)
        if now >= self._forget_due:
            self._forget_ended(now)
        self._behind = now - heard
        self._dirty = False
        if self.finished is None:
            acts += self._drive(self._decision(now, heard))
        if self.finished is not None and self._held:  # (a job ended by an event: nothing unsaid)
            held, self._held = self._held, []
            end = next((i for i, a in enumerate(acts) if isinstance(a, Finish)), len(acts))
            acts[end:end] = [_as_of(event, until, now) for event, until in held]
        return acts

    def _decision(self, now: float, heard: float) -> Decision:
        """The decision itself: it reads the registry and yields what to do (``_drive`` applies
        each step before the decision reads on, so later steps see earlier ones' effects)."""
        for h in (yield Refresh(now)).added:
            yield Event(Kind.HOST_WHITELISTED, {"host": h, "because": "cooldown"})
        yield from self._timeouts(now, heard)
        if self.plain:
            yield from self._say_held(now)
            yield from self._plain_end()
            return
        if self._succeeded():
            yield from self._say_held(now)
            yield from self._finishing()
            return
        running = self._in[WorkerState.RUNNING] > 0
        if running and not self.aborted:
            yield from self._stragglers(now)  # first: an eviction changes the target
        target = self._target()
        if running:
            yield from self._during_round(target, now)
        else:
            yield from self._between_rounds(target, now)

    # --- applying: the one place the registry changes as it decides ---------------------------
    #: The notes a Mark may set (and ``said``, which adds to the lines said this round; ``held``,
    #: which holds a blacklisting's line until the round settles; ``held_said``, which ends that).
    _MARKS = frozenset({"plain", "_wait_started", "_wait_reminder", "_notified_target", "_device_said", "said",
                        "held", "held_said", "_aborted_at", "_abort_reminder", "_stalls", "_stall_said", "kept",
                        "_np_relaxed"})

    def _drive(self, decision: Decision) -> list[Action]:
        """Run a decision: apply each step it yields, send back the answer, collect the actions."""
        acts: list[Action] = []
        try:
            step = next(decision)
            while True:
                answer = self._apply(step)
                if isinstance(step, _ACTIONS):
                    acts.append(step)
                step = decision.send(answer)
        except StopIteration:
            return acts

    def _apply(self, step: Step) -> Any:
        """Apply one step of a decision to the registry; the answer of a change that has one."""
        if isinstance(step, Move):
            w = self.workers[step.worker_id]
            self._move(w, step.to)
            if step.why is not None:
                w.why = step.why
        elif isinstance(step, Record):
            if step.worker_id in self.workers:
                raise AssertionError("worker_recorded_twice", step.worker_id)
            w = self.workers[step.worker_id] = WorkerRecord(step.worker_id, step.info.host, step.info.slot,
                                                            WorkerState.LAUNCHING, step.now, rank=step.info.rank)
            self._in[WorkerState.LAUNCHING] += 1
            self._busy[w.key] = self._busy.get(w.key, 0) + 1
            self._heard_floor = min(self._heard_floor, step.now + self.config.start_timeout)
        elif isinstance(step, Blacklist):
            return self.hosts.blacklist(step.host, step.now)
        elif isinstance(step, Drain):
            self.hosts.drain(step.host, step.now, step.hold)
        elif isinstance(step, Pardon):
            self.hosts.pardon(step.host, step.now)
        elif isinstance(step, Refresh):
            return self.hosts.refresh(step.now)
        elif isinstance(step, JudgeStragglers):
            return self.stragglers.evaluate(step.round, dict(step.members), step.now)
        elif isinstance(step, NewRound):
            for wid in step.holders:  # they all start from the same state
                if not self.workers[wid].holds:
                    self.workers[wid].holds = True
                    self._holding += 1
            self.round = step.round
            if self.round > 0:
                self.reset_count += 1
            self._rescan()  # a start timeout tells a plain job apart only before round 0
            self.members = {}
            self.aborted, self.abort_reason = False, None
            self._notified_target = None
            self._wait_started = self._wait_reminder = None
            self._aborted_at = self._abort_reminder = None
            if self._stalls:  # what members said of the last round's collectives
                for w in self.workers.values():
                    w.stalled = False
            self._stalls, self._stall_said = False, None
            self._said.clear()
            self.kept = None
        elif isinstance(step, Mark):
            if step.name not in self._MARKS:
                raise AssertionError("unknown_mark", step.name)
            if step.name == "said":
                self._said.add(step.value)
            elif step.name == "held":
                self._held.append(step.value)
            elif step.name == "held_said":
                self._held.clear()
            else:
                setattr(self, step.name, step.value)
                if step.name == "plain":
                    self._rescan()
        elif isinstance(step, Assign):
            w = self.workers[step.worker_id]
            self._move(w, WorkerState.RUNNING)
            w.round, w.rank = step.round, step.info.rank
            self.members[step.info.key] = w.id
        elif isinstance(step, AbortRound):
            self.aborted, self.abort_reason = True, step.why
        elif isinstance(step, Finish):
            self.finished = step
        return None

    # --- queries -------------------------------------------------------------------------
    def live(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if not w.exited]

    def _move(self, w: WorkerRecord, to: WorkerState) -> None:
        """A worker's move (:func:`_move`), counted in ``_in``."""
        was = w.state
        _move(w, to)
        self._in[was] -= 1
        self._in[to] += 1
        if w.bye == "exit" and to in _LIVE and not w.exited:  # its EXIT_GRACE counts from now on
            self._now_floor = min(self._now_floor, w.bye_at + EXIT_GRACE)

    def _beat_deadline(self, now: float) -> None:
        """A worker was heard at ``now``: its silence can trip --heartbeat-timeout from then."""
        if self.config.heartbeat_timeout is not None:
            self._heard_floor = min(self._heard_floor, now + self.config.heartbeat_timeout)

    def _forget_ended(self, now: float) -> None:
        """Drop the records of workers that failed or left, exited at least FORGET_AFTER ago,
        and are no member of the current round (a scan a minute). Kept: every record of a plain
        job (its end reads them all), and succeeded workers (one means the job is ending)."""
        self._forget_due = now + FORGET_AFTER
        if self.plain:
            return
        members = set(self.members.values())
        for w in list(self.workers.values()):
            if (w.state in (WorkerState.FAILED, WorkerState.LEFT) and w.ended_at is not None
                    and now - w.ended_at >= FORGET_AFTER and w.id not in members):
                del self.workers[w.id]
                self._in[w.state] -= 1
                self._holding -= w.holds

    def _rescan(self) -> None:
        """What decides which timeouts can trip changed (first contact, a plain job, a round):
        the next decision looks at every worker."""
        self._heard_floor = self._now_floor = float("-inf")

    def final_round(self) -> list[WorkerRecord]:
        """The members of the last round formed, by rank (who returned the job's result)."""
        return sorted((self.workers[wid] for wid in self.members.values()), key=lambda w: w.rank)

    def joining(self) -> int:
        """Workers launched into the running job that reached the driver and have not asked for
        a place yet (building their model before their first sync): the status line counts them."""
        return 0 if self.round < 0 else sum(1 for w in self.workers.values()
                                            if w.state is WorkerState.LAUNCHING and w.last_seen is not None)

    def starting(self) -> int:
        """Workers launched into the running job that have not reached the driver yet."""
        return 0 if self.round < 0 else sum(1 for w in self.workers.values()
                                            if w.state is WorkerState.LAUNCHING and w.last_seen is None)

    @property
    def handover_pending(self) -> bool:
        """Every worker holding the state is on a host that is going (leaving, draining) and
        nobody can take it over yet (said this round): the driver keeps a durable copy as fresh
        as it can until they go. (Holders only blacklisted may train on for long: not those.)"""
        if "handover" not in self._said:
            return False
        draining = self.hosts.draining()
        return all(w.host in draining for w in self.holders())

    def holders(self) -> list[WorkerRecord]:
        """Live workers known to hold the newest committed state."""
        if not self._holding:
            return []
        return [w for w in self.workers.values() if w.holds and w.state in _LIVE]

    def next_deadline(self) -> float | None:
        """When ``decide`` should next be called at the latest (None: only on events).

        May be early, never late: a worker heard since the last look at every worker moves its
        own deadline later, which is only seen at that deadline's decision (one more decision,
        instead of a look at every worker after every decision)."""
        if self._heard_floor == float("-inf") or self._now_floor == float("-inf"):
            self._heard_floor, self._now_floor = self._floors()
        times = []
        # Silence is judged on what was heard: as far behind as the driver was at the last decision.
        if self._heard_floor != float("inf"):
            times.append(self._heard_floor + self._behind)
        if self._now_floor != float("inf"):
            times.append(self._now_floor)
        if self._wait_started is not None:
            times.append(self._wait_started + self._wait_limit())
        if self._wait_reminder is not None:
            times.append(self._wait_reminder)
        if self._abort_reminder is not None and self.aborted and self._in[WorkerState.RUNNING]:
            times.append(self._abort_reminder)
        if self._stall_said is not None and self._stalls and not self.aborted:
            times.append(self._stall_said[1])
        expiry = self.hosts.next_expiry()
        if expiry is not None:
            times.append(expiry)
        return min(times) if times else None

    # --- bookkeeping ---------------------------------------------------------------------
    def _succeeded(self) -> bool:
        return self._in[WorkerState.SUCCEEDED] > 0

    def _wait_limit(self) -> float:
        """How long a wait for slots may last: --elastic-timeout, as horovodrun's (its first
        wait for -np slots included: an autoscaled cluster's nodes take minutes to appear);
        --start-timeout for the first round on a fixed host list, whose slots are all known."""
        return self.config.start_timeout if self._first_wait_is_short() else self.config.elastic_timeout

    def _first_wait_is_short(self) -> bool:
        return self.round < 0 and self.config.fixed_hosts

    def _failure(self, w: WorkerRecord, why: Reason, now: float) -> Decision:
        """A worker failed: its host is blacklisted, and a round it was in is aborted."""
        was_member = w.state is WorkerState.RUNNING and w.round == self.round
        # A failure that aborts the round (or comes while it is aborted) may be one of many:
        # its host's blacklisting is said once the round settles (``_say_held``).
        hold = was_member or self.aborted
        yield Move(w.id, WorkerState.FAILED, why)
        yield Event(Kind.WORKER_FAILED, {"host": w.host, "label": w.label, "rank": w.rank, "why": why})
        if why.cause is Cause.EXITED and why.fields.get("code") in SIGTERM_EXITS:
            # SIGTERM from outside the job (the driver's own stops move a worker out before they
            # signal it): a reclaim, a pod deletion, scancel. The host is going, as when a worker
            # says "leaving" from its handler. One that died of it before it had one (importing
            # torch, loading data, in its rendezvous) or past --sigterm-grace is no sign that the
            # host is bad: blacklisting it would keep out a pod that comes back under its name.
            yield from self._drain(w.host, "SIGTERM", now)
        elif w.host in self.hosts.draining() and why.cause in (Cause.EXITED, Cause.SILENT):
            # A host that said it is going (SIGTERM, discovery's notice) went before its workers
            # left: the notice came true, it is no fault of the host's. (Its own exception is.)
            yield Drain(w.host, now)
        elif not self.hosts.is_blacklisted(w.host):  # once per host: its other workers fail with it
            yield from self._blacklist(w.host, now, hold=hold)
        if was_member and not self.aborted:
            yield AbortRound(self.round, Reason(Cause.MEMBER_FAILED, {"label": w.label, "why": why}))

    def _drain(self, host: str, why: str, now: float, hold: bool = False) -> Decision:
        if host not in self.hosts.draining():
            yield Event(Kind.HOST_LEAVING, {"host": host, "why": why})
        yield Drain(host, now, hold)

    def _blacklist(self, host: str, now: float, straggler: bool = False, hold: bool = False) -> Decision:
        until = yield Blacklist(host, now)
        event = Event(Kind.HOST_BLACKLISTED, {"host": host, "seconds": None if until is None else until - now,
                                              "straggler": straggler})
        if hold:
            yield Mark("held", (event, until))
        else:
            yield event

    def _say_held(self, now: float, lifted: Collection[str] = ()) -> Decision:
        """Say the blacklistings held while the round settled, but those of ``lifted`` hosts,
        each with the time it has left now (the cooldown began at the failure)."""
        if self._held:
            held = list(self._held)
            yield Mark("held_said", None)
            for event, until in held:
                if event.fields["host"] not in lifted:
                    yield _as_of(event, until, now)

    @staticmethod
    def _failures(failed: list[WorkerRecord]) -> list[tuple[int, str, Reason | None]]:
        """(rank, label, why) of failed workers, by rank (for the job's failure reason)."""
        return [(w.rank, w.label, w.why) for w in sorted(failed, key=lambda w: w.rank)]

    def _static(self) -> bool:
        """A job of -np processes on a fixed host list: it can neither grow nor shrink."""
        c = self.config
        return c.fixed_hosts and c.min_np == c.np and c.max_np == c.np

    def _contact(self, w: WorkerRecord, now: float) -> None:
        """Worker ``w`` reached the driver: the job is elastic. If it had been taken for a job of
        plain processes (every worker slower to start than --start-timeout), it is elastic
        again (and says so: the console said otherwise), and the others get a new
        --start-timeout to reach the driver too."""
        self._first_contact()
        if self.plain and self.round < 0 and not any(o.exited for o in self.workers.values()):
            self.plain = False
            self._outbox.append(Event(Kind.ELASTIC_AFTER_ALL, {"label": w.label, "seconds": now - w.started_at}))
            self._rescan()
            for o in self.workers.values():
                if o.state is WorkerState.LAUNCHING:
                    o.started_at = now

    def _first_contact(self) -> None:
        if not self._contacted:
            self._contacted = True
            self._rescan()  # a worker that never reached the driver now fails at --start-timeout

    def _floors(self) -> tuple[float, float]:
        """The earliest a timeout of ``_timeouts`` can trip, in heard time and in now time
        (inf: none can), from what the workers are now."""
        heard = now = float("inf")
        start, limit = self.config.start_timeout, self.config.heartbeat_timeout
        # Workers that never reached a job of plain processes are left to run (see _timeouts).
        plain = self.plain and not self._contacted and self.round < 0
        for w in self.workers.values():
            if w.state is WorkerState.LAUNCHING and w.last_seen is None:
                if not plain:
                    heard = min(heard, w.started_at + start)
            elif w.bye is not None:
                if w.bye == "exit" and w.state in _LIVE and not w.exited:
                    now = min(now, w.bye_at + EXIT_GRACE)
            elif limit is not None and w.last_seen is not None and w.state in _BEATING:
                heard = min(heard, w.last_seen + limit)
        return heard, now

    def _timeouts(self, now: float, heard: float) -> Decision:
        if heard < self._heard_floor and now < self._now_floor:
            return  # no worker's timeout can have tripped yet
        yield from self._trip_timeouts(now, heard)
        self._heard_floor, self._now_floor = self._floors()

    def _trip_timeouts(self, now: float, heard: float) -> Decision:
        for w in list(self.workers.values()):
            # A process that never reached the driver within start_timeout is a failed launch,
            # unless no worker ever did: then they are plain processes, which run to their end.
            if (w.state is WorkerState.LAUNCHING and w.last_seen is None
                    and heard - w.started_at >= self.config.start_timeout):
                if not self._contacted and self.round < 0:
                    if not self.plain:
                        yield Mark("plain", True)
                        yield Event(Kind.PLAIN_COMMAND, {"limit": self.config.start_timeout})
                    continue
                why = Reason(Cause.NEVER_CONTACTED, {"limit": self.config.start_timeout})
                yield Kill(w.id, why)
                yield from self._failure(w, why, now)
            # A worker that went silent (SIGSTOP, deadlock, host off the network) is killed so
            # that its peers' collectives fail fast instead of waiting for their timeout.
            if w.bye is not None:
                # Its script ended (or it called hvd.shutdown()): no heartbeat comes any more.
                # An ending process gets EXIT_GRACE for its teardown; a process that left the
                # job with hvd.shutdown() runs on as the user's program, as under horovodrun.
                if w.bye == "exit" and w.state in _LIVE and not w.exited and now - w.bye_at >= EXIT_GRACE:
                    why = Reason(Cause.STUCK_EXITING, {"grace": EXIT_GRACE})
                    yield Kill(w.id, why)
                    yield from self._failure(w, why, now)
                continue
            limit = self.config.heartbeat_timeout
            if (limit is not None and w.last_seen is not None and heard - w.last_seen >= limit
                    and w.state in _BEATING):
                why = Reason(Cause.SILENT, {"silent_s": heard - w.last_seen, "limit": limit})
                yield Kill(w.id, why)
                yield from self._failure(w, why, now)

    def _why_gone(self, hosts: list[str]) -> dict[str, str]:
        """Why each of ``hosts`` is going or left out (a key of words._GOING), for the console."""
        draining, discovered = self.hosts.draining(), self.hosts.discovered()
        usable = dict(self.hosts.available())
        out = {}
        for h in hosts:
            if draining.get(h) == LEAVING:
                out[h] = "leaving_fixed" if self.config.fixed_hosts else "leaving"
            elif draining.get(h) == NOTICE:
                out[h] = "draining"
            elif self.hosts.is_blacklisted(h):
                out[h] = "blacklisted"
            elif h not in discovered:
                out[h] = "undiscovered"
            elif h in usable:
                out[h] = "resized"
            else:
                out[h] = "unusable"
        return out

    def held_out(self) -> dict[str, str]:
        """Hosts discovery lists that the job does not use, with why (a wait's lines name them:
        a host that is listed but left out is otherwise a mystery)."""
        usable = {h for h, _ in self.hosts.available()}
        listed = [h for h in self.hosts.discovered() if h not in usable]
        return self._why_gone(sorted(listed)) if listed else {}

    def _keep(self, kept: tuple[str, tuple[str, ...]] | None) -> Decision:
        """Note which going hosts the round keeps, and why (:attr:`kept`), when that changed."""
        if kept != self.kept:
            yield Mark("kept", kept)

    def _say_once(self, key: str, event: Event) -> Decision:
        """An event said once per round (decisions run often; the console hears it once)."""
        if key not in self._said:
            yield Mark("said", key)
            yield event

    # --- planning ------------------------------------------------------------------------
    def _assignment_order(self) -> list[tuple[str, int]]:
        """Usable hosts, those with surviving members of the current round first (by rank).

        The host manager's join order alone is not enough: a host can leave discovery (or be
        blacklisted with a cooldown) and come back while its worker survives, and it is then
        appended after newcomers. Ordering by surviving members keeps rank 0 on a worker that
        holds the newest state whenever one exists.
        """
        lowest: dict[str, int] = {}
        for wid in self.members.values():
            w = self.workers[wid]
            if w.state in _LIVE:
                lowest[w.host] = min(w.rank, lowest.get(w.host, w.rank))
        available = self.hosts.available()
        survivors = sorted((hs for hs in available if hs[0] in lowest), key=lambda hs: lowest[hs[0]])
        return survivors + [hs for hs in available if hs[0] not in lowest]

    def _target(self) -> list[SlotInfo]:
        """Every usable slot up to max_np: where workers should run (not to be modified).

        Recomputed only when its inputs changed: while N workers trickle in for a round, the
        inputs stay the same and building N places each time was half of every decision."""
        survivors = {w.key: w.rank for w in (self.workers[wid] for wid in self.members.values())
                     if w.state in _LIVE}
        order = self._assignment_order()
        key = (order, self.config.max_np, survivors)
        if self._target_cache is None or self._target_cache[0] != key:
            target = assign(order, self.config.max_np, survivors)
            self._target_cache = (key, target, frozenset(i.key for i in target))
        return self._target_cache[1]

    def _target_keys(self, target: list[SlotInfo]) -> frozenset[tuple[str, int]]:
        """The (host, slot) of every place in ``target`` (kept with the cached target)."""
        if self._target_cache is not None and self._target_cache[1] is target:
            return self._target_cache[2]
        return frozenset(i.key for i in target)

    def _by_key(self) -> dict[tuple[str, int], WorkerRecord]:
        return {w.key: w for w in self.workers.values() if w.state not in _GONE}

    def _plan(self, target: list[SlotInfo], ready: tuple[WorkerState, ...],
              holders: list[WorkerRecord]) -> list[tuple[tuple[str, int], WorkerRecord]]:
        """The round that could form now: the target's ready workers, in rank order.

        When holders are alive and none of them is among those, the lowest-ranked holder leads
        a hand-over round as rank 0 (within max_np). With holders alive and nobody ready to
        hand over to, no round can form: [] (the holders keep training, or wait).
        """
        by_key = self._by_key()
        chosen = [(i.key, by_key[i.key]) for i in target if i.key in by_key and by_key[i.key].state in ready]
        if not holders:
            return chosen
        holder_ids = {w.id for w in holders}
        among = [w for _, w in chosen if w.id in holder_ids]
        if among:
            # Rank 0 is the sync source of every ObjectState: it must be a holder even when a
            # newcomer that never synced comes first in host order (a round that failed in its sync).
            lead = min(among, key=self._seniority)
            return [(lead.key, lead)] + [(k, w) for k, w in chosen if w is not lead]
        if not chosen:
            return []
        lead = min(holders, key=self._seniority)
        cap = self.config.max_np if self.config.max_np is not None else len(chosen) + 1
        return [(lead.key, lead)] + chosen[:max(0, cap - 1)]

    def _seniority(self, w: WorkerRecord) -> tuple[bool, int, str]:
        """Members of the current round first, by rank: the usual rank 0 leads."""
        return (self.members.get(w.key) != w.id, w.rank, w.id)

    def _release_unneeded(self, keep: set[tuple[str, int]] | frozenset[tuple[str, int]]) -> Decision:
        """Dismiss waiting and kill launching workers whose slot is not in ``keep``."""
        if keep.issuperset(self._busy):
            return  # (a waiting or launching worker has not exited: its slot is busy)
        if not self._in[WorkerState.WAITING] and not self._in[WorkerState.LAUNCHING]:
            return  # the busy slots outside ``keep`` are processes on their way out: none to release
        for w in list(self.workers.values()):
            if w.key in keep:
                continue
            if w.state is WorkerState.WAITING:
                yield Move(w.id, WorkerState.LEFT)
                yield Dismiss(w.id, Reason(Cause.NO_PLACE, {"label": w.label}))
            elif w.state is WorkerState.LAUNCHING:
                yield Move(w.id, WorkerState.LEFT)
                yield Kill(w.id, Reason(Cause.NOT_NEEDED, {"label": w.label}))

    def _launch_missing(self, target: list[SlotInfo], now: float) -> Decision:
        # A slot is busy until its last process has exited, even a failed or dismissed one:
        # two processes on one slot would share its GPU.
        busy = self._busy  # (kept as workers are recorded and exit)
        if self._target_keys(target).issubset(busy):
            return
        for info in target:
            if info.key not in busy:
                wid = self._new_id()
                yield Record(wid, info, now)
                yield Launch(wid, info, joining=self.round >= 0)

    # --- decisions -----------------------------------------------------------------------
    def _plain_end(self) -> Decision:
        """A job of plain processes ends as horovodrun's: when every one has exited 0 (success),
        or at the first that fails (the others are stopped; the failure is the job's)."""
        failed = [w for w in self.workers.values() if w.state is WorkerState.FAILED]
        if failed:
            for w in self.workers.values():
                if not w.exited:
                    yield Kill(w.id, Reason(Cause.PEER_FAILED))
            yield Finish(False, Reason(Cause.PROCESSES_FAILED, {"failed": self._failures(failed)}))
        elif all(w.exited for w in self.workers.values()):
            yield Finish(True, Reason(Cause.ALL_EXITED_0, {"n": len(self.workers)}))

    def _finishing(self) -> Decision:
        for w in list(self.workers.values()):
            if w.state is WorkerState.WAITING:
                yield Move(w.id, WorkerState.LEFT)
                yield Dismiss(w.id, Reason(Cause.JOB_FINISHED))
            elif w.state is WorkerState.LAUNCHING:
                yield Move(w.id, WorkerState.LEFT)
                yield Kill(w.id, Reason(Cause.JOB_FINISHED))
        if any(w.state is WorkerState.RUNNING for w in self.workers.values()):
            return
        failed = [w for w in self.final_round() if w.state is WorkerState.FAILED]
        unfinished = sorted(w.rank for w in self.final_round() if w.state is not WorkerState.SUCCEEDED)
        if failed:  # a rank of the last round failed after another finished: the job failed
            yield Finish(False, Reason(Cause.FAILED_AFTER_SUCCESS, {"failed": self._failures(failed),
                                                                    "first": self._first_success}))
        elif unfinished and self._ended_early is not None:
            yield Finish(True, Reason(Cause.ENDED_EARLY, dict(self._ended_early, unfinished=unfinished)),
                         complete=False)
        else:
            yield Finish(True, Reason(Cause.FINISHED, {"rounds": self.round + 1, "resets": self.reset_count}))

    def _live_members(self) -> list[WorkerRecord]:
        """Members of the current round still in it (training, or asking for the next round)."""
        return [self.workers[wid] for wid in self.members.values() if self.workers[wid].state in _LIVE]

    def _during_round(self, target: list[SlotInfo], now: float) -> Decision:
        if self.aborted:
            # Wait for every member to report; the next round is decided then.
            yield from self._abort_pending(now)
            return
        yield from self._stalled(now)
        current = set(self.members)
        target_keys = self._target_keys(target)
        yield from self._release_unneeded(target_keys | current)
        if target_keys == current:
            yield from self._keep(None)
            return
        yield from self._stop_waiting()
        yield from self._launch_missing(target, now)
        # Members are in a round that held the state, so each holds it once synced; and a
        # notification takes effect only after the sync (at a check in the training loop).
        holders = [w for w in self.workers.values() if w.state in _LIVE and (w.holds or self.members.get(w.key) == w.id)]
        plan = self._plan(target, _LIVE, holders)
        keys = frozenset(k for k, _ in plan)
        gone = sorted({h for h, _ in current - target_keys})
        on_going = False
        if not plan:  # (only then: a decision runs after every batch of requests, at thousands of workers)
            signalled = {w.id for w in self._live_members() if w.leaving}
            staying = sorted((w for w in holders if w.id not in signalled and self.members.get(w.key) == w.id),
                             key=self._seniority)
            on_going = bool(signalled) and len(staying) >= self.config.min_np
        if on_going:
            # Every holder is on a going host and no newcomer is ready, but only some of them
            # got SIGTERM (one worker of a multi-slot host, whose host now counts as leaving).
            # Those leave at their next commit, as their line promised, and the others train on
            # without them: kept until a newcomer can take the state over, they kept the
            # signalled ones too, whose --sigterm-grace then ran out: a failure and a rollback.
            plan = [(w.key, w) for w in staying]
            keys = frozenset(k for k, _ in plan)
        if not plan:  # every holder is leaving and no newcomer is ready to take the state over
            if gone:
                yield from self._say_once("handover", Event(Kind.HANDOVER_PENDING, {
                    "hosts": gone, "why": self._why_gone(gone)}))
            yield from self._keep(("handover", tuple(gone)) if gone else None)
            return
        if keys == current:
            yield from self._keep(None)
            return
        if len(plan) < self.config.min_np:
            if gone:
                yield from self._say_once("below_min_np", Event(Kind.REMOVAL_HELD, {
                    "hosts": gone, "why": self._why_gone(gone), "min_np": self.config.min_np}, level="warning"))
            yield from self._keep(("min_np", tuple(gone)) if gone else None)
            return
        yield from self._keep(None)
        by_key = self._by_key()
        starting = any(i.key not in by_key or by_key[i.key].state is WorkerState.LAUNCHING for i in target)
        handover = not any(w.id in {h.id for h in holders} for k, w in plan if k in target_keys) and not on_going
        removal = bool(current - keys)
        if starting and (handover or not removal):
            return  # newcomers first: one reset for all of them (the survivors train meanwhile)
        if self._notified_target != keys:
            again = self._notified_target is not None  # the target changed since this round's first notice
            yield Mark("_notified_target", keys)
            added, removed = bool(keys - current), removal
            yield Notify(added=added, removed=removed)
            yield Event(Kind.HOSTS_UPDATED, {"added": added, "removed": removed, "handover": handover,
                                             "from_size": len(current), "to_size": len(keys), "again": again})

    def _abort_pending(self, now: float) -> Decision:
        """Name the members that have not left an aborted round, WAIT_REMINDER after the abort
        and every WAIT_REMINDER after that. A member leaves at its next collective or commit;
        one held where no abort reaches (inside NCCL's group formation, a long step of the
        script's own, a wait of its own) holds the whole job, which would otherwise say nothing."""
        if self._aborted_at is None:
            yield Mark("_aborted_at", now)
            yield Mark("_abort_reminder", now + WAIT_REMINDER)
            return
        if self._abort_reminder is None or now < self._abort_reminder:
            return
        yield Mark("_abort_reminder", now + WAIT_REMINDER)
        still = sorted((w for w in self._live_members() if w.state is WorkerState.RUNNING), key=lambda w: w.rank)
        if still:
            yield Event(Kind.ABORT_PENDING, {"round": self.round, "seconds": now - self._aborted_at, "why": self.abort_reason,
                                             "ranks": [[w.rank, w.label] for w in still[:8]],
                                             "more": max(0, len(still) - 8)}, level="warning")

    def _stalled(self, now: float) -> Decision:
        """Name the members outside every collective while another member has waited in one
        past its stall warning, and again every STALL_REPEAT while the same ones hold it.

        Why: a waiting worker knows only that it waits ("one of them is busy outside collectives
        or stuck"); which one is the question the user has, and gloo cannot answer it. Each
        heartbeat says whether its worker is in a collective, so the driver can: the round waits
        for the members that are in none (a rank evaluating or saving alone, a data loader, a
        print blocked on a console or SSH channel that nobody reads, a hang of the script's).
        Judged by the last heartbeat of each (at most a heartbeat interval old)."""
        if not self._stalls:
            return
        members = [w for w in self._live_members() if w.state is WorkerState.RUNNING and w.round == self.round]
        stalled = [w for w in members if w.stalled]
        if not stalled:  # the waits ended (or the stalled left): a new stall is a new episode
            yield Mark("_stalls", False)
            yield Mark("_stall_said", None)
            return
        outside = sorted((w for w in members if w.waiting is None), key=lambda w: w.rank)
        # Every member in a collective, past its stall warning, and they name different ones:
        # their scripts diverged (no agreement caught it: an internal collective, or one whose
        # layout was agreed earlier in the round), and gloo pairs what it is given until the
        # collective timeout. Each worker's own line says only that it waits.
        ops: dict[str, list[int]] = {}
        if not outside and all(w.stalled and w.waiting_in for w in members):
            for w in sorted(members, key=lambda w: w.rank):
                ops.setdefault(str(w.waiting_in), []).append(w.rank)
        diverged = len(ops) > 1
        named = frozenset(w.id for w in outside) | frozenset(f"{op} @ {ranks}" for op, ranks in ops.items() if diverged)
        said = self._stall_said
        if said is not None and said[0] == named and now < said[1]:
            return
        yield Mark("_stall_said", (named, now + STALL_REPEAT))
        if outside:  # (all in collectives: each waiting worker's own line says what it waits in)
            yield Event(Kind.ROUND_STALLED, {
                "round": self.round, "waited": max(w.waiting or 0.0 for w in stalled),
                "waiting": len(members) - len(outside), "ranks": [[w.rank, w.label] for w in outside[:8]],
                "more": max(0, len(outside) - 8)}, level="warning")
        elif diverged:
            groups = sorted(ops.items(), key=lambda g: g[1][0])
            yield Event(Kind.ROUND_DIVERGED, {
                "round": self.round, "waited": max(w.waiting or 0.0 for w in stalled),
                "groups": [[op, ranks[:8]] for op, ranks in groups[:4]], "more": max(0, len(groups) - 4),
                "until": sorted({w.waiting_until for w in members if w.waiting_until})[:3]},
                level="warning")

    def _stop_waiting(self) -> Decision:
        """Enough slots: the wait for them (and its reminders) is over."""
        if self._wait_started is not None or self._wait_reminder is not None:
            yield Mark("_wait_started", None)
            yield Mark("_wait_reminder", None)

    def _stragglers(self, now: float) -> Decision:
        """Name the hosts that drag the round (``stragglers.py`` says which); with
        --evict-stragglers, move them out like a discovery removal (the next commit, no rollback:
        ``_during_round`` notifies it) and blacklist them with the cooldown, unless that leaves
        fewer than --min-np workers or fewer samples per second. Holders need nothing more:
        every member of the round holds the state, and ``_plan`` keeps one as rank 0."""
        members = {w.id: w.host for w in (self.workers[wid] for wid in self.members.values())
                   if w.state is WorkerState.RUNNING}
        newly, recovered = yield JudgeStragglers(self.round, members, now)
        for h in recovered:
            yield Event(Kind.STRAGGLER, {"host": h, "action": "recovered"})
        usable = dict(self.hosts.available())
        going = [s for h, s in sorted(self.stragglers.named().items()) if h in usable]  # not leaving already
        why = self._keep_stragglers(going, members) if self.config.evict_stragglers and going else None
        evict = self.config.evict_stragglers and bool(going) and not why
        for s in newly:
            if not (evict and s in going):
                if why and s in going:
                    fields = dict(s.fields(), action="kept", kept=why)
                else:
                    fields = dict(s.fields(), action="named", hint=not self.config.evict_stragglers)
                yield Event(Kind.STRAGGLER, fields, level="warning")
        if evict:
            for s in going:
                yield Event(Kind.STRAGGLER, dict(s.fields(), action="evicted"), level="warning")
                yield from self._blacklist(s.host, now, straggler=True)

    def _keep_stragglers(self, going: list[Straggler], members: Mapping[str, str]) -> Reason | None:
        """Why the stragglers ``going`` must stay (None when they may go): --min-np, or the job
        would train fewer samples per second without them."""
        hosts = {s.host for s in going}
        workers = len(members)
        leaving = sum(1 for h in members.values() if h in hosts)
        left = workers - leaving
        if left < self.config.min_np:
            return Reason(Cause.KEEP_MIN_NP, {"count": len(going), "left": left, "min_np": self.config.min_np})
        rest = [p for h, p in self.stragglers.paces().items() if h not in hosts]
        compute, step = max(s.compute for s in going), max(s.step for s in going)
        if rest and not eviction_pays(workers, leaving, step, compute, max(rest)):
            after = step - max(0.0, compute - max(rest))
            return Reason(Cause.KEEP_SLOWER, {"count": len(going), "left": left, "after": after, "workers": workers,
                                              "step": step})
        return None

    def _between_rounds(self, target: list[SlotInfo], now: float) -> Decision:
        holders = self.holders()
        target_keys = self._target_keys(target)
        handing_over = bool(holders) and not any(w.key in target_keys for w in holders)
        keep = target_keys | ({w.key for w in holders} if handing_over else set())
        yield from self._release_unneeded(keep)  # first: who is left decides what comes next
        live = sum(self._in[s] for s in WorkerState if s not in _GONE)
        failed = [] if live else [w for w in self.workers.values() if w.state is WorkerState.FAILED]
        if not live and failed and self._unreached(failed):
            # Discovery listed hosts that did not answer (a spot node gone, or not up yet): no
            # worker ran, nothing was trained. The job waits for discovery to list others, as it
            # waits for any slot, rather than end 0.2 s after its start (their hosts are out:
            # blacklisted as any failed start).
            if "unreached" not in self._said:
                yield Mark("_wait_started", None)  # the wait it promises starts now
                yield Mark("_wait_reminder", None)
            yield from self._say_once("unreached", Event(Kind.NONE_REACHED, {
                "hosts": sorted({w.host for w in failed}), "limit": self.config.elastic_timeout}, level="warning"))
        elif not live and failed:
            if not self._resumable(failed):
                yield from self._say_held(now)
                # The failures that ended it: the latest round's (those of earlier rounds were
                # recovered from, and only crowd the line).
                # Causes before consequences: a rank whose collective failed because a peer died
                # often reports before the peer's own exit reaches the driver.
                latest = max(w.round for w in failed)
                last = sorted((w for w in failed if w.round == latest), key=lambda w: _consequence(w.why))
                yield Finish(False, Reason(Cause.ALL_FAILED, {"failed": [(w.label, w.why) for w in last[:8]]}))
                return
            if "collapse" not in self._said:
                # Losing everything at once says nothing about any one host: let them all back.
                # Their blacklistings are still held, unsaid, unless a host failed apart first.
                hosts = sorted({w.host for w in failed if w.round == self.round})
                unsaid = {e.fields["host"] for e, _ in self._held}
                for h in hosts:
                    if self.hosts.is_blacklisted(h) and h not in unsaid:
                        yield Event(Kind.HOST_WHITELISTED, {"host": h, "because": "collapse"})
                    yield Pardon(h, now)
                yield from self._say_held(now, lifted=hosts)
                # The wait it is about to promise ("up to --elastic-timeout") starts now, not
                # when the last survivors began to wait for others.
                yield Mark("_wait_started", None)
                yield Mark("_wait_reminder", None)
                target = self._target()
            yield from self._say_once("collapse", Event(Kind.WORKERS_LOST, {
                "limit": self.config.elastic_timeout, "min_np": self.config.min_np, "commit": self.durable_commit},
                level="warning"))
        yield from self._say_held(now)  # the round has settled: nobody is still in it
        # After every worker was lost, the job waits for hosts up to --elastic-timeout, as it
        # said; the known hosts failing again (they were the machines that went) must not end
        # it sooner, while discovery may still list new ones.
        resuming = ("collapse" in self._said or (self.round < 0 and "unreached" in self._said)) \
            and not self.config.fixed_hosts
        if self.hosts.all_blacklisted() and self.hosts.is_permanent() and not resuming:
            yield Finish(False, Reason(Cause.ALL_BLACKLISTED, {"hosts": list(self.hosts.blacklisted())}))
            return
        limit = self.config.reset_limit
        if self.round >= 0 and limit is not None and self.reset_count >= limit:
            yield Finish(False, Reason(Cause.RESET_LIMIT, {"limit": limit, "resets": self.reset_count}))
            return
        need = self.config.np if self.round < 0 else self.config.min_np
        draining = self.hosts.draining()
        if self.round >= 0 and handing_over and len(holders) >= need and all(
                w.state is WorkerState.WAITING and w.host in draining and not self.hosts.is_blacklisted(w.host)
                for w in holders):
            plan = self._plan(target, (WorkerState.WAITING,), holders)
            if len(plan) < need:
                # Every holder's host is going (a reclaim of the whole pool: each said "leaving"
                # in turn, and the first one's removal already stopped them) and nobody is ready to
                # take the state over: they keep training, as said, not wait idle until their
                # --sigterm-grace runs out. Durable copies go on (the one asked for now is taken
                # at their next commit); the hand-over comes when newcomers are ready.
                said = "handover" in self._said
                yield from self._stop_waiting()
                # Those that got SIGTERM themselves leave now, when the others are enough
                # (the notice in _during_round went out for that): they are dismissed.
                kept = [w for w in holders if not w.leaving]
                yield from self._form_round([(w.key, w) for w in sorted(kept if len(kept) >= need else holders,
                                                                        key=self._seniority)])
                if said:  # the same news in the round they keep training in: said (and a copy asked) once
                    yield Mark("said", "handover")
                return
        reachable = len(target) + (1 if handing_over and target else 0)
        if (self.round < 0 and self.config.min_np <= reachable < need and self.config.fixed_hosts
                and self.hosts.is_permanent()):
            # The first round's -np can never be met (a listed host failed to start, and none
            # comes back): start with what is left, as --min-np allows, not fail or wait.
            yield from self._say_once("np_never", Event(Kind.NP_NEVER, {"np": need, "reachable": reachable,
                                                                        "min_np": self.config.min_np},
                                                        level="warning"))
            need = self.config.min_np
        if self._relaxes_np(need) and (self._np_relaxed or (
                self.config.min_np <= reachable and self._wait_started is not None
                and now - self._wait_started >= self._wait_limit())):
            # The first round's wait for -np ran out, with --min-np slots or more usable: the job
            # starts with them, as --min-np allows and the wait's line said, rather than fail with
            # the slots it may train on idle (horovodrun fails); more join as discovery lists them.
            if not self._np_relaxed:
                yield Mark("_np_relaxed", True)
                yield Event(Kind.NP_NOT_MET, {"np": need, "reachable": reachable, "min_np": self.config.min_np,
                                              "limit": self._wait_limit()}, level="warning")
            need = self.config.min_np
        if reachable < need:
            # (With a durable copy, losing every worker of a round later lets every host back:
            # waiting is not for nothing.)
            if (self.config.fixed_hosts and self.hosts.is_permanent()
                    and (self.durable_commit is None or self.round < 0)):
                if self.round < 0 and self._in[WorkerState.LAUNCHING]:
                    return  # the others' starts first (bounded by --start-timeout): all of it is said
                yield Finish(False, self._never_enough(need))
            else:
                yield from self._wait(need, now)
            return
        # Enough slots. Workers still starting are bounded by --start-timeout on their own.
        yield from self._launch_missing(target, now)
        if self.round < 0:  # the first round: everyone planned, so that no reset follows at once
            yield from self._stop_waiting()
            if self._in[WorkerState.WAITING] < len(target_keys):
                return  # (while thousands trickle in: not a look at each of them per decision)
            by_key = self._by_key()
            if all(k in by_key and by_key[k].state is WorkerState.WAITING for k in target_keys):
                yield from self._form_round([(i.key, by_key[i.key]) for i in target])
            return
        plan = self._plan(target, (WorkerState.WAITING,), holders)
        if len(plan) >= need:
            yield from self._stop_waiting()
            yield from self._form_round(plan)
        else:
            # The rest are starting. A newcomer that reached the driver is bounded by nothing
            # else: one stuck in its script before it asks for its place (a hung data loader;
            # its heartbeats come from a thread) would hold the survivors, fewer than --min-np
            # without it, forever. They wait for it as for any slot: up to --elastic-timeout.
            yield from self._wait(need, now)

    def _relaxes_np(self, need: int) -> bool:
        """A wait for ``need`` slots is the first round's wait for -np from discovery, which
        starts with --min-np slots or more when it runs out (``_between_rounds``)."""
        return self.round < 0 and not self.config.fixed_hosts and self.config.min_np < need

    def _unreached(self, failed: list[WorkerRecord]) -> bool:
        """No round yet, and every worker tried failed to start because its host did not answer
        (``words.UNREACHABLE``), in a job whose discovery may list others. Not a configuration
        that fails on every host (a missing python, a refused key, a script's error): that one
        still ends the job at once, as it would after any wait."""
        return self.round < 0 and not self.config.fixed_hosts and all(
            w.why is not None and w.why.cause is Cause.EXITED
            and str(w.why.fields.get("detail", "")).startswith(UNREACHABLE) for w in failed)

    def _resumable(self, failed: list[WorkerRecord]) -> bool:
        """Every worker is gone, and a durable copy can carry on: some member of the last round
        was lost to the infrastructure (killed, silent, unreachable), not to its own exception."""
        return (self.durable_commit is not None and self.round >= 0
                and any(not w.script_error for w in failed if w.round == self.round))

    def _wait(self, need: int, now: float) -> Decision:
        """Not enough slots: wait up to the limit, saying what for (then every 30 s)."""
        flag = "--start-timeout" if self._first_wait_is_short() else "--elastic-timeout"
        usable = list(self.hosts.available())
        if self._wait_started is None:
            yield Mark("_wait_started", now)
        assert self._wait_started is not None  # (applied above)
        waited = now - self._wait_started
        # Only those a round could take: a survivor on a blacklisted host waits too, for nothing.
        where = {h for h, _ in usable}
        ready = sum(1 for w in self.workers.values() if w.state is WorkerState.WAITING and w.key[0] in where)
        if waited >= self._wait_limit():
            yield Mark("_wait_reminder", None)
            # (``ready``: with slots enough, what was missing is workers that asked for a place)
            yield Finish(False, Reason(Cause.TIMED_OUT, {"limit": self._wait_limit(), "flag": flag, "need": need,
                                                         "usable": usable, "out": self.held_out(), "ready": ready}))
            return
        if self._wait_reminder is not None and now < self._wait_reminder:
            return
        yield Mark("_wait_reminder", now + WAIT_REMINDER)
        left = self._wait_limit() - waited
        yield Event(Kind.WAITING_FOR_SLOTS, {"need": need, "ready": ready, "usable": usable, "left_s": left,
                                             "flag": flag, "out": self.held_out(),
                                             "min_np": self.config.min_np if self._relaxes_np(need) else None},
                    level="warning" if self.round >= 0 or waited > 0 else "info")

    def _never_enough(self, need: int) -> Reason:
        """Why a fixed host list can never give ``need`` slots again."""
        return Reason(Cause.NEVER_ENOUGH, {"flag": "-np" if self.round < 0 else "--min-np", "need": need,
                                           "usable": list(self.hosts.available()),
                                           "blacklisted": list(self.hosts.blacklisted()),
                                           "leaving": sorted(self.hosts.draining())})

    def _form_round(self, plan: list[tuple[tuple[str, int], WorkerRecord]]) -> Decision:
        infos = assign_keys([k for k, _ in plan])  # grouped by host: not the order of ``plan``
        by_key = dict(plan)
        workers = [by_key[i.key] for i in infos]
        previous = set(self.members.values())
        new_members = any(w.id not in previous for w in workers)
        must_sync = new_members or self.aborted or any(w.restored for w in workers)
        # A round that no holder joins: they all start from the same state, the script's own or
        # the durable copy, and hold it from now on: the script's at once (each has it), the
        # copy once they report a sync at a rendezvous (``has_state``). Rank 0 loads the copy
        # and the sync sends it to the others; a rank 0 that died first (a kill, a spot loss
        # as the job resumed) left them with the script's initial state. Counted as holders,
        # they made the next round "not fresh": no restore, no warning, training from step 0,
        # and the two-copy rotation replaced the copy the job had resumed from within seconds.
        fresh = not any(w.holds for w in workers)
        restore = fresh and self.durable_commit is not None
        if fresh and self.round >= 0 and not restore:
            yield Event(Kind.STATE_LOST, {"round": self.round + 1}, level="warning")
        backend, why = device_backend(self.config.backend, [(w.host, w.slot, w.gpus) for w in workers])
        if backend is None:  # --backend nccl where NCCL cannot run: every round would fail the same way
            yield Finish(False, Reason(Cause.NCCL_CANNOT_RUN, {"round": self.round + 1, "why": why}))
            return
        yield NewRound(self.round + 1, tuple(w.id for w in workers) if fresh and not restore else ())
        yield ForgetRounds(self.round)
        for info, w in zip(infos, workers):
            yield Assign(w.id, self.round, info, must_sync or restore, restore and info.rank == 0, backend)
        # Holders kept for a hand-over that are not in it, and anyone else waiting outside the
        # target, have no place now.
        keep = {i.key for i in self._target()} | set(self.members)
        for w in list(self.workers.values()):
            if w.state is WorkerState.WAITING and w.key not in keep:
                yield Move(w.id, WorkerState.LEFT)
                yield Dismiss(w.id, Reason(Cause.NO_PLACE, {"label": w.label}))
        hosts = sorted({i.host for i in infos})
        yield Event(Kind.ROUND_FORMED, {"round": self.round, "size": len(infos), "hosts": hosts})
        # Said when it matters and when it changes: a CPU job on machines without GPUs hears nothing.
        if (backend, why) != self._device_said and (self._device_said is not None or backend == "nccl"
                                                    or any(w.gpus for w in workers) or self.config.backend != "auto"):
            yield Mark("_device_said", (backend, why))
            yield Event(Kind.DEVICE_BACKEND, {"round": self.round, "backend": backend, "why": why})


def device_backend(requested: str, members: list[tuple[str, int, tuple[str, ...]]]) -> tuple[str | None, Reason]:
    """What carries CUDA tensors in a round of ``members`` (host, slot, and the GPUs NCCL could
    use there, as each worker reported: their UUIDs in device order), and why.

    A worker's GPU is its slot's (``slot % GPUs``, the device elasticrun binds it to). NCCL when
    ``requested`` allows it, every member has a GPU, and no two members would share one (NCCL
    refuses two ranks on one GPU: two "hosts" that are one machine, more workers than GPUs);
    gloo otherwise. (None, why) when ``--backend nccl`` was asked for and cannot run."""
    if requested == "gloo":
        return "gloo", Reason(Cause.GLOO_ASKED)
    users: dict[str, list[str]] = {}
    for host, slot, gpus in members:
        if not gpus:
            why = Reason(Cause.NO_GPU, {"place": f"{host}[{slot}]"})
            return (None, why) if requested == "nccl" else ("gloo", why)
        users.setdefault(gpus[slot % len(gpus)], []).append(f"{host}[{slot}]")
    shared = next((names for names in users.values() if len(names) > 1), None)
    if shared is not None:
        why = Reason(Cause.SHARED_GPU, {"places": shared[:2]})
        return (None, why) if requested == "nccl" else ("gloo", why)
    return "nccl", Reason(Cause.NCCL_ASKED if requested == "nccl" else Cause.GPU_EACH)
