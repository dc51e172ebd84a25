"""The runtime inside a training process: membership, the process group, updates and aborts.

One :class:`Runtime` per process (``init()`` creates it). At every rendezvous it gets the
worker's place in the next round from the driver, makes that round's
:class:`~elasticrun.worker.rounds.Round` (what the collectives take: group, rank, size,
abort check, timeout) and forms its gloo process group on a fresh namespace of the
driver-hosted store. It hears from the driver on a control thread:

* ``hosts_updated`` notifications, each with a strictly increasing timestamp. They are only
  *recorded* here (in :class:`~elasticrun.worker.host_updates.HostUpdates`, which decides);
  ``check_host_updates()`` turns them into ``HostsUpdatedInterrupt`` on every rank at the same
  call, by agreeing on them with one tiny allreduce or through flags the gradient allreduce
  carried.
* ``round_aborted``: a member of the round failed. Collectives poll this (through their
  Round) and give up at once, because ranks that were not talking to the dead peer would
  otherwise sit in their collective until its timeout.

Without the driver's environment (``python train.py``), the runtime runs a single-process
job so scripts can be debugged without the launcher.
"""

from __future__ import annotations

import atexit
import collections
import ctypes
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import zmq

from elasticrun.common.events import Kind
from elasticrun.common import deathnotice, env, limits, liveness, settings
from elasticrun.common.protocol import Message, copy_id
from elasticrun.worker import collectives, devices, durable, forks, join, prefetch, rounds, trace, waiting
from elasticrun.worker.client import ControlChannel, DriverClient, DriverTimeout, job_keys
from elasticrun.worker.exceptions import DeviceGroupError, HorovodInternalError, HostsUpdatedInterrupt
from elasticrun.worker.durable import CommittedState, CopyRequests, DurableSender, HandOff
from elasticrun.worker.host_updates import HostUpdates
from elasticrun.worker.pace import StepPace
from elasticrun.worker.rounds import Round
from elasticrun.worker.step_flags import StepFlags
from elasticrun.worker.store import DriverStore

log = logging.getLogger("elasticrun.worker")

forks.after_torch_import()  # in a DataLoader's spawn/forkserver worker: torch's handlers give SIGTERM back


#: How long an old round's process group is kept before it is released (see below).
_DROP_DELAY = 1.0


def _drop_in_background(obj: Any, works: list[Any] | None = None, delay: float = _DROP_DELAY,
                        at_most: float = 600.0) -> None:
    """Release an old process group off the training thread, ``delay`` seconds from now, and
    not before ``works`` (the round's collectives still running: see Round.track) have ended,
    or ``at_most`` seconds have passed (past gloo's own timeout, which ends a gloo collective:
    a work that never says it ended, an aborted NCCL one, does not hold the group for good).

    Why later: the old group usually still has a collective blocked on a peer that is alive
    but gone to the next round (or leaving), and gloo's teardown waits for it. Measured with
    2 hosts x 2 slots, tearing it down while the next round's group forms held that formation
    up until the blocked collective was released: 27-118 ms instead of 3 ms, and kill -> first
    step 155 ms instead of 40 ms. A second later the peers have moved on or exited, and the
    teardown neither waits nor gets in the way. A collective still running then (a peer alive
    but silent, until gloo's timeout) keeps its group and tensors another ``delay``.
    """
    _schedule_drop([obj, works or [], time.monotonic() + at_most], delay, again=False)


def _schedule_drop(holder: list[Any], delay: float, again: bool = True) -> None:
    global _drops_settled
    with _drops_lock:
        if not again:
            _drops_settled = False  # a new round after hvd.shutdown(): releases resume
        elif _drops_settled:  # a wait for a collective that ended only as the process ends: kept for good
            _keep_for_good(holder)
            return
        timer = threading.Timer(delay, _drop_when_done, (holder, delay))
        timer.daemon = True
        timer.name = "elasticrun-drop-pg"
        _pending_drops[:] = [(t, h) for t, h in _pending_drops if (h or t.is_alive()) and h is not holder]
        _pending_drops.append((timer, holder))
        timer.start()


def _drop_when_done(holder: list[Any], delay: float) -> None:
    """The timer's end: release the old round's groups, or look again later while one of its
    collectives still runs (gloo's own timeout ends it at the latest)."""
    if time.monotonic() < holder[2] and any(not rounds.completed(w) for w in holder[1]):
        _schedule_drop(holder, delay)
    else:
        holder.clear()


#: Old groups still waiting for their release, as (timer, holder), and whether the process
#: is ending (no more timers then: what is left is kept).
_pending_drops: list[tuple[threading.Timer, list[Any]]] = []
_drops_lock = threading.Lock()
_drops_settled = False


def _settle_drops(timeout: float = 5.0) -> None:
    """At exit: never let an old group's teardown run on a daemon thread while the interpreter
    finalizes. Python ends such a thread with pthread_exit when it asks for the GIL back, which
    inside gloo's (noexcept) destructor is std::terminate: "terminate called without an active
    exception", exit code -6. Releases not started yet are cancelled and the groups, with the
    collectives their round left running, kept (the process is ending: the OS closes their
    sockets); releases under way are waited for."""
    global _drops_settled
    deadline = time.monotonic() + timeout
    with _drops_lock:
        _drops_settled = True
        pending = list(_pending_drops)
        _pending_drops.clear()
    for timer, holder in pending:
        timer.cancel()
        if holder:
            _keep_for_good(holder)
        timer.join(max(0.0, deadline - time.monotonic()))


def _keep_for_good(obj: Any) -> None:
    """Never free ``obj``, not even in the interpreter's teardown (a process ending)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


_MASTER_KEY = "elasticrun/master"


def _free_port() -> int:
    """A TCP port free on this machine now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _seconds(name: str, default: float) -> float:
    """A timeout the driver passes in the environment; the job's default when it does not."""
    return float(os.environ.get(name, default))


