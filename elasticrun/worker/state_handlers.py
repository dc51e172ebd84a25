"""State handlers: how a :class:`~elasticrun.worker.torch_state.TorchState` saves, restores
and syncs each attribute of a type it knows.

A handler wraps one value (a model, an optimizer, an LR scheduler, an ``ElasticSampler``, or
a user's type registered with :func:`register_handler`). ``save``/``restore`` are local and
must cost about a memcpy: tensors are copied into buffers allocated at the first save and
reused afterwards (no pickling, no new allocations while shapes stay the same): host memory
for CPU tensors, the same GPU for CUDA tensors while they fit (``copier.commit_buffers``).
``restore()`` copies them back in place, so parameters and optimizer state keep their
identity (hooks, the DistributedOptimizer and ``torch.compile`` keep pointing at the live
tensors). ``merge`` and ``sync(root)`` are collectives.
"""

from __future__ import annotations

import copy
import inspect
import logging
import operator
import threading
import time
import warnings
from itertools import chain
from typing import Any, Callable, Iterable

import torch

from elasticrun.worker import collectives, join_news, process_sets, rounds
from elasticrun.worker.broadcast import broadcast_parameters, sync_optimizer_state
from elasticrun.worker.copier import CopyPlan, DeviceCopy, Watch, WatchedPlan, commit_buffers
from elasticrun.worker.index_set import IndexSet
from elasticrun.worker.optimizer import abandon_step
from elasticrun.worker.process_sets import ProcessSet, global_process_set
from elasticrun.worker.sampler import ElasticSampler

log = logging.getLogger("elasticrun.worker")

__all__ = ["StateHandler", "ModelStateHandler", "OptimizerStateHandler", "SamplerStateHandler",
           "LRSchedulerStateHandler", "HandlerFactory", "register_handler", "get_handler_factory", "sync_handler"]


class StateHandler:
    """Saves, restores and syncs one attribute of a :class:`TorchState`.

    ``save``/``restore`` are local (no collectives: they also run at construction and on
    assignment, which not every rank does at the same time). ``merge`` and ``sync`` are
    collectives that every rank calls in the same order: ``merge`` before each commit's save,
    ``sync(root)`` after a reset (bring every rank to rank ``root``'s live value). ``on_reset``
    runs locally after every reset, before any sync.
    """

    #: The attribute of the state it handles (set by ``TorchState``).
    name: str = ""

    def __init__(self, value: Any) -> None:
        self.value = value

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self, root: int) -> None:
        """Collective: make the value on every rank equal to rank ``root``'s.

        ``root`` holds the job's newest commit: rank 0, the longest-lived worker, unless a
        commit completed on some ranks only (a peer died at the end of its merge and the
        others saw the abort first); then the lowest rank that completed it."""
        raise NotImplementedError

    def merge(self) -> None:
        """Collective step before a commit's save (default: nothing to agree on)."""

    def save_deferred(self, guarded: frozenset[int]) -> Callable[[], None] | DeviceCopy | None:
        """A save split in two for ``TorchState(background_commit=True)``: do now what may
        change before the next optimizer step, and return the rest (a function another
        thread will run before any optimizer in the state steps again; or, for copies from
        GPU to GPU, a :class:`DeviceCopy` already queued on a side stream, which the next step
        waits for on the GPU), or None if nothing is left. ``guarded`` holds the ids of the
        parameters those optimizers update. The default saves everything now."""
        self.save()
        return None

    def on_reset(self) -> None:
        """Local step after a reset (the world may have a new size)."""


def _later(plan: CopyPlan) -> Callable[[], None] | DeviceCopy:
    """The deferred part of a background commit: queued on a side stream now when it is all
    GPU to GPU, else a function for the commit thread."""
    return plan.run_async() if plan.device_only else plan.run_released


# Bumped whenever any module registers (or replaces) a parameter, a buffer or a submodule:
# the cheap part of telling whether a model's state_dict() could have changed since a plan.
_structure_generation = 0
_watching = False
_watch_lock = threading.Lock()


def _structure_changed(*_args: Any) -> None:
    global _structure_generation
    _structure_generation += 1


def _watch_module_structure() -> None:
    """Count registrations on every ``torch.nn.Module`` from now on (idempotent).

    Called by the first model handler, not at import: a process that imports elasticrun
    but keeps no model in a TorchState pays nothing on its modules' registrations, and a
    plan is only ever compared with generations counted since before it was built.
    """
    global _watching
    with _watch_lock:
        if not _watching:
            torch.nn.modules.module.register_module_parameter_registration_hook(_structure_changed)
            torch.nn.modules.module.register_module_buffer_registration_hook(_structure_changed)
            torch.nn.modules.module.register_module_module_registration_hook(_structure_changed)
            _watching = True


