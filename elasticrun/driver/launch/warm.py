"""The driver's side of warm worker start: this machine's template, and asking a template for a worker.

A template (``elasticrun/worker/template.py``, a separate process: the driver never imports
torch) has imported torch and elasticrun once and forks each new worker of its host in a few
milliseconds instead of the ~1.5 s a new interpreter takes. The wire format is in
``elasticrun/common/warmstart.py``.

* :class:`LocalTemplate`: the template of this machine's hosts (every name of this machine
  shares it), started when the job starts, in parallel with discovery. Its standard input is a
  pipe from the driver: when the driver exits, however it exits (SIGKILL included), the
  template sees EOF, stops any worker it still has and exits.
* :func:`start_worker`: connect to a template's socket, send the request and the worker's
  descriptors (stdin, stdout, stderr, the key pipe), and return the :class:`WarmWorker` it
  forked, or raise :class:`Unavailable` (then the launcher starts a fresh process).
"""

from __future__ import annotations

import array
import collections
import json
import logging
import os
import shutil
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence

from elasticrun.common import warmstart
from elasticrun.common.lines import lines
from elasticrun.common.warmstart import PythonCommand, own_module_command

log = logging.getLogger("elasticrun")

#: The template's module, run with the workers' interpreter.
TEMPLATE_MODULE = "elasticrun.worker.template"


class Unavailable(Exception):
    """No warm start for this worker; the message says why (a fresh process starts instead)."""


def template_argv(python: str, name: str, cmd: PythonCommand, preload: Sequence[str], grace: float) -> list[str]:
    """The command line of a template for workers running ``cmd`` (with interpreter ``python``)."""
    argv = own_module_command(python, TEMPLATE_MODULE, "--name", name, "--grace", f"{grace:g}",
                              "--script" if cmd.kind == "script" else "--module", cmd.target)
    if cmd.safe:
        argv.append("--own-module")
    if preload:
        argv += ["--preload", ",".join(preload)]
    return argv + ["--room", " " * warmstart.ARGV_ROOM]  # ps shows a worker's command line there


def parse_ready(line: str) -> dict | None:
    """The template's ready line as a dict (None if ``line`` is not one)."""
    if not line.startswith(warmstart.READY_PREFIX):
        return None
    try:
        info = json.loads(line[len(warmstart.READY_PREFIX):])
    except ValueError:
        return None
    return info if isinstance(info, dict) and isinstance(info.get("socket"), str) else None


