"""A worker's death is heard before the kernel has torn it down (elasticrun/common/deathnotice.py).

Real processes: a child arms the notice as ``hvd.init()`` does, and dies in the ways workers die.
"Before it is reaped" is checked on a child holding 1 GiB of written memory, whose release takes
the kernel tens of milliseconds after the notice (0.2-0.5 ms after the kill) has been given.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from elasticrun.common import deathnotice
from elasticrun.common import env as envvars
from elasticrun.driver.launch import remote_bootstrap as rb
from elasticrun.driver.launch import warm
from elasticrun.driver.launch.local import LocalLauncher

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(rb.notice_libc() is None, reason="needs Linux and glibc >= 2.30")]

ARM = textwrap.dedent("""\
    import os, sys, time
    from elasticrun.common import deathnotice
    big = b"x" * (int(os.environ.get("HOLD_MB", "0")) << 20)  # written: the kernel must release it
    armed = deathnotice.arm_from_environment()
    sys.stdout.write("armed\\n" if armed else "not armed\\n")
    sys.stdout.flush()
    if os.environ.get("ARMED_FILE"):
        open(os.environ["ARMED_FILE"], "w").write(str(armed))
    how = os.environ.get("HOW", "sleep")
    if how == "sleep":
        sys.stdin.read()
    elif how == "block":  # the launcher's workers have /dev/null as stdin
        time.sleep(120)
    elif how == "exec":
        os.execv(sys.executable, [sys.executable, "-c", "import sys; sys.stdin.read()"])
    elif how == "exit0":
        sys.exit(0)
    else:
        os._exit(int(how))
""")


def _start(notice: rb.DeathNotice | None, **env: str) -> subprocess.Popen:
    environ = dict(os.environ, **env)
    fds: tuple[int, ...] = ()
    if notice is not None:
        assert notice.fd is not None
        environ[envvars.DEATH_FD] = str(notice.fd)
        fds = (notice.fd,)
    p = subprocess.Popen([sys.executable, "-c", ARM], env=environ, pass_fds=fds, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    if notice is not None:
        notice.close_fd()
    return p


class Waiter:
    """``Notice.wait`` on a thread, with the moment it returned."""

    def __init__(self, notice: rb.DeathNotice, p: subprocess.Popen):
        self.code: int | None = None
        self.at: float | None = None
        self.done = threading.Event()
        self._t = threading.Thread(target=self._run, args=(notice, p), daemon=True)
        self._t.start()

    def _run(self, notice: rb.DeathNotice, p: subprocess.Popen) -> None:
        self.code = notice.wait(p.pid, lambda: p.returncode is not None)
        self.at = time.monotonic()
        self.done.set()

    def join(self, timeout: float = 20) -> None:
        assert self.done.wait(timeout), "the notice's wait did not end"
        self._t.join(timeout)


def test_a_killed_worker_is_heard_of_before_it_can_be_reaped():
    notice = rb.DeathNotice.create()
    assert notice is not None
    p = _start(notice, HOLD_MB="1024")
    try:
        assert p.stdout.readline() == "armed\n"
        w = Waiter(notice, p)
        os.kill(p.pid, signal.SIGKILL)
        assert w.done.wait(20)
        reaped_at = None
        while reaped_at is None:  # the parent's view: reapable only once the memory is released
            if os.waitpid(p.pid, os.WNOHANG) != (0, 0):
                reaped_at = time.monotonic()
            else:
                time.sleep(0.0005)
        p.returncode = -9
        assert w.code == -signal.SIGKILL
        assert w.at is not None and w.at < reaped_at
    finally:
        if p.returncode is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("how, code", [("3", 3), ("exit0", None), ("exec", None)])
def test_only_a_nonzero_status_is_reported_early(how, code):
    """Status 0 (a clean exit) and an ``exec`` (which also releases the lock) are waitpid's to report."""
    notice = rb.DeathNotice.create()
    assert notice is not None
    p = _start(notice, HOW=how)
    try:
        assert p.stdout.readline() == "armed\n"
        w = Waiter(notice, p)
        w.join()
        assert w.code == code
        if how == "exec":
            assert p.poll() is None  # still running, under its new image
            p.stdin.close()
        assert p.wait(20) == (code or 0)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_a_worker_that_never_arms_ends_the_wait_when_reaped():
    notice = rb.DeathNotice.create()
    assert notice is not None
    notice.close_fd()
    p = _start(None, HOW="0")  # no notice handed over: it cannot arm
    w = Waiter(notice, p)
    assert p.stdout.readline() == "not armed\n"
    p.wait(20)
    notice.wake()  # as the launcher's reaper does
    w.join()
    assert w.code is None


