"""Drawing an analysed event log: a Chrome trace, an SVG, an HTML page, a PNG (matplotlib)."""

from __future__ import annotations

import html
import json
import math
import os
import statistics
from typing import Any
from xml.sax.saxutils import escape, quoteattr

from elasticrun.common.events import Kind
from elasticrun.common.paths import open_user_file
from elasticrun.timeline.analysis import (
    MARKERS, PHASES, Marker, TimelineError, analyze, by_cause, size_of, stragglers, summary,
)

PHASE_COLORS = {
    "detect": "#d62728",
    "decide": "#ff7f0e",
    "rendezvous": "#bcbd22",
    "group": "#2ca02c",
    "restore+sync": "#17becf",
    "first step": "#1f77b4",
}
FORMATS = (".json", ".svg", ".html", ".png")


# --- Chrome trace ---------------------------------------------------------------------------
DRIVER_PID = 1
DRIVER_TRACKS = {"rounds": 1, "resets": 2, "reset phases": 3, "hosts and failures": 4}


def to_chrome_trace(events: list[dict[str, Any]]) -> dict[str, Any]:
    """A Chrome-trace (Perfetto-loadable) dict: ``json.dump`` it."""
    a = analyze(events)
    events = a.events

    def us(t: float) -> float:
        return round((t - a.t0) * 1e6, 1)

    out: list[dict[str, Any]] = []

    def meta(name: str, pid: int, tid: int | None, value: Any) -> None:
        key = "name" if name.endswith("_name") else "sort_index"
        e: dict[str, Any] = {"ph": "M", "name": name, "pid": pid, "args": {key: value}}
        if tid is not None:
            e["tid"] = tid
        out.append(e)

    def span(name: str, pid: int, tid: int, start: float, end: float, cat: str, **args: Any) -> None:
        out.append({"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": us(start),
                    "dur": round(max(0.0, end - start) * 1e6, 1), "args": args})

    def instant(name: str, pid: int, tid: int, t: float, cat: str, **args: Any) -> None:
        out.append({"ph": "i", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": us(t), "s": "t",
                    "args": args})

    meta("process_name", DRIVER_PID, None, "elasticrun driver")
    meta("process_sort_index", DRIVER_PID, None, 0)
    for track_name, tid in DRIVER_TRACKS.items():
        meta("thread_name", DRIVER_PID, tid, track_name)
        meta("thread_sort_index", DRIVER_PID, tid, tid)
    for r in a.rounds:
        span(f"round {r.round} ({r.size} workers)", DRIVER_PID, DRIVER_TRACKS["rounds"], r.start, r.end, "round",
             round=r.round, size=r.size, hosts=r.hosts)
    for rs in a.resets:
        span(f"reset {rs.index}: {rs.cause}", DRIVER_PID, DRIVER_TRACKS["resets"], rs.start, rs.end, "reset",
             cause=rs.cause, trigger=rs.trigger, round=rs.round, from_size=rs.from_size, to_size=rs.to_size,
             ms=round(rs.seconds * 1000, 2))
        for name, p0, p1 in rs.phases:
            span(name, DRIVER_PID, DRIVER_TRACKS["reset phases"], p0, p1, "reset phase", reset=rs.index,
                 ms=round((p1 - p0) * 1000, 2))
    hf = DRIVER_TRACKS["hosts and failures"]
    for e in events:
        if e["source"] != "driver":
            continue
        k = e["kind"]
        if k in MARKERS:
            fields: dict[str, Any] = {x: e[x] for x in ("host", "slot", "rank", "message", "reason", "error", "round")
                                      if x in e}
            instant(f"{MARKERS[k][0]}: {e.get('host', '')}".rstrip(": "), DRIVER_PID, hf, e["t"],
                    "failure" if k == Kind.WORKER_FAILED else "hosts", **fields)
        elif k in (Kind.ROUND_ABORTED, Kind.NOTIFICATION_SENT, Kind.JOB_END):
            fields = {x: e[x] for x in ("round", "reason", "added", "removed", "ok") if x in e}
            instant(k.replace("_", " "), DRIVER_PID, hf, e["t"], "failure" if k == Kind.ROUND_ABORTED else "driver",
                    **fields)

    # One process per host (in order of appearance), one track per worker slot.
    pids: dict[str, int] = {}
    tids: dict[tuple[str, int], int] = {}

    def track(host: str, slot: int) -> tuple[int, int]:
        if host not in pids:
            pids[host] = DRIVER_PID + 1 + len(pids)
            meta("process_name", pids[host], None, f"host {host}")
            meta("process_sort_index", pids[host], None, pids[host])
        key = (host, slot)
        if key not in tids:
            tids[key] = slot + 1
            meta("thread_name", pids[host], tids[key], f"{host}[{slot}]")
        return pids[host], tids[key]

    by_worker: dict[tuple[str, int], list[dict]] = {}
    for e in events:
        if "host" in e and ("slot" in e or e["source"] == "worker") and e["kind"] not in MARKERS:
            key = (str(e["host"]), int(e.get("slot", 0)))
            if e["source"] == "worker" or e["kind"] in (Kind.WORKER_STARTED, Kind.WORKER_EXITED):
                by_worker.setdefault(key, []).append(e)
    for (host, slot), mine in by_worker.items():
        pid, tid = track(host, slot)
        train_from: tuple[float, dict] | None = None
        for e in mine:
            k, t = e["kind"], e["t"]
            where: dict[str, Any] = {x: e[x] for x in ("round", "rank") if x in e}
            if k == Kind.WORKER_STARTED:
                instant("worker started", pid, tid, t, "worker", worker=e.get("worker"), rank=e.get("rank"))
            elif k == Kind.WORKER_EXITED:
                if train_from is not None:
                    span("training", pid, tid, train_from[0], t, "training", **train_from[1])
                    train_from = None
                instant(f"worker exited ({e.get('code')})", pid, tid, t, "worker", worker=e.get("worker"),
                        code=e.get("code"))
            elif k == Kind.RENDEZVOUS_COMPLETE:
                span("rendezvous", pid, tid, t - float(e.get("waited_ms", 0)) / 1000, t, "reset", size=e.get("size"),
                     **where)
            elif k in (Kind.GROUP_FORMED, Kind.SYNC_DONE, Kind.RESTORE):
                name = {Kind.GROUP_FORMED: "group formation", Kind.SYNC_DONE: "sync", Kind.RESTORE: "restore"}[k]
                extra = {"skipped_bytes": e["skipped"]} if e.get("skipped") else {}
                if e.get("sent_to") is not None:
                    extra["model_sent_to_ranks"] = e["sent_to"]
                span(name, pid, tid, t - float(e.get("ms", 0)) / 1000, t, "reset", **where, **extra)
                if k != Kind.RESTORE:
                    train_from = (t, dict(where, size=size_of(a, e.get("round"))))
            elif k in (Kind.INTERRUPT, Kind.FAILURE_DETECTED):
                if train_from is not None:
                    span("training", pid, tid, train_from[0], t, "training", **train_from[1])
                    train_from = None
                args = dict(where, error=e.get("error")) if k == Kind.FAILURE_DETECTED else dict(where)
                instant(k.replace("_", " "), pid, tid, t, "failure" if k == Kind.FAILURE_DETECTED else "reset", **args)
            elif k == Kind.STATE_FETCHED:  # a newcomer, before it took a place: off the survivors' clock
                span("fetch of the committed model", pid, tid, t - float(e.get("ms", 0)) / 1000, t, "worker",
                     bytes=e.get("bytes"))
            elif k in (Kind.FIRST_STEP, Kind.NOTIFICATION_RECEIVED):
                instant(k.replace("_", " "), pid, tid, t, "reset", **where)
        if train_from is not None:
            span("training", pid, tid, train_from[0], a.t_end, "training", **train_from[1])
    # Stragglers: an instant on their host's own track (tid 0), with the figures that named them.
    for e in stragglers(a):
        host = str(e.get("host", ""))
        pid = track(host, 0)[0]
        if (host, -1) not in tids:
            tids[(host, -1)] = 0
            meta("thread_name", pid, 0, f"{host}: stragglers")
        instant(f"straggler {e.get('action', 'named')}", pid, 0, e["t"], "straggler",
                **{x: e[x] for x in ("round", "message", "compute_ms", "reference_ms", "step_ms", "steps") if x in e})
    _unoverlap(out)
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"generator": "elasticrun timeline", "job_start_unix_s": a.t0,
                          "duration_s": round(a.duration, 6), "rounds": len(a.rounds), "resets": len(a.resets)}}