def _plain_state_dict(module: torch.nn.Module) -> bool:
    """True if ``module.state_dict()`` is exactly its parameters and persistent buffers (no
    override, no extra state, no hooks): then a copy plan can stand in for the walk."""
    cls, base = type(module), torch.nn.Module
    return (cls.state_dict is base.state_dict and cls._save_to_state_dict is base._save_to_state_dict
            and getattr(cls, "get_extra_state", base.get_extra_state) is base.get_extra_state
            and not module._state_dict_hooks and not module._state_dict_pre_hooks)


def _structure_dicts(modules: list[torch.nn.Module]) -> list[Any]:
    """The containers whose sizes change when a module's state_dict() could (deletions and
    hook registrations do not go through the registration hooks)."""
    return [d for m in modules for d in (m._parameters, m._buffers, m._modules, m._non_persistent_buffers_set,
                                         m._state_dict_hooks, m._state_dict_pre_hooks)]


def _drop_grads(params: Iterable[torch.Tensor]) -> None:
    """A restore's: the gradients the aborted steps left in ``.grad``. A commit holds no pending
    gradient, and the redone step's backward adds to whatever ``.grad`` holds: a script that
    zeroes after ``step()`` (or accumulates over several backward passes) trained the redo on
    the aborted step's gradients too, and an inf there made a clean redo skip under a
    GradScaler. (As ``zero_grad()``'s default: None, not zeros.)"""
    for p in params:
        p.grad = None


