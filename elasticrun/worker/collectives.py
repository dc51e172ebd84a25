"""Collectives on the current round's process group, with horovod.torch's semantics.

Every collective is issued asynchronously here and then waited on by polling
(``worker/waiting.py``, with the handles of collectives in flight), because a blocked gloo
collective cannot be interrupted (gloo's abort() does not unblock it): polling lets a
worker give up the moment the driver says the round is dead, or when the collective timeout
passes. Either way the caller gets :class:`HorovodInternalError`, never a hang or a crash.
CUDA tensors go over the round's NCCL group when the round has one (``worker/devices.py``):
their works are polled the same way, and a NCCL communicator left behind by a dead peer is
aborted by the runtime when the round ends, never waited on.
Only gloo operations whose work reports completion while it runs are used (allreduce,
broadcast, allgather, alltoall); gloo's reduce_scatter and send/recv complete only inside
a blocking wait, so reducescatter and Adasum's pairwise exchanges are built on alltoall.

Each operation looks the current :class:`~elasticrun.worker.rounds.Round` up once and takes
everything from it: the process group, rank and size, the abort check, the timeout, and the
first-step event after a reset. ``process_set=`` runs an operation on a process set's own
group instead (``worker/process_sets.py``).

Every operation on the round's group passes a *descriptor* to :func:`_issue` (its kind,
shapes, dtype, reduction): rounds keep the recent ones, so that a rank in ``hvd.join()`` can
take part in operations it never called (``worker/join.py``).

The op constants are Horovod's integers (``hvd.Average`` is 0, ``hvd.Sum`` 1, ``hvd.Adasum``
2, ``hvd.Min`` 3, ``hvd.Max`` 4, ``hvd.Product`` 5); the names earlier versions used
(``"average"``, ``"sum"``, ...) are still accepted.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from elasticrun.worker import adasum, agreement, capacities, devices, process_sets, rounds, trace, waiting
from elasticrun.worker import descriptors as ops
from elasticrun.worker.agreement import CollectiveMismatch
from elasticrun.worker.descriptors import Op
from elasticrun.worker.exceptions import HorovodInternalError
from elasticrun.worker.process_sets import ProcessSet, global_process_set
from elasticrun.worker.rounds import Round
from elasticrun.worker.waiting import Handle, join_key, poll, synchronize, wait  # re-exported: hvd's API, join


class ReduceOp:
    """horovod's reduction operators (``hvd.Average``, ``hvd.Sum``, ...), with Horovod's values."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp.AVERAGE, ReduceOp.SUM, ReduceOp.ADASUM, ReduceOp.MIN,
                                           ReduceOp.MAX, ReduceOp.PRODUCT)
_BY_NAME = {"average": Average, "sum": Sum, "adasum": Adasum, "min": Min, "max": Max, "product": Product}
_TORCH_OPS: dict[int, Any] = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
              Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
#: gloo reduction -> its name in descriptors (what a joined rank contributes depends on it).
_TORCH_OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max",
                   dist.ReduceOp.PRODUCT: "product"}

# Poll every 100 us, and every 1 ms once a collective has taken 50 ms. Measured on 2 cores
# (13 MB allreduce, 2 ranks): this matches a blocking work.wait() (7.9 vs 8.0 ms); a spinning
# waiter starves the other ranks' gloo threads (21 ms); waking through the work's future
# callback costs a thread hand-off (9.2 ms).


def op_value(op: int | str) -> int:
    """Horovod's integer for ``op`` (an ``hvd`` constant, or its name as earlier versions had)."""
    if type(op) is int and 0 <= op <= 5:
        return op
    if isinstance(op, str) and op.lower() in _BY_NAME:
        return _BY_NAME[op.lower()]
    raise ValueError(f"unsupported reduction op {op!r}: use hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max "
                     f"or hvd.Product")


