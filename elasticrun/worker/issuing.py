"""What every collective goes through: the op constants, issuing on the round's groups (with
the descriptor a rank in ``join()`` mirrors), process sets' groups, and the agreement of
arguments before a user's collective.

An operation starts here (:func:`issue`): the round's abort is checked, a CUDA tensor goes
over the round's NCCL group where it has one, and an operation on the round's group is
counted and its descriptor (``worker/descriptors.py``) remembered, so that ``worker/join.py``
can mirror it. The op families (``reductions.py``, ``gathers.py``, ``broadcast.py``) build on
this module; ``collectives.py`` is the public face that gathers them. :func:`agree` and the
small gather it reports a mismatch with (:func:`allgather_object`) live here so that every
family may check its arguments without importing another family.

The op constants are Horovod's integers (``hvd.Average`` is 0, ``hvd.Sum`` 1, ``hvd.Adasum``
2, ``hvd.Min`` 3, ``hvd.Max`` 4, ``hvd.Product`` 5); the names earlier versions used
(``"average"``, ``"sum"``, ...) are still accepted.
"""

from __future__ import annotations

import ctypes
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from elasticrun.worker import agreement, devices, process_sets, rounds, sealing, waiting
from elasticrun.worker import descriptors as ops
from elasticrun.worker.agreement import CollectiveMismatch
from elasticrun.worker.descriptors import Op
from elasticrun.worker.exceptions import HorovodInternalError
from elasticrun.worker.process_sets import ProcessSet, global_process_set
from elasticrun.worker.rounds import Round
from elasticrun.worker.waiting import Handle, synchronize


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
TORCH_OPS: dict[int, Any] = {Average: dist.ReduceOp.SUM, Sum: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN,
                             Max: dist.ReduceOp.MAX, Product: dist.ReduceOp.PRODUCT}
#: gloo reduction -> its name in descriptors (what a joined rank contributes depends on it).
TORCH_OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max",
                  dist.ReduceOp.PRODUCT: "product"}


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


def issue(r: Round, start: Callable[[Any], Any], what: str, desc: Op | None = None,
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
    r.track(work)  # held until it completes, even if abandoned (see Round.track)
    if device or (not main and any(pg is g for g in r.device_groups.values())):
        return waiting.Polled(work)
    return work


def group_of(r: Round, process_set: ProcessSet,
             on: torch.Tensor | None = None) -> tuple[Any, int, int, tuple[int, ...]]:
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


def is_global(process_set: ProcessSet | None) -> bool:
    return process_set is None or process_set is global_process_set


def ps_id(process_set: ProcessSet | None) -> Any:
    """A process set as the ranks must agree on it: by its ranks in this round (its group is
    formed from them), not by its id, which is the order this process registered it in. Ranks
    that registered the same ranks in another order (or a newcomer that registered fewer sets
    than the survivors, which re-register theirs in a reset callback) use one group, and
    their collectives on it run as they should."""
    if process_set is None or is_global(process_set):
        return 0
    r = rounds.installed()
    return tuple(process_sets.members(process_set, r)) if r is not None else tuple(process_set.ranks or ())


def agree(r: Round, signature: dict[str, Any], what: str, process_set: ProcessSet | None = None) -> None:
    """Collective, before a user's collective: every rank of the group submitted the same
    ``signature`` (see worker/agreement.py), or every rank raises :class:`CollectiveMismatch`
    saying which ranks differed in what. One tiny allgather of digests on the CPU group (one
    message each way: the cheapest exchange gloo has, ~0.14 ms on 2 ranks here); the full
    signatures travel only when they differ. A rank in ``join()`` sends zeros, which match any."""
    if is_global(process_set):
        pg, size = None, r.size
    else:
        assert process_set is not None  # not global
        pg, _, size, _ = group_of(r, process_set)
    if size == 1:
        return
    mine = agreement.words(signature)
    t = torch.tensor(mine, dtype=torch.int64)
    out = torch.empty(2 * size, dtype=torch.int64)
    label = f"{what} (its arguments)"
    start = lambda g: g._allgather_base(out, t)  # noqa: E731
    work = issue(r, start, label, ops.Allgather(t.shape, t.dtype)) if pg is None else issue(r, start, label, pg=pg)
    waiting.wait(r, work, label)
    words = out.tolist()
    if all((x, y) == mine or (x, y) == (0, 0) for x, y in zip(words[0::2], words[1::2])):
        return
    disagreed(r, signature, process_set)


def check_call(r: Round, kind: str, name: str | None, tensors: Sequence[torch.Tensor],
               process_set: ProcessSet | None, what: str, **more: Any) -> None:
    """Before a user's collective: its name is not in flight (:func:`check_name`) and every rank
    submitted the same arguments (:func:`agree` on :func:`signature`)."""
    check_name(r, name, what)
    agree(r, signature(kind, name, tensors, process_set, **more), what, process_set)


def disagreed(r: Round, signature: dict[str, Any] | None, process_set: ProcessSet | None) -> None:
    """The ranks' signatures differ: gather them and raise the same error on every rank."""
    signatures = allgather_object(signature, name="collective signatures",
                                  process_set=process_set if process_set is not None else global_process_set)
    members = process_sets.members(process_set, r)
    raise CollectiveMismatch(agreement.message(signatures, members), signatures, members)


def check_name(r: Round, name: str | None, what: str) -> None:
    """Horovod's rule: two operations in flight at once cannot share a name (each rank knows
    its own: every rank raises the same error at the same call)."""
    if name is not None and name in r.in_flight:
        raise ValueError(f"{what}: an operation named {name!r} is already in progress; names of collectives in "
                         f"flight at the same time must differ (as in Horovod)")


def resolve_op(op: int | str | None, average: bool | None) -> int:
    if op is not None and average is not None:
        raise ValueError("pass either op or the deprecated average argument, not both")
    if average is not None:
        # Horovod's words and category: a script that turns DeprecationWarnings into errors
        # (pytest -W error) finds the same call here.
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average if op is None else op_value(op)


class UnsupportedOperation(RuntimeError, ValueError):
    """An op a collective does not support (Horovod raises RuntimeError; a ValueError too, as
    elasticrun raised before)."""


def scale(t: torch.Tensor, factor: float) -> None:
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


def signature(kind: str, name: str | None, tensors: Sequence[torch.Tensor], process_set: ProcessSet | None,
               **more: Any) -> dict[str, Any]:
    """What every rank must submit alike to a collective (see worker/agreement.py)."""
    return dict(more, collective=kind, name=name, process_set=ps_id(process_set),
                dtype=tuple(str(t.dtype) for t in tensors), device=tuple(t.device.type for t in tensors))


#: dtypes gloo's allgather and alltoall take as they are; others (complex, int16, float8, ...)
#: travel as their bytes.
GLOO_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                          torch.int32, torch.int64, torch.bool})


