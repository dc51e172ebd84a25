"""TorchState (and the DistributedOptimizer wrapper) in standalone mode: a 1-rank gloo world."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from typing import Any, Iterator

import pytest
import torch
from torch import nn

import elasticrun.torch as hvd
from elasticrun.worker import state_handlers
from elasticrun.worker.sampler import ElasticSampler
from elasticrun.worker.state_handlers import StateHandler, register_handler
from elasticrun.worker.torch_state import TorchState
from standalone_torch import make_model, rt, snapshot, train_step  # noqa: F401 (rt: autouse fixture)

pytestmark = pytest.mark.timeout(60)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def opt_snapshot(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


def same_opt(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for i, st in a["state"].items():
        if st.keys() != b["state"][i].keys():
            return False
        for k, v in st.items():
            w = b["state"][i][k]
            if not (torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w):
                return False
    return True


# --------------------------------------------------------------------------- model / optimizer


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
], ids=["sgd-momentum", "adam"])
def test_save_restore_model_and_optimizer(make_opt: Any) -> None:
    model = make_model()
    opt = make_opt(model.parameters())
    train_step(model, opt, 1)
    state = TorchState(model, opt, epoch=1)
    param_ids = [id(p) for p in model.parameters()]
    state_ids = {k: id(v) for k, v in opt.state[model[0].weight].items()}
    state.commit()
    committed, committed_opt = snapshot(model), opt_snapshot(opt)

    train_step(model, opt, 2)
    opt.param_groups[0]["lr"] = 123.0
    assert not same(snapshot(model), committed)
    state.restore()

    assert same(snapshot(model), committed)  # parameters and BatchNorm buffers
    assert same_opt(opt_snapshot(opt), committed_opt)  # momentum / Adam moments, step, lr
    # Restored in place: hooks and optimizers keep pointing at the live tensors.
    assert [id(p) for p in model.parameters()] == param_ids
    assert {k: id(v) for k, v in opt.state[model[0].weight].items()} == state_ids


def test_a_restore_drops_the_gradients_the_aborted_step_left() -> None:
    """A script that zeroes after step() (or accumulates backward passes) used to redo the
    step with the aborted one's gradients added in: the commit holds no pending gradient."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TorchState(model, opt)
    state.commit()
    model(torch.randn(4, 4)).sum().backward()  # the step a peer's death aborted
    assert all(p.grad is not None for p in model.parameters())
    state.restore()
    assert all(p.grad is None for p in model.parameters())
    only_opt = TorchState(optimizer=opt)  # (an optimizer's parameters, with no model in the state)
    model(torch.randn(4, 4)).sum().backward()
    only_opt.restore()
    assert all(p.grad is None for p in model.parameters())


def test_restore_to_commit_without_optimizer_state() -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    state = TorchState(model, opt)  # saved at construction: no optimizer state yet
    train_step(model, opt, 1)
    assert len(opt.state) > 0
    state.restore()
    assert len(opt.state) == 0
    train_step(model, opt, 1)  # and the optimizer still works
    assert len(opt.state) > 0


def test_save_reuses_host_buffers() -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, 1)
    state = TorchState(model, opt)
    mh, oh = state._handlers["model"], state._handlers["optimizer"]

    def ptrs() -> dict[Any, int]:
        return {**{("m", k): b.data_ptr() for k, b in mh._buffers.items()},
                **{("o", k): b.data_ptr() for k, b in oh._buffers.items()}}

    first = ptrs()
    assert len(first) == len(model.state_dict()) + 3 * len(list(model.parameters()))
    for seed in range(2, 5):
        train_step(model, opt, seed)
        state.commit()
        assert ptrs() == first
    # The buffers hold copies of the live tensors, not aliases.
    live = model.state_dict()
    assert all(b.data_ptr() != live[k].data_ptr() for k, b in mh._buffers.items())
    assert torch.equal(mh._buffers["0.weight"], model[0].weight.detach())