def test_arming_needs_the_main_thread_and_a_valid_descriptor(monkeypatch):
    monkeypatch.delenv(envvars.DEATH_FD, raising=False)
    assert deathnotice.arm_from_environment() is False
    monkeypatch.setenv(envvars.DEATH_FD, "not a number")
    assert deathnotice.arm_from_environment() is False
    assert envvars.DEATH_FD not in os.environ  # consumed: a child of the worker never sees it
    notice = rb.DeathNotice.create()
    assert notice is not None and notice.fd is not None
    monkeypatch.setenv(envvars.DEATH_FD, str(os.dup(notice.fd)))
    result: list[bool] = []
    t = threading.Thread(target=lambda: result.append(deathnotice.arm_from_environment()))
    t.start()
    t.join(10)
    assert result == [False]
    notice.discard()


class _Discard:
    def write(self, worker_id: str, stream: str, line: str) -> None:
        pass


def test_the_local_launcher_reports_a_killed_worker_once_and_before_it_is_reaped(tmp_path):
    reports: list[tuple[str, int, bool]] = []
    got = threading.Event()

    def on_exit(worker_id: str, code: int) -> None:
        reports.append((worker_id, code, launcher._procs[worker_id].finished.is_set()))
        got.set()

    launcher = LocalLauncher(_Discard(), on_exit)
    armed = tmp_path / "armed"
    launcher.launch("w0", [sys.executable, "-c", ARM], dict(os.environ, HOLD_MB="1024", HOW="block",
                                                            ARMED_FILE=str(armed)))
    deadline = time.monotonic() + 30
    while not armed.exists() or armed.read_text() != "True":
        assert time.monotonic() < deadline, "the worker did not arm its notice"
        time.sleep(0.01)
    proc = launcher._procs["w0"]
    launcher.signal("w0", signal.SIGKILL)
    assert got.wait(20)
    assert proc.finished.wait(20)
    launcher.drain(5)
    assert reports == [("w0", -signal.SIGKILL, False)]  # once, by the notice: not yet reaped


def test_a_warm_worker_arms_the_notice_the_driver_sent(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE, "--name", "elasticrun-test", "--bare",
                            "--grace", "1"], env)
    try:
        t.wait_ready(30)
        script = tmp_path / "arm.py"
        script.write_text(ARM)
        notice = rb.DeathNotice.create()
        assert notice is not None and notice.fd is not None
        stdin_r, stdin_w = os.pipe()
        out_r, out_w = os.pipe()
        theirs = [stdin_r, out_w, out_w, notice.fd]
        worker = warm.start_worker(t.info["socket"], [sys.executable, str(script)], dict(env, HOLD_MB="512"),
                                   str(tmp_path), theirs, 1.0, keys=False, notice=True)
        for fd in (stdin_r, out_w):
            os.close(fd)
        out = os.fdopen(out_r)
        assert out.readline() == "armed\n"
        code: list[int | None] = []
        waiter = threading.Thread(target=lambda: code.append(notice.wait(worker.pid, lambda: False)))
        waiter.start()
        os.kill(worker.pid, signal.SIGKILL)
        waiter.join(20)
        assert code == [-signal.SIGKILL]
        assert worker.wait() == -signal.SIGKILL  # and the template reaps it as before
        os.close(stdin_w)
        out.close()
    finally:
        t.stop(10)
    assert not Path(t.info["socket"]).parent.exists()


def test_a_notice_armed_by_a_process_the_worker_started_is_not_the_workers_death():
    """``bash run.sh`` -> ``python train.py``: the python inherits the descriptor and arms it; its
    death is not the worker's exit (the shell decides that), so only waitpid reports."""
    notice = rb.DeathNotice.create()
    assert notice is not None and notice.fd is not None
    environ = dict(os.environ, **{envvars.DEATH_FD: str(notice.fd)}, HOW="9")
    p = subprocess.Popen(["/bin/sh", "-c", f'"{sys.executable}" -c "$ARM"; echo "shell after $?"'],
                         env=dict(environ, ARM=ARM), pass_fds=(notice.fd,), stdout=subprocess.PIPE, text=True)
    notice.close_fd()
    try:
        w = Waiter(notice, p)
        w.join()
        assert w.code is None
        out, _ = p.communicate(timeout=20)
        assert out.splitlines() == ["armed", "shell after 9"] and p.returncode == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