def even_split(rows: int, size: int) -> list[int]:
    """``rows`` split over ``size`` ranks, the first ``rows % size`` ranks one more (as Horovod)."""
    base, extra = divmod(rows, size)
    return [base + (1 if i < extra else 0) for i in range(size)]


def allgather_same(tensor: torch.Tensor, what: str, process_set: ProcessSet | None = None) -> list[torch.Tensor]:
    """Gather equally shaped tensors and wait; one tensor per member, in member order."""
    h = allgather_same_async(tensor, what, process_set)
    return synchronize(h)


def allgather_same_async(tensor: torch.Tensor, what: str, process_set: ProcessSet | None = None) -> Handle:
    r = rounds.current()
    t = tensor.contiguous()
    if is_global(process_set):
        outputs = [torch.empty_like(t) for _ in range(r.size)]
        work = issue(r, lambda pg: pg.allgather([outputs], [t]), what, ops.Allgather(t.shape, t.dtype), on=t)
    else:
        assert process_set is not None  # not global
        pg, _, size, _ = group_of(r, process_set, t)
        outputs = [torch.empty_like(t) for _ in range(size)]
        work = issue(r, lambda g: g.allgather([outputs], [t]), what, pg=pg)
    return waiting.handle(work, what, lambda: outputs)


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The bytes of a uint8 tensor, without numpy (not a dependency: ``tensor.numpy()``
    fails with "Numpy is not available" where it is not installed)."""
    t = t.contiguous()
    return ctypes.string_at(t.data_ptr(), t.numel()) if t.numel() else b""


def allgather_object(obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set) -> list[Any]:
    """Gather a picklable object from every rank into a list ordered by rank. A rank in
    ``join()`` contributes None."""
    # Each rank seals its own pickle with the job's secret: gloo's connections are not
    # authenticated (worker/sealing.py). Bound to the sender's place in the set.
    r = rounds.current()
    members = process_sets.members(process_set, r)
    me = members.index(r.rank) if r.rank in members else -1

    def context(i: int) -> str:  # (the set by its ranks, not its id: see ps_id)
        return f"allgather_object|round {r.number}|set {','.join(map(str, members))}|member {i}|{name}"

    data = torch.frombuffer(bytearray(sealing.seal(cloudpickle.dumps(obj), context(me), len(members))),
                            dtype=torch.uint8)
    counts = [int(c.item()) for c in allgather_same(torch.tensor([data.numel()], dtype=torch.int64),
                                                   f"{name or 'allgather_object'}.size", process_set)]
    what = name or "allgather_object"
    if max(counts) > MAX_OBJECT or min(counts) < 0:  # (a length a stranger wrote: no allocation of it)
        raise HorovodInternalError(f"{what}: a size of {max(counts)} bytes came over gloo; not from a rank of this job")
    padded = torch.cat([data, data.new_zeros(max(counts) - data.numel())])
    parts = allgather_same(padded, what, process_set)
    return [cloudpickle.loads(sealing.opened(tensor_bytes(p[:n]), context(i), what, len(members))) if n else None
            for i, (p, n) in enumerate(zip(parts, counts))]


#: More than any host holds: an object's length above it was not written by a rank of the job.
MAX_OBJECT = 1 << 40
