"""DistributedOptimizer, the broadcasts and TorchState on a real 2-process gloo world.

No driver: each child makes the standalone runtime rank r of 2 over a FileStore group
(``tests/gloo_world.py``). To keep the shared machine's load low, the healthy-path scenarios
run in one world (a module fixture) and the tests check its results; the shrinking world,
where one rank leaves, runs on its own.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gloo_world  # noqa: E402

HERE = str(Path(__file__).resolve())
pytestmark = pytest.mark.timeout(180)


# --------------------------------------------------------------------------- shared helpers
# Used by the parent (references) and by the children (loaded from this file by path).


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def data(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, generator=g), torch.randn(n, 3, generator=g)


def shard(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    n = t.shape[0] // size
    return t[rank * n:(rank + 1) * n]


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def local_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """This rank's own gradients (autograd.grad does not fire the optimizer's hooks)."""
    return [g.detach().clone() for g in torch.autograd.grad(loss_fn(model, x, y), list(model.parameters()))]


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# --------------------------------------------------------------------------- child scenarios


def main_world(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd
    from elasticrun.worker import runtime

    out: dict[str, Any] = {}

    # Average, two momentum steps, one bucket per parameter (so several launches).
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters(), bucket_cap_mb=1e-6)
    rec: dict[str, Any] = {"local": [], "reduced": [], "launched_in_backward": []}
    for step in range(2):
        x, y = data(10 + step)
        xs, ys = shard(x, rank, size), shard(y, rank, size)
        rec["local"].append(local_grads(model, xs, ys))
        opt.zero_grad()
        loss_fn(model, xs, ys).backward()
        rec["launched_in_backward"].append(opt._dist_next == len(opt._dist_buckets))
        opt.step()
        rec["reduced"].append(grads(model))
    rec.update(params=params(model), buckets=len(opt._dist_buckets),
               is_sgd=isinstance(opt, torch.optim.SGD), name=type(opt).__name__)
    out["average"] = rec

    # zero_grad(set_to_none=False), three momentum steps in one bucket: the reduced gradients
    # are views of the bucket, so the next backward accumulates into it in place; the result
    # must still be each step's average (not scaled twice, not mixed with the previous step).
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   named_parameters=model.named_parameters())
    kept: dict[str, Any] = {"local": [], "reduced": []}
    for step in range(3):
        x, y = data(30 + step)
        xs, ys = shard(x, rank, size), shard(y, rank, size)
        kept["local"].append(local_grads(model, xs, ys))
        opt.zero_grad(set_to_none=False)
        loss_fn(model, xs, ys).backward()
        opt.step()
        kept["reduced"].append(grads(model))
    buffer = opt._dist_buckets[0].buffer
    kept["views"] = buffer is not None and all(
        buffer.data_ptr() <= p.grad.data_ptr() < buffer.data_ptr() + buffer.numel() * buffer.element_size()
        for p in model.parameters())
    kept["params"] = params(model)
    out["kept_grads"] = kept

    # op=Sum, with the explicit synchronize() / skip_synchronize() pattern.
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Sum)
    x, y = data(12)
    xs, ys = shard(x, rank, size), shard(y, rank, size)
    local = local_grads(model, xs, ys)
    loss_fn(model, xs, ys).backward()
    opt.synchronize()
    reduced = grads(model)
    with opt.skip_synchronize():
        opt.step()
    out["sum"] = {"local": local, "reduced": reduced, "after_step": grads(model)}

    # fp16 compression and gradient_predivide_factor.
    for name, kwargs in (("fp16", {"compression": hvd.Compression.fp16}),
                         ("predivide", {"gradient_predivide_factor": 4.0})):
        model = make_model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        local = local_grads(model, xs, ys)
        loss_fn(model, xs, ys).backward()
        opt.step()
        out[name] = {"local": local, "reduced": grads(model), "dtype": model[0].weight.grad.dtype}

    # fp16 compression of gradients near float16's smallest value: summed, then averaged (as
    # Horovod does). Divided by the size first, 5e-8 / 2 fell below float16's range: 0.
    tiny = nn.Linear(4, 1, bias=False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(tiny.parameters(), lr=0.1), compression=hvd.Compression.fp16)
    tiny.weight.grad = torch.full_like(tiny.weight, 5e-8)
    opt.synchronize()
    out["fp16_tiny"] = tiny.weight.grad.tolist()
    with opt.skip_synchronize():
        opt.step()

    # backward_passes_per_step=2: local accumulation, one reduction on the 2nd backward.
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2)
    before = params(model)
    batches = [data(20), data(21)]
    shards = [(shard(x, rank, size), shard(y, rank, size)) for x, y in batches]
    local = [local_grads(model, *s) for s in shards]
    opt.zero_grad()
    loss_fn(model, *shards[0]).backward()
    after_first = grads(model)
    launched_after_first = opt._dist_next
    loss_fn(model, *shards[1]).backward()
    opt.step()
    out["bpps"] = {"local": local, "after_first": after_first, "launched_after_first": launched_after_first,
                   "reduced": grads(model), "before": before, "after": params(model)}

    # A parameter unused on rank 1: same collective order, its gradient is rank 0's / 2.
    torch.manual_seed(3)
    heads = nn.ModuleList([nn.Linear(4, 3), nn.Linear(4, 3)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(heads.parameters(), lr=0.1), bucket_cap_mb=1e-6)
    x, y = data(22)
    xs, ys = shard(x, rank, size), shard(y, rank, size)
    out_ = heads[0](xs) + (heads[1](xs) if rank == 0 else 0)
    ((out_ - ys) ** 2).mean().backward()
    local = [p.grad.clone() if p.grad is not None else None for p in heads.parameters()]
    opt.step()
    out["unused"] = {"local": local, "reduced": grads(heads)}

    # A failure in the middle of backward (round aborted after the last layer's buckets were
    # launched), then a reset to a new group: the same optimizer must work again.
    rt = runtime.get()
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), bucket_cap_mb=1e-6)
    x, y = data(23)
    xs, ys = shard(x, rank, size), shard(y, rank, size)
    h = model[0](xs)
    h.register_hook(lambda g: rt._aborted.__setitem__(rt.round, "injected by the test"))
    error = None
    try:
        ((model[2](model[1](h)) - ys) ** 2).mean().backward()
    except hvd.HorovodInternalError as exc:
        error = str(exc)
    left_clean = opt._dist_next == 0 and all(b.buffer is None and b.handle is None for b in opt._dist_buckets)
    rt._aborted.clear()
    gloo_world.reform(rank, size, workdir / "store_after_abort")
    local = local_grads(model, xs, ys)
    opt.zero_grad()
    loss_fn(model, xs, ys).backward()
    opt.step()
    out["abort"] = {"error": error, "left_clean": left_clean, "local": local, "reduced": grads(model)}

    # State left by an error raised elsewhere (handles launched, never synchronized): on the
    # same group zero_grad() refuses like horovod; after a reset it is dropped silently.
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    loss_fn(model, xs, ys).backward()
    try:
        opt.zero_grad()
        same_group_refused = False
    except AssertionError:
        same_group_refused = True
    loss_fn(model, xs, ys).backward()  # launched again, then "an error elsewhere" + reset
    gloo_world.reform(rank, size, workdir / "store_after_stale")
    opt.zero_grad()
    local = local_grads(model, xs, ys)
    loss_fn(model, xs, ys).backward()
    opt.step()
    out["stale"] = {"same_group_refused": same_group_refused, "local": local, "reduced": grads(model)}

    # broadcast_parameters (any dtype, bool and int buffers too) and broadcast_optimizer_state
    # to a rank whose optimizer never stepped.
    model = make_model(seed=100 + rank)
    model.register_buffer("flag", torch.tensor([rank == 0, True]))
    model.register_buffer("count", torch.tensor(7 if rank == 0 else 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01 if rank == 0 else 0.5)
    if rank == 0:
        for _ in range(2):
            opt.zero_grad()
            loss_fn(model, *data(24)).backward()
            opt.step()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    other = make_model(seed=200 + rank)
    hvd.broadcast_parameters(list(other.named_parameters()), root_rank=1)
    out["broadcast"] = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                        "opt": opt.state_dict(), "other": params(other)}

    # TorchState: sync to rank 0, merge the samplers' processed sets at commit, restore.
    model = make_model(seed=300 + rank)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    sampler = hvd.ElasticSampler(range(16), shuffle=False)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=5 * rank)
    state.sync()
    synced = params(model)
    epoch_after_sync = state.epoch
    for b, (xb, yb) in enumerate([data(25), data(26)]):
        opt.zero_grad()
        loss_fn(model, shard(xb, rank, size), shard(yb, rank, size)).backward()
        opt.step()
        sampler.record_batch(b, 2)
        if b == 0:
            state.commit()
            committed = sorted(sampler.processed_indices)
            committed_params = params(model)
    live = sorted(sampler.processed_indices)
    state.restore()
    out["torch_state"] = {"synced": synced, "epoch": epoch_after_sync, "committed": committed, "live": live,
                          "restored": sorted(sampler.processed_indices), "restored_params": params(model),
                          "committed_params": committed_params, "indices_after_restore": list(sampler)}

    # sync(root): rank 1 holds the newer commit (it completed one the other abandoned), so
    # every handler, a user's one included, and the plain attributes sync from rank 1.
    from elasticrun.worker.state_handlers import StateHandler, register_handler

    class Box:
        def __init__(self, v: int) -> None:
            self.v = v

    roots: list[int] = []

    class BoxHandler(StateHandler):
        def __init__(self, value: Box) -> None:
            super().__init__(value)
            self.save()

        def save(self) -> None:
            self.saved = self.value.v

        def restore(self) -> None:
            self.value.v = self.saved

        def sync(self, root: int) -> None:
            roots.append(root)
            self.value.v = hvd.broadcast_object(self.value.v, root, "box")

    register_handler(Box, BoxHandler)
    model = make_model(seed=400 + rank)
    state = hvd.elastic.TorchState(model, box=Box(10 + rank), note=f"rank {rank}")
    if rank == 1:
        state.save()  # no collective in these handlers' merge: a commit of rank 1 only
    state.sync()
    out["sync_root"] = {"roots": roots, "box": state.box.v, "note": state.note, "params": params(model)}

    # Fine-tuning: the first layer frozen at the start, unfrozen at step 2 (and the last
    # layer frozen at step 3, with momentum): every trained gradient is the ranks' average.
    model = make_model()
    first, last = model[0], model[2]
    for p in first.parameters():
        p.requires_grad_(False)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01),
                                   named_parameters=model.named_parameters())
    tune: dict[str, Any] = {"local": [], "reduced": [], "last_before": None}
    for step in range(5):
        if step == 2:
            for p in first.parameters():
                p.requires_grad_(True)
        if step == 3:
            for p in last.parameters():
                p.requires_grad_(False)
            tune["last_before"] = params(last)
        x, y = data(70 + step)
        xs, ys = shard(x, rank, size), shard(y, rank, size)
        opt.zero_grad()
        trained = [p for p in model.parameters() if p.requires_grad]
        tune["local"].append([g.detach().clone() for g in torch.autograd.grad(loss_fn(model, xs, ys), trained)])
        loss_fn(model, xs, ys).backward()
        opt.step()
        tune["reduced"].append([p.grad.detach().clone() for p in trained])
    tune["params"] = params(model)
    tune["last_after"] = params(last)
    out["unfreeze"] = tune
    hvd.barrier()
    return out


def ported_broadcast_world(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """Rank 1 is a newcomer whose ported script kept Horovod's broadcast_parameters before the
    elastic function; rank 0 is at the reset's sync (its first step, agree_to_sync, called as
    hvd.elastic.run calls it)."""
    import elasticrun.torch as hvd
    from elasticrun.worker import elastic

    model = make_model()
    try:
        if rank == 1:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        else:
            elastic.agree_to_sync()
    except (hvd.CollectiveMismatch, hvd.HorovodInternalError) as exc:
        return {"error": str(exc), "type": type(exc).__name__}
    return {"error": None}


def test_a_newcomer_in_its_own_broadcast_while_the_others_sync_is_told_so(tmp_path: Path) -> None:
    """The ranks waited on each other until --collective-timeout (1800 s), then the newcomer's
    healthy host was blacklisted; then every rank raised CollectiveMismatch and the job ended.
    Now the newcomer raises it, with the advice in the first 500 characters (the driver's line
    keeps those), and rank 0, at the sync, goes on without it (a HorovodInternalError: hvd.elastic.run
    restores its commit and re-forms; tests/integration/test_elastic_jobs.py has the whole job)."""
    holder, newcomer = gloo_world.run_world(HERE, "ported_broadcast_world", 2, tmp_path, timeout=60,
                                            collective_timeout=30)
    assert newcomer["type"] == "CollectiveMismatch", newcomer
    text = f"CollectiveMismatch: {newcomer['error']}"[:500]
    assert "hvd.elastic.run's state sync" in text and "broadcast_parameters" in text, text
    assert "remove those calls" in text, text
    assert holder["type"] == "HorovodInternalError", holder
    assert "rank 1 is not at the state's sync" in holder["error"], holder


def joined_batches_world(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """Uneven data: rank 1 trains two batches past the commit, then joins; rank 0 trains two
    more and commits while rank 1 sits in join(), then joins too. What each committed."""
    import elasticrun.torch as hvd
    from elasticrun.worker import join_news

    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    sampler = hvd.ElasticSampler(range(40), shuffle=False)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler)
    join_news.pending_from(state._sampler_news)  # (as hvd.elastic.run does around the user's function)
    state.sync()
    mine = list(sampler)  # this rank's part of the epoch, in batches of 2

    def train(batch: int) -> None:
        opt.zero_grad()
        loss_fn(model, *data(batch)).backward()
        opt.step()
        sampler.record_batch(batch, 2)

    train(0)
    state.commit()
    train(1)
    train(2)
    if rank == 0:
        train(3)
        train(4)
        state.commit()  # rank 1 is in join(): its batches 1 and 2 are in this commit's model
    hvd.join()
    return {"mine": mine, "committed": sorted(state._handlers["sampler"]._processed)}


def test_a_commit_while_a_rank_sits_in_join_records_the_batches_it_trained_before(tmp_path: Path) -> None:
    """The commit made while rank 1 sat in join() merged only rank 0's batches, though rank 1's
    last two were in its model (their gradients were averaged): a reset back to it, rank 1's
    host removed or any host lost, handed those batches out again, trained twice."""
    ranks = gloo_world.run_world(HERE, "joined_batches_world", 2, tmp_path, timeout=60, collective_timeout=30)
    before_join = set(ranks[1]["mine"][:6])  # rank 1's batches 0, 1 and 2
    committed = set(ranks[0]["committed"])
    assert before_join <= committed, sorted(before_join - committed)
    assert set(ranks[0]["mine"][:10]) <= committed
    assert len(committed) == 16  # nothing else: rank 0's five batches and rank 1's three


def shrink_world(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """Rank 1 leaves after one step; rank 0 sees the error, resets to a world of one and
    keeps training with the same optimizer object."""
    import elasticrun.torch as hvd

    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   bucket_cap_mb=1e-6)
    x, y = data(40)
    xs, ys = shard(x, rank, size), shard(y, rank, size)
    opt.zero_grad()
    loss_fn(model, xs, ys).backward()
    opt.step()
    hvd.barrier()
    if rank == 1:
        return {}  # the child exits right after saving this
    error = None
    try:
        opt.zero_grad()
        loss_fn(model, xs, ys).backward()
        opt.step()
    except hvd.HorovodInternalError as exc:
        error = str(exc)
    gloo_world.reform(0, 1, workdir / "store_size1")
    before = params(model)
    local = local_grads(model, x, y)
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    opt.step()
    return {"error": error, "size": hvd.size(), "local": local, "reduced": grads(model),
            "before": before, "after": params(model), "momentum": [opt.state[p]["momentum_buffer"].clone()
                                                                   for p in model.parameters()]}


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def main(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return gloo_world.run_world(HERE, "main_world", 2, tmp_path_factory.mktemp("main_world"))


def mean(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [torch.stack(ts).mean(0) for ts in zip(*per_rank)]


def close(a: list[torch.Tensor], b: list[torch.Tensor], **tol: float) -> bool:
    return len(a) == len(b) and all(torch.allclose(x, y, **tol) for x, y in zip(a, b))


def test_average_matches_mean_and_full_batch(main: list[dict[str, Any]]) -> None:
    res = [r["average"] for r in main]
    assert res[0]["buckets"] == 4  # one per parameter: several async launches
    assert res[0]["is_sgd"] and res[0]["name"] == "SGD"
    for step in range(2):
        expected = mean([r["local"][step] for r in res])
        for r in res:
            assert close(r["reduced"][step], expected, atol=1e-6)
            assert r["launched_in_backward"][step]  # all buckets went out during backward
    # The same two momentum steps in one process on the full batches.
    expected_params = _full_batch_params(steps=2, first_seed=10)
    for r in res:
        assert close(r["params"], expected_params, atol=1e-6)


def _full_batch_params(steps: int, first_seed: int) -> Any:
    """The parameters after ``steps`` momentum steps in one process on the full batches."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, *data(first_seed + step)).backward()
        opt.step()
    return params(model)