class _OnGpu:
    """A stand-in for a CUDA tensor (this suite has no GPU): the attributes staging_sources reads."""

    is_cuda = True
    device = torch.device("cuda", 0)

    def __init__(self, t: torch.Tensor) -> None:
        self.t, self.dtype = t, t.dtype

    def data_ptr(self) -> int:
        return self.t.data_ptr()

    def numel(self) -> int:
        return self.t.numel()


class _Plan:
    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self._pairs = pairs

    def pairs(self) -> list[tuple[Any, Any]]:
        return self._pairs


def test_a_durable_copy_reads_gpu_tensors_from_their_commit_buffers_wherever_they_are() -> None:
    """Pinned host buffers (a commit that did not fit on the GPU) stand in for their live GPU
    tensors as device buffers do: read live, a side stream's copy races the next step's update
    (a torn durable copy). A tensor without a buffer is read live (the sender then orders the
    next step after that read)."""
    model = make_model()
    state = TorchState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    on_host, on_gpu, unplanned = (_OnGpu(torch.zeros(3)) for _ in range(3))
    host_buf = torch.ones(3)

    class _GpuBuf(_OnGpu):
        pass
    gpu_buf = _GpuBuf(torch.ones(3))
    state._handlers["model"]._plan = _Plan([(on_host, host_buf), (on_gpu, gpu_buf)])
    cpu_live = torch.zeros(2)
    got = state.staging_sources([on_host, cpu_live, on_gpu, unplanned])
    assert got[0] is host_buf and got[1] is cpu_live and got[2] is gpu_buf and got[3] is unplanned


def test_sync_in_a_world_of_one_commits() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, opt, 1)
    state = TorchState(model, opt, batch=3)
    train_step(model, opt, 2)
    state.batch = 4
    state.sync()  # broadcast from rank 0 == self, then save
    live = snapshot(model)
    train_step(model, opt, 3)
    state.batch = 9
    state.restore()
    assert same(snapshot(model), live) and state.batch == 4


def test_a_restore_names_what_still_holds_its_committed_copy_until_written() -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, 1)
    state = TorchState(model, opt)
    mh, oh = state._handlers["model"], state._handlers["optimizer"]
    assert mh.unchanged_since_restore() == frozenset()  # no restore yet
    train_step(model, opt, 2)
    state.restore()
    every_tensor = frozenset(k for k, v in model.state_dict().items() if v.numel())
    assert mh.unchanged_since_restore() == every_tensor
    assert mh.unchanged_since_restore() == frozenset()  # asked once per restore
    assert len(oh.unchanged_since_restore()) == 3 * len(list(model.parameters()))  # step, exp_avg, exp_avg_sq

    state.restore()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # in place: its version counter moves
    named = mh.unchanged_since_restore()
    assert "0.weight" not in named and len(named) == len(every_tensor) - 1

    state.restore()
    hvd.broadcast_(model[0].weight, root_rank=0)  # a collective writes it (gloo: no counter of its own)
    opt.state[model[0].weight]["exp_avg"].mul_(2.0)
    oh_named = oh.unchanged_since_restore()
    assert mh.unchanged_since_restore() == every_tensor  # the root's broadcast reads, writes nothing
    assert (0, "exp_avg") not in oh_named and (0, "exp_avg_sq") in oh_named

    state.restore()
    model[0].bias = nn.Parameter(model[0].bias.detach().clone())  # another object: the save walks anew
    assert mh.unchanged_since_restore() == frozenset()

    state.restore()
    state.commit()  # a save forgets the restore: the commit copied everything anyway
    assert mh.unchanged_since_restore() == frozenset() and oh.unchanged_since_restore() == frozenset()


