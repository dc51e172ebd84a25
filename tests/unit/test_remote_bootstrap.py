"""The remote bootstrap (elasticrun/driver/launch/remote_bootstrap.py), here without sshd.

First its rules (Python 3.6 syntax, standard library only, nothing of elasticrun: it runs in
whatever ``--remote-python`` is) and its pieces, imported and called directly. Then the whole
thing run exactly as a remote login shell runs it (``sh -c COMMAND`` with the payload on
stdin), to check how the environment and the keys arrive (the keys through a pipe, not the
environment), what it reports, and that it stops the worker's whole process group when its
stdin closes (what happens when the driver's SSH connection drops).
"""

from __future__ import annotations

import ast
import importlib.resources
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from elasticrun.common import env as envvars
from elasticrun.driver.launch import remote_bootstrap as rb
from elasticrun.driver.launch import ssh

pytestmark = pytest.mark.timeout(60)

SECRET = "5ec7e7" * 10
KEYS = b'{"v": 1, "secret": "' + SECRET.encode() + b'"}'  # the bootstrap only passes the blob on
MARK = "@@elasticrun:test@@ "
SOURCE = Path(rb.__file__).read_text(encoding="utf-8")


# --- its rules ------------------------------------------------------------------------------------
def test_it_is_what_the_ssh_launcher_sends():
    assert ssh.bootstrap_source() == SOURCE
    assert importlib.resources.files("elasticrun.driver.launch").joinpath("remote_bootstrap.py").is_file()
    assert json.loads(ssh.launch_payload(["true"], {}, "/", 1.0, MARK).split(b"\n")[0]) == SOURCE


def test_it_is_python_3_6_ascii_and_standard_library_only():
    SOURCE.encode("ascii")
    tree = ast.parse(SOURCE, feature_version=(3, 6))  # no walrus, no positional-only parameters, ...
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module}
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names
    assert not any(isinstance(node, ast.ImportFrom) and node.module == "__future__" for node in ast.walk(tree))
    # Annotations are evaluated at definition time in 3.6: no list[int], no int | None.
    annotations = [n.annotation for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.AnnAssign)) and n.annotation]
    annotations += [n.returns for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.returns]
    for annotation in annotations:
        for node in ast.walk(annotation):
            assert not isinstance(node, ast.BinOp), ast.unparse(annotation)
            assert not (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name)
                        and node.value.id in {"list", "dict", "tuple", "set", "frozenset", "type"}), \
                ast.unparse(annotation)


