"""The broadcasts: a tensor (``hvd.broadcast``), a picklable object, and a model's or an
optimizer's state (``hvd.broadcast_parameters``, ``hvd.broadcast_optimizer_state``) from one
rank to all.

A model's tensors travel as raw bytes packed into few large broadcasts (any dtype, bool
included; chunks of at most 64 MiB; tensors of 1 MiB and more from and into their own
storage), and an optimizer's state dict as a picklable skeleton plus its tensors, so a rank
whose optimizer never stepped receives complete state. Used by users directly (as in
horovod) and by the state handlers' ``sync``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import cloudpickle
import torch
import torch.distributed as dist

from elasticrun.worker import devices, issuing, process_sets, rounds, sealing, waiting
from elasticrun.worker import descriptors as ops
from elasticrun.worker.exceptions import HorovodInternalError
from elasticrun.worker.process_sets import ProcessSet, global_process_set
from elasticrun.worker.rounds import Round
from elasticrun.worker.waiting import Handle, synchronize

__all__ = ["broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_parameters",
           "broadcast_optimizer_state", "sync_optimizer_state"]

_ALIGN = 16  # byte offsets stay aligned so that views of the flat buffer can be any dtype
_BCAST_CHUNK_BYTES = 64 << 20
_IN_PLACE_BYTES = 1 << 20  # tensors this large are broadcast from and into their own storage
_OBJECT_HEAD = 4096  # broadcast_object's first broadcast: a length and up to this much of the pickle


# ------------------------------------------------------------------- a tensor, an object


def _root_index(r: Round, root_rank: int, process_set: ProcessSet | None,
                on: torch.Tensor | None = None) -> tuple[Any, int]:
    """(group or None for the round's, root's rank in it): roots are global ranks, as in Horovod."""
    if issuing.is_global(process_set):
        return None, root_rank
    assert process_set is not None  # not global
    pg, _, _, members = issuing.group_of(r, process_set, on)
    if root_rank not in members:
        raise ValueError(f"root rank {root_rank} is not a member of {process_set}")
    return pg, members.index(root_rank)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Handle:
    """Start overwriting ``tensor`` on every rank with its value on ``root_rank`` (a global rank)."""
    what = f"broadcast {name or tuple(tensor.shape)} from rank {root_rank}"
    r = rounds.current()
    if not trusted:
        issuing.check_call(r, "broadcast", name, [tensor], process_set, what, shape=tuple(tensor.shape), root=root_rank)
    pg, root = _root_index(r, root_rank, process_set, tensor)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    # A dtype the backends refuse (int16, complex, ...) travels as its bytes; a tensor that is
    # not contiguous through a contiguous copy, written back when it arrives.
    held = tensor if tensor.is_contiguous() else tensor.contiguous()
    wire = held if held.dtype in issuing.GLOO_DTYPES else held.reshape(-1).view(torch.uint8)
    if pg is None:
        work = issuing.issue(r, lambda g: g.broadcast([wire], opts), what, ops.Broadcast(wire.shape, wire.dtype, root),
                             on=wire)
    else:
        work = issuing.issue(r, lambda g: g.broadcast([wire], opts), what, pg=pg)

    def finish() -> torch.Tensor:
        if held is not tensor:
            tensor.copy_(held)
        elif r.rank != root_rank:  # gloo wrote it behind torch's back: say so, as an in-place op would
            torch.autograd.graph.increment_version(tensor)
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


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set, *, trusted: bool = False) -> Any:
    """Send a picklable object from ``root_rank`` to every rank (cloudpickle)."""
    r = rounds.current()
    if not trusted:
        issuing.agree(r, dict(collective="broadcast_object", name=name, root=root_rank,
                              process_set=issuing.ps_id(process_set)), f"broadcast_object {name or ''}", process_set)
    is_root = r.rank == root_rank
    if is_root and r.size == 1 and issuing.is_global(process_set):  # nobody to send it to
        waiting.solo(r, f"broadcast_object {name or ''}")
        return obj
    # Sealed with the job's secret: gloo's connections are not authenticated (worker/sealing.py).
    ranks = process_sets.members(process_set, r)  # (the set by its ranks: see issuing.allgather_object)
    context = f"broadcast_object|round {r.number}|root {root_rank}|set {','.join(map(str, ranks))}|{name}"
    size = len(ranks)
    payload = sealing.seal(cloudpickle.dumps(obj), context, size) if is_root else b""
    # One broadcast carries the length and, when they fit, the bytes too (an object is usually
    # small, and every sync broadcasts one: a round trip saved); a second carries the rest.
    head = bytearray(_OBJECT_HEAD)
    if is_root:
        head[:8] = len(payload).to_bytes(8, "little")
        if len(payload) <= _OBJECT_HEAD - 8:
            head[8:8 + len(payload)] = payload
    broadcast_(torch.frombuffer(head, dtype=torch.uint8), root_rank, f"{name or 'object'}.head", process_set,
               trusted=True)  # (gloo writes into ``head`` itself: the tensor shares its memory)
    if is_root:
        if len(payload) > _OBJECT_HEAD - 8:
            broadcast_(torch.frombuffer(bytearray(payload), dtype=torch.uint8), root_rank, name or "object",
                       process_set, trusted=True)
        return obj
    length = int.from_bytes(head[:8], "little")
    what = f"broadcast_object {name or ''}".rstrip()
    if length <= _OBJECT_HEAD - 8:
        return cloudpickle.loads(sealing.opened(bytes(head[8:8 + length]), context, what, size))
    if length > issuing.MAX_OBJECT:  # (a length a stranger wrote: no allocation of it)
        raise HorovodInternalError(f"{what}: {length} bytes announced over gloo; not from a rank of this job")
    data = torch.empty(length, dtype=torch.uint8)
    broadcast_(data, root_rank, name or "object", process_set, trusted=True)
    return cloudpickle.loads(sealing.opened(issuing.tensor_bytes(data), context, what, size))


# ------------------------------------------------------------------- a model's or an optimizer's state


def _nbytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * dtype.itemsize


def _plan(sizes: list[int]) -> list[list[tuple[int, int, int]]]:
    """Split tensors (by byte size) into chunks of (index, offset, nbytes); same on all ranks."""
    chunks: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    offset = 0
    for i, nb in enumerate(sizes):
        if nb == 0:
            continue
        if current and offset + nb > _BCAST_CHUNK_BYTES:
            chunks.append(current)
            current, offset = [], 0
        current.append((i, offset, nb))
        offset += -(-nb // _ALIGN) * _ALIGN
    if current:
        chunks.append(current)
    return chunks


def _broadcast_tensors(tensors: list[torch.Tensor], root_rank: int, name: str,
                       process_set: ProcessSet = global_process_set) -> None:
    """Overwrite ``tensors`` in place with root's, packed as raw bytes into few broadcasts
    (so any dtype, bool included, goes through, and a model costs a handful of messages)."""
    r = rounds.current()
    if len(process_sets.members(process_set, r)) == 1:
        return
    is_root = r.rank == root_rank
    # Packed where they live: CUDA tensors in a buffer on their GPU (over NCCL where the round
    # has it, never through host memory), CPU tensors in a host buffer. CPU first, the same
    # order on every rank (every rank holds the same tensors on the same kinds of device).
    by_kind: dict[str, list[int]] = {}
    for i, t in enumerate(tensors):
        by_kind.setdefault(t.device.type, []).append(i)
    # One agreement for the whole call (a model that differs between ranks would otherwise make
    # the packed broadcasts differ in size): then the broadcasts themselves need none.
    issuing.agree(r, {"collective": name, "root": root_rank,
                      "tensors": tuple((str(t.dtype), tuple(t.shape), t.device.type) for t in tensors)},
                  name, process_set)
    n = 0
    with torch.no_grad():
        for kind in sorted(by_kind, key=lambda k: (k != "cpu", k)):
            members = by_kind[kind]
            device = tensors[members[0]].device
            # Large tensors go as they are (no staging buffer: a 1 GiB model would otherwise be
            # copied in on the root and out on every receiver, into freshly faulted pages: 6x
            # the time of the transfer itself); the small ones packed, a handful of messages.
            nbytes = {i: _nbytes(tensors[i].shape, tensors[i].dtype) for i in members}
            small = [i for i in members if nbytes[i] < _IN_PLACE_BYTES]
            for i in members:
                if nbytes[i] >= _IN_PLACE_BYTES:
                    n = _broadcast_in_place(tensors[i], root_rank, name, n, process_set)
            sizes = [nbytes[i] for i in small]
            for chunk in _plan(sizes):
                _, last_off, last_nb = chunk[-1]
                buf = torch.empty(last_off + last_nb, dtype=torch.uint8, device=device)
                if is_root:
                    for j, off, nb in chunk:
                        buf[off:off + nb].copy_(tensors[small[j]].detach().reshape(-1).view(torch.uint8))
                broadcast_(buf, root_rank, f"{name}[{n}]", process_set, trusted=True)
                n += 1
                if not is_root:
                    for j, off, nb in chunk:
                        t = tensors[small[j]]
                        t.copy_(buf[off:off + nb].view(t.dtype).view(t.shape))


def _broadcast_in_place(t: torch.Tensor, root_rank: int, name: str, n: int, process_set: ProcessSet) -> int:
    """Broadcast one large tensor's bytes straight from and into its storage, in slices of
    at most ``_BCAST_CHUNK_BYTES`` (an abort is noticed between them); the next message
    number. Every rank slices alike: the agreement checked shapes and dtypes, and a rank
    whose tensor is not contiguous (strides are its own) goes through a contiguous copy."""
    is_root = rounds.current().rank == root_rank
    dense = t.detach()
    if not dense.is_contiguous():
        dense = dense.contiguous()  # the root's values; a receiver's scratch, copied back below
    flat = dense.reshape(-1).view(torch.uint8)
    for off in range(0, flat.numel(), _BCAST_CHUNK_BYTES):
        broadcast_(flat[off:off + _BCAST_CHUNK_BYTES], root_rank, f"{name}[{n}]", process_set, trusted=True)
        n += 1
    if not is_root and dense.data_ptr() != t.data_ptr():
        t.copy_(dense)
    return n


def broadcast_parameters(params: Mapping[str, Any] | Iterable[Any], root_rank: int, prefix: str | None = None,
                         process_set: ProcessSet = global_process_set) -> None:
    """Overwrite parameters/buffers in place with ``root_rank``'s.

    ``params`` is ``model.state_dict()`` (sorted by name, so every rank agrees on the
    order) or ``model.named_parameters()`` / a list of tensors. Non-tensor entries (module
    extra state) are skipped. ``prefix`` only names the operations (errors, the timeline).
    """
    if isinstance(params, Mapping):
        items = sorted(params.items(), key=lambda kv: str(kv[0]))
    elif isinstance(params, Iterable):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type {type(params).__name__}")
    tensors = [t for _, t in items if isinstance(t, torch.Tensor)]
    _broadcast_tensors(tensors, root_rank, f"{prefix or ''}broadcast_parameters", process_set)


class _TensorSpec(NamedTuple):
    """Stands for a tensor in the picklable skeleton of an optimizer state dict."""

    number: int  # its position in the list of tensors sent beside the skeleton
    shape: tuple[int, ...]
    dtype: torch.dtype
    kind: str = "cpu"  # the root's device type: receivers make theirs on the same kind (the same group)


def _strip(obj: Any, out: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        out.append(obj)
        return _TensorSpec(len(out) - 1, tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, dict):
        return {k: _strip(v, out) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_strip(v, out) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_strip(v, out) for v in obj)
    return obj


def _fill(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, _TensorSpec):
        return tensors[obj.number]
    if isinstance(obj, dict):
        return {k: _fill(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, tensors) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_fill(v, tensors) for v in obj)
    return obj


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int,
                              model: torch.nn.Module | None = None,
                              process_set: ProcessSet = global_process_set) -> None:
    """Make every rank's optimizer state (per-parameter tensors such as momentum buffers
    and step counts, and every param_group option such as lr) equal to ``root_rank``'s.

    The structure goes by ``broadcast_object``, the tensors as raw bytes; receivers load
    the result with ``load_state_dict``, so a rank that never stepped (a newcomer with
    empty state) gets complete state without a dummy step. That is also why ``model``
    (which Horovod uses to give parameters whose state is still empty a name, so that
    every rank broadcasts the same entries) is accepted but not needed: the state dict of
    the root is what every rank loads.
    """
    del model
    sync_optimizer_state(optimizer, root_rank, process_set, process_set)


_SPARSE_KEY = "elasticrun_sparse_positions"


def _sparse_positions(optimizer: torch.optim.Optimizer) -> list[int]:
    """The positions (in ``param_groups`` order) of the parameters a DistributedOptimizer
    reduces as sparse, in the order it reduces them; [] for any other optimizer. (Read by
    attribute: worker/optimizer.py imports this module.)"""
    sparse = getattr(optimizer, "_dist_sparse", None)
    if not sparse:
        return []
    where = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    return [where[id(p)] for p in sparse if id(p) in where]


def _adopt_sparse(optimizer: torch.optim.Optimizer, positions: Sequence[int]) -> None:
    """Take the sync root's sparse parameters (:func:`_sparse_positions`), in its order.

    A rank learns that a parameter is sparse from its first sparse gradient and takes it out
    of its buckets. A newcomer's fresh optimizer has seen none, so its buckets still held the
    survivors' sparse embedding: every rank raised CollectiveMismatch at the first step after
    the job grew. The sync now hands the survivors' knowledge over, as it hands the state."""
    if not hasattr(optimizer, "_dist_sparse") or getattr(optimizer, "_dist_sparse_as_dense", True):
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    theirs = [params[i] for i in positions if 0 <= i < len(params)]
    mine = list(optimizer._dist_sparse)
    ordered = theirs + [p for p in mine if all(p is not q for q in theirs)]
    if [id(p) for p in ordered] == [id(p) for p in mine]:
        return
    optimizer._dist_sparse = {p: None for p in ordered}
    optimizer._dist_build()  # type: ignore[attr-defined]  # (a DistributedOptimizer: it has _dist_sparse)


