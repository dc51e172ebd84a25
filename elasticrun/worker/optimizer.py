"""``hvd.DistributedOptimizer``, with horovod.torch's semantics.

Gradients are averaged (or summed) over the ranks while backward still runs: a
post-accumulate-grad hook on every parameter marks its gradient ready, ready gradients are
packed into fused buckets (DDP-style, in reverse parameter order, so the last layers, whose
gradients arrive first, are reduced first) and each full bucket is allreduced
asynchronously. ``step()`` waits for what is in flight, reduces what never became ready,
and then steps the wrapped optimizer.

Elasticity shapes the design:

* Nothing about the world is cached. Every gradient hook and ``step()`` look up the
  current round (size, process group), and a step begun in another round is dropped, so
  the same optimizer object keeps working after ``elastic.run`` formed a new group.
* A failed collective (``HorovodInternalError``) may surface inside ``backward()`` or in
  ``step()``. Either way all pending state is dropped before the error propagates, and the
  fused buffers are discarded rather than reused (an abandoned gloo operation may still
  hold them), so the next backward starts clean. State left behind by an error raised
  elsewhere is recognised as stale by its process group and dropped at the next hook.
* Buckets are launched strictly in bucket order. gloo matches collectives by issue order,
  so every rank must issue the same sequence even when some parameter got no gradient on
  some rank (its bucket then waits for ``step()``, which launches the rest in order).
"""

from __future__ import annotations

import collections
import contextlib
import operator
import time
import warnings
import weakref
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from elasticrun.worker import collectives, process_sets, rounds
from elasticrun.worker.collectives import Adasum, Average, Handle, Sum
from elasticrun.worker.process_sets import ProcessSet, global_process_set
from elasticrun.worker.rounds import Round
from elasticrun.worker.step_flags import StepFlags

__all__ = ["Compression", "Compressor", "DistributedOptimizer", "abandon_step"]


# --------------------------------------------------------------------------- compression


class Compressor:
    """Interface: ``compress(tensor) -> (tensor, ctx)`` before the allreduce, then
    ``decompress(tensor, ctx)`` after it. ``compress`` may return its input unchanged."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """Send the tensor as it is."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class FP16Compressor(Compressor):
    """Send floating-point tensors as float16: half the bytes on the wire, ~3 significant
    digits. Scale the gradients (``gradient_predivide_factor``) if the sum may overflow."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
            return tensor.to(torch.float16), tensor.dtype
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """``hvd.Compression.none`` / ``hvd.Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


# --------------------------------------------------------------------------- fused buckets

#: The first bucket is small so that the first allreduce starts early in backward (as DDP).
_FIRST_BUCKET_BYTES = 1 << 20
# The first bucket carries the step's agreement flags (worker/step_flags.py) after its
# gradients. check_host_updates() then reads the already-agreed flags instead of running its
# own allreduce every step (0.7 ms per step on 2 ranks here, ~0.05 this way).


def assign_buckets(tensors: Sequence[tuple[Hashable, int]], cap: int, first_cap: int) -> list[list[int]]:
    """Which tensors share a bucket: ``tensors`` are (key, bytes) in the order their gradients
    are expected; a bucket holds one key (dtype and device) and its members in that order.

    As DDP once it has seen a backward pass (its rebuilt buckets): a key's first bucket is
    capped at ``first_cap``, the others at ``cap``, and a bucket closes once it holds its cap,
    the tensor that crosses it included. Closing *before* that tensor (as this did until
    2026-11-27) left a first bucket of a few KB whenever a large weight followed a small head,
    so every large gradient waited for the end of backward while DDP's overlapped it (that
    layout trained at 0.95-0.97 of DDP's speed on 16 cores)."""
    layout: list[list[int]] = []
    open_: dict[Hashable, tuple[int, int, int]] = {}  # key -> (bucket, bytes so far, its cap)
    started: set[Hashable] = set()
    for i, (key, nbytes) in enumerate(tensors):
        if key not in open_:
            open_[key] = (len(layout), 0, cap if key in started else min(cap, first_cap))
            layout.append([])
            started.add(key)
        index, held, limit = open_[key]
        layout[index].append(i)
        if held + nbytes >= limit:
            del open_[key]
        else:
            open_[key] = (index, held + nbytes, limit)
    return layout


