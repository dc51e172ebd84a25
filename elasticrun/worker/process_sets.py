"""Process sets: collectives among some of the ranks (``hvd.ProcessSet``, as in horovod.torch).

A process set is a list of ranks. Elastic rounds renumber and resize the world, so a set is
not tied to one gloo group: in every round, the first collective a member runs on the set
forms a gloo subgroup of the members that still exist (ranks below the round's size; the
others are dropped) on the round's store, keyed by the member list. Only members take part,
so non-members pay nothing, and a set that is no longer used costs nothing either. The
group of a round is released with the round.

Rank arguments of collectives (``root_rank`` of a broadcast) stay global ranks, as in
Horovod; :meth:`ProcessSet.rank` is the position within the set (the order of an allgather).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch.distributed as dist

from elasticrun.worker import rounds
from elasticrun.worker.rounds import Round

__all__ = [
    "ProcessSet",
    "add_process_set",
    "global_process_set",
    "group",
    "members",
    "process_sets",
    "remove_process_set",
]


class ProcessSet:
    """Ranks that run collectives together: ``ProcessSet([0, 2])``; pass it as ``process_set=``.

    Register it with ``hvd.add_process_set`` (or ``hvd.init(process_sets=[...])``) on every
    rank, in the same order, as Horovod requires. MPI communicators are not accepted (there
    is no MPI here).
    """

    def __init__(self, ranks_or_comm: Iterable[int]) -> None:
        if isinstance(ranks_or_comm, (str, bytes)) or not isinstance(ranks_or_comm, Iterable):
            raise ValueError("ProcessSet takes a list of ranks (MPI communicators need MPI, which elasticrun "
                             "does not use)")
        ranks = sorted(set(ranks_or_comm))
        if any(not isinstance(r, int) or isinstance(r, bool) or r < 0 for r in ranks):
            raise ValueError(f"ProcessSet ranks must be non-negative integers, got {list(ranks_or_comm)!r}")
        self.ranks: list[int] | None = ranks
        self.process_set_id: int | None = None
        self.mpi_comm: Any = None

    def _members(self, r: Round) -> tuple[int, ...]:
        if self.ranks is None:
            raise ValueError(f"{self} was removed")
        return tuple(x for x in self.ranks if x < r.size)

    def size(self) -> int | None:
        """Members in the current round (ranks beyond the world's size are dropped)."""
        return len(self._members(rounds.current())) if self.ranks is not None else None

    def rank(self) -> int | None:
        """This process's position within the set (None if it is not a member)."""
        if self.ranks is None:
            return None
        r = rounds.current()
        m = self._members(r)
        return m.index(r.rank) if r.rank in m else None

    def included(self) -> bool | None:
        """Whether this process is a member in the current round."""
        if self.ranks is None:
            return None
        r = rounds.current()
        return r.rank in self._members(r)

    def invalidate(self) -> None:
        self.process_set_id = None
        self.ranks = None

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __str__ = __repr__


class _GlobalProcessSet(ProcessSet):
    """Every rank of the current round."""

    def __init__(self) -> None:
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self) -> list[int]:
        try:
            return list(range(rounds.current().size))
        except ValueError:  # before init
            return []

    @ranks.setter
    def ranks(self, value: Any) -> None:
        pass  # always the whole world

    def _members(self, r: Round) -> tuple[int, ...]:
        return tuple(range(r.size))

    def invalidate(self) -> None:
        pass  # the global set cannot be removed


global_process_set: ProcessSet = _GlobalProcessSet()
_registered: dict[int, ProcessSet] = {0: global_process_set}
_next_id = 1


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set (call it on every rank, in the same order); returns it with its id.

    ValueError for a set with the same ranks as a registered one, as in Horovod.
    """
    global _next_id
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if ps.ranks is None or isinstance(ps, _GlobalProcessSet):
        raise ValueError(f"cannot add {ps}")
    for other in _registered.values():
        if other is not global_process_set and other.ranks == ps.ranks:
            raise ValueError(f"a process set with ranks {ps.ranks} is already registered: {other}")
    ps.process_set_id = _next_id
    _registered[_next_id] = ps
    _next_id += 1
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set (not the global one); True if it was registered."""
    if process_set is global_process_set or process_set.process_set_id is None:
        return False
    found = _registered.pop(process_set.process_set_id, None)
    process_set.invalidate()
    return found is not None


def process_sets() -> list[ProcessSet]:
    """The registered process sets, the global one first."""
    return [_registered[k] for k in sorted(_registered)]


def members(process_set: ProcessSet | None, r: Round) -> tuple[int, ...]:
    """The set's ranks in round ``r`` (all ranks for the global set)."""
    if process_set is None or process_set is global_process_set:
        return tuple(range(r.size))
    return process_set._members(r)


def group(process_set: ProcessSet, r: Round) -> tuple[Any, int, int, tuple[int, ...]]:
    """(gloo group, this rank's position, size, members) of ``process_set`` in round ``r``,
    forming the group on the round's store at its first use in the round (members only)."""
    ranks = process_set._members(r)
    if r.rank not in ranks:
        raise ValueError(f"rank {r.rank} is not a member of {process_set} (members in this round: {list(ranks)})")
    pg = r.subgroups.get(ranks)
    if pg is None:
        if r.store is None:
            raise ValueError("process sets need the round's store; this round has none")
        store = dist.PrefixStore("elasticrun/ps/" + ",".join(map(str, ranks)), r.store)
        # Counted as a collective's wait: a member that registered the set with other ranks
        # (a newcomer's [0, 2, 4] beside the survivors' [0, 2]) waits here for ranks that never
        # come, and the driver's stall line names what each rank waits in.
        r.waiting_in = f"forming process set {list(ranks)}"
        r.waiting_since = time.monotonic()
        try:
            pg = dist.ProcessGroupGloo(store, ranks.index(r.rank), len(ranks),
                                       rounds.group_timeout(r.collective_timeout))
        finally:
            r.waiting_since = None
        r.subgroups[ranks] = pg
    return pg, ranks.index(r.rank), len(ranks), ranks
