"""Copy plans: the tensor copy a commit makes, with as little Python per tensor as possible.

A commit copies every tensor of the state into a buffer. For a state of a few large tensors
that is a memcpy. For a state of hundreds of small tensors (a small CNN or a transformer:
weights, biases, norms, Adam's two moments and step counters) the bytes are cheap and the
per-tensor overhead is not: torch's ``copy_`` costs about 1 µs of dispatch per call, and
walking ``state_dict()`` and checking each buffer costs more.

Where the buffers live (:func:`commit_buffers`): host memory for CPU tensors; for CUDA
tensors, the same GPU while the copies fit beside training (a device-to-device copy at HBM
speed, which a GPU user's commit costs in Horovod too), else pinned host memory (PCIe speed,
said once).

A :class:`CopyPlan` is built once for a list of live tensors and their buffers and then
replayed. Small contiguous CPU tensors are copied with one ``memmove`` each (about 0.3 µs,
and the GIL is released during the copy); large ones keep ``copy_`` (multi-threaded for large
CPU tensors, asynchronous into pinned memory from the GPU); device-to-device pairs go in one
``_foreach_copy_`` per GPU, ordered on the caller's stream and never waited for by the host
(whatever reads the buffers runs on that stream after them), or on a side stream for a
background commit (:meth:`CopyPlan.run_async`).

Safety: the plan keeps a reference to every source's storage, so a raw copy can never read
freed memory, even if the live tensor was re-pointed (``p.data = ...``) after the plan was
built. Whether it still describes the live state is checked with :meth:`CopyPlan.current`
(identity and data pointer of every source) before every replay.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import operator
import os
import threading
from collections import deque
from itertools import starmap
from typing import Any, Callable, Sequence

import torch

__all__ = ["CopyPlan", "DeviceCopy", "MEMMOVE_MAX_BYTES", "Watch", "WatchedPlan", "commit_buffers", "same_bytes",
           "watched_copy"]

log = logging.getLogger("elasticrun.worker")

#: GPU memory a device commit must leave free (a share of the GPU's total): training's own
#: peaks (activations, the allocator's fragmentation) need room beside the committed copy.
DEVICE_HEADROOM = 0.10
_said_host: set[str] = set()  # devices whose commits were sent to host memory (said once each)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def device_room(free: int, total: int, reserved: int, peak_allocated: int, needed: int) -> bool:
    """Whether ``needed`` more bytes fit on a GPU beside training, leaving DEVICE_HEADROOM of
    it free. ``free`` is the device's (other processes' use already out of it); of the memory
    this process's allocator holds (``reserved``), only what training has never needed at
    once counts as free: blocks cached after a step are needed again at the next step's peak
    (the activations), so counting them as free would let a committed copy take the room of
    the next forward pass."""
    spare = max(0, reserved - peak_allocated)
    return free + spare - needed >= DEVICE_HEADROOM * total


def _fits_on_device(device: torch.device, needed: int) -> bool:
    """Whether ``needed`` more bytes of committed copies fit on ``device`` (:func:`device_room`)."""
    if os.environ.get("ELASTICRUN_COMMIT_ON_DEVICE", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    try:
        free, total = torch.cuda.mem_get_info(device)
        reserved = torch.cuda.memory_reserved(device)
        peak = torch.cuda.max_memory_allocated(device)
    except Exception:  # no answer: the safe place
        return False
    ok = device_room(free, total, reserved, peak, needed)
    if not ok and str(device) not in _said_host:
        _said_host.add(str(device))
        log.warning("the committed copy (%.0f MB more) does not fit on %s beside training (%.0f MB free of %.0f, "
                    "counting the steps' peak): commits of its tensors go to pinned host memory, at PCIe speed",
                    needed / 1e6, device, (free + max(0, reserved - peak)) / 1e6, total / 1e6)
    return ok


def commit_buffers(sources: Sequence[torch.Tensor], previous: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
    """A buffer for the committed copy of each of ``sources``: ``previous[i]`` when it still
    fits (same shape and dtype, and where this commit keeps copies), else a new one. CPU
    tensors: host memory. CUDA tensors: their own GPU when every copy of that GPU fits beside
    training (one decision per GPU and call), else pinned host memory."""
    needed: dict[torch.device, int] = {}
    for src, prev in zip(sources, previous):
        if src.is_cuda and not (prev is not None and prev.device == src.device and prev.shape == src.shape
                                and prev.dtype == src.dtype):
            needed[src.device] = needed.get(src.device, 0) + _nbytes(src)
    on_device = {d: _fits_on_device(d, n) for d, n in needed.items()}
    out = []
    for src, prev in zip(sources, previous):
        where = src.device if src.is_cuda and on_device.get(src.device, True) else torch.device("cpu")
        if prev is not None and prev.shape == src.shape and prev.dtype == src.dtype and prev.device == where:
            out.append(prev)
        else:
            out.append(torch.empty(src.shape, dtype=src.dtype, device=where,
                                   pin_memory=src.is_cuda and where.type == "cpu"))
    return out


class DeviceCopy:
    """Device-to-device copies enqueued on a side stream (a background commit's): :meth:`wait`
    makes the caller's stream wait for them on the GPU; the host never blocks."""

    def __init__(self, events: list[Any]) -> None:
        self._events = events

    def wait(self) -> None:
        for event in self._events:
            torch.cuda.current_stream(event.device).wait_event(event)


_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    stream = _side_streams.get(device)
    if stream is None:
        stream = _side_streams[device] = torch.cuda.Stream(device)
    return stream

#: Up to this size a raw ``memmove`` beats ``copy_`` (whose cost is dispatch, not bytes);
#: above it ``copy_`` may use several threads.
MEMMOVE_MAX_BYTES = 1 << 18

_memmove = ctypes.memmove
_data_ptr = torch.Tensor.data_ptr


def _raw_copyable(src: torch.Tensor, dst: torch.Tensor) -> bool:
    return (src.device.type == "cpu" and dst.device.type == "cpu" and src.dtype == dst.dtype
            and src.shape == dst.shape and src.is_contiguous() and dst.is_contiguous()
            and not src.is_quantized and src.layout == torch.strided
            and src.numel() * src.element_size() <= MEMMOVE_MAX_BYTES)


class CopyPlan:
    """``dst[i].copy_(src[i])`` for fixed lists of sources and buffers, replayable cheaply."""

    def __init__(self, sources: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]) -> None:
        if len(sources) != len(buffers):
            raise ValueError(f"{len(sources)} sources for {len(buffers)} buffers")
        self._sources = list(sources)  # the live objects (Parameters...): identity checks
        self._ptrs = [_data_ptr(t) for t in self._sources]
        # Detached views keep each source's storage alive for as long as the plan exists.
        self._keep = [t.detach() for t in self._sources]
        self._buffers = list(buffers)
        self._raw: list[tuple[int, int, int]] = []
        self._torch: list[tuple[torch.Tensor, torch.Tensor]] = []
        # Device-to-device pairs by GPU: (buffers, sources), one _foreach_copy_ each.
        self._d2d: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._device = False  # some pair involves a GPU
        self._to_host = False  # some GPU tensor is copied to host memory: run() waits for it
        self._all: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (buffers, sources)
        for src, dst in zip(self._keep, self._buffers):
            nbytes = src.numel() * src.element_size()
            if nbytes == 0:
                continue
            self._all[0].append(dst)
            self._all[1].append(src)
            if _raw_copyable(src, dst):
                self._raw.append((_data_ptr(dst), _data_ptr(src), nbytes))
            elif src.is_cuda and dst.device == src.device:
                pair = self._d2d.setdefault(src.device, ([], []))
                pair[0].append(dst)
                pair[1].append(src)
                self._device = True
            else:
                self._torch.append((dst, src))
                self._device = self._device or src.device.type != "cpu"
                self._to_host = self._to_host or (src.is_cuda and not dst.is_cuda)

    def __len__(self) -> int:
        return len(self._sources)

    def pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, buffer) of every copy the plan makes."""
        return list(zip(self._all[1], self._all[0]))

    def members(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(source, buffer) of every pair the plan was built on, empty tensors included."""
        return list(zip(self._sources, self._buffers))

    def split(self, first: Callable[[torch.Tensor], bool]) -> tuple[CopyPlan, CopyPlan]:
        """Two plans: the pairs whose source satisfies ``first``, and the others."""
        pairs = list(zip(self._sources, self._buffers))
        yes = [pair for pair in pairs if first(pair[0])]
        no = [pair for pair in pairs if not first(pair[0])]
        return CopyPlan([s for s, _ in yes], [b for _, b in yes]), CopyPlan([s for s, _ in no], [b for _, b in no])

    def current(self, sources: Sequence[torch.Tensor] | None = None) -> bool:
        """True if replaying copies the live state: the sources still point at the memory the
        plan was built on (and, if given, ``sources`` are the very same objects)."""
        if sources is not None and (len(sources) != len(self._sources)
                                    or not all(map(operator.is_, sources, self._sources))):
            return False
        return list(map(_data_ptr, self._sources)) == self._ptrs

    @property
    def device_only(self) -> bool:
        """Every copy is device-to-device (a background commit needs no thread: see run_async)."""
        return bool(self._d2d) and not self._raw and not self._torch

    def run_released(self) -> None:
        """The same copy in one torch call, which takes the GIL once instead of once per
        tensor: for a background thread, whose per-tensor GIL hand-offs would otherwise
        queue behind the training thread's Python."""
        if self._device:  # mixed devices: not one foreach call
            self.run()
        elif self._all[0]:
            with torch.no_grad():
                torch._foreach_copy_(*self._all)

    def run_async(self) -> DeviceCopy:
        """The device-to-device copies on a side stream, after what the caller's stream has
        queued so far (the commit point): the training thread pays the enqueue, the GPU copies
        beside the next forward pass. The returned :class:`DeviceCopy` orders a stream after them."""
        events = []
        with torch.no_grad():
            for device, (dsts, srcs) in self._d2d.items():
                side = _side_stream(device)
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    torch._foreach_copy_(dsts, srcs)
                event = torch.cuda.Event()
                event.record(side)
                events.append(event)
        return DeviceCopy(events)

    def run(self) -> None:
        """Copy every source into its buffer. Copies into host memory are complete when it
        returns; device-to-device ones are queued on the caller's stream, before anything it
        queues later (a restore, the next step), so the host does not wait for them."""
        deque(starmap(_memmove, self._raw), 0)
        with torch.no_grad():
            for dst, src in self._torch:
                dst.copy_(src, non_blocking=src.is_cuda)
            for dsts, srcs in self._d2d.values():
                torch._foreach_copy_(dsts, srcs)
        if self._to_host:
            # The copies to host memory were queued on each source device's current stream:
            # wait for those streams only. (torch.cuda.synchronize() waits for the calling
            # thread's current device, device 0 on a commit thread (a CUDA context made there),
            # and for every stream of it, an old round's NCCL kernel on a dead peer included.)
            for device in {src.device for _, src in self._torch if src.is_cuda}:
                torch.cuda.current_stream(device).synchronize()