def sync_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, process_set: ProcessSet,
                         receivers: ProcessSet | None) -> None:
    """:func:`broadcast_optimizer_state`, but the state's tensors go only to the members of
    ``receivers`` (None: to nobody). Every rank of ``process_set`` takes the root's
    param_group options; a rank outside ``receivers`` keeps its state tensors, which the
    caller knows equal the root's (worker/torch_state.py: a sync's holders of the newest
    commit), so that a sync sends a large state only to the ranks that lack it."""
    if not optimizer.state:
        # As Horovod's: an optimizer that never stepped gets zero gradients for its trainable
        # parameters that have none (Horovod makes them for the dummy step it takes there).
        for group in optimizer.param_groups:
            for p in group["params"]:
                if isinstance(p, torch.Tensor) and p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)
    r = rounds.current()
    if len(process_sets.members(process_set, r)) == 1:
        return
    tensors: list[torch.Tensor] = []
    skeleton = _strip(optimizer.state_dict(), tensors)
    # Which parameters a DistributedOptimizer reduces as sparse travels with the options: a
    # newcomer has not seen a gradient yet (see _adopt_sparse).
    skeleton[_SPARSE_KEY] = _sparse_positions(optimizer)
    skeleton = broadcast_object(skeleton, root_rank, "broadcast_optimizer_state.skeleton", process_set)
    _adopt_sparse(optimizer, skeleton.pop(_SPARSE_KEY, []))
    receiving = receivers is not None and r.rank in process_sets.members(receivers, r)
    if r.rank == root_rank:
        if receiving:
            assert receivers is not None  # receiving
            _broadcast_tensors(tensors, root_rank, "broadcast_optimizer_state", receivers)
        return
    if not receiving:
        for group, theirs in zip(optimizer.param_groups, skeleton["param_groups"]):
            group.update({k: v for k, v in theirs.items() if k != "params"})
        return
    assert receivers is not None  # receiving
    specs: list[_TensorSpec] = []
    _collect_specs(skeleton, specs)
    tensors = [torch.empty(s.shape, dtype=s.dtype, device=devices.kind_device(s.kind))
               for s in sorted(specs, key=lambda s: s.number)]
    _broadcast_tensors(tensors, root_rank, "broadcast_optimizer_state", receivers)
    load_keeping_groups(optimizer, _fill(skeleton, tensors))