class LocalTemplate:
    """This machine's template process, from the job's start to its end."""

    def __init__(self, argv: list[str], env: Mapping[str, str]):
        self.argv = argv
        self.info: dict | None = None
        self.ended = False
        self._ready = threading.Event()
        self._stderr: collections.deque[str] = collections.deque(maxlen=5)
        # Its own session: a Ctrl-C on the driver's terminal is the driver's to handle.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=warmstart.with_room(env), start_new_session=True)
        self._started = time.monotonic()
        self._threads = [threading.Thread(target=self._read_stdout, name="elasticrun-template-out", daemon=True),
                         threading.Thread(target=self._read_stderr, name="elasticrun-template-err", daemon=True)]
        for t in self._threads:
            t.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for line in lines(self.proc.stdout):
            info = parse_ready(line)
            if info is not None and self.info is None:
                self.info = info
                log.debug("warm start: this machine's template (pid %d) is ready after %.2f s (its own count: "
                          "%s s): %s", self.proc.pid, time.monotonic() - self._started, info.get("seconds"),
                          info.get("socket"))
                for module, why in (info.get("failed") or {}).items():
                    log.warning("--preload %s: the warm-start template on this machine cannot import it: %s",
                                module, why)
                self._ready.set()
        self.ended = True
        self._ready.set()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for line in lines(self.proc.stderr):
            self._stderr.append(line)
            log.debug("warm start: template: %s", line)

    def wait_ready(self, timeout: float, cancel: threading.Event | None = None) -> str:
        """The template's socket once it serves; Unavailable if it does not (within ``timeout``,
        or before ``cancel`` is set)."""
        deadline = time.monotonic() + timeout
        while not self._ready.is_set():
            if cancel is not None and cancel.is_set():
                raise Unavailable("the job is stopping")
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unavailable(f"the template was not ready within {timeout:g} s")
            self._ready.wait(min(left, 0.05) if cancel is not None else left)
        if self.info is None or self.ended:
            raise Unavailable(self.why_gone())
        return self.info["socket"]

    def why_gone(self) -> str:
        """Why it no longer serves (its exit status and last stderr lines)."""
        try:
            code = self.proc.wait(1.0) if self.ended else self.proc.poll()  # its stdout closed: exiting
        except subprocess.TimeoutExpired:
            code = None
        said = " | ".join(self._stderr) or "nothing"
        return f"it exited{f' with code {code}' if code is not None else ''}; it said: {said}"

    @property
    def usable(self) -> bool:
        """False once it is known not to serve (it exited, or never got ready)."""
        return not self.ended

    def stop(self, timeout: float) -> None:
        """Close its standard input (it stops any worker it has, then exits); SIGKILL after ``timeout``."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("warm start: the template (pid %d) did not stop within %g s; killing it", self.proc.pid,
                        timeout)
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                pass
        for t in self._threads:
            t.join(2.0)
        if self.info is not None:  # a template killed before it could clean up
            shutil.rmtree(os.path.dirname(self.info["socket"]), ignore_errors=True)


class WarmWorker:
    """A worker a template forked (``pid``: also its process group), as its client sees it."""

    def __init__(self, sock: socket.socket, pid: int, rest: bytes):
        self.sock = sock
        self.pid = pid
        self._buf = rest

    def wait(self) -> int | None:
        """Its exit status (``subprocess``-style), or None if the template went away first."""
        self.sock.settimeout(None)  # as long as the worker lives
        try:
            line = _read_line(self.sock, self._buf, None)
            return int(warmstart.decode_reply(line)["exit"]) if line else None
        except (OSError, warmstart.WireError, KeyError, TypeError, ValueError):
            return None
        finally:
            self.sock.close()

    def close(self) -> None:
        self.sock.close()


def _read_line(sock: socket.socket, buf: bytes, deadline: float | None) -> bytes:
    """One reply line (b"" at EOF); ``deadline``: socket.timeout past it."""
    while b"\n" not in buf:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer")
            sock.settimeout(left)
        chunk = sock.recv(4096)
        if not chunk:
            return b""
        buf += chunk
    return buf


def peer_not_us(sock: socket.socket) -> str:
    """Why the process listening on the other end of ``sock`` is not one of this user's ("" if
    it is). The template's directory is private, but a template that stopped removes it, and
    anyone can make a new one at the same path before a launch still on its way connects: the
    request carries the worker's environment and the job's key pipe, so it goes only to a
    listener of our own user (as the template accepts only us)."""
    uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))[1]
    return "" if uid == os.getuid() else f"it is served by uid {uid}, not this user's ({os.getuid()})"


def start_worker(socket_path: str, command: Sequence[str], env: Mapping[str, str], cwd: str, fds: Sequence[int],
                 grace: float, timeout: float = 10.0, *, keys: bool | None = None,
                 notice: bool = False) -> WarmWorker:
    """Ask the template at ``socket_path`` to fork a worker running ``command``.

    ``fds``: the worker's stdin, stdout and stderr, then the job's key pipe if ``keys`` (its
    number goes in ``ELASTICRUN_SECRET_FD``, set by the template), then the worker's death
    notice if ``notice`` (``ELASTICRUN_DEATH_FD``); ``keys`` defaults to "a fourth descriptor
    came". They are sent, not given away: the caller closes its copies. Unavailable when the
    template cannot or will not.
    """
    if keys is None:
        keys = len(fds) > 3 + notice
    deadline = time.monotonic() + timeout
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    handed = False  # the socket is the worker's once the template answered
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(socket_path)
            stranger = peer_not_us(sock)
            if stranger:  # (before anything is sent: the environment, the key pipe)
                raise Unavailable(f"refused the socket at {socket_path}: {stranger}")
            data = warmstart.encode_request(command, env, cwd, grace, keys=keys, notice=notice)
            sent = sock.sendmsg([data[:1 << 16]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            if sent < len(data):  # (an empty send to a template that already answered is EPIPE)
                sock.sendall(data[sent:])
            line = _read_line(sock, b"", deadline)
        except TimeoutError:
            raise Unavailable(f"the template did not answer within {timeout:g} s") from None
        except OSError as exc:
            raise Unavailable(f"cannot reach the template at {socket_path}: {exc.strerror or exc}") from None
        if not line:
            raise Unavailable("the template closed the connection without an answer")
        first, _, rest = line.partition(b"\n")
        try:
            msg = warmstart.decode_reply(first)
        except warmstart.WireError as exc:
            raise Unavailable(str(exc)) from None
        if "fallback" in msg:
            raise Unavailable(str(msg["fallback"]))
        if not isinstance(msg.get("pid"), int):
            raise Unavailable(f"an unexpected answer: {first[:100]!r}")
        worker = WarmWorker(sock, msg["pid"], rest)
        handed = True
        return worker
    finally:
        if not handed:
            sock.close()
