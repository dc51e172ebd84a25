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
    (["-np", "1", "-H", "localhost", "-i", "/", "python", "x.py"], "-i /: not a regular file"),
    (["-np", "1", "-H", "localhost", "--ssh-known-hosts", "/dev/zero", "python", "x.py"],
     "--ssh-known-hosts /dev/zero: not a regular file"),
    # Paths the job would write, checked before anything starts.
    (["-np", "1", "-H", "localhost", "--events", "/proc/x/y", "python", "x.py"],
     "--events /proc/x/y: cannot create directory /proc/x: no such file or directory"),
    (["-np", "1", "-H", "localhost", "--output-filename", "/dev/null/out", "python", "x.py"],
     "--output-filename /dev/null/out: /dev/null is not a directory"),
    (["-np", "1", "-H", "localhost", "--events", "/", "python", "x.py"], "--events /: is a directory"),
])
def test_bad_arguments(args, expected):
    r = elasticrun(*args)
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], r.stderr


def test_a_fifo_no_one_finishes_writing_is_one_line_not_a_hang(tmp_path):
    """`--hostfile <(make_hosts)` reads a pipe; a FIFO whose writer never comes (or never closes
    it) used to block elasticrun for good before it said anything. (--config-file reads through
    the same function: tests/unit/test_paths.py, with a shorter wait.)"""
    import os

    flag = "--hostfile"
    fifo = tmp_path / "hosts"
    os.mkfifo(fifo)
    r = elasticrun("-np", "1", flag, str(fifo), "python", "x.py")
    assert r.returncode == 2, r
    assert r.stderr == (f"elasticrun: error: {flag} {fifo}: it did not end within 10 s (a pipe or FIFO that is "
                        f"never closed?) (see elasticrun --help)\n"), r.stderr


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
    from elasticrun.driver.cli.command import parse_settings

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


def test_unwritable_paths_are_refused_before_anything_starts(job, tmp_path):
    """Nothing runs (the command would leave a marker) and nothing is written."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    marker = tmp_path / "ran"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for flags, line in [
        (["--events", str(blocker / "events.jsonl")], f"--events {blocker}/events.jsonl: {blocker} is not a directory"),
        (["--output-filename", str(blocker / "logs")], f"--output-filename {blocker}/logs: {blocker} is not a directory"),
        (["--events", "/proc/x/y"], "--events /proc/x/y: cannot create directory /proc/x: no such file or directory"),
    ]:
        r = elasticrun("-np", "1", "-H", "localhost", *flags, *command)
        assert r.returncode == 2, r
        assert r.stderr == f"elasticrun: error: {line} (see elasticrun --help)\n"
    assert not marker.exists()
    # A missing directory is created, as the job would create it.
    out = tmp_path / "new" / "logs"
    r = job.run(["-np", "1", "-H", "localhost", "--output-filename", str(out)], command)
    assert r.returncode == 0, r.stderr
    assert marker.exists() and (out / "events.jsonl").exists()


def test_run_raises_the_same_message():
    import elasticrun

    with pytest.raises(ValueError, match=r"^--events /proc/x/y: cannot create directory /proc/x"):
        elasticrun.run(print, np=1, hosts="localhost:1", events="/proc/x/y")
    with pytest.raises(ValueError, match=r"host 'localhost' is listed twice"):
        elasticrun.run(print, np=1, hosts=["localhost:1", "localhost:1"])


@pytest.mark.parametrize("check", [False, True])
def test_a_binary_hostfile_is_one_line(tmp_path, check):
    hostfile = tmp_path / "hosts"
    hostfile.write_bytes(b"\x7fELF\xff\xfe\x00garbage\n")
    r = elasticrun(*(["--check"] if check else ["-np", "1"]), "--hostfile", str(hostfile), "python", "x.py")
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "line 1:" in lines[0] and "is not a valid host name" in lines[0], r.stderr


def test_ssh_files_others_could_change_or_read_are_refused(tmp_path):
    """The known-hosts file decides which servers get the job's keys and environment, and the
    private key is a secret: both are held to the rules of the files the job obeys (ssh's)."""
    ssh = ["-np", "1", "-H", "localhost", "--launcher", "ssh"]
    known = tmp_path / "known_hosts"
    known.write_text("")
    known.chmod(0o666)
    r = elasticrun(*ssh, "--ssh-known-hosts", str(known), "python", "x.py")
    assert r.returncode == 2, r
    assert r.stderr == (f"elasticrun: error: --ssh-known-hosts {known}: anyone may change it (mode 0666): "
                        f"chmod o-w {known} (see elasticrun --help)\n")
    key = tmp_path / "id"
    key.write_text("not a key\n")
    key.chmod(0o644)
    r = elasticrun(*ssh, "-i", str(key), "python", "x.py")
    assert r.returncode == 2, r
    assert r.stderr == (f"elasticrun: error: -i {key}: permissions 0644 are too open for a private key: "
                        f"chmod 600 {key} (see elasticrun --help)\n")


def test_workers_that_never_started_are_said_so_once_per_host(tmp_path):
    """A host whose name does not resolve: the reason once (not once per slot), and no made-up
    exit code for processes that never ran."""
    r = elasticrun("-np", "2", "-H", "nosuchhost.invalid:2", "python", "x.py")
    assert r.returncode == 1, r
    assert r.stderr.count("cannot tell which address of this machine its workers could reach") == 1, r.stderr
    assert "code 255" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1] == (
        "elasticrun: The job failed after " + r.stderr.splitlines()[-1].split("after ")[1].split(" s:")[0]
        + " s: all workers failed (nosuchhost.invalid[0] never started: no address of this machine to give it; "
        "nosuchhost.invalid[1] never started: no address of this machine to give it).")
