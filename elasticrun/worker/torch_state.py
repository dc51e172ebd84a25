"""``hvd.elastic.TorchState``: elastic state for a model, an optimizer, samplers and more.

Attributes whose type has a registered *handler* (models, optimizers, LR schedulers,
:class:`ElasticSampler` by default; see :mod:`elasticrun.worker.state_handlers`) are saved,
restored and synced by that handler; every other keyword is a plain :class:`ObjectState`
attribute (deep-copied, broadcast by pickle). With ``background_commit=True`` the bulk of a
commit's copy runs on a thread, and everything that could change what it copies waits for it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import weakref
from typing import Any, Callable

import torch
import torch.distributed

from elasticrun.worker import collectives, durable, elastic, join, prefetch, rounds
from elasticrun.worker.broadcast import load_keeping_groups
from elasticrun.worker.copier import DeviceCopy
from elasticrun.worker.elastic import ObjectState
from elasticrun.worker.process_sets import ProcessSet, global_process_set
from elasticrun.worker.sampler import ElasticSampler
# The handler API, importable from here as before the split.
from elasticrun.worker.state_handlers import (
    HandlerFactory,
    LRSchedulerStateHandler,
    ModelStateHandler,
    OptimizerStateHandler,
    SamplerStateHandler,
    StateHandler,
    get_handler_factory,
    register_handler,
    sync_handler,
)

log = logging.getLogger("elasticrun.worker")

__all__ = ["StateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "LRSchedulerStateHandler", "HandlerFactory", "TorchState", "register_handler", "get_handler_factory"]


#: Below this many bytes of model and optimizer state, a sync that some ranks could skip still
#: broadcasts to all: forming a subgroup of the others costs a few milliseconds, about what
#: sending this much more costs over loopback gloo.
_SEND_TO_SOME_BYTES = 16 << 20


def _bytes_to_send(handler: Any, keep: frozenset[str]) -> int:
    """Bytes of a model's parameters (but ``keep``) or of an optimizer's state tensors: what a
    sync sends to the ranks that lack them (0 for other handlers)."""
    if isinstance(handler, ModelStateHandler):
        params = handler.parameter_names() - keep
        return sum(b.numel() * b.element_size() for k, b in handler._buffers.items() if k in params)
    if isinstance(handler, OptimizerStateHandler):
        return sum(b.numel() * b.element_size() for b in handler._buffers.values())
    return 0


def _sent_words(needs: list[int], receivers: ProcessSet | None, r: Any) -> str:
    """Where a sync sent the model and optimizer state, for the root's log line."""
    ranks = ", ".join(map(str, needs[:8])) + (f" and {len(needs) - 8} more" if len(needs) > 8 else "")
    if receivers is None:
        return "every rank holds the model and optimizer state: none sent"
    if receivers is not global_process_set:
        return f"model and optimizer state sent to rank(s) {ranks} only (the others hold them)"
    if len(needs) < r.size - 1:
        why = "NCCL" if r.device_backend == "nccl" else "a small state"
        return f"model and optimizer state sent to every rank ({why}: as cheap as to rank(s) {ranks} alone)"
    return "model and optimizer state sent to every rank"


def _call_all(functions: list[Callable[[], None]]) -> None:
    for f in functions:
        f()


def _named(handler: StateHandler, name: str) -> StateHandler:
    """``handler``, told the attribute it handles (a sampler's joined ranks publish by it)."""
    try:
        handler.name = name
    except AttributeError:  # (a user's handler with __slots__: it has no sampler's join to follow)
        pass
    return handler


