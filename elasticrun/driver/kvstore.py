"""The key/value store behind torch.distributed rendezvous, as a pure data structure.

Blocking reads (``get``/``wait`` on missing keys) become *waiters* that are answered when a
later ``set``/``add`` supplies the keys, or expire at their deadline: the driver's single
event loop never blocks on one worker.

Why snapshots: gloo's full-mesh rendezvous has every rank ``wait`` for and ``get`` every rank's
address, 2N round trips per rank and 2N² through the driver per reset (2 million at 1,024
ranks). A ``get``/``wait`` may name a key prefix (``dir``) and the newest write it has seen
(``since``): its reply then also carries every key under that prefix written since, up to
:data:`SNAPSHOT_BYTES`, and the worker serves the rest of the rendezvous from those (see
``worker/store.py``). A rank then needs a few round trips, growing slowly with N (13 per rank
at 32 ranks forming at once, against 65).
"""

from __future__ import annotations

import base64
import bisect
from dataclasses import dataclass, field
from typing import Any, Hashable

#: Most base64 value bytes one snapshot carries: the reply stays well under the frame limit.
SNAPSHOT_BYTES = 512 * 1024


@dataclass
class _Waiter:
    token: Hashable
    op: str
    keys: tuple[str, ...]
    deadline: float
    snapshot: tuple[str, int] | None = None  # (key prefix, newest write seen) to reply with


@dataclass
class KVStore:
    data: dict[str, bytes] = field(default_factory=dict)
    _waiters: list[_Waiter] = field(default_factory=list)
    _seq: int = 0  # the number of the newest write
    _written: dict[str, int] = field(default_factory=dict)  # key -> the number of its last write
    _order: list[tuple[int, str]] = field(default_factory=list)  # (number, key) of writes, ascending

    def _put(self, key: str, value: bytes) -> None:
        self.data[key] = value
        self._seq += 1
        self._written[key] = self._seq
        self._order.append((self._seq, key))
        if len(self._order) > 4 * len(self._written) + 1024:  # counters rewritten without end
            self._order = sorted((n, k) for k, n in self._written.items())

    def handle(self, token: Hashable, body: dict[str, Any], now: float) -> list[tuple[Hashable, str, dict]]:
        """Apply one store request; return replies ``(token, type, body)`` ready to send now."""
        op = body.get("op")
        try:
            if op == "set":
                self._put(body["key"], base64.b64decode(body["value"]))
                return [(token, "store_result", {})] + self._wake()
            if op == "add":
                value = int(self.data.get(body["key"], b"0")) + int(body["amount"])
                self._put(body["key"], str(value).encode())
                return [(token, "store_result", {"value": value})] + self._wake()
            if op == "compare_set":
                key, expected, desired = body["key"], base64.b64decode(body["expected"]), base64.b64decode(body["desired"])
                current = self.data.get(key)
                if (current is None and expected == b"") or current == expected:
                    self._put(key, desired)
                    return [(token, "store_result", {"value": body["desired"]})] + self._wake()
                shown = current if current is not None else expected
                return [(token, "store_result", {"value": base64.b64encode(shown).decode()})]
            if op in ("get", "wait"):
                keys = (body["key"],) if op == "get" else tuple(body["keys"])
                timeout = float(body.get("timeout") or 300.0)
                snapshot = (str(body["dir"]), int(body.get("since", 0))) if body.get("dir") else None
                waiter = _Waiter(token, op, keys, now + timeout, snapshot)
                if all(k in self.data for k in keys):
                    return [self._answer(waiter)]
                self._waiters.append(waiter)
                return []
            if op == "check":
                return [(token, "store_result", {"value": all(k in self.data for k in body["keys"])})]
            if op == "delete" and "keys" in body:  # (several at once: a join's keys as it ends)
                gone = [k for k in body["keys"] if isinstance(k, str)]
                for key in gone:
                    self._written.pop(key, None)
                return [(token, "store_result", {"value": sum(self.data.pop(k, None) is not None for k in gone)})]
            if op == "delete":
                self._written.pop(body["key"], None)
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

    def keep_only(self, prefix: str) -> list[tuple[Hashable, str, dict]]:
        """Forget every key outside ``prefix`` (a round that is over); the waiters for such keys
        are answered with an error now (their keys can no longer come: waiting on for their
        deadline would only delay whoever asks again under the new round)."""
        self.data = {k: v for k, v in self.data.items() if k.startswith(prefix)}
        self._written = {k: n for k, n in self._written.items() if k in self.data}
        self._order = sorted((n, k) for k, n in self._written.items())
        gone = [w for w in self._waiters if not all(k.startswith(prefix) for k in w.keys)]
        self._waiters = [w for w in self._waiters if all(k.startswith(prefix) for k in w.keys)]
        return [(w.token, "store_error", {"error": "forgotten: the round of keys " + ", ".join(w.keys) + " is over"})
                for w in gone]

    def next_deadline(self) -> float | None:
        return min((w.deadline for w in self._waiters), default=None)

    def _answer(self, w: _Waiter) -> tuple[Hashable, str, dict]:
        body: dict[str, Any] = {}
        if w.op == "get":
            body["value"] = base64.b64encode(self.data[w.keys[0]]).decode()
        if w.snapshot is not None:
            body["snapshot"], body["seq"] = self._snapshot(*w.snapshot)
        return (w.token, "store_result", body)

    def _snapshot(self, prefix: str, since: int) -> tuple[dict[str, str], int]:
        """The keys under ``prefix`` written after write number ``since`` (their latest values),
        oldest first, up to SNAPSHOT_BYTES; and the number of the newest write it covers."""
        out: dict[str, str] = {}
        used, seq = 0, since
        for n, key in self._order[bisect.bisect_right(self._order, (since, "\U0010ffff")):]:
            if self._written.get(key) != n or not key.startswith(prefix):
                seq = n  # overwritten later, deleted, or another prefix: nothing to send
                continue
            value = base64.b64encode(self.data[key]).decode()
            if out and used + len(value) > SNAPSHOT_BYTES:
                break
            out[key] = value
            used += len(value)
            seq = n
        return out, seq

    def _wake(self) -> list[tuple[Hashable, str, dict]]:
        ready = [w for w in self._waiters if all(k in self.data for k in w.keys)]
        if ready:
            self._waiters = [w for w in self._waiters if w not in ready]
        return [self._answer(w) for w in ready]