# --- watched copies (a newcomer's prefetch, see worker/prefetch.py) ---------------------------

_memcmp = ctypes.CDLL(None).memcmp
_memcmp.restype = ctypes.c_int
_memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
_CMP_SLICE = 64 << 20
_cmp_pool: concurrent.futures.ThreadPoolExecutor | None = None
_cmp_pool_lock = threading.Lock()


def _pool() -> concurrent.futures.ThreadPoolExecutor:
    global _cmp_pool
    with _cmp_pool_lock:
        if _cmp_pool is None:
            _cmp_pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=max(1, min(8, torch.get_num_threads())), thread_name_prefix="elasticrun-compare")
        return _cmp_pool


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous CPU tensors of one dtype and shape hold the same bytes.

    ``memcmp`` (the GIL released by ctypes), in 64 MiB slices over a few threads for large
    tensors: comparing 1 GiB costs about what copying it does. Byte equality, not ``==``:
    a NaN equals itself here, and -0.0 differs from 0.0, as a copy would preserve them."""
    if a.dtype != b.dtype or a.shape != b.shape or a.device.type != "cpu" or b.device.type != "cpu" \
            or not a.is_contiguous() or not b.is_contiguous():
        return False
    n = a.numel() * a.element_size()
    pa, pb = a.data_ptr(), b.data_ptr()
    if n <= _CMP_SLICE:
        return n == 0 or _memcmp(pa, pb, n) == 0
    slices = [(pa + o, pb + o, min(_CMP_SLICE, n - o)) for o in range(0, n, _CMP_SLICE)]
    return all(_pool().map(lambda s: _memcmp(*s) == 0, slices))


class Watch:
    """Which committed tensors of a model changed since a newcomer began to fetch them.

    Set on a model's handler by the rank serving the fetch; while it is set, every commit
    compares each tensor with its committed copy before overwriting it and names those
    that differ (``changed``), and a commit that had to reallocate its buffers marks all
    (``everything``). A tensor it does not name was not written since the watch began, so
    the bytes the newcomer read are still the committed ones."""

    #: A watch no fetch renewed for this long ends at the next commit: a newcomer that
    #: fetched and then never joined must not leave every commit comparing for good.
    LIFETIME_S = 60.0

    def __init__(self, epoch: int, now: float) -> None:
        self.epoch = epoch
        self.names: list[str] = []  # the committed copies offered for fetching
        self.changed: set[str] = set()
        self.everything = False
        self.renewed = now  # when a fetch last began under it

    def expired(self, now: float) -> bool:
        return now - self.renewed > self.LIFETIME_S

    def unchanged(self, names: list[str]) -> list[str]:
        return [] if self.everything else [n for n in names if n not in self.changed]


class WatchedPlan:
    """A commit's copy while a watch is set, built once per plan: tensors of at most
    :data:`MEMMOVE_MAX_BYTES`, and any not both on the CPU, are copied by one :class:`CopyPlan`
    and named as changed (sending them again in the join's sync costs less than comparing
    them one by one, ~3 µs of Python each); the larger ones are compared first
    (:func:`watched_copy`)."""

    def __init__(self, named: Sequence[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
        def compared(src: torch.Tensor, buf: torch.Tensor) -> bool:
            return src.device.type == "cpu" and buf.device.type == "cpu" and _nbytes(src) > MEMMOVE_MAX_BYTES
        small = [t for t in named if not compared(t[1], t[2])]
        self._plan = CopyPlan([src for _, src, _ in small], [buf for _, _, buf in small])
        self._names = [name for name, _, _ in small]
        self._large = [t for t in named if compared(t[1], t[2])]

    def run(self, watch: Watch) -> None:
        self._plan.run()
        watch.changed.update(self._names)
        watched_copy(self._large, watch)


def watched_copy(named: Sequence[tuple[str, torch.Tensor, torch.Tensor]], watch: Watch) -> None:
    """Copy each ``(name, source, buffer)`` of host tensors, as a commit does, writing only
    what differs and naming it in ``watch``."""
    with torch.no_grad():
        for name, src, buf in named:
            if not same_bytes(src, buf):
                buf.copy_(src)
                watch.changed.add(name)