def test_it_runs_as_the_loaders_main_only_and_its_names_match_elasticruns():
    """Importing it (as this file does) runs nothing; the loader runs it as __main__."""
    assert rb.SECRET_FD == envvars.SECRET_FD
    # It then reads its request from stdin: here there is none.
    r = subprocess.run([sys.executable, "-c", ssh.LOADER], input=json.dumps(SOURCE) + "\n", capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 125 and "JSONDecodeError" in r.stderr  # run() reports a bug as 125


# --- its pieces -----------------------------------------------------------------------------------
def test_reporter_writes_marked_json_lines_and_never_raises():
    out = io.StringIO()
    report = rb.reporter(MARK, out)
    report(pid=5, pgid=5)
    report(exit=-9)
    assert out.getvalue() == MARK + '{"pid": 5, "pgid": 5}\n' + MARK + '{"exit": -9}\n'
    out.close()
    report(exit=0)  # the driver is gone: nothing to say it to, and no exception either


def test_worker_env_overlays_the_login_environment_without_a_key_pipe():
    login = {"PATH": "/usr/bin", "HOME": "/home/u", envvars.SECRET_FD: "7"}
    sent = {"PATH": "/opt/bin:/usr/bin", "RANK": "1", envvars.SECRET_FD: "9"}
    assert rb.worker_env(login, sent) == {"PATH": "/opt/bin:/usr/bin", "HOME": "/home/u", "RANK": "1"}


def test_enter_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    env: dict[str, str] = {}
    assert rb.enter_directory("sub", env) is None
    assert os.getcwd() == env["PWD"] == str(tmp_path / "sub")  # a relative one: PWD is absolute
    assert rb.enter_directory(str(tmp_path), env) is None and env["PWD"] == str(tmp_path)
    assert rb.enter_directory("/nonexistent/dir", env) == \
        "cannot change to directory /nonexistent/dir: No such file or directory"
    assert os.getcwd() == str(tmp_path)


def test_find_command(tmp_path):
    script = tmp_path / "plain"
    script.write_text("")
    assert rb.find_command("sh", "/nonexistent:/bin:/usr/bin")[0] in ("/bin/sh", "/usr/bin/sh")
    assert rb.find_command("no-such-cmd", "/bin") == (None, "command not found: no-such-cmd (searched PATH=/bin)")
    assert rb.find_command(str(script), "/bin") == (None, f"{script}: not executable")
    assert rb.find_command("/nonexistent/x", "/bin") == (None, "/nonexistent/x: no such file")


@pytest.mark.parametrize("status,code", [(0, 0), (3 << 8, 3), (255 << 8, 255), (9, -9), (15, -15)])
def test_exit_code(status, code):
    assert rb.exit_code(status) == code


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def test_spawn_holds_the_worker_in_its_own_group_until_released(tmp_path):
    out = tmp_path / "out"
    script = f'echo "$GREETING $(cat /dev/fd/$ELASTICRUN_SECRET_FD)" > {out}; exit 3'
    pid, gate, errors = rb.spawn("/bin/sh", ["sh", "-c", script], {"GREETING": "hi", "PATH": "/bin:/usr/bin"},
                                 KEYS.decode())
    try:
        assert os.getpgid(pid) == pid != os.getpgrp()  # its own group, before it runs anything
        time.sleep(0.2)
        assert not out.exists()  # held at the gate
        assert rb.release(gate, errors) == b""
        assert rb.exit_code(os.waitpid(pid, 0)[1]) == 3
        assert out.read_text() == f"hi {KEYS.decode()}\n"
    finally:
        _kill_group(pid)


def test_spawn_reports_a_failed_exec(tmp_path):
    plain = tmp_path / "plain"
    plain.write_text("")
    pid, gate, errors = rb.spawn(str(plain), [str(plain)], {}, None)
    try:
        assert rb.release(gate, errors) == f"{plain}: Permission denied".encode()
        assert rb.exit_code(os.waitpid(pid, 0)[1]) == 127
    finally:
        _kill_group(pid)


class _Watch:
    """watch() on a real worker, with a pipe standing for the driver's SSH channel."""

    def __init__(self, script: str, tmp_path: Path, grace: float = 2.0):
        self.pids = tmp_path / "pids"
        self.driver_r, self.driver_w = os.pipe()
        self.stop = threading.Event()
        self.pid, gate, errors = rb.spawn("/bin/sh", ["sh", "-c", script], {"PATH": os.environ["PATH"]}, None)
        assert rb.release(gate, errors) == b""
        self.grace = grace

    def children(self) -> list[int]:
        _wait_for(self.pids.exists, 10, "the worker's children")
        return [int(p) for p in self.pids.read_text().split()]

    def run(self) -> tuple[int | None, float]:
        started = time.monotonic()
        status = rb.watch(self.pid, self.grace, self.stop, driver_fd=self.driver_r)
        return status, time.monotonic() - started

    def close(self) -> None:
        _kill_group(self.pid)
        if self.driver_w >= 0:
            os.close(self.driver_w)  # EOF: watch's reader thread ends
        reader = [t for t in threading.enumerate() if t.name == "bootstrap-driver"]
        for t in reader:
            t.join(5)
        assert not any(t.is_alive() for t in reader)
        os.close(self.driver_r)


def _sleepers(pids: Path) -> str:
    return f"sleep 300 & echo $! > {pids}.tmp; mv {pids}.tmp {pids}"


def test_watch_reaps_a_worker_that_exits_and_kills_its_leftover_children(tmp_path):
    w = _Watch(_sleepers(tmp_path / "pids") + "; exit 5", tmp_path)
    try:
        child, = w.children()
        status, elapsed = w.run()
        assert rb.exit_code(status) == 5 and elapsed < 2
        _wait_for(lambda: not _alive(child), 2, "the orphaned sleep to die")
    finally:
        w.close()


@pytest.mark.parametrize("how", ["driver gone", "asked to stop"])
def test_watch_stops_the_whole_group(how, tmp_path):
    w = _Watch(_sleepers(tmp_path / "pids") + "; wait", tmp_path)
    try:
        child, = w.children()
        if how == "driver gone":
            os.close(w.driver_w)  # what the SSH connection dropping looks like
            w.driver_w = -1
        else:
            threading.Timer(0.1, w.stop.set).start()  # what SIGTERM/SIGINT/SIGHUP do
        status, elapsed = w.run()
        assert rb.exit_code(status) == -15 and elapsed < 2  # SIGTERM was enough
        assert not _alive(child)
    finally:
        w.close()


def test_watch_kills_after_the_grace_period(tmp_path):
    w = _Watch("trap '' TERM; " + _sleepers(tmp_path / "pids") + "; wait", tmp_path, grace=0.5)
    try:
        child, = w.children()
        w.stop.set()
        status, elapsed = w.run()
        assert rb.exit_code(status) == -9 and 0.5 <= elapsed < 3
        assert not _alive(child)
    finally:
        w.close()


# A worker that takes 1 s to leave once told (as an elastic worker runs on to its next commit).
def _leaves_in_a_second(pids: Path) -> str:
    return "trap 'sleep 1; exit 3' TERM; " + _sleepers(pids) + "; wait"


@pytest.mark.parametrize("signalled,driver_goes,code", [
    (True, False, 3),  # the host is going: the worker's leave is let finish
    (False, False, -9),  # the driver's stop: the grace only
    (True, True, -9),  # signalled, then the driver is gone: no leave can complete
])
def test_a_signalled_watchdog_waits_for_the_workers_leave_up_to_its_sigterm_grace(
        signalled, driver_goes, code, tmp_path):
    w = _Watch(_leaves_in_a_second(tmp_path / "pids"), tmp_path, grace=0.3)
    marked = threading.Event()
    try:
        w.children()  # its trap is set
        if signalled:
            marked.set()
        w.stop.set()
        if driver_goes:
            threading.Timer(0.1, os.close, args=(w.driver_w,)).start()
            w.driver_w = -1
        started = time.monotonic()
        status = rb.watch(w.pid, w.grace, w.stop, driver_fd=w.driver_r, leave=5.0, signalled=marked)
        elapsed = time.monotonic() - started
        assert rb.exit_code(status) == code
        assert elapsed < (3 if code == 3 else 0.9), elapsed
    finally:
        w.close()


def test_leave_seconds_is_the_workers_sigterm_grace_or_nothing():
    assert rb.SIGTERM_GRACE == envvars.SIGTERM_GRACE
    assert rb.leave_seconds({rb.SIGTERM_GRACE: "20.0"}) == 20.0
    for bad in ({}, {rb.SIGTERM_GRACE: "soon"}, {rb.SIGTERM_GRACE: "-1"}, {rb.SIGTERM_GRACE: "inf"},
                {rb.SIGTERM_GRACE: "nan"}):
        assert rb.leave_seconds(bad) == 0.0


def test_a_watchdog_signalled_with_its_worker_lets_it_leave(tmp_path):
    """A spot host going down signals every process: the watchdog and its worker. The worker's
    SIGTERM is notice to leave at its next commit; the watchdog waits for that up to the worker's
    --sigterm-grace, instead of SIGKILLing it after the stop grace (a leave turned into a
    rollback)."""
    ready = tmp_path / "ready"
    env = {"PATH": os.environ["PATH"], envvars.SIGTERM_GRACE: "5"}
    proc = _start(["sh", "-c", f"trap 'sleep 1; exit 3' TERM; touch {ready}; sleep 300 & wait"], env, grace=0.3)
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGTERM)
    out, _ = _finish(proc, 20)
    assert _reports(out)[0][-1] == {"exit": 3}
    assert proc.returncode == 3


