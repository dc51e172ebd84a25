"""The event log: every phase of a reset is recorded, and the console says what each cost."""

from __future__ import annotations

import pytest

from elasticrun.common.events import read_events

pytestmark = pytest.mark.timeout(180)


def test_event_log_records_each_phase_of_a_failure_reset(job):
    events_file = job.tmp / "events.jsonl"
    r = job.run(["-np", "3", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1", "--events", str(events_file)],
                job.train_cmd("--fail=127.0.0.2:0@2:sigkill", epochs=4))
    assert r.returncode == 0, r.output
    events = read_events(str(events_file))
    kinds = [e["kind"] for e in events]
    for kind in ("worker_started", "round_formed", "worker_exited", "worker_failed", "host_blacklisted",
                 "round_aborted", "failure_detected", "restore", "rendezvous_complete", "group_formed",
                 "sync_done", "first_step", "reset", "job_end"):
        assert kind in kinds, f"no {kind} event in {sorted(set(kinds))}"
    reset = next(e for e in events if e["kind"] == "reset")
    assert reset["from_size"] == 3 and reset["to_size"] == 2 and "exited with code -9" in reset["cause"]
    assert 0 < reset["seconds"] < 5
    # Phases of the reset happen in order on each survivor.
    for rank in (0, 1):
        mine = [e["kind"] for e in events if e["source"] == "worker" and e.get("host") in ("localhost", "127.0.0.1")
                and e["kind"] in ("failure_detected", "restore", "rendezvous_complete", "sync_done", "first_step")
                and e.get("round", -1) >= 0]
        assert mine.index("failure_detected") < mine.index("restore") < len(mine)
    worker_events = [e for e in events if e["source"] == "worker"]
    assert all({"t", "round", "rank", "host"} <= e.keys() for e in worker_events)
    # The console: one line per reset, and a summary at exit.
    assert "reset 1 (127.0.0.2[0] exited with code -9): 3 -> 2 worker(s), training again" in r.stderr
    assert "summary: 2 round(s), 1 reset(s) (1 after failures), " in r.stderr
    assert "blacklisted hosts: 127.0.0.2" in r.stderr


def test_graceful_change_is_logged_with_notifications(job):
    events_file = job.tmp / "events.jsonl"
    from conftest import PROGRESS_DISCOVERY

    r = job.run(["-np", "2", "--min-np", "1", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.2", "--events", str(events_file)],
                job.train_cmd("--await-size=2:1", epochs=3),
                HOSTS_SCHEDULE="0:localhost:1,127.0.0.1:1;1:localhost:1")
    assert r.returncode == 0, r.output
    events = read_events(str(events_file))
    sent = [e for e in events if e["kind"] == "notification_sent"]
    assert len(sent) == 1 and sent[0]["removed"] and not sent[0]["added"]
    received = [e for e in events if e["kind"] == "notification_received"]
    # Each worker heard it once, from the notification on its heartbeat connection: the same
    # connection as the heartbeat replies, so no reply that carries it can come first.
    assert sorted((e["host"], e["ts"], e["via"]) for e in received) == \
        [("127.0.0.1", sent[0]["ts"], "notification"), ("localhost", sent[0]["ts"], "notification")], received
    interrupts = [e for e in events if e["kind"] == "interrupt"]
    assert len(interrupts) == 2 and all(e["skip_sync"] for e in interrupts)  # removals only: no re-sync
    assert any(e["kind"] == "discovery" and e["hosts"] == {"localhost": 1} for e in events)
    assert "reset 1 (hosts removed): 2 -> 1 worker(s)" in r.stderr
