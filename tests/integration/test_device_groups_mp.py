"""The device-group seam on CPU (tests/gloo_world.py): what carries a tensor is decided per
tensor, the round's second group is formed at its first use, aborted (never waited on) when the
round ends or is aborted, and every collective gives the same results over it.

No GPU here, so the seam is driven with a stand-in: float64 tensors play the CUDA tensors, and
the "NCCL" group is a second gloo group made by the same code path (``devices.new_nccl`` and
``devices.connect`` replaced). Everything above the seam (routing in the collectives, the join
mirror, process sets, formation on the round's store, aborts by the runtime) is the real code.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gloo_world  # noqa: E402

HERE = str(Path(__file__).resolve())
pytestmark = pytest.mark.timeout(240)


def _stand_in() -> dict[str, list[Any]]:
    """Replace NCCL by gloo and CUDA tensors by float64 ones; record formations and aborts."""
    from datetime import timedelta

    import torch.distributed as dist

    from elasticrun.worker import devices, runtime

    seen: dict[str, list[Any]] = {"formed": [], "aborted": []}
    devices.is_device_tensor = lambda t: t.dtype == torch.float64
    devices.kind_device = lambda kind: torch.device("cpu")

    def new_nccl(store: Any, rank: int, size: int, timeout: float) -> Any:
        pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=timeout))
        seen["formed"].append((runtime.get().round, rank, size))
        return pg

    devices.new_nccl = new_nccl
    devices.connect = lambda pg, device: None
    real_abort = devices.abort_soon
    devices.abort_soon = lambda pg, why="": (seen["aborted"].append(why), real_abort(pg, why))
    return seen


def _nccl_round() -> Any:
    from elasticrun.worker import runtime

    r = runtime.get().current_round
    r.device_backend = "nccl"
    return r


def device_world(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd

    seen = _stand_in()
    r = _nccl_round()
    out: dict[str, Any] = {}
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * rank  # "on the GPU"
    c = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * rank  # on the CPU
    out["before"] = len(seen["formed"])
    out["sum"] = hvd.allreduce(x, op=hvd.Sum)
    out["formed_after_first"] = len(seen["formed"])
    out["cpu_sum"] = hvd.allreduce(c, op=hvd.Sum)  # gloo, interleaved
    out["avg"] = hvd.allreduce(x)
    out["grouped"] = hvd.grouped_allreduce([x, c, x * 2], op=hvd.Sum)
    out["broadcast"] = hvd.broadcast(x, root_rank=1)
    out["allgather"] = hvd.allgather(torch.full((1 + rank, 2), float(rank), dtype=torch.float64))
    out["alltoall"] = hvd.alltoall(torch.arange(4, dtype=torch.float64) + 100 * rank, splits=[1, 3] if rank == 0
                                   else [2, 2])
    out["reducescatter"] = hvd.reducescatter(torch.ones(4, 2, dtype=torch.float64) * (rank + 1), op=hvd.Sum)
    sparse = torch.sparse_coo_tensor([[rank]], torch.tensor([1.5 + rank], dtype=torch.float64), (3,))
    out["sparse"] = hvd.sparse_allreduce_async(sparse, name="s", op=hvd.Sum)().coalesce().to_dense()
    out["adasum"] = hvd.allreduce(torch.tensor([1.0, 0.0], dtype=torch.float64) if rank == 0
                                  else torch.tensor([0.0, 1.0], dtype=torch.float64), op=hvd.Adasum)
    ps = hvd.add_process_set([0, 1])
    out["ps_sum"] = hvd.allreduce(x, op=hvd.Sum, process_set=ps)
    # A rank out of data mirrors the others' device collectives on the device group too.
    if rank == 1:
        out["last_joined"] = hvd.join()
    else:
        out["joined_sum"] = hvd.allreduce(x, op=hvd.Sum)
        out["last_joined"] = hvd.join()
    out["formed"] = list(seen["formed"])
    out["groups"] = sorted(r.device_groups)
    # The next round: the old device groups are aborted, a new one forms at its first use.
    gloo_world.reform(rank, size, workdir / "store1")
    _nccl_round()
    out["aborted_at_reform"] = list(seen["aborted"])
    out["sum2"] = hvd.allreduce(x, op=hvd.Sum)
    out["formed2"] = list(seen["formed"])
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return gloo_world.run_world(HERE, "device_world", 2, tmp_path_factory.mktemp("devices"), timeout=180)


def test_device_tensors_form_the_rounds_second_group_at_first_use_once(world: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(world):
        assert out["before"] == 0 and out["formed_after_first"] == 1
        # the round's own, and the process set's: one each, however many operations ran
        assert sorted(out["formed"]) == [(1, rank, 2), (1, rank, 2)]  # gloo_world's first round is 1
        assert out["groups"] == [(), (0, 1)]


def test_every_collective_gives_the_same_results_over_the_device_group(world: list[dict[str, Any]]) -> None:
    x = [torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * r for r in range(2)]
    c = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + 10 * r for r in range(2)]
    for rank, out in enumerate(world):
        assert torch.equal(out["sum"], x[0] + x[1]) and out["sum"].dtype == torch.float64
        assert torch.equal(out["cpu_sum"], c[0] + c[1])
        assert torch.allclose(out["avg"], (x[0] + x[1]) / 2)
        g = out["grouped"]
        assert torch.equal(g[0], x[0] + x[1]) and torch.equal(g[1], c[0] + c[1]) and torch.equal(g[2], 2 * (x[0] + x[1]))
        assert torch.equal(out["broadcast"], x[1])
        assert out["allgather"].tolist() == [[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]
        received = out["alltoall"][0].tolist()
        assert received == ([0.0, 100.0, 101.0] if rank == 0 else [1.0, 2.0, 3.0, 102.0, 103.0])
        assert torch.equal(out["reducescatter"], torch.full((2, 2), 3.0, dtype=torch.float64))
        assert out["sparse"].tolist() == [1.5, 2.5, 0.0]
        assert torch.allclose(out["adasum"], torch.tensor([1.0, 1.0], dtype=torch.float64))
        assert torch.equal(out["ps_sum"], x[0] + x[1])
        assert out["last_joined"] == 0
    assert torch.equal(world[0]["joined_sum"], x[0])  # rank 1 joined: it contributed zeros


def test_a_round_change_aborts_the_old_device_groups_and_forms_new_ones(world: list[dict[str, Any]]) -> None:
    for rank, out in enumerate(world):
        assert out["aborted_at_reform"] == ["round 1 is over", "round 1 is over"]
        assert torch.equal(out["sum2"], world[0]["sum"])
        assert out["formed2"][-1] == (2, rank, 2) and len(out["formed2"]) == 3


def abort_world(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """Rank 0 waits in a device collective that rank 1 never starts; the driver's abort comes
    0.3 s later: the collective gives up, and the round's device group is aborted at once."""
    import elasticrun.torch as hvd
    from elasticrun.worker import runtime

    seen = _stand_in()
    _nccl_round()
    rt = runtime.get()
    hvd.allreduce(torch.ones(2, dtype=torch.float64))  # formed and working
    out: dict[str, Any] = {}
    if rank == 0:
        timer = threading.Timer(0.3, rt._abort, (rt.round, "injected: a peer died"))
        timer.start()
        started = time.monotonic()
        try:
            hvd.allreduce(torch.ones(2, dtype=torch.float64), name="never")
        except hvd.HorovodInternalError as exc:
            out["error"] = str(exc)
        out["seconds"] = time.monotonic() - started
        out["aborted"] = list(seen["aborted"])
    else:
        time.sleep(1.5)
    return out


