"""Faults beyond a clean crash: hung workers, a killed driver, and misbehaving discovery."""

from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import PROGRESS_DISCOVERY, assert_nothing_left

pytestmark = pytest.mark.timeout(180)

TWO = "localhost:1,127.0.0.1:1"
THREE = "localhost:1,127.0.0.1:1,127.0.0.2:1"


def test_hung_worker_is_killed_and_survivors_continue(job):
    r = job.run(["-np", "3", "--min-np", "2", "-H", THREE, "--heartbeat-timeout", "2"],
                job.train_cmd("--fail=127.0.0.2:0@2:sigstop", epochs=4))
    assert r.returncode == 0, r.output
    assert "127.0.0.2[0] (rank 2) sent no heartbeat for" in r.stderr, r.stderr
    assert [e["size"] for e in r.log][-1] == 2, r.log
    assert r.log[-1]["rendezvous"] == 2


def wait_for_training(job, lines: int = 2, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not (job.log.exists() and job.log.read_text().count("\n") >= lines):
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.05)


def test_workers_exit_when_the_driver_is_killed(job):
    job.start(["-np", "2", "-H", TWO], job.train_cmd(epochs=1000, batches=5, sleep=0.05))
    wait_for_training(job)
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(timeout=10)
    started = time.monotonic()
    assert_nothing_left(job.tag, within=15)  # default driver timeout is 5 s
    assert time.monotonic() - started < 15


def write_script(path, body: str):
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(0o755)
    return str(path)


def test_discovery_that_hangs_later_is_killed_and_the_job_goes_on(job, tmp_path):
    # First run answers; later runs hang past --discovery-timeout and must not stall training.
    script = write_script(tmp_path / "d.sh", f"""
if [ -e "{tmp_path}/ran" ]; then sleep 60; fi
touch "{tmp_path}/ran"
echo localhost:1; echo 127.0.0.1:1
""")
    r = job.run(["-np", "2", "--host-discovery-script", script, "--discovery-interval", "0.2",
                 "--discovery-timeout", "0.5"], job.train_cmd(epochs=4, batches=10, sleep=0.05))
    assert r.returncode == 0, r.output
    assert "did not finish within 0.5 s" in r.stderr and "keeping the last known hosts" in r.stderr
    assert {e["size"] for e in r.log} == {2}


def test_garbage_and_empty_discovery_output_keep_the_job_alive(job, tmp_path):
    # Alternates between a valid list with junk lines, and empty output.
    script = write_script(tmp_path / "d.sh", f"""
n=$(cat "{tmp_path}/n" 2>/dev/null || echo 0); echo $((n+1)) > "{tmp_path}/n"
if [ $((n % 2)) -eq 1 ]; then exit 0; fi
echo localhost:1; echo 127.0.0.1:1; echo 'not a host!'; echo 'localhost:0'; echo '127.0.0.1:2'
""")
    r = job.run(["-np", "2", "--max-np", "2", "--host-discovery-script", script, "--discovery-interval", "0.1"],
                job.train_cmd(epochs=4, batches=10, sleep=0.05))
    assert r.returncode == 0, r.output
    assert "skipped invalid line, line 3: 'not a host!'" in r.stderr, r.stderr
    assert "a host needs at least 1 slot" in r.stderr
    assert "listed again with 2 slots" in r.stderr
    assert "discovery listed no hosts (empty output, or only invalid lines); keeping the last known hosts" in r.stderr
    assert r.stderr.count("skipped invalid line, line 3") == 1  # said once, not every interval
    assert {e["size"] for e in r.log} == {2}


def _worker_env(tag: str, name: str, timeout: float = 60) -> str:
    """Read ``name`` from the environment of a running worker of the job tagged ``tag``."""
    from conftest import tagged_pids

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in tagged_pids(tag):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    for item in f.read().split(b"\0"):
                        if item.startswith(name.encode() + b"="):
                            return item.split(b"=", 1)[1].decode()
            except OSError:
                continue
        time.sleep(0.05)
    raise AssertionError(f"no worker with {name} appeared")


def test_forged_and_oversized_control_messages_are_dropped(job):
    import zmq

    from elasticrun.common.protocol import MAX_FRAME_BYTES, Codec

    job.start(["-np", "2", "-H", TWO], job.train_cmd(epochs=6, batches=10, sleep=0.05))
    addr = _worker_env(job.tag, "ELASTICRUN_CONTROL_ADDR")
    job_id = _worker_env(job.tag, "ELASTICRUN_JOB_ID")
    ctx = zmq.Context()
    try:
        rogue = ctx.socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        # The driver refuses this peer's handshake (no CURVE keys), so between its reconnects the
        # socket may have no pipe at all and a send would block for good: bound it. A frame that
        # cannot even leave this socket is dropped as surely as one the driver refuses.
        rogue.setsockopt(zmq.SNDTIMEO, 2000)
        rogue.connect(addr)
        forged = Codec(b"not the job's secret" * 2, job_id, "rogue")
        for frame in (forged.encode("rendezvous", {"worker": "w1", "after_round": 0}),  # wrong secret
                      b"\x00" * 40,  # garbage
                      b"x" * (MAX_FRAME_BYTES + 10)):  # oversized
            try:
                rogue.send(frame)
            except zmq.Again:
                pass
        wait_for_training(job, lines=3)
    finally:
        ctx.destroy(linger=0)
    r = job.finish()
    assert r.returncode == 0, r.output
    # A peer without the job's CURVE keys never gets a frame to the driver's loop (a peer with
    # stolen CURVE keys but not the HMAC secret: tests/integration/test_security.py).
    assert "dropped a control frame" not in r.stderr, r.stderr
    assert [e["epoch"] for e in r.log] == list(range(6))  # nothing was lost or repeated


def test_a_rank_that_times_out_alone_aborts_the_round_for_its_peers(job):
    """127.0.0.1 stalls 8 s in user code; localhost gives up after the 2 s collective timeout and
    says so when it asks for the next round. The driver aborts the round, so the stalled rank's
    next collective is abandoned at once instead of waiting out a timeout of its own."""
    from elasticrun.common.events import read_events

    events_file = job.tmp / "events.jsonl"
    r = job.run(["-np", "2", "-H", TWO, "--collective-timeout", "2", "--heartbeat-timeout", "10",
                 "--events", str(events_file)],
                job.train_cmd("--fail=127.0.0.1:0@1:stall", epochs=3))
    assert r.returncode == 0, r.output
    events = read_events(str(events_file))
    aborted = [e for e in events if e["kind"] == "round_aborted"]
    assert len(aborted) == 1 and "localhost[0] left round 0 after an error" in aborted[0]["reason"], \
        (aborted, [(e["kind"], e.get("host"), e.get("reason") or e.get("error")) for e in events], r.output[-3000:])
    assert "collective timeout" in aborted[0]["reason"]
    stalled = [e for e in events if e["kind"] == "failure_detected" and e.get("host") == "127.0.0.1"]
    # Freed by the abort (before or while issuing its collective), not by a timeout of its own.
    assert stalled and "round 0 was aborted: localhost[0] left round 0" in stalled[0]["error"], stalled
    assert not stalled[0]["error"].startswith("allreduce"), stalled
    assert [e["size"] for e in r.log][-1] == 2 and r.log[-1]["rendezvous"] == 2  # both kept going
