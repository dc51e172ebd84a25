"""The Launcher protocol, the local/SSH router (elasticrun/driver/launch/launchers.py), and a driver
that is given its launcher: it binds it, launches through it, hears exits from it and stops it."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from elasticrun.common import env as envvars
from elasticrun.common.errors import JobFailed
from elasticrun.common.settings import JobSettings
from elasticrun.discovery.sources import FixedHosts
from elasticrun.driver.driver import ElasticDriver
from elasticrun.driver.launch.launchers import Launchers
from elasticrun.driver.launching import Launcher

pytestmark = pytest.mark.timeout(60)

KEYS = b'{"v": 1, "secret": "' + b"ab" * 32 + b'"}'


def _settings(**kw) -> JobSettings:
    return JobSettings(command=["true"], np=1, min_np=1, max_np=1, **kw)


class _Sink:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, str]] = []

    def write(self, worker_id: str, stream: str, line: str) -> None:
        self.lines.append((worker_id, stream, line))


class _Exits:
    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self._cv = threading.Condition()

    def __call__(self, worker_id: str, code: int, detail: str = "") -> None:
        with self._cv:
            assert worker_id not in self.codes, f"{worker_id} reported twice"
            self.codes[worker_id] = code
            self._cv.notify_all()

    def wait(self, worker_id: str, timeout: float = 20) -> int:
        with self._cv:
            assert self._cv.wait_for(lambda: worker_id in self.codes, timeout), f"no exit for {worker_id}"
            return self.codes[worker_id]


@pytest.mark.parametrize("mode,host,remote", [
    ("auto", "localhost", False), ("auto", "127.0.0.2", False), ("auto", "me@localhost", True),
    ("auto", "no-such-host.invalid", True), ("ssh", "localhost", True), ("local", "127.0.0.2", False),
])
def test_launcher_choice(mode, host, remote):
    assert Launchers(_settings(launcher=mode)).is_remote(host) is remote


def test_local_mode_refuses_a_remote_host():
    launchers = Launchers(_settings(launcher="local"))
    launchers.bind(_Exits(), _Sink())
    with pytest.raises(OSError, match="not this machine"):
        launchers.launch("w1", ["true"], {}, host="no-such-host.invalid")


def test_launchers_is_a_launcher_bound_once():
    launchers = Launchers(_settings())
    assert isinstance(launchers, Launcher)
    with pytest.raises(RuntimeError, match="bind"):
        launchers.launch("w1", ["true"], {}, host="localhost")
    launchers.bind(_Exits(), _Sink())
    with pytest.raises(RuntimeError, match="bound to a driver already"):
        launchers.bind(_Exits(), _Sink())
    launchers.stop_all(1)  # nothing launched: nothing to stop, no SSH set up
    launchers.drain(1)
    assert launchers._ssh is None


def test_local_workers_report_output_exit_and_get_the_keys_through_a_pipe():
    launchers, exits, sink = Launchers(_settings()), _Exits(), _Sink()
    launchers.bind(exits, sink)
    script = 'echo "out $GREETING"; cat /dev/fd/$ELASTICRUN_SECRET_FD; echo; echo err >&2; exit 3'
    launchers.launch("w1", ["sh", "-c", script], {"GREETING": "hi", "PATH": "/bin:/usr/bin"}, host="localhost",
                     keys=KEYS)
    launchers.launch("w2", ["sleep", "300"], {"PATH": "/bin:/usr/bin"}, host="127.0.0.1")
    try:
        assert exits.wait("w1") == 3
        launchers.signal("w2", signal.SIGTERM)
        assert exits.wait("w2") == -signal.SIGTERM
        launchers.signal("w2", signal.SIGTERM)  # gone: nothing happens
        launchers.signal("nobody", signal.SIGTERM)
    finally:
        launchers.stop_all(1)
        launchers.drain(2)
    assert sink.lines.count(("w1", "stdout", "out hi")) == 1
    assert ("w1", "stdout", KEYS.decode()) in sink.lines and ("w1", "stderr", "err") in sink.lines



def test_an_ended_worker_is_forgotten_and_the_stop_never_signals_its_group_again(monkeypatch):
    """A job replacing workers for days must not keep each one's record (threads, pipes: ~8 KB a
    worker), nor SIGKILL, at its stop, a process group id that an ended worker had: once that
    group is empty the id is free, and pids wrap (at 32,768 on many machines)."""
    import os

    launchers, exits, sink = Launchers(_settings()), _Exits(), _Sink()
    launchers.bind(exits, sink)
    launchers.launch("w1", ["sh", "-c", "echo bye; exit 0"], {"PATH": "/bin:/usr/bin"}, host="localhost")
    launchers.launch("w2", ["sleep", "300"], {"PATH": "/bin:/usr/bin"}, host="localhost")
    ended = launchers.pid("w1")
    assert ended is not None and exits.wait("w1") == 0
    deadline = time.monotonic() + 10
    while launchers.local.knows("w1"):  # reaped, swept (0.25 s after its exit), output read: forgotten
        assert time.monotonic() < deadline, "w1 was not forgotten"
        time.sleep(0.01)
    assert ("w1", "stdout", "bye") in sink.lines
    assert launchers.pid("w1") is None and launchers.local.knows("w2")
    launchers.signal("w1", signal.SIGTERM)  # forgotten: nothing happens
    signalled: list[int] = []
    real = os.killpg
    monkeypatch.setattr(os, "killpg", lambda pgid, sig: (signalled.append(pgid), real(pgid, sig)))
    try:
        launchers.stop_all(1)
    finally:
        launchers.drain(2)
    assert exits.wait("w2") == -signal.SIGTERM
    assert ended not in signalled and launchers.pid("w2") is None


# --- the driver and its launcher ---------------------------------------------------------------------
class _FailingLauncher:
    """Every worker it is asked for exits with code 1 at once, from another thread (as a
    launcher's watcher thread reports it)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.on_exit = None
        self.output = None

    def bind(self, on_exit, output) -> None:
        self.calls.append(("bind",))
        self.on_exit, self.output = on_exit, output

    def is_remote(self, host: str) -> bool:
        return False

    def launch(self, worker_id, command, env, host, keys=None) -> None:
        self.calls.append(("launch", worker_id, list(command), dict(env), host, keys))
        threading.Thread(target=self.on_exit, args=(worker_id, 1)).start()

    def signal(self, worker_id, sig) -> None:
        self.calls.append(("signal", worker_id, sig))

    def stop_all(self, grace) -> None:
        self.calls.append(("stop_all", grace))

    def drain(self, timeout) -> None:
        self.calls.append(("drain", timeout))


def test_the_driver_uses_the_launcher_it_is_given():
    settings = JobSettings(command=["python", "train.py"], np=1, min_np=1, max_np=1, hosts={"localhost": 1},
                           start_timeout=5, elastic_timeout=5)
    launcher = _FailingLauncher()
    assert isinstance(launcher, Launcher)
    driver = ElasticDriver(settings, FixedHosts({"localhost": 1}), launcher)
    assert launcher.calls == [("bind",)] and launcher.on_exit == driver.worker_exited
    started = time.monotonic()
    with pytest.raises(JobFailed):
        driver.run()
    assert time.monotonic() - started < 10
    kinds = [c[0] for c in launcher.calls]
    assert kinds[:2] == ["bind", "launch"] and kinds[-2:] == ["stop_all", "drain"], kinds
    _, worker_id, command, env, host, keys = launcher.calls[1]
    assert command == ["python", "train.py"] and host == "localhost"
    assert env[envvars.WORKER_ID] == worker_id and env[envvars.JOB_ID] == driver.job_id
    assert env[envvars.CONTROL_ADDR].startswith("tcp://127.0.0.1:")
    assert keys and keys.decode() not in "\n".join(env.values())  # the keys go beside the environment
    assert driver.registry.workers[worker_id].exit_code == 1  # the exit it reported was heard
