"""A worker's side of durable copies (``--checkpoint-dir``): hand a shard off, send it, restore.

Every rank holds the same committed state, so a durable copy is sharded by bytes: the state's
tensors, laid end to end, are ``data.bin``; rank ``r`` of ``N`` sends bytes
``[r*B/N, (r+1)*B/N)``, so no rank carries the whole copy, and rank 0 also sends the pickled
rest (``meta``: the non-tensor state and the index of the tensors).

Off the training path: at the commit the ranks agreed to copy, the training thread only copies
its shard out of the commit buffers into a staging buffer (:meth:`DurableSender.hand_off`:
1/N of the state, at memcpy speed); a background thread then sends it to the driver, chunk by
chunk, each acknowledged (the flow control: at most one chunk in flight per rank). A copy that
cannot be sent (the driver refuses it, a timeout) is dropped with a warning: the job goes on
with its in-memory commits.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import zmq

from elasticrun.common.auth import WorkerKeys, secure_client
from elasticrun.common.protocol import MAX_FRAME_BYTES, Codec, ProtocolError, new_sender_id

log = logging.getLogger("elasticrun.worker")

#: Bytes per message (with the header, under the frame limit).
CHUNK = MAX_FRAME_BYTES // 2
#: How long one chunk may wait for its acknowledgement.
CHUNK_TIMEOUT = 30.0


@dataclass(frozen=True)
class Entry:
    """One tensor of a durable copy: where its bytes are in data.bin."""

    key: str
    dtype: str  # str(torch dtype), e.g. "torch.float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def layout(tensors: Sequence[tuple[str, torch.Tensor]]) -> list[Entry]:
    """The index of ``tensors`` laid end to end (the order given; every rank gives the same)."""
    out, offset = [], 0
    for key, t in tensors:
        n = t.numel() * t.element_size()
        out.append(Entry(key, str(t.dtype), tuple(t.shape), offset, n))
        offset += n
    return out


def shard_range(total: int, rank: int, world: int) -> tuple[int, int]:
    """Rank ``rank``'s bytes of a ``total``-byte copy: (offset, size)."""
    start, end = total * rank // world, total * (rank + 1) // world
    return start, end - start


def copy_range(tensors: Sequence[torch.Tensor], entries: Sequence[Entry], offset: int, out: memoryview) -> None:
    """Copy bytes ``[offset, offset + len(out))`` of the tensors laid end to end into ``out``."""
    end = offset + len(out)
    dst = ctypes.addressof(ctypes.c_char.from_buffer(out)) if len(out) else 0
    for t, e in zip(tensors, entries):
        lo, hi = max(offset, e.offset), min(end, e.offset + e.nbytes)
        if lo >= hi:
            continue
        src = t if t.is_contiguous() and t.device.type == "cpu" else t.detach().to("cpu").contiguous()
        ctypes.memmove(dst + (lo - offset), src.data_ptr() + (lo - e.offset), hi - lo)


def fill_range(tensors: Sequence[torch.Tensor], entries: Sequence[Entry], offset: int, data: bytes) -> None:
    """The reverse of :func:`copy_range`: bytes of data.bin into the (contiguous CPU) tensors."""
    data = bytes(data)
    end = offset + len(data)
    src = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0  # ``data`` stays alive below
    for t, e in zip(tensors, entries):
        lo, hi = max(offset, e.offset), min(end, e.offset + e.nbytes)
        if lo < hi:
            ctypes.memmove(t.data_ptr() + (lo - e.offset), src + (lo - offset), hi - lo)


@dataclass
class _Copy:
    request: int
    rank: int
    world: int
    commit: int
    steps: int
    saved_at: float
    data_bytes: int
    offset: int
    staged: bytearray
    meta: bytes  # rank 0 only


