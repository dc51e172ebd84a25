"""The gathers: allgather (single and grouped, first dimensions may differ per rank) and
alltoall. Both exchange row counts beside or before the rows; allgather sends the rows at
once up to the capacities agreed in ``worker/capacities.py``. An exchange made of several
operations tags its first with the descriptor a rank in ``join()`` mirrors (:class:`_Tag`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from elasticrun.worker import agreement, capacities, issuing, rounds, waiting
from elasticrun.worker import descriptors as ops
from elasticrun.worker.descriptors import Op
from elasticrun.worker.process_sets import ProcessSet, global_process_set
from elasticrun.worker.rounds import Round
from elasticrun.worker.waiting import Handle, synchronize


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.reshape(1) if t.dim() == 0 else t


def _wire(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What a contiguous tensor goes over gloo as, and how many of its units one row is: the
    tensor itself (a row is a row) when gloo takes its dtype, else a flat uint8 view of its
    bytes (no copy; a dtype view costs ~10 us, so only when needed)."""
    if t.dtype in issuing.GLOO_DTYPES:
        return t, 1
    return t.reshape(-1).view(torch.uint8), math.prod(t.shape[1:]) * t.element_size()


def _segment(t: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    """Rows ``[start, start + rows)`` of ``t``, zero-padded to ``rows`` where ``t`` ends first
    (``t`` itself when that is all of it)."""
    have = max(0, min(t.shape[0] - start, rows))
    if have == rows:
        return t if start == 0 and rows == t.shape[0] else t[start:start + rows]
    out = t.new_zeros((rows,) + tuple(t.shape[1:]))
    out[:have] = t[start:start + have]
    return out


def _capacities(r: Round, group_key: tuple[int, ...]) -> capacities.Capacities:
    caps = r.capacities.get(group_key)
    if caps is None:
        caps = r.capacities[group_key] = capacities.Capacities()
    return caps


@dataclass
class _Group:
    """Where a collective runs: the round's group (``pg`` None) or a process set's."""

    pg: Any
    size: int
    me: int
    key: tuple[int, ...]  # () for the round's group, the members for a process set's


def _where(r: Round, process_set: ProcessSet | None) -> _Group:
    if issuing.is_global(process_set):
        return _Group(None, r.size, r.rank, ())
    assert process_set is not None  # not global
    pg, me, size, members = issuing.group_of(r, process_set)
    return _Group(pg, size, me, members)


def _on(r: Round, g: _Group, start: Callable[[Any], Any], what: str, desc: Op,
        on: torch.Tensor | None = None) -> Any:
    """Issue on the group of ``g`` (its NCCL group for a CUDA ``on`` where the round has NCCL);
    descriptors only for the round's (joined ranks answer those)."""
    if g.pg is None:
        return issuing.issue(r, start, what, desc, on=on)
    pg = issuing.device_group(r, g.key, on) if on is not None and issuing.on_device(r, on) else g.pg
    return issuing.issue(r, start, what, pg=pg)


class _Tag:
    """Descriptors of an exchange made of several operations: the first one issued carries
    the exchange's own (a joined rank reads it and runs the whole exchange itself, with no
    rows); the later ones are marked as its parts, which nobody reads."""

    def __init__(self, desc: Op) -> None:
        self._desc = desc

    def __call__(self) -> Op:
        desc, self._desc = self._desc, ops.PartOf(self._desc.kind)
        return desc


def _gather_bytes(r: Round, g: _Group, t: torch.Tensor, rows: int, start: int, what: str,
                  tag: _Tag) -> tuple[torch.Tensor, Any]:
    """Start gathering rows ``[start, start + rows)`` of ``t`` (padded) from every member: the
    output holds ``rows`` rows per member, in member order."""
    out = t.new_empty((g.size * rows,) + tuple(t.shape[1:]))
    (send, _), (recv, _) = _wire(_segment(t, start, rows)), _wire(out)
    work = _on(r, g, lambda pg: pg._allgather_base(recv, send), what, tag(), on=t)
    return out, work


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: str | None = None,
                            process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """Start concatenating each tensor of ``tensors`` from every rank along dim 0 (first
    dimensions may differ per rank).

    The rows go out at once, up to the agreed capacities of ``worker/capacities.py``, beside
    one small exchange of every rank's row counts; only rows past a capacity wait for those
    counts (a second exchange). So a gather whose shapes repeat costs one round trip."""
    ts = [_rows(t).contiguous() for t in tensors]
    what = f"allgather {name or [tuple(t.shape) for t in ts]}"
    r = rounds.current()
    if not trusted:
        issuing.check_call(r, "allgather", name, ts, process_set, what, rows_of=tuple(tuple(t.shape[1:]) for t in ts))
    g = _where(r, process_set)
    key = ("allgather", name, tuple((t.dtype, tuple(t.shape[1:])) for t in ts))
    cache = _capacities(r, g.key)
    row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in ts]
    caps = capacities.usable(cache.get(key) or (0,) * len(ts), row_bytes)
    counts = torch.tensor([t.shape[0] for t in ts], dtype=torch.int64)
    table_out = torch.empty(g.size * len(ts), dtype=torch.int64)
    kind = "cuda" if ts and issuing.on_device(r, ts[0]) else "cpu"  # a joined rank makes its no-rows tensors there
    tag = _Tag(ops.VarAllgather(name, tuple(t.dtype for t in ts), tuple(tuple(t.shape[1:]) for t in ts), kind))
    # the capped rows first, then the counts: the rows do not wait for the counts' round trip
    first = [_gather_bytes(r, g, t, cap, 0, what, tag) if cap else None for t, cap in zip(ts, caps)]
    head = _on(r, g, lambda pg: pg._allgather_base(table_out, counts), what + ".sizes", tag())
    waiting.wait(r, head, what + ".sizes")
    flat = table_out.tolist()
    table = [flat[i:i + len(ts)] for i in range(0, len(flat), len(ts))]  # [member][tensor]
    new_caps = capacities.gather_capacities(table)
    rests = capacities.beyond(new_caps, caps)
    second = [_gather_bytes(r, g, t, rest, cap, what, tag) if rest else None
              for t, cap, rest in zip(ts, caps, rests)]
    cache.put(key, new_caps)
    works = [w for part in first + second if part is not None for w in part[1:]]

    def finish() -> list[torch.Tensor]:
        results = []
        for k, t in enumerate(ts):
            per_rank = [row[k] for row in table]
            head, tail = first[k], second[k]
            if head is not None and not rests[k] and all(n == caps[k] for n in per_rank):
                results.append(head[0])  # every rank filled its capacity: the output is the result
                continue
            chunks = []
            for i, (a, b) in enumerate(capacities.pieces(per_rank, caps[k], rests[k])):
                if a:
                    assert head is not None  # a rank sent rows within the capacity: the first pass ran
                    chunks.append(head[0][i * caps[k]:i * caps[k] + a])
                if b:
                    assert tail is not None  # rows beyond it: the second pass ran
                    chunks.append(tail[0][i * rests[k]:i * rests[k] + b])
            results.append(torch.cat(chunks) if chunks else t.new_empty((0,) + tuple(t.shape[1:])))
        return results
    return waiting.handle(waiting.Works(works) if works else waiting.DONE, what, finish, None if trusted else name)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> list[torch.Tensor]:
    return synchronize(grouped_allgather_async(tensors, name, process_set, trusted=trusted))


