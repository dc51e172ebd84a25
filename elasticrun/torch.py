"""``import elasticrun.torch as hvd``: the horovod.torch API on elasticrun.

A Horovod PyTorch script (elastic or not) runs unchanged apart from its import line. Every
public name of ``horovod.torch`` is here except what needs MPI or a GPU vendor library; the
table in docs/porting-from-horovod.md lists them all (tests/compat checks it).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from elasticrun.worker import collectives as _collectives
from elasticrun.worker import rounds as _rounds
from elasticrun.worker import runtime as _runtime
from elasticrun.worker import trace as _trace
from elasticrun.worker.broadcast import broadcast_optimizer_state, broadcast_parameters
from elasticrun.worker.collectives import (
    Adasum,
    Average,
    Handle,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather_async,
    allgather_object,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall_async,
    barrier,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    grouped_allgather_async,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    poll,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)
from elasticrun.worker.elastic import ObjectState, State, run
from elasticrun.worker.agreement import CollectiveMismatch
from elasticrun.worker.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from elasticrun.worker.autograd import (
    allgather,
    allreduce,
    alltoall,
    broadcast,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    reducescatter,
)
from elasticrun.worker.join import join
from elasticrun.worker.optimizer import Compression, DistributedOptimizer
from elasticrun.worker.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from elasticrun.worker.sampler import ElasticSampler
from elasticrun.worker.sync_batch_norm import SyncBatchNorm
from elasticrun.worker.torch_state import TorchState


def init(comm: Sequence[int] | None = None, process_sets: Sequence[ProcessSet] | str | None = None) -> None:
    """Join the job: connect to the driver and form the first round's process group.

    ``process_sets``: process sets to register (as ``add_process_set`` would), or
    ``"dynamic"`` (accepted: sets can always be added later). ``comm`` (an MPI communicator
    or a list of ranks) is refused: elasticrun's world is the job's, without MPI.
    """
    if comm is not None:
        raise ValueError("hvd.init(comm=...) needs MPI; elasticrun's world is every worker of the job "
                         "(use a ProcessSet for a subset of ranks)")
    _runtime.init()
    if process_sets is not None and not isinstance(process_sets, str):
        for ps in process_sets:
            if ps.process_set_id is None:
                add_process_set(ps)


def shutdown() -> None:
    """Leave the job (elastic.run's workers do it at exit)."""
    _runtime.shutdown()


def is_initialized() -> bool:
    return _runtime.is_initialized()


def rank() -> int:
    """This worker's rank in the current round (a worker joining a running job: the rank it
    was launched for, until its first collective or sync takes its place)."""
    return _rounds.placed().rank


def size() -> int:
    """The number of workers in the current round (a worker joining a running job: the size
    it was launched for, until its first collective or sync takes its place)."""
    return _rounds.placed().size


def local_rank() -> int:
    return _runtime.get().local_rank


def local_size() -> int:
    return _runtime.get().local_size


def cross_rank() -> int:
    return _runtime.get().cross_rank


def cross_size() -> int:
    return _runtime.get().cross_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of workers in this round (Horovod's meaning).
    As Horovod's, a value the worker holds (the driver sends it with each round's ranks), not a
    collective: a script may ask on one rank alone."""
    return bool(_runtime.get().homogeneous)


def process_group() -> Any:
    """The current round's gloo ``ProcessGroup``, for ``torch.distributed`` calls:
    ``torch.distributed.all_reduce(t, group=hvd.process_group())``. It is replaced at every
    reset: look it up again after one (in a reset callback), never keep it."""
    pg = _rounds.current().pg
    if pg is None:
        raise HorovodInternalError("no process group: the last reset did not complete")
    return pg


def gloo_enabled() -> bool:
    """True: every collective runs over gloo."""
    return True


def gloo_built() -> bool:
    return True


def mpi_enabled() -> bool:
    """False: there is no MPI here."""
    return False


def mpi_built() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """False: there is no MPI (Horovod raises ValueError when MPI is not enabled; a truthful
    False lets scripts that only branch on it run)."""
    return False


def nccl_built() -> int:
    """What torch reports: NCCL's version code if torch has NCCL, else 0 (as Horovod's).
    elasticrun's collectives use it for CUDA tensors where the round agreed on it (--backend)."""
    if not dist.is_nccl_available():
        return 0
    try:
        major, minor, patch = torch.cuda.nccl.version()[:3]  # (4 with a suffix: (2, 27, 3, 'a0'))
    except Exception:
        return 0
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """Whether torch was built with CUDA (gloo then also moves CUDA tensors, through host memory)."""
    return bool(torch.backends.cuda.is_built())


def rocm_built() -> bool:
    return torch.version.hip is not None


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome trace of the collectives into ``file_path`` (see worker/trace.py), written
    as it goes and closed at :func:`stop_timeline` or exit, by rank 0 alone, as Horovod's
    (``{rank}`` in the path: by every rank, to its own file). ``mark_cycles``: also mark every ``state.commit()``. Works
    before and after ``init()``."""
    _trace.start(file_path, mark_cycles)


def stop_timeline() -> None:
    _trace.stop()


#: ``hvd.elastic.run``, ``hvd.elastic.TorchState``, ... as in ``horovod.torch.elastic``; a module
#: of its own (``elasticrun.torch.elastic``), so that ``from horovod.torch.elastic import
#: ElasticSampler, TorchState`` ports by its import line too.
elastic = types.ModuleType(f"{__name__}.elastic", "horovod.torch.elastic's names, on elasticrun.")
elastic.__dict__.update(
    run=run, State=State, ObjectState=ObjectState, TorchState=TorchState, ElasticSampler=ElasticSampler,
    HorovodInternalError=HorovodInternalError, HostsUpdatedInterrupt=HostsUpdatedInterrupt, init=init,
    shutdown=shutdown,
    __all__=["run", "State", "ObjectState", "TorchState", "ElasticSampler", "HorovodInternalError",
             "HostsUpdatedInterrupt", "init", "shutdown"],
)
sys.modules[elastic.__name__] = elastic

__all__ = [
    "Adasum",
    "Average",
    "CollectiveMismatch",
    "Compression",
    "DistributedOptimizer",
    "ElasticSampler",
    "Handle",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ObjectState",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "State",
    "Sum",
    "SyncBatchNorm",
    "TorchState",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "process_group",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "run",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
