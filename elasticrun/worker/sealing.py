"""Pickles over gloo travel sealed with the job's secret, and are opened before they are loaded.

gloo's connections are not authenticated: a peer is told apart by the small sequence number it
sends first, so a local user who reaches a worker's gloo port before the real peer can write
to it (docs/security.md). Tensors from such a peer can spoil training; a pickle from it would run
code in the worker. ``broadcast_object`` and ``allgather_object`` (every ``sync()`` uses them)
therefore send each pickle behind an HMAC-SHA256 of the job's secret, which only the job's own
processes hold (it reached them through a pipe), bound to the round, the operation, the
sending rank and the process set; nothing is unpickled before its seal is checked.

A process outside a job (``python train.py`` alone) has no secret and no peer: nothing to seal.
"""

from __future__ import annotations

import hashlib
import hmac

from elasticrun.worker import client
from elasticrun.worker.exceptions import HorovodInternalError

#: Bytes of the seal in front of every pickle.
TAG = 32
#: The job secret is used for the control channel too: objects get a key of their own from it.
_DOMAIN = b"elasticrun: objects over gloo, v1"
_derived: tuple[bytes, bytes] | None = None  # (secret, its object key)


def _key() -> bytes | None:
    global _derived
    keys = client.loaded_keys()
    if keys is None:
        return None
    secret = keys.secret
    if _derived is None or _derived[0] != secret:
        _derived = (secret, hmac.new(secret, _DOMAIN, hashlib.sha256).digest())
    return _derived[1]


def _tag(key: bytes, context: str, payload: bytes | memoryview) -> bytes:
    mac = hmac.new(key, context.encode() + b"\0", hashlib.sha256)
    mac.update(payload)
    return mac.digest()


def seal(payload: bytes, context: str, size: int) -> bytes:
    """``payload`` (a pickle) with its seal in front. ``size``: the ranks it goes to (a
    process alone in no job sends nothing anywhere and needs no key)."""
    key = _key()
    if key is None:
        if size > 1:
            raise RuntimeError("this worker holds no job secret, so it cannot seal what it sends to its peers")
        return bytes(TAG) + payload
    return _tag(key, context, payload) + payload


def opened(blob: bytes | memoryview, context: str, what: str, size: int) -> memoryview:
    """The pickle inside ``blob``, once its seal is the job's; HorovodInternalError otherwise
    (the round is reset: nothing from a stranger is ever loaded)."""
    view = memoryview(blob)
    key = _key()
    if key is None and size <= 1:
        return view[TAG:]
    if key is None or len(view) < TAG or not hmac.compare_digest(bytes(view[:TAG]), _tag(key, context, view[TAG:])):
        raise HorovodInternalError(
            f"{what}: the bytes that came over gloo do not carry the job's seal, so they are not from a rank of "
            f"this job (did someone else connect to this worker's gloo port?); not unpickled")
    return view[TAG:]
