"""Reading an event log and analysing it: rounds, resets split into phases, markers, a summary.

Pure data in, data out (no drawing): ``elasticrun/timeline/render.py`` draws what this finds,
and the phase boundaries are documented in ``elasticrun/timeline/__init__.py``.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable

from elasticrun.common.events import Kind

PHASES = ("detect", "decide", "rendezvous", "group", "restore+sync", "first step")
# Markers on the world-size chart: event kind -> (label, colour, shape).
MARKERS: dict[str, tuple[str, str, str]] = {  # Kind -> (label, colour, shape); Kind is a str
    Kind.HOST_ADDED: ("host added", "#2ca02c", "up"),
    Kind.HOST_REMOVED: ("host removed", "#7f7f7f", "down"),
    Kind.HOST_LEAVING: ("host left (SIGTERM)", "#ff7f0e", "down"),
    Kind.HOST_DRAINING: ("host draining", "#bcbd22", "down"),
    Kind.HOST_BLACKLISTED: ("host blacklisted", "#000000", "cross"),
    Kind.HOST_WHITELISTED: ("host back from blacklist", "#9467bd", "diamond"),
    Kind.WORKER_FAILED: ("worker failed", "#d62728", "circle"),
    Kind.STRAGGLER: ("straggler", "#e377c2", "square"),
}


class TimelineError(Exception):
    """A problem the user can fix (bad file, unknown format, missing matplotlib)."""


# --- reading --------------------------------------------------------------------------------
def load_events(path: str) -> list[dict[str, Any]]:
    """The events of a log, by time; lines that are not JSON objects (a job killed mid-write) are skipped."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:  # (not text: no events, said below)
            lines = f.readlines()
    except OSError as exc:
        raise TimelineError(f"cannot read the event log {path}: {exc.strerror or exc}") from None
    events = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and isinstance(e.get("kind"), str) and isinstance(e.get("t"), (int, float)):
            events.append(e)
    if not events:
        raise TimelineError(f"{path} holds no events (write one with `elasticrun --events {path} ...`)")
    return sorted(events, key=lambda e: e["t"])


# --- analysis -------------------------------------------------------------------------------
@dataclass
class Round:
    round: int
    size: int
    hosts: list[str]
    start: float
    end: float


@dataclass
class Reset:
    index: int
    cause: str
    trigger: str  # "failure" | "hosts"
    round: int  # the round it led to
    from_size: int
    to_size: int
    start: float
    end: float
    seconds: float
    phases: list[tuple[str, float, float]]  # (name, start, end), end to end from start to end

    def phase_seconds(self) -> dict[str, float]:
        return {name: b - a for name, a, b in self.phases}


@dataclass
class Marker:
    t: float
    kind: str
    host: str
    label: str


@dataclass
class Analysis:
    t0: float
    t_end: float
    rounds: list[Round]
    resets: list[Reset]
    markers: list[Marker]
    steps: list[tuple[float, int]]  # world size from each time on
    ok: bool | None = None
    end_reason: str = ""
    events: list[dict[str, Any]] = field(default_factory=list, repr=False)

    @property
    def duration(self) -> float:
        return self.t_end - self.t0


def _in_round(events: Iterable[dict], kind: str, round_: int) -> list[float]:
    return [e["t"] for e in events if e["kind"] == kind and e.get("round") == round_ and e["source"] == "worker"]


