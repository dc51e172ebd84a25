"""The warm-start template (elasticrun/worker/template.py) as a real process, asked through the
driver's client (elasticrun/driver/launch/warm.py). ``--bare`` templates import nothing heavy (the
imports of torch are the integration tests'); the mechanics are the same: a forked worker runs
its script as ``python script.py`` would, in its own session, with its own descriptors and
environment, and reports its exit; everything else starts fresh; nothing outlives the template."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from elasticrun.common import env as envvars
from elasticrun.common import secretpipe
from elasticrun.driver.launch import warm

pytestmark = pytest.mark.timeout(60)

PROBE = textwrap.dedent("""\
    import json, os, re, sys, random
    g = {k: re.sub("0x[0-9a-f]+", "0x", repr(v)) if k != "__loader__" else type(v).__name__
         for k, v in globals().items() if k not in ("json", "os", "re", "sys", "random")}
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    print(json.dumps({
        "globals": g, "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
        "main_is_me": sys.modules["__main__"].__dict__ is globals(), "orig_argv": sys.orig_argv[1:],
        "executable": sys.executable, "sid_is_pid": os.getsid(0) == os.getpid(),
        "pgid_is_pid": os.getpgid(0) == os.getpid(), "env_foo": os.environ.get("FOO"),
        "template_only": os.environ.get("TEMPLATE_ONLY"), "stdout_line_buffering": sys.stdout.line_buffering,
        "stdout_write_through": sys.stdout.write_through, "stderr_line_buffering": sys.stderr.line_buffering,
        "stdin": sys.stdin.read(), "stdout_name": sys.stdout.buffer.name if hasattr(sys.stdout, "buffer") else None,
        "sigint": repr(__import__("signal").getsignal(2)), "sigterm": repr(__import__("signal").getsignal(15)),
        "sigchld": repr(__import__("signal").getsignal(17)), "fds": fds, "random": random.random(),
        "keys": sorted(g),
    }))
    print("to stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("EXIT", "0")))
""")


class Worker:
    def __init__(self, warm_worker: warm.WarmWorker, out: int, err: int):
        self.w = warm_worker
        self.pid = warm_worker.pid
        self._out, self._err = out, err

    def finish(self, timeout: float = 20) -> tuple[int | None, str, str]:
        code = self.w.wait()
        out = os.fdopen(self._out, "rb").read().decode()
        err = os.fdopen(self._err, "rb").read().decode()
        return code, out, err


def _ask(sock: str, command: list[str], env: dict[str, str], cwd: str, keys: bytes | None = None,
         grace: float = 2.0) -> Worker:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    theirs = [os.open(os.devnull, os.O_RDONLY), out_w, err_w]
    if keys is not None:
        theirs.append(secretpipe.hand_over(keys))
    try:
        w = warm.start_worker(sock, command, env, cwd, theirs, grace)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        for fd in theirs:
            os.close(fd)
    return Worker(w, out_r, err_r)


@pytest.fixture
def template(tmp_path):
    """A bare template started as the driver starts one (its env: this one plus TEMPLATE_ONLY)."""
    env = dict(os.environ, TEMPLATE_ONLY="1", TMPDIR=str(tmp_path))
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE, "--name", "elasticrun-test", "--bare",
                            "--grace", "1"], env)
    t.env = env
    t.wait_ready(30)
    yield t
    t.stop(10)
    assert t.proc.returncode == 0
    assert not Path(t.info["socket"]).parent.exists()  # it removed its directory


def _worker_env(t, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in t.env.items() if k != "TEMPLATE_ONLY"}
    env.update(extra)
    return env


def test_a_script_runs_as_python_would_run_it(template, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "probe.py").write_text(PROBE)
    (tmp_path / "link").symlink_to(real)
    command = [sys.executable, "link/probe.py", "a", "-u"]
    env = _worker_env(template, FOO="bar", EXIT="3")
    fresh = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           start_new_session=True)
    w = _ask(template.info["socket"], command, env, str(tmp_path))
    code, out, err = w.finish()
    assert (code, fresh.returncode) == (3, 3)
    assert err == fresh.stderr == "to stderr\n"
    warm_, cold = json.loads(out), json.loads(fresh.stdout)
    assert warm_.pop("random") != cold.pop("random")
    assert warm_ == cold, {k: (warm_[k], cold[k]) for k in warm_ if warm_[k] != cold.get(k)}
    assert warm_["argv"] == ["link/probe.py", "a", "-u"] and warm_["path0"] == str(real)
    assert warm_["globals"]["__file__"] == repr(str(tmp_path / "link/probe.py"))
    assert warm_["sid_is_pid"] and warm_["env_foo"] == "bar" and warm_["template_only"] is None
    assert warm_["fds"] == [0, 1, 2, 3]  # 3: the listing's own


def test_ps_shows_the_workers_command_line_and_environment(tmp_path):
    """/proc/PID/cmdline and /proc/PID/environ (ps, top, monitoring) are the worker's, not the template's."""
    env = dict(os.environ, TEMPLATE_ONLY="1", TMPDIR=str(tmp_path))
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE, "--bare", "--room", " " * 4096], env)
    t.env = env
    try:
        t.wait_ready(30)
        (tmp_path / "p.py").write_text("import sys; sys.stdin.read()\n")
        r, w = os.pipe()
        out_r, out_w = os.pipe()
        command = [sys.executable, "p.py", "--an", "argument"]
        theirs = [r, out_w, out_w]
        worker = warm.start_worker(t.info["socket"], command, _worker_env(t, FOO="bar"), str(tmp_path), theirs, 1.0)
        for fd in (r, out_w):
            os.close(fd)
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:  # until the child has set itself up (environment first)
                cmdline = Path(f"/proc/{worker.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
                if cmdline == [c.encode() for c in command]:
                    break
                time.sleep(0.01)
            assert cmdline == [c.encode() for c in command]
            environ = [x for x in Path(f"/proc/{worker.pid}/environ").read_bytes().split(b"\0") if x]
            assert b"FOO=bar" in environ and b"TEMPLATE_ONLY=1" not in environ
            assert not any(x.startswith(b"ELASTICRUN_TEMPLATE_ROOM=") for x in environ)
        finally:
            os.close(w)
            os.close(out_r)
            assert worker.wait() == 0
    finally:
        t.stop(10)


def test_a_module_runs_as_python_m_would_run_it(template, tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "probe.py").write_text(PROBE)
    command = [sys.executable, "-m", "pkg.probe", "x"]
    env = _worker_env(template, PYTHONUNBUFFERED="1")
    fresh = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                           start_new_session=True)
    code, out, err = _ask(template.info["socket"], command, env, str(tmp_path)).finish()
    warm_, cold = json.loads(out), json.loads(fresh.stdout)
    warm_.pop("random"), cold.pop("random")
    assert code == fresh.returncode == 0 and err == fresh.stderr
    assert warm_ == cold, {k: (warm_[k], cold[k]) for k in warm_ if warm_[k] != cold.get(k)}
    assert warm_["argv"] == [str(pkg / "probe.py"), "x"] and warm_["stdout_write_through"] is True


def test_an_uncaught_exception_is_its_traceback_and_1(template, tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import atexit\natexit.register(print, 'atexit ran')\n\ndef f():\n    raise ValueError('boom')\n\nf()\n")
    command = [sys.executable, str(script)]
    env = _worker_env(template)
    fresh = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
    code, out, err = _ask(template.info["socket"], command, env, str(tmp_path)).finish()
    assert code == fresh.returncode == 1
    assert out == fresh.stdout == "atexit ran\n"
    assert err == fresh.stderr and err.startswith("Traceback (most recent call last):\n  File \"" + str(script))


def test_a_syntax_error_and_a_missing_module(template, tmp_path):
    (tmp_path / "bad.py").write_text("def (:\n")
    env = _worker_env(template)
    for command in ([sys.executable, "bad.py"], [sys.executable, "-m", "no_such_module_here"]):
        fresh = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True)
        code, out, err = _ask(template.info["socket"], command, env, str(tmp_path)).finish()
        assert (code, out, err) == (fresh.returncode, fresh.stdout, fresh.stderr), command


def test_non_daemon_threads_are_joined_before_the_exit(template, tmp_path):
    script = tmp_path / "t.py"
    script.write_text("import threading, time\n"
                      "threading.Thread(target=lambda: (time.sleep(0.3), print('thread done', flush=True))).start()\n"
                      "raise SystemExit(5)\n")
    code, out, _ = _ask(template.info["socket"], [sys.executable, str(script)], _worker_env(template),
                        str(tmp_path)).finish()
    assert (code, out) == (5, "thread done\n")


def test_the_keys_arrive_through_the_pipe(template, tmp_path):
    script = tmp_path / "k.py"
    script.write_text("from elasticrun.common import secretpipe\nimport os\n"
                      "print(secretpipe.receive().decode(), os.environ.get('ELASTICRUN_SECRET_FD'))\n")
    env = _worker_env(template, **{envvars.SECRET_FD: "99"})  # a stale number is replaced
    code, out, _ = _ask(template.info["socket"], [sys.executable, str(script)], env, str(tmp_path),
                        keys=b"the-keys").finish()
    assert (code, out) == (0, "the-keys None\n")


def test_a_signal_is_a_negative_status_and_reaches_the_group(template, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import subprocess, time\nsubprocess.Popen(['sleep', '300'])\nprint('up', flush=True)\n"
                      "time.sleep(300)\n")
    w = _ask(template.info["socket"], [sys.executable, str(script)], _worker_env(template), str(tmp_path))
    with os.fdopen(os.dup(w._out), "rb") as f:
        assert f.readline() == b"up\n"
    os.killpg(w.pid, signal.SIGKILL)
    code, _, _ = w.finish()
    assert code == -signal.SIGKILL


def test_a_client_that_goes_away_gets_its_worker_stopped(template, tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    w = _ask(template.info["socket"], [sys.executable, str(script)], _worker_env(template), str(tmp_path))
    with os.fdopen(os.dup(w._out), "rb") as f:
        assert f.readline() == b"up\n"
    w.w.close()
    _wait_gone(w.pid, 10)


@pytest.mark.parametrize("command,extra,why", [
    (["bash", "-c", "true"], {}, "'bash' is not a Python interpreter"),
    (["python3", "-c", "pass"], {}, "'-c'"),
    ([sys.executable, "missing.py"], {}, "missing.py is not a file"),
    ([sys.executable, "t.py"], {"PYTHONPATH": "/elsewhere"}, "PYTHONPATH differs from the template's"),
    ([sys.executable, "t.py"], {"OMP_NUM_THREADS": "7", "LC_ALL": "C"}, "LC_ALL, OMP_NUM_THREADS differ"),
    (["/usr/bin/python3", "t.py"], {}, "is not this template's interpreter"),
])
def test_what_starts_fresh(template, tmp_path, command, extra, why):
    (tmp_path / "t.py").write_text("pass\n")
    if not os.path.exists(command[0]) and command[0].startswith("/"):
        pytest.skip(f"no {command[0]} here")
    with pytest.raises(warm.Unavailable, match=why):
        _ask(template.info["socket"], command, _worker_env(template, **extra), str(tmp_path))


def test_a_template_with_a_thread_forks_nothing(tmp_path):
    (tmp_path / "threaded.py").write_text("import threading, time\n"
                                          "threading.Thread(target=time.sleep, args=(300,), daemon=True).start()\n")
    (tmp_path / "t.py").write_text("pass\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TMPDIR=str(tmp_path))
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE, "--bare", "--preload", "threaded"], env)
    try:
        t.wait_ready(30)
        assert t.info["threads"] == 2 and t.info["preloaded"] == ["threaded"]
        with pytest.raises(warm.Unavailable, match="the template has 2 threads .*forking it is not safe"):
            _ask(t.info["socket"], [sys.executable, "t.py"], env, str(tmp_path))
    finally:
        t.stop(10)


def test_a_failed_preload_is_reported_and_the_template_serves(tmp_path):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE, "--bare", "--preload", "no_such_mod_x"], env)
    try:
        t.wait_ready(30)
        assert "ModuleNotFoundError" in t.info["failed"]["no_such_mod_x"]
    finally:
        t.stop(10)


def test_a_template_that_cannot_start_is_unavailable(tmp_path):
    t = warm.LocalTemplate([sys.executable, "-c", "import sys; sys.exit('no torch here')"], dict(os.environ))
    with pytest.raises(warm.Unavailable, match="exited with code 1; it said: no torch here"):
        t.wait_ready(30)
    assert not t.usable
    t.stop(5)


def test_the_driver_going_away_stops_the_template_and_its_workers(tmp_path):
    """The template's stdin is the driver's pipe: EOF (the driver exited, even by SIGKILL) stops
    its workers (SIGTERM, SIGKILL after the grace period) and the template."""
    (tmp_path / "stubborn.py").write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                                          "print('up', flush=True)\ntime.sleep(300)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE, "--bare", "--grace", "0.5"], env)
    t.wait_ready(30)
    w = _ask(t.info["socket"], [sys.executable, "stubborn.py"], env, str(tmp_path), grace=0.5)
    with os.fdopen(os.dup(w._out), "rb") as f:
        assert f.readline() == b"up\n"
    t.proc.stdin.close()  # what the driver's death does
    assert w.w.wait() == -signal.SIGKILL  # its exit is still reported to a client that stays
    assert t.proc.wait(15) == 0
    _wait_gone(w.pid, 5)
    t.stop(5)


@pytest.mark.parametrize("driver_goes", [False, True])
def test_a_signalled_template_lets_its_workers_leave_up_to_their_sigterm_grace(driver_goes, tmp_path):
    """A spot host going down signals the template and its workers: a worker's SIGTERM is notice
    to leave at its next commit, so it is SIGKILLed only after its --sigterm-grace and the grace,
    not the grace alone (a leave turned into a rollback). Once the driver is gone no leave can
    complete: the grace from then."""
    (tmp_path / "leaving.py").write_text(
        "import signal, sys, time\n"
        "def leave(*_):\n    print('leaving', flush=True)\n    time.sleep(1)\n    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, leave)\nprint('up', flush=True)\ntime.sleep(300)\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE, "--bare", "--grace", "0.3"], env)
    t.wait_ready(30)
    w = _ask(t.info["socket"], [sys.executable, "leaving.py"], dict(env, **{envvars.SIGTERM_GRACE: "5"}),
             str(tmp_path), grace=0.3)
    with os.fdopen(os.dup(w._out), "rb") as f:
        assert f.readline() == b"up\n"
        started = time.monotonic()
        t.proc.send_signal(signal.SIGTERM)
        assert f.readline() == b"leaving\n"  # the template passed the signal on
        if driver_goes:
            t.proc.stdin.close()
        code = w.w.wait()
    assert code == (-signal.SIGKILL if driver_goes else 3)
    assert time.monotonic() - started < (0.9 if driver_goes else 3)
    assert t.proc.wait(15) == 0
    _wait_gone(w.pid, 5)
    t.stop(5)


def _wait_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().split(b") ")[-1][:1] == b"Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"process {pid} still runs")


def test_the_template_never_touches_cuda(tmp_path):
    """A fork after CUDA's initialization leaves the worker without a GPU: the template's imports
    (torch, elasticrun.torch, the warm-up) must not initialize it, nor even ask about GPUs (which
    initializes the CUDA driver). A sitecustomize records every such call."""
    record = tmp_path / "cuda_calls"
    (tmp_path / "sitecustomize.py").write_text(
        "import torch, functools\n"
        f"RECORD = {str(record)!r}\n"
        "def spy(name, real):\n"
        "    @functools.wraps(real)\n"
        "    def call(*a, **k):\n"
        "        open(RECORD, 'a').write(name + '\\n')\n"
        "        return real(*a, **k)\n"
        "    return call\n"
        "for name in ('is_available', 'device_count', 'init', '_lazy_init', 'current_device', 'set_device',\n"
        "             'mem_get_info', 'get_device_name'):\n"
        "    setattr(torch.cuda, name, spy(name, getattr(torch.cuda, name)))\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TMPDIR=str(tmp_path))
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE], env)
    try:
        t.wait_ready(60)
        assert "elasticrun.torch" in t.info["preloaded"] and t.info["cuda_initialized"] is False
    finally:
        t.stop(10)
    assert not record.exists(), f"the template asked torch.cuda: {record.read_text().split()}"


def test_a_template_whose_preload_initialized_cuda_forks_nothing(tmp_path):
    (tmp_path / "gpu_lib.py").write_text("import torch\ntorch.cuda.is_initialized = lambda: True  # as if it had\n")
    (tmp_path / "t.py").write_text("pass\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TMPDIR=str(tmp_path))
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE, "--bare", "--preload", "gpu_lib"], env)
    try:
        t.wait_ready(30)
        assert t.info["cuda_initialized"] is True
        with pytest.raises(warm.Unavailable, match="CUDA was initialized in the template"):
            _ask(t.info["socket"], [sys.executable, "t.py"], env, str(tmp_path))
    finally:
        t.stop(10)


def _aged(path: Path, seconds: float = 120.0) -> None:
    t = time.time() - seconds
    os.utime(path, (t, t), follow_symlinks=False)


def _dead_socket_dir(base: Path, name: str, age: float = 120.0) -> Path:
    """A directory as a SIGKILLed template leaves it: 0700, its socket bound and no one listening."""
    import socket as socketlib

    d = base / name
    d.mkdir(mode=0o700)
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    s.bind(str(d / "template.sock"))
    s.close()
    _aged(d / "template.sock", age)
    return d


def test_directories_of_templates_that_are_gone_are_swept_and_nothing_else(tmp_path):
    import socket as socketlib

    from elasticrun.worker import template

    dead = _dead_socket_dir(tmp_path, "elasticrun-1-dead")
    young = _dead_socket_dir(tmp_path, "elasticrun-2-young", age=1.0)  # may be bound, not yet listening
    live = tmp_path / "elasticrun-3-live"
    live.mkdir(mode=0o700)
    listener = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    listener.bind(str(live / "template.sock"))
    listener.listen(1)
    _aged(live / "template.sock")
    empty_old = tmp_path / "elasticrun-4-empty"
    empty_old.mkdir(mode=0o700)
    _aged(empty_old)
    empty_new = tmp_path / "elasticrun-5-fresh"
    empty_new.mkdir(mode=0o700)
    other = _dead_socket_dir(tmp_path, "elasticrun-6-more")
    (other / "notes").write_text("x")
    wide = _dead_socket_dir(tmp_path, "elasticrun-7-wide")
    wide.chmod(0o755)
    target = _dead_socket_dir(tmp_path, "target-8")
    (tmp_path / "elasticrun-9-link").symlink_to(target)
    foreign = _dead_socket_dir(tmp_path, "someone-else")
    try:
        assert template.sweep_stale_dirs(str(tmp_path)) == 2
        gone = {p.name for p in (dead, empty_old) if not p.exists()}
        assert gone == {"elasticrun-1-dead", "elasticrun-4-empty"}
        for kept in (young, live, empty_new, other, wide, target, foreign):
            assert kept.exists(), kept
        assert (target / "template.sock").exists() and (tmp_path / "elasticrun-9-link").is_symlink()
        assert template.sweep_stale_dirs(str(tmp_path)) == 0
    finally:
        listener.close()


def test_a_new_template_removes_what_a_sigkilled_one_left(tmp_path):
    env = dict(os.environ, TEMPLATE_ONLY="1", TMPDIR=str(tmp_path))
    env.pop("XDG_RUNTIME_DIR", None)
    argv = [sys.executable, "-m", warm.TEMPLATE_MODULE, "--name", "elasticrun-test", "--bare", "--grace", "1"]
    first = warm.LocalTemplate(argv, env)
    first.wait_ready(30)
    left = Path(first.info["socket"]).parent
    os.kill(first.info["pid"], signal.SIGKILL)
    first.proc.wait(10)
    assert (left / "template.sock").exists()  # nothing could remove it
    _aged(left / "template.sock")
    second = warm.LocalTemplate(argv, env)
    try:
        second.wait_ready(30)
        assert not left.exists()
        assert Path(second.info["socket"]).exists()
    finally:
        second.stop(10)
        first.info = None  # its directory is already gone; nothing for its stop to remove
        first.stop(1)


def test_a_preload_that_asks_for_gpus_asks_nvml_and_no_worker_inherits_the_switch(tmp_path):
    """``device = "cuda" if torch.cuda.is_available() else "cpu"`` in a --preload module ran
    cudaGetDeviceCount (cuInit) in the template, which torch.cuda.is_initialized() does not
    show: every forked worker then found no usable GPU. torch asks NVML while the switch is on."""
    seen = tmp_path / "seen"
    (tmp_path / "gpu_lib.py").write_text(
        "import os, torch\n"
        f"open({str(seen)!r}, 'w').write(os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK', 'unset'))\n"
        "device = 'cuda' if torch.cuda.is_available() else 'cpu'\n")
    (tmp_path / "t.py").write_text(
        "import os, sys\nsys.exit(7 if 'PYTORCH_NVML_BASED_CUDA_CHECK' in os.environ else 0)\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TMPDIR=str(tmp_path))
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)
    t = warm.LocalTemplate([sys.executable, "-m", warm.TEMPLATE_MODULE, "--bare", "--preload", "gpu_lib",
                            "--grace", "1"], env)
    try:
        t.wait_ready(30)
        assert seen.read_text() == "1"
        w = _ask(t.info["socket"], [sys.executable, "t.py"], env, str(tmp_path))
        code, out, err = w.finish()
        assert code == 0, (out, err)  # the worker's environment is the job's, without the switch
    finally:
        t.stop(10)
