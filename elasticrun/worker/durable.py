"""A worker's side of durable copies (``--checkpoint-dir``): hand a shard off, send it, restore.

Every rank holds the same committed state, so a durable copy is sharded by bytes: the state's
tensors, laid end to end, are ``data.bin``; rank ``r`` of ``N`` sends bytes
``[r*B/N, (r+1)*B/N)``, so no rank carries the whole copy, and rank 0 also sends the pickled
rest (``meta``: the non-tensor state and the index of the tensors).

Off the training path: at the commit the ranks agreed to copy, the training thread only copies
its shard out of the commit buffers into a staging buffer (:meth:`DurableSender.hand_off`:
1/N of the state, at memcpy speed; from a GPU, it only queues that copy, on a side stream
into pinned memory, and the sending thread waits for it); a background thread then sends it
to the driver, chunk by chunk, each acknowledged (the flow control: at most one chunk in
flight per rank). A copy that cannot be sent (the driver refuses it, a timeout) is dropped
with a warning: the job goes on with its in-memory commits.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
import zmq

from elasticrun.common.auth import WorkerKeys, secure_client
from elasticrun.common.protocol import MAX_FRAME_BYTES, Codec, ProtocolError, copy_name, new_sender_id
from elasticrun.common.ratelimit import LimitedLog, LogLimiter

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


def stage_range(tensors: Sequence[torch.Tensor], entries: Sequence[Entry], offset: int,
                staging: torch.Tensor) -> Any:
    """:func:`copy_range` into ``staging`` (pinned host memory, uint8) where some tensors are on a
    GPU: their bytes are copied on a side stream, after what the caller's stream queued so far
    (the commit), without the host waiting; CPU tensors' bytes are copied now. Returns the
    CUDA event that marks the GPU copies done (the sender waits for it before reading)."""
    end = offset + staging.numel()
    dst = staging.data_ptr()
    device = next(t.device for t in tensors if t.is_cuda)
    side = _staging_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.no_grad(), torch.cuda.stream(side):
        for t, e in zip(tensors, entries):
            lo, hi = max(offset, e.offset), min(end, e.offset + e.nbytes)
            if lo >= hi:
                continue
            if t.is_cuda:
                flat = t.detach().reshape(-1) if t.is_contiguous() else t.detach().contiguous().reshape(-1)
                staging[lo - offset:hi - offset].copy_(flat.view(torch.uint8)[lo - e.offset:hi - e.offset],
                                                       non_blocking=True)
            else:
                src = t.detach().contiguous()
                ctypes.memmove(dst + (lo - offset), src.data_ptr() + (lo - e.offset), hi - lo)
        event = torch.cuda.Event()
        event.record(side)
    return event


_staging_streams: dict[torch.device, Any] = {}


def _staging_stream(device: torch.device) -> Any:
    stream = _staging_streams.get(device)
    if stream is None:
        stream = _staging_streams[device] = torch.cuda.Stream(device)
    return stream


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU uint8 tensor, as a memoryview (no copy, no numpy)."""
    return memoryview((ctypes.c_char * t.numel()).from_address(t.data_ptr())).cast("B") if t.numel() else \
        memoryview(b"")


def fill_range(tensors: Sequence[torch.Tensor], entries: Sequence[Entry], offset: int, data: bytes) -> None:
    """The reverse of :func:`copy_range`: bytes of data.bin into the (contiguous CPU) tensors."""
    data = bytes(data)
    end = offset + len(data)
    src = ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0  # ``data`` stays alive below
    for t, e in zip(tensors, entries):
        lo, hi = max(offset, e.offset), min(end, e.offset + e.nbytes)
        if lo < hi:
            ctypes.memmove(t.data_ptr() + (lo - e.offset), src + (lo - offset), hi - lo)


class DurableMismatch(RuntimeError):
    """A durable copy does not fit the state it is restored into (one line naming the first
    key that differs): a restore refuses it rather than train a model it does not belong to."""


@dataclass(frozen=True)
class _TensorRef:
    index: int


def _like(d: dict, items: list[tuple[Any, Any]]) -> dict:
    """A dict of ``d``'s type (OrderedDict for a state_dict) with these items."""
    try:
        return type(d)(items)
    except TypeError:
        return dict(items)