def allgather_async(tensor: torch.Tensor, name: str | None = None,
                    process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """Start concatenating ``tensor`` from every rank along dim 0; first dimensions may differ."""
    inner = grouped_allgather_async([tensor], name, process_set, trusted=trusted)
    return waiting.handle(inner.work, inner.what, lambda: synchronize(inner)[0])


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None, process_set: ProcessSet = global_process_set, *,
                   trusted: bool = False) -> Handle:
    """Start sending ``splits[i]`` rows of ``tensor`` (in order) to member ``i`` and receiving what
    every member sends here; ``synchronize`` returns ``(output, received_splits)``, the splits
    int32 whatever the dtype of ``splits`` (as Horovod's). Without
    ``splits`` the rows are split evenly (the first ranks one more).

    Each member first learns how many rows it receives (a small alltoall of the splits), then
    the rows follow in an alltoall of exactly those sizes. Unlike allgather, the rows do not
    go out beside the counts (``worker/capacities.py``): on a 2-core machine two alltoalls in
    flight at once cost more than one after the other (p50 1.11 ms against 0.87 for 1 MiB)."""
    r = rounds.current()
    g = _where(r, process_set)
    t = _rows(tensor).contiguous()
    what = f"alltoall {name or tuple(t.shape)}"
    if splits is None:
        if t.shape[0] % g.size:
            raise ValueError(f"alltoall without splits needs the first dimension ({t.shape[0]}) to be divisible by "
                             f"the number of ranks ({g.size}); pass splits to send uneven parts")
        sends = issuing.even_split(t.shape[0], g.size)
    else:
        sends = [int(x) for x in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(sends) != g.size or any(x < 0 for x in sends) or sum(sends) != t.shape[0]:
            raise ValueError(f"alltoall splits {sends} must be {g.size} non-negative counts adding up to the "
                             f"first dimension of the tensor ({t.shape[0]})")
    rest_shape = tuple(t.shape[1:])
    opts = dist.AllToAllOptions()
    # Each member gets, with the count of rows this rank sends it, this rank's signature (see
    # worker/agreement.py): the exchange of counts checks the ranks agree, at no extra cost. A
    # rank in join() (trusted) sends none, and takes any.
    if trusted:
        a = b = 0
    else:
        issuing.check_name(r, name, what)
        a, b = agreement.words(issuing.signature("alltoall", name, [t], process_set, rest=rest_shape))
    three = [3] * g.size
    counts = torch.tensor([x for n in sends for x in (n, a, b)], dtype=torch.int64)
    received_t = torch.empty(3 * g.size, dtype=torch.int64)
    tag = _Tag(ops.VarAlltoall(name, t.dtype, rest_shape, "cuda" if issuing.on_device(r, t) else "cpu"))
    splits_work = _on(r, g, lambda pg: pg.alltoall_base(received_t, counts, three, three, opts), what + ".splits",
                      tag())
    waiting.wait(r, splits_work, what + ".splits")
    table = received_t.tolist()
    if not trusted and any((sa, sb) != (a, b) and (sa, sb) != (0, 0) for sa, sb in zip(table[1::3], table[2::3])):
        issuing.disagreed(r, issuing.signature("alltoall", name, [t], process_set, rest=rest_shape), process_set)
    received = table[0::3]
    received_t = torch.tensor(received, dtype=torch.int64)
    out = t.new_empty((sum(received),) + rest_shape)
    (send, row), (recv, _) = _wire(t), _wire(out)
    sb, rb = ([n * row for n in sends], [n * row for n in received]) if row != 1 else (sends, received)
    work = _on(r, g, lambda pg: pg.alltoall_base(recv, send, rb, sb, opts), what, tag(), on=t)
    return waiting.handle(work, what, lambda: (out, received_t.to(torch.int32)), None if trusted else name)
