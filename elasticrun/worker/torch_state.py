"""``hvd.elastic.TorchState``: elastic state for a model, an optimizer, samplers and more.

Attributes whose type has a registered *handler* (models, optimizers, LR schedulers,
:class:`ElasticSampler` by default) are saved, restored and synced by that handler; every
other keyword is a plain :class:`ObjectState` attribute (deep-copied, broadcast by pickle).

Commits happen every few batches, so ``save()`` must cost about a memcpy: tensors are copied
into host buffers allocated at the first save and reused afterwards (no pickling, no new
allocations while shapes stay the same), and ``restore()`` copies them back in place, so
parameters and optimizer state keep their identity (hooks, the DistributedOptimizer and
``torch.compile`` keep pointing at the live tensors).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed

from elasticrun.worker import collectives, runtime
from elasticrun.worker.elastic import ObjectState
from elasticrun.worker.optimizer import _DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from elasticrun.worker.sampler import ElasticSampler

__all__ = ["StateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "LRSchedulerStateHandler", "TorchState", "register_handler", "get_handler_factory"]


class StateHandler:
    """Saves, restores and syncs one attribute of a :class:`TorchState`.

    ``save``/``restore`` are local (no collectives: they also run at construction and on
    assignment, which not every rank does at the same time). ``merge`` and ``sync`` are
    collectives that every rank calls in the same order: ``merge`` before each commit's save,
    ``sync`` after a reset (bring every rank to rank 0's live value). ``on_reset`` runs
    locally after every reset, before any sync.
    """

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def merge(self) -> None:
        """Collective step before a commit's save (default: nothing to agree on)."""

    def on_reset(self) -> None:
        """Local step after a reset (the world may have a new size)."""


def _host_buffer(buf: torch.Tensor | None, src: torch.Tensor) -> torch.Tensor:
    """``buf`` if it can hold ``src``, else a new host buffer (pinned for GPU sources)."""
    if buf is not None and buf.shape == src.shape and buf.dtype == src.dtype:
        return buf
    return torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=src.is_cuda)


def _copy_in(buffers: dict[Any, torch.Tensor], key: Any, src: torch.Tensor) -> torch.Tensor:
    buf = _host_buffer(buffers.get(key), src)
    buffers[key] = buf
    buf.copy_(src.detach(), non_blocking=src.is_cuda)
    return buf


