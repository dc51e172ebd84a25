"""The elastic programming model: ``run``, ``State`` and ``ObjectState`` (horovod semantics).

A training function wrapped in :func:`run` is called again, in the same process, after every
reset. What survives a reset is the *state* object: ``commit()`` saves it (and checks for host
updates), ``restore()`` rolls back to the last commit after a failure, ``sync()`` brings every
rank to rank 0's state (rank 0 is always the longest-lived worker, so it holds the newest
commit).
"""

from __future__ import annotations

import copy
import functools
import logging
import time
from typing import Any, Callable, Iterable, TypeVar

from elasticrun.common.events import Kind
from elasticrun.worker import collectives, durable, join, join_news, rounds, runtime, trace
from elasticrun.worker.agreement import CollectiveMismatch
from elasticrun.worker.exceptions import CollectiveTimeout, HorovodInternalError, HostsUpdatedInterrupt

log = logging.getLogger("elasticrun.worker")
F = TypeVar("F", bound=Callable[..., Any])


class State:
    """Base class of elastic state: save / restore / sync, plus reset callbacks."""

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        """``bcast_object``, ``get_rank``: Horovod's ``State(bcast_object, get_rank)`` takes the
        framework's object broadcast and rank; a subclass written for it passes them to
        ``super().__init__`` and ports unchanged. The broadcast is what ``ObjectState.sync``
        uses; the job knows its ranks without ``get_rank``."""
        self._reset_callbacks: list[Callable[[], None]] = []
        if bcast_object is not None:
            self._bcast_object = bcast_object
        self._get_rank = get_rank

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call these after every reset (e.g. to scale the learning rate with the new size)."""
        self._reset_callbacks.extend(callbacks)

    def reset(self) -> None:
        """Hook for subclasses: called after every reset, before the reset callbacks (as in
        Horovod). The default does nothing."""

    def on_reset(self) -> None:
        type(self).reset(self)  # through the class: an ObjectState attribute may be named "reset"
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state, then check (collectively) whether hosts changed; with
        ``--checkpoint-dir``, the same agreement may hand the commit off as a durable copy."""
        self.save()
        self._note_steps()
        timeline = trace.active()
        if timeline is not None and runtime.is_initialized():  # --timeline-mark-cycles: a step's end
            timeline.mark("commit", runtime.get().round)
        self._just_saved = True
        try:
            self.check_host_updates()
        finally:
            self._just_saved = False

    def _note_steps(self) -> None:
        """The job's optimizer steps at this commit: a restore puts the count back, so that
        the driver's ``status:`` never counts the steps trained again after a rollback."""
        if runtime.is_initialized():
            self.__dict__["_steps_at_commit"] = runtime.get().steps

    def restored_steps(self) -> int | None:
        """The job's optimizer steps at the last commit this rank made (None: none yet)."""
        return self.__dict__.get("_steps_at_commit")

    @property
    def commit_seq(self) -> int:
        """How many commits this job's state has had (equal on every rank after a sync)."""
        return int(self.__dict__.get("_commit_seq", 0))

    def durable_state(self) -> dict[str, Any]:
        """Everything a restore needs, right after a commit (live == committed then): nested
        dicts/lists of tensors and picklable values. Subclasses say what they hold."""
        raise NotImplementedError(f"{type(self).__name__} cannot make durable copies (use ObjectState or "
                                  f"TorchState, or implement durable_state/load_durable_state)")

    def load_durable_state(self, saved: dict[str, Any]) -> None:
        raise NotImplementedError

    @staticmethod
    def _before_commit_copy() -> None:
        """A commit is about to overwrite its buffers: a durable copy still reading them goes first."""
        if runtime.is_initialized():
            runtime.get().before_commit_copy()

    def staging_sources(self, tensors: list[Any]) -> list[Any]:
        """Where a durable copy reads the commit's tensors from (the live ones, equal to the
        commit right after it; a state that keeps committed copies on the GPU names those:
        they do not change until the next commit, so the copy to host needs no stall)."""
        return tensors

    def load_durable(self, meta: bytes, data: bytes) -> tuple[int, int]:
        """Put a durable copy into this state (live and committed); (commit, steps) it holds.
        DurableMismatch (one line: the first key that does not fit) if it is not this model's."""
        saved, commit, steps = durable.decode(meta, data)
        self.load_durable_state(saved)
        self.__dict__["_commit_seq"] = commit
        return commit, steps

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank at this same call if hosts changed.

        Called outside ``commit()``, the state is saved (a commit) before the interrupt is
        raised: every rank is at the same call, so the progress since the last commit can
        still be merged over the old world. Otherwise the samples a leaving worker trained
        since the last commit, whose gradients are in everyone's live model, would be
        forgotten and trained again.
        """
        just_saved = getattr(self, "_just_saved", False)
        try:
            # Right after a commit's save, the same agreement may hand the commit off as a
            # durable copy (--checkpoint-dir).
            runtime.get().check_host_updates(committed=self if just_saved else None)
        except HostsUpdatedInterrupt:
            if not just_saved:
                self.save()
                self._note_steps()
            self.mark_committed()
            raise

    @property
    def _host_messages(self) -> _HostMessages:
        """Horovod's ``State._host_messages`` (a queue its driver's notifications fill and
        ``check_host_updates()`` drains), which some Horovod scripts poll to wait for a host
        change: ``while state._host_messages.empty(): time.sleep(0.1)``. Here a view of the
        updates this worker has heard of and not yet acted on (a reset acts on them)."""
        return _HostMessages()

    def mark_committed(self) -> None:
        """Hook: the live state is the commit just saved (an interrupt is on its way). A state
        that keeps committed copies may note it to spare the sync after the reset."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class _HostMessages:
    """What Horovod scripts read of ``State._host_messages``: whether a host update is waiting."""

    def qsize(self) -> int:
        """1 while this worker has heard of a host update that no reset has acted on yet, else 0."""
        if not runtime.is_initialized():
            return 0
        updates = runtime.get().host_updates
        return int(updates.local_flags()[0])

    def empty(self) -> bool:
        return self.qsize() == 0


