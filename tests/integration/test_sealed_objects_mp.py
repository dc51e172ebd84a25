"""Pickles over gloo are sealed with the job's secret and checked before they are loaded
(worker/sealing.py), on a real 2-process gloo world.

gloo's connections are not authenticated: a local user who reaches a worker's gloo port first
can write to it. Here rank 0 plays that stranger: it holds another secret, as anyone outside
the job does, and sends a pickle that would create a file when loaded. The receiver must refuse
it with HorovodInternalError (a reset, not a crash) and never load it."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gloo_world  # noqa: E402

HERE = str(Path(__file__).resolve())
pytestmark = pytest.mark.timeout(180)


class Planted:
    """Loading it creates ``path``: what a stranger's pickle could do, harmlessly."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


def _as_stranger() -> None:
    from elasticrun.common.auth import WorkerKeys
    from elasticrun.worker import client

    client._keys = WorkerKeys(secret=b"not-the-job-secret".ljust(32, b"!"), server_public=b"", client_public=b"",
                              client_secret=b"")


def refused(rank: int, size: int, workdir: Path) -> dict[str, Any]:
    import elasticrun.torch as hvd

    out: dict[str, Any] = {}
    # The job's own objects go through, small (in the first message) and large (in a second).
    out["small"] = hvd.broadcast_object({"epoch": 3} if rank == 0 else None, 0, name="ok.small")
    out["large"] = len(hvd.broadcast_object(b"x" * 100_000 if rank == 0 else None, 0, name="ok.large"))
    out["gathered"] = hvd.allgather_object(rank * 10, name="ok.gather")
    for case in ("small", "large"):
        marker = str(workdir / f"loaded-{case}")
        if rank == 0:
            _as_stranger()
            payload: Any = Planted(marker) if case == "small" else [Planted(marker), b"y" * 100_000]
            hvd.broadcast_object(payload, 0, name=f"bad.{case}")
        else:
            try:
                hvd.broadcast_object(None, 0, name=f"bad.{case}")
                out[f"bad.{case}"] = "loaded"
            except hvd.HorovodInternalError as exc:
                out[f"bad.{case}"] = str(exc)
        out[f"marker.{case}"] = os.path.exists(marker)
        _restore_job_keys()
    if rank == 0:
        _as_stranger()
    try:  # (the stranger's own part is harmless here: it would load it itself)
        hvd.allgather_object("from a stranger" if rank == 0 else "fine", name="bad.gather")
        out["bad.gather"] = "loaded"
    except hvd.HorovodInternalError as exc:
        out["bad.gather"] = str(exc)
    return out


def _restore_job_keys() -> None:
    from elasticrun.common.auth import WorkerKeys
    from elasticrun.worker import client

    client._keys = WorkerKeys(secret=b"gloo-world-secret".ljust(32, b"."), server_public=b"", client_public=b"",
                              client_secret=b"")


def test_a_pickle_without_the_jobs_seal_is_refused_before_it_is_loaded(tmp_path):
    stranger, receiver = gloo_world.run_world(HERE, "refused", 2, tmp_path)
    assert receiver["small"] == {"epoch": 3} and receiver["large"] == 100_000
    assert receiver["gathered"] == stranger["gathered"] == [0, 10]
    for case in ("small", "large"):
        assert "do not carry the job's seal" in receiver[f"bad.{case}"], receiver[f"bad.{case}"]
        assert "not unpickled" in receiver[f"bad.{case}"]
    # allgather_object: each rank checks every part; the stranger's own part is refused on
    # rank 1, and rank 1's (sealed with the real secret) on rank 0, which holds another.
    assert "do not carry the job's seal" in receiver["bad.gather"], receiver["bad.gather"]
    assert "do not carry the job's seal" in stranger["bad.gather"], stranger["bad.gather"]
    assert not receiver["marker.small"] and not receiver["marker.large"]
    assert not (tmp_path / "loaded-small").exists() and not (tmp_path / "loaded-large").exists()
