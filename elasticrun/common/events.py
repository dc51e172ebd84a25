"""The job's event log: one JSON object per line, written by the driver, and its schema.

Workers do not write files: they queue events in memory (no I/O on the training path) and
their control thread ships them to the driver, which appends them to the same file. Every
event carries the wall-clock time it happened (``t``, seconds since the epoch, taken where it
happened), its ``kind`` and ``source`` ("driver" or "worker"), and where known the round, host
and rank, so that a reset can be split into phases after the fact (``benchmarks/recovery.py``,
``elasticrun timeline``).

Every kind is a :class:`Kind` and its fields are listed in :data:`FIELDS`; emitters (the
driver, the registry's log events, the workers), the reset tracker and the timeline all name
kinds through :class:`Kind`, so a kind cannot be misspelt in one place and read in another.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from elasticrun.common.diagnostics import DiagnosticFile
from elasticrun.common.ratelimit import LimitedLog


class Kind(str, enum.Enum):
    """The kinds of event (a ``str``: ``Kind.ROUND_FORMED == "round_formed"`` in JSON and code)."""

    # The driver's own.
    DISCOVERY = "discovery"                  # the discovered hosts changed
    DISCOVERY_EMPTY = "discovery_empty"      # an empty listing, ignored
    HOST_ADDED = "host_added"
    HOST_REMOVED = "host_removed"
    HOST_RESIZED = "host_resized"
    HOSTS_MORE = "hosts_more"                # more hosts changed in one listing than are named, counted
    HOST_BLACKLISTED = "host_blacklisted"
    HOST_WHITELISTED = "host_whitelisted"    # back after its cooldown
    HOST_DRAINING = "host_draining"          # discovery says it is about to go
    HOST_LEAVING = "host_leaving"            # one of its workers got SIGTERM: it is going
    STRAGGLER = "straggler"                  # a host computes persistently slower than the rest
    WORKER_STARTED = "worker_started"
    WORKER_EXITED = "worker_exited"
    WORKER_FAILED = "worker_failed"
    WORKER_SUCCEEDED = "worker_succeeded"
    HOSTS_UPDATED = "hosts_updated"          # the registry decided to notify (with what changes)
    NOTIFICATION_SENT = "notification_sent"  # ... and the driver published it
    HANDOVER_PENDING = "handover_pending"    # every holder of the state is leaving; no newcomer ready
    REMOVAL_HELD = "removal_held"            # a removal would leave fewer than --min-np
    WAITING_FOR_SLOTS = "waiting_for_slots"
    STATE_LOST = "state_lost"                # a round formed without any holder of the state
    WORKERS_LOST = "workers_lost"            # every worker lost to the infrastructure; resuming from disk
    NP_NEVER = "np_never"                    # a fixed host list can no longer give -np: round 0 starts with fewer
    NP_NOT_MET = "np_not_met"                # discovery gave fewer than -np within --elastic-timeout: round 0 starts with them
    NONE_REACHED = "none_reached"            # no host of the first round answered: waiting for discovery to list others
    PLAIN_COMMAND = "plain_command"          # no worker called hvd.init(): plain processes, horovodrun's way
    ELASTIC_AFTER_ALL = "elastic_after_all"  # ... and then one did: the job is elastic again
    RESUMED = "resumed"                      # a round starts from the newest durable copy
    DURABLE_WRITTEN = "durable_written"      # a durable copy of a commit is whole on disk
    ROUND_ABORTED = "round_aborted"
    ABORT_PENDING = "abort_pending"          # members have not left an aborted round for a while
    ROUND_STALLED = "round_stalled"          # members wait past the stall warning for others in no collective
    ROUND_DIVERGED = "round_diverged"        # every member waits past the stall warning, not in the same collective
    ROUND_FORMED = "round_formed"
    DEVICE_BACKEND = "device_backend"        # what carries CUDA tensors in this round, and why
    RESET = "reset"                          # a reset closed: cause, sizes and cost
    JOB_END = "job_end"
    # The workers' (source "worker"): the phases of a reset, as each worker lives them.
    NOTIFICATION_RECEIVED = "notification_received"
    INTERRUPT = "interrupt"                  # HostsUpdatedInterrupt raised (all ranks at once)
    FAILURE_DETECTED = "failure_detected"    # a collective failed: HorovodInternalError
    RESTORE = "restore"
    RENDEZVOUS_COMPLETE = "rendezvous_complete"
    GROUP_FORMED = "group_formed"
    SYNC_DONE = "sync_done"                  # skipped: bytes a newcomer had fetched before (no sync needed);
    #                                          sent_to: ranks the model went to (0: every rank held it)
    STATE_FETCHED = "state_fetched"          # a newcomer fetched the committed model before joining
    FIRST_STEP = "first_step"                # the first collective of a new round completed

    def __str__(self) -> str:
        return self.value


class Cause(str, enum.Enum):
    """Why a worker failed or was sent away, why a round was aborted, why the job ended, and
    what carries CUDA tensors: the registry's decisions say which as data (with the figures in
    a ``Reason``'s fields, listed beside each), and ``elasticrun/driver/words.py`` words them."""

    # A worker failed.
    EXITED = "exited"                        # code, detail
    SCRIPT_ERROR = "script_error"            # error: its own Python exception
    NEVER_CONTACTED = "never_contacted"      # limit: --start-timeout
    STUCK_EXITING = "stuck_exiting"          # grace: its script ended, its process did not exit
    SILENT = "silent"                        # silent_s, limit: --heartbeat-timeout
    # A worker is sent away (dismissed or killed).
    NOT_IN_JOB = "not_in_job"
    JOB_FINISHED = "job_finished"
    NO_PLACE_ANY_MORE = "no_place_any_more"
    NO_PLACE = "no_place"                    # label: no place in the next round
    NOT_NEEDED = "not_needed"                # label
    PEER_FAILED = "peer_failed"              # (plain processes) another process failed
    # A round is aborted.
    LEFT_AFTER_ERROR = "left_after_error"    # label, round, error
    MEMBER_FAILED = "member_failed"          # label, why (the member's failure)
    # The job ended.
    FINISHED = "finished"                    # rounds, resets
    ENDED_EARLY = "ended_early"              # rank, steps, training, unfinished
    ALL_EXITED_0 = "all_exited_0"            # n (plain processes)
    PROCESSES_FAILED = "processes_failed"    # failed: [(rank, label, why)] (plain processes)
    FAILED_AFTER_SUCCESS = "failed_after_success"  # failed: [(rank, label, why)], first
    ALL_FAILED = "all_failed"                # failed: [(label, why)]
    ALL_BLACKLISTED = "all_blacklisted"      # hosts
    RESET_LIMIT = "reset_limit"              # limit, resets
    TIMED_OUT = "timed_out"                  # limit, flag, need, hosts, ready
    NEVER_ENOUGH = "never_enough"            # flag, need, hosts, blacklisted
    NCCL_CANNOT_RUN = "nccl_cannot_run"      # round, why (a device cause)
    CANNOT_RESUME = "cannot_resume"          # error
    SIGNALLED = "signalled"                  # signal: SIGINT, SIGTERM or SIGHUP to the driver
    # A straggler is kept (not evicted).
    KEEP_MIN_NP = "keep_min_np"              # count, left, min_np
    KEEP_SLOWER = "keep_slower"              # count, left, after, workers, step (seconds)
    # What carries CUDA tensors in a round.
    GLOO_ASKED = "gloo_asked"                # --backend gloo
    NCCL_ASKED = "nccl_asked"                # --backend nccl, and it can run
    GPU_EACH = "gpu_each"                    # every member has a GPU of its own
    NO_GPU = "no_gpu"                        # place
    SHARED_GPU = "shared_gpu"                # places

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Reason:
    """A :class:`Cause` with its figures (``fields``): what a decision says happened, as data."""

    cause: Cause
    fields: Mapping[str, Any] = field(default_factory=dict)