class _Channel:
    """Request/reply with the driver's durable-copy socket (one outstanding request)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: WorkerKeys, job_id: str):
        self._codec = Codec(keys.secret, job_id, new_sender_id("durable"))
        self._sock = ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        secure_client(self._sock, keys, MAX_FRAME_BYTES + 4096)
        self._sock.connect(endpoint)
        self._req = 0

    def request(self, type_: str, body: dict[str, Any], blob: bytes | memoryview | None = None,
                timeout: float = CHUNK_TIMEOUT) -> tuple[dict[str, Any], bytes]:
        self._req += 1
        body = dict(body, req=self._req)
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout * 1000))
        try:
            if blob is None:
                self._sock.send(self._codec.encode(type_, body))
            else:
                self._sock.send_multipart(self._codec.encode_with_blob(type_, body, blob))
        except zmq.Again:
            raise TimeoutError(f"could not send {type_} to the driver within {timeout:g} s") from None
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                raise TimeoutError(f"the driver did not answer {type_} within {timeout:g} s")
            parts = self._sock.recv_multipart()
            try:
                if len(parts) == 2:
                    msg, data = self._codec.decode_with_blob(parts[0], parts[1])
                else:
                    msg, data = self._codec.decode(parts[0]), b""
            except ProtocolError as exc:
                log.warning("dropped a durable-copy frame: %s", exc)
                continue
            if msg.body.get("re") != self._req:
                continue  # an answer to an abandoned request
            if msg.type == "error" or "error" in msg.body:
                raise RuntimeError(str(msg.body.get("error")))
            return msg.body, data

    def close(self) -> None:
        self._sock.close(0)


class DurableSender:
    """Sends this rank's shard of agreed commits to the driver, on a thread of its own."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: WorkerKeys, job_id: str):
        self._channel = _Channel(ctx, endpoint, keys, job_id)
        self._pending: _Copy | None = None
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.sent = 0  # copies sent whole (tests, logs)
        self._thread = threading.Thread(target=self._run, name="elasticrun-durable-send", daemon=True)
        self._thread.start()

    def hand_off(self, request: int, rank: int, world: int, commit: int, steps: int,
                 tensors: Sequence[torch.Tensor], entries: Sequence[Entry], meta: Callable[[], bytes]) -> bool:
        """Copy this rank's shard of the just-saved commit into staging and queue it (the
        training thread's only cost). False if the previous copy is still being sent: this one
        is skipped (the next agreed commit will be copied)."""
        with self._cv:
            if self._busy or self._pending is not None or self._closed:
                return False
            total = entries[-1].offset + entries[-1].nbytes if entries else 0
            offset, size = shard_range(total, rank, world)
            staged = bytearray(size)
            copy_range(tensors, entries, offset, memoryview(staged))
            self._pending = _Copy(request, rank, world, commit, steps, time.time(), total, offset, staged,
                                  meta() if rank == 0 else b"")
            self._cv.notify()
            return True

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(5.0)
        self._channel.close()

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                c, self._pending, self._busy = self._pending, None, True
            try:
                self._send(c)
                self.sent += 1
            except Exception as exc:  # the driver refused it, or is gone: the job goes on
                log.warning("durable copy %d: rank %d could not send its shard: %s", c.request, c.rank, exc)
            finally:
                with self._cv:
                    self._busy = False

    def _send(self, c: _Copy) -> None:
        ch = self._channel
        ch.request("ckpt_begin", {"id": c.request, "rank": c.rank, "world": c.world, "commit": c.commit,
                                  "steps": c.steps, "saved_at": c.saved_at, "data_bytes": c.data_bytes,
                                  "meta_bytes": len(c.meta)})
        view = memoryview(c.staged)
        for i in range(0, len(view), CHUNK):
            ch.request("ckpt_data", {"id": c.request, "offset": c.offset + i}, view[i:i + CHUNK])
        meta = memoryview(c.meta)
        for i in range(0, len(meta), CHUNK):
            ch.request("ckpt_meta", {"id": c.request, "offset": i}, meta[i:i + CHUNK])
        end = {"id": c.request, "rank": c.rank, "offset": c.offset, "size": len(c.staged),
               "sha256": hashlib.sha256(c.staged).hexdigest()}
        if c.rank == 0:
            end["meta_sha256"] = hashlib.sha256(c.meta).hexdigest()
        ch.request("ckpt_end", end)


def fetch(ctx: zmq.Context, endpoint: str, keys: WorkerKeys, job_id: str) -> tuple[dict[str, Any], bytes, bytes]:
    """The newest durable copy from the driver: (info, meta bytes, data bytes). For a restore."""
    ch = _Channel(ctx, endpoint, keys, job_id)
    try:
        info, _ = ch.request("ckpt_info", {})
        parts = {}
        for name, size in (("meta", int(info["meta_bytes"])), ("data", int(info["data_bytes"]))):
            buf = bytearray(size)
            for i in range(0, size, CHUNK):
                _, chunk = ch.request("ckpt_read", {"number": info["number"], "file": name, "offset": i,
                                                    "size": min(CHUNK, size - i)})
                buf[i:i + len(chunk)] = chunk
            parts[name] = bytes(buf)
        return info, parts["meta"], parts["data"]
    finally:
        ch.close()