def test_the_sync_after_a_restore_copies_back_only_what_changed_since() -> None:
    """The root of a sync (here the only rank) saves what a restore left alone by not copying
    it: its committed copy is what it holds. What changed since is copied. (White-box: the
    committed copies are spoiled behind the state's back to see which ones a save rewrites.)"""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, opt, 1)
    state = TorchState(model, opt, batch=3)
    state.commit()
    train_step(model, opt, 2)
    state.restore()
    committed = snapshot(model)
    mh, oh = state._handlers["model"], state._handlers["optimizer"]
    with torch.no_grad():
        model[3].weight.mul_(3.0)  # a reset callback's change: must reach the commit
        mh._buffers["0.weight"].add_(100.0)  # spoiled: left so by a skipping save
        mh._buffers["3.weight"].add_(100.0)  # spoiled, but its tensor changed: rewritten
        next(iter(oh._buffers.values())).add_(100.0)
    state.sync()
    assert torch.equal(mh._buffers["3.weight"], model[3].weight.detach())
    assert torch.equal(mh._buffers["0.weight"], committed["0.weight"] + 100.0)  # not copied
    assert torch.equal(next(iter(oh._buffers.values())), opt.state[model[0].weight]["momentum_buffer"] + 100.0)

    # Without a restore before it, a sync copies everything, as a commit does.
    with torch.no_grad():
        mh._buffers["0.weight"].add_(100.0)
    state.sync()
    assert torch.equal(mh._buffers["0.weight"], model[0].weight.detach())


# --------------------------------------------------------------------------- assignment


def test_assigning_a_new_model_recreates_its_handler() -> None:
    old, new = make_model(0), make_model(1)
    opt = torch.optim.SGD(old.parameters(), lr=0.1)
    state = TorchState(old, opt)
    old_committed = snapshot(old)
    state.model = new
    assert state.model is new and state._handlers["model"].value is new
    new_committed = snapshot(new)
    with torch.no_grad():
        for p in list(old.parameters()) + list(new.parameters()):
            p.add_(1.0)
    state.restore()
    assert same(snapshot(new), new_committed)  # the new model is the one restored
    assert not same(snapshot(old), old_committed)  # the old one is no longer tracked

    state.model = None  # no handler for None: a plain attribute now
    assert "model" not in state._handlers and "model" in state._object_keys
    state.commit()
    state.model = 5
    state.restore()
    assert state.model is None


def test_plain_attribute_becoming_a_handled_type() -> None:
    state = TorchState(extra=None)
    model = make_model()
    state.extra = model
    assert "extra" in state._handlers and "extra" not in state._object_keys
    committed = snapshot(model)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    state.restore()
    assert same(snapshot(model), committed)


# --------------------------------------------------------------------------- sampler


def test_a_sampler_commit_saves_what_is_new_and_agrees_with_the_whole_comparison() -> None:
    """A commit compared (and copied) the whole processed set to find what was new: seconds at
    millions of indices, all of it holding the GIL. It follows the sampler's records instead;
    a set replaced or changed by hand falls back to the whole comparison."""
    sampler = ElasticSampler(range(100), shuffle=False, world=lambda: (0, 1))
    h = state_handlers.SamplerStateHandler(sampler)
    sampler.record_indices(range(10))
    assert h.news() == (0, list(range(10)))
    h.save()
    sampler.record_indices([10, 11, 3])  # (3: recorded again, not new)
    sampler.merge_processed([50, 51])  # another rank's, merged at a commit
    assert h.news() == (0, [10, 11, 50, 51]) and h._fresh() == [10, 11, 50, 51]
    h.save()
    assert h._processed == set(range(12)) | {50, 51} and h.news() == (0, [])
    sampler.record_indices([20])
    h.restore()  # back to the commit: 20 is not processed, and nothing is new
    assert sampler.processed_indices == h._processed and h.news() == (0, [])
    sampler.processed_indices.add(99)  # by hand: not a record; the whole comparison sees it
    assert h._fresh() is None and h.news() == (0, [99])
    h.save()
    assert 99 in h._processed and h._fresh() == []
    sampler.set_epoch(1)  # a new set: everything of the new epoch is new
    sampler.record_indices([7])
    assert h.news() == (1, [7])
    h.save()
    assert h._processed == {7} and h._epoch == 1
    plain = ElasticSampler(range(100), shuffle=False, world=lambda: (0, 1))
    plain.record_indices(range(50))
    assert len(plain._recorded) == 0  # (no handler follows it: its records are not kept twice)