class ObjectState(State):
    """State made of plain picklable attributes: ``ObjectState(epoch=0, batch=0)``.

    ``save()`` keeps a deep copy (so later in-place changes to a list or dict do not leak
    into the commit); ``sync()`` broadcasts rank 0's live values and commits them, so that a
    new worker starts from a commit too.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any):
        """``ObjectState(epoch=0, batch=0)``; Horovod's ``ObjectState(hvd.broadcast_object,
        hvd.rank, epoch=0)`` too (its two framework arguments, by position or name, are not
        state)."""
        super().__init__(bcast_object, get_rank)
        self._bcast_object = bcast_object or (lambda obj: collectives.broadcast_object(obj, root_rank=0, trusted=True))
        self._saved_state: dict[str, Any] = {}
        self.__dict__.setdefault("_commit_seq", 0)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._object_keys = list(kwargs)
        self._save_objects()

    def _live(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._object_keys}

    def _save_objects(self) -> None:
        self._saved_state = copy.deepcopy(self._live())

    def save(self) -> None:
        self.__dict__["_commit_seq"] = self.commit_seq + 1
        self._save_objects()

    def restore(self) -> None:
        for name, value in copy.deepcopy(self._saved_state).items():
            setattr(self, name, value)

    def sync(self) -> None:
        agree_to_sync()
        live, seq = self._bcast_object((self._live(), self.commit_seq))
        for name, value in live.items():
            setattr(self, name, value)
        self.__dict__["_commit_seq"] = seq
        self._save_objects()

    def durable_state(self) -> dict[str, Any]:
        return {"objects": dict(self._saved_state)}

    def load_durable_state(self, saved: dict[str, Any]) -> None:
        self._load_durable_objects(saved)
        self._save_objects()

    def _load_durable_objects(self, saved: dict[str, Any]) -> None:
        """Set the plain attributes from a durable copy; refuse a copy that lacks one."""
        objects = saved.get("objects", {})
        missing = [k for k in self._object_keys if k not in objects]
        if missing:
            raise durable.DurableMismatch(f"attribute {missing[0]!r} of the state is not in the durable copy")
        for name in self._object_keys:
            setattr(self, name, objects[name])


def run(func: F) -> F:
    """Run ``func(state, ...)`` elastically: recover from failures and host changes in-process.

    On ``HorovodInternalError`` the state is restored to the last commit; on
    ``HostsUpdatedInterrupt`` the live state is kept (and the re-sync skipped when hosts were
    only removed and nobody new joined). Then the worker re-rendezvouses, forms the new
    round's group, runs the reset callbacks, syncs and calls ``func`` again. Any other
    exception propagates and ends the worker with a non-zero exit.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        rt = runtime.get()
        launched_for = (rt.rank, rt.size)
        fetch = getattr(state, "fetch_before_joining", None)
        if fetch is not None:
            fetch()  # a newcomer: the committed model, before the survivors hear of it (TorchState)
        if rt.join():
            # A newcomer to a running job takes its place here, its model built. Had the job
            # changed since it was launched, what the script derived from hvd.size() is stale:
            # the reset callbacks (which derive it again after every reset) run first.
            if (rt.rank, rt.size) != launched_for:
                state.on_reset()
        rt.active_state = state  # what the job trains: its commit count for the driver (Runtime.commit_seq)
        try:
            return _run(func, state, rt, args, kwargs)
        finally:
            rt.active_state = None
            join.sync_with(None)  # (a join() after the elastic function is a plain Horovod one)
            join_news.pending_from(None)

    return wrapper  # type: ignore[return-value]  # called as func is (functools.wraps); mypy sees another type


