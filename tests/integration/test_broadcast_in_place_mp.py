"""Large tensors broadcast from and into their own storage (worker/broadcast.py), on a real
2-process gloo world: values exact for every dtype and layout, the receiver's tensors the same
objects and storages, and slices of a tensor larger than one message reassembled in order."""

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


def tensors(rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    wide = torch.randn(700, 1100, generator=g)  # 3.1 MB: in place, in 4 slices of 1 MiB
    return {
        "a.wide": wide,
        # Same shape everywhere, but a transposed layout on rank 1 only (its own strides).
        "b.transposed": torch.randn(600, 500, generator=g) if rank == 0 else torch.randn(500, 600, generator=g).t(),
        "c.mask": torch.rand(1 << 21, generator=g) > 0.5,  # 2 MiB of bool
        "d.half": torch.randn(1 << 20, generator=g).half(),  # 2 MiB of float16
        "e.small": torch.randn(7, generator=g),
        "f.count": torch.tensor(rank * 5 + 3, dtype=torch.int64),
        "g.empty": torch.empty(0, 4),
    }


def in_place(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd
    from elasticrun.worker import broadcast

    broadcast._BCAST_CHUNK_BYTES = 1 << 20
    mine = tensors(rank)
    before = {k: (id(t), t.data_ptr(), t.stride()) for k, t in mine.items()}
    hvd.broadcast_parameters(mine, root_rank=0)
    after = {k: (id(t), t.data_ptr(), t.stride()) for k, t in mine.items()}
    return {"values": {k: t.clone() for k, t in mine.items()}, "kept": before == after}


def test_large_tensors_arrive_exactly_in_their_own_storage(tmp_path):
    root, receiver = gloo_world.run_world(HERE, "in_place", 2, tmp_path)
    expected = tensors(0)
    for rank, result in enumerate((root, receiver)):
        assert result["kept"], rank  # same tensor objects, storages and strides
        for name, want in expected.items():
            got = result["values"][name]
            assert got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), (rank, name)


def after_restore(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """Every rank restores a commit of its own, then (1) a broadcast writes into the live tensors
    of rank 1 and (2) a sync: what each rank names unchanged since the restore, and whether each
    rank's committed copies end up as the root's."""
    import elasticrun.torch as hvd

    torch.manual_seed(rank)  # the ranks' commits differ, as a newcomer's from a survivor's
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024))  # 4 MiB: in place
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()
    state = hvd.elastic.TorchState(model, opt)
    mh = state._handlers["model"]
    state.restore()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    unchanged = sorted(mh.unchanged_since_restore())
    state.restore()
    state.sync()
    committed = {k: b.clone() for k, b in mh._buffers.items()}
    return {"unchanged": unchanged, "committed": committed,
            "live": {k: t.detach().clone() for k, t in model.state_dict().items()}}


def test_what_a_collective_writes_after_a_restore_is_committed_again(tmp_path):
    root, receiver = gloo_world.run_world(HERE, "after_restore", 2, tmp_path)
    every = sorted(root["live"])
    assert root["unchanged"] == every  # the root's broadcast wrote nothing of its own
    assert receiver["unchanged"] == []  # large (in place) and small (packed) tensors were written
    for result in (root, receiver):
        for name in every:
            assert torch.equal(result["live"][name], root["live"][name]), name
            assert torch.equal(result["committed"][name], root["live"][name]), name