def on_device(r: Round, t: torch.Tensor | None) -> bool:
    """Whether ``t`` goes over the round's NCCL group (a CUDA tensor in a round that has one)."""
    return t is not None and r.device_backend == "nccl" and devices.is_device_tensor(t)


def device_group(r: Round, members: tuple[int, ...], t: torch.Tensor) -> Any:
    """The NCCL group of ``members`` (() for the whole round) in round ``r``, formed at its first use."""
    g = r.device_groups.get(members)
    if g is None:
        if r.form_device_group is None:
            raise HorovodInternalError(f"round {r.number} cannot form a NCCL group (no store)")
        g = r.form_device_group(r, members, t.device)
    return g


def _issue(r: Round, start: Callable[[Any], Any], what: str, desc: Op | None = None,
           pg: Any = None, on: torch.Tensor | None = None) -> Any:
    """Start a collective on round ``r``'s group (or on ``pg``, a process set's group), unless
    the round has none or is aborted. ``on``: the tensor it carries; a CUDA one goes over the
    round's NCCL group when the round has one (a process set's ``pg`` is already its own).
    Operations on the round's groups are counted and their descriptor ``desc`` remembered (and
    published while a peer is in join())."""
    main = pg is None
    reason = r.abort_reason()
    if reason:
        raise HorovodInternalError(f"round {r.number} was aborted: {reason}")
    device = main and on_device(r, on)
    if device:
        assert on is not None
        pg = device_group(r, (), on)
    elif main:
        pg = r.pg
        if pg is None:
            raise HorovodInternalError("no process group: the last reset did not complete")
    if main:
        seq = r.calls
        r.calls = seq + 1
        d = desc if desc is not None else ops.Unknown(what)
        kind = "cuda" if device else "cpu"
        r.log.append((seq, d, kind))
        if r.join_active and not r.joined:
            waiting.publish(r, seq, d, kind)
    try:
        work = start(pg)
    except HorovodInternalError:
        raise
    except Exception as exc:
        raise HorovodInternalError(f"{what} failed to start: {exc}") from exc
    if device or (not main and any(pg is g for g in r.device_groups.values())):
        return waiting.Polled(work)
    return work


def issue(r: Round, start: Callable[[Any], Any], what: str, desc: Op | None = None,
          on: torch.Tensor | None = None) -> Any:
    """:func:`_issue` on the round's group, for other modules of the worker (``join``)."""
    return _issue(r, start, what, desc, on=on)


def _group(r: Round, process_set: ProcessSet, on: torch.Tensor | None = None) -> tuple[Any, int, int, tuple[int, ...]]:
    """A process set's (group, rank in it, size, members) in round ``r``: its NCCL group for a
    CUDA ``on`` where the round has NCCL, else its gloo group. Forming a group (its first use in
    the round) fails like a collective would."""
    try:
        pg, me, size, members = process_sets.group(process_set, r)
        if on_device(r, on):
            assert on is not None
            pg = device_group(r, members, on)
        return pg, me, size, members
    except ValueError:
        raise
    except Exception as exc:
        raise HorovodInternalError(f"could not form the group of {process_set} in round {r.number}: {exc}") from exc


def _is_global(process_set: ProcessSet | None) -> bool:
    return process_set is None or process_set is global_process_set


def _ps_id(process_set: ProcessSet | None) -> Any:
    if process_set is None or _is_global(process_set):
        return 0
    return (process_set.process_set_id, tuple(process_set.ranks or ()))


