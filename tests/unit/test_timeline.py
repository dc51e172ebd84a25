"""`elasticrun timeline`: Chrome-trace JSON, SVG/HTML picture, summary; on hand-written and recorded logs."""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from elasticrun import timeline
from elasticrun.timeline import PHASES, TimelineError

pytestmark = pytest.mark.timeout(30)

DATA = Path(__file__).resolve().parents[1] / "data"
DEMO = DATA / "events_demo.jsonl"  # examples/discover_hosts.sh demo: a host added, then one removed
FAILURE = DATA / "events_failure.jsonl"  # 3 hosts, one worker SIGKILLed, blacklisted; 2 carry on
SVG = "{http://www.w3.org/2000/svg}"


def _w(t, kind, host, rank, round_, **fields):
    return dict(t=t, kind=kind, source="worker", host=host, slot=0, rank=rank, round=round_, **fields)


def _d(t, kind, **fields):
    return dict(t=t, kind=kind, source="driver", **fields)


def hand_written() -> list[dict]:
    """Round 0 on a, b; c added (reset 1, 350 ms); c killed (reset 2, 220 ms); job ends."""
    ev = [
        _d(1000.0, "host_added", round=-1, host="a"), _d(1000.0, "host_added", round=-1, host="b"),
        _d(1000.01, "worker_started", worker="w1", host="a", slot=0, rank=0),
        _d(1000.01, "worker_started", worker="w2", host="b", slot=0, rank=1),
        _d(1001.0, "round_formed", round=0, size=2, hosts=["a", "b"]),
    ]
    for host, rank in (("a", 0), ("b", 1)):
        ev += [_w(1001.0, "rendezvous_complete", host, rank, 0, size=2, waited_ms=10),
               _w(1001.01, "group_formed", host, rank, 0, ms=5), _w(1001.02, "sync_done", host, rank, 0, ms=5)]
    ev += [_d(1002.0, "host_added", round=0, host="c"),
           _d(1002.0, "worker_started", worker="w3", host="c", slot=0, rank=2),
           _d(1003.0, "notification_sent", round=0, ts=1003.0, added=True, removed=False),
           _d(1003.15, "round_formed", round=1, size=3, hosts=["a", "b", "c"])]
    for host, rank in (("a", 0), ("b", 1)):
        ev += [_w(1003.1, "interrupt", host, rank, 0, ts=1003.0, skip_sync=False),
               _w(1003.16, "rendezvous_complete", host, rank, 1, size=3, waited_ms=1),
               _w(1003.25, "group_formed", host, rank, 1, ms=80), _w(1003.3, "sync_done", host, rank, 1, ms=40)]
    ev += [_w(1003.2, "rendezvous_complete", "c", 2, 1, size=3, waited_ms=900),
           _w(1003.24, "group_formed", "c", 2, 1, ms=30), _w(1003.29, "sync_done", "c", 2, 1, ms=40),
           _w(1003.35, "first_step", "a", 0, 1), _w(1003.36, "first_step", "b", 1, 1),
           _d(1003.4, "reset", cause="hosts added", trigger="hosts", round=1, from_size=2, to_size=3, seconds=0.35),
           _d(1005.0, "worker_failed", round=1, host="c", rank=2, message="c[0] (rank 2) exited with code -9"),
           _d(1005.0, "host_blacklisted", round=1, host="c"),
           _d(1005.0, "round_aborted", round=1, reason="c[0] exited with code -9"),
           _d(1005.0, "worker_exited", worker="w3", code=-9, host="c", slot=0, rank=2),
           _d(1005.1, "round_formed", round=2, size=2, hosts=["a", "b"])]
    for host, rank in (("a", 0), ("b", 1)):
        ev += [_w(1005.02, "failure_detected", host, rank, 1, error="allreduce failed"),
               _w(1005.03, "restore", host, rank, 1, ms=10),
               _w(1005.12, "rendezvous_complete", host, rank, 2, size=2, waited_ms=90),
               _w(1005.15, "group_formed", host, rank, 2, ms=30), _w(1005.2, "sync_done", host, rank, 2, ms=50),
               _w(1005.22, "first_step", host, rank, 2)]
    ev += [_d(1005.3, "reset", cause="c[0] exited with code -9", trigger="failure", round=2, from_size=3, to_size=2,
              seconds=0.22),
           _d(1006.0, "worker_exited", worker="w1", code=0, host="a", slot=0, rank=0),
           _d(1006.0, "worker_exited", worker="w2", code=0, host="b", slot=0, rank=1),
           _d(1006.0, "job_end", round=2, ok=True, reason="training finished after 3 round(s), 2 reset(s)")]
    return sorted(ev, key=lambda e: e["t"])


