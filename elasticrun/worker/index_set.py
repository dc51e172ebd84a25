"""A set of dataset indices ``0 <= i < n`` kept as one byte per index of the dataset.

An ``ElasticSampler`` deep into a large epoch holds millions of processed indices. As a Python
``set`` they cost about 60 bytes each (1 GB a copy at 18M indices, and a sampler's handler keeps
a second, committed copy), and every whole-set step (building a set, sorting it, pickling it for
a sync) was one C call that held the GIL for seconds: the worker's heartbeat thread could not
run, and past ``--heartbeat-timeout`` the driver took the worker for hung and killed it, in the
middle of the very restore that followed a failure.

Here a set is a ``bytearray`` of ``n`` bytes (20 MB at 20M) and a count: ``in`` is one byte read,
a recorded batch a few byte writes, and every whole-set step (copy, union, difference, sorted
list, packing for the wire) is a torch operation over a view of the bytes, or a loop over
slices of :data:`SLICE` indices: the GIL is let go between slices, so no call holds it for
long whatever the dataset's size. Pure data: no threads, no I/O.
"""

from __future__ import annotations

import array
import itertools
from collections.abc import Iterable, Iterator, MutableSet
from typing import Any

import torch

#: Indices handled per step of a whole-set loop: a few milliseconds of one C call.
SLICE = 1 << 18

# A record of fewer indices than this is written byte by byte (cheaper than building tensors).
SMALL = 2048

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _out_of_range(n: int, bad: list[int]) -> ValueError:
    return ValueError(f"indices out of range for a dataset of {n}: {bad[:5]}")


def int64_tensor(ints: list[int]) -> torch.Tensor:
    """``torch.tensor(ints, dtype=torch.int64)``, a slice at a time, through ``array`` (7x
    faster than ``torch.tensor`` of a list: 0.4 s instead of 1.2 s at 18M). ``OverflowError``
    for an int beyond 64 bits, ``TypeError`` for an item without ``__index__`` (a float)."""
    parts = [torch.frombuffer(array.array("q", ints[a:a + SLICE]), dtype=torch.int64)
             for a in range(0, len(ints), SLICE)]
    return torch.cat(parts) if len(parts) > 1 else parts[0] if parts else torch.zeros(0, dtype=torch.int64)


def checked_int64(indices: Iterable[Any], n: int) -> torch.Tensor:
    """``indices`` (ints, anything ``int()`` takes, or a tensor) as a 1-D int64 tensor, every
    one checked to lie in ``[0, n)``: ``ValueError`` naming up to five that do not. Built a
    slice at a time: a list comprehension over millions took seconds (20 s to merge another
    rank's 18M news at a commit)."""
    if isinstance(indices, torch.Tensor):
        t = indices.detach().reshape(-1).cpu().to(torch.int64)
    else:
        parts: list[torch.Tensor] = []
        chunks: Iterator[Any]
        if isinstance(indices, (list, tuple)):
            chunks = (indices[a:a + SLICE] for a in range(0, len(indices), SLICE))
        else:
            it = iter(indices)
            chunks = iter(lambda: list(itertools.islice(it, SLICE)), [])
        for chunk in chunks:
            try:
                try:
                    parts.append(int64_tensor(chunk if isinstance(chunk, list) else list(chunk)))
                except TypeError:  # (floats, strings: what int() takes, as a plain set's user gave them)
                    parts.append(int64_tensor([int(i) for i in chunk]))
            except OverflowError:
                raise _out_of_range(n, [int(i) for i in chunk if not 0 <= int(i) < n]) from None
        t = torch.cat(parts) if len(parts) > 1 else parts[0] if parts else torch.zeros(0, dtype=torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= n):
        raise _out_of_range(n, to_list(t[(t < 0) | (t >= n)][:5]))
    return t