def _agree(r: Round, signature: dict[str, Any], what: str, process_set: ProcessSet | None = None) -> None:
    """Collective, before a user's collective: every rank of the group submitted the same
    ``signature`` (see worker/agreement.py), or every rank raises :class:`CollectiveMismatch`
    saying which ranks differed in what. One tiny allgather of digests on the CPU group (one
    message each way: the cheapest exchange gloo has, ~0.14 ms on 2 ranks here); the full
    signatures travel only when they differ. A rank in ``join()`` sends zeros, which match any."""
    if _is_global(process_set):
        pg, size = None, r.size
    else:
        assert process_set is not None  # not global
        pg, _, size, _ = _group(r, process_set)
    if size == 1:
        return
    mine = agreement.words(signature)
    t = torch.tensor(mine, dtype=torch.int64)
    out = torch.empty(2 * size, dtype=torch.int64)
    label = f"{what} (its arguments)"
    start = lambda g: g._allgather_base(out, t)  # noqa: E731
    work = _issue(r, start, label, ops.Allgather(t.shape, t.dtype)) if pg is None else _issue(r, start, label, pg=pg)
    waiting.wait(r, work, label)
    words = out.tolist()
    if all((x, y) == mine or (x, y) == (0, 0) for x, y in zip(words[0::2], words[1::2])):
        return
    _disagreed(r, signature, process_set)


def agree(r: Round, signature: dict[str, Any], what: str, process_set: ProcessSet | None = None) -> None:
    """:func:`_agree`, for the other modules of the worker (broadcast, the optimizer)."""
    _agree(r, signature, what, process_set)


def _disagreed(r: Round, signature: dict[str, Any] | None, process_set: ProcessSet | None) -> None:
    """The ranks' signatures differ: gather them and raise the same error on every rank."""
    signatures = allgather_object(signature, name="collective signatures",
                                  process_set=process_set if process_set is not None else global_process_set)
    members = process_sets.members(process_set, r)
    raise CollectiveMismatch(agreement.message(signatures, members))


def _check_name(r: Round, name: str | None, what: str) -> None:
    """Horovod's rule: two operations in flight at once cannot share a name (each rank knows
    its own: every rank raises the same error at the same call)."""
    if name is not None and name in r.in_flight:
        raise ValueError(f"{what}: an operation named {name!r} is already in progress; names of collectives in "
                         f"flight at the same time must differ (as in Horovod)")


def _resolve_op(op: int | str | None, average: bool | None) -> int:
    if op is not None and average is not None:
        raise ValueError("pass either op or the deprecated average argument, not both")
    if average is not None:
        return Average if average else Sum
    return Average if op is None else op_value(op)


class UnsupportedOperation(RuntimeError, ValueError):
    """An op a collective does not support (Horovod raises RuntimeError; a ValueError too, as
    elasticrun raised before)."""


def _scale(t: torch.Tensor, factor: float) -> None:
    """Scale ``t`` in place; integers as Horovod scales them: in double precision, truncated
    toward zero (an average of -75 and 0 is -37, not -38)."""
    if factor != 1.0:
        if t.is_floating_point() or t.is_complex():
            t.mul_(factor)
        else:
            inv = 1.0 / factor
            if inv == int(inv):
                t.div_(int(inv), rounding_mode="trunc")
            else:
                t.copy_((t.double() * factor).trunc().to(t.dtype))


# --------------------------------------------------------------------------- allreduce


#: dtypes no backend reduces, and what they are reduced as (then cast back: the same wrap-around).
_REDUCE_AS = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}