def load_keeping_groups(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> None:
    """``optimizer.load_state_dict(state_dict)``, keeping its ``param_groups`` dicts and its
    ``state`` mapping: torch's replaces them with new ones, and an LR scheduler made before
    the optimizer was wrapped (or anything else holding a group) went on setting the learning
    rate in dicts the optimizer no longer used, on every rank but the root (Horovod's
    broadcast writes options and state in place, so scripts count on it)."""
    groups, state = optimizer.param_groups, optimizer.state
    theirs = len(state_dict.get("param_groups", ()))
    if theirs != len(groups):
        raise ValueError(
            f"the optimizer has {len(groups)} param group(s) here and {theirs} on the rank it is synced from: a group "
            f"added with add_param_group() after the job started is not in a new worker's optimizer, which is made "
            f"from the script's start. Make every group when the optimizer is made (one that should not train yet with "
            f"lr 0, set to its value later)")
    kept = list(groups)
    optimizer.load_state_dict(state_dict)
    for mine, loaded in zip(kept, optimizer.param_groups):
        mine.update({k: v for k, v in loaded.items() if k != "params"})
    loaded_state = dict(optimizer.state)
    groups[:] = kept
    optimizer.param_groups = groups
    state.clear()
    state.update(loaded_state)
    optimizer.state = state


def _collect_specs(obj: Any, out: list[_TensorSpec]) -> None:
    if isinstance(obj, _TensorSpec):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _collect_specs(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _collect_specs(v, out)