def test_main_reports_why_it_cannot_start_the_worker(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    request = {"mark": MARK, "env": {"PATH": "/bin"}, "cwd": "/nonexistent", "grace": 1, "command": ["true"]}
    out = io.StringIO()
    assert rb.main(io.StringIO(json.dumps(request) + "\n"), out) == 126
    assert out.getvalue().startswith(MARK + '{"error": "cwd", "detail": "cannot change to directory /nonexistent')
    out = io.StringIO()
    request.update(cwd=str(tmp_path), command=["no-such-cmd"])
    assert rb.main(io.StringIO(json.dumps(request) + "\n"), out) == 127
    assert json.loads(out.getvalue().partition(MARK)[2]) == {
        "error": "not_found", "detail": "command not found: no-such-cmd (searched PATH=/bin)"}


# --- the whole bootstrap, run as a remote shell would run it --------------------------------------
def _start(command: list[str], env: dict[str, str], cwd: str = "/", grace: float = 2.0,
           keys: bytes | None = None, notice: bool = False) -> subprocess.Popen:
    line = ssh.remote_command(sys.executable, "job1", "w1")
    proc = subprocess.Popen(["sh", "-c", line], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    proc.stdin.write(ssh.launch_payload(command, env, cwd, grace, MARK, keys, notice=notice))
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


def test_a_worker_never_outlives_a_watchdog_killed_with_sigkill(tmp_path):
    """No handler runs on SIGKILL (the OOM killer, an agent torn down): the worker must go too."""
    ready = tmp_path / "ready"
    proc = _start(["sh", "-c", f"touch {ready}; exec sleep 300"], {"PATH": os.environ["PATH"]})
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    line = proc.stdout.readline().decode()
    worker = json.loads(line.partition(MARK)[2])["pid"]
    assert _alive(worker)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 5
    while _alive(worker):
        assert time.monotonic() < deadline, "the worker outlived its watchdog"
        time.sleep(0.02)


def test_the_notice_layout_is_the_workers():
    from elasticrun.common import deathnotice

    assert (rb.DEATH_FD, rb.NOTICE_BYTES, rb.NOTICE_MUTEX_AT, rb.NOTICE_SEM_AT, rb.NOTICE_PID_AT,
            rb.NOTICE_STOP_AT) == (
        envvars.DEATH_FD, deathnotice.NOTICE_BYTES, deathnotice.NOTICE_MUTEX_AT, deathnotice.NOTICE_SEM_AT,
        deathnotice.NOTICE_PID_AT, deathnotice.NOTICE_STOP_AT)


ARM_AND = ("import os, sys; from elasticrun.common import deathnotice; "
           "print(deathnotice.arm_from_environment(), os.environ.get('ELASTICRUN_DEATH_FD')); sys.stdout.flush(); ")


@pytest.mark.skipif(rb.notice_libc() is None, reason="needs Linux and glibc >= 2.30")
@pytest.mark.parametrize("then, dying, code", [("os.kill(os.getpid(), 9)", [-9], -9), ("sys.exit(0)", [], 0),
                                               ("os._exit(4)", [4], 4)])
def test_the_watchdog_reports_a_dying_worker_before_its_exit(then, dying, code):
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = _start([sys.executable, "-c", ARM_AND + then], env, notice=True)
    out, err = _finish(proc)
    reports, lines = _reports(out)
    assert lines == ["True None"], err  # armed; the descriptor's number gone from its environment
    said = [r["dying"] for r in reports if "dying" in r]
    assert said == dying
    assert reports[-1] == {"exit": code}  # and the watchdog's own report after it, as before


@pytest.mark.skipif(rb.notice_libc() is None, reason="needs Linux and glibc >= 2.30")
@pytest.mark.parametrize("how, watchers_own", [("driver gone", True), ("watchdog signalled", False)])
def test_the_watchdog_says_when_its_sigterm_is_its_own(how, watchers_own, tmp_path):
    """An SSH session lost closes the watchdog's channel: it stops the worker, and says first, in
    the notice, that this SIGTERM is its own (the worker must not report its machine going).
    A watchdog signalled itself (the machine going signals every process) says nothing."""
    ready = tmp_path / "ready"
    worker = (ARM_AND + "import signal, time; "
              "signal.signal(signal.SIGTERM, lambda *a: (print('own', deathnotice.stopped_by_watcher()), "
              "sys.stdout.flush(), os._exit(7))); "
              f"open({str(ready)!r}, 'w').close(); time.sleep(60)")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = _start([sys.executable, "-c", worker], env, notice=True)
    deadline = time.monotonic() + 20
    while not ready.exists():
        assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
        time.sleep(0.02)
    if how == "driver gone":
        proc.stdin.close()  # what the SSH connection dropping looks like
    else:
        os.kill(proc.pid, signal.SIGTERM)
    out, err = _finish(proc)
    reports, lines = _reports(out)
    assert lines == ["True None", f"own {watchers_own}"], (lines, err)
    assert reports[-1] == {"exit": 7}


SIGTERMED_WORKER = """
import ctypes, os, signal, sys, threading, time, types
from elasticrun.common import deathnotice
from elasticrun.worker import runtime
page = ctypes.create_string_buffer(deathnotice.NOTICE_BYTES)  # stands for the notice the worker armed
deathnotice._armed = ctypes.addressof(page)
if sys.argv[1] == "watchdog":
    page[deathnotice.NOTICE_STOP_AT] = b"\\x01"


class Control:
    def post(self, kind, body):
        print("posted", kind, body["why"], flush=True)


rt = types.SimpleNamespace(hostname="h", slot=0, worker_id="w1", _driver_stopping=False, _control=Control(),
                           _leaving=None, _leaving_heard=threading.Event())
rt._leaving_heard.set()  # the driver answers the leave
runtime._install_sigterm(rt)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(2)
print("still here", flush=True)
"""


@pytest.mark.parametrize("sender", ["watchdog", "machine"])
def test_a_worker_reports_leaving_only_for_a_sigterm_that_is_not_its_watchdogs(sender):
    """The worker's SIGTERM handler (runtime._install_sigterm): a SIGTERM its SSH watchdog said
    is its own (the driver's connection lost) stops it at once, unreported; any other is the
    machine going: it tells the driver it leaves at its next step, and trains on meanwhile."""
    r = subprocess.run([sys.executable, "-c", SIGTERMED_WORKER, sender], capture_output=True, text=True, timeout=60,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    if sender == "watchdog":
        assert r.returncode == 128 + signal.SIGTERM and r.stdout == "", (r.stdout, r.stderr)
        assert "the SSH watchdog over this worker lost its connection to the driver and stops it" in r.stderr
    else:
        assert r.returncode == 0 and r.stdout == "posted leaving SIGTERM\nstill here\n", (r.stdout, r.stderr)
        assert "SIGTERM: leaving the job at its next commit" in r.stderr


def test_without_a_notice_asked_for_the_worker_has_none():
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path),
           "ELASTICRUN_DEATH_FD": "0"}  # forwarded from somewhere: never passed on
    proc = _start([sys.executable, "-c", ARM_AND], env)
    out, err = _finish(proc)
    reports, lines = _reports(out)
    assert lines == ["False None"], err
    assert not any("dying" in r for r in reports)


# --- what a worker leaves outside its process group -------------------------------------------------
def _escaped(env: dict[str, str]) -> int:
    """A sleep in a session of its own (no signal to the worker's group reaches it), with ``env``.
    (Popen returns after the child's exec, so its setsid() has happened: a shell's `setsid sleep &`
    may not have called it yet when the shell exits.)"""
    p = subprocess.Popen(["sleep", "300"], env=dict(os.environ, **env), start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return p.pid


def test_the_ids_named_in_a_workers_environment_are_elasticruns():
    assert (rb.JOB_ID, rb.WORKER_ID) == (envvars.JOB_ID, envvars.WORKER_ID)


def test_a_sweep_stops_what_the_worker_left_in_a_session_of_its_own_and_nothing_else():
    mine = _escaped({rb.JOB_ID: "job1", rb.WORKER_ID: "w3"})
    other_worker = _escaped({rb.JOB_ID: "job1", rb.WORKER_ID: "w33"})
    other_job = _escaped({rb.JOB_ID: "job2", rb.WORKER_ID: "w3"})
    try:
        assert rb.left_behind("job1", "w3") == [mine]
        stopped = rb.sweep("job1", "w3")
        assert stopped == [(mine, "sleep 300")]
        _wait_for(lambda: not _alive(mine), 5, "the escaped sleep to die")
        assert _alive(other_worker) and _alive(other_job)
        assert rb.sweep(None, "w3") == [] and rb.sweep("job1", None) == []
        line = rb.said_swept(stopped)
        assert line.startswith("stopped 1 process(es)") and f"{mine} (sleep 300)" in line
    finally:
        for pid in (mine, other_worker, other_job):
            _kill_group(pid)  # (each leads a session, and so a group, of its own)


def test_the_watchdog_stops_what_its_worker_left_in_a_session_of_its_own_and_says_so(tmp_path):
    pids = tmp_path / "pids"
    env = {"PATH": os.environ["PATH"], rb.JOB_ID: "jobx", rb.WORKER_ID: "w1"}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    # The sleep has called setsid() before the worker exits (Popen returns after its exec): with
    # a shell's `setsid sleep &` it may not have, and then the group's SIGKILL takes it.
    worker = ("import subprocess, sys; p = subprocess.Popen(['sleep', '300'], start_new_session=True, "
              "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
              f"open({str(pids)!r}, 'w').write(str(p.pid)); sys.exit(4)")
    proc = _start([sys.executable, "-c", worker], env)
    out, err = _finish(proc)
    escaped = int(pids.read_text())
    try:
        assert _reports(out)[0][-1] == {"exit": 4}
        _wait_for(lambda: not _alive(escaped), 5, "the escaped sleep to die")
    finally:
        _kill_group(escaped)  # (left running if the watchdog did not sweep it)
    assert f"stopped 1 process(es) the worker left running outside its process group (started in a new " \
           f"session): {escaped} (sleep 300)" in err.decode(), err


# --- the job's reaper on the driver's machine -----------------------------------------------------
def _reaper(job_id: str, grace: float) -> subprocess.Popen:
    """The reaper as the local launcher starts it (its stdin the driver's pipe)."""
    proc = subprocess.Popen([sys.executable, "-I", "-S", rb.__file__], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(json.dumps({"reap": {"job": job_id, "grace": grace}}).encode() + b"\n")
    proc.stdin.flush()
    return proc


def test_a_reaper_told_the_job_is_done_leaves_everything_alone():
    mine = _escaped({rb.JOB_ID: "jobr1", rb.WORKER_ID: "w1"})
    try:
        reaper = _reaper("jobr1", 1.0)
        _, err = reaper.communicate(rb.REAPER_DONE.encode(), timeout=10)
        assert reaper.returncode == 0 and err == b"", err
        assert _alive(mine)
    finally:
        _kill_group(mine)


def test_a_reaper_whose_driver_died_stops_the_jobs_processes_here_and_only_them():
    """EOF without 'done': the driver died (SIGKILL). A worker (a group leader with a child that
    does not carry the job's ids), what it left in a session of its own, and one that ignores
    SIGTERM (killed after the grace) all stop; another job's process does not."""
    worker = subprocess.Popen(["sh", "-c", "env -i sleep 301 & exec sleep 302"], start_new_session=True,
                              env=dict(os.environ, **{rb.JOB_ID: "jobr2", rb.WORKER_ID: "w1"}))
    escaped = _escaped({rb.JOB_ID: "jobr2", rb.WORKER_ID: "w2"})
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print(flush=True); time.sleep(300)"], stdout=subprocess.PIPE,
                                env=dict(os.environ, **{rb.JOB_ID: "jobr2", rb.WORKER_ID: "w3"}))
    other_job = _escaped({rb.JOB_ID: "jobr3", rb.WORKER_ID: "w1"})
    assert stubborn.stdout is not None and stubborn.stdout.readline() == b"\n"  # SIGTERM ignored from now on
    try:
        def started() -> list[str]:
            return [p for p in os.listdir("/proc") if p.isdigit() and rb.command_of(int(p)) == "sleep 301"]

        _wait_for(lambda: rb.command_of(worker.pid) == "sleep 302" and started(), 5, "the worker and its child")
        child = started()
        _wait_for(lambda: rb.left_behind("jobr2", "w1") == [worker.pid], 5, "the child's exec (env -i)")
        assert len(child) == 1 and os.getpgid(int(child[0])) == worker.pid  # its group's, not the job's
        reaper = _reaper("jobr2", 0.5)
        started = time.monotonic()
        _, err = reaper.communicate(b"", timeout=20)  # EOF: the driver is gone
        took = time.monotonic() - started
        assert reaper.returncode == 0
        for pid in (worker.pid, int(child[0]), escaped, stubborn.pid):
            _wait_for(lambda: not _alive(pid), 5, f"{pid} to die")
        assert worker.wait(5) == -signal.SIGTERM and stubborn.wait(5) == -signal.SIGKILL
        assert _alive(other_job)
        assert 0.5 <= took < 10, took  # the grace, for the stubborn one
        line = err.decode()
        assert line.startswith(f"elasticrun: the driver (pid {os.getpid()}) ended without stopping job jobr2; "
                               "stopped the 3 process(es) it left on this machine: "), line
        assert f"{escaped} (sleep 300)" in line and f"{worker.pid} (sleep 302)" in line, line
        assert line.count("\n") == 1
    finally:
        for pid in (worker.pid, escaped, stubborn.pid, other_job):
            _kill_group(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in (worker, stubborn):
            p.wait(5)


def test_a_reaper_with_nothing_to_stop_says_nothing():
    reaper = _reaper("jobr4-nothing", 1.0)
    _, err = reaper.communicate(b"", timeout=10)
    assert reaper.returncode == 0 and err == b""
