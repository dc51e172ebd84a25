"""The reductions: allreduce (single, grouped, sparse), Adasum, reducescatter and barrier.

Each issues through ``worker/issuing.py`` (descriptors for ``join()``, NCCL for CUDA tensors
where the round has it) and returns a handle of ``worker/waiting.py``. Gloo's reduce_scatter
and send/recv complete only inside a blocking wait, so reducescatter and Adasum's pairwise
exchanges are built on alltoall, whose work reports completion while it runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from elasticrun.worker import adasum, gathers, issuing, process_sets, rounds, trace, waiting
from elasticrun.worker import descriptors as ops
from elasticrun.worker.issuing import Adasum, Average, Sum, UnsupportedOperation, op_value
from elasticrun.worker.process_sets import ProcessSet, global_process_set
from elasticrun.worker.waiting import Handle, synchronize


#: dtypes no backend reduces, and what they are reduced as (then cast back: the same wrap-around).
_REDUCE_AS = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, *, trusted: bool = False,
                     flags_at: int | None = None) -> Handle:
    """Start an in-place allreduce of ``tensor``; returns a handle for :func:`synchronize`.
    ``trusted``: the caller knows every rank submits the same (elasticrun's own reductions):
    no agreement first. ``flags_at``: the step flags ride in ``tensor`` from there (a joined
    rank's mirror sets "busy" in them)."""
    op = issuing.resolve_op(op, average)
    what = f"allreduce {name or tuple(tensor.shape)}"
    r = rounds.current()
    if not trusted:
        issuing.check_call(r, "allreduce", name, [tensor], process_set, what, op=op, shape=tuple(tensor.shape))
    if op == Adasum:
        return _adasum([tensor], what, prescale_factor, postscale_factor, process_set, single=True)
    torch_op = issuing.TORCH_OPS[op]
    wide = _REDUCE_AS.get(tensor.dtype)
    data = tensor if wide is None else tensor.to(wide)
    if prescale_factor != 1.0:
        issuing.scale(data, prescale_factor)
    opts = dist.AllreduceOptions()
    opts.reduceOp = torch_op
    if process_set is global_process_set or process_set is None:
        size = r.size
        work = issuing.issue(r, lambda pg: pg.allreduce([data], opts), what,
                             ops.Allreduce(data.shape, data.dtype, issuing.TORCH_OP_NAMES[torch_op], flags_at), on=data)
    else:
        pg, _, size, _ = issuing.group_of(r, process_set, data)
        work = issuing.issue(r, lambda g: g.allreduce([data], opts), what, pg=pg)

    def finish() -> torch.Tensor:
        issuing.scale(data, postscale_factor / size if op == Average else postscale_factor)
        if data is not tensor:
            tensor.copy_(data)
        return tensor
    return waiting.handle(work, what, finish, None if trusted else name)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """Start an allreduce of a copy of ``tensor`` (the input is not modified)."""
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor,
                            process_set, trusted=trusted)


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
               op: int | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> torch.Tensor:
    """Reduce ``tensor`` in place over all ranks and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set,
                                        trusted=trusted))


def allreduce_inplace(tensor: torch.Tensor, op: Any, what: str, flags_at: int | None = None) -> None:
    """Reduce ``tensor`` in place with a torch ReduceOp and wait (check_host_updates, the
    state's sync, barrier). ``flags_at``: as in :func:`allreduce_async_`."""
    r = rounds.current()
    if r.size == 1 and not issuing.on_device(r, tensor):  # every op of one rank is the identity
        waiting.solo(r, what)
        return
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    started = trace.now()
    desc = ops.Allreduce(tensor.shape, tensor.dtype, issuing.TORCH_OP_NAMES[op], flags_at)
    waiting.wait(r, issuing.issue(r, lambda pg: pg.allreduce([tensor], opts), what, desc, on=tensor), what)
    waiting.traced(r, what, started)


def _flat_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of ``tensors`` grouped by (dtype, device), in first-seen order (one fused buffer each)."""
    groups: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.dtype, t.device), []).append(i)
    return list(groups.values())


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | str | None = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """Start an in-place allreduce of every tensor of ``tensors``, fused into one buffer per dtype."""
    op = issuing.resolve_op(op, average)
    tensors = list(tensors)
    what = f"grouped allreduce {name or len(tensors)}"
    r = rounds.current()
    if not trusted:
        issuing.check_call(r, "grouped allreduce", name, tensors, process_set, what, op=op,
                           shape=tuple(tuple(t.shape) for t in tensors))
    if op == Adasum:
        return _adasum(tensors, what, prescale_factor, postscale_factor, process_set, single=False)
    parts: list[tuple[list[int], torch.Tensor, Handle]] = []
    for idx in _flat_groups(tensors):
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx]) if len(idx) > 1 else \
            tensors[idx[0]].detach().reshape(-1)
        if len(idx) == 1 and flat.data_ptr() != tensors[idx[0]].data_ptr():
            flat = flat.clone()
        parts.append((idx, flat, allreduce_async_(flat, None, what, op, prescale_factor, postscale_factor,
                                                  process_set, trusted=True)))

    def finish() -> list[torch.Tensor]:
        with torch.no_grad():
            for idx, flat, h in parts:
                synchronize(h)
                off = 0
                for i in idx:
                    t = tensors[i]
                    n = t.numel()
                    if flat.data_ptr() != t.data_ptr():
                        t.copy_(flat[off:off + n].view_as(t))
                    off += n
        return tensors
    return waiting.handle(waiting.Works([h.work for _, _, h in parts]), what, finish, None if trusted else name)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | str | None = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """As :func:`grouped_allreduce_async_`, on copies (the inputs are not modified)."""
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op, prescale_factor,
                                    postscale_factor, process_set, trusted=trusted)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> list[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set, trusted=trusted))


def sparse_allreduce_async(tensor: torch.Tensor, name: str | None = None, op: int | str | None = None,
                           process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """Allreduce a sparse COO tensor by gathering every rank's indices and values (as Horovod);
    the result (``synchronize(h)`` or ``h()``) is an uncoalesced sparse tensor."""
    op = Average if op is None else op_value(op)
    if op not in (Average, Sum):
        raise UnsupportedOperation("sparse allreduce supports op=Average or op=Sum")
    t = tensor
    what = f"sparse allreduce {name or tuple(t.shape)}"
    if not trusted:
        r = rounds.current()
        issuing.check_call(r, "sparse allreduce", name, [t._values()], process_set, what, op=op, shape=tuple(t.shape))
    # indices and values share one exchange of their (equal) row counts
    gathered = gathers.grouped_allgather_async([t._indices().t().contiguous(), t._values().contiguous()], name,
                                               process_set, trusted=True)
    size = len(process_sets.members(process_set, rounds.current()))

    def finish() -> torch.Tensor:
        i, v = synchronize(gathered)
        if op == Average:
            v = v / size
        return torch.sparse_coo_tensor(i.t(), v, t.size())
    return waiting.handle(gathered.work, what, finish)


def _adasum(tensors: list[torch.Tensor], what: str, prescale: float, postscale: float,
            process_set: ProcessSet | None, single: bool) -> Handle:
    """Adasum of ``tensors`` in place (per tensor), along the pairwise tree of worker/adasum.py:
    one alltoall per step (each rank sends its vector to its partner of that step). Runs to
    completion here; the handle it returns is done."""
    if not issuing.is_global(process_set):
        raise NotImplementedError("Adasum does not support non-global process sets yet.")
    result: Any = tensors[0] if single else tensors
    if not tensors:
        return Handle(waiting.DONE, what, lambda: result, done=True, result=result)
    dtype = tensors[0].dtype
    if not dtype.is_floating_point or any(t.dtype != dtype for t in tensors):
        raise ValueError(f"Adasum needs floating-point tensors of one dtype, got {[t.dtype for t in tensors]}")
    r = rounds.current()
    started = trace.now()
    with torch.no_grad():
        segments, off = [], 0
        for t in tensors:
            segments.append((off, t.numel()))
            off += t.numel()
        flat = torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) > 1 else tensors[0].reshape(-1).clone()
        if prescale != 1.0:
            flat.mul_(prescale)
        size, me, n = r.size, r.rank, flat.numel()
        steps = adasum.schedule(size)
        p = 1
        while p * 2 <= size:
            p *= 2
        opts = dist.AllToAllOptions()
        for i, partners in enumerate(steps):
            fold = size > p and i == 0
            unfold = size > p and i == len(steps) - 1
            if fold:
                sends = [[n if j >= p and k == partners[j] else 0 for k in range(size)] for j in range(size)]
            elif unfold:
                sends = [[n if j < size - p and k == partners[j] else 0 for k in range(size)] for j in range(size)]
            else:
                sends = [[n if k == partners[j] else 0 for k in range(size)] for j in range(size)]
            row = sends[me]
            col = [sends[j][me] for j in range(size)]
            inp = flat if any(row) else flat.new_empty(0)
            out = flat.new_empty(sum(col))
            matrix = tuple(tuple(x) for x in sends)
            waiting.wait(r, issuing.issue(r, lambda pg: pg.alltoall_base(out, inp, col, row, opts), what,
                                          ops.Alltoall((), dtype, matrix), on=flat), what)
            if not any(col):
                continue
            q = partners[me]
            if unfold:
                flat = out
            elif me < q:
                flat = adasum.combine(flat, out, segments)
            else:
                flat = adasum.combine(out, flat, segments)
        if postscale != 1.0:
            flat.mul_(postscale)
        for t, (o, k) in zip(tensors, segments):
            t.copy_(flat[o:o + k].view_as(t))
    waiting.traced(r, what, started)
    return Handle(waiting.DONE, what, lambda: result, done=True, result=result)


def _reducescatter_issue(tensor: torch.Tensor, what: str, op: int, prescale: float,
                         process_set: ProcessSet | None) -> tuple[Any, Callable[[float], torch.Tensor]]:
    r = rounds.current()
    members = process_sets.members(process_set, r)
    size = len(members)
    me = members.index(r.rank) if r.rank in members else -1
    if me < 0:
        raise ValueError(f"rank {r.rank} is not a member of {process_set}")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension (it scatters along the first)")
    t = tensor.detach().contiguous()
    if prescale != 1.0:
        t = t.clone()
        issuing.scale(t, prescale)  # in the tensor's own dtype, integers too
    counts = issuing.even_split(t.shape[0], size)
    mine = counts[me]
    rest = tuple(t.shape[1:])
    out = t.new_empty((size * mine,) + rest)
    opts = dist.AllToAllOptions()
    recv = [mine] * size
    if issuing.is_global(process_set):
        work = issuing.issue(r, lambda pg: pg.alltoall_base(out, t, recv, counts, opts), what,
                             ops.Alltoall(rest, t.dtype, tuple(tuple(counts) for _ in range(size))), on=t)
    else:
        assert process_set is not None  # not global
        pg, _, _, _ = issuing.group_of(r, process_set, t)
        work = issuing.issue(r, lambda g: g.alltoall_base(out, t, recv, counts, opts), what, pg=pg)

    def finish(postscale: float) -> torch.Tensor:
        result = out.view((size, mine) + rest).sum(0, dtype=out.dtype) if size > 1 else out.clone()
        issuing.scale(result, postscale / size if op == Average else postscale)
        return result
    return work, finish


def _reducescatter_checked(kind: str, name: str | None, tensors: list[torch.Tensor], op: int | str,
                           process_set: ProcessSet | None, what: str, shape: Any, trusted: bool) -> int:
    """The op (Horovod's reducescatter takes Average or Sum), after the arguments' checks."""
    value = op_value(op)
    if value not in (Average, Sum):
        raise UnsupportedOperation("reducescatter supports op=Average or op=Sum")
    if not trusted:
        issuing.check_call(rounds.current(), kind, name, tensors, process_set, what, op=value, shape=shape)
    return value


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int | str = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, trusted: bool = False) -> Handle:
    """Start reducing ``tensor`` over the ranks and scattering the result along dim 0: member
    ``i`` gets rows ``[sum(counts[:i]), ...)`` of the reduction, the first ``rows % size``
    members one row more (as Horovod). The input is not modified."""
    what = f"reducescatter {name or tuple(tensor.shape)}"
    op = _reducescatter_checked("reducescatter", name, [tensor], op, process_set, what, tuple(tensor.shape), trusted)
    work, finish = _reducescatter_issue(tensor, what, op, prescale_factor, process_set)
    return waiting.handle(work, what, lambda: finish(postscale_factor), None if trusted else name)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int | str = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, *, trusted: bool = False) -> Handle:
    """:func:`reducescatter_async` of each tensor; ``synchronize`` returns the list of results."""
    what = f"grouped reducescatter {name or len(tensors)}"
    op = _reducescatter_checked("grouped reducescatter", name, list(tensors), op, process_set, what,
                                tuple(tuple(t.shape) for t in tensors), trusted)
    parts = [_reducescatter_issue(t, what, op, prescale_factor, process_set) for t in tensors]
    return waiting.handle(waiting.Works([w for w, _ in parts]), what, lambda: [f(postscale_factor) for _, f in parts],
                          None if trusted else name)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of the process set) has reached the barrier."""
    if issuing.is_global(process_set):
        allreduce_inplace(torch.zeros(1), dist.ReduceOp.SUM, "barrier")
    else:
        allreduce_(torch.zeros(1), op=Sum, name="barrier", process_set=process_set, trusted=True)
