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
    homogeneous: bool = True  # every host of the round has as many places (Horovod's is_homogeneous())
    # (host, slot): a plain attribute, not a property; decisions read it for every place.
    key: tuple[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", (self.host, self.slot))

    def as_dict(self) -> dict[str, int | str]:
        return {"host": self.host, "slot": self.slot, "rank": self.rank, "size": self.size,
                "local_rank": self.local_rank, "local_size": self.local_size,
                "cross_rank": self.cross_rank, "cross_size": self.cross_size, "homogeneous": self.homogeneous}


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
    state) first. A worker's local rank is its slot, for the whole life of its process, as in
    Horovod (where a worker is launched for a slot): a GPU script picks its device once,
    ``torch.cuda.set_device(hvd.local_rank())``, and the driver gives NCCL the slot's GPU. In a
    round formed before every newcomer of a host is ready (slot 1 without slot 0), numbering the
    places 0..n-1 instead would tell the slot-1 worker it is local rank 0 now and 1 later, and a
    script that reads it again would move to another GPU. ``local_size`` is the host's places
    in the round, or one more than its highest slot if that is larger, so that ``local_rank <
    local_size`` always holds.
    """
    by_host: dict[str, list[int]] = {}
    for host, slot in keys:
        by_host.setdefault(host, []).append(slot)
    cross_size: dict[int, int] = {}
    cross_rank: dict[tuple[str, int], int] = {}
    for host, slots in by_host.items():
        for slot in sorted(slots):
            cross_rank[(host, slot)] = cross_size.get(slot, 0)
            cross_size[slot] = cross_size.get(slot, 0) + 1
    size = len(keys)
    homogeneous = len({len(slots) for slots in by_host.values()}) <= 1
    out: list[SlotInfo] = []
    for host, slots in by_host.items():
        local_size = max(len(slots), max(slots) + 1)
        for slot in slots:
            out.append(SlotInfo(host=host, slot=slot, rank=len(out), size=size, local_rank=slot,
                                local_size=local_size, cross_rank=cross_rank[(host, slot)], cross_size=cross_size[slot],
                                homogeneous=homogeneous))
    return out
