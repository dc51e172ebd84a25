"""Row capacities that let a variable-size allgather skip its size exchange.

Horovod's allgather takes tensors whose first dimension differs per rank, so a receiver
cannot know how many rows will arrive. Asking first costs a whole round trip before every
call. Horovod's coordinator negotiates sizes too; its response cache is what lets tensors it
has seen before skip that. Here the rows go out at once, capped at a *capacity* every rank
already agrees on: the largest row count of the previous call with the same key. A tiny
exchange of the true counts is issued at the same moment and runs beside the rows. When a
count exceeded its capacity, the rows past it follow in one more exchange whose sizes every
rank now knows. Nothing is sent twice and nothing is guessed: a wrong capacity costs one
extra round trip (what every call cost before), never a mismatch.

Capacities stay agreed because every rank of a group issues the same collectives in the same
order (gloo requires it), every rank sees every count, and the next capacity of a tensor is
the largest count of the call (so a fixed-shape gather pays nothing, and a smaller last batch
pads at most one call). Rows beyond :data:`SPECULATE_BYTES` per rank are never sent ahead. A rank in ``join()`` runs the same exchange with no rows, so it keeps
the same capacities as the others.

Keys are (name, dtypes and trailing shapes) within one group of one round; a new round
starts empty. Each group keeps at most :data:`LIMIT` keys, dropping the least recently used
(in an order every member shares, since they make the same calls). Names must match across
ranks, as in Horovod.

alltoall does not use this: its receivers cannot see the other pairs' counts, and on a
2-core machine two alltoalls in flight cost more than one after the other (see
``collectives.alltoall_async``).

Pure: no torch, no threads, no clocks. ``worker/gathers.py`` does the communication.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Sequence
from typing import Any

__all__ = ["LIMIT", "SPECULATE_BYTES", "Capacities", "beyond", "gather_capacities", "pieces", "usable"]

#: Keys one group remembers; a job alternating more distinct gathers than this pays the size
#: round trip for them, as without capacities.
LIMIT = 1024
#: The most one rank sends ahead of the counts for one tensor. Past it the round trip saved is
#: a small part of the transfer, while rows sent (and a buffer of members x capacity received)
#: for a count that shrank would not be: one huge gather must not make the next small one
#: allocate and move as much again.
SPECULATE_BYTES = 16 << 20


class Capacities:
    """Per-key capacities of one group, least recently used dropped past ``limit``."""

    def __init__(self, limit: int = LIMIT) -> None:
        self._limit = limit
        self._caps: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()

    def get(self, key: Hashable) -> Any:
        """The capacities stored for ``key`` (None when it was never stored or was dropped)."""
        value = self._caps.get(key)
        if value is not None:
            self._caps.move_to_end(key)
        return value

    def put(self, key: Hashable, value: Any) -> None:
        self._caps[key] = value
        self._caps.move_to_end(key)
        while len(self._caps) > self._limit:
            self._caps.popitem(last=False)

    def __len__(self) -> int:
        return len(self._caps)


def usable(caps: Sequence[int], row_bytes: Sequence[int]) -> tuple[int, ...]:
    """The capacities to send ahead with: each stored one, or 0 (wait for the counts) where its
    rows would exceed :data:`SPECULATE_BYTES`."""
    return tuple(c if c * b <= SPECULATE_BYTES else 0 for c, b in zip(caps, row_bytes))


def beyond(counts: Sequence[int], caps: Sequence[int]) -> list[int]:
    """Rows of each count past its capacity (what the second exchange carries)."""
    return [max(0, n - c) for n, c in zip(counts, caps)]


def gather_capacities(table: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """The next capacities of a gather of several tensors: per tensor, the largest row count
    of any rank (``table[rank][tensor]``)."""
    if not table:
        return ()
    return tuple(max(row[k] for row in table) for k in range(len(table[0])))


def pieces(counts: Sequence[int], cap: int, rest: int) -> list[tuple[int, int]]:
    """Where each rank's rows are after a capped exchange of ``cap`` rows per rank and a second
    one of ``rest``: per rank, (rows in the first exchange, rows in the second)."""
    out = []
    for n in counts:
        first = min(n, cap)
        second = n - first
        if second > rest:
            raise ValueError(f"{n} rows do not fit a capacity of {cap} plus {rest}")
        out.append((first, second))
    return out
