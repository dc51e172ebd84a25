"""The four flags every rank agrees on at a step, packed the same way wherever they travel (pure).

They ride in two places: appended to the DistributedOptimizer's first gradient bucket (summed
with the gradients: no extra collective per step), or in the check point's own tiny allreduce
(MAX) when no gradient allreduce carried them. Either way, after the reduction any rank's
flag set makes the flag set on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

__all__ = ["StepFlags"]


@dataclass(frozen=True)
class StepFlags:
    """``pending``: some rank has a host update newer than the handled ones (in the check
    point's MAX reduction: the newest timestamp any rank knows, handled or not); ``added``:
    such an update added hosts (newcomers: the reset must sync); ``wanted``: some rank was asked
    for a durable copy; ``busy``: some rank is still sending its last one, or sits in
    ``hvd.join()`` (it saved none of the commits made meanwhile: it has no shard of them)."""

    pending: float
    added: bool
    wanted: bool
    busy: bool

    #: How many elements they take in a reduced buffer.
    SIZE: ClassVar[int] = 4
    #: Where ``busy`` is among them (a joined rank sets only that one: worker/join.py).
    BUSY: ClassVar[int] = 3

    def encode(self) -> list[float]:
        return [float(self.pending), float(self.added), float(self.wanted), float(self.busy)]

    @classmethod
    def decode(cls, values: Sequence[float]) -> "StepFlags":
        """The flags from a reduced buffer (summed, averaged or maxed: any positive value is set)."""
        if len(values) != cls.SIZE:
            raise ValueError(f"step flags: {len(values)} values, expected {cls.SIZE}")
        pending, added, wanted, busy = values
        return cls(float(pending), added > 0, wanted > 0, busy > 0)