class IndexSet(MutableSet[int]):
    """A mutable set of the indices ``0 <= i < n``: what a plain ``set`` of them does (``in``,
    ``len``, ``add``, ``update``, ``|``, ``==``, iteration), in ``n`` bytes. Iteration is in
    increasing order. An index outside ``[0, n)`` is refused with a ``ValueError``.

    ``edits`` counts the changes made through the set's public methods: an ``ElasticSampler``
    records through :meth:`put`, which does not count, so its handler can tell a set changed
    by hand (whose news it must find by comparing the whole set) from one changed by records.
    """

    __slots__ = ("_bytes", "_count", "edits")

    def __init__(self, n: int, indices: Iterable[int] = ()) -> None:
        if n < 0:
            raise ValueError(f"a dataset of {n} indices")
        self._bytes = bytearray(n)
        self._count = 0
        self.edits = 0
        self.put(indices)

    # ------------------------------------------------------------------ construction

    def copy(self) -> IndexSet:
        """An independent copy (one ``memcpy`` of ``n`` bytes)."""
        out = IndexSet.__new__(IndexSet)
        out._bytes = bytearray(self._bytes)
        out._count = self._count
        out.edits = 0
        return out

    def packed_tensor(self) -> torch.Tensor:
        """The set as a uint8 tensor of ``ceil(n / 8)`` bytes, one bit per index (a durable copy
        writes it raw: a list of millions of ints was pickled in one GIL-holding call)."""
        n = self.n
        if n == 0:
            return torch.zeros(0, dtype=torch.uint8)
        bits = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8)
        bits[:n] = self._view()
        return (bits.view(-1, 8) * _BITS).sum(1, dtype=torch.uint8)

    def packed(self) -> bytes:
        """:meth:`packed_tensor` as bytes: what a sync sends (a pickled sorted list of millions
        of ints was hundreds of MB, and one GIL-holding call to build)."""
        t = self.packed_tensor()
        out = bytearray(t.numel())
        if out:
            torch.frombuffer(out, dtype=torch.uint8).copy_(t)
        return bytes(out)

    @classmethod
    def unpacked(cls, n: int, data: bytes | torch.Tensor) -> IndexSet:
        """The set :meth:`packed` (or :meth:`packed_tensor`) gave for a dataset of ``n`` indices."""
        if isinstance(data, torch.Tensor):
            if data.dtype != torch.uint8 or data.dim() != 1:
                raise ValueError(f"a packed set is a 1-D uint8 tensor, not {data.dtype} of shape {tuple(data.shape)}")
            size = data.numel()
        else:
            size = len(data)
        if size != -(-n // 8):
            raise ValueError(f"{size} bytes for a set of {n} indices (expected {-(-n // 8)})")
        out = cls(n)
        if n:
            if isinstance(data, torch.Tensor):
                packed = data.cpu()
            else:
                packed = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            bits = ((packed.unsqueeze(1) & _BITS) != 0).view(-1)[:n]
            view = out._view()
            view.copy_(bits)
            out._count = int(view.sum())
        return out

    def __reduce__(self) -> tuple[Any, ...]:
        return IndexSet.unpacked, (self.n, self.packed())

    # ------------------------------------------------------------------ the set

    @property
    def n(self) -> int:
        """The dataset's length: indices run over ``[0, n)``."""
        return len(self._bytes)

    def __contains__(self, i: object) -> bool:
        if isinstance(i, int):
            k = i
        else:  # (a numpy or torch integer; anything else is in no set of ints)
            index = getattr(i, "__index__", None)
            if index is None:
                return False
            k = index()
        return 0 <= k < len(self._bytes) and bool(self._bytes[k])

    def __len__(self) -> int:
        return self._count

    def _parts(self) -> Iterator[list[int]]:
        """The indices in increasing order, a list per slice of the bytes."""
        if self._count:
            view = self._view()
            for a in range(0, self.n, SLICE):
                yield (view[a:a + SLICE].nonzero().view(-1) + a).tolist()

    def __iter__(self) -> Iterator[int]:
        for part in self._parts():
            yield from part

    def sorted_list(self) -> list[int]:
        """The indices in increasing order, as a list (what ``sorted(s)`` gives, in slices)."""
        out: list[int] = []
        for part in self._parts():
            out.extend(part)
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, IndexSet) and other.n == self.n:
            return self._count == other._count and self._bytes == other._bytes
        return super().__eq__(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, as a set

    def __repr__(self) -> str:
        head = list(itertools.islice(iter(self), 8))
        more = ", ..." if self._count > len(head) else ""
        return f"IndexSet(n={self.n}, {self._count} indices: {head}{more})"

    @classmethod
    def _from_iterable(cls, it: Iterable[Any]) -> set[Any]:
        # What the Set mixins (&, |, -, ^) return: a plain set (they know no n).
        return set(it)

    def add(self, value: int) -> None:
        self.edits += 1
        self.put((value,))

    def discard(self, value: int) -> None:
        if value in self:
            self.edits += 1
            self._bytes[value] = 0
            self._count -= 1

    def clear(self) -> None:
        self.edits += 1
        if self._count:
            self._view().zero_()
        self._count = 0

    def update(self, *others: Iterable[int]) -> None:
        """Add every index of ``others`` (as ``set.update``)."""
        self.edits += 1
        for other in others:
            self.put(other)

    def __ior__(self, other: Any) -> IndexSet:  # type: ignore[misc]  # as typeshed's MutableSet.__ior__ (in place)
        self.update(other)
        return self

    # ------------------------------------------------------------------ whole-set steps

    def put(self, indices: Iterable[int]) -> int:
        """Add ``indices`` without counting an edit; returns how many were new. All of them
        are checked first, so a bad index adds none."""
        if isinstance(indices, IndexSet) and indices.n == self.n:
            return self._merge(indices)
        if isinstance(indices, (list, tuple, set, frozenset, range)) and len(indices) < SMALL:
            return self._put_small(list(indices))
        return self.put_tensor(checked_int64(indices, self.n))

    def put_tensor(self, t: torch.Tensor) -> int:
        """:meth:`put` of an int64 tensor already known to lie in ``[0, n)``
        (:func:`checked_int64`'s)."""
        if not t.numel():
            return 0
        view = self._view()
        if t.numel() > self.n // 64:  # (a recount of n bytes costs less than sorting t)
            view[t] = 1
            before, self._count = self._count, int(view.sum())
            return self._count - before
        t = t.unique()
        added = int((view[t] == 0).sum())
        view[t] = 1
        self._count += added
        return added

    def _put_small(self, indices: list[int]) -> int:
        n = self.n
        checked = [int(i) for i in indices]
        bad = [i for i in checked if not 0 <= i < n]
        if bad:
            raise _out_of_range(n, bad)
        return self.put_checked(checked)

    def put_checked(self, indices: list[int] | torch.Tensor) -> int:
        """:meth:`put` of ints, or an int64 tensor, already known to lie in ``[0, n)`` (a
        sampler's checked record)."""
        if isinstance(indices, torch.Tensor):
            return self.put_tensor(indices)
        if len(indices) >= SMALL:
            return self.put(indices)
        b, added = self._bytes, 0
        for i in indices:
            if not b[i]:
                b[i] = 1
                added += 1
        self._count += added
        return added

    def _merge(self, other: IndexSet) -> int:
        if not other._count:
            return 0
        view = self._view()
        view.logical_or_(other._view())
        before, self._count = self._count, int(view.sum())
        return self._count - before

    def issubset_of(self, other: IndexSet) -> bool:
        """Whether every index here is in ``other`` (of the same ``n``)."""
        if self._count > other._count:
            return False
        return self._count == 0 or not bool((self._view() > other._view()).any())

    def minus(self, other: IndexSet) -> list[int]:
        """The indices here and not in ``other`` (of the same ``n``), in increasing order."""
        if not self._count:
            return []
        diff = (self._view() > other._view()).nonzero().view(-1)
        return to_list(diff)

    def keep_mask(self, order: torch.Tensor) -> torch.Tensor:
        """For a tensor of indices: which are *not* in the set (what a reset hands out)."""
        if not self._count:
            return torch.ones(order.numel(), dtype=torch.bool)
        return self._view()[order] == 0

    def _view(self) -> torch.Tensor:
        """The bytes as a uint8 tensor sharing their memory (n must be > 0)."""
        return torch.frombuffer(self._bytes, dtype=torch.uint8)


def slices(t: torch.Tensor, start: int = 0) -> Iterator[list[int]]:
    """``t[start:].tolist()`` of a 1-D tensor, a list per slice: one ``tolist`` of millions
    held the GIL for seconds."""
    for a in range(start, t.numel(), SLICE):
        yield t[a:a + SLICE].tolist()


def to_list(t: torch.Tensor) -> list[int]:
    """``t.tolist()`` of a 1-D tensor, in slices."""
    if t.numel() <= SLICE:
        return t.tolist()
    out: list[int] = []
    for part in slices(t):
        out.extend(part)
    return out


class Records:
    """The indices a sampler recorded since a point (its last commit), as its batches'
    lists while they are few (a commit then costs what is new, not the epoch), folded into an
    :class:`IndexSet` past :data:`FOLD` of them (a script that commits once an epoch: a Python
    set of the whole epoch was a gigabyte, and its growth held the GIL for as long as it took to
    rehash it). The records are lists of ints, or int64 tensors (a merge of another rank's
    thousands), already checked to lie in ``[0, n)``."""

    FOLD = 1 << 20

    __slots__ = ("n", "_parts", "_size", "_mask")

    def __init__(self, n: int) -> None:
        self.n = n
        self._parts: list[list[int] | torch.Tensor] = []
        self._size = 0  # indices in _parts, repeats counted
        self._mask: IndexSet | None = None

    def add(self, checked: list[int] | torch.Tensor) -> None:
        """Record ``checked``: ints or an int64 tensor, known to lie in ``[0, n)``."""
        if isinstance(checked, torch.Tensor) and checked.numel() < SMALL:
            checked = checked.tolist()  # (so that a tensor is never one of a few records: see absent_from)
        if self._mask is None and self._size + len(checked) > self.FOLD:
            self._mask = self._folded()
            self._parts, self._size = [], 0
        if self._mask is not None:
            self._mask.put_checked(checked)
            return
        self._parts.append(checked)
        self._size += len(checked)

    def __len__(self) -> int:
        """An upper bound of the distinct indices recorded (exact once folded)."""
        return len(self._mask) if self._mask is not None else self._size

    def _folded(self) -> IndexSet:
        mask = IndexSet(self.n)
        for part in self._parts:
            mask.put_checked(part)
        return mask

    def absent_from(self, done: IndexSet) -> list[int]:
        """The recorded indices not in ``done`` (an :class:`IndexSet` of the same ``n``), in
        increasing order."""
        if self._mask is None and self._size < SMALL:  # (lists only: a tensor record holds SMALL or more)
            b = done._bytes
            return sorted({i for part in self._parts for i in part if not b[i]})
        return (self._mask if self._mask is not None else self._folded()).minus(done)
