"""``elasticrun.run(fn)`` inside the driver: the function goes out, the results come back.

One :class:`FunctionService` per job serves two request types on the driver's authenticated
channel: ``function`` (a worker fetches the pickled function, part by part, each under the
frame limit) and ``result`` (a worker's pickled return value or exception, part by part). The
driver only routes those requests here; it never unpickles anything. What came back is read
with :meth:`result` and :meth:`errors` once the job is over (``elasticrun/api.py`` does that, in
the caller's process).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol

from elasticrun.common.protocol import MAX_FRAME_BYTES
from elasticrun.driver.registry import WorkerRecord

#: Raw bytes per part: their base64 (4/3) plus the JSON envelope stays under MAX_FRAME_BYTES.
PART_BYTES = MAX_FRAME_BYTES // 2
#: Most parts a result may have (32 GiB): a bound on what one worker can make the driver keep.
MAX_PARTS = 1 << 16


class Service(Protocol):
    """Handles some request types for the driver (``types``); returns the reply's type and body.
    Raising ValueError means a malformed request: the driver counts it and replies with an error."""

    types: tuple[str, ...]

    def handle(self, type_: str, body: Mapping[str, Any], worker: WorkerRecord | None) -> tuple[str, dict[str, Any]]:
        ...


@dataclass
class Result:
    """What one worker sent back: its return value (``kind == "value"``) or exception."""

    worker: str
    kind: str  # "value" | "error"
    round: int
    rank: int
    host: str
    slot: int
    error: str = ""  # "Type: message", for errors
    traceback: str = ""
    parts: list[bytes | None] = field(default_factory=list)

    @property
    def blob(self) -> bytes | None:
        """The pickled value or exception, or None while parts are missing."""
        return None if any(p is None for p in self.parts) else b"".join(p for p in self.parts if p is not None)


class FunctionService:
    """The function of an ``elasticrun.run`` job, and what its workers sent back."""

    types: tuple[str, ...] = ("function", "result")

    def __init__(self, payload: bytes, sys_path: list[str]):
        self._payload = payload
        self._sys_path = list(sys_path)
        self._results: dict[str, Result] = {}

    def handle(self, type_: str, body: Mapping[str, Any], worker: WorkerRecord | None) -> tuple[str, dict[str, Any]]:
        if type_ == "function":
            return "function", self._part(int(body.get("part", 0)))
        if worker is None:
            raise ValueError(f"unknown worker {body.get('worker')!r}")
        self._store(worker, body)
        return "ack", {}

    def result(self, worker_id: str) -> Result | None:
        return self._results.get(worker_id)

    def errors(self) -> list[Result]:
        """Every exception a worker sent, in the order they arrived."""
        return [r for r in self._results.values() if r.kind == "error"]

    def _part(self, part: int) -> dict[str, Any]:
        blob, n = self._payload, PART_BYTES
        parts = max(1, -(-len(blob) // n))
        if not 0 <= part < parts:
            return {"error": f"there is no part {part} of {parts}"}
        return {"part": part, "parts": parts, "data": base64.b64encode(blob[part * n:(part + 1) * n]).decode(),
                "sys_path": self._sys_path if part == 0 else []}

    def _store(self, w: WorkerRecord, body: Mapping[str, Any]) -> None:
        kind, part, parts = str(body["kind"]), int(body["part"]), int(body["parts"])
        if kind not in ("value", "error") or not 0 <= part < parts <= MAX_PARTS:
            raise ValueError(f"bad result part {part}/{parts} of kind {kind!r}")
        r = self._results.get(w.id)
        if r is None or r.kind != kind or len(r.parts) != parts:
            r = self._results[w.id] = Result(
                w.id, kind, int(body.get("round", w.round)), int(body.get("rank", w.rank)), w.host, w.slot,
                str(body.get("error", ""))[:2000], str(body.get("traceback", ""))[-20000:], [None] * parts)
        r.parts[part] = base64.b64decode(body["data"])
