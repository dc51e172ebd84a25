"""What the driver's request types carry, read from an authenticated message's body (pure).

A body is JSON from a worker holding the job's key: well-formed, but its fields are whatever
that process sent. Each request type is a small class whose ``parse`` takes any body and
returns its fields typed and bounded (strings cut, lists capped, wrong types dropped), never
raising: the loop's handlers (``ElasticDriver``'s dispatch table) get values, not dicts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

from elasticrun.driver.stragglers import Pace

__all__ = ["Heartbeat", "Rendezvous", "Report"]


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _worker(body: Mapping[str, Any]) -> str:
    return str(body.get("worker"))[:200]


def _seconds(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    return None


@dataclass(frozen=True)
class Heartbeat:
    """A sign of life: steps and commits so far, the pace of recent steps, and on the last one
    of a process, ``bye`` ("exit" or "shutdown"). ``waiting``: how long it has waited in the
    collective it is in (None: in none); ``stalled``: that wait is past its stall warning; ``op``:
    which collective, and ``until``: the flag that ends the wait (its collective timeout or
    stall shutdown, as the worker keeps it), once stalled."""

    worker: str
    steps: int | None = None
    commit: int | None = None
    pace: Pace | None = None
    bye: str | None = None
    waiting: float | None = None
    stalled: bool = False
    op: str | None = None  # the collective it waits in, once stalled (its name, cut to 80 characters)
    until: str | None = None  # what ends that wait, once stalled ("--collective-timeout 1800"; 60 characters)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> "Heartbeat":
        bye, op, until = body.get("bye"), body.get("in"), body.get("until")
        waiting = _seconds(body.get("waiting"))
        stalled = waiting is not None and body.get("stalled") is True
        return cls(_worker(body), _int(body.get("steps")), _int(body.get("commit")), Pace.parse(body.get("pace")),
                   bye[:20] if isinstance(bye, str) else None, waiting, stalled,
                   op[:80] if stalled and isinstance(op, str) and op else None,
                   until[:60] if stalled and isinstance(until, str) and until else None)


@dataclass(frozen=True)
class Rendezvous:
    """A worker asks for its place in the next round (see ``Registry.rendezvous``)."""

    worker: str
    error: str | None = None
    restored: bool = False
    has_state: bool = False
    gpus: tuple[str, ...] = ()

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> "Rendezvous":
        error, gpus = body.get("error"), body.get("gpus")
        return cls(_worker(body), str(error)[:300] if error else None, body.get("restored") is True,
                   body.get("has_state") is True,
                   tuple(str(g)[:100] for g in gpus[:1024]) if isinstance(gpus, list) else ())


@dataclass(frozen=True)
class Report:
    """A worker's one line: why it is leaving (``leaving``: it got SIGTERM), how its script
    failed (``failing``), why the durable copy does not fit its state (``restore_failed``)."""

    worker: str
    text: str

    @classmethod
    def parse(cls, body: Mapping[str, Any], key: str, default: str, limit: int) -> "Report":
        return cls(_worker(body), str(body.get(key, default))[:limit])
