"""Variable-size allgather (with agreed capacities, worker/capacities.py) and alltoall on a
real 3-process gloo world: repeated calls whose row counts repeat, grow, shrink, vanish and
differ per rank and per pair, every dtype (those gloo refuses travel as bytes), process sets,
sparse allreduce, and a rank in ``join()`` while the others' counts change (then every rank
goes on with the same keys).

Every result is checked against what the rows must be; the number of gloo operations each
allgather issued shows which path it took (a repeated shape: the counts beside the rows, 2;
a count past its capacity: one more).
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
pytestmark = pytest.mark.timeout(240)

#: Row counts of rank 0, 1, 2 in successive allgathers of one key.
GATHER_COUNTS = [(3, 3, 3), (3, 3, 3), (5, 2, 3), (1, 4, 0), (0, 0, 0), (4, 4, 4), (6, 1, 2), (6, 1, 2)]
#: alltoall send matrices, [sender][receiver], in successive calls of one key.
ALLTOALL = [
    ((1, 2, 0), (0, 1, 1), (2, 2, 2)),
    ((1, 2, 0), (0, 1, 1), (2, 2, 2)),  # repeated: the fast path
    ((1, 3, 0), (0, 1, 1), (2, 2, 2)),  # rank 0 sends more to rank 1 only
    ((0, 0, 0), (0, 0, 0), (0, 0, 0)),
    ((4, 0, 1), (1, 1, 5), (0, 3, 0)),
    ((4, 0, 1), (1, 1, 5), (0, 3, 0)),
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64, torch.bool,
          torch.complex64, torch.int16]


def rows(rank: int, call: int, n: int, rest: tuple[int, ...] = (2,), dtype: torch.dtype = torch.float32
         ) -> torch.Tensor:
    """``n`` rows that say who sent them, in which call, and which row they are."""
    base = torch.arange(n * max(1, int(torch.tensor(rest).prod().item())), dtype=torch.float64)
    t = (base + 1000 * rank + 100 * call).view((n,) + rest)
    if dtype == torch.bool:
        return (t.long() % 3 == 0)
    if dtype.is_complex:
        return torch.complex(t, -t).to(dtype)
    if dtype == torch.int8:
        return (t.long() % 100).to(dtype)
    return t.to(dtype)


def calls(fn: Any) -> tuple[Any, int]:
    """fn's result and how many operations it issued on the round's group."""
    from elasticrun.worker import rounds

    before = rounds.current().calls
    result = fn()
    return result, rounds.current().calls - before


def scenario(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd

    out: dict[str, Any] = {}
    out["gather"] = [calls(lambda: hvd.allgather(rows(rank, c, counts[rank]), name="g"))
                     for c, counts in enumerate(GATHER_COUNTS)]
    # a 0-dim tensor is one row, as in Horovod
    out["scalar"] = [hvd.allgather(torch.tensor(float(rank + c))) for c in range(2)]
    out["dtypes"] = {str(dt): [hvd.allgather(rows(rank, c, (c + rank) % 3, (3,), dt)) for c in range(3)]
                     for dt in DTYPES}
    out["dtypes_alltoall"] = {str(dt): hvd.alltoall(rows(rank, 0, 3, (2,), dt), splits=[1, 1, 1]) for dt in DTYPES}
    out["grouped"] = [calls(lambda: hvd.grouped_allgather(
        [rows(rank, c, c + rank, (2,)), rows(rank, c, 2, (), torch.int64), rows(rank, c, 3 - c, (1, 2))]))
        for c in range(4)]
    out["alltoall"] = [calls(lambda: hvd.alltoall(rows(rank, c, sum(m[rank]), (2,)), splits=list(m[rank]),
                                                  name="a"))
                       for c, m in enumerate(ALLTOALL)]
    out["alltoall_even"] = [hvd.alltoall(rows(rank, c, 3 * (1 + c + rank), (1,))) for c in range(3)]
    try:  # as Horovod: without splits, the first dimension must divide by the size
        hvd.alltoall(rows(rank, 0, 4, (1,)))
    except ValueError as exc:
        out["alltoall_uneven"] = str(exc)
    pair = hvd.add_process_set([0, 2])
    if rank in (0, 2):
        me = 0 if rank == 0 else 1
        out["set_gather"] = [hvd.allgather(rows(rank, c, c * (me + 1)), process_set=pair) for c in range(3)]
        out["set_alltoall"] = [hvd.alltoall(rows(rank, c, 2 + c, (2,)), splits=[c, 2] if me == 0 else [2, c],
                                            process_set=pair) for c in range(3)]
    hvd.barrier()
    sparse = []
    for c in range(3):
        nnz = 2 + c * (rank + 1)
        idx = torch.arange(nnz).view(1, nnz) * (rank + 1)
        sparse.append(hvd.sparse_allreduce_async(torch.sparse_coo_tensor(idx, torch.ones(nnz), (40,)), "s",
                                                 hvd.Sum)().to_dense())
    out["sparse"] = sparse

    # join: rank 2 is out of data; ranks 0 and 1 gather and exchange rows of changing counts
    # (past their capacities, too) while it answers with none; then all three go on.
    joined: dict[str, Any] = {"gather": [], "alltoall": []}
    if rank < 2:
        for c, n in enumerate([3, 5, 5, 1]):
            joined["gather"].append(hvd.allgather(rows(rank, c, n + rank), name="g"))
        for c, m in enumerate([(1, 1, 0), (2, 3, 0), (2, 3, 0)]):
            send = m if rank == 0 else (m[1], m[0], 0)
            joined["alltoall"].append(hvd.alltoall(rows(rank, c, sum(send), (2,)), splits=list(send), name="a"))
    joined["last"] = hvd.join()
    joined["after_gather"] = [hvd.allgather(rows(rank, c, 2 + rank + c), name="g") for c in range(3)]
    joined["after_alltoall"] = [hvd.alltoall(rows(rank, c, 3 * (c + 1), (2,)), splits=[c + 1] * 3, name="a")
                                for c in range(3)]
    out["join"] = joined
    hvd.barrier()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return gloo_world.run_world(HERE, "scenario", 3, tmp_path_factory.mktemp("capacities"))


def test_allgather_rows_are_right_whatever_the_counts_do(world: list[dict[str, Any]]) -> None:
    for c, counts in enumerate(GATHER_COUNTS):
        expected = torch.cat([rows(r, c, counts[r]) for r in range(3)])
        for w in world:
            got, _ = w["gather"][c]
            assert torch.equal(got, expected), (c, counts)


def test_a_repeated_shape_sends_its_rows_beside_the_counts(world: list[dict[str, Any]]) -> None:
    issued = [n for _, n in world[0]["gather"]]
    # each begins with the agreement on what every rank submitted (worker/agreement.py); then,
    # first call: the counts, then the rows (no capacity yet); a repeat: counts and rows at
    # once; a count past the capacity: counts, capped rows, the rows past it
    assert issued == [3, 3, 4, 3, 3, 3, 4, 3], issued
    assert all([n for _, n in w["gather"]] == issued for w in world)


def test_scalars_and_every_dtype_gather(world: list[dict[str, Any]]) -> None:
    for c in range(2):
        assert world[1]["scalar"][c].tolist() == [float(r + c) for r in range(3)]
    for dt in DTYPES:
        for c in range(3):
            expected = torch.cat([rows(r, c, (c + r) % 3, (3,), dt) for r in range(3)])
            got = world[2]["dtypes"][str(dt)][c]
            assert got.dtype == dt and torch.equal(got, expected), (dt, c)


def test_every_dtype_goes_through_alltoall(world: list[dict[str, Any]]) -> None:
    for dt in DTYPES:
        for me, w in enumerate(world):
            got, splits = w["dtypes_alltoall"][str(dt)]
            want = torch.cat([rows(s, 0, 3, (2,), dt)[me:me + 1] for s in range(3)])
            assert got.dtype == dt and torch.equal(got, want) and splits.tolist() == [1, 1, 1], (dt, me)


def test_grouped_allgather_shares_one_count_exchange(world: list[dict[str, Any]]) -> None:
    for c in range(4):
        got, issued = world[0]["grouped"][c]
        assert torch.equal(got[0], torch.cat([rows(r, c, c + r, (2,)) for r in range(3)]))
        assert torch.equal(got[1], torch.cat([rows(r, c, 2, (), torch.int64) for r in range(3)]))
        assert torch.equal(got[2], torch.cat([rows(r, c, 3 - c, (1, 2)) for r in range(3)]))
        if c == 0:
            assert issued == 5  # the agreement, the counts, then the rows of each of the three tensors
        else:  # tensor 0 grows every call (capped rows + the rest); the others repeat or shrink
            assert issued == 6, (c, issued)


def expected_alltoall(m: tuple[tuple[int, ...], ...], c: int, me: int) -> tuple[torch.Tensor, list[int]]:
    parts = []
    for sender in range(3):
        sent = rows(sender, c, sum(m[sender]), (2,))
        start = sum(m[sender][:me])
        parts.append(sent[start:start + m[sender][me]])
    return torch.cat(parts), [m[s][me] for s in range(3)]


def test_alltoall_rows_and_received_splits_are_right(world: list[dict[str, Any]]) -> None:
    for c, m in enumerate(ALLTOALL):
        for me, w in enumerate(world):
            (got, splits), _ = w["alltoall"][c]
            want, want_splits = expected_alltoall(m, c, me)
            assert torch.equal(got, want), (c, me)
            assert splits.tolist() == want_splits and splits.dtype == torch.int32


def test_alltoall_learns_the_splits_then_sends_exactly_the_rows(world: list[dict[str, Any]]) -> None:
    # alltoall keeps no capacities: every call is the splits, then the rows (see its docstring)
    assert all([n for _, n in w["alltoall"]] == [2] * len(ALLTOALL) for w in world)


def test_alltoall_without_splits_splits_evenly(world: list[dict[str, Any]]) -> None:
    for c in range(3):
        for me, w in enumerate(world):
            parts = []
            for sender in range(3):
                n = 3 * (1 + c + sender)
                share = n // 3
                parts.append(rows(sender, c, n, (1,))[me * share:(me + 1) * share])
            assert torch.equal(w["alltoall_even"][c], torch.cat(parts)), (c, me)
    for w in world:
        assert "first dimension (4) to be divisible by the number of ranks (3)" in w["alltoall_uneven"]


def test_process_sets_keep_their_own_capacities(world: list[dict[str, Any]]) -> None:
    members = [0, 2]
    for c in range(3):
        want = torch.cat([rows(r, c, c * (i + 1)) for i, r in enumerate(members)])
        for r in members:
            assert torch.equal(world[r]["set_gather"][c], want), (c, r)
        sends = {0: [c, 2], 2: [2, c]}
        for i, r in enumerate(members):
            got, splits = world[r]["set_alltoall"][c]
            parts = []
            for s in members:
                start = sum(sends[s][:i])
                parts.append(rows(s, c, 2 + c, (2,))[start:start + sends[s][i]])
            assert torch.equal(got, torch.cat(parts)) and splits.tolist() == [sends[s][i] for s in members]
    assert "set_gather" not in world[1]


def test_sparse_allreduce_with_changing_nnz(world: list[dict[str, Any]]) -> None:
    for c in range(3):
        dense = torch.zeros(40)
        for r in range(3):
            nnz = 2 + c * (r + 1)
            dense[torch.arange(nnz) * (r + 1)] += 1
        for w in world:
            assert torch.equal(w["sparse"][c], dense), c


def test_a_joined_rank_keeps_the_capacities_agreed(world: list[dict[str, Any]]) -> None:
    for me in range(2):
        j = world[me]["join"]
        for c, n in enumerate([3, 5, 5, 1]):
            assert torch.equal(j["gather"][c], torch.cat([rows(r, c, n + r) for r in range(2)])), (me, c)
        for c, m in enumerate([(1, 1, 0), (2, 3, 0), (2, 3, 0)]):
            sends = [m, (m[1], m[0], 0)]
            got, splits = j["alltoall"][c]
            parts = []
            for s in range(2):
                start = sum(sends[s][:me])
                parts.append(rows(s, c, sum(sends[s]), (2,))[start:start + sends[s][me]])
            assert torch.equal(got, torch.cat(parts)) and splits.tolist() == [sends[0][me], sends[1][me], 0]
    # rank 2 joined first (the others' operations could not complete without it), so it
    # answered every one of them; the last to join is rank 0 or 1, the same for all
    lasts = {w["join"]["last"] for w in world}
    assert len(lasts) == 1 and lasts <= {0, 1}, lasts
    for me, w in enumerate(world):
        j = w["join"]
        for c in range(3):
            assert torch.equal(j["after_gather"][c], torch.cat([rows(r, c, 2 + r + c) for r in range(3)]))
            got, splits = j["after_alltoall"][c]
            parts = [rows(s, c, 3 * (c + 1), (2,))[me * (c + 1):(me + 1) * (c + 1)] for s in range(3)]
            assert torch.equal(got, torch.cat(parts)) and splits.tolist() == [c + 1] * 3
