"""Copy plans: the tensor copy a commit makes, with as little Python per tensor as possible.

A commit copies every tensor of the state into a host buffer. For a state of a few large
tensors that is a memcpy. For a state of hundreds of small tensors (a small CNN or a
transformer: weights, biases, norms, Adam's two moments and step counters) the bytes are
cheap and the per-tensor overhead is not: torch's ``copy_`` costs about 1 µs of dispatch
per call, and walking ``state_dict()`` and checking each buffer costs more.

A :class:`CopyPlan` is built once for a list of live tensors and their buffers and then
replayed. Small contiguous CPU tensors are copied with one ``memmove`` each (about 0.3 µs,
and the GIL is released during the copy); large ones and device tensors keep ``copy_``
(multi-threaded for large CPU tensors, asynchronous into pinned memory from the GPU).

Safety: the plan keeps a reference to every source's storage, so a raw copy can never read
freed memory, even if the live tensor was re-pointed (``p.data = ...``) after the plan was
built. Whether it still describes the live state is checked with :meth:`CopyPlan.current`
(identity and data pointer of every source) before every replay.
"""

from __future__ import annotations

import ctypes
import operator
from collections import deque
from itertools import starmap
from typing import Callable, Sequence

import torch

__all__ = ["CopyPlan", "MEMMOVE_MAX_BYTES"]

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
        self._device = False
        self._all: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # (buffers, sources)
        for src, dst in zip(self._keep, self._buffers):
            nbytes = src.numel() * src.element_size()
            if nbytes == 0:
                continue
            self._all[0].append(dst)
            self._all[1].append(src)
            if _raw_copyable(src, dst):
                self._raw.append((_data_ptr(dst), _data_ptr(src), nbytes))
            else:
                self._torch.append((dst, src))
                self._device = self._device or src.device.type != "cpu"

    def __len__(self) -> int:
        return len(self._sources)

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

    def run_released(self) -> None:
        """The same copy in one torch call, which takes the GIL once instead of once per
        tensor: for a background thread, whose per-tensor GIL hand-offs would otherwise
        queue behind the training thread's Python."""
        if self._device:  # mixed devices: not one foreach call
            self.run()
        elif self._all[0]:
            with torch.no_grad():
                torch._foreach_copy_(*self._all)

    def run(self) -> None:
        """Copy every source into its buffer (waits for device copies)."""
        deque(starmap(_memmove, self._raw), 0)
        with torch.no_grad():
            for dst, src in self._torch:
                dst.copy_(src, non_blocking=src.is_cuda)
        if self._device and torch.cuda.is_available():
            torch.cuda.synchronize()