def test_gradients_kept_between_steps_are_reduced_in_place(main: list[dict[str, Any]]) -> None:
    res = [r["kept_grads"] for r in main]
    for step in range(3):
        expected = mean([r["local"][step] for r in res])
        for r in res:
            assert close(r["reduced"][step], expected, atol=1e-6), step
    for r in res:
        assert r["views"]  # no copy back: the gradients are the reduced bucket
    expected_params = _full_batch_params(steps=3, first_seed=30)
    for r in res:
        assert close(r["params"], expected_params, atol=1e-6)


def test_sum_and_explicit_synchronize(main: list[dict[str, Any]]) -> None:
    res = [r["sum"] for r in main]
    expected = [torch.stack(ts).sum(0) for ts in zip(*(r["local"] for r in res))]
    for r in res:
        assert close(r["reduced"], expected, atol=1e-6)
        assert close(r["after_step"], expected, atol=1e-6)  # skip_synchronize: not reduced twice


def test_fp16_compression_and_predivide(main: list[dict[str, Any]]) -> None:
    for name, tol in (("fp16", {"rtol": 1e-2, "atol": 1e-3}), ("predivide", {"atol": 1e-6})):
        res = [r[name] for r in main]
        expected = mean([r["local"] for r in res])
        for r in res:
            assert r["dtype"] == torch.float32
            assert close(r["reduced"], expected, **tol), name


