"""Authenticated control-plane messages between the driver and its workers.

A frame on the wire is ``MAC (32 bytes) || payload``, where payload is UTF-8 JSON::

    {"v": 1, "t": type, "job": job_id, "from": sender, "seq": n, "to": recipient|null, "body": {...}}

and MAC is HMAC-SHA256(secret, payload). Why this shape:

* The MAC is checked *before* the payload is parsed, so a forged or corrupted frame is
  dropped without touching a parser; bodies are plain JSON data, never pickles.
* ``seq`` strictly increases per sender, and the receiver remembers the last ``seq`` it
  accepted from every sender, so a captured frame cannot be replayed. Senders are random
  per process, so a restarted worker starts a fresh sequence under a new name.
* ``to`` binds a reply to one recipient, so a reply captured on one worker's connection
  cannot be replayed to another; ``job`` stops cross-talk between two jobs that happen to
  share a secret or a port.
"""

from __future__ import annotations

import hmac
import itertools
import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

PROTOCOL_VERSION = 1
MAC_BYTES = 32
#: Frames larger than this are refused (ZeroMQ also drops the connection of a peer that
#: sends one, via ``zmq.MAXMSGSIZE``). Control messages are small; 1 MiB is generous.
MAX_FRAME_BYTES = 1 << 20
#: Senders a Codec keeps a replay entry for (~90 B each), the least recently heard dropped first.
#: Each worker process sends under new random ids, so a job that replaces workers for days kept
#: every one it ever heard (a soak: +330 entries for 143 worker starts, never freed). Far above
#: the live senders of the largest job (3 a worker: 12,288 at 4,096 workers); an entry dropped
#: is of a sender silent the longest, whose old frames (MAC'd with the job's secret) could then
#: pass once more.
MAX_SENDERS = 65536

# One encoder and one decoder for every frame: ``json.dumps``/``loads`` build or look these up
# per call, and the one-shot ``hmac.digest`` runs in C where ``hmac.new(...).digest()`` builds
# two Python objects. Every message pays these (the driver answers thousands of heartbeats a
# second at 4,096 workers): a heartbeat in the driver's handler costs 0.93-0.96x what it did
# (benchmarks/heartbeats.py).
_ENCODER = json.JSONEncoder(separators=(",", ":"))  # ensure_ascii: a payload is ASCII, so UTF-8
_DECODER = json.JSONDecoder()


def _mac(secret: bytes, payload: bytes) -> bytes:
    return hmac.digest(secret, payload, "sha256")


class ProtocolError(Exception):
    """A frame was refused: bad MAC, malformed, wrong job, replayed or too large.

    ``reason`` is a short fixed text ("bad MAC", "too large"...) for counting refused frames
    without logging each one (``elasticrun.common.ratelimit``)."""

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


