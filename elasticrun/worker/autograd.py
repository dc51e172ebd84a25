"""The differentiable collectives: ``hvd.allreduce``, ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter`` and the grouped ones, as ``torch.autograd.Function``s (as in horovod.torch).

Gradients flow through them the way Horovod defines it, each backward being the matching
collective of the incoming gradients:

* allreduce: the same allreduce (same op and scale factors) of the gradients;
* allgather: the average over the ranks of the gradients, then this rank's rows;
* broadcast: the average over the ranks of the gradients on the root, zeros elsewhere;
* alltoall: an alltoall of the gradients sending back what was received (``received_splits``);
* reducescatter: an allgather of the gradients, times the size for ``op=Sum``, times the
  scale factors.

Every backward is a collective, so every rank must run backward through the same ones. A
forward checks first that every rank submitted the same (worker/agreement.py); a backward is
trusted: the shapes it reduces are those its forward agreed on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from elasticrun.worker import collectives, process_sets, rounds
from elasticrun.worker.collectives import Average, Sum
from elasticrun.worker.optimizer import Compression, Compressor
from elasticrun.worker.process_sets import ProcessSet, global_process_set

__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "broadcast",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "reducescatter",
]


class _Untracked:
    """The ``ctx`` a Function's forward gets when it runs without autograd (see :func:`_apply`)."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        pass


def _apply(fn: type[torch.autograd.Function], inputs: Sequence[torch.Tensor], *args: Any) -> Any:
    """``fn.apply(*args)`` when a gradient can flow from ``inputs``; otherwise its forward
    alone: autograd's bookkeeping costs ~0.1 ms a call on a busy 2-core machine, a tenth of a
    1 MiB alltoall, for a graph nobody will walk back."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
        return fn.apply(*args)
    return fn.forward(_Untracked(), *args)


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, average: bool | None, name: str | None, op: Any,
                prescale: float, postscale: float, process_set: ProcessSet, trusted: bool = False) -> torch.Tensor:
        ctx.args = (average, op, prescale, postscale, process_set)
        return collectives.synchronize(collectives.allreduce_async(tensor, average, name, op, prescale, postscale,
                                                                   process_set, trusted=trusted))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        average, op, prescale, postscale, process_set = ctx.args
        reduced = _apply(_Allreduce, (grad,), grad, average, None, op, prescale, postscale, process_set, True)
        return reduced, None, None, None, None, None, None, None


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: type[Compressor] = Compression.none, op: int | str | None = None,
              prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """The reduction of ``tensor`` over all ranks (``op=Average`` by default); the input is not
    modified. Differentiable. ``compression`` compresses what travels (e.g. fp16)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"hvd.allreduce takes a tensor, not {type(tensor).__name__}: reduce torch.tensor(value) "
                        f"(hvd.allgather_object gathers any picklable object)")
    compressed, ctx = compression.compress(tensor)
    out = _apply(_Allreduce, (compressed,), compressed, average, name, op, prescale_factor, postscale_factor,
                 process_set)
    return compression.decompress(out, ctx)