class ModelStateHandler(StateHandler):
    """A ``torch.nn.Module``: parameters and persistent buffers (its ``state_dict``).

    The first save walks ``state_dict()`` and builds a :class:`CopyPlan`; later saves replay
    it without the walk as long as nothing could have changed the state_dict: no parameter,
    buffer or submodule registered anywhere since (a global registration hook counts them),
    no container of the model changed size (deletions, hooks), and every tensor still points
    at the same memory (``p.data = ...``, ``model.to(...)``). Otherwise the save walks again.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        _watch_module_structure()
        self._buffers: dict[str, torch.Tensor] = {}
        self._extra: dict[str, Any] = {}  # non-tensor entries (module extra state)
        self._plan: CopyPlan | None = None
        self._plan_generation = -1
        self._dicts: list[Any] = []  # see _structure_dicts; empty: no fast path
        self._sizes: list[int] = []
        # For background commits: (guarded parameter ids, their plan, the rest's plan, the names
        # of the rest's tensors).
        self._split: tuple[frozenset[int], CopyPlan, CopyPlan, list[str]] | None = None
        # While a newcomer fetches the committed tensors from this rank (worker/prefetch.py):
        # what commits overwrite is compared first and named. The lock orders the fetch's
        # start against every write into the buffers (a background commit's included).
        self._watch: Watch | None = None
        self._watched: tuple[CopyPlan, WatchedPlan] | None = None  # the plan it was built for, and it
        self._lock = threading.Lock()
        # What the last restore() wrote: name -> (live tensor, its version counter after the copy).
        self._restored: dict[str, tuple[torch.Tensor, int]] = {}
        self._at_commit = False  # a restore or mark_committed() since the last save
        self.save()

    def _plan_is_current(self) -> bool:
        return (self._plan is not None and bool(self._dicts) and self._plan_generation == _structure_generation
                and list(map(len, self._dicts)) == self._sizes and self._plan.current())

    def save(self, keep: frozenset[str] = frozenset()) -> None:
        """Commit the live model. ``keep``: tensors whose committed copy is known to equal the
        live one already (a sync that skipped them: see worker/prefetch.py, or tensors
        :meth:`unchanged_since_restore` names); not copied."""
        with self._lock:
            self._restored, self._at_commit = {}, False
            if self._watch is not None and self._watch.expired(time.monotonic()):
                self._watch = None  # its newcomer never joined; a later one fetches under a new watch
            if self._plan is not None and self._plan_is_current():
                if self._watch is not None and not keep:
                    if self._watched is None or self._watched[0] is not self._plan:
                        self._watched = (self._plan, WatchedPlan(self._named_pairs()))
                    self._watched[1].run(self._watch)
                elif self._watch is not None or keep:
                    named = [t for t in self._named_pairs() if t[0] not in keep]
                    if self._watch is not None:
                        WatchedPlan(named).run(self._watch)
                    else:
                        CopyPlan([src for _, src, _ in named], [buf for _, _, buf in named]).run()
                else:
                    self._plan.run()
                return
            if self._watch is not None:
                self._watch.everything = True  # the walk below may reallocate buffers
            self._save_walk()

    def _named_pairs(self) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
        """(name, live tensor, committed copy) for every tensor of the current plan."""
        assert self._plan is not None
        return [(name, src, buf) for name, (src, buf) in zip(self._buffers, self._plan.members())]

    def _save_walk(self) -> None:
        generation = _structure_generation
        live = self.value.state_dict(keep_vars=True)
        names = [k for k, t in live.items() if isinstance(t, torch.Tensor)]
        self._extra = {k: copy.deepcopy(t) for k, t in live.items() if not isinstance(t, torch.Tensor)}
        sources = [live[k] for k in names]
        if self._plan is None or not self._plan.current(sources) or list(self._buffers) != names:
            self._buffers = dict(zip(names, commit_buffers(sources, [self._buffers.get(k) for k in names])))
            self._plan = CopyPlan(sources, list(self._buffers.values()))
            self._split = None
        self._plan.run()
        modules = list(self.value.modules())
        if not self._extra and all(_plain_state_dict(m) for m in modules):
            self._dicts = _structure_dicts(modules)
            self._sizes = list(map(len, self._dicts))
            self._plan_generation = generation
        else:
            self._dicts, self._sizes = [], []

    def save_deferred(self, guarded: frozenset[int]) -> Callable[[], None] | DeviceCopy | None:
        # Buffers (BatchNorm statistics change in forward) and parameters no optimizer of
        # the state updates are copied now; the guarded parameters later.
        if not self._plan_is_current() or self._watch is not None:
            self.save()  # a watched commit compares as it copies: all of it now
            return None
        with self._lock:
            if self._split is None or self._split[0] != guarded:
                assert self._plan is not None  # current, checked above
                now_plan, later_plan = self._plan.split(lambda t: id(t) not in guarded)
                later_buffers = {id(buf) for _, buf in later_plan.members()}
                later_names = [name for name, _, buf in self._named_pairs() if id(buf) in later_buffers]
                self._split = (guarded, now_plan, later_plan, later_names)
            self._split[1].run()
        later = _later(self._split[2])
        if isinstance(later, DeviceCopy):
            return later  # GPU to GPU: never fetched by a newcomer (worker/prefetch.py serves host memory)
        names = self._split[3]

        def copy_later() -> None:
            with self._lock:
                later()
                if self._watch is not None:  # a fetch began before this copy ran: its bytes moved
                    self._watch.changed.update(names)
        return copy_later

    # --- a newcomer's prefetch (worker/prefetch.py) -------------------------------------------
    def watch(self, epoch: int) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Start watching (or go on with the watch already under way); the watch's epoch and
        the committed copies a newcomer may fetch: contiguous host tensors, by name."""
        with self._lock:
            offered = [(k, b) for k, b in self._buffers.items()
                       if b.device.type == "cpu" and b.is_contiguous() and b.numel() > 0]
            now = time.monotonic()
            if self._watch is None or self._watch.expired(now):
                self._watch = Watch(epoch, now)
                self._watch.names = [k for k, _ in offered]
            elif [k for k, _ in offered] != self._watch.names:
                self._watch.everything = True  # the buffers were reallocated since it began
            self._watch.renewed = now
            return self._watch.epoch, offered

    def end_watch(self) -> Watch | None:
        with self._lock:
            watch, self._watch = self._watch, None
            return watch

    def restore(self) -> None:
        self._restored, self._at_commit = {}, False
        _drop_grads(self.value.parameters())
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
        with torch.no_grad():  # one call for all: a copy per tensor costs its launch on a GPU
            names = list(self._buffers)
            if names:
                torch._foreach_copy_([live[k] for k in names], [self._buffers[k] for k in names])
        self._restored = {k: (live[k], live[k]._version) for k in names}
        self._at_commit = True

    def mark_committed(self) -> None:
        """The live model is its committed copy now (an interrupt right after a save): note
        each tensor's version, as a restore does, so that a sync knows this rank holds it."""
        with self._lock:
            if self._plan is not None and self._plan_is_current():
                self._restored = {name: (src, src._version) for name, src, _ in self._named_pairs()}
                self._at_commit = True

    def holds_commit(self) -> bool:
        """Whether every parameter still holds what the last restore (or mark_committed)
        left in it: then this rank's parameters are its committed copy. Buffers do not
        count: a sync sends them to every rank (BatchNorm statistics differ between ranks by
        design)."""
        if not self._at_commit or self._plan is None or not self._plan_is_current():
            return False
        unchanged = self.unchanged_since_restore(forget=False)
        # The plan's sources are the live tensors (no state_dict walk on the recovery path).
        return all(name in unchanged for name, src, _ in self._named_pairs() if isinstance(src, torch.nn.Parameter))

    def parameter_names(self) -> frozenset[str]:
        return frozenset(k for k, v in self.value.state_dict(keep_vars=True).items()
                         if isinstance(v, torch.nn.Parameter))

    def unchanged_since_restore(self, forget: bool = True) -> frozenset[str]:
        """Tensors that still hold what the last :meth:`restore` copied into them from their
        committed copies, and forget that restore. A save may skip them.

        Why: after a failure, every rank restores, and a sync follows. The sync's root is not
        written by its broadcasts, so its next save would only copy each tensor back to the
        committed copy it was just copied from. For a 1 GiB model that is a whole copy on the
        recovery's path (about 0.2 s on the CPU).

        How: a tensor counts if it is still the same object and its version counter has not
        moved. Every in-place torch operation moves it, and so does every broadcast of
        ``elasticrun.torch`` on a receiving rank (as the sync's). The counter cannot see
        writes that bypass torch's in-place operations: through ``.data``, a numpy view, an
        in-place allreduce, or a raw ``torch.distributed`` call. Such a write on the root,
        made between the restore and the sync (in a reset callback), reaches the committed
        copy at the next commit; a failure before it runs the callback again.

        ``forget=False``: keep the restore for a later call (a sync asks before its
        broadcasts, :meth:`holds_commit`, and after them)."""
        with self._lock:
            restored = self._restored
            if forget:
                self._restored, self._at_commit = {}, False
            if not restored or self._plan is None or not self._plan_is_current():
                return frozenset()
            return frozenset(name for name, src, _ in self._named_pairs()
                             if (was := restored.get(name)) is not None and was[0] is src and src._version == was[1])

    def sync(self, root: int, keep: frozenset[str] = frozenset(),
             receivers: ProcessSet | None = global_process_set) -> None:
        """``keep``: tensors every rank already holds as the root does (agreed by
        worker/prefetch.py): not sent. ``receivers``: the ranks the parameters go to (None:
        none; worker/torch_state.py leaves out the ranks that hold them already); buffers go
        to every rank."""
        if receivers is global_process_set:
            live = self.value.state_dict()
            broadcast_parameters({k: v for k, v in live.items() if k not in keep} if keep else live, root_rank=root)
            return
        entries = [(k, v) for k, v in self.value.state_dict(keep_vars=True).items() if k not in keep]
        if buffers := {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in entries
                       if not isinstance(v, torch.nn.Parameter)}:
            broadcast_parameters(buffers, root_rank=root, prefix="buffers.")
        r = rounds.current()
        if receivers is not None and r.rank in process_sets.members(receivers, r):
            broadcast_parameters({k: v.detach() for k, v in entries if isinstance(v, torch.nn.Parameter)},
                                 root_rank=root, prefix="parameters.", process_set=receivers)