def _short(value: Any) -> str:
    """repr() of a peer-supplied value, cut short: an error message must stay one short line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def new_secret() -> bytes:
    """A fresh per-job secret (256 bits)."""
    return os.urandom(32)


def new_sender_id(prefix: str) -> str:
    return f"{prefix}-{os.urandom(6).hex()}"


def copy_id(round_: int, commit: int) -> int:
    """The id of a round's durable copy of one commit, the same on every rank: a later round's
    copy always has the higher id (a restore can take the commit count back down)."""
    return round_ << 32 | (commit & 0xFFFFFFFF)


def copy_name(copy: int) -> str:
    """A copy id as a user reads it, not as the number on the wire."""
    return f"round {copy >> 32}'s copy of commit {copy & 0xFFFFFFFF}"


@dataclass(frozen=True)
class Message:
    type: str
    sender: str
    seq: int
    body: dict[str, Any]
    to: str | None = None


@dataclass
class Codec:
    """Encodes and verifies frames for one socket (thread-safe).

    Use one Codec per socket, never one shared by two sockets: sequence numbers are only
    ordered within one FIFO connection, so a counter or replay table shared across sockets
    would see honest frames out of order and reject them as replays.
    """

    secret: bytes
    job_id: str
    sender: str
    _counter: Any = field(default_factory=lambda: itertools.count(1), repr=False)
    _last_seen: OrderedDict[str, int] = field(default_factory=OrderedDict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def encode(self, type_: str, body: dict[str, Any] | None = None, to: str | None = None) -> bytes:
        with self._lock:
            seq = next(self._counter)
        payload = _ENCODER.encode(
            {"v": PROTOCOL_VERSION, "t": type_, "job": self.job_id, "from": self.sender,
             "seq": seq, "to": to, "body": body or {}}).encode()
        if len(payload) + MAC_BYTES > MAX_FRAME_BYTES:
            raise ProtocolError(f"message {_short(type_)} is {len(payload)} bytes, over the {MAX_FRAME_BYTES} limit",
                                "too large")
        return _mac(self.secret, payload) + payload

    def decode(self, frame: bytes) -> Message:
        """Verify and parse one frame; raise ProtocolError (without parsing) if it is not genuine.

        Nothing else is raised, whatever the frame holds: the size is checked before the MAC
        is computed, the MAC before the JSON is parsed, and every header field's type after."""
        if len(frame) > MAX_FRAME_BYTES:
            raise ProtocolError(f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES} limit", "too large")
        if len(frame) <= MAC_BYTES:
            raise ProtocolError("frame too short to carry a MAC", "too short")
        mac, payload = frame[:MAC_BYTES], frame[MAC_BYTES:]
        expected = _mac(self.secret, payload)
        if not hmac.compare_digest(mac, expected):
            raise ProtocolError("bad MAC (wrong secret or tampered frame)", "bad MAC")
        try:
            obj = _DECODER.decode(payload.decode())  # not UTF-8 (never ours): malformed
            version, type_, job, sender, seq, to, body = (
                obj["v"], obj["t"], obj["job"], obj["from"], obj["seq"], obj.get("to"), obj["body"])
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            raise ProtocolError(f"malformed payload: {type(exc).__name__}") from None
        # type() is not isinstance(): JSON true is not protocol version 1 nor sequence number 1.
        if type(version) is not int or version != PROTOCOL_VERSION:
            raise ProtocolError(f"protocol version {_short(version)}, expected {PROTOCOL_VERSION}", "wrong version")
        if job != self.job_id:
            raise ProtocolError(f"message for job {_short(job)}, this is job {self.job_id!r}", "wrong job")
        if (type(seq) is not int or seq >= 1 << 63 or not isinstance(sender, str) or not isinstance(type_, str)
                or not isinstance(body, dict) or not (to is None or isinstance(to, str))):
            raise ProtocolError("malformed header fields")
        if to is not None and to != self.sender:
            raise ProtocolError(f"message addressed to {_short(to)}, not to {self.sender!r}", "wrong recipient")
        with self._lock:
            seen = self._last_seen
            if seq <= seen.get(sender, 0):
                raise ProtocolError(f"replayed or reordered frame from {_short(sender)} (seq {_short(seq)})", "replayed")
            seen[sender] = seq
            seen.move_to_end(sender)
            if len(seen) > MAX_SENDERS:
                seen.popitem(last=False)
        return Message(type=type_, sender=sender, seq=seq, body=body, to=to)

    def encode_with_blob(self, type_: str, body: dict[str, Any], blob: bytes | memoryview,
                         to: str | None = None) -> list[bytes | memoryview]:
        """A message with raw bytes attached (bulk data: durable-copy shards), as two frames:
        the usual authenticated header, naming the blob's length, then the blob itself (no
        base64, no copy into JSON, no MAC pass over it).

        The blob's *content* is not covered by the header's MAC: bulk data is checked end to
        end instead, against a SHA-256 its sender puts in an authenticated message (a shard's
        ``ckpt_end``, a copy's manifest), which costs one hash pass instead of a MAC pass per
        hop plus a hash. (The transport is CURVE-authenticated and encrypted as well.)"""
        if len(blob) > MAX_FRAME_BYTES:
            raise ProtocolError(f"a blob of {len(blob)} bytes is over the {MAX_FRAME_BYTES} limit", "too large")
        return [self.encode(type_, dict(body, blob=len(blob)), to), blob]

    def decode_with_blob(self, header: bytes, blob: bytes | memoryview) -> tuple[Message, bytes | memoryview]:
        """Verify the header of a message of :meth:`encode_with_blob` and the blob's length
        (the caller checks the blob's content against its sender's checksum)."""
        if len(blob) > MAX_FRAME_BYTES:
            raise ProtocolError("frame over the size limit", "too large")
        msg = self.decode(header)
        if msg.body.get("blob") != len(blob):
            raise ProtocolError("the blob's length does not match its header")
        return msg, blob

    def forget(self, sender: str) -> None:
        """Drop the replay entry of a peer that is gone (keeps the table bounded)."""
        with self._lock:
            self._last_seen.pop(sender, None)
