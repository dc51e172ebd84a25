"""Rank assignment for a round (pure).

Ranks fill host by host in the host manager's join order, slot by slot, up to ``max_np``.
Because a worker's slot index on its host is its local rank, and surviving hosts come first,
a surviving worker keeps its (host, slot) and the lowest ranks go to the oldest hosts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence


@dataclass(frozen=True)
class SlotInfo:
    """One process's place in a round (horovod's rank/local/cross triple)."""

    host: str
    slot: int  # == local_rank
    rank: int
    size: int
    local_rank: int
    local_size: int
    cross_rank: int  # index of this host among hosts that have this local_rank
    cross_size: int  # number of hosts that have this local_rank

    @property
    def key(self) -> tuple[str, int]:
        return (self.host, self.slot)

    def as_dict(self) -> dict[str, int | str]:
        return {"host": self.host, "slot": self.slot, "rank": self.rank, "size": self.size,
                "local_rank": self.local_rank, "local_size": self.local_size,
                "cross_rank": self.cross_rank, "cross_size": self.cross_size}


def assign(hosts: Sequence[tuple[str, int]], max_np: int | None,
           previous: Mapping[tuple[str, int], int] | None = None) -> list[SlotInfo]:
    """Assign ranks to ``hosts`` (``[(host, slots), ...]`` in order), at most ``max_np`` in all.

    ``previous`` maps the (host, slot) of surviving workers to their last rank. Within a host,
    those slots take the lowest ranks (in their old order), so that a process launched on a
    freed slot 0 never outranks a survivor on slot 1. Slots themselves never move: a worker's
    local rank is its slot, which is what picks its GPU.
    """
    budget = max_np if max_np is not None else sum(s for _, s in hosts)
    used: list[tuple[str, int]] = []
    total = 0
    for host, slots in hosts:
        take = min(slots, budget - total)
        if take <= 0:
            break
        used.append((host, take))
        total += take
    # cross_rank / cross_size: hosts that have a worker at each local rank, in host order.
    cross_size: list[int] = []
    cross_rank: dict[tuple[str, int], int] = {}
    for host, n in used:
        cross_size.extend([0] * (n - len(cross_size)))
        for local in range(n):
            cross_rank[(host, local)] = cross_size[local]
            cross_size[local] += 1
    previous = previous or {}
    out: list[SlotInfo] = []
    rank = 0
    for host, local_size in used:
        order = sorted(range(local_size), key=lambda s: ((host, s) not in previous, previous.get((host, s), 0), s))
        for slot in order:
            out.append(SlotInfo(host=host, slot=slot, rank=rank, size=total, local_rank=slot, local_size=local_size,
                                cross_rank=cross_rank[(host, slot)], cross_size=cross_size[slot]))
            rank += 1
    return out