def test_an_aborted_round_gives_up_its_device_collective_and_aborts_the_group(tmp_path: Path) -> None:
    out = gloo_world.run_world(HERE, "abort_world", 2, tmp_path, timeout=120, collective_timeout=20)[0]
    assert "round 1 was aborted (injected: a peer died)" in out["error"], out
    assert out["seconds"] < 5, out
    assert out["aborted"] == ["round 1 aborted"], out


def stuck_formation_world(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """Rank 0's formation hangs as NCCL's blocking init does when a peer was lost during it;
    the driver's abort comes: the worker says, once the formation has outlived the abort by
    FORMATION_STUCK_AFTER, that it cannot leave the round and what to do. (Here the formation
    is let go after that, and gives up as an aborted one.)"""
    import logging

    import elasticrun.torch as hvd
    from elasticrun.worker import devices, runtime

    _stand_in()
    _nccl_round()
    rt = runtime.get()
    runtime.FORMATION_STUCK_AFTER = 0.5
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("elasticrun.worker").addHandler(handler)
    release = threading.Event()
    out: dict[str, Any] = {}
    if rank == 0:
        devices.connect = lambda pg, device: release.wait(30)
    threading.Timer(0.3, rt._abort, (rt.round, "injected: a peer died")).start()
    started = time.monotonic()
    if rank == 0:
        def watch() -> None:
            while not any("still inside NCCL's group formation" in line for line in lines):
                if time.monotonic() - started > 20:
                    break
                time.sleep(0.05)
            out["said_after"] = time.monotonic() - started
            release.set()

        threading.Thread(target=watch, daemon=True).start()
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.float64), name="stuck")
    except hvd.HorovodInternalError as exc:
        out["error"] = str(exc)
    out["lines"] = [line for line in lines if "NCCL" in line]
    return out


