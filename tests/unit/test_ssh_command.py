"""The SSH launcher's pure parts and its remote bootstrap, run here without sshd.

The command line a remote shell runs is checked for quoting and for what it must never hold
(the environment, the keys, the user's command). The bootstrap is then run exactly as a
remote login shell would run it (``sh -c COMMAND`` with the payload on stdin), to check how the
environment and the keys arrive (the keys through a pipe, not the environment), what it
reports, and that it stops the worker's whole process group when its stdin closes (what
happens when the driver's SSH connection drops).
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from elasticrun.common.settings import JobSettings
from elasticrun.driver import cli, ssh

pytestmark = pytest.mark.timeout(60)

SECRET = "5ec7e7" * 10
KEYS = b'{"v": 1, "secret": "' + SECRET.encode() + b'"}'  # the bootstrap only passes the blob on
MARK = "@@elasticrun:test@@ "


# --- command construction and quoting ------------------------------------------------------------
@pytest.mark.parametrize("python", ["python3", "/opt/my python/bin/python3", "py'thon", "$(touch /tmp/x)"])
def test_remote_command_quotes_every_word(python):
    line = ssh.remote_command(python, "job1", "w7")
    words = shlex.split(line)
    assert words == ["exec", python, "-c", ssh._LOADER, "elasticrun-worker", "job1", "w7"]


def test_remote_command_holds_no_environment_secret_or_user_command():
    env = {"TOKEN": "hunter2"}
    payload = ssh.launch_payload(["python", "train.py", "--lr", "0.1"], env, "/work", 5.0, MARK, KEYS)
    line = ssh.remote_command("python3", "job1", "w1")
    for word in (SECRET, "hunter2", "train.py", "TOKEN", "/work"):
        assert word not in line
        assert word.encode() in payload
    assert len(line) < 200  # no "argument list too long", whatever the environment
    request = json.loads(payload.split(b"\n")[1])
    assert request["keys"] == KEYS.decode() and SECRET not in json.dumps(request["env"])


def test_payload_is_ascii_json_lines_and_keeps_odd_values_exact():
    odd = {"NEWLINES": "a\nb\r\nc", "QUOTES": "it's \"q\" `x` $(y)", "UNICODE": "héllo ✓",
           "SURROGATE": "bad\udcff byte", "EMPTY": ""}
    payload = ssh.launch_payload(["cmd"], odd, "/tmp", 1.0, MARK)
    payload.decode("ascii")  # the remote locale cannot garble it
    lines = payload.split(b"\n")
    assert len(lines) == 3 and lines[2] == b""  # exactly two lines, newline-terminated
    assert json.loads(lines[0]) == ssh._BOOTSTRAP
    assert json.loads(lines[1])["env"] == odd


def test_split_user():
    assert ssh.split_user("alice@node1", "bob") == ("alice", "node1")
    assert ssh.split_user("node1", "bob") == ("bob", "node1")
    assert ssh.split_user("node1")[0]  # the current user


@pytest.mark.parametrize("status,code", [(0, 0), (3, 3), (127, 127), (128, 128), (137, -9), (143, -15),
                                         (255, 255)])
def test_decode_exit_status(status, code):
    assert ssh.decode_exit_status(status) == code


def _settings(**kw) -> JobSettings:
    return JobSettings(command=["true"], np=1, min_np=1, max_np=1, **kw)


@pytest.mark.parametrize("mode,host,remote", [
    ("auto", "localhost", False), ("auto", "127.0.0.2", False), ("auto", "me@localhost", True),
    ("auto", "no-such-host.invalid", True), ("ssh", "localhost", True), ("local", "127.0.0.2", False),
])
def test_launcher_choice(mode, host, remote):
    launchers = ssh.Launchers(_settings(launcher=mode), sink=None, on_exit=lambda w, c: None)
    assert launchers.is_remote(host) is remote


def test_local_mode_refuses_a_remote_host():
    launchers = ssh.Launchers(_settings(launcher="local"), sink=None, on_exit=lambda w, c: None)
    with pytest.raises(OSError, match="not this machine"):
        launchers.launch("w1", ["true"], {}, host="no-such-host.invalid")


# --- command line flags ------------------------------------------------------------------------------
BASE = ["-np", "1", "-H", "localhost", "python", "train.py"]


def test_cli_ssh_defaults():
    s = cli.parse_settings(BASE)
    assert (s.launcher, s.ssh_port, s.ssh_user, s.ssh_identity_file, s.ssh_accept_unknown_hosts) == \
        ("auto", 22, None, None, False)
    assert s.forward_env and s.remote_python == "python3" and s.driver_address is None and s.extra_env == {}


def test_cli_ssh_flags(tmp_path, monkeypatch):
    key = tmp_path / "id"
    key.write_text("x")
    monkeypatch.setenv("FROM_HERE", "v1")
    s = cli.parse_settings(["--launcher", "ssh", "-p", "2222", "-i", str(key), "--ssh-user", "bob",
                            "--ssh-accept-unknown-hosts", "--remote-cwd", "/data", "-x", "FROM_HERE",
                            "--env", "SET=a=b", "--no-forward-env", "--network-interface", "lo", *BASE])
    assert (s.launcher, s.ssh_port, s.ssh_identity_file, s.ssh_user) == ("ssh", 2222, str(key), "bob")
    assert s.ssh_accept_unknown_hosts and s.remote_cwd == "/data" and not s.forward_env
    assert s.extra_env == {"FROM_HERE": "v1", "SET": "a=b"}
    assert s.driver_address == "127.0.0.1" and s.network_interface == "lo"
    assert s.command == ["python", "train.py"]


@pytest.mark.parametrize("args,expected", [
    (["-x", "NOT_SET_ANYWHERE_42"], "-x NOT_SET_ANYWHERE_42: NOT_SET_ANYWHERE_42 is not set here"),
    (["-x", "1BAD=x"], "not a valid environment variable name"),
    (["-i", "/nonexistent/key"], "-i /nonexistent/key: no such readable file"),
    (["--network-interface", "nosuch0"], "no network interface 'nosuch0'"),
    (["--driver-address", "203.0.113.7"], "cannot listen on 203.0.113.7"),
    (["--launcher", "rsh"], "invalid choice"),
])
def test_cli_ssh_errors(args, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_settings([*args, *BASE])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err


# --- the bootstrap, run as a remote shell would run it ---------------------------------------------
def _start(command: list[str], env: dict[str, str], cwd: str = "/", grace: float = 2.0,
           keys: bytes | None = None) -> subprocess.Popen:
    line = ssh.remote_command(sys.executable, "job1", "w1")
    proc = subprocess.Popen(["sh", "-c", line], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    proc.stdin.write(ssh.launch_payload(command, env, cwd, grace, MARK, keys))
    proc.stdin.flush()
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 30) -> tuple[bytes, bytes]:
    """Read everything without closing stdin (closing it is the driver-is-gone signal)."""
    try:
        out = proc.stdout.read()
        err = proc.stderr.read()
        proc.wait(timeout)
    finally:
        if proc.stdin and not proc.stdin.closed:
            proc.stdin.close()
    return out, err


def _reports(stdout: bytes) -> tuple[list[dict], list[str]]:
    reports, lines = [], []
    for line in stdout.decode().splitlines():
        if MARK in line:
            before, _, rest = line.partition(MARK)
            if before:
                lines.append(before)
            reports.append(json.loads(rest))
        else:
            lines.append(line)
    return reports, lines


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_bootstrap_delivers_env_and_cwd_without_command_line(tmp_path):
    code = ("import os,sys;"
            "from elasticrun.common import secretpipe;"
            "environ = open('/proc/%d/environ' % os.getpid(), 'rb').read();"
            "print(secretpipe.receive().decode(), os.environ['ODD'], os.getcwd(), os.environ['PWD'], sep='|');"
            f"print({SECRET!r}.encode() in environ, 'ELASTICRUN_SECRET_FD' in os.environ);"
            "sys.stdout.flush();"
            "print(repr(open('/proc/%d/cmdline' % os.getppid(), 'rb').read()));"
            "print(os.getpgrp() == os.getpid(), os.getpgrp() != os.getpgid(os.getppid()));"
            "sys.exit(3)")
    env = {"ODD": "a b'c\"$(x)", "PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = _start([sys.executable, "-c", code], env, cwd=str(tmp_path), keys=KEYS)
    out, err = _finish(proc)
    reports, lines = _reports(out)
    assert proc.returncode == 3, err
    assert lines[0] == f"{KEYS.decode()}|a b'c\"$(x)|{tmp_path}|{tmp_path}"  # the keys came through the pipe
    assert lines[1] == "False False"  # not in the worker's environment, and the pipe's number is gone once read
    assert SECRET not in lines[2] and "elasticrun-worker" in lines[2]  # the watchdog's command line
    assert lines[3] == "True True"  # the worker leads its own process group, apart from the watchdog
    assert "pid" in reports[0] and reports[0]["pgid"] == reports[0]["pid"]
    assert reports[-1] == {"exit": 3}


def test_bootstrap_reports_a_signal_death():
    proc = _start(["sh", "-c", "kill -9 $$"], {"PATH": os.environ["PATH"]})
    out, _ = _finish(proc)
    assert _reports(out)[0][-1] == {"exit": -9}
    assert ssh.decode_exit_status(proc.returncode) == -9


def test_bootstrap_command_not_found():
    proc = _start(["no-such-command-xyz", "--flag"], {"PATH": "/usr/bin:/bin"})
    out, _ = _finish(proc)
    (report,), _ = _reports(out)
    assert proc.returncode == 127
    assert report["error"] == "not_found"
    assert "command not found: no-such-command-xyz" in report["detail"] and "/usr/bin:/bin" in report["detail"]


def test_bootstrap_missing_working_directory():
    proc = _start(["true"], {}, cwd="/nonexistent/dir")
    out, _ = _finish(proc)
    (report,), _ = _reports(out)
    assert proc.returncode == 126 and report["error"] == "cwd"
    assert "cannot change to directory /nonexistent/dir: No such file or directory" in report["detail"]


def test_missing_python_is_the_shells_127():
    line = ssh.remote_command("/nonexistent/python3", "job1", "w1")
    r = subprocess.run(["sh", "-c", line], input=b"", capture_output=True, timeout=30)
    assert r.returncode == 127 and r.stdout == b""


@pytest.mark.parametrize("how", ["stdin EOF", "SIGTERM to the watchdog"])
def test_bootstrap_kills_the_whole_group_when_the_driver_goes(how, tmp_path):
    """EOF on stdin is what the watchdog sees when the driver's connection drops."""
    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $! > {pids}.tmp; sh -c 'sleep 300' & echo $! >> {pids}.tmp; mv {pids}.tmp {pids}; wait"
    proc = _start(["sh", "-c", script], {"PATH": os.environ["PATH"]}, grace=2.0)
    deadline = time.monotonic() + 20
    while not pids.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    children = [int(p) for p in pids.read_text().split()]
    assert all(_alive(p) for p in children)
    started = time.monotonic()
    if how == "stdin EOF":
        proc.stdin.close()
    else:
        os.kill(proc.pid, signal.SIGTERM)
    out, _ = _finish(proc, 20)
    elapsed = time.monotonic() - started
    assert not any(_alive(p) for p in children)
    assert elapsed < 2.0, elapsed  # SIGTERM is enough for these; SIGKILL only after the grace
    assert _reports(out)[0][-1] == {"exit": -15}
    assert proc.returncode == 128 + 15