#: A NCCL formation still under way this long after its round was aborted is stuck (a peer was
#: lost while it formed; NCCL's blocking init cannot be aborted): the worker says so.
FORMATION_STUCK_AFTER = 30.0

#: A NCCL formation that fails the same way this many rounds in a row, never aborted, ends
#: the worker (DeviceGroupError) instead of resetting the job forever.
FORMATION_ATTEMPTS = 3


def formation_failed(failures: list[str], error: str | None) -> list[str]:
    """Record a failed NCCL formation in ``failures`` (in place; also returned): ``error``,
    or None when its round was aborted (a peer died: a new round may well succeed). Only the
    same failure again (numbers aside: ranks and devices), round after round, adds up; any
    other starts the count anew."""
    if error is None:
        failures.clear()
        return failures
    # All of it, on one line: NCCL's cause comes last ("Last error: Duplicate GPU detected ...").
    first = " ".join(line.strip() for line in error.splitlines() if line.strip())[:800] or "(no message)"
    if failures and re.sub(r"\d+", "#", failures[-1]) != re.sub(r"\d+", "#", first):
        failures.clear()
    failures.append(first)
    return failures


class Runtime:
    """A worker's view of the elastic job. Use :func:`init` / :func:`get`."""

    def __init__(self, in_job: bool = True) -> None:
        # in_job False: this process is no worker but one a worker started (forks.worker_above):
        # it answers with that worker's place (inherited environment) and joins nothing.
        self.standalone = not in_job or env.CONTROL_ADDR not in os.environ
        # Launched into a running job: init() takes no place; join() does, when one is first needed.
        self.joining = not self.standalone and os.environ.get(env.JOINING) == "1"
        self._join_lock = threading.Lock()
        self.hostname = os.environ.get(env.HOSTNAME, socket.gethostname())
        self.slot = int(os.environ.get(env.SLOT, "0"))
        self.worker_id = os.environ.get(env.WORKER_ID, "standalone")
        self.local_rank = int(os.environ.get(env.LOCAL_RANK, "0"))
        self.local_size = int(os.environ.get(env.LOCAL_SIZE, "1"))
        self.cross_rank = int(os.environ.get(env.CROSS_RANK, "0"))
        self.cross_size = int(os.environ.get(env.CROSS_SIZE, "1"))
        self.homogeneous = True  # every host of the round has as many workers (the driver says, each round)
        self.collective_timeout = _seconds(env.COLLECTIVE_TIMEOUT, settings.DEFAULT_COLLECTIVE_TIMEOUT)
        self.stall = rounds.stall_check(os.environ, self.collective_timeout)  # Horovod's stall check
        self.rendezvous_timeout = _seconds(env.RENDEZVOUS_TIMEOUT, settings.DEFAULT_RENDEZVOUS_TIMEOUT)
        self.rendezvous_count = 0
        self.must_sync = True  # the driver's word for this round: sync() even after removals only
        # This process has synced in some round (elastic.run entered the training function), so
        # it holds the job's state; the driver keeps such workers until the state is handed over.
        self.has_state = False
        self._store: Any = None
        self._lock = threading.Lock()  # what the control thread writes: host updates, aborts
        self.host_updates = HostUpdates()
        self.copy_requests = CopyRequests()  # the driver's requests for a durable copy
        self.steps = 0  # optimizer steps applied in this job (restored with a durable copy)
        self.pace = StepPace()  # this round's recent step and allreduce-wait times, for the heartbeats
        self.restore = False  # the driver's word for this round: load the newest durable copy first
        self.active_state: Any = None  # the state elastic.run is training (its commit count)
        self.device: Any = None  # this rank's GPU, once a NCCL group was formed on it (it never changes)
        self.formation_failures: list[str] = []  # the last NCCL formations that failed, none aborted
        self._forming: int | None = None  # the round whose NCCL group this worker is forming now
        self._gpus: list[str] | None = None  # GPUs NCCL could use here (asked once, at the first rendezvous)
        self._durable: HandOff | None = None  # with --checkpoint-dir: this rank's part in durable copies
        self._keys: Any = None
        self._leaving: float | None = None  # when SIGTERM came (the worker is leaving)
        self._driver_stopping = False  # the driver said it stops the job (its SIGTERM is no reclaim)
        self._leaving_heard = threading.Event()  # the driver answered our "leaving"
        self._aborted: dict[int, str] = {}
        # The group of every round this worker is alone in: one rank has no peer that could die
        # or hang it, so it outlives rounds (forming one costs a millisecond of a recovery).
        self._solo_pg: Any = None
        # Events for the driver's event log: appended here, shipped by the control thread.
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=10_000)
        # Round -1: the place the launcher gave, until the first rendezvous (not installed).
        self._round = self._new_round(-1, int(os.environ.get(env.RANK, "0")), int(os.environ.get(env.SIZE, "1")))
        self._ctx: zmq.Context | None = None
        self._client: DriverClient | None = None
        self._control: ControlChannel | None = None
        if not self.standalone:
            self._connect()

    # --- connection -------------------------------------------------------------------------
    def _connect(self) -> None:
        # The keys come through a pipe the launcher handed over (never the environment, which
        # /proc/PID/environ shows and the user's subprocesses inherit); read once, then closed.
        keys = self._keys = job_keys()
        job_id = os.environ[env.JOB_ID]
        self._ctx = zmq.Context()
        self._client = DriverClient(self._ctx, os.environ[env.CONTROL_ADDR], keys, job_id, "worker")
        if env.DURABLE_ADDR in os.environ:  # --checkpoint-dir: this rank sends its shards there
            self._durable = HandOff(DurableSender(self._ctx, os.environ[env.DURABLE_ADDR], keys, job_id))
        self._control = ControlChannel(
            self._ctx, os.environ[env.CONTROL_ADDR], keys, job_id,
            heartbeat_body=self._heartbeat_body,
            on_message=self._on_message, on_driver_lost=self._on_driver_lost,
            interval=_seconds(env.HEARTBEAT_INTERVAL, settings.DEFAULT_HEARTBEAT_INTERVAL),
            driver_timeout=_seconds(env.DRIVER_TIMEOUT, settings.DEFAULT_DRIVER_TIMEOUT),
            take_events=self._take_events, driver_stopped=_driver_stopped)
        self._control.start()

    def _heartbeat_body(self) -> dict[str, Any]:
        body = {"worker": self.worker_id, "round": self.round, "steps": self.steps, "commit": self.commit_seq()}
        pace = self.pace.summary()  # medians of the recent steps: the driver names stragglers from them
        if pace is not None:
            body["pace"] = pace
        r = self._round
        since = r.waiting_since
        if since is not None:  # in a collective: past the stall warning, the driver names who is not
            waited = time.monotonic() - since
            body["waiting"] = round(waited, 1)
            if r.stall.warning is not None and waited >= r.stall.warning:
                body["stalled"] = True
                body["in"] = r.waiting_in[:80]  # (ranks stalled in different ones took different paths)
                body["until"] = waiting.gives_up(r)  # (so the driver's line names the limit kept)
        return body

    # --- the current round ------------------------------------------------------------------
    @property
    def current_round(self) -> Round:
        """The round this worker is in (replaced at every rendezvous)."""
        return self._round

    @property
    def round(self) -> int:
        return self._round.number

    @property
    def rank(self) -> int:
        return self._round.rank

    @property
    def size(self) -> int:
        return self._round.size

    @property
    def pg(self) -> dist.ProcessGroupGloo | None:
        return self._round.pg

    def _new_round(self, number: int, rank: int, size: int, pg: dist.ProcessGroupGloo | None = None) -> Round:
        return Round(number, rank, size, collective_timeout=self.collective_timeout, stall=self.stall,
                     host_updates=self.host_updates,
                     aborted=self._aborted, emit=self.emit, pg=pg, copy_requests=self.copy_requests,
                     copy_busy=self.copy_busy, step_done=self.step_done)

    def commit_seq(self) -> int:
        """The commit counter of the state being trained (0 before elastic.run)."""
        state = self.active_state
        return int(getattr(state, "commit_seq", 0)) if state is not None else 0

    def gpus(self) -> list[str]:
        """The GPUs NCCL could use here ([]: none, or --backend gloo), for the driver's choice of
        what carries CUDA tensors: all that are visible until this worker has formed a NCCL group,
        then the one it used (the driver assumed slot % GPUs; a script that chose otherwise is
        then known as it is). Asked once: it initializes the CUDA driver."""
        if self._gpus is None:
            self._gpus = devices.nccl_gpus()
        if self.device is not None and self._gpus:
            return [devices.gpu_name(self.device.index or 0)]
        return self._gpus

    @property
    def job_ending(self) -> bool:
        """The driver said it stops the job: a peer's collective failing now is that stop."""
        return self._driver_stopping

    def copy_busy(self) -> bool:
        """This rank cannot hand a durable copy off now: its last one is still being sent, or
        it does not hold the job's state yet (a commit before ``elastic.run`` synced it, or
        before rank 0 restored the durable copy it was told to: a copy then would replace the
        very copy the job resumes from with the script's initial state)."""
        return (self._durable is not None and self._durable.busy) or not self.has_state or self.restore

    def step_done(self, wait: float = 0.0) -> None:
        """The DistributedOptimizer reduced a step's gradients (with the agreed flags), after
        waiting ``wait`` s for them, and is about to apply them. The step's time and wait go
        to :attr:`pace`. A host update agreed in that allreduce is *not* acted on here: as in
        Horovod, the interrupt comes at the script's next ``commit()`` or
        ``check_host_updates()``, which then needs no collective of its own. The script says
        where its state is whole: a step interrupted inside ``step()`` lost the batch a script
        recorded before ``step()`` (Horovod's ImageNet example does), committed the buffers its
        forward pass had updated (BatchNorm's statistics), and left its gradients to a loop
        that zeroes them after ``step()``.
        """
        self.pace.record(time.perf_counter(), wait)
        r = self._round
        self.steps += 1
        if r.awaiting_first_step:  # a world of one reduces nothing: its first step is this one
            r.step_completed("optimizer step")

    def enter_round(self, number: int, rank: int, size: int, pg: dist.ProcessGroupGloo | None = None,
                    store: dist.Store | None = None) -> Round:
        """Make round ``number`` (this worker: ``rank`` of ``size``) the current one, for this
        runtime and for the collectives. The rendezvous calls it with the driver's assignment
        and then forms the group; tests that form their own group pass it as ``pg`` (and the
        store it was formed on, for process sets and join)."""
        old = self._round
        kept = old.pg if old.pg is not self._solo_pg else None
        running = old.unfinished()
        if kept is not None or old.subgroups or running:
            _drop_in_background((kept, dict(old.subgroups)), running,
                                at_most=rounds.group_timeout(old.collective_timeout).total_seconds() + 10.0)
        for group in list(old.device_groups.values()):  # never waited on: the old round may hold a hung kernel
            devices.abort_soon(group, f"round {old.number} is over")
        old.device_groups.clear()
        self._round = self._new_round(number, rank, size, pg)
        self._round.store = store
        self._round.form_device_group = self._form_device_group
        self.pace.new_round(number)
        rounds.install(self._round)
        return self._round

    def export_environment(self, master: str | None = None) -> None:
        """Put this worker's place in the current round into ``os.environ``, under elasticrun's,
        Horovod's and torch.distributed's names, for libraries that read them (at every reset).

        ``MASTER_ADDR``/``MASTER_PORT`` (``host:port``): the host rank 0 runs on and a port that
        was free there when the round formed, agreed through the round's store; nothing listens
        on it until a library (``torch.distributed.rpc``, say) does.
        """
        r = self._round
        place = {
            "RANK": r.rank, "SIZE": r.size, "LOCAL_RANK": self.local_rank, "LOCAL_SIZE": self.local_size,
            "CROSS_RANK": self.cross_rank, "CROSS_SIZE": self.cross_size, "HOSTNAME": self.hostname,
        }
        for key, value in place.items():
            os.environ[f"HOROVOD_{key}"] = str(value)
            if not self.standalone:
                os.environ[f"ELASTICRUN_{key}"] = str(value)
        os.environ.update({"RANK": str(r.rank), "WORLD_SIZE": str(r.size), "LOCAL_RANK": str(self.local_rank),
                           "LOCAL_WORLD_SIZE": str(self.local_size)})
        if master is not None:
            addr, _, port = master.rpartition(":")
            os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, port

    def emit(self, kind: str, **fields: Any) -> None:
        """Record an event for the job's event log (cheap: an append; the control thread ships it)."""
        if not self.standalone:
            r = self._round
            self._events.append(dict(fields, t=time.time(), kind=kind, round=r.number, rank=r.rank,
                                     host=self.hostname, slot=self.slot))

    def _take_events(self, most: int = 200) -> list[dict[str, Any]]:
        batch: list[dict[str, Any]] = []
        while self._events and len(batch) < most:
            batch.append(self._events.popleft())
        return batch

    def _on_message(self, msg: Message) -> None:
        body = msg.body
        with self._lock:
            if msg.type == "hosts_updated":
                ts = float(body["ts"])
                if self.host_updates.record(ts, bool(body["added"])):
                    self.emit(Kind.NOTIFICATION_RECEIVED, ts=ts, via="notification")
            elif msg.type == "round_aborted":
                self._abort(int(body["round"]), str(body.get("reason", "round aborted")))
            elif msg.type == "stopping":  # the job is ending: the SIGTERM that follows is the driver's
                self._driver_stopping = True
            elif msg.type == "leaving_ack":
                self._leaving_heard.set()
            elif msg.type == "durable_request":
                self.copy_requests.record(int(body["id"]))
            elif msg.type == "heartbeat_ack":
                for ts, added, _removed in body.get("updates", []):
                    # New here: the driver's notification did not bring it (sent before the
                    # driver knew this connection, or dropped on a full queue). A worker not in
                    # a round yet hears of older updates too: not news of its own.
                    if self.host_updates.record(float(ts), bool(added)) and self.round >= 0:
                        self.emit(Kind.NOTIFICATION_RECEIVED, ts=float(ts), via="heartbeat")
                self.copy_requests.record(int(body.get("durable", 0)))
                if body.get("aborted") and int(body["round"]) not in self._aborted:
                    self._abort(int(body["round"]), str(body.get("reason", "round aborted")))

    def _abort(self, round_: int, reason: str) -> None:
        """Mark ``round_`` dead: collectives waiting in it give up at their next poll, and its
        NCCL communicators are aborted now, off this thread (a kernel waiting on a dead peer
        would otherwise never end, and neither would a CUDA sync behind it)."""
        self._aborted[round_] = reason
        r = self._round
        if r.number == round_:
            for pg in list(r.device_groups.values()):
                devices.abort_soon(pg, f"round {round_} aborted")
        if self._forming == round_:
            timer = threading.Timer(FORMATION_STUCK_AFTER, self._formation_stuck, (round_, reason))
            timer.daemon = True
            timer.start()

    def _formation_stuck(self, round_: int, reason: str) -> None:
        """Said when this worker is still inside NCCL's formation of an aborted round: the
        driver can only say that this rank has not left it; this says why, and what to do."""
        if self._forming == round_:
            log.warning("%s[%s]: rank %d is still inside NCCL's group formation of round %d, aborted %.0f s ago "
                        "(%s): a peer was lost while the group formed, and NCCL cannot abort a formation once "
                        "begun, so this worker cannot leave the round. Kill it (pid %d) to let the job go on "
                        "without it (its host counts as failed)", self.hostname, self.slot, self._round.rank,
                        round_, FORMATION_STUCK_AFTER, reason, os.getpid())

    def _form_device_group(self, r: Round, members: tuple[int, ...], device: Any) -> Any:
        """The NCCL group of ``members`` (() for all of round ``r``) on ``device``, formed on the
        round's store (collective: every member calls it at the same operation). Registered in
        the round before it connects, so that an abort meanwhile aborts it too."""
        if r.store is None or r.device_backend != "nccl":
            raise HorovodInternalError(f"round {r.number} has no NCCL group")
        if self.device is None:
            self.device = devices.bound = device
        elif device != self.device:
            raise ValueError(f"a CUDA tensor on {device}, but this rank's NCCL groups are on {self.device} (one GPU "
                             f"per worker: move the model to {self.device}, or call torch.cuda.set_device before "
                             f"hvd.init())")
        self._forming = r.number  # (before the check: an abort from now on sees it)
        if r.abort_reason():  # NCCL's init cannot be aborted once begun: none for a dead round
            self._forming = None
            raise HorovodInternalError(f"round {r.number} was aborted: {r.abort_reason()}")
        ranks = members or tuple(range(r.size))
        store = dist.PrefixStore("elasticrun/nccl/" + (",".join(map(str, members)) if members else "all"), r.store)
        started = time.monotonic()
        try:
            pg = devices.new_nccl(store, ranks.index(r.rank), len(ranks), self.collective_timeout)
            r.device_groups[members] = pg
            devices.connect(pg, device)
        except Exception as exc:
            self._forming = None
            r.device_groups.pop(members, None)
            if "pg" in locals():
                devices.abort_soon(pg, "its formation failed")
            reason = r.abort_reason()
            failures = formation_failed(self.formation_failures, None if reason else str(exc))
            if len(failures) >= FORMATION_ATTEMPTS:
                raise DeviceGroupError(
                    f"could not form the NCCL group on {device} in {len(failures)} rounds in a row, each time: "
                    f"{failures[-1]}. Each worker needs a GPU of its own: leave the choice to hvd.init() or call "
                    f"torch.cuda.set_device(hvd.local_rank()) before using CUDA, and do not change "
                    f"CUDA_VISIBLE_DEVICES in the script") from exc
            raise HorovodInternalError(f"could not form the NCCL group of round {r.number} on {device}"
                                       f"{f' (the round was aborted: {reason})' if reason else ''}: {exc}") from exc
        self._forming = None
        self.formation_failures.clear()
        if r.abort_reason():  # aborted while it connected: the control thread may have missed it
            devices.abort_soon(pg, "its round was aborted")
            raise HorovodInternalError(f"round {r.number} was aborted: {r.abort_reason()}")
        log.info("rank %d/%d: NCCL group of round %d on %s formed in %.1f ms", r.rank, r.size, r.number, device,
                 (time.monotonic() - started) * 1000)
        return pg

    def _on_driver_lost(self, silence: float) -> None:
        """Exit: the driver is gone (a worker must not outlive its job)."""
        try:  # stderr is often a pipe to the dead driver: the message is best effort, the exit is not
            sys.stderr.write(f"elasticrun: {self.hostname}[{self.slot}]: the driver has not answered for "
                             f"{silence:.0f} s: the job is gone or stopping; this worker exits.\n")
            sys.stderr.flush()
        finally:
            os._exit(1)

    # --- rounds -----------------------------------------------------------------------------
    def abort_reason(self) -> str | None:
        """Why the current round was aborted, or None while it is healthy."""
        return self._round.abort_reason()

    def rendezvous(self, error: str | None = None, restored: bool = False) -> None:
        """Get this worker's place in the next round and form that round's process group.

        ``error``: why this worker leaves its round (a failed collective). The driver then
        aborts the round for everyone, so peers still blocked in a collective with this
        worker give up at once instead of at their collective timeout. ``restored``: this
        worker rolled back to its last commit; the driver then makes everyone sync.
        """
        if self.standalone:
            if self.pg is None:
                store = dist.HashStore()
                self.enter_round(0, self.rank, self.size, dist.ProcessGroupGloo(
                    store, 0, 1, rounds.group_timeout(self.collective_timeout)), store)
                self.export_environment(f"127.0.0.1:{_free_port()}")
            return
        assert self._client is not None
        while True:
            asked = time.monotonic()
            try:
                msg = self._client.request("rendezvous", {"worker": self.worker_id, "after_round": self.round,
                                                          "error": error, "restored": restored,
                                                          "has_state": self.has_state, "gpus": self.gpus()},
                                           timeout=self.rendezvous_timeout, what="this worker's place in the next round")
            except DriverTimeout as exc:
                raise HorovodInternalError(str(exc)) from None
            if msg.type == "dismiss":  # a graceful end: the driver says it on its console
                log.debug("%s[%s]: %s; exiting", self.hostname, self.slot, msg.body.get("reason"))
                self.shutdown(exiting=True)
                _end_within(_seconds(env.EXIT_GRACE, EXIT_GRACE), f"{self.hostname}[{self.slot}]")
                raise SystemExit(0)
            a = msg.body
            self.enter_round(int(a["round"]), int(a["rank"]), int(a["size"]))
            self._round.device_backend = "nccl" if a.get("device_backend") == "nccl" else "gloo"
            self.local_rank, self.local_size = int(a["local_rank"]), int(a["local_size"])
            self.cross_rank, self.cross_size = int(a["cross_rank"]), int(a["cross_size"])
            self.homogeneous = bool(a.get("homogeneous", True))
            self.must_sync = bool(a.get("must_sync", True))
            self.restore = bool(a.get("restore", False))
            self.rendezvous_count += 1
            self.emit(Kind.RENDEZVOUS_COMPLETE, size=self.size, waited_ms=round((time.monotonic() - asked) * 1000, 2))
            self.host_updates.handled(float(a.get("notify_ts", 0.0)))
            error = None  # a retry after an aborted formation is not this worker's error
            try:
                started = time.monotonic()
                self._form_group()
                self.emit(Kind.GROUP_FORMED, ms=round((time.monotonic() - started) * 1000, 2))
                return
            except Exception as exc:
                reason = self.abort_reason()
                if reason is None:
                    # Nobody died, so retrying would fail the same way: fail this worker loudly.
                    raise RuntimeError(f"elasticrun: could not form the process group of round {self.round} "
                                       f"as rank {self.rank}/{self.size}: {exc}") from exc
                log.warning("round %d was aborted while its group formed (%s); asking for the next round",
                            self.round, reason)

    def join(self) -> bool:
        """Take this worker's place in the job's next round, if it has none yet; True if it
        joined now.

        A worker launched into a running job (``joining``) defers this from ``hvd.init()`` to
        its first collective (``rounds.current``) or ``elastic.run``'s first sync: the driver
        tells the survivors of it only once it asks, so they train on while it builds its
        model and loads its data, instead of waiting for it in their next ``sync()``.
        """
        with self._join_lock:
            if self._round.number >= 0:
                return False
            self.rendezvous()
            return True

    def _form_group(self) -> None:
        """Form the current round's gloo group on its own namespace of the driver's store."""
        r = self._round
        assert self._client is not None
        if r.size == 1:
            # A world of one has no peer to meet: its group, store and MASTER_PORT are local
            # (the driver's store would cost round trips on the recovery path for nothing), and
            # its group is the one it had the last time it was alone. The store is the round's
            # own (process sets form their groups on it, under keys a later round reuses).
            if self._solo_pg is None:
                self._solo_pg = dist.ProcessGroupGloo(dist.HashStore(), 0, 1,
                                                      rounds.group_timeout(self.collective_timeout))
            r.pg = self._solo_pg
            r.store = dist.HashStore()
            self.export_environment(f"{self.hostname}:{_free_port()}")
            if r.device_backend == "nccl" and devices.requested() == "nccl":
                device = self.device if self.device is not None else devices.rank_device(self.slot)
                self._form_device_group(r, (), device)
            return
        # Keep the Python store alive here: the C++ side holds only the trampoline, and once
        # the Python object is collected its methods are gone ("Not implemented").
        self._store = DriverStore(self._client, self.collective_timeout, r.abort_reason)
        store = dist.PrefixStore(f"round{r.number}", self._store)
        # MASTER_ADDR/PORT for torch.distributed libraries: rank 0 offers a free port before
        # the group forms, so the others find it once the group has formed (one store round
        # trip each).
        if r.rank == 0:
            master = f"{self.hostname}:{_free_port()}"
            store.set(_MASTER_KEY, master)
        with self._store.forming():
            r.pg = dist.ProcessGroupGloo(store, r.rank, r.size, rounds.group_timeout(self.collective_timeout))
        r.store = store
        if r.rank != 0:
            master = store.get(_MASTER_KEY).decode()
        self.export_environment(master)
        if r.device_backend == "nccl" and devices.requested() == "nccl":
            # --backend nccl: the round's NCCL group now, connected, with its gloo group. (With
            # auto, at the round's first CUDA collective: a CPU job never makes a CUDA context.)
            device = self.device if self.device is not None else devices.rank_device(self.slot)
            self._form_device_group(r, (), device)

    def report_failure(self, error: str) -> None:
        """Tell the driver this worker is failing, before the slow interpreter teardown.

        The driver can then abort the round and blacklist the host at once, instead of
        waiting for the process to exit (~0.5 s for a Python process that imported torch).
        """
        if self._client is None:
            return
        try:
            self._client.request("failing", {"worker": self.worker_id, "error": error[-2000:]}, timeout=1.0,
                                 what="the failure report")
        except Exception as exc:  # the exit code still tells the driver
            log.debug("could not report the failure: %s", exc)

    def check_host_updates(self, committed: CommittedState | None = None) -> None:
        """Collective: raise HostsUpdatedInterrupt on every rank if any rank saw a newer update.

        When the optimizer's gradient allreduce already carried the flags since the last
        check, their agreed value is used and no extra collective runs. Every rank takes the
        same path: they all ran the same steps. See worker/host_updates.py.

        ``committed`` (the state, right after its commit saved; with --checkpoint-dir): the same
        agreement says whether the ranks hand that commit off as a durable copy (some rank was
        asked, none is still sending the last one); the hand-off (``durable.HandOff``) takes
        this rank's shard before any interrupt.
        """
        if self.standalone:
            return
        r = self._round
        updates = self.host_updates
        verdict = updates.take_agreed(r.number)
        copy = self.copy_requests.take_agreed(r.number) if committed is not None else None
        if verdict is None:
            latest, added = updates.proposal()
            wanted, busy = self.copy_requests.local_flags(self.copy_busy())
            packed = torch.tensor(StepFlags(latest, added, wanted, busy).encode(), dtype=torch.float64)
            collectives.allreduce_inplace(packed, dist.ReduceOp.MAX, "check_host_updates", flags_at=0)
            agreed = StepFlags.decode(packed.tolist())  # pending: the newest timestamp any rank knows
            verdict = (updates.settle(agreed.pending), agreed.added)
            copy = (agreed.wanted, agreed.busy)
            where: dict[str, Any] = {"ts": agreed.pending}
        else:
            where = {"agreed_in": "gradient allreduce"}
        if committed is not None and copy is not None and copy[0] and not copy[1] and self._durable is not None:
            self._durable.give(committed, copy_id(r.number, committed.commit_seq), self.rank, self.size, self.steps)
            self.copy_requests.served()
        interrupt, added = verdict
        if interrupt:
            self.emit(Kind.INTERRUPT, skip_sync=not added, **where)
            join.tell_joined(r, skip_sync=not added)
            raise HostsUpdatedInterrupt(skip_sync=not added)

    def before_commit_copy(self) -> None:
        """A commit is about to overwrite its buffers: a durable copy still reading them on the
        GPU goes first (ordered on the GPU; the host does not wait)."""
        if self._durable is not None:
            self._durable.before_commit()

    def fetch_durable(self) -> tuple[dict[str, Any], bytes, bytes]:
        """The newest durable copy, from the driver (a restore)."""
        if self._ctx is None or env.DURABLE_ADDR not in os.environ:
            raise RuntimeError("this job keeps no durable copies (--checkpoint-dir)")
        return durable.fetch(self._ctx, os.environ[env.DURABLE_ADDR], self._keys, os.environ[env.JOB_ID])

    def report_restored(self, commit: int, steps: int) -> None:
        """The durable copy is loaded: the driver says "resumed" now, not when it asked for it."""
        if self._control is not None:
            self._control.post("restored", {"worker": self.worker_id, "commit": commit, "steps": steps})

    def report_restore_failed(self, error: str) -> None:
        """A durable copy could not be restored (it does not fit the model): the job must stop,
        not start over from scratch."""
        if self._client is not None:
            try:
                self._client.request("restore_failed", {"worker": self.worker_id, "error": error[-2000:]},
                                     timeout=5.0, what="the restore failure report")
            except Exception as exc:
                log.debug("could not report the failed restore: %s", exc)

    def shutdown(self, exiting: bool = False) -> None:
        """Leave the job. ``exiting``: the process is ending (at exit, or dismissed); else the
        script called hvd.shutdown() and goes on. The driver hears which (no heartbeat follows
        either way, and an ending process may take seconds to tear down)."""
        # The current round's NCCL groups are kept to the end (an abort costs a second; the
        # process's end frees them); aborts already under way are waited for.
        for group in self._round.device_groups.values():
            _keep_for_good(group)
        devices.settle_aborts()
        _settle_drops()
        running = self._round.unfinished()
        if running:  # a collective abandoned in this round: its group cannot be torn down without waiting for it
            _keep_for_good([running, self._round.pg, dict(self._round.subgroups)])
        prefetch.stop()
        if self._durable is not None:
            self._durable.close()
            self._durable = None
        if self._control is not None:
            self._control.stop("exit" if exiting else "shutdown")  # it ships the last queued events first
            self._control.join(timeout=2)
            self._control = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        rounds.uninstall(self._round)
        self._round.pg = None