class OptimizerStateHandler(StateHandler):
    """A ``torch.optim.Optimizer`` (plain or DistributedOptimizer): per-parameter state and
    the options of every param group (lr, momentum, ...). Parameters are identified by
    their position in ``param_groups``, like ``Optimizer.state_dict`` does.

    Like the model's, the tensor copy is a :class:`CopyPlan` replayed while the layout holds:
    the same parameters, the same per-parameter state dicts with the same keys, the same
    tensor objects at the same memory (optimizers update their state in place; one that
    replaces a tensor, or a parameter gaining state, makes the next save rebuild the plan).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self._buffers: dict[tuple[int, str], torch.Tensor] = {}
        # position -> {key: host buffer (tensor state) or deep copy (anything else)}
        self._state: dict[int, dict[str, Any]] = {}
        self._devices: dict[tuple[int, str], torch.device] = {}
        self._groups: list[dict[str, Any]] = []
        # The layout the plan was built on: parameters, optimizer.state's keys and dicts, every
        # entry's key in order, and where the tensors are among the entries' values.
        self._plan: CopyPlan | None = None
        self._plan_params: list[torch.Tensor] = []
        self._state_keys: list[Any] = []
        self._state_dicts: list[dict[str, Any]] = []
        self._entry_keys: list[str] = []
        self._tensor_positions: list[int] = []
        self._plain_keys: list[tuple[int, dict[str, Any], str]] = []  # non-tensor entries: deep-copied
        # What the last restore() copied in place: (position, key) -> (live tensor, its version then).
        self._restored: dict[tuple[int, str], tuple[torch.Tensor, int]] = {}
        self._at_commit = False  # a restore or mark_committed() since the last save
        self.save()

    def _params(self) -> list[torch.Tensor]:
        return [p for g in self.value.param_groups for p in g["params"]]

    def _plan_is_current(self, params: list[torch.Tensor]) -> bool:
        # Identity and size checks over C-level iterators: hashing a tensor key calls
        # Tensor.__hash__ in Python, so per-parameter dict lookups would cost more than the copy.
        state = self.value.state
        if (self._plan is None or len(state) != len(self._state_keys) or len(params) != len(self._plan_params)
                or not all(map(operator.is_, params, self._plan_params))
                or not all(map(operator.is_, state.keys(), self._state_keys))
                or not all(map(operator.is_, state.values(), self._state_dicts))
                or list(chain.from_iterable(map(dict.keys, self._state_dicts))) != self._entry_keys):
            return False
        values = list(chain.from_iterable(map(dict.values, self._state_dicts)))
        return self._plan.current([values[i] for i in self._tensor_positions])

    def _save_unless_current(self) -> bool:
        """Save everything but the plan's tensor copy if the plan is current (True), or
        everything (False)."""
        opt = self.value
        self._groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        params = self._params()
        if self._plan_is_current(params):
            for i, live, k in self._plain_keys:
                self._state[i][k] = copy.deepcopy(live[k])
            return True
        self._rebuild(params)
        return False

    def save(self, keep: frozenset[tuple[int, str]] = frozenset()) -> None:
        """Commit the optimizer. ``keep``: state tensors (position, key) whose committed copy
        equals the live one already (:meth:`unchanged_since_restore`); not copied."""
        self._restored, self._at_commit = {}, False
        if self._save_unless_current():
            assert self._plan is not None  # current: it was just checked
            if keep:
                pairs = [pair for key, pair in zip(self._buffers, self._plan.members()) if key not in keep]
                CopyPlan([src for src, _ in pairs], [buf for _, buf in pairs]).run()
            else:
                self._plan.run()

    def unchanged_since_restore(self, forget: bool = True) -> frozenset[tuple[int, str]]:
        """As :meth:`ModelStateHandler.unchanged_since_restore`, for the state tensors that
        the last restore copied in place; forgets that restore unless ``forget=False``."""
        restored = self._restored
        if forget:
            self._restored, self._at_commit = {}, False
        if not restored or not self._plan_is_current(self._params()):
            return frozenset()
        assert self._plan is not None  # current: it was just checked
        return frozenset(key for key, (src, _) in zip(self._buffers, self._plan.members())
                         if (was := restored.get(key)) is not None and was[0] is src and src._version == was[1])

    def save_deferred(self, guarded: frozenset[int]) -> Callable[[], None] | DeviceCopy | None:
        # Only a step changes the optimizer's tensors, and steps wait for the copy.
        if not self._save_unless_current():
            return None
        assert self._plan is not None  # current: it was just checked
        return _later(self._plan)

    def _rebuild(self, params: list[torch.Tensor]) -> None:
        opt = self.value
        state: dict[int, dict[str, Any]] = {}
        buffers: dict[tuple[int, str], torch.Tensor] = {}
        sources: list[torch.Tensor] = []
        self._plain_keys = []
        keys: list[tuple[int, str]] = []
        for i, p in enumerate(params):
            live = opt.state.get(p)
            if not live:
                continue
            entry: dict[str, Any] = {}
            for k, v in live.items():
                if isinstance(v, torch.Tensor):
                    entry[k] = None  # its buffer, below (the entry keeps the live order of keys)
                    keys.append((i, k))
                    self._devices[(i, k)] = v.device
                    sources.append(v)
                else:
                    entry[k] = copy.deepcopy(v)
                    self._plain_keys.append((i, live, k))
            state[i] = entry
        for (i, k), buf in zip(keys, commit_buffers(sources, [self._buffers.get(key) for key in keys])):
            state[i][k] = buffers[(i, k)] = buf
        for gone in [k for k in self._devices if k not in buffers]:
            del self._devices[gone]
        self._buffers, self._state = buffers, state
        self._plan = CopyPlan(sources, list(buffers.values()))
        self._plan.run()
        # The fast check walks optimizer.state in its own order; the plan's sources are in
        # parameter order. Record where each source sits in the flattened values (every
        # source comes from one of those dicts; the identity check backs this up).
        self._plan_params = params
        self._state_keys, self._state_dicts = list(opt.state.keys()), list(opt.state.values())
        self._entry_keys = list(chain.from_iterable(map(dict.keys, self._state_dicts)))
        where = {id(v): i for i, v in enumerate(chain.from_iterable(map(dict.values, self._state_dicts)))}
        self._tensor_positions = [where[id(t)] for t in sources]

    def mark_committed(self) -> None:
        """As :meth:`ModelStateHandler.mark_committed`."""
        if self._plan is not None and self._plan_is_current(self._params()):
            self._restored = {key: (src, src._version) for key, (src, _) in zip(self._buffers, self._plan.members())}
            self._at_commit = True

    def holds_commit(self) -> bool:
        """As :meth:`ModelStateHandler.holds_commit`: every state tensor holds its commit."""
        # A plan no longer current (state added since, by a step in a reset callback): no.
        return (self._at_commit and self._plan_is_current(self._params())
                and set(self._buffers) <= self.unchanged_since_restore(forget=False))

    def restore(self) -> None:
        self._restored, self._at_commit = {}, False
        opt = self.value
        abandon_step(opt)  # a step in progress belongs to the failed round
        _drop_grads(p for group in opt.param_groups for p in group["params"])
        self._restore_groups(opt)
        for group, saved in zip(opt.param_groups, self._groups):
            group.update(copy.deepcopy(saved))
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        keys: list[tuple[int, str]] = []
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
                        dsts.append(cur)
                        srcs.append(v)
                        keys.append((i, k))
                    else:
                        live[k] = v.to(device, copy=True)
            if dsts:
                torch._foreach_copy_(dsts, srcs)
        self._restored = {key: (t, t._version) for key, t in zip(keys, dsts)}
        # Every state tensor was copied in place (one replaced by a new tensor is not in
        # _restored, so holds_commit() says no).
        self._at_commit = True

    def _restore_groups(self, opt: torch.optim.Optimizer) -> None:
        """Param groups added since the commit (``add_param_group``) are removed with their
        state: the script's own record that it added them (an attribute of the state) rolls
        back too, so it adds them again; kept, they made that second add fail on every rank
        ("some parameters appear in more than one parameter group")."""
        n = len(self._groups)
        if len(opt.param_groups) < n:
            raise ValueError(f"the optimizer has {len(opt.param_groups)} param group(s), {n} at its last commit: a "
                             f"group removed since cannot be restored; keep every group and set its lr to 0 instead")
        if len(opt.param_groups) == n:
            return
        kept = {id(p) for g in opt.param_groups[:n] for p in g["params"]}
        for g in opt.param_groups[n:]:
            for p in g["params"]:
                if id(p) not in kept:
                    opt.state.pop(p, None)
        log.info("restore: %d param group(s) added to the optimizer since the last commit were removed with it",
                 len(opt.param_groups) - n)
        del opt.param_groups[n:]
        rebuild = getattr(opt, "_dist_build", None)
        if rebuild is not None:  # a DistributedOptimizer's buckets cover the groups it has
            rebuild()

    def sync(self, root: int, receivers: ProcessSet | None = global_process_set) -> None:
        """``receivers``: the ranks the state's tensors go to (see ModelStateHandler.sync)."""
        sync_optimizer_state(self.value, root, global_process_set, receivers)


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

    def sync(self, root: int) -> None:
        self.value.load_state_dict(collectives.broadcast_object(self.value.state_dict(), root, "lr_scheduler", trusted=True))