#: The DistributedOptimizers alive in this process (see ``_dist_launch``: with more than one,
#: each bucket's reduction is checked to be the same bucket on every rank).
_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def forget_agreed_layouts() -> None:
    """Every live DistributedOptimizer checks its buckets against the other ranks' again at
    its next launch (after ``join()``, where some ranks made that check and others only
    took part in it)."""
    for opt in list(_LIVE):
        opt._dist_agreed = None


@dataclass(eq=False)
class _Bucket:
    """Gradients reduced together through one flat buffer (one dtype, one device)."""

    index: int
    name: str
    dtype: torch.dtype
    device: torch.device
    params: list[torch.Tensor] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    # Per-step state, reset by _DistributedOptimizer._dist_clear.
    passes: list[int] = field(default_factory=list)  # backward passes seen per parameter
    staged: list[bool] = field(default_factory=list)  # gradient already copied into the buffer
    ready: int = 0  # parameters that saw backward_passes_per_step passes
    launched: bool = False
    handle: Handle | None = None  # None once launched: nothing to wait for (world of one)
    ctx: Any = None
    buffer: torch.Tensor | None = None  # reused across steps; dropped after an error

    def add(self, p: torch.Tensor) -> None:
        self.params.append(p)
        self.offsets.append(self.numel)
        self.numel += p.numel()
        self.passes.append(0)
        self.staged.append(False)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _carries_flags(b: _Bucket) -> bool:
    """Bucket 0 carries the host-update flags (when its dtype can hold them)."""
    return b.index == 0 and b.dtype.is_floating_point


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixin placed in front of the wrapped optimizer's class (see DistributedOptimizer).

    Never constructed through ``__init__``: the instance takes over the wrapped optimizer's
    attributes, so ``param_groups``, ``state`` and ``defaults`` are the very same objects.
    """

    _dist_original: Callable[[], torch.optim.Optimizer | None]  # the wrapped instance (a weak reference)

    # --- setup ------------------------------------------------------------------------
    def _dist_setup(self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None, compression: type[Compressor],
                    backward_passes_per_step: int, op: int | str, gradient_predivide_factor: float,
                    bucket_cap_mb: float, process_set: ProcessSet | None = None,
                    sparse_as_dense: bool = False) -> None:
        op = collectives.op_value(op)
        if op not in (Average, Sum, Adasum):
            raise ValueError(f"DistributedOptimizer supports op=Average, op=Sum or op=Adasum, not {op!r}")
        if gradient_predivide_factor != 1.0 and op != Average:
            raise ValueError("gradient_predivide_factor is only supported with op=Average")
        if backward_passes_per_step < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._dist_compression = compression
        self._dist_op = op
        # A process set's optimizer reduces among its members only; the host-update flags
        # then stay out of its buckets (they must be agreed by every rank of the round).
        self._dist_ps = None if process_set is None or process_set is global_process_set else process_set
        self._dist_flags = self._dist_ps is None
        # Horovod splits the average into a prescale before the sum and a postscale after
        # it; collectives divides the postscale by the size for op=Average.
        self._dist_prescale = 1.0 / gradient_predivide_factor
        self._dist_postscale = float(gradient_predivide_factor)
        # With fp16 on the wire the postscale (and the average's division) comes after the sum,
        # as in Horovod: divided first, a small gradient over many ranks fell below float16's
        # smallest value (1e-6 over 64 ranks: 0) where Horovod's keeps it.
        self._dist_scale_after = isinstance(compression, type) and issubclass(compression, FP16Compressor)
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._dist_bucket_cap = max(1, int(bucket_cap_mb * (1 << 20)))
        self._dist_names = self._dist_check_names(named_parameters)
        _LIVE.add(self)
        self._dist_buckets: list[_Bucket] = []
        self._dist_slots: dict[torch.Tensor, tuple[_Bucket, int]] = {}
        self._dist_hooks: dict[torch.Tensor, Any] = {}
        # Sparse gradients (an Embedding(sparse=True)) are reduced as Horovod reduces them, as
        # sparse tensors (every rank's indices and values gathered), unless sparse_as_dense: a
        # parameter is known sparse from its first sparse gradient on, and then leaves the
        # buckets. Per step: its backward passes seen, and its reduction in flight.
        self._dist_sparse_as_dense = bool(sparse_as_dense)
        self._dist_sparse: dict[torch.Tensor, None] = {}  # an ordered set: every rank reduces them in one order
        self._dist_sparse_found = False  # a parameter became sparse this step: rebuild the buckets after it
        self._dist_sparse_passes: dict[torch.Tensor, int] = {}
        self._dist_sparse_handles: dict[torch.Tensor, Handle] = {}
        self._dist_agreed: tuple[int, int] | None = None  # (round, bucket layout) the ranks agreed on
        self._dist_next = 0  # first bucket not launched yet (launch order = bucket order)
        # The round of the step in progress, held weakly: the old round's group must be
        # released off the training thread (see runtime._drop_in_background).
        self._dist_cycle_round: weakref.ref[Round] | None = None
        self._should_synchronize = True
        self._synchronized = False
        self._dist_build()

    def _dist_check_names(self, named_parameters: Iterable[tuple[str, torch.Tensor]] | None
                          ) -> dict[torch.Tensor, str]:
        """Names only label collectives in errors, but horovod validates them; so do we."""
        params = [p for g in self.param_groups for p in g["params"]]
        if named_parameters is None:
            return {p: f"allreduce.noname.{i}" for i, p in enumerate(params)}
        named = list(named_parameters)
        if any(not isinstance(item, tuple) or len(item) != 2 for item in named):
            raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                             "usually model.named_parameters()")
        counts = collections.Counter(n for n, _ in named)
        dupes = sorted(n for n, c in counts.items() if c > 1)
        if dupes:
            raise ValueError(f"parameter names in named_parameters must be unique; duplicates: {dupes}")
        by_param = {p: n for n, p in named}
        if any(p not in by_param for p in params):
            raise ValueError("named_parameters was specified, but one or more model parameters were not named; "
                             "pass all of them (model.named_parameters())")
        return by_param

    def _dist_build(self) -> None:
        """Assign every trainable parameter to a bucket and hook it (idempotent)."""
        self._dist_clear(discard=True)
        if self._dist_op == Adasum:  # reduces the deltas of a local step at step(): no hooks
            self._dist_buckets, self._dist_slots = [], {}
            self._dist_trained: tuple[torch.Tensor, ...] = ()
            self._dist_frozen: tuple[torch.Tensor, ...] = ()
            return
        params: list[torch.Tensor] = []
        seen: set[torch.Tensor] = set(self._dist_sparse)
        hooked: list[torch.Tensor] = list(self._dist_sparse)
        frozen: dict[torch.Tensor, None] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad and p not in seen:
                    seen.add(p)
                    params.append(p)
                    hooked.append(p)
                elif not p.requires_grad:
                    frozen[p] = None
        # What requires_grad was when the buckets were made: a script that unfreezes a
        # backbone mid-run (p.requires_grad_(True)) or freezes a layer changes it, and the
        # buckets are made again after that step's synchronize (see _dist_trainable_changed).
        self._dist_trained, self._dist_frozen = tuple(params), tuple(frozen)
        order = list(reversed(params))  # gradients of the last layers are ready first
        layout = assign_buckets([((p.dtype, p.device), p.numel() * p.element_size()) for p in order],
                                self._dist_bucket_cap, _FIRST_BUCKET_BYTES)
        buckets: list[_Bucket] = []
        for members in layout:
            b = _Bucket(len(buckets), "", order[members[0]].dtype, order[members[0]].device)
            for i in members:
                b.add(order[i])
            buckets.append(b)
        for b in buckets:
            first, last = self._dist_names.get(b.params[0], "?"), self._dist_names.get(b.params[-1], "?")
            b.name = first if len(b.params) == 1 else f"gradient bucket {b.index} ({first} .. {last})"
        self._dist_buckets = buckets
        self._dist_slots = {p: (b, i) for b in buckets for i, p in enumerate(b.params)}
        self._dist_layout = getattr(self, "_dist_layout", 0) + 1  # a new layout: agreed again before use
        # Hooks hold the optimizer weakly: an optimizer that was dropped must not keep
        # reducing gradients of a model that a new optimizer now trains.
        self_ref = weakref.ref(self)
        for p in hooked:
            if p not in self._dist_hooks:
                def hook(param: torch.Tensor, self_ref: weakref.ref = self_ref) -> None:
                    opt = self_ref()
                    if opt is not None:
                        opt._dist_on_grad(param)
                self._dist_hooks[p] = p.register_post_accumulate_grad_hook(hook)

    # --- per-step state ---------------------------------------------------------------
    def _dist_clear(self, discard: bool) -> None:
        """Forget the step in progress. ``discard`` also drops the fused buffers: after an
        error an abandoned collective may still write into them."""
        for b in getattr(self, "_dist_buckets", ()):
            b.passes = [0] * len(b.params)
            b.staged = [False] * len(b.params)
            b.ready, b.launched, b.handle, b.ctx = 0, False, None, None
            if discard:
                b.buffer = None
        self._dist_next = 0
        self._dist_cycle_round = None
        self._dist_sparse_passes = {}
        self._dist_sparse_handles = {}

    def _dist_member(self, r: Round) -> bool:
        """Whether this rank reduces in this round: a process set's optimizer on a rank outside
        the set steps with its own gradients, as Horovod's does."""
        return self._dist_ps is None or r.rank in process_sets.members(self._dist_ps, r)

    def _dist_sparse_reduce(self, p: torch.Tensor, r: Round) -> None:
        """Start the sparse reduction of ``p``'s gradient (an empty one where this rank has none)."""
        g = p.grad
        if g is None or not g.is_sparse:
            g = torch.sparse_coo_tensor(torch.empty((1, 0), dtype=torch.int64, device=p.device),
                                        torch.empty((0,) + tuple(p.shape[1:]), dtype=p.dtype, device=p.device),
                                        tuple(p.shape))
        op = Sum if self._dist_op == Sum else Average
        self._dist_sparse_handles[p] = collectives.sparse_allreduce_async(
            g.coalesce(), name=self._dist_names.get(p, "sparse"), op=op,
            process_set=self._dist_ps if self._dist_ps is not None else global_process_set, trusted=True)

    def _dist_has_handles(self) -> bool:
        return any(b.handle is not None and not b.handle.done for b in self._dist_buckets)

    def _dist_begin(self) -> Round:
        """Start (or continue) a step in the current round; state from another round is stale."""
        r = rounds.current()
        cycle = self._dist_cycle_round
        if cycle is not None and cycle() is not r:
            self._dist_clear(discard=True)
            cycle = None
        if cycle is None:
            self._dist_cycle_round = weakref.ref(r)
            self._synchronized = False
        return r

    def _dist_on_grad(self, p: torch.Tensor) -> None:
        if not self._dist_sparse_as_dense and (p in self._dist_sparse or (p.grad is not None and p.grad.is_sparse)):
            self._dist_on_sparse_grad(p)
            return
        slot = self._dist_slots.get(p)
        if slot is None:
            return
        bucket, i = slot
        try:
            r = self._dist_begin()
            if bucket.launched or bucket.passes[i] >= self.backward_passes_per_step:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to "
                    "step(). Increase backward_passes_per_step to accumulate gradients locally.")
            bucket.passes[i] += 1
            if bucket.passes[i] == self.backward_passes_per_step:
                # Copy now, while backward still computes other layers (as DDP does): at the
                # last gradient only that one is left to copy before the allreduce starts.
                self._dist_stage(bucket, i, r)
                bucket.ready += 1
                self._dist_launch_ready(r)
        except BaseException:
            self._dist_clear(discard=True)
            raise

    def _dist_on_sparse_grad(self, p: torch.Tensor) -> None:
        try:
            self._dist_begin()  # (a step of this round: state from another one is dropped)
            if p not in self._dist_sparse:  # its first sparse gradient: sparse from now on
                self._dist_sparse[p] = None
                self._dist_sparse_found = True
            passes = self._dist_sparse_passes.get(p, 0) + 1
            if passes > self.backward_passes_per_step or p in self._dist_sparse_handles:
                raise AssertionError(
                    "Gradients were computed more than backward_passes_per_step times before call to "
                    "step(). Increase backward_passes_per_step to accumulate gradients locally.")
            self._dist_sparse_passes[p] = passes
            # Reduced at synchronize(), after the dense buckets, in one order on every rank: a
            # rank whose step did not use the parameter (a per-rank branch) has no hook to start
            # it from, and a reduction started here on one rank met another's dense bucket
            # (gloo aborted both processes: "Is there a distributed collective mismatch").
        except BaseException:
            self._dist_clear(discard=True)
            raise

    def _dist_launch_ready(self, r: Round) -> None:
        buckets = self._dist_buckets
        while self._dist_next < len(buckets) and buckets[self._dist_next].ready == len(buckets[self._dist_next].params):
            self._dist_launch(buckets[self._dist_next], r)
            self._dist_next += 1

    def _dist_scale(self, r: Round) -> float:
        """What a gradient is multiplied by: Horovod's prescale before the sum and postscale (over
        the size, for an average) after it, both applied before the sum, while the gradient is
        copied into the bucket (as DDP divides before its allreduce): the reduced sums are then
        the gradients themselves, and nothing is copied back. With fp16 compression only the
        prescale: the rest is :meth:`_dist_after`'s."""
        return self._dist_prescale if self._dist_scale_after else self._dist_prescale * self._dist_post(r)

    def _dist_post(self, r: Round) -> float:
        size = r.size if self._dist_ps is None else len(process_sets.members(self._dist_ps, r))
        return self._dist_postscale / size if self._dist_op == Average else self._dist_postscale

    def _dist_after(self, reduced: torch.Tensor, ctx: Any, b: _Bucket, r: Round) -> torch.Tensor:
        """The reduced bucket as the gradients' dtype: decompressed, then, with fp16 compression,
        postscaled in that dtype (the float16 sum's average can be smaller than float16 holds;
        measured faster than one fused float16-to-float32 multiply). The step flags after the
        gradients are left as they are."""
        out = self._dist_compression.decompress(reduced, ctx)
        post = self._dist_post(r) if self._dist_scale_after else 1.0
        if post != 1.0:
            out[:b.numel].mul_(post)
        return out

    def _dist_stage(self, b: _Bucket, i: int, r: Round) -> None:
        """Put parameter ``i``'s gradient, scaled, into the bucket's flat buffer (zeros if it has
        none, or if it is reduced sparsely: it leaves the buckets after this step). A gradient
        that is already a view of its place there (the previous step's, accumulated in place) is
        only scaled."""
        if r.size == 1 or not self._dist_member(r):
            return  # Average and Sum over one rank are the identity: skip the copies
        if b.buffer is None:
            b.buffer = torch.empty(b.numel + (StepFlags.SIZE if self._dist_flags and _carries_flags(b) else 0), dtype=b.dtype,
                                   device=b.device)
        p, off = b.params[i], b.offsets[i]
        dst = b.buffer[off:off + p.numel()]
        g = p.grad
        scale = self._dist_scale(r)
        with torch.no_grad():
            if g is None or p in self._dist_sparse:  # no (dense) gradient here, but another rank may have one
                dst.zero_()
            elif not g.is_sparse and g.data_ptr() == dst.data_ptr() and g.numel() == dst.numel():
                if scale != 1.0:
                    dst.mul_(scale)
            elif scale != 1.0:
                torch.mul((g.to_dense() if g.is_sparse else g).reshape(-1), scale, out=dst)
            else:
                dst.copy_((g.to_dense() if g.is_sparse else g).reshape(-1))
        b.staged[i] = True

    def _dist_launch(self, b: _Bucket, r: Round) -> None:
        b.launched = True
        if r.size == 1 or not self._dist_member(r):
            return
        if self._dist_agreed != (r.number, self._dist_layout):
            # Once per round and per bucket layout: the ranks' buckets match (a model that
            # differs between ranks would otherwise make the reductions differ in size).
            collectives.agree(r, {"collective": "DistributedOptimizer", "op": self._dist_op,
                                  "buckets": tuple((x.numel, str(x.dtype), x.device.type) for x in self._dist_buckets)},
                              "DistributedOptimizer", self._dist_ps)
            self._dist_agreed = (r.number, self._dist_layout)
        for i, staged in enumerate(b.staged):  # gradients whose hook never fired this step
            if not staged:
                self._dist_stage(b, i, r)
        assert b.buffer is not None
        with torch.no_grad():
            if self._dist_flags and _carries_flags(b):
                pending, added = r.host_updates.local_flags()
                wanted, busy = r.copy_requests.local_flags(r.copy_busy()) if r.copy_requests else (False, False)
                flags = StepFlags(1.0 if pending else 0.0, added, wanted, busy)
                for i, value in enumerate(flags.encode()):  # scalar fills: no host-to-device copy to wait on
                    b.buffer[b.numel + i] = value
            tensor, b.ctx = self._dist_compression.compress(b.buffer)  # prescaled (see _dist_scale)
            if len(_LIVE) > 1:
                # Two optimizers (a GAN, a multi-task model) launch their buckets as their
                # gradients come, and a graph that differs between ranks (one rank trains head
                # a, another head b) orders them differently: gloo pairs collectives by order,
                # so a's bucket on one rank was summed with b's on another, silently. Horovod
                # pairs them by name; here the ranks check they reduce the same bucket (a tiny
                # allgather, only in a process with more than one DistributedOptimizer), and
                # otherwise every rank raises CollectiveMismatch naming both.
                collectives.agree(r, {"collective": "DistributedOptimizer bucket", "bucket": b.name,
                                      "numel": b.numel, "dtype": str(b.dtype)},
                                  "DistributedOptimizer (one of several)", self._dist_ps)
            b.handle = collectives.allreduce_async_(
                tensor, name=b.name, op=Sum, trusted=True, process_set=self._dist_ps or global_process_set,
                flags_at=b.numel if self._dist_flags and _carries_flags(b) else None)

    def _dist_finish(self, b: _Bucket, r: Round) -> None:
        with torch.no_grad():
            if b.handle is None:  # reduced over a world of one: only fill missing grads
                for p in b.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                return
            out = self._dist_after(collectives.synchronize(b.handle), b.ctx, b, r)
            if self._dist_flags and _carries_flags(b):  # any positive sum (or average) means "some rank"
                agreed = StepFlags.decode(out[b.numel:b.numel + StepFlags.SIZE].tolist())
                r.host_updates.agreed(r.number, agreed.pending > 0, agreed.added)
                if r.copy_requests is not None:
                    r.copy_requests.agreed(r.number, agreed.wanted, agreed.busy)
            for p, off in zip(b.params, b.offsets):
                if p in self._dist_sparse:
                    continue  # reduced sparsely (see _dist_finish_sparse)
                g = p.grad
                if g is None or g.is_sparse or g.data_ptr() != out.data_ptr() + off * out.element_size():
                    # The reduced gradient is its place in the bucket (a view, as DDP's
                    # gradient_as_bucket_view): no copy back; a next backward that finds it
                    # (zero_grad(set_to_none=False)) accumulates into the bucket directly.
                    p.grad = out[off:off + p.numel()].view(p.shape)

    # --- horovod API ------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce; reduce those whose hook never fired
        (unused parameters, fewer backward passes than expected) with what they hold.

        Called by the script (Horovod's pattern for clipping or AMP: ``synchronize()``, then
        ``with skip_synchronize(): step()``), this is the step's end as far as elasticrun is
        concerned: its pace is recorded (:meth:`_dist_step_done`), as when ``step()``
        synchronizes. A host update agreed in this allreduce waits for the next commit."""
        started = time.perf_counter()
        self._dist_synchronize()
        if self._dist_op != Adasum:  # (Adasum's step() ends the step, after its own exchange)
            self._dist_step_done(started)

    def _dist_step_done(self, started: float) -> None:
        r = rounds.current()
        if r.step_done is not None:
            r.step_done(time.perf_counter() - started)  # the wait tells a straggler apart

    def _dist_trainable_changed(self) -> bool:
        """Whether a parameter was unfrozen or frozen since the buckets were made. Unfrozen, its
        gradient had no bucket and no hook: each rank stepped with its own, and the replicas
        drifted apart silently. Frozen, its bucket gave it a zero gradient that momentum or
        weight decay still applied. (A look at each parameter's flag per step: microseconds.)"""
        return any(map(_REQUIRES_GRAD, self._dist_frozen)) or not all(map(_REQUIRES_GRAD, self._dist_trained))

    def _dist_synchronize(self) -> None:
        changed = self._dist_op != Adasum and self._dist_trainable_changed()
        try:
            r = self._dist_begin()
            while self._dist_next < len(self._dist_buckets):
                self._dist_launch(self._dist_buckets[self._dist_next], r)
                self._dist_next += 1
            for b in self._dist_buckets:
                self._dist_finish(b, r)
            self._dist_finish_sparse(r)
            if changed:
                self._dist_reduce_changed(r)
        except BaseException:
            self._dist_clear(discard=True)
            raise
        self._dist_clear(discard=False)
        if self._dist_sparse_found or changed:  # every rank found it in this same step: the same new buckets
            self._dist_sparse_found = False
            self._dist_build()
        self._synchronized = True

    def _dist_reduce_changed(self, r: Round) -> None:
        """This step's gradients of parameters unfrozen since the buckets were made, reduced
        as a bucket would (in buckets of their own, which the ranks agree on first: a rank that
        did not unfreeze them fails with CollectiveMismatch rather than hang); parameters frozen
        since get no gradient (the buckets gave them zeros)."""
        for p in self._dist_trained:
            if not p.requires_grad:
                p.grad = None
        new = [p for p in self._dist_frozen
               if p.requires_grad and p not in self._dist_slots and p not in self._dist_sparse]
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in new:
            groups.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), ps in groups.items():
            b = _Bucket(-1, f"gradients of {len(ps)} parameter(s) unfrozen at this step", dtype, device)
            for p in ps:
                b.add(p)
            if r.size > 1 and self._dist_member(r):
                collectives.agree(r, {"collective": "DistributedOptimizer, parameters unfrozen", "numel": b.numel,
                                      "dtype": str(dtype)}, "DistributedOptimizer", self._dist_ps)
            self._dist_launch(b, r)
            self._dist_finish(b, r)

    def _dist_finish_sparse(self, r: Round) -> None:
        """The sparse reductions: started here for every sparse parameter, in one order on
        every rank (an empty gradient where this rank has none), then waited for; each
        gradient becomes the (uncoalesced) sum or average of every rank's, a sparse tensor as
        SparseAdam wants it."""
        if not self._dist_sparse or r.size == 1 or not self._dist_member(r):
            return
        for p in self._dist_sparse:
            if p not in self._dist_sparse_handles:
                self._dist_sparse_reduce(p, r)
        for p in self._dist_sparse:
            p.grad = collectives.synchronize(self._dist_sparse_handles[p])

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``with opt.skip_synchronize(): opt.step()`` after an explicit ``synchronize()``
        (e.g. to clip the reduced gradients in between)."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self._dist_op == Adasum:
            return self._dist_adasum_step(closure)
        if self._should_synchronize:
            if self._synchronized:
                # No backward since synchronize(): reducing again would be redundant (and
                # would multiply the gradients by the size with op=Sum).
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). Use the skip_synchronize() context to make the "
                              "intent explicit.", stacklevel=2)
            else:
                self.synchronize()
        self._synchronized = False
        original = self._dist_original()
        if original is not None:
            # An LR scheduler made before wrapping watches the original for "stepped".
            setattr(original, "_opt_called", True)  # an attribute torch.optim.lr_scheduler sets, not in the stubs
        return super().step(closure)

    def _dist_adasum_step(self, closure: Callable[[], Any] | None) -> Any:
        """op=Adasum, as Horovod does it on CPU: take the wrapped optimizer's step locally, then
        combine the steps' deltas (new - old parameters) over the ranks with Adasum and apply
        the result to the old parameters (``p = old + adasum(delta)``)."""
        loss = closure() if closure is not None else None
        r = rounds.current()
        original = self._dist_original()
        if original is not None:
            setattr(original, "_opt_called", True)  # an attribute torch.optim.lr_scheduler sets, not in the stubs
        if r.size == 1:
            if r.step_done is not None:  # (a world of one's steps count too: pace, leaves)
                r.step_done(0.0)
            super().step()
            return loss
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
            super().step()
            deltas: dict[torch.dtype, list[int]] = {}
            for i, p in enumerate(params):
                deltas.setdefault(p.dtype, []).append(i)
            reduced: dict[int, torch.Tensor] = {}
            for idx in deltas.values():
                pairs = [self._dist_compression.compress(params[i].detach() - start[i]) for i in idx]
                out = collectives.grouped_allreduce_([t for t, _ in pairs], name="adasum deltas", op=Adasum,
                                                     trusted=True)
                for i, t, (_, ctx) in zip(idx, out, pairs):
                    reduced[i] = self._dist_compression.decompress(t, ctx)
            for p, s in zip(params, start):
                p.copy_(s)
        if r.step_done is not None:
            r.step_done(0.0)
        with torch.no_grad():
            for i, p in enumerate(params):
                p.add_(reduced[i])
        return loss

    # torch's Optimizer.__setstate__/load_state_dict wrap ``type(self).step`` in a profiling
    # hook unless it is marked: ours calls the wrapped class's (already hooked) step, so
    # wrapping it again would run the step hooks twice.
    step.hooked = True  # type: ignore[attr-defined]  # a mark on the function, read by torch.optim

    def zero_grad(self, set_to_none: bool = True) -> None:
        launched = self._dist_has_handles()
        stale = (launched and self._dist_cycle_round is not None
                 and self._dist_cycle_round() is not rounds.current())
        self._dist_clear(discard=launched)
        if launched and not stale:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize(). This is prohibited as it "
                                 "can cause a race condition.")
        super().zero_grad(set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            self._dist_names.setdefault(p, f"allreduce.noname.{len(self._dist_names)}")
        self._dist_build()

    def set_backward_passes_per_step(self, passes: int) -> None:
        if passes < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self._dist_clear(discard=False)
        self.backward_passes_per_step = int(passes)


def abandon_step(optimizer: torch.optim.Optimizer) -> None:
    """Forget the step in progress of a DistributedOptimizer (other optimizers have none).

    For a rollback: gradients reduced or launched in the failed round must be neither
    waited for nor applied, and the fused buffers an abandoned collective may still write
    into are dropped.
    """
    if isinstance(optimizer, _DistributedOptimizer):
        optimizer._dist_clear(discard=True)


_classes: dict[type, type[_DistributedOptimizer]] = {}


def _distributed_class(base: type) -> type[_DistributedOptimizer]:
    """One subclass per optimizer class, named like it, so isinstance checks keep working."""
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base), {"__module__": base.__module__,
                                                                   "__qualname__": base.__qualname__})
        _classes[base] = cls
    return cls