# --- analysis and summary -------------------------------------------------------------------
def test_rounds_resets_and_phases_of_a_hand_written_log():
    a = timeline.analyze(hand_written())
    assert [(r.round, r.size) for r in a.rounds] == [(0, 2), (1, 3), (2, 2)]
    assert a.duration == pytest.approx(6.0)
    added, failed = a.resets
    assert (added.cause, added.trigger, added.from_size, added.to_size) == ("hosts added", "hosts", 2, 3)
    # trigger 1003.0 -> interrupt 1003.1 -> round 1003.15 -> last assignment 1003.2 -> last group 1003.25
    # -> last sync 1003.3 -> first step 1003.35
    assert [round(v, 3) for v in added.phase_seconds().values()] == [0.1, 0.05, 0.05, 0.05, 0.05, 0.05]
    assert [round(v, 3) for v in failed.phase_seconds().values()] == [0.02, 0.08, 0.02, 0.03, 0.05, 0.02]
    assert list(failed.phase_seconds()) == list(PHASES)
    for r in a.resets:  # phases lie end to end and add up to the cost the driver reported
        assert sum(r.phase_seconds().values()) == pytest.approx(r.seconds)
    assert {m.kind for m in a.markers} == {"host_added", "worker_failed", "host_blacklisted"}
    text = timeline.summary(a)
    assert "job succeeded in 6.0 s: 3 round(s), 2 reset(s), 0.57 s recovering" in text
    assert ("reset 2 at 5.0 s (c[0] exited with code -9): 3 -> 2 worker(s), 220 ms  "
            "[20 / 80 / 20 / 30 / 50 / 20]") in text
    assert "  hosts added: 1 reset(s), 350 ms in all" in text


def test_a_round_that_never_trained_is_a_reset_as_the_console_counts_it():
    """A signal during a reset: the console said "2 round(s), 1 reset(s) (1 ended before training
    resumed)", the timeline "2 round(s), 0 reset(s)"."""
    ev = [e for e in hand_written() if e["t"] < 1003.3 and e.get("kind") != "first_step"]
    ev.append(_d(1003.5, "job_end", round=1, ok=False, reason="stopped by SIGTERM"))
    text = timeline.summary(timeline.analyze(ev))
    assert "job failed in 3.5 s: 2 round(s), 1 reset(s) (1 ended before training resumed)" in text, text


def test_phases_are_clamped_when_a_worker_notices_before_the_driver():
    ev = hand_written()
    for e in ev:
        if e["kind"] == "failure_detected":
            e["t"] = 1004.99  # a survivor's collective failed before the driver aborted the round
    failed = timeline.analyze(ev).resets[1]
    assert failed.phase_seconds()["detect"] == 0
    assert all(v >= 0 for v in failed.phase_seconds().values())
    assert sum(failed.phase_seconds().values()) == pytest.approx(0.22)


# --- Chrome trace ---------------------------------------------------------------------------
def _tracks(trace: dict) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    procs = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
               if e["ph"] == "M" and e["name"] == "thread_name"}
    return procs, threads