def _signature(kind: str, name: str | None, tensors: Sequence[torch.Tensor], process_set: ProcessSet | None,
               **more: Any) -> dict[str, Any]:
    """What every rank must submit alike to a collective (see worker/agreement.py)."""
    return dict(more, collective=kind, name=name, process_set=_ps_id(process_set),
                dtype=tuple(str(t.dtype) for t in tensors), device=tuple(t.device.type for t in tensors))


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | str | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """Start an in-place allreduce of ``tensor``; returns a handle for :func:`synchronize`.
    ``trusted``: the caller knows every rank submits the same (elasticrun's own reductions):
    no agreement first."""
    op = _resolve_op(op, average)
    what = f"allreduce {name or tuple(tensor.shape)}"
    r = rounds.current()
    if not trusted:
        _check_name(r, name, what)
        _agree(r, _signature("allreduce", name, [tensor], process_set, op=op, shape=tuple(tensor.shape)), what,
               process_set)
    if op == Adasum:
        return _adasum([tensor], what, prescale_factor, postscale_factor, process_set, single=True)
    torch_op = _TORCH_OPS[op]
    wide = _REDUCE_AS.get(tensor.dtype)
    data = tensor if wide is None else tensor.to(wide)
    if prescale_factor != 1.0:
        _scale(data, prescale_factor)
    opts = dist.AllreduceOptions()
    opts.reduceOp = torch_op
    if process_set is global_process_set or process_set is None:
        size = r.size
        work = _issue(r, lambda pg: pg.allreduce([data], opts), what,
                      ops.Allreduce(data.shape, data.dtype, _TORCH_OP_NAMES[torch_op]), on=data)
    else:
        pg, _, size, _ = _group(r, process_set, data)
        work = _issue(r, lambda g: g.allreduce([data], opts), what, pg=pg)

    def finish() -> torch.Tensor:
        _scale(data, postscale_factor / size if op == Average else postscale_factor)
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


def allreduce_inplace(tensor: torch.Tensor, op: Any, what: str) -> None:
    """Reduce ``tensor`` in place with a torch ReduceOp and wait (check_host_updates, the
    state's sync, barrier)."""
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    r = rounds.current()
    started = trace.now()
    waiting.wait(r, _issue(r, lambda pg: pg.allreduce([tensor], opts), what,
                    ops.Allreduce(tensor.shape, tensor.dtype, _TORCH_OP_NAMES[op]), on=tensor), what)
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
    op = _resolve_op(op, average)
    tensors = list(tensors)
    what = f"grouped allreduce {name or len(tensors)}"
    r = rounds.current()
    if not trusted:
        _check_name(r, name, what)
        _agree(r, _signature("grouped allreduce", name, tensors, process_set, op=op,
                             shape=tuple(tuple(t.shape) for t in tensors)), what, process_set)
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
        _check_name(r, name, what)
        _agree(r, _signature("sparse allreduce", name, [t._values()], process_set, op=op, shape=tuple(t.shape)),
               what, process_set)
    # indices and values share one exchange of their (equal) row counts
    gathered = grouped_allgather_async([t._indices().t().contiguous(), t._values().contiguous()], name, process_set,
                                       trusted=True)
    size = len(process_sets.members(process_set, rounds.current()))

    def finish() -> torch.Tensor:
        i, v = synchronize(gathered)
        if op == Average:
            v = v / size
        return torch.sparse_coo_tensor(i.t(), v, t.size())
    return waiting.handle(gathered.work, what, finish)


# --------------------------------------------------------------------------- Adasum


