"""Hostile and broken input: floods of frames or discovery output give a few log lines and
counts, the driver's memory stays bounded, and the job goes on (or fails with one line)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS
from sshd import ssh_server, sshd_clean  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(180)


def counted(lines: list[str], *full: str) -> int:
    """Occurrences accounted for by full lines (containing one of ``full``) plus summaries ("1,234 more ...")."""
    shown = sum(1 for line in lines if any(f in line for f in full))
    summed = sum(int(m.group(1).replace(",", "")) for line in lines if (m := re.search(r"\] ([\d,]+) more ", line)))
    return shown + summed


def script(path: Path, body: str) -> str:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def test_a_flood_of_garbage_frames_gives_a_few_lines_and_counts(job):
    n = 50_000
    r = job.run(["-np", "1", "-H", "localhost:1"], [sys.executable, str(SCRIPTS / "flood_driver.py"), str(n)])
    assert r.returncode == 0, r.output[-3000:]
    assert "the driver answered: heartbeat_ack" in r.stdout, r.output[-3000:]
    lines = [line for line in r.stderr.splitlines() if "control frame" in line]
    assert len(lines) <= 10, "\n".join(lines)  # was one line per frame
    # Nothing is lost: full lines plus the counts of the summaries (flushed at the end) add up.
    assert counted(lines, "dropped a control frame", "dropped a message of") == n + 3, lines
    summaries = " ".join(line for line in lines if " more " in line)
    assert "bad MAC" in summaries and "too short" in summaries, lines
    assert "[elasticrun] summary:" in r.stderr


def test_100000_bad_discovery_lines_give_a_few_lines_and_a_count(job, tmp_path):
    bad = 99_000  # and one good line: under the 100,000-line limit of a discovery run
    path = script(tmp_path / "discover.sh", f"echo localhost:1; yes 'bad host!' | head -n {bad}")
    # The "worker" lets several discovery runs (every 0.2 s) happen, then succeeds.
    r = job.run(["-np", "1", "--host-discovery-script", path, "--discovery-interval", "0.2"],
                [sys.executable, "-c", "import time; time.sleep(2)"])
    assert r.returncode == 0, r.output[-3000:]
    lines = [line for line in r.stderr.splitlines() if "invalid" in line]
    assert len(lines) <= 7, "\n".join(lines)  # the first few, one count; identical runs say nothing more
    assert counted(lines, "skipped invalid line") == bad, lines


def test_endless_discovery_output_on_the_first_run_fails_at_once_with_one_line(job, tmp_path):
    path = script(tmp_path / "discover.sh", "yes localhost:1")
    r = job.run(["-np", "1", "--host-discovery-script", path, "--discovery-timeout", "20"],
                [sys.executable, "-c", "pass"])
    assert r.returncode == 2, r.output[-3000:]
    assert r.seconds < 15, r.seconds  # the limit, not the timeout, ended it
    assert r.stderr.strip().splitlines() == [
        "elasticrun: The discovery script is misconfigured: its first run failed.",
        f"{path} printed more than 1 MiB; it was killed (a discovery script prints one host per line)"]


def test_discovery_printing_100_mb_keeps_the_driver_small_and_the_job_going(job, tmp_path):
    """First run: a host. Later runs print 50 MB each (the driver used to hold all of it)."""
    runs = tmp_path / "runs"
    path = script(tmp_path / "discover.sh", f"""n=$(cat {runs} 2>/dev/null || echo 0)
echo $((n + 1)) > {runs}
if [ "$n" -eq 0 ]; then echo localhost:1; else yes localhost:1 | head -c 50000000; fi""")
    # The "worker" waits for 4 flooding runs, then reports its parent's (the driver's) peak memory.
    worker = f"""import os, time
deadline = time.monotonic() + 60
while time.monotonic() < deadline and int(open({str(runs)!r}).read() or 0) < 6:
    time.sleep(0.05)
status = open(f"/proc/{{os.getppid()}}/status").read()
print("driver peak kB:", status.split("VmHWM:")[1].split()[0])"""
    r = job.run(["-np", "1", "--host-discovery-script", path, "--discovery-interval", "0.2"],
                [sys.executable, "-c", worker])
    assert r.returncode == 0, r.output[-3000:]
    peak_kb = int(re.search(r"driver peak kB: (\d+)", r.stdout).group(1))
    assert peak_kb < 120_000, peak_kb  # ~30 MB idle; 50 MB runs used to take it past 400 MB
    failed = [line for line in r.stderr.splitlines() if "printed more than 1 MiB" in line]
    assert failed == [f"[elasticrun] discovery failed, keeping the last known hosts: {path} printed more than "
                      f"1 MiB; it was killed (a discovery script prints one host per line)"], r.stderr[-3000:]


def test_a_worker_line_of_200_mb_keeps_the_driver_small_and_loses_nothing(job):
    """A line is handed on in pieces of 64 KiB (it was held whole: 1.4 GB of driver for this one)."""
    worker = """import os, sys
for _ in range(200):
    sys.stdout.write("x" * (1 << 20))
sys.stdout.flush()
status = open(f"/proc/{os.getppid()}/status").read()
print("\\ndriver peak kB:", status.split("VmHWM:")[1].split()[0])"""
    r = job.run(["-np", "1", "-H", "localhost:1"], [sys.executable, "-c", worker])
    assert r.returncode == 0, r.output[-3000:]
    peak_kb = int(re.search(r"driver peak kB: (\d+)", r.stdout).group(1))
    assert peak_kb < 120_000, peak_kb
    pieces = [line for line in r.stdout.splitlines() if line.startswith("[0]<stdout>:x")]
    assert sum(len(p) - len("[0]<stdout>:") for p in pieces) == 200 << 20
    assert max(len(p) for p in pieces) <= len("[0]<stdout>:") + (64 << 10)


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_report_after_a_long_unended_line_still_reaches_the_driver(job, where, request):
    """Over SSH the launcher's reports share the worker's stdout: one that follows 300 KiB with no
    newline must not be cut between two pieces (the worker's exit status would be lost)."""
    if where == "local":
        hosts = ["-H", "localhost:1"]
    else:
        hosts = ["-H", "127.0.0.2:1", *request.getfixturevalue("sshd_clean").ssh_args()]
    worker = "import os, sys; sys.stdout.write('x' * 300_001); sys.stdout.flush(); os._exit(3)"
    r = job.run(["-np", "1", *hosts, "--no-warm-start"], [sys.executable, "-c", worker])
    assert "exited with code 3" in r.stderr, r.stderr[-3000:]
    pieces = [line for line in r.stdout.splitlines() if line.startswith("[0]<stdout>:")]
    assert "".join(p[len("[0]<stdout>:"):] for p in pieces) == "x" * 300_001, [p[:40] for p in pieces]