def _check_trace(trace: dict) -> None:
    trace = json.loads(json.dumps(trace))  # plain JSON all the way down
    events = trace["traceEvents"]
    assert all(e["ph"] in ("M", "X", "i") for e in events)
    timed = [e for e in events if e["ph"] != "M"]
    assert min(e["ts"] for e in timed) == 0  # microseconds since the job started
    assert all(e["ts"] >= 0 and isinstance(e["pid"], int) and isinstance(e["tid"], int) for e in timed)
    spans: dict[tuple[int, int], list[dict]] = {}
    for e in timed:
        if e["ph"] == "X":
            assert e["dur"] >= 0
            spans.setdefault((e["pid"], e["tid"]), []).append(e)
        else:
            assert e["s"] == "t"
    for track in spans.values():  # spans of one track never overlap
        track.sort(key=lambda e: e["ts"])
        for before, after in zip(track, track[1:]):
            assert before["ts"] + before["dur"] <= after["ts"] + 0.2


def test_chrome_trace_has_driver_and_worker_tracks_and_spans():
    trace = timeline.to_chrome_trace(hand_written())
    _check_trace(trace)
    procs, threads = _tracks(trace)
    assert sorted(procs.values()) == ["elasticrun driver", "host a", "host b", "host c"]
    driver = next(pid for pid, name in procs.items() if name == "elasticrun driver")
    assert {name for (pid, _), name in threads.items() if pid == driver} == {
        "rounds", "resets", "reset phases", "hosts and failures"}
    assert {name for (pid, _), name in threads.items() if pid != driver} == {"a[0]", "b[0]", "c[0]"}
    names = {(e["ph"], e["name"]) for e in trace["traceEvents"] if e["ph"] != "M"}
    for span in ("round 0 (2 workers)", "round 1 (3 workers)", "round 2 (2 workers)", "reset 1: hosts added",
                 "reset 2: c[0] exited with code -9", "rendezvous", "group formation", "restore", "sync", "training",
                 *PHASES):
        assert ("X", span) in names, span
    for instant in ("host added: c", "worker failed: c", "host blacklisted: c", "round aborted", "failure detected",
                    "first step", "worker exited (-9)"):
        assert ("i", instant) in names, instant
    # Training spans: a and b train in rounds 0, 1 and 2; c only in round 1 (until it was killed).
    by_track = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"] == "training":
            by_track.setdefault(threads[(e["pid"], e["tid"])], []).append(e["args"]["round"])
    assert by_track == {"a[0]": [0, 1, 2], "b[0]": [0, 1, 2], "c[0]": [1]}
    c_training = next(e for e in trace["traceEvents"]
                      if e["name"] == "training" and threads[(e["pid"], e["tid"])] == "c[0]")
    assert (c_training["ts"] + c_training["dur"]) / 1e6 == pytest.approx(5.0)  # ends when c is killed
    reset = next(e for e in trace["traceEvents"] if e["name"] == "reset 1: hosts added")
    assert reset["ts"] == pytest.approx(3.0e6) and reset["dur"] == pytest.approx(0.35e6)


# --- SVG and HTML ---------------------------------------------------------------------------
def _parse_svg(text: str) -> ET.Element:
    root = ET.fromstring(text)
    assert root.tag == f"{SVG}svg"
    return root


def test_svg_has_world_size_step_line_markers_and_one_bar_per_reset():
    root = _parse_svg(timeline.to_svg(hand_written()))
    path = root.find(f".//{SVG}path[@id='world-size']")
    assert path is not None
    # From 0, a vertical step at each of the 3 rounds (sizes 2, 3, 2), then on to the end.
    assert path.get("d").count("V") == 3
    resets = [g for g in root.iter(f"{SVG}g") if g.get("class") == "reset"]
    assert [g.get("id") for g in resets] == ["reset-1", "reset-2"]
    for g in resets:
        assert [r.get("data-phase") for r in g.iter(f"{SVG}rect")] == list(PHASES)
    markers = {g.get("class") for g in root.iter(f"{SVG}g") if (g.get("class") or "").startswith("marker ")}
    assert markers == {"marker host_added", "marker worker_failed", "marker host_blacklisted"}


