"""A sync sends the model and optimizer state only to the ranks that lack them
(worker/torch_state.py ``_newest_commit_root``), on a real 3-process gloo world.

Ranks that hold the newest commit, unchanged since their restore (or since the interrupt
that followed the commit), hold the root's tensors already: after a failure the sync sends
no model at all, and a newcomer's sync costs one transfer, not one per survivor. Every case
checks what matters more than the saving: every rank ends with the root's live state and
commits it, buffers (which differ between ranks by design) included.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gloo_world  # noqa: E402

HERE = str(Path(__file__).resolve())
pytestmark = pytest.mark.timeout(180)


def _build(seed: int, width: int) -> tuple[Any, Any, Any]:
    """A model with a BatchNorm (buffers), its SGD-momentum optimizer (state after one step)
    and a TorchState of them; ``seed`` makes ranks differ as a newcomer's init does."""
    import elasticrun.torch as hvd

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.BatchNorm1d(width))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    return model, opt, hvd.elastic.TorchState(model, opt, epoch=seed)


def _step(model: Any, opt: Any, rank_stats: int) -> None:
    """The same update on every rank (as averaged gradients are), and rank-local BatchNorm
    statistics (as each rank's own batches make them)."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01)
    opt.step()
    with torch.no_grad():
        model[1].running_mean.fill_(float(rank_stats))


def _record() -> list[tuple[str, tuple[int, ...]]]:
    """Every packed broadcast of a model's or an optimizer's tensors this rank takes part in:
    (name, members of its process set)."""
    from elasticrun.worker import broadcast, process_sets, rounds

    calls: list[tuple[str, tuple[int, ...]]] = []
    inner = broadcast._broadcast_tensors

    def recording(tensors, root_rank, name, process_set=process_sets.global_process_set):
        if tensors:
            calls.append((name, process_sets.members(process_set, rounds.current())))
        return inner(tensors, root_rank, name, process_set)

    broadcast._broadcast_tensors = recording
    import logging

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            _LOGS.append(record.getMessage())

    logger = logging.getLogger("elasticrun.worker")
    logger.setLevel(logging.INFO)
    logger.addHandler(Keep())
    return calls


_LOGS: list[str] = []  # the worker's log lines from _record() on (what the root says of its sync)


def _result(model: Any, opt: Any, state: Any, calls: list) -> dict[str, Any]:
    mh, oh = state._handlers["model"], state._handlers["optimizer"]
    return {"calls": calls, "epoch": state.epoch, "seq": state.commit_seq,
            "live": {k: t.detach().clone() for k, t in model.state_dict().items()},
            "committed": {k: b.clone() for k, b in mh._buffers.items()},
            "momentum": [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()],
            "committed_momentum": [b.clone() for b in oh._buffers.values()],
            "lr": opt.param_groups[0]["lr"], "logs": [m for m in _LOGS if m.startswith("sync of commit")]}


def _survivors_at_a_commit(rank: int, width: int, newcomer: int | None = None,
                           after_restore: Any = None) -> dict[str, Any]:
    """Ranks sync (rank 0's init wins), train a step, commit, train another step, then (as
    after a failure) restore and sync again. ``newcomer``: that rank joins only for the
    last sync, with a model of its own. ``after_restore(rank, model, opt)`` runs between the
    restore and the last sync (a reset callback)."""
    model, opt, state = _build(rank + 1, width)
    if rank != newcomer:
        # The first sync of the survivors, among themselves: a newcomer is not there yet.
        if newcomer is None:
            state.sync()
        else:
            fresh = _build(1, width)  # rank 0's init, as that sync would have given them
            model.load_state_dict(fresh[0].state_dict())
            opt.load_state_dict(fresh[1].state_dict())
            state.epoch = 1
            state.save()
            state.__dict__["_synced"] = True
        _step(model, opt, rank)
        state.save()
        _step(model, opt, rank)
        state.restore()
    if after_restore is not None:
        after_restore(rank, model, opt)
    from elasticrun.worker import runtime

    runtime.get().steps = 0 if rank == newcomer else 7  # a newcomer counts the job's steps from its sync
    calls = _record()
    state.sync()
    return dict(_result(model, opt, state, calls), steps=runtime.get().steps)


def _same_as_root(results: list[dict[str, Any]]) -> None:
    root = results[0]
    for rank, r in enumerate(results):
        assert r["seq"] == root["seq"] and r["epoch"] == root["epoch"] and r["lr"] == root["lr"], rank
        for name, want in root["live"].items():
            assert torch.equal(r["live"][name], want), (rank, name)
            assert torch.equal(r["committed"][name], want), (rank, name, "committed")
        for got, committed, want in zip(r["momentum"], r["committed_momentum"], root["momentum"]):
            assert torch.equal(got, want) and torch.equal(committed, want), rank


def _params_sent(calls: list) -> list:
    return [c for c in calls if c[0] in ("parameters.broadcast_parameters", "broadcast_parameters",
                                         "broadcast_optimizer_state")]


def after_a_failure(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    return _survivors_at_a_commit(rank, 1024)


def test_after_a_failure_survivors_holding_the_newest_commit_are_sent_no_model(tmp_path):
    results = gloo_world.run_world(HERE, "after_a_failure", 3, tmp_path)
    _same_as_root(results)
    for rank, r in enumerate(results):
        assert _params_sent(r["calls"]) == [], (rank, r["calls"])  # no parameter, no optimizer tensor
        assert ("buffers.broadcast_parameters", (0, 1, 2)) in r["calls"], rank  # BatchNorm stats: to all
    assert results[0]["logs"] == [f"sync of commit {results[0]['seq']} from rank 0: every rank holds the model "
                                  "and optimizer state: none sent"]
    assert results[1]["logs"] == []  # the root says it
    # Each rank's statistics were its own before the sync; rank 0's everywhere after it.
    assert all(torch.equal(r["live"]["1.running_mean"], torch.zeros(1024)) for r in results)


def big_newcomer(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    return _survivors_at_a_commit(rank, 2048, newcomer=2)  # 16 MiB of weights + 16 of momentum


def test_a_newcomer_is_sent_the_model_alone_and_ends_equal(tmp_path):
    results = gloo_world.run_world(HERE, "big_newcomer", 3, tmp_path)
    _same_as_root(results)
    assert _params_sent(results[1]["calls"]) == []  # the other survivor receives no tensor of it
    for rank in (0, 2):
        assert _params_sent(results[rank]["calls"]) == [("parameters.broadcast_parameters", (0, 2)),
                                                        ("broadcast_optimizer_state", (0, 2))], rank
    assert results[0]["logs"][0].endswith("model and optimizer state sent to rank(s) 2 only (the others hold them)")
    assert [r["steps"] for r in results] == [7, 7, 7]  # the job's steps (the driver's status and resumes count them)


def small_newcomer(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    return _survivors_at_a_commit(rank, 64, newcomer=2)


def test_a_small_state_still_goes_to_every_rank_in_one_broadcast(tmp_path):
    results = gloo_world.run_world(HERE, "small_newcomer", 3, tmp_path)
    _same_as_root(results)
    for rank, r in enumerate(results):
        assert _params_sent(r["calls"]) == [("broadcast_parameters", (0, 1, 2)),
                                            ("broadcast_optimizer_state", (0, 1, 2))], rank
    assert results[0]["logs"][0].endswith("model and optimizer state sent to every rank (a small state: as cheap "
                                          "as to rank(s) 2 alone)")


def _scale_on(who: int) -> Any:
    def scale(rank: int, model: Any, opt: Any) -> None:
        if rank == who:  # an in-place write after the restore: this rank no longer holds its commit
            with torch.no_grad():
                model[0].weight.mul_(2.0)
    return scale


def survivor_writes(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    return _survivors_at_a_commit(rank, 2048, after_restore=_scale_on(1))


def test_a_survivor_that_wrote_its_parameters_after_the_restore_is_sent_them(tmp_path):
    results = gloo_world.run_world(HERE, "survivor_writes", 3, tmp_path)
    _same_as_root(results)  # rank 1's doubled weight is the root's again
    assert _params_sent(results[2]["calls"]) == []
    assert _params_sent(results[1]["calls"])[0] == ("parameters.broadcast_parameters", (0, 1))


def root_writes(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    return _survivors_at_a_commit(rank, 64, after_restore=_scale_on(0))


def test_when_the_root_wrote_after_its_restore_every_rank_takes_its_live_state(tmp_path):
    results = gloo_world.run_world(HERE, "root_writes", 3, tmp_path)
    _same_as_root(results)  # the root's doubled weight everywhere, as Horovod's sync gives
    w = results[0]["live"]["0.weight"]
    for rank, r in enumerate(results):
        assert torch.equal(r["live"]["0.weight"], w), rank
        assert ("broadcast_parameters", (0, 1, 2)) in r["calls"], rank


def older_commit(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """Rank 1 abandoned the last commit (its merge saw the round's abort first): it holds
    the commit before, and rank 0 too; rank 2 holds the newest and is the root."""
    model, opt, state = _build(rank + 1, 2048)
    state.sync()
    _step(model, opt, rank)
    if rank == 2:
        state.save()
    else:
        state.save()
        state.__dict__["_commit_seq"] -= 1  # as if this save were the commit before
    _step(model, opt, rank)
    state.restore()
    calls = _record()
    state.sync()
    return _result(model, opt, state, calls)


def test_ranks_without_the_newest_commit_are_sent_it_from_its_holder(tmp_path):
    results = gloo_world.run_world(HERE, "older_commit", 3, tmp_path)
    for rank, r in enumerate(results):
        assert r["seq"] == results[2]["seq"], rank
        for name, want in results[2]["live"].items():
            assert torch.equal(r["live"][name], want), (rank, name)
        # Rank 2 is the root (the lowest rank holding the newest commit), its holders none
        # but itself: the whole round's broadcast.
        assert ("broadcast_parameters", (0, 1, 2)) in r["calls"], rank


def interrupted(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """A host update right after a commit (no restore): the state notes it holds the commit."""
    from elasticrun.worker import runtime
    from elasticrun.worker.exceptions import HostsUpdatedInterrupt

    model, opt, state = _build(rank + 1, 2048)
    state.sync()
    _step(model, opt, rank)

    def hosts_changed(committed: Any = None) -> None:
        raise HostsUpdatedInterrupt(False)

    runtime.get().check_host_updates = hosts_changed
    try:
        state.commit()
    except HostsUpdatedInterrupt:
        pass
    calls = _record()
    state.sync()
    return _result(model, opt, state, calls)


def test_after_an_interrupt_at_a_commit_survivors_are_sent_no_model(tmp_path):
    results = gloo_world.run_world(HERE, "interrupted", 3, tmp_path)
    _same_as_root(results)
    for rank, r in enumerate(results):
        assert _params_sent(r["calls"]) == [], (rank, r["calls"])


class _Tagged(torch.nn.Sequential):
    """A model type with a handler of its own (registered in the ranks' processes)."""


def custom_handler(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """A handler subclass written against the documented ``sync(self, root)``."""
    import elasticrun.torch as hvd
    from elasticrun.worker.state_handlers import ModelStateHandler

    class Counting(ModelStateHandler):
        syncs = 0

        def sync(self, root: int) -> None:
            Counting.syncs += 1
            super().sync(root)

    hvd.elastic.TorchState.register_handler(_Tagged, Counting)
    torch.manual_seed(rank + 1)
    model = _Tagged(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    state = hvd.elastic.TorchState(model, opt, epoch=rank)
    state.sync()
    _step(model, opt, rank)
    state.save()
    _step(model, opt, rank)
    state.restore()
    calls = _record()
    state.sync()
    return dict(_result(model, opt, state, calls), syncs=Counting.syncs)


def test_a_handler_subclass_with_its_own_sync_is_called_as_documented(tmp_path):
    results = gloo_world.run_world(HERE, "custom_handler", 3, tmp_path)
    _same_as_root(results)
    for rank, r in enumerate(results):
        assert r["syncs"] == 2, rank  # its sync(root), at both syncs
        assert ("broadcast_parameters", (0, 1, 2)) in r["calls"], rank  # it sends to all, as it always did