def test_fp16_compression_averages_after_the_sum_as_horovod_does(main: list[dict[str, Any]]) -> None:
    for r in main:  # float16(5e-8) is its smallest subnormal, 5.96e-8: the average of two of them
        assert r["fp16_tiny"] == [[float(torch.tensor(5e-8, dtype=torch.float16))] * 4], r["fp16_tiny"]


def test_backward_passes_per_step_accumulates_locally(main: list[dict[str, Any]]) -> None:
    res = [r["bpps"] for r in main]
    expected = mean([[a + b for a, b in zip(*r["local"])] for r in res])
    for r in res:
        assert r["launched_after_first"] == 0
        assert close(r["after_first"], r["local"][0], atol=1e-6)  # not reduced yet
        assert close(r["reduced"], expected, atol=1e-6)
        assert close(r["after"], [p - 0.1 * g for p, g in zip(r["before"], expected)], atol=1e-6)


def test_unused_parameter_keeps_ranks_in_step(main: list[dict[str, Any]]) -> None:
    res = [r["unused"] for r in main]
    assert res[1]["local"][2] is None  # rank 1 never touched head 1
    zero = [torch.zeros_like(t) for t in res[0]["local"]]
    expected = mean([[t if t is not None else z for t, z in zip(r["local"], zero)] for r in res])
    for r in res:
        assert close(r["reduced"], expected, atol=1e-6)


