"""A ``torch.distributed.Store`` served by the driver over the authenticated control channel.

Why not a TCPStore: the store must outlive any worker (losing rank 0 must not take the
rendezvous down), it should not open a second, unauthenticated port, and the driver must not
import torch. gloo only needs set/get/wait during group formation (about ten small round trips
for two ranks), so routing them through the driver costs well under a millisecond each.
"""

from __future__ import annotations

import base64
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from elasticrun.worker.client import DriverClient


def _b64(value: bytes | str) -> str:
    return base64.b64encode(value.encode() if isinstance(value, str) else bytes(value)).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


class DriverStore(dist.Store):
    """Key/value store whose keys live in the driver. Blocking reads honour the timeout and abort."""

    def __init__(self, client: DriverClient, timeout: float, abort: Callable[[], str | None]):
        super().__init__()
        self._client = client
        self._timeout = timeout
        self._abort = abort

    def _call(self, op: str, timeout: float | None = None, **body: object) -> dict:
        wait = self._timeout if timeout is None else timeout
        msg = self._client.request("store", dict(body, op=op, timeout=wait), timeout=wait + 1.0,
                                   what=f"store {op} {body.get('key') or body.get('keys')}", abort=self._abort)
        if msg.type == "store_error":
            raise RuntimeError(f"store {op}: {msg.body.get('error')}")
        return msg.body

    # The torch.distributed.Store interface ------------------------------------------------
    def set(self, key: str, value: bytes | str) -> None:
        self._call("set", key=key, value=_b64(value))

    def get(self, key: str) -> bytes:
        return _unb64(self._call("get", key=key)["value"])

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", key=key, amount=int(amount))["value"])

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return _unb64(self._call("compare_set", key=key, expected=_b64(expected), desired=_b64(desired))["value"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else None
        self._call("wait", keys=list(keys), timeout=seconds)

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", keys=list(keys))["value"])

    def delete_key(self, key: str) -> bool:
        return bool(self._call("delete", key=key)["value"])

    def num_keys(self) -> int:
        return int(self._call("num_keys")["value"])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[bytes | str]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)
