"""The worker registry and round decisions: a pure state machine (no threads, sockets or clocks).

Every input is an event with the current time (``now``, monotonic seconds); every output is a
list of actions for the driver shell to carry out (launch, reply with an assignment, dismiss,
kill, notify, abort a round, finish). This keeps all decisions in one place that tests can
drive exhaustively, in the style of torch.distributed.elastic's dynamic rendezvous.

Lifecycle of a worker process::

    LAUNCHING --rendezvous--> WAITING --assigned--> RUNNING --rendezvous--> WAITING ...
        \\                         \\                   \\
         exit / start timeout       exit               exit 0 -> SUCCEEDED, else FAILED
    (dismissed or killed on purpose -> LEFT; its exit is then ignored)

A round ends when no worker is RUNNING in it: every member has reported (asked for the next
round after an interrupt or error, succeeded, or failed). Then the registry decides:

* any worker succeeded       -> the job finishes when the others have finished;
* no live worker is left     -> the job fails ("all workers failed");
* every host is blacklisted  -> the job fails (unless blacklisting has a cooldown);
* ``reset_limit`` reached    -> the job fails naming the limit;
* otherwise wait up to ``elastic_timeout`` for ``min_np`` slots, launch processes for new
  slots only, and start the next round when every slot of it has a waiting worker.

Graceful changes (hosts added or removed by discovery) do not stop a round: new workers are
launched first, and only when all of them have checked in is ``Notify`` emitted, so the
survivors keep training while the newcomers import torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Callable, Mapping, Union

from elasticrun.discovery.host_manager import HostManager
from elasticrun.driver.assignment import SlotInfo, assign


class WorkerState(enum.Enum):
    LAUNCHING = "launching"
    WAITING = "waiting"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    LEFT = "left"


_GONE = (WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.LEFT)


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
    why: str = ""  # how it failed, for the job's failure message
    last_seen: float | None = None  # last heartbeat or request; None until the first contact
    restored: bool = False  # it rolled back to its last commit before asking for this round

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.slot)

    @property
    def label(self) -> str:
        return f"{self.host}[{self.slot}]"


# --- actions -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    worker_id: str
    info: SlotInfo  # the planned place, given to the process as its launch environment


@dataclass(frozen=True)
class Assign:
    worker_id: str
    round: int
    info: SlotInfo
    new_members: bool  # someone in this round was not in the previous one
    # The state must be synced: new members, or the previous round failed or some member
    # rolled back (then ranks that took a host-update interrupt hold a newer commit).
    must_sync: bool = True


@dataclass(frozen=True)
class Dismiss:
    """Reply to a waiting worker that it has no place: it exits 0."""

    worker_id: str
    reason: str


@dataclass(frozen=True)
class Kill:
    worker_id: str
    reason: str


@dataclass(frozen=True)
class Notify:
    """Tell every worker that hosts changed: they interrupt at the same step and re-form."""

    added: bool
    removed: bool


@dataclass(frozen=True)
class AbortRound:
    """A member of ``round`` failed: every worker must abandon its collectives now."""

    round: int
    reason: str


@dataclass(frozen=True)
class Event:
    """Something worth telling the user or the event log."""

    kind: str
    message: str
    fields: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Finish:
    ok: bool
    reason: str


Action = Union[Launch, Assign, Dismiss, Kill, Notify, AbortRound, Event, Finish]


@dataclass(frozen=True)
class RegistryConfig:
    np: int
    min_np: int
    max_np: int | None
    reset_limit: int | None
    elastic_timeout: float
    start_timeout: float
    heartbeat_timeout: float | None = None  # None: never declare a silent worker hung


class Registry:
    """Workers, rounds and the decisions between them. Call an event method, run the actions."""

    def __init__(self, config: RegistryConfig, hosts: HostManager, new_id: Callable[[], str]):
        self.config = config
        self.hosts = hosts
        self._new_id = new_id
        self.workers: dict[str, WorkerRecord] = {}
        self.round = -1
        self.members: dict[tuple[str, int], str] = {}
        self.aborted = False
        self.reset_count = 0
        self.finished: Finish | None = None
        self._notified_target: frozenset[tuple[str, int]] | None = None
        self._wait_started: float | None = None
        # Batching (the driver's choice): events only update state and mark it dirty, and
        # flush() decides once per batch of messages. A round of N workers then costs O(N)
        # decisions instead of O(N) per arrival. Off by default: one decision per event.
        self.defer = False
        self._dirty = False

    # --- events --------------------------------------------------------------------------
    def discovered(self, hosts: Mapping[str, int], now: float) -> list[Action]:
        change = self.hosts.update(hosts, now)
        acts: list[Action] = []
        for h in change.added:
            acts.append(Event("host_added", f"host {h} added ({hosts[h]} slots)", {"host": h}))
        for h in change.removed:
            acts.append(Event("host_removed", f"host {h} removed", {"host": h}))
        for h in change.resized:
            acts.append(Event("host_resized", f"host {h} now has {hosts[h]} slots", {"host": h}))
        return acts + self._decide(now)

    def rendezvous(self, worker_id: str, now: float, error: str | None = None,
                   restored: bool = False) -> list[Action]:
        """A worker asks for its place in the next round (first time, after an interrupt, or
        after ``error``: a collective failed on its side). ``restored``: it rolled back to its
        last commit (after any failed collective)."""
        w = self.workers.get(worker_id)
        if w is None:
            return [Dismiss(worker_id, "this process is not part of the job")]
        if w.state in _GONE:
            return [Dismiss(worker_id, "the job has finished" if self.finished or self._succeeded()
                            else "this process has no place in the job any more")]
        acts: list[Action] = []
        if error and w.state is WorkerState.RUNNING and w.round == self.round and not self.aborted:
            # Its peers may be blocked in a collective with it (e.g. it gave up on its own
            # collective timeout): without an abort they would wait out theirs.
            self.aborted = True
            acts.append(AbortRound(self.round, f"{w.label} left round {self.round} after an error: {error}"))
        w.state, w.last_seen, w.restored = WorkerState.WAITING, now, restored
        return acts + self._decide(now)

    def heartbeat(self, worker_id: str, now: float) -> None:
        """A sign of life from a worker (no decision depends on it until it stops)."""
        w = self.workers.get(worker_id)
        if w is not None:
            w.last_seen = now

    def exited(self, worker_id: str, code: int, now: float, detail: str = "") -> list[Action]:
        w = self.workers.get(worker_id)
        if w is None or w.exited:
            return []
        w.exited, w.exit_code = True, code
        if w.state in (WorkerState.LEFT, WorkerState.FAILED):  # already accounted for
            return self._decide(now)
        if code == 0:
            w.state = WorkerState.SUCCEEDED
            return [Event("worker_succeeded", f"{w.label} (rank {w.rank}) finished", {"host": w.host})] \
                + self._decide(now)
        return self._fail(w, f"exited with code {code}" + (f": {detail}" if detail else ""), now) \
            + self._decide(now)

    def failing(self, worker_id: str, error: str, now: float) -> list[Action]:
        """A worker reports it is failing (before its exit, which is then only recorded)."""
        w = self.workers.get(worker_id)
        if w is None or w.state in _GONE:
            return []
        return self._fail(w, f"failed: {error}", now) + self._decide(now)

    def tick(self, now: float) -> list[Action]:
        """Time passed: cooldowns, start timeouts and waits may have expired."""
        change = self.hosts.refresh(now)
        acts: list[Action] = [Event("host_whitelisted", f"host {h} is back after its blacklist cooldown",
                                    {"host": h}) for h in change.added]
        self._dirty = False
        return acts + self._reconcile(now)

    @property
    def dirty(self) -> bool:
        """Events arrived (with ``defer``) that no decision has looked at yet."""
        return self._dirty

    def flush(self, now: float) -> list[Action]:
        """With ``defer``: decide once for every event since the last flush."""
        if not self._dirty:
            return []
        self._dirty = False
        return self._reconcile(now)

    def _decide(self, now: float) -> list[Action]:
        if self.defer:
            self._dirty = True
            return []
        return self._reconcile(now)

    # --- queries -------------------------------------------------------------------------
    def live(self) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if not w.exited]

    def next_deadline(self) -> float | None:
        """When ``tick`` should next be called at the latest (None: only on events)."""
        times = [w.started_at + self.config.start_timeout for w in self.workers.values()
                 if w.state is WorkerState.LAUNCHING]
        if self.config.heartbeat_timeout is not None:
            times += [w.last_seen + self.config.heartbeat_timeout for w in self.workers.values()
                      if w.last_seen is not None and w.state in (WorkerState.WAITING, WorkerState.RUNNING)]
        if self._wait_started is not None:
            times.append(self._wait_started + self._wait_limit())
        expiry = self.hosts.next_expiry()
        if expiry is not None:
            times.append(expiry)
        return min(times) if times else None

    # --- decisions -----------------------------------------------------------------------
    def _succeeded(self) -> bool:
        return any(w.state is WorkerState.SUCCEEDED for w in self.workers.values())

    def _wait_limit(self) -> float:
        return self.config.start_timeout if self.round < 0 else self.config.elastic_timeout

    def _fail(self, w: WorkerRecord, why: str, now: float) -> list[Action]:
        was_member = w.state is WorkerState.RUNNING and w.round == self.round
        w.state, w.why = WorkerState.FAILED, why
        until = self.hosts.blacklist(w.host, now)
        when = "permanently" if until is None else f"for {until - now:.1f} s"
        acts: list[Action] = [
            Event("worker_failed", f"{w.label} (rank {w.rank}) {why}", {"host": w.host, "rank": w.rank}),
            Event("host_blacklisted", f"host {w.host} blacklisted {when}", {"host": w.host}),
        ]
        if was_member and not self.aborted:
            self.aborted = True
            acts.append(AbortRound(self.round, f"{w.label} {why}"))
        return acts

    def _finish(self, ok: bool, reason: str) -> list[Action]:
        self.finished = Finish(ok, reason)
        return [self.finished]

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
            if w.state in (WorkerState.RUNNING, WorkerState.WAITING):
                lowest[w.host] = min(w.rank, lowest.get(w.host, w.rank))
        available = self.hosts.available()
        survivors = sorted((hs for hs in available if hs[0] in lowest), key=lambda hs: lowest[hs[0]])
        return survivors + [hs for hs in available if hs[0] not in lowest]

    def _by_key(self) -> dict[tuple[str, int], WorkerRecord]:
        return {w.key: w for w in self.workers.values() if w.state not in _GONE}

    def _launch_missing(self, target: list[SlotInfo], now: float) -> list[Action]:
        # A slot is busy until its last process has exited, even a failed or dismissed one:
        # two processes on one slot would share its GPU.
        busy = {w.key for w in self.workers.values() if not w.exited}
        acts: list[Action] = []
        for info in target:
            if info.key not in busy:
                wid = self._new_id()
                self.workers[wid] = WorkerRecord(wid, info.host, info.slot, WorkerState.LAUNCHING, now,
                                                 rank=info.rank)
                acts.append(Launch(wid, info))
        return acts

    def _release_unneeded(self, keep: set[tuple[str, int]]) -> list[Action]:
        """Dismiss waiting and kill launching workers whose slot is not in ``keep``."""
        acts: list[Action] = []
        for w in self.workers.values():
            if w.key in keep:
                continue
            if w.state is WorkerState.WAITING:
                w.state = WorkerState.LEFT
                acts.append(Dismiss(w.id, f"no place for {w.label} in the next round"))
            elif w.state is WorkerState.LAUNCHING:
                w.state = WorkerState.LEFT
                acts.append(Kill(w.id, f"{w.label} is no longer needed"))
        return acts

    def _reconcile(self, now: float) -> list[Action]:
        if self.finished is not None:
            return []
        acts: list[Action] = []
        # A process that never reached the driver within start_timeout is a failed launch.
        for w in list(self.workers.values()):
            if w.state is WorkerState.LAUNCHING and now - w.started_at >= self.config.start_timeout:
                acts.append(Kill(w.id, "start timeout"))
                acts += self._fail(w, f"did not contact the driver within --start-timeout "
                                      f"{self.config.start_timeout:g} s", now)
            # A worker that went silent (SIGSTOP, deadlock, host off the network) is killed so
            # that its peers' collectives fail fast instead of waiting for their timeout.
            limit = self.config.heartbeat_timeout
            if (limit is not None and w.last_seen is not None and now - w.last_seen >= limit
                    and w.state in (WorkerState.WAITING, WorkerState.RUNNING)):
                acts.append(Kill(w.id, "heartbeat timeout"))
                acts += self._fail(w, f"sent no heartbeat for {now - w.last_seen:.1f} s "
                                      f"(--heartbeat-timeout {limit:g} s); it is hung or unreachable", now)

        if self._succeeded():
            return acts + self._finishing()

        running = [w for w in self.workers.values() if w.state is WorkerState.RUNNING]
        survivors = {w.key: w.rank for w in (self.workers[wid] for wid in self.members.values())
                     if w.state in (WorkerState.RUNNING, WorkerState.WAITING)}
        target = assign(self._assignment_order(), self.config.max_np, survivors)
        target_keys = {s.key for s in target}
        if running:
            return acts + self._during_round(target, target_keys, now)
        return acts + self._between_rounds(target, target_keys, now)

    def _finishing(self) -> list[Action]:
        acts: list[Action] = []
        for w in self.workers.values():
            if w.state is WorkerState.WAITING:
                w.state = WorkerState.LEFT
                acts.append(Dismiss(w.id, "the job has finished"))
            elif w.state is WorkerState.LAUNCHING:
                w.state = WorkerState.LEFT
                acts.append(Kill(w.id, "the job has finished"))
        if not any(w.state is WorkerState.RUNNING for w in self.workers.values()):
            failed = [w for w in self.workers.values() if w.state is WorkerState.FAILED and w.round == self.round]
            note = f" ({len(failed)} worker(s) of the last round failed)" if failed else ""
            acts += self._finish(True, f"training finished after {self.round + 1} round(s), "
                                       f"{self.reset_count} reset(s){note}")
        return acts

    def _during_round(self, target: list[SlotInfo], target_keys: set, now: float) -> list[Action]:
        if self.aborted:
            return []  # wait for every member to report; the next round is decided then
        current = set(self.members)
        acts = self._release_unneeded(target_keys | current)
        if target_keys == current:
            return acts
        self._wait_started = None  # enough slots now: a later shortage starts a fresh wait
        acts += self._launch_missing(target, now)
        by_key = self._by_key()
        ready = all(k in by_key and by_key[k].state in (WorkerState.WAITING, WorkerState.RUNNING)
                    for k in target_keys)
        frozen = frozenset(target_keys)
        if ready and self._notified_target != frozen:
            self._notified_target = frozen
            added, removed = bool(target_keys - current), bool(current - target_keys)
            acts.append(Notify(added=added, removed=removed))
            acts.append(Event("hosts_updated",
                              f"membership changing from {len(current)} to {len(target_keys)} worker(s)",
                              {"added": added, "removed": removed}))
        return acts

    def _between_rounds(self, target: list[SlotInfo], target_keys: set, now: float) -> list[Action]:
        acts = self._release_unneeded(target_keys)  # first: who is left decides what comes next
        live = [w for w in self.workers.values() if w.state not in _GONE]
        failed = [w for w in self.workers.values() if w.state is WorkerState.FAILED]
        if not live and failed:
            detail = "; ".join(f"{w.label} {w.why}" for w in failed[-8:])
            members = [self.workers[wid] for wid in self.members.values()]
            dismissed = [w for w in members if w.state is WorkerState.LEFT]
            if not dismissed:
                return acts + self._finish(False, f"all workers failed ({detail})")
            # Survivors on a blacklisted host leave with it, and with them the job's state.
            return acts + self._finish(False, "no worker is left to continue from: " + detail + "; "
                                + ", ".join(w.label for w in dismissed) + " left with blacklisted host(s) "
                                + ", ".join(sorted({w.host for w in dismissed})))
        if self.hosts.all_blacklisted() and self.hosts.is_permanent():
            return acts + self._finish(False, "every host is blacklisted after failures: "
                                       + ", ".join(self.hosts.blacklisted()))
        limit = self.config.reset_limit
        if self.round >= 0 and limit is not None and self.reset_count >= limit:
            return acts + self._finish(False, f"reset limit {limit} exceeded: the job needed another reset "
                                       f"after {self.reset_count} (raise --reset-limit to allow more)")
        need = self.config.np if self.round < 0 else self.config.min_np
        if len(target) < need:
            if self._wait_started is None:
                self._wait_started = now
            if now - self._wait_started >= self._wait_limit():
                flag = "--start-timeout" if self.round < 0 else "--elastic-timeout"
                hosts = ", ".join(f"{h}:{s}" for h, s in self.hosts.available()) or "none"
                return acts + self._finish(False, f"timed out after {self._wait_limit():g} s ({flag}) waiting for "
                                           f"{need} slots; usable hosts: {hosts}")
            return acts
        self._wait_started = None  # enough slots now: a later shortage starts a fresh wait
        acts += self._launch_missing(target, now)
        by_key = self._by_key()
        if all(k in by_key and by_key[k].state is WorkerState.WAITING for k in target_keys):
            acts += self._form_round(target, by_key)
        return acts

    def _form_round(self, target: list[SlotInfo], by_key: dict) -> list[Action]:
        previous = set(self.members.values())
        new_members = any(by_key[i.key].id not in previous for i in target)
        must_sync = new_members or self.aborted or any(by_key[i.key].restored for i in target)
        self.round += 1
        if self.round > 0:
            self.reset_count += 1
        self.members = {}
        self.aborted = False
        self._notified_target = None
        self._wait_started = None
        acts: list[Action] = []
        for info in target:
            w = by_key[info.key]
            w.state, w.round, w.rank = WorkerState.RUNNING, self.round, info.rank
            self.members[info.key] = w.id
            acts.append(Assign(w.id, self.round, info, new_members, must_sync))
        hosts = sorted({i.host for i in target})
        acts.append(Event("round_formed", f"round {self.round}: {len(target)} worker(s) on {len(hosts)} host(s)",
                          {"size": len(target), "hosts": hosts}))
        return acts