def DistributedOptimizer(optimizer: torch.optim.Optimizer,
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none,
                         backward_passes_per_step: int = 1,
                         op: int | str = Average,
                         gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set,
                         *, bucket_cap_mb: float = 25.0) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies gradients reduced over all ranks.

    The result is an instance of a subclass of ``type(optimizer)`` sharing its
    ``param_groups``, ``state`` and ``defaults`` (so LR schedulers work whether they were
    created before or after wrapping; step only the wrapper). ``op=Average`` divides by the
    size at each reduction, ``op=Sum`` does not; ``gradient_predivide_factor`` f splits
    the average into a 1/f prescale and an f/size postscale. With
    ``backward_passes_per_step`` N the gradients are accumulated locally and reduced on
    the N-th backward. ``op=Adasum`` steps locally and combines the steps' deltas with Adasum
    (as Horovod on CPU). ``process_set``: reduce among its ranks only (a rank outside it steps
    with its own gradients, as Horovod's). Sparse gradients are reduced as sparse tensors
    (every rank's indices and values gathered), so ``SparseAdam`` gets what it needs, unless
    ``sparse_as_dense``. ``bucket_cap_mb`` bounds a fused bucket; ``num_groups`` and ``groups``
    are accepted for horovod compatibility (fusion is automatic).
    """
    del num_groups, groups
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("the optimizer is already a DistributedOptimizer")
    cls = _distributed_class(type(optimizer))
    wrapped = cls.__new__(cls)
    # An LR scheduler patches ``step`` on the instance, bound to the original optimizer;
    # copying it would bypass our step.
    wrapped.__dict__.update({k: v for k, v in optimizer.__dict__.items() if k != "step"})
    wrapped._dist_original = weakref.ref(optimizer)
    wrapped._dist_setup(named_parameters, compression, backward_passes_per_step, op,
                        gradient_predivide_factor, bucket_cap_mb, process_set, sparse_as_dense)
    return wrapped
