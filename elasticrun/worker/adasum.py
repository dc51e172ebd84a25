"""Adasum, the adaptive summation Horovod offers as ``op=hvd.Adasum`` (pure math, no collectives).

Two gradients (or optimizer deltas) ``a`` and ``b`` combine as

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

so orthogonal vectors add up, parallel ones average, and anything between gets something
between. Ranks combine pairwise along a binary tree (recursive halving, as Horovod's): at
level ``d`` (1, 2, 4, ...) rank ``i`` combines with rank ``i ^ d``, each pair's result going on
to the next level, so every rank ends with the same vector. The dot products and norms are
per tensor (Horovod computes them per tensor of a fused buffer, too), in float64.

Horovod refuses sizes that are not a power of two; an elastic world changes size, so here
the ranks beyond the largest power of two ``p`` first fold into rank ``i - p`` (an Adasum of
the two), the ``p`` ranks run the tree, and the folded ranks receive the result.
"""

from __future__ import annotations

import torch

__all__ = ["combine", "schedule"]

#: Horovod's threshold below which a squared norm counts as zero (its coefficient stays 1).
_TINY = 1e-8


def combine(a: torch.Tensor, b: torch.Tensor, segments: list[tuple[int, int]]) -> torch.Tensor:
    """Adasum of the flat vectors ``a`` (the lower rank's) and ``b``, per segment (offset, length).

    Both ranks of a pair call it with the same operand order, so they get identical bits.
    """
    out = torch.empty_like(a)
    for off, n in segments:
        x, y = a[off:off + n], b[off:off + n]
        x64, y64 = x.double(), y.double()
        dot = float(torch.dot(x64, y64))
        xx = float(torch.dot(x64, x64))
        yy = float(torch.dot(y64, y64))
        ca = 1.0 - dot / xx * 0.5 if xx >= _TINY else 1.0
        cb = 1.0 - dot / yy * 0.5 if yy >= _TINY else 1.0
        torch.add(x * ca, y, alpha=cb, out=out[off:off + n])
    return out


def schedule(size: int) -> list[list[int]]:
    """The exchanges of an Adasum over ``size`` ranks: one list per step, ``partner[i]`` the
    rank that rank ``i`` swaps vectors with in that step (-1: none). Step kinds, in order:
    fold (ranks >= p send to i - p), the tree levels, unfold (results back to the folded)."""
    p = 1
    while p * 2 <= size:
        p *= 2
    steps: list[list[int]] = []
    if size > p:
        steps.append([i + p if i + p < size else (i - p if i >= p else -1) for i in range(size)])
    d = 1
    while d < p:
        steps.append([i ^ d if i < p else -1 for i in range(size)])
        d *= 2
    if size > p:
        steps.append(list(steps[0]))
    return steps
