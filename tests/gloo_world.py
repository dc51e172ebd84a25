"""Real multi-process gloo worlds for tests, without the driver.

Each spawned process creates the runtime in standalone mode and then swaps in a
FileStore-backed ``ProcessGroupGloo`` of the requested rank and size, which is all the
collectives and the DistributedOptimizer look at. :func:`reform` enters the next round the
way a reset would (new group, new size).

Scenario functions run in the children: ``run_world`` loads them from their source file
by path, so this works whatever import mode pytest uses.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from elasticrun.common import env
from elasticrun.common.auth import WorkerKeys
from elasticrun.worker import client, runtime


def join(rank: int, size: int, store_file: str | Path, timeout: float = 30.0) -> runtime.Runtime:
    """Init the standalone runtime, then make it rank ``rank`` of a ``size``-rank gloo world."""
    for name in list(os.environ):
        if name.startswith("ELASTICRUN_") and name != env.LOG_LEVEL:
            del os.environ[name]
    rt = runtime.init()
    rt.collective_timeout = timeout
    # The driver hands every worker the job's keys; pickles over gloo are sealed with its
    # secret (worker/sealing.py). Every rank of a test world gets the same one.
    client._keys = WorkerKeys(secret=b"gloo-world-secret".ljust(32, b"."), server_public=b"", client_public=b"",
                              client_secret=b"")
    return reform(rank, size, store_file)


def reform(rank: int, size: int, store_file: str | Path) -> runtime.Runtime:
    """Replace the runtime's round as a reset does: the next round, with a new group (new store)."""
    rt = runtime.get()
    store = dist.FileStore(str(store_file), size)
    pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=rt.collective_timeout))
    rt.enter_round(rt.round + 1, rank, size, pg, store)  # the old group is released in the background
    return rt


def _load(path: str, name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"_gloo_world_scenarios_{Path(path).stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return getattr(module, name)


def _child(rank: int, size: int, path: str, name: str, workdir: str, timeout: float) -> None:
    try:
        torch.set_num_threads(1)  # the test machine is small and shared
        join(rank, size, Path(workdir) / "store0", timeout)
        result = _load(path, name)(rank, size, Path(workdir))
        torch.save(result, Path(workdir) / f"result{rank}.pt")
    except BaseException:
        (Path(workdir) / f"error{rank}.txt").write_text(traceback.format_exc())
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown: a group whose peer already left may block it


def run_world(path: str | Path, name: str, size: int, workdir: Path, timeout: float = 90.0,
              collective_timeout: float = 20.0) -> list[Any]:
    """Run ``name(rank, size, workdir)`` from the file ``path`` on ``size`` spawned ranks
    and return each rank's result; raise with the children's tracebacks if any failed.
    Every child is joined, or killed once ``timeout`` seconds have passed."""
    import time

    workdir.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(r, size, str(path), name, str(workdir), collective_timeout),
                         daemon=True) for r in range(size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        errors = {r: (workdir / f"error{r}.txt").read_text() for r in range(size)
                  if (workdir / f"error{r}.txt").exists()}
        if errors or hung or any(p.exitcode != 0 for p in procs):
            detail = "\n".join(f"--- rank {r}:\n{text}" for r, text in sorted(errors.items()))
            raise AssertionError(f"world {name!r} failed: exit codes {[p.exitcode for p in procs]}, "
                                 f"still running after {timeout:g} s: {hung}\n{detail}")
        return [torch.load(workdir / f"result{r}.pt", weights_only=False) for r in range(size)]
    finally:
        for p in procs:
            if p.pid is None:  # never started
                continue
            if p.is_alive():
                p.kill()
            p.join(5)
