"""The remote side of an SSH launch: start one worker, then watch over it.

This file is not imported on the remote host: the SSH launcher (``ssh.py``) reads it as text
and sends it over the channel's stdin, and the one-line loader on the remote command line
runs it (``exec``, as ``__main__``) in whatever Python ``--remote-python`` names. Hence its rules:
**Python 3.6 syntax, standard library only, nothing of elasticrun** (the remote Python may be
an old system ``python3`` without it); ``tests/unit/test_remote_bootstrap.py`` checks them.

Its second stdin line is the launch request (JSON): ``mark``, ``command``, ``env``, ``cwd``,
``grace`` and ``keys``. It then

1. changes to the working directory and looks the command up on the worker's ``PATH``,
2. forks the worker into **its own process group**, reports the group id on stdout (one
   marker line), and only then lets the worker ``exec`` -- so the driver can signal the whole
   tree the worker will start before it has started anything; the job's keys go to the
   worker through a pipe (``ELASTICRUN_SECRET_FD``), never its environment;
3. stays behind as a **watchdog**: when its stdin reaches EOF (the SSH connection is gone
   because the driver died, was killed with SIGKILL, or closed the channel) or it gets
   SIGTERM/SIGINT/SIGHUP, it sends SIGTERM to the worker's group and SIGKILL after the grace
   period; when the worker exits on its own, it SIGKILLs what is left of the group (the
   worker's children), reports the worker's exit status (one marker line) and exits.

Warm start (``elasticrun/worker/template.py``). A request with ``"template": true`` starts
the host's template instead of a worker: after steps 1 (its directory, its interpreter) this
process *becomes* it (``execve``); its stdin is still the channel, so the template ends when
the driver's connection does. A worker request with ``"warm": {"socket": PATH}`` first asks
that template to fork the worker, sending it this process's stdout and stderr (the channel),
/dev/null and the key pipe as descriptors (the format is ``elasticrun/common/warmstart.py``'s,
copied here: :func:`encode_request`); this process stays the watchdog of the forked worker's
group exactly as of its own child, and gets the exit status from the template, the only
process that can wait for it. A template that answers ``fallback``, or cannot be reached,
means a fresh worker as in step 2 (reported as ``{"fallback": why}``); a template that goes
away while its worker runs means that worker is killed and counts as failed.

Report lines are ``mark`` followed by JSON: ``{"pid", "pgid", "watchdog"}`` once the worker's
group exists (with ``"warm": true`` when a template forked it), ``{"error", "detail"}`` when
the worker could not be started (``error`` is ``cwd``, ``not_found`` or ``exec``),
``{"fallback"}`` (see above), ``{"exit"}`` with its status as ``subprocess`` gives it
(negative for a signal). The watchdog's own exit status is the worker's in the shell's
convention (128+N for signal N), 126/127 when it could not start it, 255 when the worker
could not be reaped, 125 for a bug here.
"""

import array
import json
import os
import shutil
import signal
import socket
import struct
import sys
import threading
import time
from typing import IO, Any, Callable, Dict, List, Mapping, Optional, Tuple

#: elasticrun.common.env.SECRET_FD (this file imports nothing of elasticrun).
SECRET_FD = "ELASTICRUN_SECRET_FD"
#: After SIGKILL, how long to wait for the worker to be reaped.
REAP_SECONDS = 10.0


def reporter(mark: str, stream: IO[str]) -> Callable[..., None]:
    """``report(**fields)``: one ``mark + JSON`` line on ``stream``, never raising."""

    def report(**fields: object) -> None:
        try:
            stream.write(mark + json.dumps(fields) + "\n")
            stream.flush()
        except (OSError, ValueError):
            pass  # the driver is gone; the exit status is all that is left

    return report


def worker_env(login_env: Mapping[str, str], forwarded: Mapping[str, str]) -> Dict[str, str]:
    """The remote login environment overlaid with the one the driver sent, with no key pipe."""
    env = dict(login_env)
    env.update(forwarded)
    env.pop(SECRET_FD, None)  # only the pipe this bootstrap makes may be named there
    return env


