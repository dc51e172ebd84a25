"""A list of ranks as a line says it (the driver's and the workers' messages alike)."""

from __future__ import annotations

from collections.abc import Sequence


def rank_list(ranks: Sequence[int]) -> str:
    """``rank 2``, ``ranks 0, 1``, ``ranks 0, 1, ... (9 ranks)``: a line stays short however
    many ranks it names."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 4:
        return f"ranks {ranks[0]}, {ranks[1]}, ... ({len(ranks)} ranks)"
    return "ranks " + ", ".join(map(str, ranks))