class GradScalerStateHandler(StateHandler):
    """A ``torch.amp.GradScaler`` (mixed precision's loss scale) through its ``state_dict``,
    loaded **in place**: the script keeps calling the scaler object it made
    (``scaler.scale(loss)``, ``scaler.step(opt)``), so a restore or a sync that replaced the
    attribute would leave that one stale. After a join the newcomer would then train with its
    initial scale while the others use theirs, each unscaling a differently scaled sum: the
    replicas drift apart silently."""

    #: The scaler's attributes a commit copies without asking for their values: its
    #: ``state_dict()`` reads the scale and the growth tracker with ``.item()``, a wait for
    #: the GPU to finish every queued kernel, at every commit.
    _OPTIONS = ("_growth_factor", "_backoff_factor", "_growth_interval", "_init_scale", "_init_growth_tracker")

    def __init__(self, scaler: Any) -> None:
        super().__init__(scaler)
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None  # (scale, growth tracker) copies
        self.save()

    def _direct(self) -> bool:
        """Whether the scaler has the attributes a commit copies directly (torch's own, which
        may change between versions: otherwise its ``state_dict()`` is used)."""
        return all(hasattr(self.value, a) for a in self._OPTIONS + ("_scale", "_growth_tracker", "_enabled"))

    def save(self) -> None:
        scaler = self.value
        if not self._direct():
            self._saved = dict(scaler.state_dict())  # floats and ints: a shallow copy is a copy
            return
        self._saved = {a: getattr(scaler, a) for a in self._OPTIONS + ("_enabled",)}
        live = (scaler._scale, scaler._growth_tracker)
        if live[0] is None or live[1] is None:
            self._tensors = None
            return
        kept = self._tensors
        if kept is None or any(k.device != t.device or k.dtype != t.dtype or k.shape != t.shape
                               for k, t in zip(kept, live)):
            kept = self._tensors = (torch.empty_like(live[0]), torch.empty_like(live[1]))
        with torch.no_grad():  # queued on the stream that updates them: the host does not wait
            kept[0].copy_(live[0])
            kept[1].copy_(live[1])

    @staticmethod
    def _ready(scaler: Any) -> None:
        """Forget where the scaler was within a step (``unscale_()`` called, an inf found):
        a commit is taken between steps, so a rollback to it must find every optimizer ready,
        or the step tried again fails with "unscale_() has already been called on this
        optimizer since the last update()". The dict is torch's defaultdict, emptied in place
        as ``update()`` renews it."""
        states = getattr(scaler, "_per_optimizer_states", None)
        if isinstance(states, dict):
            states.clear()

    def restore(self) -> None:
        scaler = self.value
        self._ready(scaler)
        if not self._direct() or "_enabled" not in self._saved:
            if self._saved:  # a disabled scaler's is empty (and loading it is then a no-op)
                scaler.load_state_dict(dict(self._saved))
            return
        if not self._saved["_enabled"]:
            return
        for a in self._OPTIONS:
            setattr(scaler, a, self._saved[a])
        kept = self._tensors
        with torch.no_grad():
            if kept is None:  # committed before its first scale(): its tensors start from the options
                if scaler._scale is not None:
                    scaler._scale.fill_(self._saved["_init_scale"])
                    scaler._growth_tracker.fill_(self._saved["_init_growth_tracker"])
            elif scaler._scale is None or scaler._scale.device != kept[0].device:
                scaler._scale, scaler._growth_tracker = kept[0].clone(), kept[1].clone()
            else:
                scaler._scale.copy_(kept[0])
                scaler._growth_tracker.copy_(kept[1])

    def sync(self, root: int) -> None:
        theirs = collectives.broadcast_object(self.value.state_dict(), root, "grad_scaler", trusted=True)
        self._ready(self.value)
        if theirs:
            self.value.load_state_dict(theirs)