def enter_directory(cwd: str, env: Dict[str, str]) -> Optional[str]:
    """``chdir`` to ``cwd`` and set ``PWD`` in ``env``; why not, or None when done."""
    try:
        os.chdir(cwd)
    except OSError as exc:
        return "cannot change to directory %s: %s" % (cwd, exc.strerror)
    env["PWD"] = cwd if os.path.isabs(cwd) else os.getcwd()
    return None


def find_command(prog: str, path: str) -> Tuple[Optional[str], str]:
    """(the executable ``prog`` names on ``path``, "") or (None, why there is none)."""
    found = shutil.which(prog, path=path)
    if found is not None:
        return found, ""
    if os.sep in prog:
        why = "not executable" if os.path.exists(prog) else "no such file"
        return None, "%s: %s" % (prog, why)
    return None, "command not found: %s (searched PATH=%s)" % (prog, path)


def die_with(parent: int) -> None:
    """Ask Linux to SIGKILL this process when the watchdog dies (``PR_SET_PDEATHSIG``, kept
    across ``exec``): a watchdog killed with SIGKILL (OOM killer, an agent's teardown) can then
    never leave its worker running unwatched. Elsewhere (no ``prctl``) the watchdog's own
    handlers are the only guard."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # 1: PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the watchdog died before the request took effect
        os._exit(127)


def spawn(program: str, argv: List[str], env: Dict[str, str], keys: Optional[str]) -> Tuple[int, int, int]:
    """Fork the worker as the leader of a new process group, held before ``exec``.

    Returns (pid, gate, errors): the worker runs ``program`` (``execve``) once :func:`release`
    opens ``gate``, and ``errors`` tells whether that failed. ``keys`` (ASCII) reach it through a
    fresh pipe named by ``ELASTICRUN_SECRET_FD``.
    """
    gate_r, gate_w = os.pipe()
    err_r, err_w = os.pipe()  # close-on-exec: EOF without data means the exec succeeded
    watchdog = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(gate_w)
            os.close(err_r)
            os.setpgid(0, 0)
            die_with(watchdog)
            os.read(gate_r, 1)  # wait until the driver knows our group
            os.close(gate_r)
            for name in ("SIGPIPE", "SIGXFSZ"):  # Python ignores them; the worker must not
                if hasattr(signal, name):
                    signal.signal(getattr(signal, name), signal.SIG_DFL)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)  # the worker never reads the driver's pipe
            if keys is not None:  # tiny: fits the pipe's buffer, so writing never blocks
                key_r, key_w = os.pipe()
                os.write(key_w, keys.encode("ascii"))
                os.close(key_w)
                os.set_inheritable(key_r, True)
                env[SECRET_FD] = str(key_r)
            os.execve(program, argv, env)
        except BaseException as exc:
            try:
                os.write(err_w, ("%s: %s" % (argv[0], getattr(exc, "strerror", None) or exc)).encode(
                    "utf-8", "replace"))
            except BaseException:
                pass
        os._exit(127)

    os.close(gate_r)
    os.close(err_w)
    try:
        os.setpgid(pid, pid)  # also here, so the group exists before anyone signals it
    except OSError:
        pass
    return pid, gate_w, err_r


def release(gate: int, errors: int) -> bytes:
    """Let the worker ``exec``; b"" once it did, else why it could not."""
    os.write(gate, b"x")
    os.close(gate)
    failed = b""
    while True:
        chunk = os.read(errors, 4096)
        if not chunk:
            break
        failed += chunk
    os.close(errors)
    return failed


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM, SIGINT and SIGHUP (the driver's ``kill``, a hang-up) set ``stop``."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())


def killpg(pgid: int, sig: int) -> None:
    """Signal a process group that may be gone already."""
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def until_stopped(stop: threading.Event, waiter: Callable[[], None], name: str, driver_fd: int) -> None:
    """Run ``waiter`` (which sets ``stop`` once the worker is done) and a reader of ``driver_fd``
    (which sets it at EOF: the driver's connection is gone, or it closed this channel) on
    daemon threads; return once ``stop`` is set, by either or by a signal."""
    def watch_driver() -> None:
        try:
            while os.read(driver_fd, 4096):
                pass
        except OSError:
            pass
        stop.set()

    threading.Thread(target=waiter, name=name, daemon=True).start()
    threading.Thread(target=watch_driver, name="bootstrap-driver", daemon=True).start()
    while not stop.wait(1.0):
        pass


def watch(pid: int, grace: float, stop: threading.Event, driver_fd: int = 0) -> Optional[int]:
    """Wait for the worker ``pid`` to exit, ``driver_fd`` to reach EOF or ``stop``; then clean up.

    If the worker is still running: SIGTERM to its group, SIGKILL after ``grace``. Either
    way, SIGKILL to whatever is left of the group (the worker's own children). Returns the
    worker's wait status, or None if it was not reaped within REAP_SECONDS.
    """
    status: List[int] = []

    def wait_child() -> None:
        status.append(os.waitpid(pid, 0)[1])
        stop.set()

    until_stopped(stop, wait_child, "bootstrap-wait", driver_fd)
    if not status:  # asked to stop, or the driver is gone: SIGTERM the group, SIGKILL after grace
        killpg(pid, signal.SIGTERM)
        deadline = time.time() + grace
        while not status and time.time() < deadline:
            time.sleep(0.02)
    killpg(pid, signal.SIGKILL)  # whatever is left of the group: the worker's own children too
    deadline = time.time() + REAP_SECONDS
    while not status and time.time() < deadline:
        time.sleep(0.02)
    return status[0] if status else None


def encode_request(command: List[str], env: Mapping[str, str], cwd: str, grace: float, keys: bool) -> bytes:
    """A template request (elasticrun.common.warmstart.encode_request, byte for byte)."""
    body = json.dumps({"v": 1, "command": list(command), "env": dict(env), "cwd": cwd, "grace": float(grace),
                       "keys": bool(keys)}, sort_keys=True).encode("ascii")
    return struct.pack(">I", len(body)) + body


def warm_spawn(path: str, command: List[str], env: Dict[str, str], cwd: str, grace: float,
               keys: Optional[str], timeout: float = 10.0) -> Any:
    """Ask the template at ``path`` to fork the worker: (connection, pid, what followed the
    answer) or, when it will not, why (a string; then the worker starts fresh)."""
    null = os.open(os.devnull, os.O_RDONLY)
    fds = [null, 1, 2]  # the worker's stdin; stdout and stderr are this channel's
    if keys is not None:  # tiny: fits the pipe's buffer
        key_r, key_w = os.pipe()
        os.write(key_w, keys.encode("ascii"))
        os.close(key_w)
        fds.append(key_r)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    handed = False  # the socket is the watchdog's once the template answered
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        data = encode_request(command, env, cwd, grace, keys is not None)
        sent = sock.sendmsg([data[:65536]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        if sent < len(data):
            sock.sendall(data[sent:])
        buf = b""
        while b"\n" not in buf:
            chunk = sock.recv(4096)
            if not chunk:
                return "the template closed the connection without an answer"
            buf += chunk
        line, _, rest = buf.partition(b"\n")
        answer = json.loads(line.decode("ascii"))
        if "fallback" in answer:
            return str(answer["fallback"])
        pid = int(answer["pid"])
        handed = True
        return sock, pid, rest
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return "cannot use the template at %s: %s" % (path, exc)
    finally:
        for fd in fds[:1] + fds[3:]:
            os.close(fd)
        if not handed:
            sock.close()


def watch_warm(pid: int, conn: socket.socket, rest: bytes, grace: float, stop: threading.Event,
               driver_fd: int = 0) -> Optional[int]:
    """:func:`watch` for a worker the template forked: its exit status (``subprocess``-style)
    comes from ``conn``. None if the template went away first (the worker is then killed)."""
    status = []  # type: List[int]
    gone = threading.Event()  # the template answered, or is gone

    def wait_template() -> None:
        buf = rest
        try:
            conn.settimeout(None)
            while b"\n" not in buf:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                buf += chunk
            if b"\n" in buf:
                status.append(int(json.loads(buf.partition(b"\n")[0].decode("ascii"))["exit"]))
        except (OSError, ValueError, KeyError, TypeError):
            pass
        gone.set()
        stop.set()

    until_stopped(stop, wait_template, "bootstrap-template", driver_fd)
    if not gone.is_set():  # asked to stop, or the driver is gone
        killpg(pid, signal.SIGTERM)
        gone.wait(grace)
    killpg(pid, signal.SIGKILL)  # whatever is left of the group
    gone.wait(REAP_SECONDS)
    conn.close()
    return status[0] if status else None


def exit_code(status: int) -> int:
    """A wait status as ``subprocess`` reports it: the exit code, or -N for signal N."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def main(stdin: IO[str], stdout: IO[str]) -> int:
    """Read the launch request, start the worker, watch it; the watchdog's exit status."""
    cfg = json.loads(stdin.readline())
    report = reporter(cfg["mark"], stdout)
    env = worker_env(os.environ, cfg["env"])
    keys = cfg.pop("keys", None)  # the job's keys: through a pipe, never the environment
    command, cwd, grace = cfg["command"], cfg["cwd"], float(cfg["grace"])
    problem = enter_directory(cwd, env)
    if problem is not None:
        report(error="cwd", detail=problem)
        return 126
    found, problem = find_command(command[0], env.get("PATH", os.defpath))
    if found is None:
        report(error="not_found", detail=problem)
        return 127
    if cfg.get("template"):  # become the host's warm-start template
        return become(found, command, env, report)

    warm = cfg.get("warm")
    if warm:
        started = warm_spawn(str(warm["socket"]), command, env, os.getcwd(), grace, keys)
        if isinstance(started, str):
            report(fallback=started)
        else:
            conn, pid, rest = started
            keys = cfg = None
            report(pid=pid, pgid=pid, watchdog=os.getpid(), warm=True)
            stop = threading.Event()
            stop_on_signals(stop)
            code = watch_warm(pid, conn, rest, grace, stop)
            if code is None:
                sys.stderr.write("elasticrun: the warm-start template on this host went away while the worker "
                                 "ran; the worker was stopped\n")
                return 255
            report(exit=code)
            return code if code >= 0 else 128 - code

    pid, gate, errors = spawn(found, command, env, keys)
    keys = cfg = None  # the watchdog keeps no copy
    report(pid=pid, pgid=pid, watchdog=os.getpid())
    failed = release(gate, errors)
    if failed:
        os.waitpid(pid, 0)
        report(error="exec", detail=failed.decode("utf-8", "replace"))
        return 126

    stop = threading.Event()
    stop_on_signals(stop)
    status = watch(pid, grace, stop)
    if status is None:
        return 255
    code = exit_code(status)
    report(exit=code)
    return code if code >= 0 else 128 - code


def become(program: str, argv: List[str], env: Dict[str, str], report: Callable[..., None]) -> int:
    """``execve`` the template (it only returns if that failed)."""
    for name in ("SIGPIPE", "SIGXFSZ"):  # as spawn() leaves them for a worker
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    sys.stdout.flush()
    try:
        os.execve(program, argv, env)
    except OSError as exc:
        report(error="exec", detail="%s: %s" % (argv[0], exc.strerror or exc))
    return 126


def run() -> None:
    """The process's whole life: ``main``, then exit at once (no interpreter teardown)."""
    try:
        code = main(sys.stdin, sys.stdout)
    except BaseException:
        import traceback
        traceback.print_exc()
        code = 125
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


if __name__ == "__main__":
    run()
