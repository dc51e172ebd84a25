"""The driver's side of durable copies: receiving shards, writing them, serving restores.

Durable copies move megabytes to gigabytes, so they have a socket and a thread of their own:
the driver's event loop (heartbeats, rendezvous, notifications) never waits for a shard to be
verified or written. The socket is a CURVE server behind the job's ZAP gate like the control
socket, and every message is HMAC-authenticated; a shard's bytes travel as a raw second frame
covered by the MAC (``Codec.encode_with_blob``), so nothing is base64-encoded or parsed.

Worker -> driver messages (each answered with ``ack`` or ``error``, which is the flow control):

    ckpt_begin  {id, rank, world, commit, steps, saved_at, data_bytes, meta_bytes (rank 0)}
    ckpt_data   {id, offset} + bytes of data.bin       ckpt_meta {id, offset} + bytes (rank 0)
    ckpt_end    {id, rank, offset, size, sha256, meta_sha256 (rank 0)}
    ckpt_info   {}                        -> the newest copy: number, commit, steps, sizes
    ckpt_read   {number, file, offset, size}  -> bytes of meta.bin or data.bin (a restore)

One copy is written at a time: a request with a newer id replaces an unfinished one, and an
unfinished copy is dropped after ``stale_after`` seconds (a rank died mid-transfer). A failed
write is a warning: the job goes on with its in-memory commits and the older copies.

Every request is answered, a bad one with an ``error`` naming what was wrong, and no request,
however malformed, ends the service: an exception in handling one is one rate-limited line,
and the thread serves the next (a dead service would leave a restore waiting for nothing).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

import zmq

from elasticrun.common.auth import JobKeys, secure_server
from elasticrun.common.protocol import MAX_FRAME_BYTES, Codec, Message, ProtocolError, copy_name, new_sender_id
from elasticrun.common.ratelimit import LimitedLog
from elasticrun.driver.durable import checkpoints as ck

log = logging.getLogger("elasticrun")

#: Bytes per message of a shard or a restore (with the header, under the frame limit).
CHUNK = MAX_FRAME_BYTES // 2


class DurableService(threading.Thread):
    """Durable copies of the job's commits in ``directory``; see the module docstring.

    ``on_written(durable, seconds)`` is called (on this thread) when a copy is whole on disk;
    ``on_failed(began, line)`` when a copy was not written (``began``: when its first message
    came, on the monotonic clock: which request it answered is the workers' agreement).
    ``lineage``: the lineage new copies carry (that of the copy resumed from, or a new one).
    """

    def __init__(self, ctx: zmq.Context, keys: JobKeys, job_id: str, directory: ck.CheckpointDir, *,
                 on_written: Callable[[ck.Durable, float], None], on_failed: Callable[[float, str], None],
                 lineage: str, keep: int = 2, stale_after: float = 600.0, newest: ck.Durable | None = None):
        super().__init__(name="elasticrun-durable", daemon=True)
        self.directory = directory
        self._lineage = lineage
        self._codec = Codec(keys.secret, job_id, new_sender_id("driver-durable"))
        self._job = job_id
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        secure_server(self._sock, keys, MAX_FRAME_BYTES + 4096)
        self._on_written, self._on_failed = on_written, on_failed
        self._keep, self._stale_after = keep, stale_after
        # A copy failed for want of room: from then on this job's older copies are removed
        # before each new one is begun (the newest whole one always stays), so that a disk with
        # room for ``keep`` copies, not keep + 1, still gets new ones.
        self._tight = False
        self._newest = newest  # what a restore reads
        self._newest_began = -math.inf
        self._writer: ck.Writer | None = None
        self._writing: tuple[int, float] | None = None  # (request id, when its first shard came)
        self._went_back: int | None = None  # the last request refused for a commit older than the newest copy's
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._endpoints: dict[str, str] = {}
        self._to_bind: list[tuple[str, threading.Event]] = []
        self._dropped = LimitedLog(log)
        self._broken = LimitedLog(log)  # requests that raised while handled

    # --- the driver's side ---------------------------------------------------------------------
    def bind(self, endpoint_base: str) -> str:
        """Listen on ``tcp://ADDR`` (a random port); return the endpoint workers connect to.
        Before :meth:`start` only; afterwards use :meth:`endpoint` (the socket is this thread's)."""
        port = self._sock.bind_to_random_port(endpoint_base)
        return f"{endpoint_base}:{port}"

    def endpoint(self, endpoint_base: str, timeout: float = 5.0) -> str:
        """The endpoint on ``tcp://ADDR``, bound on first use by the service's own thread."""
        with self._lock:
            known = self._endpoints.get(endpoint_base)
            if known is not None:
                return known
            if not self.is_alive():
                self._endpoints[endpoint_base] = self.bind(endpoint_base)
                return self._endpoints[endpoint_base]
            done = threading.Event()
            self._to_bind.append((endpoint_base, done))
        if not done.wait(timeout):
            raise OSError(f"the durable-copy service did not listen on {endpoint_base} within {timeout:g} s")
        with self._lock:
            if endpoint_base not in self._endpoints:
                raise OSError(f"the durable-copy service cannot listen on {endpoint_base}")
            return self._endpoints[endpoint_base]

    def _bind_requested(self) -> None:
        with self._lock:
            todo, self._to_bind = self._to_bind, []
        for base, done in todo:
            try:
                endpoint = self.bind(base)
                with self._lock:
                    self._endpoints[base] = endpoint
            except zmq.ZMQError as exc:
                log.error("the durable-copy service cannot listen on %s: %s", base, exc)
            done.set()

    @property
    def newest(self) -> ck.Durable | None:
        with self._lock:
            return self._newest

    @property
    def newest_began(self) -> float:
        """When (monotonic) the newest copy written here began: a stop's last copy must have
        begun after the stop asked for it (one begun before is of an older commit). -inf for a
        copy this job did not write (the one it resumed from) or none."""
        with self._lock:
            return self._newest_began

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self.join(timeout)
        if self._writer is not None:
            self._writer.abort()
            self._writer = None
        self._sock.close(0)

    # --- the thread ----------------------------------------------------------------------------
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stopping.is_set():
            try:
                self._bind_requested()
                if poller.poll(50):
                    for _ in range(64):
                        try:
                            parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message([p.buffer for p in parts])
                self._expire()
            except zmq.ZMQError as exc:
                if self._stopping.is_set():
                    return
                self._broken.warn("durable-copy service errors", f"the durable-copy service: {exc}", "zmq")
            except Exception as exc:  # a bug must cost one request, never the service
                self._broken.warn("durable-copy service errors", f"the durable-copy service: "
                                  f"{type(exc).__name__}: {str(exc)[:200]}", type(exc).__name__)

    def _on_message(self, parts: list[memoryview]) -> None:
        if len(parts) not in (2, 3):
            self._dropped.warn("dropped durable-copy frames", f"dropped a message of {len(parts)} frames", "shape")
            return
        identity = bytes(parts[0])
        try:
            if len(parts) == 3:
                msg, blob = self._codec.decode_with_blob(bytes(parts[1]), parts[2])
            else:
                msg, blob = self._codec.decode(bytes(parts[1])), b""
        except ProtocolError as exc:
            self._dropped.warn("dropped durable-copy frames", f"dropped a durable-copy frame: {exc}", exc.reason)
            return
        try:
            reply, data = self._handle(msg, blob)
        except ck.CheckpointError as exc:  # the copy being written cannot be finished
            if self._writer is not None and msg.type.startswith("ckpt_") and msg.type not in ("ckpt_info", "ckpt_read"):
                self._fail(self._no_room(exc))
            reply, data = {"error": str(exc)[:500]}, None
        except (KeyError, TypeError, ValueError) as exc:  # a malformed request: refused, nothing changes
            reply, data = {"error": f"bad {msg.type[:40]} request: {type(exc).__name__}: {str(exc)[:300]}"}, None
        except Exception as exc:  # anything else: answered, said once in a while, and served on
            self._broken.warn("durable-copy service errors", f"a {msg.type[:40]} request failed: "
                              f"{type(exc).__name__}: {str(exc)[:200]}", type(exc).__name__)
            reply, data = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}, None
        body = dict(reply, re=msg.body.get("req"))
        try:
            if data is None:
                self._sock.send_multipart([identity, self._codec.encode("ack" if "error" not in reply else "error",
                                                                        body, to=msg.sender)], zmq.NOBLOCK)
            else:
                self._sock.send_multipart([identity, *self._codec.encode_with_blob("ack", body, data, to=msg.sender)],
                                          zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            pass  # the worker is gone

    def _handle(self, msg: Message, blob: Any) -> tuple[dict[str, Any], bytes | None]:
        b = msg.body
        if msg.type == "ckpt_info":
            d = self.newest
            if d is None:
                return {"error": "there is no durable copy"}, None
            m = d.manifest
            return {"number": m.number, "commit": m.commit, "steps": m.steps, "saved_at": m.saved_at,
                    "meta_bytes": m.meta_bytes, "data_bytes": m.data_bytes, "meta_sha256": m.meta_sha256,
                    "shards": [[x.offset, x.size, x.sha256] for x in m.shards]}, None
        if msg.type == "ckpt_read":
            d = self.newest
            if d is None or _count(b, "number") != d.manifest.number:
                return {"error": f"durable copy {str(b.get('number'))[:20]} is not the newest"}, None
            name = {"meta": "meta.bin", "data": "data.bin"}.get(str(b.get("file")))
            if name is None:
                raise ValueError(f"file {str(b.get('file'))[:20]!r}: meta or data")
            total = d.manifest.meta_bytes if name == "meta.bin" else d.manifest.data_bytes
            offset, size = _count(b, "offset"), _count(b, "size")
            if offset > total:
                raise ValueError(f"offset {offset} lies past {name}'s {total} bytes")
            return {}, self.directory.read_range(d, name, offset, min(size, CHUNK, total - offset))
        request = _count(b, "id")
        if msg.type == "ckpt_begin":
            self._begin(request, b)
            return {}, None
        w = self._current(request)
        if msg.type == "ckpt_data":
            w.write(_count(b, "offset"), blob)
        elif msg.type == "ckpt_meta":
            w.write_meta(_count(b, "offset"), blob)
        elif msg.type == "ckpt_end":
            w.shard_done(_count(b, "offset"), _count(b, "size"), str(b["sha256"]))
            if b.get("meta_sha256"):
                w.meta_done(str(b["meta_sha256"]))
            if w.complete:
                self._finish(w)
        else:
            raise ValueError(f"unknown request {msg.type!r}")
        return {}, None

    def _begin(self, request: int, b: dict[str, Any]) -> None:
        world, rank = _count(b, "world"), _count(b, "rank")
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} of {world}")
        if self._writing is not None and self._writing[0] != request:
            if request < self._writing[0]:
                raise ValueError(f"{copy_name(request)} was replaced by {copy_name(self._writing[0])}")
            self._fail(f"{copy_name(self._writing[0])} was not whole when {copy_name(request)} began")
        if self._writer is None:
            commit, newest = _count(b, "commit"), self._newest
            if newest is not None and commit < newest.manifest.commit:
                # Commits only move forward in a job, and a round that no holder joins restores
                # the newest copy: an older commit is a state that went back (the script's initial
                # one). Written, it would have rotated away the copy the job resumed from.
                if request != self._went_back:
                    self._went_back = request
                    self._on_failed(time.monotonic(), (
                        f"durable copy not written: it is of commit {commit}, older than the newest copy "
                        f"({newest.name}, commit {newest.manifest.commit}), which is kept: the workers' state "
                        f"went back (an elasticrun bug: please report it with this log)"))
                raise ValueError(f"commit {commit} is older than the newest copy's ({newest.manifest.commit})")
            self._writing = (request, time.monotonic())
            if self._tight:
                try:
                    self.directory.rotate(self._lineage, max(1, self._keep - 1))
                except (OSError, ck.CheckpointError):
                    pass  # the write below says what is wrong
            try:
                self._writer = ck.Writer(self.directory, self.directory.next_number(), commit=_count(b, "commit"),
                                         steps=_count(b, "steps"), saved_at=float(b["saved_at"]), job=self._job,
                                         lineage=self._lineage, world=world, data_bytes=_count(b, "data_bytes"))
            except ck.CheckpointError as exc:
                self._fail(self._no_room(exc))
                raise
        if rank == 0:
            self._writer.meta_size(_count(b, "meta_bytes"))

    def _current(self, request: int) -> ck.Writer:
        if self._writer is None or self._writing is None or self._writing[0] != request:
            raise ValueError(f"{copy_name(request)} is not being written")
        return self._writer

    def _finish(self, w: ck.Writer) -> None:
        assert self._writing is not None
        started = self._writing[1]
        self._writer, self._writing = None, None
        try:
            durable = w.commit(self._keep)
        except ck.CheckpointError as exc:
            self._on_failed(started, f"durable copy not written ({self._no_room(exc)}); training goes on from the "
                                     f"in-memory commits")
            return
        with self._lock:
            self._newest, self._newest_began = durable, started
        self._on_written(durable, time.monotonic() - started)

    def _no_room(self, exc: ck.CheckpointError) -> str:
        """``exc`` in words; a first want of room makes every later copy begin by removing this
        job's older copy (said once, with it)."""
        if not isinstance(exc, ck.NoSpace) or self._tight:
            return str(exc)
        self._tight = True
        try:
            others = self.directory.others(self._lineage)
        except OSError:
            others = []
        kept = (f"; {self.directory.path} also holds {len(others)} {'copy' if len(others) == 1 else 'copies'} of an earlier run that this job never "
                f"removes ({', '.join(others[:4])}{', ...' if len(others) > 4 else ''}): remove them if they are "
                f"no longer needed") if others else ""
        return (f"{exc}; from now on this job's older copy is removed before each new one is written, and the "
                f"newest whole copy is always kept{kept}")

    def _fail(self, why: str) -> None:
        if self._writer is not None:
            self._writer.abort()
        began = self._writing[1] if self._writing is not None else time.monotonic()
        self._writer, self._writing = None, None
        self._on_failed(began, f"durable copy not written ({why}); training goes on from the in-memory commits")

    def _expire(self) -> None:
        if self._writing is not None and time.monotonic() - self._writing[1] > self._stale_after:
            self._fail(f"not all ranks sent their shards within {self._stale_after:g} s")
        self._dropped.flush()


def _count(body: dict[str, Any], key: str) -> int:
    """A non-negative whole number of a request (KeyError, ValueError: the request is refused)."""
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} must be a whole number, 0 or more, not {str(value)[:20]!r}")
    return value
