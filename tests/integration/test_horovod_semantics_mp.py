"""Horovod's semantics where a user errs or a corner is reached, on a real 2-process gloo world
(tests/gloo_world.py), issue 24:

* ranks that call a collective with different arguments (dtype, shape, root, name, split
  count) all raise the same ``CollectiveMismatch`` naming the ranks and the difference, at once
  (no abort inside gloo, no wait for the collective timeout), and the next collective works;
* a name used twice while in flight is refused on every rank;
* the corners: an int16 broadcast, integer averages truncated, reducescatter's prescale on
  integers and its op check, alltoall's and reducescatter's local checks, sparse gradients for
  SparseAdam, a process set's optimizer on a rank outside the set, ``processed_num``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gloo_world  # noqa: E402

HERE = str(Path(__file__).resolve())
pytestmark = pytest.mark.timeout(240)


def mistakes(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd

    out: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        started = time.monotonic()
        try:
            fn()
            out[name] = ("returned", None, 0.0)
        except Exception as exc:
            out[name] = (type(exc).__name__, str(exc), time.monotonic() - started)
        # the process and its group stay usable
        out[name + " then"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()

    attempt("dtype", lambda: hvd.allreduce(torch.ones(3, dtype=torch.float32 if rank == 0 else torch.float64)))
    attempt("shape", lambda: hvd.allreduce(torch.ones(2 + rank, 3)))
    attempt("op", lambda: hvd.allreduce(torch.ones(3), op=hvd.Sum if rank == 0 else hvd.Max))
    attempt("root", lambda: hvd.broadcast(torch.ones(3), root_rank=rank))
    attempt("broadcast shape", lambda: hvd.broadcast(torch.ones(3 + rank), root_rank=0))
    attempt("allgather dtype", lambda: hvd.allgather(torch.ones(2, 2, dtype=torch.int32 if rank else torch.int64)))
    attempt("allgather row shape", lambda: hvd.allgather(torch.ones(2, 2 + rank)))
    attempt("alltoall row shape", lambda: hvd.alltoall(torch.ones(2, 3 + rank), splits=[1, 1]))
    attempt("reducescatter shape", lambda: hvd.reducescatter(torch.ones(2 * (1 + rank), 3)))
    attempt("name", lambda: hvd.allreduce(torch.ones(3), name=f"loss{rank}"))

    def twice() -> None:
        h = hvd.allreduce_async(torch.ones(2), name="x")
        try:
            hvd.allreduce_async(torch.ones(2), name="x")
        finally:
            hvd.synchronize(h)
    attempt("same name in flight", twice)

    model = torch.nn.Linear(3, 2 + rank)  # the ranks' models differ
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())

    def step() -> None:
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    attempt("models differ", step)

    # The same set registered in a different order on each rank: two ids for it (as when
    # survivors re-register their sets in a reset callback and a newcomer registers them once).
    pair, alone = ((hvd.add_process_set([0, 1]), hvd.add_process_set([0])) if rank == 0
                   else (hvd.add_process_set([0]), hvd.add_process_set([0, 1]))[::-1])
    out["process set ids"] = pair.process_set_id
    attempt("process set order", lambda: hvd.allreduce(torch.ones(2) * (rank + 1), op=hvd.Sum, process_set=pair))
    out["process set order value"] = hvd.allreduce(torch.ones(2) * (rank + 1), op=hvd.Sum, process_set=pair).tolist()
    return out


@pytest.fixture(scope="module")
def errors(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return gloo_world.run_world(HERE, "mistakes", 2, tmp_path_factory.mktemp("mistakes"), timeout=200,
                                collective_timeout=30)


@pytest.mark.parametrize("case, says", [
    ("dtype", "dtype (rank 0: ('float32',); rank 1: ('float64',))"),
    ("shape", "shape (rank 0: (2, 3); rank 1: (3, 3))"),
    ("op", "op (rank 0: 1; rank 1: 4)"),
    ("root", "root (rank 0: 0; rank 1: 1)"),
    ("broadcast shape", "shape (rank 0: (3,); rank 1: (4,))"),
    ("allgather dtype", "dtype (rank 0: ('int64',); rank 1: ('int32',))"),
    ("allgather row shape", "rows_of (rank 0: ((2,),); rank 1: ((3,),))"),
    ("alltoall row shape", "rest (rank 0: (3,); rank 1: (4,))"),
    ("reducescatter shape", "shape (rank 0: (2, 3); rank 1: (4, 3))"),
    ("name", "name (rank 0: loss0; rank 1: loss1)"),
    ("models differ", "buckets"),
])
def test_a_mismatch_is_the_same_error_on_every_rank_at_once_and_the_group_lives_on(errors, case, says):
    kinds = {w[case][0] for w in errors}
    messages = {w[case][1] for w in errors}
    assert kinds == {"CollectiveMismatch"}, [w[case] for w in errors]
    assert len(messages) == 1, messages  # the very same words on every rank
    [message] = messages
    assert "the ranks called it with different arguments" in message and says in message, message
    assert all(w[case][2] < 10 for w in errors), [w[case][2] for w in errors]  # not the collective timeout
    assert all(w[case + " then"] == 2.0 for w in errors)


def test_a_process_set_is_known_by_its_ranks_not_the_order_it_was_registered_in(errors):
    """Each rank sealed its signature for the set under its own id, so the other's seemed a
    stranger's ("do not carry the job's seal ... did someone else connect"), and an elastic
    job reset without end; by the ids alone it would be a mismatch. Both use one group of the
    same ranks: the collective runs."""
    assert [w["process set ids"] for w in errors] == [1, 2]
    for w in errors:
        assert w["process set order"][0] == "returned", w["process set order"]
        assert w["process set order value"] == [3.0, 3.0]


def test_a_name_twice_in_flight_is_refused_on_every_rank(errors):
    for w in errors:
        kind, message, _ = w["same name in flight"]
        assert kind == "ValueError" and "an operation named 'x' is already in progress" in message
        assert w["same name in flight then"] == 2.0


def corners(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd

    out: dict[str, Any] = {}

    def attempt(name: str, fn: Any) -> None:
        try:
            out[name] = fn()
        except Exception as exc:
            out[name] = exc

    attempt("broadcast int16", lambda: hvd.broadcast(torch.tensor([rank + 7], dtype=torch.int16), 0))
    attempt("allreduce int16", lambda: hvd.allreduce(torch.tensor([rank + 7], dtype=torch.int16), op=hvd.Sum))
    attempt("int average", lambda: hvd.allreduce(torch.tensor([-75 if rank == 0 else 0])))
    attempt("reducescatter int prescale", lambda: hvd.reducescatter(torch.tensor([3, 5]), op=hvd.Sum,
                                                                    prescale_factor=0.5))
    attempt("reducescatter adasum", lambda: hvd.reducescatter(torch.ones(2), op=hvd.Adasum))
    attempt("alltoall uneven", lambda: hvd.alltoall(torch.arange(3.0)))
    attempt("reducescatter 0-d", lambda: hvd.reducescatter(torch.tensor(1.0)))
    emb = torch.nn.Embedding(10, 3, sparse=True)
    torch.nn.init.constant_(emb.weight, 1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SparseAdam(emb.parameters(), lr=0.1),
                                   named_parameters=emb.named_parameters())

    def sparse_steps() -> Any:
        for step in range(3):
            emb(torch.tensor([rank, 5] if step != 1 or rank == 0 else [5])).sum().backward()
            grad = emb.weight.grad
            opt.step()
            opt.zero_grad()
        return grad.is_sparse, emb.weight.detach().clone()
    attempt("sparse adam", sparse_steps)
    ps = hvd.add_process_set([0])
    lin = torch.nn.Linear(2, 2)
    before = [p.detach().clone() for p in lin.parameters()]
    o2 = hvd.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1),
                                  named_parameters=lin.named_parameters(), process_set=ps)

    def outside_the_set() -> Any:
        lin(torch.ones(1, 2) * (rank + 1)).sum().backward()
        o2.step()
        return [(b - p.detach()).abs().sum().item() for b, p in zip(before, lin.parameters())]
    attempt("process set step", outside_the_set)
    sampler = hvd.elastic.ElasticSampler(list(range(8)), shuffle=False)
    sampler.record_batch(0, 2)
    out["processed_num"] = sampler.processed_num
    return out


@pytest.fixture(scope="module")
def corner(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return gloo_world.run_world(HERE, "corners", 2, tmp_path_factory.mktemp("corners"), timeout=200)


def test_small_integer_dtypes_travel(corner):
    for w in corner:
        assert w["broadcast int16"].dtype == torch.int16 and w["broadcast int16"].tolist() == [7]
        assert w["allreduce int16"].dtype == torch.int16 and w["allreduce int16"].tolist() == [15]


def test_integers_are_averaged_and_prescaled_as_horovod_does(corner):
    for w in corner:
        assert w["int average"].tolist() == [-37]  # truncated toward zero, not floored to -38
    assert corner[0]["reducescatter int prescale"].dtype == torch.int64
    assert corner[0]["reducescatter int prescale"].tolist() == [2] and corner[1]["reducescatter int prescale"].tolist() == [4]


def test_argument_checks_are_local_and_clear(corner):
    for w in corner:
        assert isinstance(w["reducescatter adasum"], RuntimeError)  # Horovod's type (and a ValueError)
        assert isinstance(w["alltoall uneven"], ValueError) and "divisible" in str(w["alltoall uneven"])
        assert isinstance(w["reducescatter 0-d"], ValueError) and "at least one dimension" in str(w["reducescatter 0-d"])


def test_sparse_gradients_stay_sparse_for_sparse_adam(corner):
    (sparse0, w0), (sparse1, w1) = corner[0]["sparse adam"], corner[1]["sparse adam"]
    assert sparse0 and sparse1 and torch.equal(w0, w1)  # every rank applied the same reduced gradients
    assert not torch.equal(w0, torch.ones_like(w0))


def test_a_process_sets_optimizer_steps_alone_on_a_rank_outside_it(corner):
    assert all(d > 0 for d in corner[1]["process set step"])  # stepped with its own gradients
    assert all(d > 0 for d in corner[0]["process set step"])


def test_the_sampler_counts_processed_samples(corner):
    assert [w["processed_num"] for w in corner] == [2, 2]


def fresh_optimizer(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd

    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    model[1].bias.requires_grad_(False)  # a parameter without a gradient, ever
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return {"grads": [None if p.grad is None else float(p.grad.abs().sum()) for p in model.parameters()]}


def test_broadcast_optimizer_state_of_a_fresh_optimizer_makes_zero_gradients(tmp_path):
    for w in gloo_world.run_world(HERE, "fresh_optimizer", 2, tmp_path, timeout=120):
        assert w["grads"] == [0.0, 0.0, 0.0, None]  # as Horovod: zeros for trainable ones only


def scheduler_made_before_wrapping(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)  # before wrapping
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    groups, state = opt.param_groups[0], opt.state
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        scheduler.step()
    return {"lr": opt.param_groups[0]["lr"], "same group": opt.param_groups[0] is groups,
            "same state": opt.state is state}


def test_broadcast_optimizer_state_keeps_the_groups_a_scheduler_made_before_wrapping_holds(tmp_path):
    """As Horovod's (which writes options and state in place): the receivers' param_groups
    stay the dicts the scheduler sets the learning rate in. torch's load_state_dict replaced
    them, and every rank but the root trained at a constant learning rate."""
    for w in gloo_world.run_world(HERE, "scheduler_made_before_wrapping", 2, tmp_path, timeout=120):
        assert w == {"lr": 0.1 * 0.5 ** 3, "same group": True, "same state": True}


def two_optimizers(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd

    torch.manual_seed(0)
    heads = {"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)}
    opts = {k: hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                        named_parameters=[(f"{k}.{n}", p) for n, p in m.named_parameters()])
            for k, m in heads.items()}
    x = torch.randn(4, 4)
    out: dict[str, Any] = {}
    for step, per_rank in enumerate([False, True]):
        for o in opts.values():
            o.zero_grad()
        head = heads["ab"[rank % 2]] if per_rank else heads["a"]
        try:
            (head(x) ** 2).sum().backward()
            for o in opts.values():
                o.step()
            out[step] = "stepped"
        except Exception as exc:
            out[step] = f"{type(exc).__name__}: {exc}"
    return out


def test_two_optimizers_used_differently_by_the_ranks_fail_loudly_not_silently(tmp_path):
    """Each DistributedOptimizer launches its buckets as its gradients come; with a graph that
    differs between ranks, a's bucket on rank 0 met b's on rank 1 and the two were summed,
    silently. Horovod pairs reductions by name; here every rank raises, naming both buckets."""
    for w in gloo_world.run_world(HERE, "two_optimizers", 2, tmp_path, timeout=120):
        assert w[0] == "stepped"  # the same head on every rank: as before
        assert w[1].startswith("CollectiveMismatch: DistributedOptimizer bucket") and "a.bias .. a.weight" in w[1] \
            and "b.bias .. b.weight" in w[1], w[1]


def sparse_used_by_some_ranks(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd

    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD([*emb.parameters(), *head.parameters()], lr=0.1),
                                   named_parameters=[("emb.weight", emb.weight), *head.named_parameters()])
    hvd.broadcast_parameters({"emb": emb.weight, "w": head.weight, "b": head.bias}, root_rank=0)
    ids = torch.tensor([1, 2, 3])
    for step in range(3):
        opt.zero_grad()
        uses = not (rank == 1 and step == 1)  # a per-rank branch skips the embedding once
        x = emb(ids) if uses else torch.ones(3, 4)
        head(x).sum().backward()
        opt.step()
    return {"emb": emb.weight.detach().clone(), "head": head.weight.detach().clone()}


def test_a_sparse_gradient_one_rank_did_not_compute_this_step_is_reduced_as_zeros(tmp_path):
    """Both ranks know the embedding's gradients are sparse; in one step rank 1 does not use it.
    Its reduction was started from the gradient's hook on rank 0 and at synchronize() on rank 1,
    out of order with the dense bucket: gloo aborted both processes. Now every rank reduces the
    sparse gradients after the dense buckets, and the replicas stay equal."""
    a, b = gloo_world.run_world(HERE, "sparse_used_by_some_ranks", 2, tmp_path, timeout=120)
    assert torch.equal(a["emb"], b["emb"]) and torch.equal(a["head"], b["head"])