class _GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, average: bool | None, name: str | None, op: Any, prescale: float, postscale: float,
                process_set: ProcessSet, trusted: bool, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(collectives.synchronize(collectives.grouped_allreduce_async(
            list(tensors), average, name, op, prescale, postscale, process_set, trusted=trusted)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        average, op, prescale, postscale, process_set = ctx.args
        reduced = _apply(_GroupedAllreduce, grads, average, None, op, prescale, postscale, process_set, True, *grads)
        return (None, None, None, None, None, None, None, *reduced)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: type[Compressor] = Compression.none, op: int | str | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """The reductions of ``tensors`` (fused into one buffer per dtype); differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    compressed = [t for t, _ in pairs]
    out = _apply(_GroupedAllreduce, compressed, average, name, op, prescale_factor, postscale_factor, process_set,
                 False, *compressed)
    return [compression.decompress(t, c) for t, (_, c) in zip(out, pairs)]


def _own_rows(grad: torch.Tensor, rows: int, process_set: ProcessSet) -> torch.Tensor:
    """This rank's rows of an allgathered gradient (Horovod: averaged over the ranks first)."""
    reduced = collectives.allreduce_(grad.contiguous().clone(), op=Average, process_set=process_set, trusted=True)
    counts = torch.cat(collectives.allgather_same(torch.tensor([rows], dtype=torch.int64), "grad.rows", process_set))
    me = _position(process_set)
    offset = int(counts[:me].sum()) if me else 0
    return reduced.narrow(0, offset, rows)


def _position(process_set: ProcessSet) -> int:
    r = rounds.current()
    return process_sets.members(process_set, r).index(r.rank)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, process_set: ProcessSet) -> torch.Tensor:
        ctx.rows = tensor.shape[0] if tensor.dim() else 1
        ctx.scalar = tensor.dim() == 0
        ctx.process_set = process_set
        return collectives.synchronize(collectives.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        g = _own_rows(grad, ctx.rows, ctx.process_set)
        return (g.reshape(()) if ctx.scalar else g), None, None


def allgather(tensor: torch.Tensor, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``tensor`` from every rank concatenated along dim 0 (first dimensions may differ);
    differentiable."""
    return _apply(_Allgather, (tensor,), tensor, name, process_set)


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, process_set: ProcessSet, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.rows = [t.shape[0] if t.dim() else 1 for t in tensors]
        ctx.process_set = process_set
        return tuple(collectives.grouped_allgather(list(tensors), name, process_set))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *[_own_rows(g, n, ctx.process_set) for g, n in zip(grads, ctx.rows)])


def grouped_allgather(tensors: Sequence[torch.Tensor], name: str | None = None,
                      process_set: ProcessSet = global_process_set) -> list[torch.Tensor]:
    """:func:`allgather` of each tensor, with one exchange of row counts; differentiable."""
    return list(_apply(_GroupedAllgather, tensors, name, process_set, *tensors))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None,
                process_set: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return collectives.synchronize(collectives.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        reduced = collectives.allreduce_(grad.contiguous().clone(), op=Average, process_set=ctx.process_set,
                                         trusted=True)
        if rounds.current().rank != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None, None


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """``tensor`` as it is on ``root_rank``; the input is not modified. Differentiable."""
    return _apply(_Broadcast, (tensor,), tensor, root_rank, name, process_set)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: ProcessSet) -> Any:
        out, received = collectives.synchronize(collectives.alltoall_async(tensor, splits, name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: Any) -> Any:
        back, _ = collectives.synchronize(collectives.alltoall_async(grad.contiguous(), ctx.received,
                                                                     process_set=ctx.process_set, trusted=True))
        return back, None, None, None


def alltoall(tensor: torch.Tensor, splits: Sequence[int] | torch.Tensor | None = None, name: str | None = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send ``splits[i]`` rows of ``tensor`` to rank ``i`` and return the rows received, in rank
    order; with ``splits`` given, also the received splits (``(output, received_splits)``), as
    Horovod. Differentiable."""
    return _apply(_Alltoall, (tensor,), tensor, splits, name, process_set)


def _reducescatter_grad(grad: torch.Tensor, op: int, prescale: float, postscale: float,
                        process_set: ProcessSet) -> torch.Tensor:
    g = grad.contiguous()
    factor = prescale * postscale * (len(process_sets.members(process_set, rounds.current())) if op == Sum else 1)
    if factor != 1.0:
        g = g * factor
    return collectives.grouped_allgather([g], "reducescatter.grad", process_set, trusted=True)[0]


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, op: int, process_set: ProcessSet,
                prescale: float, postscale: float) -> torch.Tensor:
        ctx.args = (collectives.op_value(op), prescale, postscale, process_set)
        return collectives.synchronize(collectives.reducescatter_async(tensor, name, op, process_set, prescale,
                                                                       postscale))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        op, prescale, postscale, process_set = ctx.args
        return _reducescatter_grad(grad, op, prescale, postscale, process_set), None, None, None, None, None


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: type[Compressor] = Compression.none,
                  op: int | str = Average, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> torch.Tensor:
    """This rank's rows of the reduction of ``tensor`` over the ranks (see
    ``collectives.reducescatter_async``); differentiable."""
    compressed, ctx = compression.compress(tensor)
    out = _apply(_Reducescatter, (compressed,), compressed, name, op, process_set, prescale_factor, postscale_factor)
    return compression.decompress(out, ctx)


class _GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, name: str | None, op: int, process_set: ProcessSet, prescale: float, postscale: float,
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.args = (collectives.op_value(op), prescale, postscale, process_set)
        return tuple(collectives.synchronize(collectives.grouped_reducescatter_async(
            list(tensors), name, op, process_set, prescale, postscale)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        op, prescale, postscale, process_set = ctx.args
        return (None, None, None, None, None,
                *[_reducescatter_grad(g, op, prescale, postscale, process_set) for g in grads])


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: str | None = None,
                          compression: type[Compressor] = Compression.none, op: int | str = Average,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """:func:`reducescatter` of each tensor; differentiable."""
    pairs = [compression.compress(t) for t in tensors]
    compressed = [t for t, _ in pairs]
    out = _apply(_GroupedReducescatter, compressed, name, op, process_set, prescale_factor, postscale_factor,
                 *compressed)
    return [compression.decompress(t, c) for t, (_, c) in zip(out, pairs)]