def _unoverlap(out: list[dict[str, Any]]) -> None:
    """Spans of one track never overlap (clocks of hosts differ a little; viewers dislike overlaps)."""
    tracks: dict[tuple[int, int], list[dict]] = {}
    for e in out:
        if e["ph"] == "X":
            tracks.setdefault((e["pid"], e["tid"]), []).append(e)
    for spans in tracks.values():
        spans.sort(key=lambda e: e["ts"])
        end = -math.inf
        for e in spans:
            stop = e["ts"] + e["dur"]
            if e["ts"] < end:
                e["ts"] = end
                e["dur"] = round(max(0.0, stop - end), 1)
            end = max(end, e["ts"] + e["dur"])



# --- SVG ------------------------------------------------------------------------------------
def _ticks(span: float, target: int = 8) -> list[float]:
    if span <= 0:
        return [0.0]
    raw = span / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    return [i * step for i in range(int(span / step + 1e-9) + 1)]


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def _marker_shape(shape: str, x: float, y: float, color: str, r: float = 5) -> str:
    X, Y = _num(x), _num(y)
    if shape == "up":
        return f'<path d="M{X} {_num(y - r)} L{_num(x + r)} {_num(y + r)} L{_num(x - r)} {_num(y + r)} Z" ' \
               f'fill="{color}"'
    if shape == "down":
        return f'<path d="M{X} {_num(y + r)} L{_num(x + r)} {_num(y - r)} L{_num(x - r)} {_num(y - r)} Z" ' \
               f'fill="{color}"'
    if shape == "cross":
        return (f'<path d="M{_num(x - r)} {_num(y - r)} L{_num(x + r)} {_num(y + r)} M{_num(x + r)} {_num(y - r)} '
                f'L{_num(x - r)} {_num(y + r)}" stroke="{color}" stroke-width="2.5" fill="none"')
    if shape == "square":
        return (f'<rect x="{_num(x - r + 0.5)}" y="{_num(y - r + 0.5)}" width="{_num(2 * r - 1)}" '
                f'height="{_num(2 * r - 1)}" fill="{color}"')
    if shape == "diamond":
        return (f'<path d="M{X} {_num(y - r)} L{_num(x + r)} {Y} L{X} {_num(y + r)} L{_num(x - r)} {Y} Z" '
                f'fill="{color}"')
    return f'<circle cx="{X}" cy="{Y}" r="{_num(r)}" fill="{color}"'