#: The fields of each kind, besides ``t``, ``kind`` and ``source`` (``round`` is on most).
FIELDS: dict[Kind, tuple[str, ...]] = {
    Kind.DISCOVERY: ("hosts", "draining"),
    Kind.DISCOVERY_EMPTY: ("round", "message"),
    Kind.HOST_ADDED: ("round", "message", "host", "slots"),
    Kind.HOST_REMOVED: ("round", "message", "host"),
    Kind.HOSTS_MORE: ("round", "message", "added", "removed", "resized", "whitelisted"),
    Kind.HOST_RESIZED: ("round", "message", "host", "slots"),
    # seconds: how long (None: permanently); straggler: for dragging the job, not for a failure
    Kind.HOST_BLACKLISTED: ("round", "message", "host", "seconds", "straggler", "over"),
    # because: "cooldown" (it ended) or "collapse" (every worker was lost at once: no one host's fault)
    Kind.HOST_WHITELISTED: ("round", "message", "host", "because"),
    Kind.HOST_DRAINING: ("round", "message", "host"),
    Kind.HOST_LEAVING: ("round", "message", "host", "why"),
    # action: named (no --evict-stragglers), evicted, kept (--min-np, or it would not pay), recovered
    # others: how many hosts it was compared with; hint: --evict-stragglers is off; kept: why it stays
    Kind.STRAGGLER: ("round", "message", "host", "action", "compute_ms", "reference_ms", "step_ms", "steps", "others",
                     "hint", "kept"),
    Kind.WORKER_STARTED: ("worker", "host", "slot", "rank"),
    Kind.WORKER_EXITED: ("worker", "code", "host", "slot", "rank"),
    Kind.WORKER_FAILED: ("round", "message", "host", "label", "rank", "why"),
    Kind.WORKER_SUCCEEDED: ("round", "message", "host", "label", "rank", "plain"),
    Kind.HOSTS_UPDATED: ("round", "message", "added", "removed", "handover", "from_size", "to_size", "again"),
    Kind.NOTIFICATION_SENT: ("round", "ts", "added", "removed"),
    Kind.HANDOVER_PENDING: ("round", "message", "hosts", "why"),
    Kind.REMOVAL_HELD: ("round", "message", "hosts", "why", "min_np"),
    # usable: [[host, slots], ...]; left_s: until the wait gives up; flag: the limit's flag
    Kind.WAITING_FOR_SLOTS: ("round", "message", "need", "ready", "usable", "left_s", "flag", "out", "min_np"),
    Kind.STATE_LOST: ("round", "message"),
    Kind.WORKERS_LOST: ("round", "message", "limit", "min_np", "commit", "was"),
    Kind.NP_NEVER: ("round", "message", "np", "reachable", "min_np"),
    Kind.NP_NOT_MET: ("round", "message", "np", "reachable", "min_np", "limit"),
    Kind.NONE_REACHED: ("round", "message", "hosts", "limit"),
    Kind.PLAIN_COMMAND: ("round", "message", "limit"),
    Kind.ELASTIC_AFTER_ALL: ("round", "message", "label", "seconds"),
    Kind.RESUMED: ("round", "message", "checkpoint", "commit", "saved_at", "steps_back"),
    Kind.DURABLE_WRITTEN: ("round", "number", "commit", "bytes", "seconds"),
    Kind.ROUND_ABORTED: ("round", "reason", "cause"),
    Kind.ABORT_PENDING: ("round", "message", "seconds", "why", "ranks", "more"),
    # waited: the longest wait (s); waiting: how many members are in a collective; ranks: [[rank, label], ...]
    Kind.ROUND_STALLED: ("round", "message", "waited", "waiting", "ranks", "more"),
    Kind.ROUND_DIVERGED: ("round", "message", "waited", "groups", "more", "until"),
    Kind.ROUND_FORMED: ("round", "message", "size", "hosts"),
    Kind.DEVICE_BACKEND: ("round", "message", "backend", "why"),
    Kind.RESET: ("cause", "trigger", "round", "from_size", "to_size", "seconds"),
    Kind.JOB_END: ("round", "ok", "reason", "cause"),
    Kind.NOTIFICATION_RECEIVED: ("round", "rank", "host", "slot", "ts", "via"),
    Kind.INTERRUPT: ("round", "rank", "host", "slot", "skip_sync", "ts", "agreed_in"),
    Kind.FAILURE_DETECTED: ("round", "rank", "host", "slot", "error"),
    Kind.RESTORE: ("round", "rank", "host", "slot", "ms"),
    Kind.RENDEZVOUS_COMPLETE: ("round", "rank", "host", "slot", "size", "waited_ms"),
    Kind.GROUP_FORMED: ("round", "rank", "host", "slot", "ms"),
    Kind.SYNC_DONE: ("round", "rank", "host", "slot", "ms", "skipped", "sent_to"),
    Kind.STATE_FETCHED: ("round", "rank", "host", "slot", "ms", "bytes"),
    Kind.FIRST_STEP: ("round", "rank", "host", "slot", "what"),
}