class SamplerStateHandler(StateHandler):
    """An :class:`ElasticSampler`, following the contract in its docstring.

    Each rank records only its own batches, so before a commit's save ``merge`` unions the
    processed sets over the ranks (only what each rank added since the last save travels),
    without repartitioning: a pass in progress continues. ``restore`` loads the committed
    state (which repartitions); ``on_reset`` repartitions for the new world (enough after a
    removals-only reset, where sync is skipped and all ranks hold the merged set of the
    interrupted commit); ``sync`` unions every rank's live set and takes the root's epoch.
    """

    def __init__(self, sampler: ElasticSampler) -> None:
        super().__init__(sampler)
        self._epoch = sampler.epoch
        self._processed = sampler._done().copy()
        self._follow()

    def _follow(self) -> None:
        """From here on, the sampler's records since now are what is new to the saved set."""
        s = self.value
        self._set_seen = s.processed_indices
        self._edits_seen = getattr(s.processed_indices, "edits", None)
        self._generation, _ = s._take_recorded()

    def _fresh(self) -> list[int] | None:
        """What the live set holds beyond the saved one, from the sampler's records alone
        (O(new), not O(processed): a commit at millions of indices took seconds, all of it
        holding the GIL, and starved the heartbeat thread past --heartbeat-timeout); None when
        the live set is not the saved one plus those records (a new epoch, a load, a set the
        script changed by hand): then the whole set is compared, as before."""
        s = self.value
        done = s.processed_indices
        if (s.epoch != self._epoch or done is not self._set_seen or s._generation != self._generation
                or getattr(done, "edits", None) != self._edits_seen or len(s.dataset) != self._processed.n):
            return None
        fresh = s._recorded.absent_from(self._processed)
        return fresh if len(self._processed) + len(fresh) == len(done) else None

    def save(self) -> None:
        s = self.value
        fresh = self._fresh()
        if fresh is not None:
            self._processed.put_checked(fresh)
        else:
            self._epoch = s.epoch
            self._processed = s._done().copy()
        self._follow()

    def news(self) -> tuple[int, list[int]]:
        """(epoch, what this rank recorded since the last save)."""
        s = self.value
        fresh = self._fresh()
        if fresh is not None:
            return s.epoch, fresh
        done = s._done()
        if done.n != self._processed.n:  # the dataset's length changed: the saved set follows it
            try:
                self._processed = IndexSet(done.n, self._processed)
            except ValueError:  # (it shrank below a saved index: everything is news)
                return s.epoch, done.sorted_list()
        if s.epoch == self._epoch and self._processed.issubset_of(done):
            return s.epoch, done.minus(self._processed)
        return s.epoch, done.sorted_list()  # a new epoch since the last save: everything

    def merge(self) -> None:
        s = self.value
        r = rounds.current()
        for rank, item in enumerate(collectives.allgather_object(self.news(), "sampler.processed_indices")):
            if item is None:  # a rank in hvd.join(): what it recorded before it joined (its batches'
                # gradients are in this commit), as it published them then (worker/join_news.py)
                item = join_news.published(r, rank).get(self.name)
                if item is None:
                    continue
            epoch, part = item
            if epoch == s.epoch:
                s.merge_processed(part)

    def restore(self) -> None:
        self.value._load(self._epoch, self._processed.copy())
        self._follow()

    def on_reset(self) -> None:
        self.value.reset()

    def sync(self, root: int) -> None:
        """Every rank's set, the union over the ranks, is the root's plus what each recorded
        since its own last save: a rank holds the newest commit's set (the root's) or an older
        one of the same epoch (a subset of it: commits merge every rank's batches), plus its
        news; a newcomer holds nothing. So the root's set is broadcast and only the news is
        gathered. (Every rank's whole set gathered to every rank cost ranks x indices of
        memory and time as a host joined: 2.6 GB and 19 s a rank at 4 ranks and 6M indices.)
        The root's set travels as one bit per sample (2.5 MB at 20M samples)."""
        s = self.value
        r = rounds.current()
        mine = None
        if r.rank == root:
            done = s._done()
            mine = (s.epoch, done.n, done.packed())
        epoch, n, packed = collectives.broadcast_object(mine, root_rank=root, name="sampler.sync", trusted=True)
        merged = IndexSet.unpacked(n, packed)
        for e, part in collectives.allgather_object(self.news(), "sampler.sync.news"):
            if e == epoch:  # a newcomer's empty epoch-0 news must not mix into another epoch
                merged.put(part)
        s._load(epoch, merged)