_runtime: Runtime | None = None
_init_lock = threading.Lock()


def configure_logging(level: str) -> None:
    """Send elasticrun's own log records to stderr at ``level``, and leave every other logger to
    the script: a ``logging.basicConfig()`` the script calls after ``hvd.init()`` must still
    take effect (a handler of ours on the root logger made it a no-op, and the script's lines
    vanished), and ``--verbose`` is no order to print every library's DEBUG lines."""
    logger = logging.getLogger("elasticrun")
    logger.setLevel(level.upper())
    if not any(getattr(h, "elasticrun_console", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        handler.elasticrun_console = True  # type: ignore[attr-defined]  # a mark to find our own handler again
        logger.addHandler(handler)
    logger.propagate = False  # not twice once the script configures the root logger


def init() -> Runtime:
    """Join the job (idempotent): connect to the driver and form the first round's group.

    A worker launched into a running job connects only: its place comes at its first
    collective or first ``sync()`` (:meth:`Runtime.join`); ``hvd.rank()``/``hvd.size()``
    until then give the place it was launched for."""
    global _runtime
    with _init_lock:
        if _runtime is None and (above := forks.worker_above()) is not None:
            _runtime = _not_a_worker(above)
        if _runtime is None:
            level = os.environ.get(env.LOG_LEVEL)
            if level:
                configure_logging(level)
            _start_timeline_from_environment()
            deathnotice.arm_from_environment()  # before anything can fail: the launcher hears at once
            limits.lift_open_files()  # before gloo's listener: see common/limits.py
            rt = Runtime()
            if not rt.standalone:
                warm_up()
            if rt.joining:
                rounds.defer(rt.current_round, rt.join)
            else:
                try:
                    rt.rendezvous()
                except BaseException:
                    rounds.uninstall(rt.current_round)  # collectives: "not initialized", as before
                    raise
            _runtime = rt
            atexit.register(shutdown, exiting=True)
            if not rt.standalone:
                _install_excepthook(rt)
                _install_sigterm(rt)
        return _runtime


def _not_a_worker(above: int) -> Runtime:
    """``hvd.init()`` in a process worker ``above`` started: a DataLoader's ``spawn`` or
    ``forkserver`` worker imports the script again, and Horovod scripts often call
    ``hvd.init()`` and ``hvd.local_rank()`` at the top. It takes no place in the job (it used to
    fail for want of keys, and the DataLoader with it): ``hvd.rank()``, ``size()`` and the local
    and cross ranks answer the worker's as it started this process, and a collective says why it
    cannot run here. No timeline, notice, handler or exit hook: those are the worker's."""
    rt = Runtime(in_job=False)

    def refuse() -> None:
        raise RuntimeError(
            f"elasticrun: this process (pid {os.getpid()}) is not a worker of the job: worker pid {above} "
            "started it (a DataLoader's spawn or forkserver worker imports the script again). It has "
            "hvd.rank() and hvd.size() but no collectives: run training under `if __name__ == \"__main__\":`")

    rounds.defer(rt.current_round, refuse)
    return rt


def _driver_stopped() -> bool:
    """Whether the driver's process is on this machine and stopped (Ctrl-Z, SIGSTOP, a
    debugger): it is not gone, and this worker waits for it. A driver that runs and has been
    silent past the timeout is taken for gone as before (the job may be over while its process
    lives on, as an ``elasticrun.run`` caller's does); a worker on another machine cannot tell."""
    ident = os.environ.get(env.DRIVER_PROCESS)
    return ident is not None and liveness.state(ident) == "stopped"


def _start_timeline_from_environment() -> None:
    """``HOROVOD_TIMELINE`` (set by ``--timeline-filename``, or by the user as for Horovod):
    record the timeline from the first collective on, as Horovod's workers do. A path that
    cannot be written is said once and training goes on without it."""
    path = os.environ.get("HOROVOD_TIMELINE")
    if not path or path.strip().upper() == "DYNAMIC" or trace.active() is not None:
        return  # DYNAMIC, as in Horovod: the script starts it with hvd.start_timeline(path)
    mark = os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0").strip().lower() not in ("", "0", "false", "no", "off")
    try:
        trace.start(path, mark)
    except OSError as exc:
        log.warning("HOROVOD_TIMELINE: no timeline recorded: %s", exc)


def warm_up() -> None:
    """Pay torch's one-time lazy costs before joining, not after.

    The first optimizer a process builds imports torch._dynamo (~0.9 s here). Scripts build
    theirs right after init(); a worker joining a running job would pay it while the
    survivors already wait for it in sync(). Done before the rendezvous request, the
    survivors keep training meanwhile. The warm-start template (worker/template.py) calls it
    once, before it forks any worker.
    """
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


#: How long a dismissed worker may take to end. Its SystemExit comes from inside the elastic
#: function, so the script's code after that function (where it stops a helper process it
#: started) never runs; Python then waits at exit for every non-daemon thread and
#: multiprocessing child, for good: the process lingered until the job's end, holding its slot
#: (the job could not grow back onto it) and the driver's word "exits 0" untrue.
EXIT_GRACE = 30.0


def _end_within(grace: float, where: str) -> None:
    """End this dismissed process after ``grace`` seconds if it has not ended by then (its
    launcher then stops what it left running in its process group)."""
    def end() -> None:
        _say(f"elasticrun: {where}: dismissed {grace:g} s ago and still running: Python waits at exit for "
             f"the non-daemon threads and multiprocessing children the script started (stop them in a "
             f"'finally:' around the elastic function, or make them daemon); exiting now\n")
        os._exit(0)

    timer = threading.Timer(grace, end)
    timer.daemon = True
    timer.start()


def _say(text: str) -> None:
    """A line on stderr from a signal handler or a timer (os.write: no buffered-IO reentry)."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


#: How long a worker told to stop (SIGTERM) waits for the driver to hear it is leaving; without
#: an answer the driver is gone (or is stopping the job itself) and the worker stops at once.
ANSWER_TIMEOUT = 1.0


#: How long a worker that got SIGTERM waits for its SSH watchdog's word that the signal is the
#: watchdog's own (the driver's connection lost), before it reports that its machine goes.
_WATCHER_WORD = 0.1


def _install_sigterm(rt: Runtime) -> None:
    """SIGTERM is the cloud's (or Kubernetes', or Slurm's) warning that this machine goes: the
    worker tells the driver it is leaving, which moves its host out at the next commit (no
    rollback), and exits 0 when dismissed. It is stopped at once after --sigterm-grace, at a
    second SIGTERM, or when the SIGTERM is the driver's own (the job is ending)."""
    if threading.current_thread() is not threading.main_thread():
        return
    grace = _seconds(env.SIGTERM_GRACE, settings.DEFAULT_SIGTERM_GRACE)
    where = f"{rt.hostname}[{rt.slot}]"

    def stop_now(why: str) -> None:  # from the handler or a timer thread: no signal.signal() there
        _say(f"elasticrun: {where}: {why}; stopping now\n")
        os._exit(128 + signal.SIGTERM)

    def unheard() -> None:  # no driver to leave gracefully with (it is gone, or stopping us)
        if not rt._leaving_heard.wait(ANSWER_TIMEOUT):
            stop_now("the driver did not answer SIGTERM's 'leaving'")

    watcher_stop = ("the SSH watchdog over this worker lost its connection to the driver and stops it (not "
                    "this machine going): the driver counts the worker as failed")

    def leave(control: Any) -> None:  # on its own thread: a moment's wait for the watchdog's word
        deadline = time.monotonic() + _WATCHER_WORD
        while time.monotonic() < deadline:
            if deathnotice.stopped_by_watcher():
                stop_now(watcher_stop)
            time.sleep(0.005)
        control.post("leaving", {"worker": rt.worker_id, "why": "SIGTERM"})
        _say(f"elasticrun: {where}: SIGTERM: leaving the job at its next commit (at most {grace:g} s, "
             f"--sigterm-grace)\n")
        deadline_timer = threading.Timer(grace, stop_now, (f"--sigterm-grace {grace:g} s ran out",))
        answer = threading.Thread(target=unheard, name="elasticrun-sigterm")
        for t in (deadline_timer, answer):
            t.daemon = True
            t.start()

    def handler(signum: int, frame: Any) -> None:
        forks.worker_got_sigterm()  # first: the processes it forked wait for this to tell their SIGTERM's source
        if rt._driver_stopping or rt._control is None:
            stop_now("the job is ending")
        elif deathnotice.stopped_by_watcher():
            stop_now(watcher_stop)
        elif rt._leaving is not None:
            # Within forks.WINDOW of the first, it is the same news sent twice: a machine's
            # shutdown signals every process, and the watchdog (or warm-start template) over
            # this worker forwards its own SIGTERM to the worker's group. A deliberate second
            # SIGTERM (a user insisting) comes later.
            if time.monotonic() - rt._leaving >= forks.WINDOW:
                stop_now("a second SIGTERM")
        else:
            # A SIGTERM is a warning that the machine goes, unless the SSH watchdog over this
            # worker sends it because its channel to the driver closed (an SSH session lost):
            # it says so in the death notice first, but the warm-start template, which stops
            # its workers too when its own channel closes, may signal a moment before.
            rt._leaving = time.monotonic()
            threading.Thread(target=leave, args=(rt._control,), name="elasticrun-sigterm-leave", daemon=True).start()

    signal.signal(signal.SIGTERM, handler)
    forks.arm(handler)


def _install_excepthook(rt: Runtime) -> None:
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not issubclass(kind, (KeyboardInterrupt, SystemExit)) and not forks.in_forked_child():
            rt.report_failure(f"{kind.__name__}: {exc}")
        previous(kind, exc, tb)

    sys.excepthook = hook


def get() -> Runtime:
    if _runtime is None:
        raise ValueError("elasticrun has not been initialized; call hvd.init() first")
    return _runtime


def is_initialized() -> bool:
    return _runtime is not None


def shutdown(exiting: bool = False) -> None:
    """Leave the job (hvd.shutdown(); at exit with ``exiting``: see :meth:`Runtime.shutdown`)."""
    global _runtime
    if forks.in_forked_child():
        return  # a process the worker forked: the job, its sockets and threads are the worker's
    with _init_lock:
        if _runtime is not None:
            _runtime.shutdown(exiting)
            _runtime = None