def test_a_formation_stuck_in_an_aborted_round_says_so_and_what_to_do(tmp_path: Path) -> None:
    """A peer lost while NCCL's group formed hangs the others' formation (NCCL cannot abort a
    blocking init): the rank said nothing, and the driver only waited for it."""
    outs = gloo_world.run_world(HERE, "stuck_formation_world", 2, tmp_path, timeout=120, collective_timeout=20)
    stuck, other = outs
    assert "round 1 was aborted: injected: a peer died" in stuck["error"], stuck
    assert 0.7 < stuck["said_after"] < 5, stuck
    [line] = stuck["lines"]
    assert "rank 0 is still inside NCCL's group formation of round 1" in line, line
    assert "Kill it (pid" in line and "injected: a peer died" in line, line
    assert "round 1 was aborted" in other["error"] and other["lines"] == [], other


def duplicate_gpu_world(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    """Every formation fails as NCCL fails for two ranks on one GPU (ranks in the message
    differ from round to round); one success in between starts the count anew."""
    import elasticrun.torch as hvd
    from elasticrun.worker import devices, exceptions

    seen = _stand_in()
    formed = devices.new_nccl
    fail = {"on": True}

    def new_nccl(store: Any, rank_: int, size_: int, timeout: float) -> Any:
        if fail["on"]:
            raise RuntimeError(f"NCCL error: invalid usage\nLast error:\nDuplicate GPU detected : rank {rank_} and rank "
                               f"{1 - rank_} both on CUDA device 1000")
        return formed(store, rank_, size_, timeout)

    devices.new_nccl = new_nccl
    errors: list[str] = []
    for n, pattern in enumerate(("fail", "fail", "ok", "fail", "fail", "fail")):
        fail["on"] = pattern == "fail"
        gloo_world.reform(rank, size, workdir / f"round{n}")
        _nccl_round()
        try:
            hvd.allreduce(torch.ones(2, dtype=torch.float64))
            errors.append("ok")
        except exceptions.DeviceGroupError as exc:
            errors.append(f"fatal: {exc}")
        except hvd.HorovodInternalError as exc:
            errors.append(f"retry: {exc}")
    return {"errors": errors, "formed": len(seen["formed"])}


def test_a_group_that_fails_to_form_the_same_way_three_rounds_in_a_row_ends_the_worker(tmp_path: Path) -> None:
    """Two ranks on one GPU (a script that skips set_device, or changes CUDA_VISIBLE_DEVICES)
    fail NCCL's formation in every round: each failure restored, re-formed the same round and
    failed again, and the job reset forever without a word the user could act on."""
    for out in gloo_world.run_world(HERE, "duplicate_gpu_world", 2, tmp_path, timeout=120):
        kinds = [e.split(":")[0] for e in out["errors"]]
        assert kinds == ["retry", "retry", "ok", "retry", "retry", "fatal"], out
        assert "Duplicate GPU detected" in out["errors"][1], out
        fatal = out["errors"][-1]
        assert "in 3 rounds in a row" in fatal and "Duplicate GPU detected" in fatal, fatal
        assert "torch.cuda.set_device(hvd.local_rank())" in fatal, fatal
        assert out["formed"] == 1, out
