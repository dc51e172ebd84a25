"""``hvd.join()``: a rank out of data keeps answering the others' collectives until all joined.

gloo matches collectives by the order they are issued in, so a rank that stopped training
must still take part in every operation the others run on the round's group, with the
right shape, dtype and reduction, or they would hang. It cannot guess them; the others
tell it. Every operation on the round's group carries a small descriptor
(``issuing.issue``, a class of ``descriptors.py``): kind, shape, dtype, reduction, root,
or the row counts of an alltoall. A rank that joins announces it on the round's store (the operation it stopped
at); a rank whose collective then waits notices within milliseconds, publishes the
descriptors of its operations from that one on, and of every later one as it issues it.
The joined rank reads them one by one and takes part with what changes nothing: zeros for
a sum (so an average still divides by the full size, as in Horovod), the identity of a
min, max or product, no rows in an allgather or alltoall, a zero vector in an Adasum.
The last rank to join ends it for everyone with its own rank, which ``join()`` returns.

Nothing of this runs while nobody has joined, except one store lookup by a collective that
has waited 10 ms (then at most every 0.2 s while it waits): the training hot path is
unchanged. A joined rank's waits are bounded by the collective timeout and give up when
the round is aborted, like any collective. Collectives on other process sets are not
answered by joined ranks.
"""

from __future__ import annotations

import logging
import pickle
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from elasticrun.worker import collectives, devices, join_news, optimizer, rounds
from elasticrun.worker import descriptors as ops
from elasticrun.worker.exceptions import CollectiveTimeout, HorovodInternalError, HostsUpdatedInterrupt
from elasticrun.worker.rounds import Round
from elasticrun.worker.step_flags import StepFlags
from elasticrun.worker.store import delete_keys

__all__ = ["diverged", "join", "sync_with", "take_diverged", "tell_joined"]

log = logging.getLogger("elasticrun.worker")

# (Any: torch's stubs type these RedOpType and AllreduceOptions.reduceOp a ReduceOp; both work.)
_OPS: dict[str, Any] = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX,
                        "product": dist.ReduceOp.PRODUCT}
#: How long one store wait for the next descriptor lasts before the abort check runs again.
_WAIT_SLICE = 0.5
#: Keys deleted in one request to the driver's store (each ~50 bytes: well under a frame).
_DELETE_BATCH = 2000


def _identity(shape: Any, dtype: torch.dtype, op: str, device: torch.device) -> torch.Tensor:
    """A tensor that leaves a reduction ``op`` unchanged."""
    if op == "sum":
        return torch.zeros(shape, dtype=dtype, device=device)
    if op == "product":
        return torch.ones(shape, dtype=dtype, device=device)
    if dtype == torch.bool:
        return torch.full(shape, op == "min", dtype=dtype, device=device)
    info = torch.finfo(dtype) if dtype.is_floating_point else torch.iinfo(dtype)
    high = float("inf") if dtype.is_floating_point else info.max
    low = float("-inf") if dtype.is_floating_point else info.min
    return torch.full(shape, high if op == "min" else low, dtype=dtype, device=device)


def _device(kind: str) -> torch.device:
    """Where a joined rank makes its tensors for an operation the others ran on ``kind``
    tensors: this rank's GPU for theirs (the round's NCCL group), the CPU otherwise."""
    return devices.kind_device(kind)


def _next(r: Round, seq: int) -> tuple[ops.Op, str]:
    """The descriptor of operation ``seq`` and its tensors' device kind, waiting for it
    (abortable, bounded)."""
    assert r.store is not None
    key = collectives.join_key(f"op{seq}")
    deadline = time.monotonic() + r.collective_timeout
    while True:
        reason = r.abort_reason()
        if reason:
            raise HorovodInternalError(f"join() abandoned: round {r.number} was aborted ({reason})")
        try:
            r.store.wait([key], timedelta(seconds=_WAIT_SLICE))
            desc, on = pickle.loads(r.store.get(key))
        except Exception as exc:  # a slice that timed out (or an aborted round's refusal)
            if time.monotonic() > deadline:
                raise CollectiveTimeout(f"join(): no operation from the other ranks within the collective "
                                        f"timeout ({r.collective_timeout:g} s): {exc}") from None
            continue
        if not isinstance(desc, ops.Op):
            raise HorovodInternalError(f"join(): operation {seq} came with no descriptor ({type(desc).__name__})")
        return desc, on