def split_tensors(tree: Any, prefix: str = "") -> tuple[list[tuple[str, torch.Tensor]], Any]:
    """(the tensors of ``tree`` with their paths, ``tree`` with each tensor replaced by a
    reference): the tensors go to data.bin, raw; the rest is pickled once (meta)."""
    tensors: list[tuple[str, torch.Tensor]] = []

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append((path, x.detach()))
            return _TensorRef(len(tensors) - 1)
        if isinstance(x, dict):
            return _like(x, [(k, walk(v, f"{path}.{k}" if path else str(k))) for k, v in x.items()])
        if type(x) in (list, tuple):
            return type(x)(walk(v, f"{path}[{i}]") for i, v in enumerate(x))
        return x

    return tensors, walk(tree, prefix)


def encode_meta(structure: Any, entries: Sequence[Entry], commit: int, steps: int) -> bytes:
    import cloudpickle

    return cloudpickle.dumps({"format": 1, "structure": structure, "entries": list(entries), "commit": commit,
                              "steps": steps})


def decode(meta: bytes, data: bytes) -> tuple[Any, int, int]:
    """(the state tree with its tensors, commit, steps) of a durable copy."""
    import cloudpickle

    try:
        m = cloudpickle.loads(meta)
        entries: list[Entry] = m["entries"]
    except Exception as exc:  # the driver verified its checksum: this is another version's format
        raise DurableMismatch(f"the durable copy's metadata cannot be read here ({type(exc).__name__}: {exc})") \
            from None
    tensors = []
    for e in entries:
        dtype = getattr(torch, e.dtype.removeprefix("torch."))
        tensors.append(torch.empty(e.shape, dtype=dtype))
    fill_range(tensors, entries, 0, data)

    def put(x: Any) -> Any:
        if isinstance(x, _TensorRef):
            return tensors[x.index]
        if isinstance(x, dict):
            return _like(x, [(k, put(v)) for k, v in x.items()])
        if type(x) in (list, tuple):
            return type(x)(put(v) for v in x)
        return x

    return put(m["structure"]), int(m["commit"]), int(m["steps"])


def check_fits(name: str, live: Any, saved: Any) -> None:
    """Raise DurableMismatch naming the first key where ``saved`` (a state_dict from a durable
    copy) does not fit ``live`` (the same object's state_dict now): keys, shapes, dtypes."""
    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
                raise DurableMismatch(f"{path}: the model has {type(a).__name__}, the durable copy {type(b).__name__}")
            if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
                raise DurableMismatch(f"{path}: the model has {tuple(a.shape)} {a.dtype}, the durable copy "
                                      f"{tuple(b.shape)} {b.dtype}")
        elif isinstance(a, dict) and isinstance(b, dict):
            for k in a:
                if k not in b:
                    raise DurableMismatch(f"{path}.{k}: in the model, not in the durable copy")
                walk(a[k], b[k], f"{path}.{k}")
            for k in b:
                if k not in a:
                    raise DurableMismatch(f"{path}.{k}: in the durable copy, not in the model")

    walk(live, saved, name)


def check_optimizer_fits(name: str, live: Any, saved: Any) -> None:
    """Raise DurableMismatch when ``saved`` (an optimizer's state_dict from a durable copy) is
    another kind of optimizer's than ``live`` (this one's now): torch's load_state_dict takes it
    and merges the options, so an Adam(lr=1e-3) resumed from an SGD(lr=0.1) copy trained on
    with SGD's learning rate and momentum, silently. Options only one side has are a newer
    torch's (it adds some with defaults): only options missing on both sides refuse it."""
    try:
        mine = [set(g) - {"params"} for g in live["param_groups"]]
        theirs = [set(g) - {"params"} for g in saved["param_groups"]]
    except (KeyError, TypeError):
        raise DurableMismatch(f"{name}: the durable copy holds no optimizer state") from None
    if len(mine) != len(theirs):
        raise DurableMismatch(f"{name}: the optimizer has {len(mine)} parameter group(s), the durable copy "
                              f"{len(theirs)}")
    for i, (a, b) in enumerate(zip(mine, theirs)):
        if a - b and b - a:
            raise DurableMismatch(f"{name}.param_groups[{i}]: another optimizer's options (the durable copy has "
                                  f"{', '.join(sorted(b - a)[:4])}; this one has {', '.join(sorted(a - b)[:4])})")


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
    staged: bytearray | memoryview
    meta: bytes  # rank 0 only
    ready: Any = None  # a CUDA event: the staging copy from the GPU is done (None: it was done at once)


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
            return msg.body, bytes(data)  # bytes already (recv_multipart copies): the same object

    def close(self) -> None:
        self._sock.close(0)