def test_sampler_save_restore_and_reset() -> None:
    sampler = ElasticSampler(range(10), shuffle=False)
    state = TorchState(sampler=sampler, epoch=0)
    assert "sampler" in state._handlers
    sampler.record_batch(0, 3)
    state.commit()
    assert sampler.processed_indices == {0, 1, 2}
    sampler.record_batch(1, 3)
    state.epoch = 7
    state.restore()
    assert sampler.processed_indices == {0, 1, 2} and state.epoch == 0
    assert list(sampler) == list(range(3, 10))  # repartitioned from the commit

    # A finished epoch: set_epoch clears the set; the commit saves the new epoch.
    for b in range(3):
        sampler.record_batch(b, 3)
    sampler.record_indices([9])
    sampler.set_epoch(1)
    state.commit()
    sampler.record_batch(0, 4)
    state.restore()
    assert sampler.epoch == 1 and sampler.processed_indices == set() and len(sampler) == 10

    sampler.record_batch(0, 5)
    state.on_reset()  # a reset repartitions (locally) for the new world
    assert len(sampler) == 5
    state.sync()
    assert sampler.processed_indices == set(range(5))


@pytest.mark.parametrize("n", [0, 1000])
def test_a_durable_copy_keeps_the_processed_set_as_raw_bits_and_loads_it(n: int) -> None:
    """The sampler's part of a durable copy is a tensor of bits, written raw beside the model,
    not a list of ints pickled in one call; a copy loads back to the same set, a copy made for
    another dataset's length is refused by name, and an older copy's list still loads."""
    from elasticrun.worker import durable
    from elasticrun.worker.torch_state import TorchState

    s = ElasticSampler(range(n), world=lambda: (0, 1))
    s.record_indices(range(0, n, 7))
    state = TorchState(sampler=s, epoch=3)
    state.commit()
    tensors, structure = durable.split_tensors(state.durable_state())
    assert [p for p, _ in tensors] == ["handlers.sampler.processed_bits"]
    entries = durable.layout(tensors)
    data = bytearray(sum(e.nbytes for e in entries))
    durable.copy_range([t for _, t in tensors], entries, 0, memoryview(data))
    saved, _, _ = durable.decode(durable.encode_meta(structure, entries, 5, 9), bytes(data))

    t = ElasticSampler(range(n), world=lambda: (0, 1))
    again = TorchState(sampler=t, epoch=0)
    again.load_durable_state(saved)
    s.reset()
    assert t.processed_indices == set(range(0, n, 7)) and again.epoch == 3 and list(t) == list(s)
    other = TorchState(sampler=ElasticSampler(range(n + 1), world=lambda: (0, 1)), epoch=0)
    with pytest.raises(durable.DurableMismatch,
                       match=f"sampler: the saved sampler state is of a dataset of {n} samples; this "
                             f"sampler's dataset has {n + 1}"):
        other.load_durable_state(saved)
    if n:
        older = {"objects": saved["objects"], "handlers": {"sampler": {"epoch": 3, "processed_indices": [1, 2]}}}
        again.load_durable_state(older)
        assert t.processed_indices == {1, 2}


# --------------------------------------------------------------------------- registry / objects


class Counter:
    def __init__(self) -> None:
        self.n = 0


class CounterHandler(StateHandler):
    calls: list[str] = []

    def __init__(self, value: Counter) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self.calls.append("save")
        self.saved = self.value.n

    def restore(self) -> None:
        self.calls.append("restore")
        self.value.n = self.saved

    def sync(self, root: int) -> None:
        self.calls.append(f"sync from {root}")
        self.value.n = hvd.broadcast_object(self.value.n, root)


@pytest.fixture
def counter_handler() -> Iterator[None]:
    before = list(state_handlers._registry)
    CounterHandler.calls = []
    register_handler(Counter, CounterHandler)
    yield
    state_handlers._registry[:] = before


