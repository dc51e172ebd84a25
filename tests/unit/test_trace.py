"""hvd.start_timeline's recording (elasticrun/worker/trace.py): which worker writes a shared
path, streaming to the file, bounded memory, and a clear error before recording starts."""

from __future__ import annotations

import json
import os

import pytest

from elasticrun.worker import trace
from elasticrun.worker.trace import Timeline, writes

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def _no_rank(monkeypatch):
    monkeypatch.setattr(trace, "_rank", None)
    monkeypatch.setattr(trace, "_active", None)


def _ops(t: Timeline, n: int, round_: int = 1) -> None:
    for i in range(n):
        t.record(f"allreduce op{i}", i * 1e-3, i * 1e-3 + 1e-4, round_, shape=[4])


def test_rank_0_alone_writes_a_shared_path_and_any_rank_its_own():
    assert writes("/t.json", 0) and writes("/t.json", None)  # before any round: alone
    assert not writes("/t.json", 1) and not writes("/t.json", 7)
    assert writes("/t-{rank}.json", 3)


def test_the_writer_leaves_a_valid_trace(tmp_path):
    path = tmp_path / "tl.json"
    t = Timeline(str(path), mark_cycles=True)
    t.rank = 0
    _ops(t, 3)
    t.mark("commit", 1)
    assert t.close() == str(path)
    events = json.loads(path.read_text())
    assert [e["name"] for e in events if e["ph"] == "X"] == ["allreduce op0", "allreduce op1", "allreduce op2"]
    assert [e["name"] for e in events if e["ph"] == "i"] == ["commit"]
    assert {"name": "round 1"} in [e["args"] for e in events if e["name"] == "thread_name"]
    assert t.close() == str(path) and json.loads(path.read_text()) == events  # closing twice changes nothing


def test_another_rank_writes_nothing_and_keeps_little(tmp_path):
    path = tmp_path / "tl.json"
    path.write_text("rank 0's\n")
    t = Timeline(str(path))
    t.rank = 1
    _ops(t, 3 * Timeline.FLUSH_EVERY)
    assert len(t.events) < Timeline.FLUSH_EVERY  # bounded
    assert t.close() is None
    assert path.read_text() == "rank 0's\n"  # untouched, even at start


def test_a_long_recording_streams_and_survives_its_writer(tmp_path):
    path = tmp_path / "tl.json"
    t = Timeline(str(path))
    t.rank = 0
    _ops(t, Timeline.FLUSH_EVERY + 10)
    assert len(t.events) == 10  # the rest is on disk already
    on_disk = path.read_text()
    assert on_disk.startswith("[\n") and on_disk.count("allreduce op") == Timeline.FLUSH_EVERY
    json.loads(on_disk + "]")  # what a killed writer leaves: an unclosed array, every event whole
    t.close()
    assert sum(e["ph"] == "X" for e in json.loads(path.read_text())) == Timeline.FLUSH_EVERY + 10


def test_a_new_rank_0_writes_its_newest_events(tmp_path):
    """Rank 0 was lost: its successor's file holds what it saw just before, then on."""
    path = tmp_path / "tl.json"
    t = Timeline(str(path))
    t.rank = 1
    _ops(t, 2 * Timeline.FLUSH_EVERY, round_=1)
    trace._active = t
    trace.note_rank(0)
    _ops(t, 5, round_=2)
    t.close()
    events = json.loads(path.read_text())
    rounds = [e["tid"] for e in events if e["ph"] == "X"]
    assert rounds.count(2) == 5 and 0 < rounds.count(1) <= Timeline.FLUSH_EVERY
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"] == [f"rank 0 (pid {os.getpid()})"]


def test_every_rank_its_own_file(tmp_path):
    t = Timeline(str(tmp_path / "tl-{rank}.json"))
    t.rank = 2
    _ops(t, 1)
    assert t.close() == str(tmp_path / "tl-2.json")
    assert not (tmp_path / "tl-{rank}.json").exists()


@pytest.mark.parametrize("where,error", [("missing/tl.json", FileNotFoundError), ("dir", IsADirectoryError)])
def test_an_unwritable_path_fails_at_start(tmp_path, where, error):
    (tmp_path / "dir").mkdir()
    with pytest.raises(error, match="timeline"):
        Timeline(str(tmp_path / where))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