# One mirror per kind of operation: take part in it contributing nothing, with tensors on the
# device kind the others used (so it goes over the same group as theirs).
def _allreduce(r: Round, d: ops.Allreduce, on: str) -> None:
    t = _identity(d.shape, d.dtype, d.op, _device(on))
    if d.flags_at is not None and r.copy_requests is not None:
        # The others agree a durable copy in these flags: this rank saved none of the commits
        # they make while it sits here, so it has no shard to send. "busy" defers the copy to
        # the first commit after the join (else each one due meanwhile was started by the
        # others and failed: "durable copy not written ... was not whole").
        t.view(-1)[d.flags_at + StepFlags.BUSY] = 1
    opts = dist.AllreduceOptions()
    opts.reduceOp = _OPS[d.op]
    _run(r, lambda pg: pg.allreduce([t], opts), d, t)


def _broadcast(r: Round, d: ops.Broadcast, on: str) -> None:
    if d.root == r.rank:
        raise ValueError("a broadcast from a rank that has called join(): the joined rank has no data to send")
    t = torch.empty(d.shape, dtype=d.dtype, device=_device(on))
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = d.root, 0
    _run(r, lambda pg: pg.broadcast([t], opts), d, t)


def _allgather(r: Round, d: ops.Allgather, on: str) -> None:
    t = torch.zeros(d.shape, dtype=d.dtype, device=_device(on))
    outputs = [torch.empty_like(t) for _ in range(r.size)]
    _run(r, lambda pg: pg.allgather([outputs], [t]), d, t)


def _alltoall(r: Round, d: ops.Alltoall, on: str) -> None:
    dev = _device(on)
    row = list(d.matrix[r.rank])
    col = [d.matrix[i][r.rank] for i in range(r.size)]
    inp = torch.zeros((sum(row),) + tuple(d.rest), dtype=d.dtype, device=dev)
    out = torch.empty((sum(col),) + tuple(d.rest), dtype=d.dtype, device=dev)
    opts = dist.AllToAllOptions()
    _run(r, lambda pg: pg.alltoall_base(out, inp, col, row, opts), d, inp)


def _var_allgather(r: Round, d: ops.VarAllgather, on: str) -> None:
    """Its whole exchange, with no rows."""
    rows = _device(d.rows_on)
    collectives.synchronize(collectives.grouped_allgather_async(
        [torch.zeros((0,) + tuple(rest), dtype=dtype, device=rows) for dtype, rest in zip(d.dtypes, d.rests)],
        d.name, trusted=True))


def _var_alltoall(r: Round, d: ops.VarAlltoall, on: str) -> None:
    collectives.synchronize(collectives.alltoall_async(
        torch.zeros((0,) + tuple(d.rest), dtype=d.dtype, device=_device(d.rows_on)), [0] * r.size, d.name,
        trusted=True))


def _run(r: Round, start: Callable[[Any], Any], d: ops.Op, on: torch.Tensor) -> None:
    what = f"join: {d.kind}"
    collectives.wait(r, collectives.issue(r, start, what, d, on=on), what)


#: Every descriptor class a joined rank can take part in -> its mirror (test_join_descriptors.py
#: checks that no such class is missing).
MIRRORS: dict[type[ops.Op], Callable[[Round, Any, str], None]] = {
    ops.Allreduce: _allreduce,
    ops.Broadcast: _broadcast,
    ops.Allgather: _allgather,
    ops.Alltoall: _alltoall,
    ops.VarAllgather: _var_allgather,
    ops.VarAlltoall: _var_alltoall,
}


