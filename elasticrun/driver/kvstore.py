"""The key/value store behind torch.distributed rendezvous, as a pure data structure.

Blocking reads (``get``/``wait`` on missing keys) become *waiters* that are answered when a
later ``set``/``add`` supplies the keys, or expire at their deadline: the driver's single
event loop never blocks on one worker.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Hashable


@dataclass
class _Waiter:
    token: Hashable
    op: str
    keys: tuple[str, ...]
    deadline: float


@dataclass
class KVStore:
    data: dict[str, bytes] = field(default_factory=dict)
    _waiters: list[_Waiter] = field(default_factory=list)

    def handle(self, token: Hashable, body: dict[str, Any], now: float) -> list[tuple[Hashable, str, dict]]:
        """Apply one store request; return replies ``(token, type, body)`` ready to send now."""
        op = body.get("op")
        try:
            if op == "set":
                self.data[body["key"]] = base64.b64decode(body["value"])
                return [(token, "store_result", {})] + self._wake()
            if op == "add":
                value = int(self.data.get(body["key"], b"0")) + int(body["amount"])
                self.data[body["key"]] = str(value).encode()
                return [(token, "store_result", {"value": value})] + self._wake()
            if op == "compare_set":
                key, expected, desired = body["key"], base64.b64decode(body["expected"]), base64.b64decode(body["desired"])
                current = self.data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self.data[key] = desired
                    return [(token, "store_result", {"value": body["desired"]})] + self._wake()
                shown = current if current is not None else expected
                return [(token, "store_result", {"value": base64.b64encode(shown).decode()})]
            if op in ("get", "wait"):
                keys = (body["key"],) if op == "get" else tuple(body["keys"])
                timeout = float(body.get("timeout") or 300.0)
                waiter = _Waiter(token, op, keys, now + timeout)
                if all(k in self.data for k in keys):
                    return [self._answer(waiter)]
                self._waiters.append(waiter)
                return []
            if op == "check":
                return [(token, "store_result", {"value": all(k in self.data for k in body["keys"])})]
            if op == "delete":
                return [(token, "store_result", {"value": self.data.pop(body["key"], None) is not None})]
            if op == "num_keys":
                return [(token, "store_result", {"value": len(self.data)})]
        except (KeyError, TypeError, ValueError) as exc:
            return [(token, "store_error", {"error": f"malformed {op} request: {exc}"})]
        return [(token, "store_error", {"error": f"unknown store operation {op!r}"})]

    def expire(self, now: float) -> list[tuple[Hashable, str, dict]]:
        """Answer waiters whose deadline passed with an error naming the missing keys."""
        expired = [w for w in self._waiters if w.deadline <= now]
        self._waiters = [w for w in self._waiters if w.deadline > now]
        return [(w.token, "store_error", {"error": "timed out waiting for keys "
                                           + ", ".join(k for k in w.keys if k not in self.data)}) for w in expired]

    def keep_only(self, prefix: str) -> None:
        """Forget every key, and every waiter, outside ``prefix`` (a round that is over)."""
        self.data = {k: v for k, v in self.data.items() if k.startswith(prefix)}
        self._waiters = [w for w in self._waiters if all(k.startswith(prefix) for k in w.keys)]

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self._waiters), default=None)

    def _answer(self, w: _Waiter) -> tuple[Hashable, str, dict]:
        if w.op == "get":
            return (w.token, "store_result", {"value": base64.b64encode(self.data[w.keys[0]]).decode()})
        return (w.token, "store_result", {})

    def _wake(self) -> list[tuple[Hashable, str, dict]]:
        ready = [w for w in self._waiters if all(k in self.data for k in w.keys)]
        if ready:
            self._waiters = [w for w in self._waiters if w not in ready]
        return [self._answer(w) for w in ready]