def _restore_durable(state: State, rt: Any) -> None:
    """Rank 0 of a round that no holder of the state joined: load the newest durable copy
    (the sync then gives it to everyone). A copy that does not fit ends the job, with the
    first key that differs, instead of training from scratch."""
    loaded = time.monotonic()
    try:
        info, meta, data = rt.fetch_durable()
    except Exception as exc:  # the checkpoint's fault or the driver's, never this host's
        message = f"cannot read the durable copy from the checkpoint directory: {exc}"
        rt.report_restore_failed(message)
        raise RuntimeError(message) from None
    try:
        commit, steps = state.load_durable(meta, data)
    except durable.DurableMismatch as exc:
        message = f"the durable copy in the checkpoint directory does not fit this state: {exc}"
        rt.report_restore_failed(message)
        raise RuntimeError(message) from None
    rt.steps = steps
    rt.restore = False
    rt.report_restored(commit, steps)
    log.warning("rank 0: restored the durable copy of commit %d (%d steps, %.1f MB) in %.2f s", commit, steps,
                (len(meta) + len(data)) / 1e6, time.monotonic() - loaded)


#: What the ranks agree on before a reset's sync (see worker/agreement.py): a rank elsewhere
#: names its own collective, and every rank raises CollectiveMismatch with both.
SYNC_SIGNATURE = {"collective": "hvd.elastic.run's state sync",
                  "hint": "In an elastic script the state's sync replaces broadcast_parameters, "
                          "broadcast_optimizer_state and broadcast_object of the state: remove those calls"}


def agree_to_sync() -> None:
    """Collective, at the start of a state's sync (after a newcomer's fetch, which must come
    before it joins): every rank is at its sync. One tiny allgather per reset. A newcomer in a
    collective of its own instead (a ported script's broadcast_parameters before the elastic
    function) made the ranks wait on each other until --collective-timeout, and then its
    healthy host was blacklisted."""
    if not runtime.is_initialized():  # (a state synced by a broadcast of its own, with no job: nothing to agree)
        return
    try:
        collectives.agree(rounds.current(), SYNC_SIGNATURE, "hvd.elastic.run's state sync")
    except CollectiveMismatch as exc:
        off = off_script(exc.signatures, exc.ranks, runtime.get().rank)
        if not off:
            raise
        # Rank 0 holds the job's newest state and is here: the others are off the script (a
        # ported newcomer's broadcast_parameters); they fail with the mismatch, and this rank
        # goes on without them from its last commit, as after any failed collective. The job
        # ended before, with every rank failed and every host blacklisted.
        if len(off) == 1:
            raise HorovodInternalError(f"rank {off[0]} is not at the state's sync (its error says why); going on "
                                       f"without it") from None
        raise HorovodInternalError(f"ranks {', '.join(map(str, off))} are not at the state's sync (their errors "
                                   f"say why); going on without them") from None


