"""The Horovod-parity collectives on a real 2-process gloo world (no driver; tests/gloo_world.py).

One world runs every healthy-path scenario (module fixture) and the tests check its results;
a second one checks that each new operation gives up with HorovodInternalError when its
round is aborted while it waits for a peer that never comes.
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
pytestmark = pytest.mark.timeout(240)


def values(rank: int, shape: tuple[int, ...], seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randn(shape, generator=g)


def main_world(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import torch.distributed as dist

    import elasticrun.torch as hvd
    from elasticrun.worker import adasum

    out: dict[str, Any] = {}
    x = values(rank, (5, 3))
    out["ops"] = {name: hvd.allreduce(x, op=op) for name, op in
                  (("average", hvd.Average), ("sum", hvd.Sum), ("min", hvd.Min), ("max", hvd.Max),
                   ("product", hvd.Product), ("sum_str", "sum"))}
    out["int_average"] = hvd.allreduce(torch.tensor([rank * 3 + 4]), op=hvd.Average)
    out["prescale"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    out["fp16"] = hvd.allreduce(x, compression=hvd.Compression.fp16)

    # Differentiable allreduce / allgather / broadcast / alltoall / reducescatter.
    grads: dict[str, Any] = {}
    t = x.clone().requires_grad_()
    (hvd.allreduce(t, op=hvd.Sum) * (rank + 1)).sum().backward()
    grads["allreduce_sum"] = t.grad.clone()
    t = x.clone().requires_grad_()
    (hvd.allreduce(t) * (rank + 1)).sum().backward()
    grads["allreduce_avg"] = t.grad.clone()
    rows = torch.arange(2 + rank, dtype=torch.float32).unsqueeze(1).repeat(1, 2) + 10 * rank
    t = rows.clone().requires_grad_()
    gathered = hvd.allgather(t)
    (gathered * (rank + 1)).sum().backward()
    out["allgather"] = gathered.detach()
    grads["allgather"] = t.grad.clone()
    t = x.clone().requires_grad_()
    b = hvd.broadcast(t, root_rank=1)
    (b * (rank + 1)).sum().backward()
    out["broadcast"] = b.detach()
    grads["broadcast"] = t.grad.clone()
    send = torch.arange(5, dtype=torch.float32) + 100 * rank
    splits = [1, 4] if rank == 0 else torch.tensor([3, 2])  # int64: the received splits are int32 all the same
    t = send.clone().requires_grad_()
    received, recv_splits = hvd.alltoall(t, splits=splits)
    (received * torch.arange(1, received.numel() + 1)).sum().backward()
    out["alltoall"] = (received.detach(), recv_splits)
    grads["alltoall"] = t.grad.clone()
    out["alltoall_even"] = hvd.alltoall(torch.arange(4.0) + 10 * rank)
    y = torch.arange(10, dtype=torch.float32).view(5, 2) * (rank + 1)
    for op in ("sum", "average"):
        t = y.clone().requires_grad_()
        part = hvd.reducescatter(t, op=hvd.Sum if op == "sum" else hvd.Average)
        (part * (rank + 1)).sum().backward()
        out[f"reducescatter_{op}"] = part.detach()
        grads[f"reducescatter_{op}"] = t.grad.clone()
    out["grads"] = grads

    # Grouped and asynchronous forms.
    a, bb = values(rank, (4,), 1), torch.tensor([rank + 1, 2 * rank], dtype=torch.int64)
    out["grouped_allreduce"] = hvd.grouped_allreduce([a, bb], op=hvd.Sum)
    inplace = [a.clone(), bb.clone()]
    hvd.grouped_allreduce_(inplace, op=hvd.Sum)
    out["grouped_allreduce_"] = inplace
    out["grouped_allgather"] = hvd.grouped_allgather([rows, torch.tensor([rank])])
    out["grouped_reducescatter"] = hvd.grouped_reducescatter([y, y[:3]], op=hvd.Sum)
    handles = [hvd.allreduce_async(x, op=hvd.Sum), hvd.allgather_async(rows), hvd.broadcast_async(x, 0),
               hvd.alltoall_async(send, splits), hvd.reducescatter_async(y, op=hvd.Sum),
               hvd.grouped_allreduce_async([a], op=hvd.Sum), hvd.grouped_allgather_async([rows]),
               hvd.grouped_reducescatter_async([y], op=hvd.Sum)]
    out["async"] = [hvd.synchronize(h) for h in handles]
    sparse = torch.sparse_coo_tensor(torch.tensor([[rank, 3]]), torch.tensor([1.0 + rank, 2.0]), (5,))
    h = hvd.sparse_allreduce_async(sparse, name="sp", op=hvd.Sum)
    out["sparse"] = h().to_dense()

    # Adasum: the pairwise combination of both ranks' vectors, per tensor.
    v1, v2 = values(rank, (6,), 2), values(rank, (3,), 3)
    out["adasum_inputs"] = (v1.clone(), v2.clone())
    out["adasum"] = hvd.allreduce(v1, op=hvd.Adasum)
    out["adasum_grouped"] = hvd.grouped_allreduce([v1, v2], op=hvd.Adasum)
    model = nn.Linear(3, 2)
    torch.manual_seed(0)
    nn.init.constant_(model.weight, 0.5)
    nn.init.zeros_(model.bias)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum)
    before = [p.detach().clone() for p in model.parameters()]
    model(values(rank, (4, 3), 4)).pow(2).sum().backward()
    local = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    out["adasum_opt"] = {"before": before, "grads": local, "after": [p.detach().clone() for p in model.parameters()]}
    out["adasum_check"] = adasum.combine(torch.ones(4), torch.ones(4), [(0, 4)])

    # Process sets: registered ranks, members only; the global set; removal.
    solo = hvd.add_process_set([1])
    both = hvd.add_process_set(hvd.ProcessSet([0, 1]))
    try:
        hvd.add_process_set([0, 1])
        duplicate_refused = False
    except ValueError:
        duplicate_refused = True
    ps: dict[str, Any] = {"ids": (solo.process_set_id, both.process_set_id), "dup": duplicate_refused,
                          "included": solo.included(), "rank_in_solo": solo.rank(), "size": both.size()}
    if rank == 1:
        ps["solo_sum"] = hvd.allreduce(torch.tensor([7.0]), op=hvd.Sum, process_set=solo)
    ps["both_gather"] = hvd.allgather(torch.tensor([rank]), process_set=both)
    ps["both_bcast"] = hvd.broadcast(torch.tensor([rank * 1.0]), root_rank=1, process_set=both)
    ps["object"] = hvd.broadcast_object({"from": rank}, root_rank=1, process_set=both)
    # Objects whose pickle fits the first broadcast, just does not, and far exceeds it.
    ps["objects_by_size"] = [hvd.broadcast_object(b"x" * n if rank == 0 else None, root_rank=0, name=f"sized{n}")
                             for n in (4060, 4100, 300_000)]
    hvd.barrier(process_set=both)
    ps["removed"] = hvd.remove_process_set(solo)
    ps["removed_ranks"] = solo.ranks
    out["process_sets"] = ps

    # torch.distributed on the round's group.
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t, group=hvd.process_group())
    out["torch_distributed"] = t

    # join(): rank 1 runs out of data first; rank 0 runs three more allreduces, an optimizer
    # step, an allgather, a broadcast, an alltoall, a reducescatter and an object gather.
    model = nn.Linear(3, 1)
    nn.init.constant_(model.weight, 1.0)
    nn.init.zeros_(model.bias)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    j: dict[str, Any] = {}
    if rank == 0:
        j["sums"] = [hvd.allreduce(torch.tensor([float(i + 1)]), op=hvd.Sum) for i in range(3)]
        j["avg"] = hvd.allreduce(torch.tensor([4.0, 2.0]))
        j["max"] = hvd.allreduce(torch.tensor([-5.0]), op=hvd.Max)
        opt.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        opt.step()
        j["weight"] = model.weight.detach().clone()
        j["gather"] = hvd.allgather(torch.tensor([[1.0, 2.0]]))
        j["alltoall"] = hvd.alltoall(torch.arange(3.0), splits=[3, 0])
        j["reducescatter"] = hvd.reducescatter(torch.arange(4.0), op=hvd.Sum)
        j["objects"] = hvd.allgather_object("rank0")
        import time
        time.sleep(0.3)  # rank 1 waits for descriptors meanwhile
    j["last"] = hvd.join()
    j["after"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum)  # both train again afterwards
    out["join"] = j

    # SyncBatchNorm against one process normalizing both batches (3 and 5 rows).
    torch.manual_seed(5)
    full = torch.randn(8, 4, 2)
    mine = full[:3] if rank == 0 else full[3:]
    bn = hvd.SyncBatchNorm(4)
    with torch.no_grad():
        bn.weight.copy_(torch.arange(1.0, 5.0))
        bn.bias.copy_(torch.arange(4.0))
    inp = mine.clone().requires_grad_()
    yy = bn(inp)
    (yy * torch.arange(yy.numel()).view_as(yy)).sum().backward()
    out["sync_bn"] = {"y": yy.detach(), "dx": inp.grad.clone(), "dw": bn.weight.grad.clone(),
                      "db": bn.bias.grad.clone(), "running": (bn.running_mean.clone(), bn.running_var.clone())}

    # The timeline records this rank's collectives.
    hvd.start_timeline(str(workdir / f"timeline{rank}.json"))
    hvd.allreduce(x, name="traced")
    hvd.barrier()
    hvd.stop_timeline()
    out["built"] = (hvd.gloo_built(), hvd.mpi_built(), hvd.mpi_threads_supported(), hvd.nccl_built())

    # Process sets re-form in the next round, dropping ranks that are gone.
    gloo_world.reform(rank, size, workdir / "store_round2")
    out["ps_next_round"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, process_set=both)
    hvd.barrier()
    return out


def mean_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(tensors).mean(0)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return gloo_world.run_world(HERE, "main_world", 2, tmp_path_factory.mktemp("collectives"))


def test_op_constants_are_horovods_integers_and_strings_still_work(world: list[dict[str, Any]]) -> None:
    import elasticrun.torch as hvd

    assert (hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product) == (0, 1, 2, 3, 4, 5)
    xs = [values(r, (5, 3)) for r in range(2)]
    ops = world[0]["ops"]
    assert torch.allclose(ops["average"], mean_of(xs))
    assert torch.allclose(ops["sum"], xs[0] + xs[1]) and torch.allclose(ops["sum_str"], ops["sum"])
    assert torch.equal(ops["min"], torch.minimum(*xs)) and torch.equal(ops["max"], torch.maximum(*xs))
    assert torch.allclose(ops["product"], xs[0] * xs[1])
    assert world[0]["int_average"].tolist() == [5]  # (4 + 7) // 2, floor as Horovod
    assert torch.allclose(world[1]["prescale"], xs[0] + xs[1])
    assert torch.allclose(world[1]["fp16"], mean_of(xs), atol=1e-2) and world[1]["fp16"].dtype == torch.float32


def test_gradients_flow_through_the_collectives(world: list[dict[str, Any]]) -> None:
    g = [w["grads"] for w in world]
    for r in range(2):
        assert torch.allclose(g[r]["allreduce_sum"], torch.full((5, 3), 3.0))  # sum of (1, 2)
        assert torch.allclose(g[r]["allreduce_avg"], torch.full((5, 3), 1.5))  # the average of (1, 2)
        assert torch.allclose(g[r]["allgather"], torch.full((2 + r, 2), 1.5))  # the ranks' average
        assert torch.allclose(g[r]["broadcast"], torch.full((5, 3), 1.5 if r == 1 else 0.0))
        # reducescatter: an allgather of the gradients (times the size for Sum), as Horovod.
        assert torch.allclose(g[r]["reducescatter_sum"], torch.tensor([1.0] * 6 + [2.0] * 4).view(5, 2) * 2)
        assert torch.allclose(g[r]["reducescatter_average"], torch.tensor([1.0] * 6 + [2.0] * 4).view(5, 2))
    # alltoall: the gradient of each sent row comes back from where it went.
    assert g[0]["alltoall"].tolist() == [1.0, 1.0, 2.0, 3.0, 4.0], g[0]["alltoall"]
    assert g[1]["alltoall"].tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]


def test_allgather_broadcast_alltoall_reducescatter_results(world: list[dict[str, Any]]) -> None:
    rows = [torch.arange(2 + r, dtype=torch.float32).unsqueeze(1).repeat(1, 2) + 10 * r for r in range(2)]
    for r in range(2):
        w = world[r]
        assert torch.equal(w["allgather"], torch.cat(rows))
        assert torch.equal(w["broadcast"], values(1, (5, 3)))
    (out0, splits0), (out1, splits1) = world[0]["alltoall"], world[1]["alltoall"]
    assert out0.tolist() == [0.0, 100.0, 101.0, 102.0] and splits0.tolist() == [1, 3]
    assert out1.tolist() == [1.0, 2.0, 3.0, 4.0, 103.0, 104.0] and splits1.tolist() == [4, 2]
    assert splits0.dtype == splits1.dtype == torch.int32  # as Horovod's, whatever the dtype of the splits sent
    assert world[0]["alltoall_even"].tolist() == [0.0, 1.0, 10.0, 11.0]
    total = torch.arange(10, dtype=torch.float32).view(5, 2) * 3
    assert torch.equal(world[0]["reducescatter_sum"], total[:3]) and torch.equal(world[1]["reducescatter_sum"], total[3:])
    assert torch.allclose(world[1]["reducescatter_average"], total[3:] / 2)


def test_grouped_async_and_sparse_forms(world: list[dict[str, Any]]) -> None:
    a = [values(r, (4,), 1) for r in range(2)]
    for r in range(2):
        w = world[r]
        for got in (w["grouped_allreduce"], w["grouped_allreduce_"]):
            assert torch.allclose(got[0], a[0] + a[1]) and got[1].tolist() == [3, 2] and got[1].dtype == torch.int64
        assert w["grouped_allgather"][1].tolist() == [0, 1]
        assert torch.equal(w["grouped_allgather"][0], world[0]["allgather"])
        total = torch.arange(10, dtype=torch.float32).view(5, 2) * 3
        assert torch.equal(w["grouped_reducescatter"][0], total[:3] if r == 0 else total[3:])
        assert torch.equal(w["grouped_reducescatter"][1], total[:2] if r == 0 else total[2:3])
        res = w["async"]
        assert torch.allclose(res[0], w["ops"]["sum"]) and torch.equal(res[1], w["allgather"])
        assert torch.equal(res[2], values(0, (5, 3))) and torch.equal(res[3][0], w["alltoall"][0])
        assert torch.equal(res[4], w["reducescatter_sum"]) and torch.allclose(res[5][0], a[0] + a[1])
        assert torch.equal(res[6][0], w["allgather"]) and torch.equal(res[7][0], w["reducescatter_sum"])
        assert w["sparse"].tolist() == [1.0, 2.0, 0.0, 4.0, 0.0]


def test_adasum_combines_pairwise_per_tensor(world: list[dict[str, Any]]) -> None:
    from elasticrun.worker import adasum

    (a1, a2), (b1, b2) = world[0]["adasum_inputs"], world[1]["adasum_inputs"]
    expected = adasum.combine(a1, b1, [(0, 6)])
    cat = adasum.combine(torch.cat([a1, a2]), torch.cat([b1, b2]), [(0, 6), (6, 3)])
    for w in world:
        assert torch.allclose(w["adasum"], expected)
        assert torch.allclose(w["adasum_grouped"][0], cat[:6]) and torch.allclose(w["adasum_grouped"][1], cat[6:])
    assert torch.allclose(world[0]["adasum_check"], torch.ones(4))  # parallel vectors average
    # Orthogonal vectors add up; the formula with a hand-computed case.
    assert torch.allclose(adasum.combine(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]), [(0, 2)]),
                          torch.tensor([1.0, 2.0]))
    # DistributedOptimizer(op=Adasum): old parameters + Adasum of the local SGD steps' deltas.
    opt0, opt1 = world[0]["adasum_opt"], world[1]["adasum_opt"]
    deltas = [[-0.1 * g for g in o["grads"]] for o in (opt0, opt1)]
    for i, before in enumerate(opt0["before"]):
        d = adasum.combine(deltas[0][i].reshape(-1), deltas[1][i].reshape(-1), [(0, before.numel())])
        for o in (opt0, opt1):
            assert torch.allclose(o["after"][i], before + d.view_as(before), atol=1e-6)


def test_adasum_schedule_folds_sizes_that_are_not_powers_of_two() -> None:
    from elasticrun.worker import adasum

    assert adasum.schedule(1) == []
    assert adasum.schedule(2) == [[1, 0]]
    assert adasum.schedule(4) == [[1, 0, 3, 2], [2, 3, 0, 1]]
    assert adasum.schedule(3) == [[2, -1, 0], [1, 0, -1], [2, -1, 0]]


def test_process_sets(world: list[dict[str, Any]]) -> None:
    for r, w in enumerate(world):
        ps = w["process_sets"]
        assert ps["ids"] == (1, 2) and ps["dup"] and ps["size"] == 2
        assert ps["included"] == (r == 1) and ps["rank_in_solo"] == (0 if r == 1 else None)
        assert ps["both_gather"].tolist() == [0, 1] and ps["both_bcast"].tolist() == [1.0]
        assert ps["object"] == {"from": 1}
        assert [len(o) for o in ps["objects_by_size"]] == [4060, 4100, 300_000]
        assert all(o == b"x" * len(o) for o in ps["objects_by_size"])
        assert ps["removed"] and ps["removed_ranks"] is None
        assert w["ps_next_round"].tolist() == [2.0]  # re-formed in the new round
    assert world[1]["process_sets"]["solo_sum"].tolist() == [7.0]


def test_torch_distributed_runs_on_the_rounds_group(world: list[dict[str, Any]]) -> None:
    assert [w["torch_distributed"].tolist() for w in world] == [[3.0], [3.0]]


def test_join_answers_the_other_ranks_collectives_with_nothing(world: list[dict[str, Any]]) -> None:
    j0, j1 = world[0]["join"], world[1]["join"]
    assert j0["last"] == j1["last"] == 0
    assert [t.tolist() for t in j0["sums"]] == [[1.0], [2.0], [3.0]]
    assert j0["avg"].tolist() == [2.0, 1.0]  # zeros from the joined rank; still divided by 2
    assert j0["max"].tolist() == [-5.0]  # the joined rank contributes -inf to a max
    assert torch.allclose(j0["weight"], torch.full((1, 3), 1.0 - 0.1 * 2 / 2))  # gradient 2 averaged with 0
    assert j0["gather"].tolist() == [[1.0, 2.0]]  # no rows from the joined rank
    assert j0["alltoall"][0].tolist() == [0.0, 1.0, 2.0] and j0["alltoall"][1].tolist() == [3, 0]
    assert j0["reducescatter"].tolist() == [0.0, 1.0]
    assert j0["objects"] == ["rank0", None]
    assert j0["after"].tolist() == j1["after"].tolist() == [2.0]


def test_sync_batch_norm_matches_one_process_over_all_rows(world: list[dict[str, Any]]) -> None:
    torch.manual_seed(5)
    full = torch.randn(8, 4, 2).requires_grad_()
    bn = nn.BatchNorm1d(4)
    with torch.no_grad():
        bn.weight.copy_(torch.arange(1.0, 5.0))
        bn.bias.copy_(torch.arange(4.0))
    y = bn(full)
    weights = torch.cat([torch.arange(24).view(3, 4, 2), torch.arange(40).view(5, 4, 2)]).float()
    (y * weights).sum().backward()
    s0, s1 = world[0]["sync_bn"], world[1]["sync_bn"]
    assert torch.allclose(torch.cat([s0["y"], s1["y"]]), y.detach(), atol=1e-5)
    assert torch.allclose(torch.cat([s0["dx"], s1["dx"]]), full.grad, atol=1e-4)
    assert torch.allclose(s0["dw"] + s1["dw"], bn.weight.grad, atol=1e-4)
    assert torch.allclose(s0["db"] + s1["db"], bn.bias.grad, atol=1e-4)
    for s in (s0, s1):
        assert torch.allclose(s["running"][0], bn.running_mean, atol=1e-6)
        assert torch.allclose(s["running"][1], bn.running_var, atol=1e-6)


def test_timeline_and_built_flags(world: list[dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> None:
    import json

    assert world[0]["built"][:3] == (True, False, False) and isinstance(world[0]["built"][3], int)
    root = next(Path(p) for p in [tmp_path_factory.getbasetemp()] if p.exists())
    trace_file = next(root.rglob("timeline0.json"))
    events = json.loads(trace_file.read_text())
    names = [e["name"] for e in events if e.get("ph") == "X"]
    assert "allreduce traced" in names and "barrier" in names
    assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")


# --------------------------------------------------------------------------- aborts


def abort_world(rank: int, size: int, workdir: Path) -> list[str]:
    """Rank 0 starts each operation; rank 1 never does. The round is aborted 0.2 s later (as
    the driver does when a peer dies): the operation must raise HorovodInternalError."""
    import threading

    import elasticrun.torch as hvd
    from elasticrun.worker import runtime

    rt = runtime.get()
    ops = {
        "allreduce": lambda: hvd.allreduce(torch.ones(3)),
        "grouped_allreduce": lambda: hvd.grouped_allreduce([torch.ones(3), torch.ones(2)]),
        "adasum": lambda: hvd.allreduce(torch.ones(3), op=hvd.Adasum),
        "allgather": lambda: hvd.allgather(torch.ones(2, 2)),
        "grouped_allgather": lambda: hvd.grouped_allgather([torch.ones(2)]),
        "broadcast": lambda: hvd.broadcast(torch.ones(2), 1),
        "alltoall": lambda: hvd.alltoall(torch.ones(4)),
        "reducescatter": lambda: hvd.reducescatter(torch.ones(4)),
        "grouped_reducescatter": lambda: hvd.grouped_reducescatter([torch.ones(4)]),
        "join": lambda: hvd.join(),
        "sync_batch_norm": lambda: hvd.SyncBatchNorm(2)(torch.ones(3, 2)),
    }
    pair = hvd.ProcessSet([0, 1])
    ops["process_set"] = lambda: hvd.allreduce(torch.ones(1), process_set=pair)
    seen = []
    for i, (name, op) in enumerate(ops.items()):
        if name == "process_set":  # both form the set's group first; then only rank 0 uses it
            hvd.barrier(process_set=pair)
        if rank == 0:
            number = rt.round
            timer = threading.Timer(0.2, rt._aborted.__setitem__, (number, f"injected during {name}"))
            timer.start()
            try:
                op()
            except hvd.HorovodInternalError as exc:
                if "injected" in str(exc):
                    seen.append(name)
            timer.join()
        gloo_world.reform(rank, size, workdir / f"store_{i}")
    return seen


@pytest.mark.timeout(180)
def test_every_new_operation_gives_up_when_its_round_is_aborted(tmp_path: Path) -> None:
    seen = gloo_world.run_world(HERE, "abort_world", 2, tmp_path, timeout=150, collective_timeout=20)[0]
    assert seen == ["allreduce", "grouped_allreduce", "adasum", "allgather", "grouped_allgather", "broadcast",
                    "alltoall", "reducescatter", "grouped_reducescatter", "join", "sync_batch_norm", "process_set"]