def to_svg(events: list[dict[str, Any]], title: str = "elasticrun job timeline") -> str:
    """The picture as an SVG document (a string): world size over time, markers, a bar per reset."""
    a = analyze(events)
    W, left, right = 860, 64, 24
    pw = W - left - right
    top, ph = 104, 190  # world-size plot
    marker_y = top - 10
    T = max(a.duration, 1e-3)
    max_size = max([s for _, s in a.steps] + [1])
    bars_top = top + ph + 56
    row = 24
    n = len(a.resets)
    bars_h = (row * n + 44) if n else 30
    H = bars_top + bars_h + 16

    def X(t: float) -> float:
        return left + (t - a.t0) / T * pw

    def Y(size: float) -> float:
        return top + ph - size / (max_size + 0.5) * ph

    p: list[str] = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" '
        f'font-family="Helvetica, Arial, sans-serif" font-size="11">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{W}" height="{H}" fill="#ffffff"/>',
        f'<text x="{left}" y="20" font-size="15" font-weight="bold">{escape(title)}</text>',
    ]
    recovering = sum(r.seconds for r in a.resets)
    status = "" if a.ok is None else ("succeeded, " if a.ok else "failed, ")
    p.append(f'<text x="{left}" y="36" fill="#555">{escape(status)}{a.duration:.1f} s, {len(a.rounds)} round(s), '
             f'{n} reset(s), {recovering * 1000:.0f} ms recovering</text>')
    # Axes and grid.
    p.append('<g class="axes" stroke="#ccc" stroke-width="1">')
    for s in range(0, max_size + 1):
        p.append(f'<line x1="{left}" y1="{_num(Y(s))}" x2="{left + pw}" y2="{_num(Y(s))}"/>')
    p.append("</g>")
    p.append('<g class="ticks" fill="#333">')
    for s in range(0, max_size + 1):
        p.append(f'<text x="{left - 6}" y="{_num(Y(s) + 4)}" text-anchor="end">{s}</text>')
    for tk in _ticks(T):
        x = X(a.t0 + tk)
        p.append(f'<line x1="{_num(x)}" y1="{top + ph}" x2="{_num(x)}" y2="{top + ph + 4}" stroke="#333"/>')
        p.append(f'<text x="{_num(x)}" y="{top + ph + 16}" text-anchor="middle">{_num(tk)}</text>')
    p.append("</g>")
    p.append(f'<text x="{left + pw / 2}" y="{top + ph + 32}" text-anchor="middle" fill="#333">seconds since the '
             f'job started</text>')
    p.append(f'<text x="16" y="{top + ph / 2}" text-anchor="middle" fill="#333" '
             f'transform="rotate(-90 16 {top + ph / 2})">world size (workers)</text>')
    p.append(f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
    # Before the first round: workers starting (interpreter, imports, first rendezvous).
    if a.rounds:
        x1 = X(a.rounds[0].start)
        p.append(f'<g class="startup"><title>starting workers until the first round formed</title>'
                 f'<rect x="{left}" y="{top}" width="{_num(x1 - left)}" height="{ph}" fill="#eeeeee"/>'
                 f'<text x="{_num((left + x1) / 2)}" y="{top + ph - 8}" text-anchor="middle" fill="#888" '
                 f'font-size="10">starting</text></g>')
    # Resets: shaded, numbered.
    for rs in a.resets:
        x0, x1 = X(rs.start), X(rs.end)
        p.append(f'<g class="reset-span"><title>reset {rs.index}: {escape(rs.cause)}, {rs.seconds * 1000:.0f} ms'
                 f'</title><rect x="{_num(x0)}" y="{top}" width="{_num(max(x1 - x0, 1.5))}" height="{ph}" '
                 f'fill="#ff7f0e" fill-opacity="0.35"/>'
                 f'<text x="{_num(x0)}" y="{top + 12}" font-size="10" fill="#b35900" dx="3">{rs.index}</text></g>')
    # World size: a step line.
    d = []
    for i, (t, s) in enumerate(a.steps):
        sx, sy = _num(X(t)), _num(Y(s))
        d.append(f"M{sx} {sy}" if i == 0 else f"H{sx} V{sy}")
    d.append(f"H{_num(X(a.t_end))}")
    p.append(f'<path id="world-size" class="world-size" d="{" ".join(d)}" fill="none" stroke="#1f77b4" '
             f'stroke-width="2.5"/>')
    # Markers above the plot: markers of one kind close together become one, with a count;
    # different kinds at one time stack upwards.
    groups: list[tuple[float, str, list[Marker]]] = []
    for m in sorted(a.markers, key=lambda m: m.t):
        x = X(m.t)
        same = next((g for g in groups if g[1] == m.kind and x - g[0] < 8), None)
        if same is not None:
            same[2].append(m)
        else:
            groups.append((x, m.kind, [m]))
    p.append('<g class="markers">')
    placed: list[tuple[float, int]] = []
    for x, kind, ms in groups:
        level = sum(1 for px, _ in placed if abs(px - x) < 10)
        placed.append((x, level))
        _, color, shape = MARKERS[kind]
        tip = "; ".join(f"{m.label} at {m.t - a.t0:.2f} s" for m in ms)
        y = marker_y - 13 * level
        count = (f'<text x="{_num(x + 7)}" y="{_num(y + 4)}" font-size="9" fill="{color}">\u00d7{len(ms)}</text>'
                 if len(ms) > 1 else "")
        p.append(f'<g class="marker {kind}"><title>{escape(tip)}</title>'
                 f'{_marker_shape(shape, x, y, color)}/>{count}'
                 f'<line x1="{_num(x)}" y1="{top}" x2="{_num(x)}" y2="{top + ph}" stroke="{color}" '
                 f'stroke-dasharray="2 3" stroke-opacity="0.6"/></g>')
    p.append("</g>")
    # Legend of markers.
    lx: float = left
    kinds = [k for k in MARKERS if any(m.kind == k for m in a.markers)]
    for k in kinds:
        label, color, shape = MARKERS[k]
        p.append(f'{_marker_shape(shape, lx + 4, 53, color, 4.5)}/><text x="{lx + 12}" y="57">{escape(label)}</text>')
        lx += 30 + 6.2 * len(label)
    p.append(f'<rect x="{_num(lx)}" y="48" width="10" height="10" fill="#ff7f0e" fill-opacity="0.35"/>'
             f'<text x="{_num(lx + 14)}" y="57">reset (numbered)</text>')
    # Reset bars, on a shared duration scale.
    p.append(f'<text x="{left}" y="{bars_top - 8}" font-weight="bold">resets: time from trigger to the first step '
             f'of the new round, by phase</text>')
    if n:
        label_w = 330
        bx, bw = left + label_w, pw - label_w - 60
        longest = max(r.seconds for r in a.resets) or 1e-3
        for i, rs in enumerate(a.resets):
            y = bars_top + i * row
            label = f"{rs.index}. at {rs.start - a.t0:.1f} s: {rs.cause} ({rs.from_size}\u2192{rs.to_size})"
            if len(label) > 54:
                label = label[:53] + "\u2026"
            p.append(f'<g class="reset" id="reset-{rs.index}">')
            p.append(f'<text x="{bx - 8}" y="{y + 14}" text-anchor="end">{escape(label)}</text>')
            for name, s0, s1 in rs.phases:
                w = (s1 - s0) / longest * bw
                x = bx + (s0 - rs.start) / longest * bw
                p.append(f'<rect class="phase" data-phase={quoteattr(name)} x="{_num(x)}" y="{y + 3}" '
                         f'width="{w:.2f}" height="{row - 8}" fill="{PHASE_COLORS[name]}">'
                         f'<title>{escape(name)}: {(s1 - s0) * 1000:.1f} ms</title></rect>')
            p.append(f'<text x="{_num(bx + rs.seconds / longest * bw + 6)}" y="{y + 14}">'
                     f'{rs.seconds * 1000:.0f} ms</text></g>')
        ly = bars_top + n * row + 14
        lx = bx
        for name in PHASES:
            p.append(f'<rect x="{_num(lx)}" y="{ly}" width="10" height="10" fill="{PHASE_COLORS[name]}"/>'
                     f'<text x="{_num(lx + 14)}" y="{ly + 9}">{escape(name)}</text>')
            lx += 24 + 6.2 * len(name)
    else:
        p.append(f'<text x="{left}" y="{bars_top + 12}" fill="#555">no resets</text>')
    p.append("</svg>")
    return "\n".join(p) + "\n"


# --- HTML -----------------------------------------------------------------------------------
def to_html(events: list[dict[str, Any]], title: str = "elasticrun job timeline") -> str:
    a = analyze(events)
    rows = "".join(
        f"<tr><td>{r.round}</td><td>{r.size}</td><td>{html.escape(', '.join(r.hosts))}</td>"
        f"<td>{r.start - a.t0:.2f}</td><td>{r.end - r.start:.2f}</td></tr>" for r in a.rounds)
    resets = "".join(
        f"<tr><td>{rs.index}</td><td>{html.escape(rs.cause)}</td><td>{rs.trigger}</td><td>{rs.round}</td>"
        f"<td>{rs.from_size} \u2192 {rs.to_size}</td><td>{rs.start - a.t0:.2f}</td>"
        f"<td><b>{rs.seconds * 1000:.1f}</b></td>"
        + "".join(f"<td>{v * 1000:.1f}</td>" for v in rs.phase_seconds().values()) + "</tr>" for rs in a.resets)
    causes = "".join(
        f"<tr><td>{html.escape(c)}</td><td>{len(items)}</td><td>{sum(r.seconds for r in items) * 1000:.1f}</td>"
        f"<td>{statistics.median(r.seconds for r in items) * 1000:.1f}</td></tr>"
        for c, items in by_cause(a.resets).items())
    phase_heads = "".join(f"<th>{html.escape(p)} ms</th>" for p in PHASES)
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>
body {{ font-family: Helvetica, Arial, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 20px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
th {{ background: #f3f3f3; }} td:nth-child(2) {{ text-align: left; }}
pre {{ background: #f7f7f7; padding: 8px; }}
</style></head><body>
{to_svg(events, title)}
<h2>Rounds</h2>
<table><tr><th>round</th><th>workers</th><th>hosts</th><th>start s</th><th>lasted s</th></tr>{rows}</table>
<h2>Resets</h2>
<table><tr><th>#</th><th>cause</th><th>trigger</th><th>round</th><th>workers</th><th>at s</th><th>total ms</th>
{phase_heads}</tr>{resets}</table>
<h2>Resets by cause</h2>
<table><tr><th>cause</th><th>resets</th><th>total ms</th><th>median ms</th></tr>{causes}</table>
<pre>{html.escape(summary(a))}</pre>
</body></html>
"""


# --- PNG (matplotlib) -----------------------------------------------------------------------
def write_png(events: list[dict[str, Any]], path: str, title: str = "elasticrun job timeline") -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TimelineError(f"{path}: writing .png needs matplotlib, which is not installed: "
                            f"`pip install matplotlib`, or write .svg or .html (no dependency)") from None
    a = analyze(events)
    n = len(a.resets)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(10, 4 + 0.35 * max(n, 1)),
                                 gridspec_kw={"height_ratios": [3, max(1, 0.4 * n)]})
    xs = [t - a.t0 for t, _ in a.steps] + [a.duration]
    ys = [s for _, s in a.steps] + [a.steps[-1][1]]
    ax.step(xs, ys, where="post", color="#1f77b4", linewidth=2, label="world size")
    for rs in a.resets:
        ax.axvspan(rs.start - a.t0, rs.end - a.t0, color="#ff7f0e", alpha=0.35, linewidth=0)
    top = max(ys + [1]) + 0.6
    seen = set()
    shapes = {"up": "^", "down": "v", "cross": "x", "diamond": "D", "circle": "o", "square": "s"}
    for m in a.markers:
        label, color, shape = MARKERS[m.kind]
        ax.plot([m.t - a.t0], [top], shapes[shape], color=color, label=None if m.kind in seen else label)
        seen.add(m.kind)
    ax.set_ylim(0, top + 0.5)
    ax.set_xlim(0, max(a.duration, 1e-3))
    ax.set_xlabel("seconds since the job started")
    ax.set_ylabel("world size (workers)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    if n:
        for i, rs in enumerate(a.resets):
            for name, s0, s1 in rs.phases:
                bx.barh(i, (s1 - s0) * 1000, left=(s0 - rs.start) * 1000, color=PHASE_COLORS[name],
                        label=name if i == 0 else None)
        bx.set_yticks(range(n), [f"{rs.index}. {rs.cause[:40]}" for rs in a.resets], fontsize=8)
        bx.invert_yaxis()
        bx.set_xlabel("ms from trigger to the first step of the new round")
        bx.legend(fontsize=7, ncol=len(PHASES), loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    else:
        bx.axis("off")
        bx.text(0.5, 0.5, "no resets", ha="center", transform=bx.transAxes)
    fig.tight_layout()
    with _user_file(path, binary=True) as f:
        fig.savefig(f, dpi=120, format="png")
    plt.close(fig)


def _user_file(path: str, binary: bool = False) -> Any:
    """``path`` opened for writing (truncated), refusing a link or a file someone else planted
    on the way to it (``open_user_file``: ``-o /tmp/job.svg`` where a neighbour left a link to
    one of your files)."""
    fd = open_user_file(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC)
    return os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")


# --- command --------------------------------------------------------------------------------
def write(events: list[dict[str, Any]], path: str, title: str = "elasticrun job timeline") -> None:
    """Write ``path`` in the format its extension names (.json, .svg, .html, .png)."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in FORMATS:
        raise TimelineError(f"{path}: unknown output format {ext or '(no extension)'!r}; use one of "
                            f"{', '.join(FORMATS)}")
    try:
        if ext == ".png":
            write_png(events, path, title)
            return
        text = (json.dumps(to_chrome_trace(events), separators=(",", ":")) if ext == ".json"
                else to_svg(events, title) if ext == ".svg" else to_html(events, title))
        with _user_file(path) as f:
            f.write(text)
    except OSError as exc:  # a missing directory, no permission, a full disk
        raise TimelineError(f"cannot write {path}: {exc.strerror or exc}") from None