def test_parameters_unfrozen_or_frozen_mid_run_are_reduced_as_the_others(main: list[dict[str, Any]]) -> None:
    """A backbone unfrozen at step k (``requires_grad_(True)``) had no bucket and no hook: each
    rank stepped with its own gradient, and the replicas drifted apart with no word. A layer
    frozen later got a zero gradient, which momentum and weight decay still applied."""
    res = [r["unfreeze"] for r in main]
    for step in range(5):
        expected = mean([r["local"][step] for r in res])
        for r in res:
            assert close(r["reduced"][step], expected, atol=1e-6), step
    assert close(res[0]["params"], res[1]["params"], atol=0)  # the same replica on both ranks
    for r in res:
        assert close(r["last_after"], r["last_before"], atol=0)  # frozen: not moved by momentum or decay


def test_reusable_after_error_mid_backward_and_reset(main: list[dict[str, Any]]) -> None:
    res = [r["abort"] for r in main]
    expected = mean([r["local"] for r in res])
    for r in res:
        assert r["error"] and "injected by the test" in r["error"]
        assert r["left_clean"]
        assert close(r["reduced"], expected, atol=1e-6)


def test_stale_state_from_another_group_is_dropped(main: list[dict[str, Any]]) -> None:
    res = [r["stale"] for r in main]
    expected = mean([r["local"] for r in res])
    for r in res:
        assert r["same_group_refused"]
        assert close(r["reduced"], expected, atol=1e-6)