WORKER_KINDS = frozenset({Kind.NOTIFICATION_RECEIVED, Kind.INTERRUPT, Kind.FAILURE_DETECTED, Kind.RESTORE,
                          Kind.RENDEZVOUS_COMPLETE, Kind.GROUP_FORMED, Kind.SYNC_DONE, Kind.STATE_FETCHED,
                          Kind.FIRST_STEP})


class EventLog:
    """Appends events to a JSON-lines file (thread-safe); a no-op without a path. A write that
    fails is a warning (``limited``), never an exception: the log describes the job, it must
    not end it (elasticrun/common/diagnostics.py)."""

    def __init__(self, path: str | None, limited: LimitedLog | None = None, beneath: str | None = None):
        """``beneath``: the directory ``path`` lies in when elasticrun chose its name there
        (``--output-filename``'s events.jsonl; see DiagnosticFile)."""
        self._file = DiagnosticFile(path, "the event log", limited, beneath=beneath) if path else None

    def write(self, kind: Kind | str, source: str = "driver", t: float | None = None, **fields: Any) -> None:
        if self._file is None:
            return
        record = {"t": time.time() if t is None else t, "kind": str(kind), "source": source}
        record.update({k: v for k, v in fields.items() if v is not None})
        self._file.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


def read_events(path: str) -> list[dict[str, Any]]:
    """Load an event log, ordered by time (workers' events arrive a little late)."""
    with open(path, encoding="utf-8") as f:
        events = [json.loads(line) for line in f if line.strip()]
    return sorted(events, key=lambda e: e["t"])