class CommittedState(Protocol):
    """What a durable hand-off reads of the state right after a commit (``elastic.State``)."""

    @property
    def commit_seq(self) -> int: ...

    def durable_state(self) -> dict[str, Any]: ...

    def staging_sources(self, tensors: list[Any]) -> list[Any]: ...


class HandOff:
    """This rank's part in durable copies, in one place: from the agreement that a commit is
    copied to its shard in the sender. The runtime holds one (with ``--checkpoint-dir``) and
    gives it the state a commit just saved; the state only says what it holds
    (:class:`CommittedState`)."""

    def __init__(self, sender: DurableSender):
        self.sender = sender

    @property
    def busy(self) -> bool:
        """The last copy is still being sent: this rank cannot take another yet."""
        return self.sender.busy

    def before_commit(self) -> None:
        """A commit is about to overwrite its buffers: a copy still reading them on the GPU goes
        first (ordered on the GPU; the host does not wait)."""
        self.sender.order_after_staging()

    def give(self, state: CommittedState, request: int, rank: int, size: int, steps: int) -> None:
        """This rank's shard of the commit ``state`` just saved (the training thread's only cost:
        copying 1/size of it into staging); the sender does the rest."""
        tensors, structure = split_tensors(state.durable_state())
        entries = layout(tensors)
        commit = state.commit_seq

        def meta() -> bytes:  # rank 0 only, on this thread: the state does not move meanwhile
            return encode_meta(structure, entries, commit, steps)
        live = [t for _, t in tensors]
        sources = state.staging_sources(live)
        # A GPU tensor no commit buffer stands in for is read live, on a side stream: the next
        # step, which updates it, must wait for that read (on the GPU; the host goes on).
        self.sender.hand_off(request, rank, size, commit, steps, sources, entries, meta,
                             guard=any(s is t and t.is_cuda for s, t in zip(sources, live)))

    def close(self) -> None:
        self.sender.close()