def _mirror(r: Round, desc: ops.Op, on: str) -> None:
    """Take part in the operation ``desc`` describes, contributing nothing."""
    mirror = MIRRORS.get(type(desc))
    if mirror is None:
        raise ValueError(f"join(): the other ranks ran an operation a joined rank cannot take part in: {desc!r}")
    mirror(r, desc, on)


def join(device: int = -1) -> int:
    """Stop contributing data: take part in the other ranks' collectives (with zeros) until
    every rank has called ``join()``; return the rank that joined last. ``device`` is
    accepted for Horovod compatibility (zeros are made on the CPU)."""
    del device
    r = rounds.current()
    if r.size == 1:
        return r.rank
    if r.store is None:
        raise HorovodInternalError("join() needs the round's store; this round has none")
    store = r.store
    gen = r.join_gen
    seq = r.calls
    try:
        join_news.publish(r, gen)  # (before it counts as joined: the others' commits read it)
        count = store.add(collectives.join_key(f"{gen}/count"), 1)
        if count == 1:
            store.set(collectives.join_key(f"{gen}/first"), str(seq))
        if count == r.size:  # the last one: everyone else waits at this very operation
            store.set(collectives.join_key(f"op{seq}"),
                      pickle.dumps((ops.End(r.rank), "cpu")))  # type: ignore[arg-type]  # stub: str; C++ takes bytes
    except Exception as exc:
        raise HorovodInternalError(f"join() could not reach the round's store: {exc}") from exc
    r.joined = True
    try:
        while True:
            desc, on = _next(r, r.calls)
            if isinstance(desc, ops.End):
                _after_join(r)
                last = desc.rank
                break
            if isinstance(desc, ops.Interrupted):  # the others left for the next round: so does this rank
                global _diverged
                _diverged = True  # it sat out their last steps: the next sync sends it the root's replica
                raise HostsUpdatedInterrupt(skip_sync=desc.skip_sync)
            _mirror(r, desc, on)
    finally:
        r.joined = False
        r.join_active = False
        r.join_gen = gen + 1
    end = r.calls  # (the operation End came as: every rank is here)
    _forget_keys(r, [f"{gen}/news/{r.rank}"], news=True)
    if _sync_state(last) and r.rank == last:
        # Every rank is past End now (the sync's collectives had them all): no descriptor is
        # read again. The rank that wrote End deletes them, from the first rank's join on.
        try:
            first = int(store.get(collectives.join_key(f"{gen}/first")))
        except Exception:  # (an aborted round's store: dropped with its round)
            first = end
        _forget_keys(r, [f"op{n}" for n in range(first, end + 1)] + [f"{gen}/count", f"{gen}/first"])
    return last


def _sync_state(last: int) -> bool:
    """Every rank, as ``join()`` ends: the elastic state ``hvd.elastic.run`` trains takes the
    replica of ``last``, the rank that joined last (it applied every step; a rank that joined
    earlier applied none since), and commits it on every rank under one commit number.

    Why: the ranks that kept stepping committed while the others sat in ``join()``, so the
    replicas and their commit counts differed from here on. A durable copy is every rank's
    shard of one commit, so none was whole again for the rest of the round (the job ended
    "succeeded" with its newest copy epochs old), and a reset was the only thing that made
    the replicas equal again. A state without this method (a plain ``ObjectState``) is left
    as it is, as Horovod leaves every replica. Whether it ran (every rank then passed it)."""
    if _state_sync is None:
        return False
    _state_sync(last)
    return True


#: The ``sync_after_join`` of the state ``hvd.elastic.run`` trains (None: no such state).
_state_sync: Callable[[int], None] | None = None