# --- handlers written before sync() took the root ---------------------------------------

#: Handler class -> whether its sync() takes the root (checked once per class).
_takes_root: dict[type, bool] = {}


def _sync_takes_root(sync: Callable[..., None], bound: bool = True) -> bool:
    """Whether ``sync`` accepts the root (with ``bound=False``: besides ``self``)."""
    try:
        signature = inspect.signature(sync)
    except (TypeError, ValueError):  # no signature to read (a builtin): assume the new one
        return True
    try:
        signature.bind(0) if bound else signature.bind(None, 0)
    except TypeError:
        return False
    return True


def _check_sync(cls: type, takes_root: Callable[[], bool], stacklevel: int) -> bool:
    """Whether handlers of ``cls`` take the root; warns once per class if not (``stacklevel``
    as in the caller's own ``warnings.warn``)."""
    takes = _takes_root.get(cls)
    if takes is None:
        takes = _takes_root[cls] = takes_root()
        if not takes:
            warnings.warn(f"{cls.__module__}.{cls.__qualname__}.sync() takes no root: a state handler's "
                          f"sync(self, root) now makes every rank equal to rank `root`, the one holding the "
                          f"newest commit. A sync() without it is still called, without the root, but it "
                          f"cannot follow a root other than rank 0; define sync(self, root).",
                          DeprecationWarning, stacklevel=stacklevel + 1)
    return takes