def _wait_for_copies(tensors: Any) -> None:
    """Device-to-host copies were asynchronous (into pinned memory): wait once for all."""
    if torch.cuda.is_available() and any(t.is_cuda for t in tensors):
        torch.cuda.synchronize()


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: parameters and persistent buffers (its ``state_dict``)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self._buffers: dict[str, torch.Tensor] = {}
        self._extra: dict[str, Any] = {}  # non-tensor entries (module extra state)
        self.save()

    def save(self) -> None:
        live = self.value.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, t in live.items():
                if isinstance(t, torch.Tensor):
                    _copy_in(self._buffers, name, t)
                else:
                    self._extra[name] = copy.deepcopy(t)
        for gone in [k for k in self._buffers if k not in live]:
            del self._buffers[gone]
        for gone in [k for k in self._extra if k not in live]:
            del self._extra[gone]
        _wait_for_copies(t for t in live.values() if isinstance(t, torch.Tensor))

    def restore(self) -> None:
        live = self.value.state_dict(keep_vars=True)
        fits = set(live) == set(self._buffers) | set(self._extra) and all(
            isinstance(live[k], torch.Tensor) and live[k].shape == b.shape and live[k].dtype == b.dtype
            for k, b in self._buffers.items())
        if not fits or self._extra:
            # The module changed shape (or has extra state): let it load a full copy.
            saved = {k: b.clone() for k, b in self._buffers.items()}
            saved.update(copy.deepcopy(self._extra))
            self.value.load_state_dict(saved)
            return
        with torch.no_grad():
            for name, buf in self._buffers.items():
                live[name].copy_(buf)

    def sync(self) -> None:
        broadcast_parameters(self.value.state_dict(), root_rank=getattr(self, "sync_root", 0))


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer`` (plain or DistributedOptimizer): per-parameter state and
    the options of every param group (lr, momentum, ...). Parameters are identified by
    their position in ``param_groups``, like ``Optimizer.state_dict`` does."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        # position -> {key: host buffer (tensor state) or deep copy (anything else)}
        self._state: dict[int, dict[str, Any]] = {}
        self._devices: dict[tuple[int, str], torch.device] = {}
        self._groups: list[dict[str, Any]] = []
        self.save()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.value.param_groups for p in g["params"]]

    def save(self) -> None:
        opt = self.value
        self._groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        state: dict[int, dict[str, Any]] = {}
        used: set[tuple[int, str]] = set()
        copied: list[torch.Tensor] = []
        with torch.no_grad():
            for i, p in enumerate(self._params()):
                live = opt.state.get(p)
                if not live:
                    continue
                entry: dict[str, Any] = {}
                for k, v in live.items():
                    if isinstance(v, torch.Tensor):
                        entry[k] = _copy_in(self._buffers, (i, k), v)
                        self._devices[(i, k)] = v.device
                        used.add((i, k))
                        copied.append(v)
                    else:
                        entry[k] = copy.deepcopy(v)
                state[i] = entry
        for gone in [k for k in self._buffers if k not in used]:
            del self._buffers[gone]
            self._devices.pop(gone, None)
        self._state = state
        _wait_for_copies(copied)

    def restore(self) -> None:
        opt = self.value
        if isinstance(opt, _DistributedOptimizer):
            opt._dist_clear(discard=True)  # a step in progress belongs to the failed round
        for group, saved in zip(opt.param_groups, self._groups):
            group.update(copy.deepcopy(saved))
        with torch.no_grad():
            for i, p in enumerate(self._params()):
                entry = self._state.get(i)
                if entry is None:
                    opt.state.pop(p, None)  # no state at the commit (e.g. before the first step)
                    continue
                live = opt.state[p]
                for k in [k for k in live if k not in entry]:
                    del live[k]
                for k, v in entry.items():
                    if not isinstance(v, torch.Tensor) or (i, k) not in self._buffers:
                        live[k] = copy.deepcopy(v)
                        continue
                    device = self._devices[(i, k)]
                    cur = live.get(k)
                    if (isinstance(cur, torch.Tensor) and cur.shape == v.shape and cur.dtype == v.dtype
                            and cur.device == device):
                        cur.copy_(v)
                    else:
                        live[k] = v.to(device, copy=True)

    def sync(self) -> None:
        broadcast_optimizer_state(self.value, root_rank=getattr(self, "sync_root", 0))


