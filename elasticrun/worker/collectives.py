"""Collectives on the current round's process group, with horovod.torch's semantics: the
public face of the op families, which ``elasticrun.torch`` and the rest of the worker use.

Every collective is issued asynchronously and then waited on by polling
(``worker/waiting.py``, with the handles of collectives in flight), because a blocked gloo
collective cannot be interrupted (gloo's abort() does not unblock it): polling lets a
worker give up the moment the driver says the round is dead, or when the collective timeout
passes. Either way the caller gets :class:`HorovodInternalError`, never a hang or a crash.
CUDA tensors go over the round's NCCL group when the round has one (``worker/devices.py``):
their works are polled the same way, and a NCCL communicator left behind by a dead peer is
aborted by the runtime when the round ends, never waited on.

Each operation looks the current :class:`~elasticrun.worker.rounds.Round` up once and takes
everything from it: the process group, rank and size, the abort check, the timeout, and the
first-step event after a reset. ``process_set=`` runs an operation on a process set's own
group instead (``worker/process_sets.py``).

Where each piece lives (a new collective goes into its family, issues through
``issuing.issue`` with a descriptor class of ``descriptors.py``, and gets a mirror in
``join.py``: ``tests/unit/test_join_descriptors.py`` fails until it has one):

* ``issuing.py``: the op constants, issuing with descriptors, process sets' groups, the
  agreement of arguments, and the small gathers the agreement reports a mismatch with;
* ``reductions.py``: allreduce (single, grouped, sparse), Adasum, reducescatter, barrier;
* ``gathers.py``: allgather (single, grouped) and alltoall;
* ``broadcast.py``: a tensor, an object, a model's and an optimizer's state;
* ``waiting.py``: waiting, handles, and publishing operations to a rank in ``join()``.
"""

from __future__ import annotations

from elasticrun.worker.broadcast import broadcast_, broadcast_async, broadcast_async_, broadcast_object
from elasticrun.worker.gathers import allgather_async, alltoall_async, grouped_allgather, grouped_allgather_async
from elasticrun.worker.issuing import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    UnsupportedOperation,
    agree,
    allgather_object,
    allgather_same,
    issue,
    op_value,
)
from elasticrun.worker.reductions import (
    allreduce_,
    allreduce_async,
    allreduce_async_,
    allreduce_inplace,
    barrier,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    reducescatter_async,
    sparse_allreduce_async,
)
from elasticrun.worker.waiting import Handle, join_key, poll, synchronize, wait

__all__ = [
    "Adasum", "Average", "Handle", "Max", "Min", "Product", "ReduceOp", "Sum", "UnsupportedOperation", "agree",
    "allgather_async", "allgather_object", "allgather_same", "allreduce_", "allreduce_async", "allreduce_async_",
    "allreduce_inplace", "alltoall_async", "barrier", "broadcast_", "broadcast_async", "broadcast_async_",
    "broadcast_object", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter_async", "issue", "join_key",
    "op_value", "poll", "reducescatter_async", "sparse_allreduce_async", "synchronize", "wait",
]