def sync_with(state_sync: Callable[[int], None] | None) -> None:
    """Have every ``join()`` end with ``state_sync(last)`` (``hvd.elastic.run`` sets its state's)."""
    global _state_sync
    _state_sync = state_sync


def _forget_keys(r: Round, names: list[str], news: bool = False) -> None:
    """Delete keys this join put on the round's store (``news``: ``names[0]`` is this rank's
    news, whose parts go too). Kept, they grew the driver's memory with every join (a rank's
    news: megabytes for a large dataset) and every operation run beside a joined rank, for as
    long as the round lasted. Once every rank is past End nobody reads them: the news only the
    commits made while this rank was joined read, the descriptors only joined ranks."""
    store = r.store
    if store is None:
        return
    keys = [collectives.join_key(n) for n in names]
    try:
        if news:
            keys += [collectives.join_key(f"{names[0]}/{n}") for n in range(int(store.get(keys[0])))]
        for start in range(0, len(keys), _DELETE_BATCH):
            delete_keys(store, f"round{r.number}", keys[start:start + _DELETE_BATCH])
    except Exception as exc:  # (an aborted round's store: dropped with its round)
        log.debug("join(): could not delete its keys from the round's store: %s", exc)


#: Set by every ``join()`` that ends; cleared by the next ``TorchState.sync()`` (``take_diverged``).
_diverged = False


def diverged() -> bool:
    """A ``join()`` left this rank's replica unlike the others' and no sync has mended it yet:
    the next rendezvous asks the driver for a sync even after removals only."""
    return _diverged


def _after_join(r: Round) -> None:
    """Every rank of the round passes here at the same point, having run different steps:
    a joined rank applied none of the steps it sat out (as in Horovod), so the replicas now
    differ, and it agreed no host-update or copy flags in the gradient allreduces it mirrored.

    * The flags the stepping ranks agreed are dropped on every rank, so the next commit's
      check runs its own collective everywhere (with them on some ranks only, those ranks
      skipped it and the others ran it: gloo paired it with another collective and aborted,
      or the job hung for the collective timeout).
    * Every DistributedOptimizer checks its buckets against the other ranks' again.
    * The next sync sends the root's parameters and optimizer state to every rank instead of
      trusting that ranks holding the same commit hold the same tensors (Horovod's sync
      broadcasts them always); otherwise replicas that differed stayed apart for good."""
    global _diverged
    r.host_updates.forget_agreed()
    if r.copy_requests is not None:
        r.copy_requests.forget_agreed()
    # A joined rank took part in the others' once-per-round check of their optimizer's buckets
    # without recording it (a rank that joined before its first step of the round): it would
    # run that check alone at its next step while the others reduce gradients. Every rank
    # checks again instead.
    optimizer.forget_agreed_layouts()
    _diverged = True


def tell_joined(r: Round, skip_sync: bool) -> None:
    """Before this rank raises ``HostsUpdatedInterrupt`` at a commit: a rank in ``join()``
    waits for the descriptor of the next operation, which would never come (the others go to
    the next round's rendezvous, and nothing aborts this round), until the collective
    timeout. It gets one that says to interrupt too. Only where a peer is known to have joined
    (``join_active``: this rank publishes their descriptors); every rank that does writes the
    same key and value."""
    if not r.join_active or r.joined or r.store is None:
        return
    try:
        r.store.set(collectives.join_key(f"op{r.calls}"),
                    pickle.dumps((ops.Interrupted(skip_sync), "cpu")))  # type: ignore[arg-type]  # stub: str; bytes work
    except Exception as exc:  # the joined rank then waits out its timeout, as before
        log.warning("could not tell the ranks in join() of the host update: %s", exc)


def take_diverged() -> bool:
    """Whether a ``join()`` ended since the last call (the replicas may differ): for ``sync()``."""
    global _diverged
    diverged, _diverged = _diverged, False
    return diverged