class LRSchedulerStateHandler(StateHandler):
    """A ``torch.optim.lr_scheduler.LRScheduler`` through its (small) ``state_dict``; a
    deep copy of the scheduler itself would drag its optimizer along."""

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self) -> None:
        self.value.load_state_dict(collectives.broadcast_object(self.value.state_dict(), getattr(self, "sync_root", 0),
                                                                "lr_scheduler"))


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`, following the contract in its docstring.

    Each rank records only its own batches, so before a commit's save ``merge`` unions the
    processed sets over the ranks (only what each rank added since the last save travels),
    without repartitioning: a pass in progress continues. ``restore`` loads the committed
    state (which repartitions); ``on_reset`` repartitions for the new world (enough after a
    removals-only reset, where sync is skipped and all ranks hold the merged set of the
    interrupted commit); ``sync`` unions every rank's live set and takes rank 0's epoch.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._epoch = sampler.epoch
        self._processed: set[int] = set(sampler.processed_indices)

    def save(self) -> None:
        self._epoch = self.value.epoch
        self._processed = set(self.value.processed_indices)

    def merge(self) -> None:
        s = self.value
        if s.epoch == self._epoch and self._processed <= s.processed_indices:
            news = sorted(s.processed_indices - self._processed)
        else:  # a new epoch since the last save: send everything
            news = sorted(s.processed_indices)
        for epoch, part in collectives.allgather_object((s.epoch, news), "sampler.processed_indices"):
            if epoch == s.epoch:
                s.merge_processed(part)

    def restore(self) -> None:
        self.value.load_state_dict({"epoch": self._epoch, "processed_indices": sorted(self._processed)})

    def on_reset(self) -> None:
        self.value.reset()

    def sync(self) -> None:
        s = self.value
        gathered = collectives.allgather_object((s.epoch, sorted(s.processed_indices)), "sampler.sync")
        epoch = gathered[getattr(self, "sync_root", 0)][0]  # the sync root's (rank 0's unless told)
        merged: set[int] = set()
        for e, part in gathered:
            if e == epoch:  # a newcomer's empty epoch-0 set must not mix into another epoch
                merged.update(part)
        s.load_state_dict({"epoch": epoch, "processed_indices": sorted(merged)})


HandlerFactory = Callable[[Any], StateHandler]

#: (type, factory), most recently registered first; the first isinstance match wins.
_registry: list[tuple[type, HandlerFactory]] = []


def register_handler(type_: type, factory: HandlerFactory) -> None:
    """Handle attributes of ``type_`` (and subclasses) with ``factory(value)``. Later
    registrations take precedence, so users can override the defaults."""
    _registry[:] = [(t, f) for t, f in _registry if t is not type_]
    _registry.insert(0, (type_, factory))


def get_handler_factory(value: Any) -> HandlerFactory | None:
    for type_, factory in _registry:
        if isinstance(value, type_):
            return factory
    return None


register_handler(torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler)
register_handler(ElasticSampler, SamplerStateHandler)
register_handler(torch.optim.Optimizer, OptimizerStateHandler)
register_handler(torch.nn.Module, ModelStateHandler)


class TorchState(ObjectState):
    """``TorchState(model, optimizer, sampler=..., epoch=0, batch=0)``: every keyword is an
    attribute; handled types go through their handlers, the rest is ObjectState."""

    register_handler = staticmethod(register_handler)

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs = {"model": model, "optimizer": optimizer, **kwargs}
        handlers: dict[str, StateHandler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            factory = get_handler_factory(value)
            if factory is None:
                plain[name] = value
            else:
                handlers[name] = factory(value)
                object.__setattr__(self, name, value)
        object.__setattr__(self, "_handlers", handlers)
        object.__setattr__(self, "_constructed", False)
        object.__setattr__(self, "_commit_seq", 0)  # saves by commit(); the newest commit wins a sync
        object.__setattr__(self, "_sync_root", 0)
        super().__init__(bcast_object=lambda obj: collectives.broadcast_object(obj, root_rank=self._sync_root),
                         get_rank=runtime.rank, **plain)
        self._constructed = True

    def __setattr__(self, name: str, value: Any) -> None:
        handlers: dict[str, StateHandler] | None = self.__dict__.get("_handlers")
        if handlers is not None and self.__dict__.get("_constructed") and not name.startswith("_"):
            factory = get_handler_factory(value)
            if name in handlers:
                if factory is None:  # e.g. state.model = None: now a plain attribute
                    del handlers[name]
                    self._object_keys.append(name)
                else:
                    handlers[name] = factory(value)  # a new object: new handler, new buffers
            elif name in self._object_keys and factory is not None:
                self._object_keys.remove(name)
                self._saved_state.pop(name, None)
                handlers[name] = factory(value)
        super().__setattr__(name, value)

    def _handlers_in_order(self) -> list[StateHandler]:
        # Collectives must be issued in the same order on every rank: sort by name.
        return [self._handlers[k] for k in sorted(self._handlers)]

    def save(self) -> None:
        if not self.__dict__.get("_constructed"):
            # Called by ObjectState.__init__: the handlers saved when they were created, and
            # construction is no collective point (newcomers construct, survivors do not).
            super().save()
            return
        for handler in self._handlers_in_order():
            handler.merge()
        self._commit_seq += 1
        self._save_local()

    def _save_local(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        # Sync from the rank holding the newest commit (the lowest such rank): rank 0 unless
        # a commit completed on some ranks while others abandoned it (a peer died at the end
        # of its merge and they saw the abort first). Syncing from rank 0 then would mix
        # rank 0's older model with the newer, merged sampler set: samples lost.
        newest = torch.tensor([self._commit_seq * 65536 + 65535 - runtime.get().rank], dtype=torch.int64)
        collectives.allreduce_inplace(newest, torch.distributed.ReduceOp.MAX, "state.newest_commit")
        self._sync_root = 65535 - int(newest.item()) % 65536
        self._commit_seq = int(newest.item()) // 65536
        for handler in self._handlers_in_order():
            handler.sync_root = self._sync_root  # type: ignore[attr-defined]
            handler.sync()
        if self._object_keys:
            for name, value in self._bcast_object(self._live()).items():
                setattr(self, name, value)
        self._save_local()  # just synced: nothing to merge

    def on_reset(self) -> None:
        for handler in self._handlers.values():
            handler.on_reset()
        super().on_reset()
