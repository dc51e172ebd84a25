"""What a rank in ``hvd.join()`` needs to take part in an operation of the round's group (pure).

Every operation issued on the round's group carries one of these (``issuing.issue``); a
rank that has joined reads them from the round's store and mirrors each one with tensors that
change nothing (``join.py``). Each kind that can be mirrored is a class here, and ``join.py``
keeps one mirror per class: ``tests/unit/test_join_descriptors.py`` fails when a class has no
mirror, so a new collective cannot forget its join side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = ["Op", "Allreduce", "Broadcast", "Allgather", "Alltoall", "VarAllgather", "VarAlltoall", "PartOf",
           "Unknown", "End"]


@dataclass(frozen=True)
class Op:
    """An operation of the round's group, as the ranks that have not joined issued it."""

    #: Whether a joined rank can take part in it (join.py has a mirror for it).
    mirrored: ClassVar[bool] = True

    @property
    def kind(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class Allreduce(Op):
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype (pickled with the descriptor)
    op: str  # "sum", "min", "max" or "product": what a joined rank contributes depends on it
    #: Where the step's agreement flags (worker/step_flags.py) start in the flat tensor, when it
    #: carries them (a commit's check, the DistributedOptimizer's first bucket): a joined rank
    #: says "busy" there, so that no durable copy is agreed while it holds no shard of the commit.
    flags_at: int | None = None


@dataclass(frozen=True)
class Broadcast(Op):
    shape: tuple[int, ...]
    dtype: Any
    root: int


@dataclass(frozen=True)
class Allgather(Op):
    """A fixed-size allgather (every rank the same shape)."""

    shape: tuple[int, ...]
    dtype: Any


@dataclass(frozen=True)
class Alltoall(Op):
    """A single alltoall whose row counts every rank knows: ``matrix[i][j]`` rows from i to j."""

    rest: tuple[int, ...]
    dtype: Any
    matrix: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class VarAllgather(Op):
    """A grouped allgather of variable first dimensions (several operations: a joined rank runs
    the whole exchange itself, with no rows, on ``rows_on``: "cpu" or "cuda")."""

    name: str | None
    dtypes: tuple[Any, ...]
    rests: tuple[tuple[int, ...], ...]
    rows_on: str


@dataclass(frozen=True)
class VarAlltoall(Op):
    """An alltoall with splits (an exchange of counts, then the rows)."""

    name: str | None
    dtype: Any
    rest: tuple[int, ...]
    rows_on: str


@dataclass(frozen=True)
class PartOf(Op):
    """A later operation of a multi-operation exchange: its first operation's descriptor covers it."""

    mirrored: ClassVar[bool] = False
    of: str


@dataclass(frozen=True)
class Unknown(Op):
    """An operation issued without a descriptor: a joined rank cannot take part in it."""

    mirrored: ClassVar[bool] = False
    what: str


@dataclass(frozen=True)
class End(Op):
    """Not an operation: the last rank to join ends ``join()`` for everyone with its rank."""

    mirrored: ClassVar[bool] = False
    rank: int


@dataclass(frozen=True)
class Interrupted(Op):
    """Not an operation: the ranks that had not joined left the round at a commit for a host
    update (``HostsUpdatedInterrupt``); a joined rank raises it too, with the same ``skip_sync``."""

    mirrored: ClassVar[bool] = False
    skip_sync: bool