def off_script(signatures: list[Any], ranks: list[int], rank: int) -> list[int]:
    """The ranks elsewhere than the state's sync, when rank 0 and ``rank`` are at it (none
    otherwise: then this rank is no better placed than the others, and raises the mismatch)."""
    sync = SYNC_SIGNATURE["collective"]
    at = {r for r, s in zip(ranks, signatures) if s is None or s.get("collective") == sync}  # (None: in join())
    if 0 not in at or rank not in at:
        return []
    return sorted(set(ranks) - at)


def _run(func: Callable[..., Any], state: State, rt: Any, args: Any, kwargs: Any) -> Any:
    """The loop of :func:`run`: call ``func``, recover, re-form, sync, call it again."""
    skip_sync = False
    resetting = False
    started = time.monotonic()  # when the current reset began (set again at each)
    error: str | None = None
    restored = False
    while True:
        try:
            if rt.restore and rt.rank == 0:
                _restore_durable(state, rt)
                # Past round 0 this resumes a job whose every worker was lost: the driver's
                # reset ends at this round's first step, as any other does.
                resetting = resetting or rt.round > 0
            if not skip_sync:
                synced = time.monotonic()
                state.sync()
                join.take_diverged()  # (TorchState's sync took it already; any other state sends all)
                rt.emit(Kind.SYNC_DONE, ms=round((time.monotonic() - synced) * 1000, 2),
                        skipped=state.__dict__.pop("_skipped_bytes", None),
                        sent_to=state.__dict__.pop("_sent_to", None))
            rt.has_state = True
            if resetting:
                rt.current_round.mark_reset()
                log.info("rank %d/%d: reset to round %d took %.1f ms", rt.rank, rt.size, rt.round,
                         (time.monotonic() - started) * 1000)
            join_news.pending_from(getattr(state, "_sampler_news", None))  # (what a join() publishes)
            join.sync_with(getattr(state, "sync_after_join", None))  # (what a join() ends with)
            return func(state, *args, **kwargs)
        except HorovodInternalError as exc:
            # While the driver stops the job, a peer stopped first fails this rank's collective:
            # the stop, not news (a user saw "failed ...; restoring the last commit" after
            # "received SIGTERM: stopping 2 worker(s)").
            log.log(logging.DEBUG if rt.job_ending else logging.WARNING, "rank %d: %s; restoring the last commit",
                    rt.rank, exc)
            rt.emit(Kind.FAILURE_DETECTED, error=str(exc)[:300])
            started = time.monotonic()
            state.restore()
            steps = state.restored_steps()
            if steps is not None:
                rt.steps = steps
            rt.emit(Kind.RESTORE, ms=round((time.monotonic() - started) * 1000, 2))
            skip_sync = False
            restored = True
            # Only this rank knows of its own timeout; a dead peer the driver sees itself.
            error = str(exc) if isinstance(exc, CollectiveTimeout) else None
        except HostsUpdatedInterrupt as exc:
            started = time.monotonic()
            skip_sync = exc.skip_sync
            error = None
            # A rank whose replica a join() left unlike the others' asks for a sync as a rank
            # that rolled back does: after removals only, it went on with a replica of its own.
            restored = join.diverged()
        resetting = True
        rt.rendezvous(error=error, restored=restored)
        # The driver decides for everyone whether to sync: newcomers must receive the
        # state even when the interrupt said "removals only" (another change may have
        # been folded into the same reset), and when the round failed or a rank rolled
        # back, ranks that took the interrupt hold a newer commit than those that
        # restored. A rank-local choice could leave some ranks in sync() and others not.
        skip_sync = skip_sync and not rt.must_sync
        state.on_reset()