class DurableSender:
    """Sends this rank's shard of agreed commits to the driver, on a thread of its own."""

    def __init__(self, ctx: zmq.Context, endpoint: str, keys: WorkerKeys, job_id: str):
        self._channel = _Channel(ctx, endpoint, keys, job_id)
        self._pending: _Copy | None = None
        self._staging = bytearray()  # reused: a fresh one would page-fault in on the training thread
        self._pinned: torch.Tensor | None = None  # reused too: the staging of shards that live on a GPU
        self._staged_event: Any = None  # the last GPU staging copy (a commit must not overwrite its source first)
        self._cv = threading.Condition()
        self._busy = False
        self._closed = False
        self.sent = 0  # copies sent whole (tests, logs)
        # A shard refused (a full disk, a copy the driver gave up) is said once, then counted
        # once a minute: the driver says why, once, and copies may follow one another.
        self._refused = LimitedLog(log, limiter=LogLimiter(first=1, interval=60.0))
        self._thread = threading.Thread(target=self._run, name="elasticrun-durable-send", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> bool:
        """A shard is still queued or being sent (this rank cannot take another yet)."""
        return self._busy or self._pending is not None

    def hand_off(self, request: int, rank: int, world: int, commit: int, steps: int,
                 tensors: Sequence[torch.Tensor], entries: Sequence[Entry], meta: Callable[[], bytes],
                 guard: bool = False) -> bool:
        """Copy this rank's shard of the just-saved commit into staging and queue it (the
        training thread's only cost). False if the previous copy is still being sent: this one
        is skipped (the next agreed commit will be copied). ``guard``: some GPU tensors are the
        live ones, so the caller's stream is ordered after their staging copy."""
        with self._cv:
            if self._busy or self._pending is not None or self._closed:
                return False
            total = entries[-1].offset + entries[-1].nbytes if entries else 0
            offset, size = shard_range(total, rank, world)
            ready = None
            if any(t.is_cuda for t in tensors) and size:
                if self._pinned is None or self._pinned.numel() != size:
                    self._pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
                ready = self._staged_event = stage_range(tensors, entries, offset, self._pinned)
                if guard:
                    torch.cuda.current_stream(ready.device).wait_event(ready)
                staged: bytearray | memoryview = _view(self._pinned)
            else:
                if len(self._staging) != size:
                    self._staging = bytearray(size)
                staged = self._staging
                copy_range(tensors, entries, offset, memoryview(staged))
            self._pending = _Copy(request, rank, world, commit, steps, time.time(), total, offset, staged,
                                  meta() if rank == 0 else b"", ready)
            self._cv.notify()
            return True

    def order_after_staging(self) -> None:
        """Order the caller's CUDA stream after the last staging copy from the GPU (its source,
        the commit's buffers, is about to be overwritten); the host does not wait."""
        event = self._staged_event
        if event is not None:
            if event.query():
                self._staged_event = None
            else:
                torch.cuda.current_stream(event.device).wait_event(event)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(5.0)
        self._channel.close()
        self._refused.flush(force=True)

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._pending is None and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                c, self._pending, self._busy = self._pending, None, True
            assert c is not None  # the wait above ends only with a copy pending, or closed
            try:
                self._send(c)
                self.sent += 1
            except Exception as exc:  # the driver refused it, or is gone: the job goes on
                self._refused.warn("durable-copy shards not sent", f"durable copy ({copy_name(c.request)}): rank "
                                   f"{c.rank} could not send its shard (the driver's log says why; training goes "
                                   f"on): {exc}", type(exc).__name__)
            finally:
                with self._cv:
                    self._busy = False
            self._refused.flush()

    def _send(self, c: _Copy) -> None:
        if c.ready is not None:
            c.ready.synchronize()  # the bytes from the GPU are in the staging buffer
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
        # The chunks came unauthenticated but for their headers: check them against the
        # checksums of the manifest, which came in an authenticated message.
        if hashlib.sha256(parts["meta"]).hexdigest() != info["meta_sha256"]:
            raise RuntimeError("the durable copy's metadata arrived damaged (checksum mismatch)")
        view = memoryview(parts["data"])
        for offset, size, sha in info["shards"]:
            if hashlib.sha256(view[offset:offset + size]).hexdigest() != sha:
                raise RuntimeError(f"the durable copy's bytes {offset}..{offset + size} arrived damaged")
        return info, parts["meta"], parts["data"]
    finally:
        ch.close()


class CopyRequests:
    """The driver's requests for a durable copy, and when every rank agrees to hand one off.

    A request must be served at one commit by every rank at once (each sends its shard of the
    same commit), but ranks hear of it at different moments. So, like host updates, it is
    agreed at a commit through a collective the commit already runs: each rank offers
    (``wanted``: it has an unserved request; ``busy``: its previous shard is still being sent)
    and the copy is made when some rank wants it and none is busy. The agreement travels in
    the DistributedOptimizer's first gradient bucket (:meth:`agreed`), or in the commit's own
    tiny allreduce. Pure: the control thread only calls :meth:`record`.
    """

    def __init__(self) -> None:
        self._latest = 0  # the newest request id heard (one int: read without a lock)
        self._served = 0
        self._agreed: tuple[int, bool, bool] | None = None  # (round, wanted, busy)

    def record(self, request: int) -> None:
        if request > self._latest:
            self._latest = request

    def local_flags(self, busy: bool) -> tuple[bool, bool]:
        return self._latest > self._served, busy

    def agreed(self, round_: int, wanted: bool, busy: bool) -> None:
        self._agreed = (round_, wanted, busy)

    def forget_agreed(self) -> None:
        """As :meth:`HostUpdates.forget_agreed` (after ``join()``): a request not served is still pending."""
        self._agreed = None

    def take_agreed(self, round_: int) -> tuple[bool, bool] | None:
        """(wanted, busy) agreed in a gradient allreduce of this round since the last commit."""
        agreed, self._agreed = self._agreed, None
        if agreed is None or agreed[0] != round_:
            return None
        return agreed[1], agreed[2]

    def served(self) -> int:
        """A copy was handed off: every request heard so far is answered by it."""
        self._served = self._latest
        return self._served