class TorchState(ObjectState):
    """``TorchState(model, optimizer, sampler=..., epoch=0, batch=0)``: every keyword is an
    attribute; handled types go through their handlers, the rest is ObjectState.

    ``background_commit=True`` (keyword only; not an attribute) moves the bulk of each
    commit's copy, the parameters and optimizer state, to a background thread, so that the
    training thread pays only for what the next forward may change (BatchNorm statistics
    and other buffers, non-tensor state) and for the host check. Every optimizer of the
    state waits for the copy before it steps, and ``restore()``, ``sync()`` and the next
    commit wait too. It pays off when a core is idle while training runs (GPU training,
    or fewer ranks than cores); with every core busy the copy only moves. The contract:
    between a commit and the next ``optimizer.step()``, parameters change only through
    the state's optimizers; code that changes them otherwise calls
    :meth:`wait_for_commit` first.
    """

    register_handler = staticmethod(register_handler)

    # Set in __init__ through object.__setattr__ (this class's __setattr__ routes public names
    # to handlers and ObjectState's attributes); declared here for the type checker.
    _handlers: dict[str, StateHandler]
    _constructed: bool
    _commit_seq: int
    _background: bool
    _pending: concurrent.futures.Future[None] | None
    _device_copies: list[DeviceCopy]
    _copy_thread: concurrent.futures.ThreadPoolExecutor | None
    _guarded: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any]

    #: How long a wait for a background commit copy may take before it is reported.
    COMMIT_WAIT_TIMEOUT = 600.0

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 *, background_commit: bool = False, **kwargs: Any) -> None:
        kwargs = {"model": model, "optimizer": optimizer, **kwargs}
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            factory = get_handler_factory(value)
            if factory is None:
                plain[name] = value
            else:
                handlers[name] = _named(factory(value), name)
                object.__setattr__(self, name, value)
        object.__setattr__(self, "_handlers", handlers)
        object.__setattr__(self, "_constructed", False)
        object.__setattr__(self, "_commit_seq", 0)  # saves by commit(); the newest commit wins a sync
        object.__setattr__(self, "_background", bool(background_commit))
        object.__setattr__(self, "_pending", None)  # the background copy in flight (a Future)
        object.__setattr__(self, "_device_copies", [])  # background GPU-to-GPU copies in flight (DeviceCopy)
        object.__setattr__(self, "_copy_thread", None)  # ThreadPoolExecutor, created at first use
        object.__setattr__(self, "_guarded", weakref.WeakKeyDictionary())  # optimizer -> its step hook
        super().__init__(**plain)
        self._constructed = True

    def wait_for_commit(self) -> None:
        """Return once the last commit's background copy (if any) is complete; raise what
        it raised. A no-op without ``background_commit``. Copies from GPU to GPU are waited
        for on the GPU: the caller's stream is ordered after them, the host goes on."""
        copies = self._device_copies
        if copies:
            self._device_copies = []
            for c in copies:
                c.wait()
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result(timeout=self.COMMIT_WAIT_TIMEOUT)
        except concurrent.futures.TimeoutError:
            raise RuntimeError(f"the background copy of commit {self._commit_seq} did not finish within "
                               f"{self.COMMIT_WAIT_TIMEOUT:.0f} s") from None
        finally:
            if pending.done():
                self._pending = None

    def _guard_optimizers(self) -> frozenset[int]:
        """Hook every optimizer of the state so that its step waits for the copy; the ids of
        the parameters they update (which the copy may take its time over)."""
        guarded: set[int] = set()
        for handler in self._handlers.values():
            if isinstance(handler, OptimizerStateHandler):
                opt = handler.value
                if opt not in self._guarded:
                    ref = weakref.ref(self)

                    def wait(*_: Any, _ref: Any = ref) -> None:
                        state = _ref()
                        if state is not None:
                            state.wait_for_commit()

                    self._guarded[opt] = opt.register_step_pre_hook(wait)
                guarded.update(id(p) for g in opt.param_groups for p in g["params"])
        return frozenset(guarded)

    def __setattr__(self, name: str, value: Any) -> None:
        handlers: dict[str, StateHandler] | None = self.__dict__.get("_handlers")
        if handlers is not None and self.__dict__.get("_constructed") and not name.startswith("_"):
            factory = get_handler_factory(value)
            if name in handlers:
                if factory is None:  # e.g. state.model = None: now a plain attribute
                    del handlers[name]
                    self._object_keys.append(name)
                else:
                    handlers[name] = _named(factory(value), name)  # a new object: new handler, new buffers
            elif name in self._object_keys and factory is not None:
                self._object_keys.remove(name)
                self._saved_state.pop(name, None)
                handlers[name] = _named(factory(value), name)
        super().__setattr__(name, value)

    def _sampler_news(self) -> dict[str, tuple[int, list[int]]]:
        """What each sampler recorded since the last commit, by attribute: what ``hvd.join()``
        publishes for the others' commits (worker/join_news.py)."""
        return {name: h.news() for name, h in self._handlers.items() if isinstance(h, SamplerStateHandler)}

    def _handlers_in_order(self) -> list[StateHandler]:
        # Collectives must be issued in the same order on every rank: sort by name.
        return [self._handlers[k] for k in sorted(self._handlers)]

    def save(self) -> None:
        if not self.__dict__.get("_constructed"):
            # The handlers saved when they were created, and construction is no collective
            # point (newcomers construct, survivors do not).
            self._save_objects()
            return
        for handler in self._handlers_in_order():
            handler.merge()
        self._commit_seq += 1
        self._save_local(background=self._background)
        self._serve_newcomers()

    def _serve_newcomers(self) -> None:
        """Rank 0 answers newcomers' fetches of the committed model (worker/prefetch.py)."""
        r = rounds.installed()
        if r is not None and r.rank == 0 and any(
                isinstance(h, ModelStateHandler) for h in self._handlers.values()):
            prefetch.serve(self)

    def _save_local(self, background: bool = False, keep: dict[str, frozenset[Any]] | None = None) -> None:
        self.wait_for_commit()  # the buffers are about to be overwritten
        self._before_commit_copy()  # ... and a durable copy may still be reading them on the GPU
        if keep:  # tensors whose committed copies are current already (see sync)
            for name, handler in self._handlers.items():
                if name in keep and isinstance(handler, (ModelStateHandler, OptimizerStateHandler)):
                    handler.save(keep[name])
                else:
                    handler.save()
        elif background:
            guarded = self._guard_optimizers()
            deferred = [f for f in (h.save_deferred(guarded) for h in self._handlers.values()) if f is not None]
            self._device_copies = [f for f in deferred if isinstance(f, DeviceCopy)]
            later = [f for f in deferred if not isinstance(f, DeviceCopy)]
            if later:
                if self._copy_thread is None:
                    self._copy_thread = concurrent.futures.ThreadPoolExecutor(
                        max_workers=1, thread_name_prefix="elasticrun-commit")
                self._pending = self._copy_thread.submit(_call_all, later)
        else:
            for handler in self._handlers.values():
                handler.save()
        self._save_objects()

    def staging_sources(self, tensors: list[Any]) -> list[Any]:
        """The committed copies stand in for the live GPU tensors they copy: the durable copy
        then reads what the commit saved, beside training, and the next step need not wait.
        Copies on the same GPU are read on a side stream; copies in host memory (pinned, where
        the commit did not fit on the GPU) are complete once the commit is, and are read at
        once. Reading the live tensors instead would race the next step, which updates them
        while a side stream still copies them out: a torn durable copy."""
        self.wait_for_commit()  # a background copy into them may still run (waited for on the GPU)
        kept: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}
        for handler in self._handlers.values():
            plan = getattr(handler, "_plan", None)
            if plan is not None:
                for src, buf in plan.pairs():
                    if src.is_cuda and (buf.device == src.device or buf.device.type == "cpu"):
                        kept[(src.data_ptr(), src.dtype, src.numel())] = buf
        if not kept:
            return tensors
        return [kept.get((t.data_ptr(), t.dtype, t.numel()), t) if t.is_cuda else t for t in tensors]

    def durable_state(self) -> dict[str, Any]:
        """The handled objects' ``state_dict()`` (model, optimizer, LR scheduler, sampler) and
        the plain attributes, right after a commit (live == committed then)."""
        handlers = {}
        for name, h in sorted(self._handlers.items()):
            if not hasattr(h.value, "state_dict"):
                raise NotImplementedError(f"durable copies need state_dict()/load_state_dict() on {name!r} "
                                          f"({type(h.value).__name__})")
            # (a sampler's processed set as a tensor of bits, written raw: see _durable_state_dict)
            handlers[name] = (h.value._durable_state_dict() if isinstance(h.value, ElasticSampler)
                              else h.value.state_dict())
        return {"objects": dict(self._saved_state), "handlers": handlers}

    def load_durable_state(self, saved: dict[str, Any]) -> None:
        handlers = saved.get("handlers", {})
        self.wait_for_commit()
        objects = saved.get("objects", {})
        for name, h in sorted(self._handlers.items()):
            if name not in handlers and hasattr(objects.get(name), "state_dict"):
                # Kept as a plain attribute by an earlier elasticrun (a GradScaler before it had
                # a handler): its state is the same.
                handlers = dict(handlers, **{name: objects[name].state_dict()})
            if name not in handlers:
                raise durable.DurableMismatch(f"{name}: the state has it, the durable copy does not")
            if isinstance(h, ModelStateHandler):
                durable.check_fits(name, h.value.state_dict(), handlers[name])
            elif isinstance(h.value, torch.optim.Optimizer):
                durable.check_optimizer_fits(name, h.value.state_dict(), handlers[name])
            try:
                if isinstance(h.value, torch.optim.Optimizer):  # its groups stay the ones a scheduler holds
                    load_keeping_groups(h.value, handlers[name])
                else:
                    h.value.load_state_dict(handlers[name])
            except (KeyError, ValueError, RuntimeError, TypeError) as exc:
                raise durable.DurableMismatch(f"{name}: {str(exc).splitlines()[0][:300]}") from None
        self._load_durable_objects(saved)
        self._save_local()  # the commit is the durable copy now

    def restore(self) -> None:
        self.wait_for_commit()
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        self.wait_for_commit()
        self.fetch_before_joining()
        elastic.agree_to_sync()
        fetched = self.__dict__.pop("_fetched", None)
        held = self._commit_seq
        tensors = {name: h for name, h in self._handlers.items()
                   if isinstance(h, (ModelStateHandler, OptimizerStateHandler))}
        diverged = join.take_diverged()  # after a join() ranks holding the same commit may differ: none holds it
        holds = bool(self.__dict__.get("_synced")) and all(h.holds_commit() for h in tensors.values()) and not diverged
        root, some_fetched, needs = self._newest_commit_root(fetched is not None, holds)
        keep: dict[str, frozenset[str]] = {}
        if some_fetched:
            keep = prefetch.agree(self, root, fetched,
                                  holds_newest=self.__dict__.get("_synced", False) and held == self._commit_seq)
        else:
            for handler in self._handlers.values():
                if isinstance(handler, ModelStateHandler):
                    handler.end_watch()  # a fetch under way is stale now: its newcomer joins with a full sync
        receivers = self._receivers(root, needs, keep)
        r = rounds.current()
        self.__dict__["_sent_to"] = (0 if receivers is None else r.size - 1 if receivers is global_process_set
                                     else len(needs))  # for the sync's event
        if r.rank == root and r.size > 1:
            log.info("sync of commit %d from rank %d: %s", self._commit_seq, root, _sent_words(needs, receivers, r))
        for name in sorted(self._handlers):
            handler = self._handlers[name]
            # A subclass that defines its own sync(root) is called as before: it sends to all.
            if isinstance(handler, ModelStateHandler) and type(handler).sync is ModelStateHandler.sync:
                handler.sync(root, keep.get(name, frozenset()), receivers)
            elif isinstance(handler, OptimizerStateHandler) and type(handler).sync is OptimizerStateHandler.sync:
                handler.sync(root, receivers)
            elif name in keep and isinstance(handler, ModelStateHandler):
                handler.sync(root, keep[name])
            else:
                sync_handler(handler, root)
        if self._object_keys:
            for name, value in collectives.broadcast_object(self._live(), root_rank=root, trusted=True).items():
                setattr(self, name, value)
        # Committed again below (just synced: nothing to merge), but for what the sync did not
        # write: the root's tensors (it only sends), and those of the ranks it left out
        # (they held the commit already). What a restore copied from the committed copies
        # (or an interrupt found equal to them) and nothing wrote since is not copied back:
        # for a 1 GiB model, a whole copy off every survivor's recovery.
        saved_as: dict[str, frozenset[Any]] = dict(keep)
        for name, h in tensors.items():
            unchanged = h.unchanged_since_restore()
            if unchanged:
                saved_as[name] = saved_as.get(name, frozenset()) | unchanged
        self._save_local(keep=saved_as)
        self.__dict__["_synced"] = True
        self._serve_newcomers()

    def sync_after_join(self, last: int) -> None:
        """As ``hvd.join()`` ends, on every rank: take rank ``last``'s replica (the rank that
        joined last applied every step; the others none since they joined) and commit it
        everywhere under one commit number, newer than any rank's (see ``join._sync_state``).
        The sampler's processed sets are merged as in any sync, so what each rank recorded
        before it joined stays processed."""
        self.__dict__["_sync_from"] = last
        try:
            self.sync()
        finally:
            self.__dict__.pop("_sync_from", None)

    def mark_committed(self) -> None:
        """The live state is the commit just saved (an interrupt raised right after the save):
        the tensors' handlers note it, so that the sync after the reset need not send this
        rank what it holds (see :meth:`_newest_commit_root`)."""
        for handler in self._handlers.values():
            if isinstance(handler, (ModelStateHandler, OptimizerStateHandler)):
                handler.mark_committed()

    def fetch_before_joining(self) -> None:
        """A worker launched into a running job fetches the committed model from rank 0
        before it asks for its place, while the survivors train (worker/prefetch.py); its
        first sync then receives only what changed since. A no-op for everyone else."""
        if rounds.deferred() and "_fetched" not in self.__dict__:
            from elasticrun.worker import runtime
            rt = runtime.get()
            self.wait_for_commit()
            self.__dict__["_fetched"] = prefetch.fetch(self, rt.worker_id, rt.emit)

    def _newest_commit_root(self, fetched: bool = False, holds: bool = False) -> tuple[int, bool, list[int]]:
        """Collective: the lowest rank holding the newest commit, which every rank adopts;
        whether some rank fetched the committed model before joining; and the other ranks
        the parameters and optimizer state must be sent to.

        The root is rank 0 unless a commit completed on some ranks while others abandoned it
        (a peer died at the end of its merge and they saw the abort first). Syncing from
        rank 0 then would mix rank 0's older model with the newer, merged sampler set:
        samples lost.

        ``holds``: this rank's parameters and optimizer state are its copy of the commit it
        holds, unchanged since (a restore, or an interrupt right after the commit). Ranks
        holding the same commit hold the same tensors (every step applies the same averaged
        gradients: what keeps data-parallel replicas equal at all), so when the root holds
        its commit too, a rank that holds the newest needs nothing sent: after a failure
        the sync sends no model at all, and a newcomer's costs one transfer, not one per
        survivor (gloo's broadcast sends to each rank in turn).
        """
        from elasticrun.worker import runtime

        rt = runtime.get() if runtime.is_initialized() else None
        r = rounds.current()
        v = torch.zeros(3 + r.size, dtype=torch.int64)
        v[0] = self._commit_seq * 65536 + 65535 - r.rank
        v[1] = int(fetched)
        v[2] = rt.steps if rt is not None else 0
        v[3 + r.rank] = self._commit_seq + 1 if holds else 0
        collectives.allreduce_inplace(v, torch.distributed.ReduceOp.MAX, "sync: who holds the newest commit")
        words = v.tolist()
        self._commit_seq = words[0] // 65536
        root = 65535 - words[0] % 65536
        if rt is not None:  # a newcomer counts the job's steps from here, as the survivors do
            rt.steps = max(rt.steps, words[2])
        forced = self.__dict__.get("_sync_from")
        if forced is not None:  # after join(): the last rank's replica, under a number nobody committed
            self._commit_seq += 1
            return int(forced), bool(words[1]), [i for i in range(r.size) if i != forced]
        held = [x == self._commit_seq + 1 for x in words[3:]]
        return root, bool(words[1]), [i for i in range(r.size) if i != root and not (held[root] and held[i])]

    def _receivers(self, root: int, needs: list[int], keep: dict[str, frozenset[str]]) -> ProcessSet | None:
        """The ranks the sync sends the parameters and optimizer state to: None (nobody),
        the global set, or a set of the root and ``needs``. The whole round's broadcast stands
        in for a set when that costs as little: a small state (forming a group costs a few
        milliseconds, about what sending 16 MiB to a few more ranks does; the size is agreed,
        so that every rank chooses alike), and a round with NCCL (whose broadcast is
        pipelined, where a new group would cost a communicator)."""
        r = rounds.current()
        if not needs:
            return None
        if len(needs) == r.size - 1 or r.device_backend == "nccl":
            return global_process_set
        size = torch.tensor([sum(_bytes_to_send(h, keep.get(name, frozenset())) for name, h in self._handlers.items())])
        collectives.allreduce_inplace(size, torch.distributed.ReduceOp.MAX, "state.sync_bytes")
        return global_process_set if int(size.item()) < _SEND_TO_SOME_BYTES else ProcessSet([root, *needs])

    def on_reset(self) -> None:
        for handler in self._handlers.values():
            handler.on_reset()
        super().on_reset()
