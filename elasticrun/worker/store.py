"""A ``torch.distributed.Store`` served by the driver over the authenticated control channel.

Why not a TCPStore: the store must outlive any worker (losing rank 0 must not take the
rendezvous down), it should not open a second, unauthenticated port, and the driver must not
import torch. gloo only needs set/get/wait during group formation, so routing them through the driver costs
well under a millisecond each.

But gloo asks for every rank's address one key at a time (a ``wait`` and a ``get`` per rank,
2N round trips per rank). While a group forms (:meth:`DriverStore.forming`), reads ask the
driver for a snapshot of every key under the same prefix written since the last one, and
answer from it: a rank needs a few round trips instead of 2N. Only then: gloo writes each
rendezvous key once, so a snapshot cannot go stale, whereas a key read in a loop (a counter)
must always go to the driver.
"""

from __future__ import annotations

import base64
import contextlib
from datetime import timedelta
from typing import Callable, Iterator

import torch.distributed as dist

from elasticrun.worker.client import DriverClient


def _b64(value: bytes | str) -> str:
    return base64.b64encode(value.encode() if isinstance(value, str) else bytes(value)).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def delete_keys(store: dist.Store, prefix: str, keys: list[str]) -> None:
    """Delete ``keys`` of ``store``, a ``PrefixStore(prefix, DriverStore)`` (a round's): in one
    round trip to the driver, or one per key on any other store."""
    under = getattr(store, "underlying_store", None)
    if isinstance(under, DriverStore):
        under.delete_keys([f"{prefix}/{k}" for k in keys])
        return
    for key in keys:
        store.delete_key(key)


class DriverStore(dist.Store):
    """Key/value store whose keys live in the driver. Blocking reads honour the timeout and abort."""

    def __init__(self, client: DriverClient, timeout: float, abort: Callable[[], str | None]):
        super().__init__()
        self._client = client
        self._timeout = timeout
        self._abort = abort
        self._cache: dict[str, bytes] | None = None  # set while a group forms
        self._since: dict[str, int] = {}  # key prefix -> the newest write its snapshots covered
        self.round_trips = 0

    @contextlib.contextmanager
    def forming(self) -> Iterator[None]:
        """Serve reads from snapshots while a gloo group forms (its keys are written once)."""
        self._cache, self._since = {}, {}
        try:
            yield
        finally:
            self._cache = None

    def _read(self, op: str, names: list[str], timeout: float | None = None, **body: object) -> dict:
        """A get/wait that, while forming, also brings back the keys written since under the prefix."""
        if self._cache is None:
            return self._call(op, timeout, **body)
        prefix = names[0].rpartition("/")[0] + "/"
        reply = self._call(op, timeout, dir=prefix, since=self._since.get(prefix, 0), **body)
        snapshot = reply.get("snapshot") or {}
        for key, value in snapshot.items():
            self._cache[key] = _unb64(value)
        self._since[prefix] = max(self._since.get(prefix, 0), int(reply.get("seq", 0)))
        return reply

    def _call(self, op: str, timeout: float | None = None, **body: object) -> dict:
        wait = self._timeout if timeout is None else timeout
        self.round_trips += 1
        msg = self._client.request("store", dict(body, op=op, timeout=wait), timeout=wait + 1.0,
                                   what=f"store {op} {body.get('key') or body.get('keys')}", abort=self._abort)
        if msg.type == "store_error":
            raise RuntimeError(f"store {op}: {msg.body.get('error')}")
        return msg.body

    def _forget(self, key: str) -> None:
        if self._cache is not None:
            self._cache.pop(key, None)

    # The torch.distributed.Store interface ------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._forget(key)
        self._call("set", key=key, value=_b64(value))

    def get(self, key: str) -> bytes:
        if self._cache is not None and key in self._cache:
            return self._cache[key]
        return _unb64(self._read("get", [key], key=key)["value"])

    def add(self, key: str, amount: int) -> int:
        self._forget(key)
        return int(self._call("add", key=key, amount=int(amount))["value"])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        self._forget(key)
        return _unb64(self._call("compare_set", key=key, expected=_b64(expected), desired=_b64(desired))["value"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if self._cache is not None and all(k in self._cache for k in keys):
            return
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        if keys:
            self._read("wait", list(keys), seconds, keys=list(keys))
        else:
            self._call("wait", keys=[], timeout=seconds)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys=list(keys))["value"])

    def delete_key(self, key: str) -> bool:
        self._forget(key)
        return bool(self._call("delete", key=key)["value"])

    def delete_keys(self, keys: list[str]) -> int:
        """Delete ``keys`` in one round trip (not part of torch's Store); how many there were."""
        for key in keys:
            self._forget(key)
        return int(self._call("delete", keys=list(keys))["value"])

    def num_keys(self) -> int:
        return int(self._call("num_keys")["value"])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)