def test_custom_handler_registry(counter_handler: None) -> None:
    counter = Counter()
    state = TorchState(counter=counter)
    assert isinstance(state._handlers["counter"], CounterHandler)
    counter.n = 3
    state.commit()
    counter.n = 10
    state.restore()
    assert counter.n == 3
    state.sync()
    assert CounterHandler.calls == ["save", "save", "restore", "sync from 0", "save"]


def test_user_handler_overrides_a_default(counter_handler: None) -> None:
    class Quiet(StateHandler):
        def save(self) -> None: ...
        def restore(self) -> None: ...
        def sync(self, root: int) -> None: ...

    register_handler(nn.Module, Quiet)
    state = TorchState(make_model())
    assert isinstance(state._handlers["model"], Quiet)


class LegacyHandler(StateHandler):
    """Written for the sync() of earlier versions (and of horovod): no root."""

    calls: list[str] = []

    def __init__(self, value: Counter) -> None:
        super().__init__(value)
        self.save()

    def save(self) -> None:
        self.saved = self.value.n

    def restore(self) -> None:
        self.value.n = self.saved

    def sync(self) -> None:  # type: ignore[override]
        self.calls.append("sync")


class Legacy(Counter):
    pass


class LegacyByFactory(Counter):
    pass


class LegacyToo(LegacyHandler):
    calls: list[str] = []