def _adasum(tensors: list[torch.Tensor], what: str, prescale: float, postscale: float,
            process_set: ProcessSet | None, single: bool) -> Handle:
    """Adasum of ``tensors`` in place (per tensor), along the pairwise tree of worker/adasum.py:
    one alltoall per step (each rank sends its vector to its partner of that step). Runs to
    completion here; the handle it returns is done."""
    if not _is_global(process_set):
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
            waiting.wait(r, _issue(r, lambda pg: pg.alltoall_base(out, inp, col, row, opts), what,
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


# --------------------------------------------------------------------------- broadcast


def _root_index(r: Round, root_rank: int, process_set: ProcessSet | None,
                on: torch.Tensor | None = None) -> tuple[Any, int]:
    """(group or None for the round's, root's rank in it): roots are global ranks, as in Horovod."""
    if _is_global(process_set):
        return None, root_rank
    assert process_set is not None  # not global
    pg, _, _, members = _group(r, process_set, on)
    if root_rank not in members:
        raise ValueError(f"root rank {root_rank} is not a member of {process_set}")
    return pg, members.index(root_rank)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """Start overwriting ``tensor`` on every rank with its value on ``root_rank`` (a global rank)."""
    what = f"broadcast {name or tuple(tensor.shape)} from rank {root_rank}"
    r = rounds.current()
    if not trusted:
        _check_name(r, name, what)
        _agree(r, _signature("broadcast", name, [tensor], process_set, shape=tuple(tensor.shape), root=root_rank),
               what, process_set)
    pg, root = _root_index(r, root_rank, process_set, tensor)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    # A dtype the backends refuse (int16, complex, ...) travels as its bytes; a tensor that is
    # not contiguous through a contiguous copy, written back when it arrives.
    held = tensor if tensor.is_contiguous() else tensor.contiguous()
    wire = held if held.dtype in _GLOO_DTYPES else held.reshape(-1).view(torch.uint8)
    if pg is None:
        work = _issue(r, lambda g: g.broadcast([wire], opts), what, ops.Broadcast(wire.shape, wire.dtype, root),
                      on=wire)
    else:
        work = _issue(r, lambda g: g.broadcast([wire], opts), what, pg=pg)

    def finish() -> torch.Tensor:
        if held is not tensor:
            tensor.copy_(held)
        return tensor
    return waiting.handle(work, what, finish, None if trusted else name)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """Start a broadcast into a copy of ``tensor`` (the input is not modified)."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set, trusted=trusted)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> torch.Tensor:
    """Overwrite ``tensor`` on every rank with its value on ``root_rank``."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set, trusted=trusted))


# --------------------------------------------------------------------------- allgather


def allgather_same(tensor: torch.Tensor, what: str, process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """Gather equally shaped tensors and wait; one tensor per member, in member order."""
    h = _allgather_same_async(tensor, what, process_set)
    return synchronize(h)


def _allgather_same_async(tensor: torch.Tensor, what: str, process_set: ProcessSet | None = None) -> Handle:
    r = rounds.current()
    t = tensor.contiguous()
    if _is_global(process_set):
        outputs = [torch.empty_like(t) for _ in range(r.size)]
        work = _issue(r, lambda pg: pg.allgather([outputs], [t]), what, ops.Allgather(t.shape, t.dtype), on=t)
    else:
        assert process_set is not None  # not global
        pg, _, size, _ = _group(r, process_set, t)
        outputs = [torch.empty_like(t) for _ in range(size)]
        work = _issue(r, lambda g: g.allgather([outputs], [t]), what, pg=pg)
    return waiting.handle(work, what, lambda: outputs)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.reshape(1) if t.dim() == 0 else t


#: dtypes gloo's allgather and alltoall take as they are; others (complex, int16, float8, ...)
#: travel as their bytes.
_GLOO_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                          torch.int32, torch.int64, torch.bool})


def _wire(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """What a contiguous tensor goes over gloo as, and how many of its units one row is: the
    tensor itself (a row is a row) when gloo takes its dtype, else a flat uint8 view of its
    bytes (no copy; a dtype view costs ~10 us, so only when needed)."""
    if t.dtype in _GLOO_DTYPES:
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
    if _is_global(process_set):
        return _Group(None, r.size, r.rank, ())
    assert process_set is not None  # not global
    pg, me, size, members = _group(r, process_set)
    return _Group(pg, size, me, members)


def _on(r: Round, g: _Group, start: Callable[[Any], Any], what: str, desc: Op,
        on: torch.Tensor | None = None) -> Any:
    """Issue on the group of ``g`` (its NCCL group for a CUDA ``on`` where the round has NCCL);
    descriptors only for the round's (joined ranks answer those)."""
    if g.pg is None:
        return _issue(r, start, what, desc, on=on)
    pg = device_group(r, g.key, on) if on is not None and on_device(r, on) else g.pg
    return _issue(r, start, what, pg=pg)


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
        _check_name(r, name, what)
        _agree(r, _signature("allgather", name, ts, process_set, rows_of=tuple(tuple(t.shape[1:]) for t in ts)),
               what, process_set)
    g = _where(r, process_set)
    key = ("allgather", name, tuple((t.dtype, tuple(t.shape[1:])) for t in ts))
    cache = _capacities(r, g.key)
    row_bytes = [math.prod(t.shape[1:]) * t.element_size() for t in ts]
    caps = capacities.usable(cache.get(key) or (0,) * len(ts), row_bytes)
    counts = torch.tensor([t.shape[0] for t in ts], dtype=torch.int64)
    table_out = torch.empty(g.size * len(ts), dtype=torch.int64)
    kind = "cuda" if ts and on_device(r, ts[0]) else "cpu"  # a joined rank makes its no-rows tensors there
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


# --------------------------------------------------------------------------- alltoall, reducescatter


def _even_split(rows: int, size: int) -> list[int]:
    """``rows`` split over ``size`` ranks, the first ``rows % size`` ranks one more (as Horovod)."""
    base, extra = divmod(rows, size)
    return [base + (1 if i < extra else 0) for i in range(size)]


def alltoall_async(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None,
                   name: str | None = None, process_set: ProcessSet = global_process_set, *,
                   trusted: bool = False) -> Handle:
    """Start sending ``splits[i]`` rows of ``tensor`` (in order) to member ``i`` and receiving what
    every member sends here; ``synchronize`` returns ``(output, received_splits)``. Without
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
        sends = _even_split(t.shape[0], g.size)
        splits_dtype = torch.int32
    else:
        splits_dtype = splits.dtype if isinstance(splits, torch.Tensor) else torch.int32
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
        _check_name(r, name, what)
        a, b = agreement.words(_signature("alltoall", name, [t], process_set, rest=rest_shape))
    three = [3] * g.size
    counts = torch.tensor([x for n in sends for x in (n, a, b)], dtype=torch.int64)
    received_t = torch.empty(3 * g.size, dtype=torch.int64)
    tag = _Tag(ops.VarAlltoall(name, t.dtype, rest_shape, "cuda" if on_device(r, t) else "cpu"))
    waiting.wait(r, _on(r, g, lambda pg: pg.alltoall_base(received_t, counts, three, three, opts), what + ".splits", tag()),
          what + ".splits")
    table = received_t.tolist()
    if not trusted and any((sa, sb) != (a, b) and (sa, sb) != (0, 0) for sa, sb in zip(table[1::3], table[2::3])):
        _disagreed(r, _signature("alltoall", name, [t], process_set, rest=rest_shape), process_set)
    received = table[0::3]
    received_t = torch.tensor(received, dtype=torch.int64)
    out = t.new_empty((sum(received),) + rest_shape)
    (send, row), (recv, _) = _wire(t), _wire(out)
    sb, rb = ([n * row for n in sends], [n * row for n in received]) if row != 1 else (sends, received)
    work = _on(r, g, lambda pg: pg.alltoall_base(recv, send, rb, sb, opts), what, tag(), on=t)
    return waiting.handle(work, what, lambda: (out, received_t.to(splits_dtype)), None if trusted else name)


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
        _scale(t, prescale)  # in the tensor's own dtype, integers too
    counts = _even_split(t.shape[0], size)
    mine = counts[me]
    rest = tuple(t.shape[1:])
    out = t.new_empty((size * mine,) + rest)
    opts = dist.AllToAllOptions()
    recv = [mine] * size
    if _is_global(process_set):
        work = _issue(r, lambda pg: pg.alltoall_base(out, t, recv, counts, opts), what,
                      ops.Alltoall(rest, t.dtype, tuple(tuple(counts) for _ in range(size))), on=t)
    else:
        assert process_set is not None  # not global
        pg, _, _, _ = _group(r, process_set, t)
        work = _issue(r, lambda g: g.alltoall_base(out, t, recv, counts, opts), what, pg=pg)

    def finish(postscale: float) -> torch.Tensor:
        result = out.view((size, mine) + rest).sum(0, dtype=out.dtype) if size > 1 else out.clone()
        _scale(result, postscale / size if op == Average else postscale)
        return result
    return work, finish


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int | str = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, trusted: bool = False) -> Handle:
    """Start reducing ``tensor`` over the ranks and scattering the result along dim 0: member
    ``i`` gets rows ``[sum(counts[:i]), ...)`` of the reduction, the first ``rows % size``
    members one row more (as Horovod). The input is not modified."""
    op = op_value(op)
    if op not in (Average, Sum):
        raise UnsupportedOperation("reducescatter supports op=Average or op=Sum")
    what = f"reducescatter {name or tuple(tensor.shape)}"
    if not trusted:
        r = rounds.current()
        _check_name(r, name, what)
        _agree(r, _signature("reducescatter", name, [tensor], process_set, op=op, shape=tuple(tensor.shape)),
               what, process_set)
    work, finish = _reducescatter_issue(tensor, what, op, prescale_factor, process_set)
    return waiting.handle(work, what, lambda: finish(postscale_factor), None if trusted else name)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: str | None = None, op: int | str = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0, *, trusted: bool = False) -> Handle:
    """:func:`reducescatter_async` of each tensor; ``synchronize`` returns the list of results."""
    op = op_value(op)
    if op not in (Average, Sum):
        raise UnsupportedOperation("reducescatter supports op=Average or op=Sum")
    what = f"grouped reducescatter {name or len(tensors)}"
    if not trusted:
        r = rounds.current()
        _check_name(r, name, what)
        _agree(r, _signature("grouped reducescatter", name, list(tensors), process_set, op=op,
                             shape=tuple(tuple(t.shape) for t in tensors)), what, process_set)
    parts = [_reducescatter_issue(t, what, op, prescale_factor, process_set) for t in tensors]
    return waiting.handle(waiting.Works([w for w, _ in parts]), what, lambda: [f(postscale_factor) for _, f in parts],
                   None if trusted else name)


# --------------------------------------------------------------------------- objects, barrier


def _bytes(t: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor, without numpy (not a dependency: ``tensor.numpy()``
    fails with "Numpy is not available" where it is not installed)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Any:
    """Send a picklable object from ``root_rank`` to every rank (cloudpickle)."""
    r = rounds.current()
    if not trusted:
        _agree(r, dict(collective="broadcast_object", name=name, root=root_rank, process_set=_ps_id(process_set)),
               f"broadcast_object {name or ''}", process_set)
    is_root = r.rank == root_rank
    payload = cloudpickle.dumps(obj) if is_root else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    broadcast_(length, root_rank, f"{name or 'object'}.size", process_set, trusted=True)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if is_root
            else torch.empty(int(length.item()), dtype=torch.uint8))
    broadcast_(data, root_rank, name or "object", process_set, trusted=True)
    return obj if is_root else cloudpickle.loads(_bytes(data))


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather a picklable object from every rank into a list ordered by rank. A rank in
    ``join()`` contributes None."""
    data = torch.frombuffer(bytearray(cloudpickle.dumps(obj)), dtype=torch.uint8)
    counts = [int(c.item()) for c in allgather_same(torch.tensor([data.numel()], dtype=torch.int64),
                                                   f"{name or 'allgather_object'}.size", process_set)]
    padded = torch.cat([data, data.new_zeros(max(counts) - data.numel())])
    parts = allgather_same(padded, name or "allgather_object", process_set)
    return [cloudpickle.loads(_bytes(p[:n])) if n else None for p, n in zip(parts, counts)]


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank (of the process set) has reached the barrier."""
    if _is_global(process_set):
        allreduce_inplace(torch.zeros(1), dist.ReduceOp.SUM, "barrier")
    else:
        allreduce_(torch.zeros(1), op=Sum, name="barrier", process_set=process_set, trusted=True)
