"""``import elasticrun.torch as hvd``: the horovod.torch API on elasticrun.

A Horovod elastic PyTorch script runs unchanged apart from its import line.
"""

from __future__ import annotations

import types

from elasticrun.worker import rounds as _rounds
from elasticrun.worker import runtime as _runtime
from elasticrun.worker.collectives import (  # noqa: F401  (re-exported API)
    Average,
    Handle,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async_,
    broadcast_object,
    poll,
    synchronize,
)
from elasticrun.worker.broadcast import broadcast_optimizer_state, broadcast_parameters
from elasticrun.worker.elastic import ObjectState, State, run
from elasticrun.worker.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from elasticrun.worker.optimizer import Compression, DistributedOptimizer
from elasticrun.worker.sampler import ElasticSampler
from elasticrun.worker.torch_state import TorchState


def init() -> None:
    """Join the job: connect to the driver and form the first round's process group."""
    _runtime.init()


def shutdown() -> None:
    _runtime.shutdown()


def is_initialized() -> bool:
    return _runtime.is_initialized()


def rank() -> int:
    return _rounds.current().rank


def size() -> int:
    return _rounds.current().size


def local_rank() -> int:
    return _runtime.get().local_rank


def local_size() -> int:
    return _runtime.get().local_size


def cross_rank() -> int:
    return _runtime.get().cross_rank


def cross_size() -> int:
    return _runtime.get().cross_size


def gloo_enabled() -> bool:
    return True


def mpi_enabled() -> bool:
    return False


#: ``hvd.elastic.run``, ``hvd.elastic.TorchState``, ... as in ``horovod.torch.elastic``.
elastic = types.SimpleNamespace(
    run=run, State=State, ObjectState=ObjectState, TorchState=TorchState, ElasticSampler=ElasticSampler,
    HorovodInternalError=HorovodInternalError, HostsUpdatedInterrupt=HostsUpdatedInterrupt,
)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "allgather", "broadcast", "broadcast_",
    "broadcast_async_", "broadcast_object", "allgather_object", "barrier", "poll", "synchronize", "Handle",
    "Average", "Sum", "Min", "Max", "Product", "ReduceOp", "elastic", "HorovodInternalError",
    "HostsUpdatedInterrupt", "DistributedOptimizer", "Compression", "broadcast_parameters",
    "broadcast_optimizer_state", "ElasticSampler", "TorchState", "ObjectState", "State", "run",
]