def test_a_handler_whose_sync_takes_no_root_still_works_and_is_deprecated(counter_handler: None) -> None:
    with pytest.warns(DeprecationWarning, match=r"LegacyHandler.sync\(\) takes no root") as warned:
        register_handler(Legacy, LegacyHandler)
    assert warned[0].filename == __file__  # points at the registration, in the user's code
    state = TorchState(legacy=Legacy())
    state.sync()
    assert LegacyHandler.calls == ["sync"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per class
        register_handler(Legacy, LegacyHandler)
        state.sync()
    assert LegacyHandler.calls == ["sync", "sync"]

    # A factory that is not the class: found out at the first sync.
    register_handler(LegacyByFactory, lambda value: LegacyToo(value))
    state = TorchState(legacy=LegacyByFactory())
    with pytest.warns(DeprecationWarning, match=r"LegacyToo.sync\(\) takes no root"):
        state.sync()
    assert LegacyToo.calls == ["sync"]


def test_object_state_attributes() -> None:
    state = TorchState(epoch=1, history=[1, 2], name="run")
    assert state.model is None and state.optimizer is None
    state.history.append(3)
    state.epoch = 2
    state.commit()
    state.history.append(4)  # an in-place change after the commit does not leak into it
    state.epoch = 3
    state.restore()
    assert state.epoch == 2 and state.history == [1, 2, 3] and state.name == "run"
    calls: list[int] = []
    state.register_reset_callbacks([lambda: calls.append(1)])
    state.on_reset()
    assert calls == [1]


def test_reset_hook_runs_before_the_callbacks() -> None:
    """Horovod's State.reset(): subclasses override it; an attribute named reset does not
    shadow it."""
    calls: list[str] = []

    class MyState(TorchState):
        def reset(self) -> None:
            calls.append("reset")

    state = MyState(epoch=0)
    state.register_reset_callbacks([lambda: calls.append("callback")])
    state.on_reset()
    assert calls == ["reset", "callback"]
    TorchState(reset=3).on_reset()  # a plain attribute named "reset"


def test_lr_scheduler_handler() -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    state = TorchState(model, opt, scheduler=sched)
    assert isinstance(state._handlers["scheduler"], state_handlers.LRSchedulerStateHandler)
    train_step(model, opt, 1)
    sched.step()
    state.commit()
    train_step(model, opt, 2)
    sched.step()
    assert opt.param_groups[0]["lr"] == 0.25
    state.restore()
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == 0.5


@pytest.mark.parametrize("enabled", [True, False])
def test_a_grad_scaler_is_restored_and_synced_in_place(enabled: bool) -> None:
    """The script keeps calling the scaler it made: a restore or sync that replaced the
    attribute left that one with a stale loss scale (after a join: ranks scaled differently)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, enabled=enabled)
    state = TorchState(model, opt, scaler=scaler)
    assert isinstance(state._handlers["scaler"], state_handlers.GradScalerStateHandler)
    scaler.scale(torch.ones(()))  # its scale tensor now exists
    if enabled:
        scaler.update(new_scale=256.0)
    state.commit()
    if enabled:
        scaler.update(new_scale=8.0)
    state.restore()
    assert state.scaler is scaler
    assert scaler.get_scale() == (256.0 if enabled else 1.0)
    if enabled:
        scaler.update(new_scale=4.0)
    state.sync()  # a world of one: its own live value
    assert state.scaler is scaler and scaler.get_scale() == (4.0 if enabled else 1.0)


def test_a_grad_scalers_commit_does_not_wait_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its state_dict() reads the scale with .item(): on a GPU, a wait for every queued kernel
    at each commit. A commit copies the scale and growth tracker tensors instead, and a restore
    copies them back (the tracker too: it decides when the scale next grows)."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=64.0, growth_interval=3)
    state = TorchState(model, opt, scaler=scaler)  # committed before its first scale()
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=32.0)
    scaler._growth_tracker.fill_(2)

    def synchronous(*_: Any) -> Any:
        raise AssertionError("a commit asked the scaler for its values")
    monkeypatch.setattr(scaler, "get_scale", synchronous)
    monkeypatch.setattr(scaler, "_get_growth_tracker", synchronous)
    monkeypatch.setattr(torch.Tensor, "item", synchronous)
    state.restore()  # to the commit made before the first scale(): the initial values, in place
    assert scaler._scale.tolist() == 64.0 and scaler._growth_tracker.tolist() == 0
    scaler.update(new_scale=32.0)
    scaler._growth_tracker.fill_(2)
    state.commit()
    scale, tracker = scaler._scale, scaler._growth_tracker
    scaler.update(new_scale=8.0)
    scaler._growth_tracker.fill_(1)
    scaler._growth_factor = 3.0
    state.restore()
    monkeypatch.undo()
    assert scaler._scale is scale and scaler._growth_tracker is tracker
    assert scaler.get_scale() == 32.0 and scaler._get_growth_tracker() == 2 and scaler._growth_factor == 2.0


@pytest.mark.parametrize("then", ["restore", "sync"])
def test_a_rollback_between_unscale_and_update_finds_the_scaler_ready(then: str) -> None:
    """A peer lost between ``scaler.unscale_(opt)`` and ``scaler.update()`` (a collective there:
    Adasum's inside ``step()``, a global norm's allreduce): the step tried again after the
    restore failed with "unscale_() has already been called", on every rank, and the job died."""
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu")
    state = TorchState(model, opt, scaler=scaler)

    def step_until_unscaled() -> None:
        opt.zero_grad()
        scaler.scale(model(torch.randn(6, 4)).sum()).backward()
        opt.synchronize()
        scaler.unscale_(opt)

    step_until_unscaled()
    getattr(state, then)()  # what elastic.run does after the error
    step_until_unscaled()  # (raised RuntimeError here)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()


def test_a_param_group_added_since_the_commit_goes_with_the_rollback() -> None:
    """The script records that it added a group (an attribute of the state): the restore rolled
    that back but kept the group, so the script added it again and every rank failed with
    "some parameters appear in more than one parameter group"."""
    model = make_model()
    extra = nn.Linear(2, 2)
    opt = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    state = TorchState(model, opt, added=False)
    train_step(model, opt, 1)
    state.commit()

    def add() -> None:
        opt.add_param_group({"params": extra.parameters(), "lr": 0.1})
        state.added = True

    add()
    (model(torch.randn(6, 4)).sum() + extra(torch.randn(3, 2)).sum()).backward()
    opt.step()
    state.restore()
    assert not state.added and len(opt.param_groups) == 1
    assert all(p not in opt.state for p in extra.parameters())
    add()  # (raised ValueError here)
    (model(torch.randn(6, 4)).sum() + extra(torch.randn(3, 2)).sum()).backward()
    opt.step()
    state.commit()
    assert len(opt.param_groups) == 2


def test_a_newcomer_without_a_group_added_mid_run_is_told_what_to_do() -> None:
    from elasticrun.worker.broadcast import load_keeping_groups

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    theirs = torch.optim.SGD(model.parameters(), lr=0.1)
    theirs.add_param_group({"params": nn.Linear(2, 2).parameters()})
    with pytest.raises(ValueError, match=r"1 param group\(s\) here and 2 on the rank it is synced from.*lr 0"):
        load_keeping_groups(opt, theirs.state_dict())


# --------------------------------------------------------------------------- DistributedOptimizer, world of one


def test_distributed_optimizer_in_a_world_of_one_is_the_plain_optimizer() -> None:
    model, ref = make_model(), make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)  # made before wrapping
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert opt.param_groups is base.param_groups and opt.state is base.state
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    pre_hook_calls: list[int] = []
    opt.register_step_pre_hook(lambda *_: pre_hook_calls.append(1))
    for seed in range(3):
        train_step(model, opt, seed)
        train_step(ref, ref_opt, seed)
        sched.step()
        ref_sched.step()
    assert same(snapshot(model), snapshot(ref))
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 3
    assert len(pre_hook_calls) == 3
    opt.load_state_dict(opt.state_dict())  # must not wrap step in a second profiling hook
    train_step(model, opt, 9)
    assert len(pre_hook_calls) == 4


@pytest.mark.parametrize("op", ["Average", "Adasum"])
@pytest.mark.parametrize("pattern", ["step", "synchronize"])
def test_each_step_is_counted_once_whatever_the_pattern(rt, op, pattern) -> None:
    """Horovod's clipping pattern ends the step at synchronize(); with Adasum, step() ends it
    (its exchange comes after the local step): once either way."""
    from standalone_torch import forward_backward
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), op=getattr(hvd, op))
    before = rt.steps
    for seed in range(3):
        opt.zero_grad()
        forward_backward(model, seed)
        if pattern == "synchronize":
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    assert rt.steps - before == 3


def test_distributed_optimizer_fills_missing_gradients_and_guards_double_backward() -> None:
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    opt.step()  # no backward at all: gradients become zeros, like horovod
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    x = torch.randn(4, 4)
    model(x).sum().backward()
    with pytest.raises(AssertionError, match="backward_passes_per_step"):
        model(x).sum().backward()
    opt.zero_grad()  # the failed step left nothing behind
    model(x).sum().backward()
    opt.step()


def test_distributed_optimizer_argument_checks() -> None:
    model = make_model()
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum,
                                 gradient_predivide_factor=2.0)
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=list(model.named_parameters())[:1])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError):
        hvd.DistributedOptimizer(opt)


# --------------------------------------------------------------------------- module hooks


def test_module_registration_hooks_come_with_the_first_model_handler() -> None:
    """Importing elasticrun hooks no torch.nn.Module; the first model handler does, once."""
    code = """
import torch
import torch.nn.modules.module as m
import elasticrun.torch as hvd
from elasticrun.worker import state_handlers

def ours():
    return [sum(h is state_handlers._structure_changed for h in d.values())
            for d in (m._global_parameter_registration_hooks, m._global_buffer_registration_hooks,
                      m._global_module_registration_hooks)]

assert ours() == [0, 0, 0], ours()
hvd.elastic.TorchState(epoch=0)  # no model: still nothing
assert ours() == [0, 0, 0], ours()
hvd.elastic.TorchState(torch.nn.Linear(2, 2))
hvd.elastic.TorchState(torch.nn.Linear(2, 2))
assert ours() == [1, 1, 1], ours()
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICRUN_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


def test_allreduce_of_a_python_number_says_what_to_pass() -> None:
    """It raised AttributeError: 'float' object has no attribute 'requires_grad'."""
    with pytest.raises(TypeError, match=r"takes a tensor, not float: reduce torch.tensor\(value\)"):
        hvd.allreduce(1.5)