def analyze(events: list[dict[str, Any]]) -> Analysis:
    """Rounds, resets (with phases), markers and the world size over time, from sorted events."""
    if not events:
        raise TimelineError("no events")
    events = sorted(events, key=lambda e: e["t"])
    for e in events:
        e.setdefault("source", "driver")
    t0 = events[0]["t"]
    job_end = next((e for e in events if e["kind"] == Kind.JOB_END), None)
    t_end = job_end["t"] if job_end else events[-1]["t"]
    t_end = max(t_end, events[-1]["t"]) if job_end is None else t_end

    formed = [e for e in events if e["kind"] == Kind.ROUND_FORMED]
    rounds = []
    for i, e in enumerate(formed):
        end = formed[i + 1]["t"] if i + 1 < len(formed) else t_end
        rounds.append(Round(int(e.get("round", i)), int(e.get("size", 0)), list(e.get("hosts") or []), e["t"],
                            max(end, e["t"])))
    steps = [(t0, 0)] + [(r.start, r.size) for r in rounds]

    resets: list[Reset] = []
    for e in (e for e in events if e["kind"] == Kind.RESET):
        r = int(e.get("round", -1))
        seconds = float(e.get("seconds", 0.0))
        first = _in_round(events, Kind.FIRST_STEP, r)
        end = min(first) if first else e["t"]
        start = end - seconds
        noticed = [x["t"] for x in events if x["kind"] in (Kind.FAILURE_DETECTED, Kind.INTERRUPT) and x["source"] == "worker"
                   and x.get("round", -1) < r and start - 1.0 <= x["t"] <= end]
        round_formed = [x["t"] for x in formed if x.get("round") == r]
        marks = [
            min(noticed, default=start),
            min(round_formed, default=start),
            max(_in_round(events, Kind.RENDEZVOUS_COMPLETE, r), default=start),
            max(_in_round(events, Kind.GROUP_FORMED, r), default=start),
            max(_in_round(events, Kind.SYNC_DONE, r), default=start),
            end,
        ]
        phases, b = [], start
        for name, m in zip(PHASES, marks):
            nb = min(max(b, m), end)
            phases.append((name, b, nb))
            b = nb
        resets.append(Reset(len(resets) + 1, str(e.get("cause", "?")), str(e.get("trigger", "?")), r,
                            int(e.get("from_size", 0)), int(e.get("to_size", 0)), start, end, seconds, phases))

    markers = []
    for e in events:
        if e["kind"] in MARKERS and e["source"] == "driver":
            host = str(e.get("host", ""))
            label = f"{MARKERS[e['kind']][0]}: {host}" if host else MARKERS[e["kind"]][0]
            detail = e.get("message") or e.get("reason") or e.get("error")
            if detail and str(detail) != label:
                label += f" ({detail})"
            markers.append(Marker(e["t"], e["kind"], host, label))
    return Analysis(t0, t_end, rounds, resets, markers, steps, ok=job_end.get("ok") if job_end else None,
                    end_reason=str(job_end.get("reason", "")) if job_end else "", events=events)


def size_of(a: Analysis, round_: Any) -> int | None:
    return next((r.size for r in a.rounds if r.round == round_), None)



# --- text summary ---------------------------------------------------------------------------
def format_ms(s: float) -> str:
    return f"{s * 1000:.0f} ms" if s < 10 else f"{s:.1f} s"


def summary(a: Analysis) -> str:
    recovering = sum(r.seconds for r in a.resets)
    share = f" ({100 * recovering / a.duration:.1f}% of the job)" if a.duration > 0 else ""
    status = "" if a.ok is None else (" succeeded" if a.ok else " failed")
    # Every round after the first is a reset, as the console counts them; the listed resets are
    # those whose round trained (a signal or a failure may end the job before it does).
    untimed = max(0, len(a.rounds) - 1 - len(a.resets))
    note = f" ({untimed} ended before training resumed)" if untimed else ""
    lines = [f"job{status} in {a.duration:.1f} s: {len(a.rounds)} round(s), {len(a.resets) + untimed} reset(s)"
             f"{note}, {recovering:.2f} s recovering{share}"]
    if a.end_reason:
        lines.append(f"  end: {a.end_reason}")
    if a.rounds:
        lines.append("rounds:")
        for r in a.rounds:
            lines.append(f"  round {r.round:<3} {r.size:>3} worker(s)  {r.start - a.t0:7.1f} s -> "
                         f"{r.end - a.t0:7.1f} s  on {', '.join(r.hosts)}")
    said = stragglers(a)
    if said:
        lines.append("stragglers:")
        for e in said:
            figures = (f": {e['compute_ms']:.0f} ms of compute per step against {e['reference_ms']:.0f} ms over the "
                       f"last {e.get('steps', '?')} steps" if "compute_ms" in e and "reference_ms" in e else "")
            lines.append(f"  at {e['t'] - a.t0:.1f} s: host {e.get('host', '?')} {e.get('action', 'named')}{figures}")
    if a.resets:
        lines.append("resets (phases in ms: " + " / ".join(PHASES) + "):")
        for rs in a.resets:
            ph = " / ".join(f"{v * 1000:.0f}" for v in rs.phase_seconds().values())
            lines.append(f"  reset {rs.index} at {rs.start - a.t0:.1f} s ({rs.cause}): {rs.from_size} -> "
                         f"{rs.to_size} worker(s), {format_ms(rs.seconds)}  [{ph}]")
        lines.append("resets by cause:")
        for cause, items in by_cause(a.resets).items():
            secs = [r.seconds for r in items]
            lines.append(f"  {cause}: {len(items)} reset(s), {format_ms(sum(secs))} in all, median "
                         f"{format_ms(statistics.median(secs))}, max {format_ms(max(secs))}")
    return "\n".join(lines)


def stragglers(a: Analysis) -> list[dict[str, Any]]:
    """The driver's straggler events (named, evicted, kept, recovered), in time order."""
    return [e for e in a.events if e["kind"] == Kind.STRAGGLER and e["source"] == "driver"]


def by_cause(resets: list[Reset]) -> dict[str, list[Reset]]:
    groups: dict[str, list[Reset]] = {}
    for r in resets:
        groups.setdefault(r.cause, []).append(r)
    return groups
