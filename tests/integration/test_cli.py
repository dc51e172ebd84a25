"""Bad command lines fail at once with one clear line and exit code 2 (no job starts)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(60)


def elasticrun(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elasticrun", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("args,expected", [
    (["-np", "2", "--min-np", "3", "-H", "localhost:4", "python", "x.py"], "--min-np 3 is more than -np 2"),
    (["-np", "4", "--max-np", "2", "-H", "localhost:4", "python", "x.py"], "--max-np 2 is less than -np 4"),
    (["-np", "2", "-H", "localhost:2"], "missing the training command"),
    (["-np", "2", "-H", "localhost:x", "python", "x.py"], "slots 'x' is not a whole number"),
    (["-np", "2", "-H", "bad host", "python", "x.py"], "is not a valid host name"),
    (["-np", "2", "--host-discovery-script", "/nonexistent/discover.sh", "python", "x.py"], "no such file"),
    (["-np", "0", "-H", "localhost", "python", "x.py"], "must be at least 1"),
    (["-np", "3", "-H", "localhost:2", "python", "x.py"], "-np 3 needs 3 slots"),
    (["python", "x.py"], "required"),
    (["-np", "2", "-H", "localhost:2", "--blacklist-cooldown-range", "5", "1", "python", "x.py"],
     "LOW is more than HIGH"),
    # A host twice, absurd counts: refused, not silently merged or waited for.
    (["-np", "2", "-H", "localhost:1,localhost:2", "python", "x.py"], "host 'localhost' is listed twice"),
    (["-np", "1", "-H", "localhost:99999999999999999999", "python", "x.py"], "a host has at most 1024 slots"),
    (["-np", "1", "-H", "localhost", "--slots-per-host", "1025", "python", "x.py"],
     "--slots-per-host 1025: a host has at most 1024 slots"),
    (["-np", "1", "-H", "localhost", "--slots-per-host", "99999999999999999999", "python", "x.py"],
     "must be at most 1,000,000"),
    (["-np", "99999999999999999999", "-H", "localhost", "python", "x.py"], "must be at most 1,000,000"),
    (["-np", "1", "--min-np", "1000001", "-H", "localhost", "python", "x.py"], "must be at most 1,000,000"),
    (["-np", "1", "--max-np", "2000000", "-H", "localhost", "python", "x.py"], "must be at most 1,000,000"),
    (["-np", "1", "--hostfile", "/dev/zero", "python", "x.py"], "--hostfile /dev/zero: more than 1 MiB"),
])
def test_bad_arguments(args, expected):
    r = elasticrun(*args)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], r.stderr


def test_non_executable_discovery_script(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost\n")
    script.chmod(0o644)
    r = elasticrun("-np", "1", "--host-discovery-script", str(script), "python", "x.py")
    assert r.returncode == 2 and "not executable" in r.stderr


def test_long_aliases_and_module_entry_point():
    r = elasticrun("--num-proc", "2", "--min-num-proc", "1", "--max-num-proc", "3", "--help")
    assert r.returncode == 0 and "--host-discovery-script" in r.stdout


def test_horovodrun_spellings(tmp_path):
    """horovodrun's single-dash -hostfile and its TRACE / FATAL log levels are accepted."""
    from elasticrun.driver.cli import parse_settings

    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    s = parse_settings(["-np", "2", "-hostfile", str(hostfile), "--log-level", "trace", "python", "x.py"])
    assert s.hosts == {"localhost": 2} and s.log_level == "DEBUG"
    s = parse_settings(["-np", "2", "-H", "localhost:2", "--log-level", "FATAL", "python", "x.py"])
    assert s.log_level == "CRITICAL" and s.worker_log_level == "CRITICAL"


def test_a_host_twice_in_a_hostfile(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=1\n127.0.0.1\nlocalhost:2\n")
    r = elasticrun("-np", "1", "--hostfile", str(hostfile), "python", "x.py")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"elasticrun: error: {hostfile} line 3: host 'localhost' is listed twice (first on line 1) "
        f"(see elasticrun --help)"]


def test_run_raises_the_same_message():
    import elasticrun

    with pytest.raises(ValueError, match=r"host 'localhost' is listed twice"):
        elasticrun.run(print, np=1, hosts=["localhost:1", "localhost:1"])