def test_svg_of_a_job_without_resets():
    ev = [e for e in hand_written() if e["t"] < 1002.0] + [_d(1002.0, "job_end", round=0, ok=True, reason="done")]
    root = _parse_svg(timeline.to_svg(ev))
    assert not [g for g in root.iter(f"{SVG}g") if g.get("class") == "reset"]
    assert "no resets" in "".join(root.itertext())


def test_html_embeds_the_svg_and_the_tables():
    page = timeline.to_html(hand_written())
    assert page.startswith("<!doctype html>") and "<svg xmlns=" in page
    assert "<h2>Resets by cause</h2>" in page and "c[0] exited with code -9" in page
    _parse_svg(page[page.index("<svg"):page.index("</svg>") + len("</svg>")])


# --- files and the command ------------------------------------------------------------------
def test_png_without_matplotlib_names_the_install_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(TimelineError, match=r"pip install matplotlib"):
        timeline.write(hand_written(), str(tmp_path / "t.png"))
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in hand_written()))
    assert timeline.main([str(log), "-o", str(tmp_path / "t.png")]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "t.png").exists()


def test_command_writes_each_format_and_prints_the_summary(tmp_path, capsys):
    log = tmp_path / "events.jsonl"
    lines = [json.dumps(e) for e in hand_written()]
    log.write_text("\n".join(lines) + '\n{"t": 1006.5, "kind": "wor')  # a job killed mid-write
    outs = [tmp_path / f"t{ext}" for ext in (".json", ".svg", ".html")]
    from elasticrun.__main__ import main  # the `elasticrun` command

    args = ["timeline", str(log)] + [x for o in outs for x in ("-o", str(o))]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "3 round(s), 2 reset(s)" in out and "resets by cause:" in out
    _check_trace(json.loads(outs[0].read_text()))
    _parse_svg(outs[1].read_text())
    assert "<svg" in outs[2].read_text()