def test_broadcasts(main: list[dict[str, Any]]) -> None:
    a, b = (r["broadcast"] for r in main)
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["model"]["flag"].tolist() == [True, True] and int(a["model"]["count"]) == 7
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"]
    assert a["opt"]["param_groups"][0]["lr"] == 0.01
    assert a["opt"]["state"].keys() == b["opt"]["state"].keys() and len(a["opt"]["state"]) == 4
    for i, st in a["opt"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, b["opt"]["state"][i][k]), (i, k)
    assert float(b["opt"]["state"][0]["step"]) == 2.0
    assert close(a["other"], b["other"], atol=0) and close(a["other"], params(make_model(seed=201)), atol=0)


def test_torch_state_across_ranks(main: list[dict[str, Any]]) -> None:
    a, b = (r["torch_state"] for r in main)
    assert close(a["synced"], b["synced"], atol=0) and close(a["synced"], params(make_model(seed=300)), atol=0)
    assert a["epoch"] == b["epoch"] == 0
    assert a["committed"] == b["committed"] == [0, 1, 2, 3]  # the union, at commit
    assert a["live"] == [0, 1, 2, 3, 4, 6] and b["live"] == [0, 1, 2, 3, 5, 7]  # recorded locally
    assert a["restored"] == b["restored"] == [0, 1, 2, 3]
    for r in (a, b):
        assert close(r["restored_params"], r["committed_params"], atol=0)
    assert sorted(a["indices_after_restore"] + b["indices_after_restore"]) == list(range(4, 16))


def test_sync_follows_the_rank_holding_the_newest_commit(main: list[dict[str, Any]]) -> None:
    for r in (r["sync_root"] for r in main):
        assert r["roots"] == [1]
        assert r["box"] == 11 and r["note"] == "rank 1"
        assert close(r["params"], params(make_model(seed=401)), atol=0)


@pytest.mark.timeout(120)
def test_same_optimizer_after_shrinking_to_one_rank(tmp_path: Path) -> None:
    res = gloo_world.run_world(HERE, "shrink_world", 2, tmp_path, timeout=90, collective_timeout=10)[0]
    assert res["error"]  # the departed peer surfaced as HorovodInternalError
    assert res["size"] == 1
    assert close(res["reduced"], res["local"], atol=1e-6)  # a world of one: own gradients
    assert all(torch.isfinite(m).all() for m in res["momentum"])
    # Plain SGD with momentum from here on: p -= lr * (0.9 * m_prev + g), with m = momentum.
    assert close(res["after"], [p - 0.1 * m for p, m in zip(res["before"], res["momentum"])], atol=1e-6)