def _class_sync_takes_root(cls: type) -> bool:
    if isinstance(inspect.getattr_static(cls, "sync", None), (staticmethod, classmethod)):
        return _sync_takes_root(getattr(cls, "sync"))
    return _sync_takes_root(getattr(cls, "sync"), bound=False)  # any class with a sync(), not only StateHandlers


def sync_handler(handler: StateHandler, root: int) -> None:
    """``handler.sync(root)``; a handler whose ``sync()`` takes no root (written for earlier
    versions of elasticrun, or for horovod) is called as it expects, with a
    DeprecationWarning once per class (at its registration when the factory is the class)."""
    if _check_sync(type(handler), lambda: _sync_takes_root(handler.sync), stacklevel=2):
        handler.sync(root)
    else:
        handler.sync()  # type: ignore[call-arg]  # an older handler's sync() takes no root (checked above)


HandlerFactory = Callable[[Any], StateHandler]

#: (type, factory), most recently registered first; the first isinstance match wins.
_registry: list[tuple[type, HandlerFactory]] = []


def register_handler(type_: type, factory: HandlerFactory) -> None:
    """Handle attributes of ``type_`` (and subclasses) with ``factory(value)``. Later
    registrations take precedence, so users can override the defaults."""
    if isinstance(factory, type):  # warn where the handler is registered, in the user's code
        _check_sync(factory, lambda: _class_sync_takes_root(factory), stacklevel=2)
    _registry[:] = [(t, f) for t, f in _registry if t is not type_]
    _registry.insert(0, (type_, factory))


def get_handler_factory(value: Any) -> HandlerFactory | None:
    for type_, factory in _registry:
        if isinstance(value, type_):
            return factory
    return None


register_handler(torch.optim.lr_scheduler.LRScheduler, LRSchedulerStateHandler)
# torch.amp.GradScaler since torch 2.3; torch.cuda.amp's (its subclass since then) before.
register_handler(getattr(torch.amp, "GradScaler", None) or torch.cuda.amp.GradScaler, GradScalerStateHandler)
register_handler(ElasticSampler, SamplerStateHandler)
register_handler(torch.optim.Optimizer, OptimizerStateHandler)
register_handler(torch.nn.Module, ModelStateHandler)