def test_command_rejects_unknown_formats_and_empty_logs(tmp_path, capsys):
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(e) + "\n" for e in hand_written()))
    assert timeline.main([str(log), "-o", str(tmp_path / "t.pdf")]) == 2
    assert "extension must be one of .json, .svg, .html, .png" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert timeline.main([str(empty)]) == 2
    assert "holds no events" in capsys.readouterr().err
    assert timeline.main([str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read the event log" in capsys.readouterr().err


def test_command_says_one_line_for_a_binary_log_and_an_unwritable_output(tmp_path, capsys):
    """Both were tracebacks (UnicodeDecodeError, FileNotFoundError)."""
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    assert timeline.main([str(binary)]) == 2
    assert capsys.readouterr().err == (f"elasticrun timeline: {binary} holds no events (write one with "
                                       f"`elasticrun --events {binary} ...`)\n")
    log = tmp_path / "events.jsonl"
    log.write_text("\n".join([json.dumps(e) for e in hand_written()] + ["\xff\xfe not json"]) + "\n")
    for ext in (".svg", ".png"):
        out = tmp_path / "no" / "such" / f"t{ext}"
        assert timeline.main([str(log), "-q", "-o", str(out)]) == 2
        assert capsys.readouterr().err == f"elasticrun timeline: cannot write {out}: No such file or directory\n"


# --- recorded logs --------------------------------------------------------------------------
def test_recorded_demo_log():
    events = timeline.load_events(str(DEMO))
    a = timeline.analyze(events)
    assert [r.size for r in a.rounds] == [2, 3, 2]
    assert [(r.cause, r.from_size, r.to_size) for r in a.resets] == [("hosts added", 2, 3), ("hosts removed", 3, 2)]
    reported = [e["seconds"] for e in events if e["kind"] == "reset"]
    for r, seconds in zip(a.resets, reported):
        assert r.seconds == seconds and sum(r.phase_seconds().values()) == pytest.approx(seconds)
    assert {m.kind for m in a.markers} == {"host_added", "host_removed"}
    trace = timeline.to_chrome_trace(events)
    _check_trace(trace)
    procs, threads = _tracks(trace)
    assert sorted(procs.values()) == ["elasticrun driver", "host 127.0.0.1", "host 127.0.0.2", "host localhost"]
    assert {"localhost[0]", "127.0.0.1[0]", "127.0.0.2[0]"} <= set(threads.values())
    root = _parse_svg(timeline.to_svg(events))
    assert len([g for g in root.iter(f"{SVG}g") if g.get("class") == "reset"]) == 2
    assert root.find(f".//{SVG}path[@id='world-size']").get("d").count("V") == 3


def test_recorded_failure_log():
    events = timeline.load_events(str(FAILURE))
    a = timeline.analyze(events)
    assert [r.size for r in a.rounds] == [3, 2]
    (reset,) = a.resets
    assert reset.trigger == "failure" and "exited with code -9" in reset.cause
    assert {"worker_failed", "host_blacklisted"} <= {m.kind for m in a.markers}
    trace = timeline.to_chrome_trace(events)
    _check_trace(trace)
    names = {e["name"] for e in trace["traceEvents"]}
    assert {"restore", "failure detected", "worker failed: 127.0.0.2", "host blacklisted: 127.0.0.2"} <= names
    assert "exited with code -9" in timeline.summary(a)


def test_png_of_a_real_demo_log_is_produced(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extras: pip install -e .[test]")
    out = tmp_path / "timeline.png"
    assert timeline.main([str(DATA / "events_demo.jsonl"), "-o", str(out), "-q"]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


# --- stragglers (issue 16) ------------------------------------------------------------------
def with_a_straggler() -> list[dict]:
    msg = ("host b is a straggler: 160 ms of compute per step against 11 ms (median of the others) over the last "
           "20 steps; evicting it (--evict-stragglers): its workers leave at their next commit, without a rollback")
    return sorted(hand_written() + [
        _d(1001.8, "straggler", round=0, host="b", action="evicted", message=msg, compute_ms=160.0,
           reference_ms=11.0, step_ms=172.0, steps=20),
        _d(1001.8, "host_blacklisted", round=0, host="b", message="host b blacklisted for 30.0 s (a straggler)"),
    ], key=lambda e: e["t"])


def test_a_straggler_is_in_the_summary_the_picture_and_the_trace():
    ev = with_a_straggler()
    text = timeline.summary(timeline.analyze(ev))
    assert "stragglers:\n  at 1.8 s: host b evicted: 160 ms of compute per step against 11 ms over the last 20 steps" \
        in text, text
    root = _parse_svg(timeline.to_svg(ev))
    [marker] = [g for g in root.iter(f"{SVG}g") if g.get("class") == "marker straggler"]
    assert "is a straggler: 160 ms" in "".join(marker.itertext())
    trace = timeline.to_chrome_trace(ev)["traceEvents"]
    [on_host] = [e for e in trace if e["name"] == "straggler evicted"]
    names = {(e["pid"], e.get("tid")): e["args"]["name"] for e in trace if e["name"] == "thread_name"}
    assert names[(on_host["pid"], 0)] == "b: stragglers" and on_host["args"]["compute_ms"] == 160.0
    assert any(e["name"] == "straggler: b" and e["ph"] == "i" for e in trace)  # the driver's track too
    assert "stragglers:" not in timeline.summary(timeline.analyze(hand_written()))


def test_a_host_that_left_or_drains_is_marked():
    events = [{"t": 0.0, "kind": "round_formed", "source": "driver", "round": 0, "size": 2},
              {"t": 1.0, "kind": "host_leaving", "source": "driver", "host": "h2", "message": "host h2 leaving (SIGTERM)"},
              {"t": 2.0, "kind": "host_draining", "source": "driver", "host": "h3"},
              {"t": 3.0, "kind": "job_end", "source": "driver", "ok": True, "reason": "done"}]
    a = timeline.analyze(events)
    assert [(m.kind, m.host) for m in a.markers] == [("host_leaving", "h2"), ("host_draining", "h3")]
