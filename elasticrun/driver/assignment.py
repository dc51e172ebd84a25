"""Rank assignment for a round (pure).

Ranks fill host by host in the host manager's join order, slot by slot, up to ``max_np``.
Because a worker's slot index on its host is its local rank, and surviving hosts come first,
a surviving worker keeps its (host, slot) and the lowest ranks go to the oldest hosts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # (host, slot): a plain attribute, not a property; decisions read it for every place.
    key: tuple[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.host, self.slot))

    def as_dict(self) -> dict[str, int | str]:
        return {"host": self.host, "slot": self.slot, "rank": self.rank, "size": self.size,
                "local_rank": self.local_rank, "local_size": self.local_size,
                "cross_rank": self.cross_rank, "cross_size": self.cross_size}


def assign(hosts: Sequence[tuple[str, int]], max_np: int | None,
           previous: Mapping[tuple[str, int], int] | None = None) -> list[SlotInfo]:
    """Assign ranks to ``hosts`` (``[(host, slots), ...]`` in order), at most ``max_np`` in all.

    ``previous`` maps the (host, slot) of surviving workers to their last rank. Within a host,
    those slots take the lowest ranks (in their old order), so that a process launched on a
    freed slot 0 never outranks a survivor on slot 1. Slots themselves never move: with every
    slot of a host in use, a worker's local rank is its slot, which is what picks its GPU.
    """
    budget = max_np if max_np is not None else sum(s for _, s in hosts)
    previous = previous or {}
    keys: list[tuple[str, int]] = []
    for host, slots in hosts:
        take = min(slots, budget - len(keys))
        if take <= 0:
            break
        order = sorted(range(take), key=lambda s: ((host, s) not in previous, previous.get((host, s), 0), s))
        keys += [(host, s) for s in order]
    return assign_keys(keys)


def assign_keys(keys: Sequence[tuple[str, int]]) -> list[SlotInfo]:
    """Ranks for exactly these (host, slot) places, in priority order.

    Ranks fill host by host (a host's places are contiguous ranks, as hierarchical collectives
    expect), hosts in the order of their first place in ``keys``, and within a host in the
    order given: the caller lists the worker that must be rank 0 (the holder of the newest
    state) first. A host's local ranks number its places by slot, so they are its slot
    numbers whenever its slots 0..n-1 are all used, and stay within 0..local_size-1 when only
    some are (a round formed before every newcomer of a host is ready).
    """
    by_host: dict[str, list[int]] = {}
    for host, slot in keys:
        by_host.setdefault(host, []).append(slot)
    local: dict[tuple[str, int], int] = {}
    cross_size: list[int] = []
    cross_rank: dict[tuple[str, int], int] = {}
    for host, slots in by_host.items():
        for index, slot in enumerate(sorted(slots)):
            local[(host, slot)] = index
        cross_size.extend([0] * (len(slots) - len(cross_size)))
        for index in range(len(slots)):
            cross_rank[(host, index)] = cross_size[index]
            cross_size[index] += 1
    size = len(keys)
    out: list[SlotInfo] = []
    for host, slots in by_host.items():
        for slot in slots:
            lr = local[(host, slot)]
            out.append(SlotInfo(host=host, slot=slot, rank=len(out), size=size, local_rank=lr,
                                local_size=len(slots), cross_rank=cross_rank[(host, lr)], cross_size=cross_size[lr]))
    return out
