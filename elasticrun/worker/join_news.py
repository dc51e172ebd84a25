"""What a rank's samplers recorded before it called ``hvd.join()``, for the others' commits.

A rank that runs out of data trains its last steps, then joins: those steps' gradients are in
every replica (the others averaged them), but the batches were recorded only in its own
``ElasticSampler``, and its next commit comes after ``join()``. The others commit meanwhile,
each merging what every rank recorded since the last commit (``SamplerStateHandler.merge``),
and a joined rank has no sampler there: it contributes nothing. So the commits made while it
sat in ``join()`` held its batches' gradients without its batches, and any reset that rolled
back to one of them (a host lost, the joined rank's host removed, a SIGTERM) handed those
batches out again: trained twice.

So a rank publishes, as it joins, what its running elastic state's samplers recorded since
its last commit: on the round's store (the driver's, authenticated; JSON, never a pickle),
compressed and in parts that fit a message. A commit on another rank merges it for each
rank that contributes nothing to the gather because it is in ``join()``.

A rank that commits once an epoch joins with millions of such indices. They travel as bits
(one per index below the largest, when that is smaller than 8 bytes an index) or as raw
little-endian int64s, after a short JSON header, built and read in slices: the JSON of a list
of 10M ints was 94 MB and one 1.5 s call that held the GIL (and its parse another 1.1 s), with
every other rank waiting in a collective for the joining one meanwhile.
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any, Callable

import torch

from elasticrun.worker.exceptions import HorovodInternalError
from elasticrun.worker.index_set import IndexSet, int64_tensor, to_list
from elasticrun.worker.rounds import Round
from elasticrun.worker.waiting import join_key

#: Bytes of one part on the store (base64 in a message under the 1 MiB frame limit).
PART = 256 * 1024

# sampler name -> (epoch, indices recorded since the last commit), of the state hvd.elastic.run runs
_pending: Callable[[], dict[str, tuple[int, list[int]]]] | None = None
# (round, join generation, rank) -> what that rank published
_read: dict[tuple[int, int, int], dict[str, tuple[int, list[int]]]] = {}


def pending_from(news: Callable[[], dict[str, tuple[int, list[int]]]] | None) -> None:
    """Have ``join()`` publish what ``news()`` returns (``hvd.elastic.run`` sets its state's)."""
    global _pending
    _pending = news


def encode(news: dict[str, tuple[int, list[int]]]) -> bytes:
    """``news`` as bytes: a 4-byte length, a JSON header naming each sampler's epoch, form
    and size, then each sampler's indices (bits below the largest, or int64s), compressed."""
    header: dict[str, list[Any]] = {}
    body: list[bytes] = []
    for name, (epoch, indices) in news.items():
        try:
            t = int64_tensor(indices if isinstance(indices, list) else list(indices))
        except OverflowError:
            raise ValueError(f"sampler {name!r}: an index beyond 64 bits in what it recorded") from None
        if t.numel() and int(t.min()) < 0:
            raise ValueError(f"sampler {name!r}: a negative index in what it recorded: {int(t.min())}")
        top = int(t.max()) + 1 if t.numel() else 0
        if -(-top // 8) < 8 * t.numel():  # bits are smaller
            s = IndexSet(top)
            s.put_tensor(t)
            data = s.packed()
            header[name] = [int(epoch), "bits", top, len(data)]
        else:
            out = bytearray(8 * t.numel())
            if out:
                torch.frombuffer(out, dtype=torch.int64).copy_(t)
            data = bytes(out)
            header[name] = [int(epoch), "i64", t.numel(), len(data)]
        body.append(data)
    head = json.dumps(header).encode()
    # (zlib lets the GIL go while it compresses; level 1: the bits of a dense epoch are what it
    # finds, at a fraction of the default's time)
    return zlib.compress(struct.pack("<I", len(head)) + head + b"".join(body), 1)


def decode(blob: bytes) -> dict[str, tuple[int, list[int]]]:
    """What :func:`encode` gave; ``ValueError`` for bytes it could not have."""
    raw = zlib.decompress(blob)
    if len(raw) < 4:
        raise ValueError(f"{len(raw)} bytes: not even a header's length")
    (size,) = struct.unpack_from("<I", raw)
    header = json.loads(raw[4:4 + size])
    at = 4 + size
    out: dict[str, tuple[int, list[int]]] = {}
    for name, (epoch, form, count, length) in header.items():
        data = raw[at:at + length]
        at += length
        if len(data) != length:
            raise ValueError(f"sampler {name!r}: {len(data)} of {length} bytes")
        if form == "bits":
            out[str(name)] = (int(epoch), IndexSet.unpacked(int(count), data).sorted_list())
        elif form == "i64" and length == 8 * count:
            out[str(name)] = (int(epoch), to_list(torch.frombuffer(bytearray(data), dtype=torch.int64)) if count else [])
        else:
            raise ValueError(f"sampler {name!r}: {form!r} of {count} in {length} bytes")
    if at != len(raw):
        raise ValueError(f"{len(raw) - at} bytes past the last sampler's")
    return out


def publish(r: Round, gen: int) -> None:
    """In ``join()``, before this rank is counted as joined (so it is there by the time any
    other rank sees it contribute nothing)."""
    assert r.store is not None
    blob = encode(_pending() if _pending is not None else {})
    parts = [blob[i:i + PART] for i in range(0, len(blob), PART)]
    for n, part in enumerate(parts):
        r.store.set(join_key(f"{gen}/news/{r.rank}/{n}"), part)  # type: ignore[arg-type]  # stub: str; bytes work
    r.store.set(join_key(f"{gen}/news/{r.rank}"), str(len(parts)))


def published(r: Round, rank: int) -> dict[str, tuple[int, list[int]]]:
    """What ``rank``, now in ``join()`` in round ``r``, published as it joined."""
    key = (r.number, r.join_gen, rank)
    got = _read.get(key)
    if got is None:
        assert r.store is not None
        gen = r.join_gen
        try:
            count = int(r.store.get(join_key(f"{gen}/news/{rank}")))
            blob = b"".join(bytes(r.store.get(join_key(f"{gen}/news/{rank}/{n}"))) for n in range(count))
            got = decode(blob)
        except Exception as exc:  # (an aborted round's store, the driver gone): this commit cannot complete
            raise HorovodInternalError(f"what rank {rank} recorded before it joined could not be read from the "
                                       f"round's store: {exc}") from exc
        for old in [k for k in _read if k[:2] != key[:2]]:  # (only the current join is read again)
            del _read[old]
        _read[key] = got
    return got
