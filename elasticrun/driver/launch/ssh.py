"""Starting workers on other machines over SSH (paramiko), and leaving nothing behind there.

How one remote worker runs
--------------------------
The driver opens (or reuses) one SSH connection per host and runs, in a new session channel::

    exec python3 -c 'import sys,json;exec(json.loads(sys.stdin.readline()))' elasticrun-worker JOB WORKER

The command line holds no configuration at all. Over the channel's stdin the driver then sends
two JSON lines: the source of a small *bootstrap* (``remote_bootstrap.py``, read as text from
this package: standard library only, Python 3.6+) and the launch request: the worker's
command, environment, working directory, the job's keys and a per-launch marker. The bootstrap
starts the worker in its own process group, reports the group on stdout (so ``signal()`` can
reach the whole tree the worker will start) and stays behind as a watchdog that stops that
group when its stdin reaches EOF, i.e. when the driver's connection is gone; see its docstring.

Why the environment travels over stdin (and not an SFTP temp file)
------------------------------------------------------------------
* Nothing secret is ever on a command line (``ps`` on either machine shows only the line above)
  and there is no ``argument list too long``, however large the environment.
* The job's keys travel in the same request but not in the environment: the bootstrap hands
  them to the worker through a pipe, as the local launcher does (``ELASTICRUN_SECRET_FD``, see
  ``elasticrun/common/secretpipe.py``), so ``/proc/PID/environ`` of the remote worker and
  anything it starts never holds them.
* Nothing is ever written to the remote disk, so there is nothing to clean up when the driver
  dies between "write the file" and "the remote removed it", and no window in which another
  process could read it.
* One channel, no extra round trips, and no dependence on the SFTP subsystem being enabled.
* The same pipe then serves as the liveness signal the watchdog needs: EOF on it means the
  driver's connection is gone. (Closing an SSH channel without a pty does *not* kill the remote
  command — measured — so something on the remote side has to act on it.)

Killing remote workers
----------------------
``signal()`` runs ``kill -SIG -- -PGID`` over a second channel on the host's connection (whole
tree gone in milliseconds, measured). If that is impossible (connection lost), the watchdog
does it on its own when the connection drops. A worker whose driver vanished without the
connection dropping (a network partition) exits by itself after ``ELASTICRUN_DRIVER_TIMEOUT``
without heartbeat answers; the watchdog then kills the rest of its group. Processes that call
``setsid()`` themselves leave the group and escape this, as they do with the local launcher.

Warm start
----------
A host's first Python worker also starts the host's template (``elasticrun/worker/template.py``)
on a channel of its own: the same loader and bootstrap, asked to ``exec`` the workers'
interpreter as ``python -m elasticrun.worker.template`` with the job's shared environment.
It imports torch once and serves on a unix socket in a private directory named after the job.
Later launches on that host pass the socket to their bootstrap, which asks the template to
fork the worker (see remote_bootstrap.py) and stays its watchdog. The template lives until the
connection closes (at the job's end, or the driver's death: its stdin reaches EOF). A launch
waits at most half of ``--start-timeout`` for a template that is still starting; a template that
fails to start is not tried again on that host, and its workers start fresh.

Exit statuses: the watchdog reports the worker's status like ``subprocess`` does (negative for a
signal). If that report is lost with the connection, the SSH exit status is used with the
shell's convention (128+N means signal N); with no status at all the worker counts as failed
with code 255, as ``ssh`` does.
"""

from __future__ import annotations

import errno
import functools
import getpass
import importlib.resources
import json
import logging
import os
import secrets
import shlex
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from elasticrun.common import env as envvars
from elasticrun.common import warmstart
from elasticrun.common.lines import lines
from elasticrun.driver import words
from elasticrun.driver.launching import OnExit
from elasticrun.driver.output import Output
from elasticrun.driver.launch.warm import parse_ready, template_argv

if TYPE_CHECKING:
    import paramiko

    from elasticrun.common.settings import JobSettings

log = logging.getLogger("elasticrun")

#: The remote command line's program: it runs the first stdin line (the bootstrap's source).
LOADER = "import sys,json;exec(json.loads(sys.stdin.readline()))"


@functools.lru_cache(maxsize=1)
def bootstrap_source() -> str:
    """The remote bootstrap's source, as sent to every remote host (read once per process)."""
    return importlib.resources.files("elasticrun.driver.launch").joinpath("remote_bootstrap.py").read_text(encoding="utf-8")


# --- pure helpers (unit-tested) --------------------------------------------------------------
class LaunchError(Exception):
    """A remote launch failed; the message names the host and the cause. ``unreachable``: the
    host did not answer (refused, no route, no answer, a handshake that never completed): a
    machine that is gone or not up yet, not a configuration every host would fail the same way."""

    def __init__(self, message: str, code: int = 255, unreachable: bool = False):
        super().__init__(message)
        self.code = code
        self.unreachable = unreachable


def split_user(host: str, default_user: str | None = None) -> tuple[str, str]:
    """``user@name`` → (user, name); a bare name gets ``default_user`` or the current user."""
    user, at, name = host.rpartition("@")
    if at and user:
        return user, name
    return (default_user or getpass.getuser()), name


def remote_command(python: str, job_id: str, worker_id: str) -> str:
    """The command line run by the remote login shell: no environment, no secret, no user command."""
    return " ".join(["exec", shlex.quote(python), "-c", shlex.quote(LOADER), "elasticrun-worker",
                     shlex.quote(job_id), shlex.quote(worker_id)])


def launch_payload(command: list[str], env: Mapping[str, str], cwd: str, grace: float, mark: str,
                   keys: bytes | None = None, warm: str | None = None, template: bool = False,
                   notice: bool = False) -> bytes:
    """What the driver writes to the channel's stdin: the bootstrap source, then the request.

    ASCII-only JSON (``ensure_ascii``), so the remote locale cannot garble it, and values that
    are not valid UTF-8 (lone surrogates from ``os.environ``) come out byte-for-byte the same.
    ``keys`` (the job's key blob, ASCII) reach the worker through a pipe, not its environment.
    ``warm``: the socket of the host's warm-start template; ``template``: the command *is* it.
    ``notice``: the watchdog hands the worker a death notice and reports ``{"dying"}`` as soon
    as it fires (``common/deathnotice.py``).
    """
    request = {"mark": mark, "command": list(command), "env": dict(env), "cwd": cwd, "grace": grace,
               "keys": keys.decode("ascii") if keys is not None else None}
    if warm is not None:  # the host's template socket: ask it to fork the worker first
        request["warm"] = {"socket": warm}
    if template:  # this command is the host's template: the bootstrap becomes it
        request["template"] = True
    elif notice:
        request["notice"] = True
    return (json.dumps(bootstrap_source()) + "\n" + json.dumps(request) + "\n").encode("ascii")


def decode_exit_status(status: int) -> int:
    """An SSH exit status as a ``subprocess``-style code: 128+N (the shell's signal N) → -N."""
    if 128 < status <= 128 + 64:
        return 128 - status
    return status


# --- SSH connections -------------------------------------------------------------------------
#: The share of --start-timeout an SSH connection may take (see SSHOptions.connect_timeout).
START_SHARE = 0.9
#: A newcomer's host that refuses the connection or has no route yet (its sshd or network is
#: still starting) is tried again after these pauses (doubling) until its connect deadline.
_RETRY_FIRST = 0.25
_RETRY_MAX = 1.0
_RETRY_LAST = 0.1
_NOT_UP_YET = frozenset({errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.ENETUNREACH})


@dataclass(frozen=True)
class SSHOptions:
    port: int = 22
    user: str | None = None
    identity_file: str | None = None
    known_hosts: str | None = None  # default ~/.ssh/known_hosts
    accept_unknown_hosts: bool = False
    # Nine tenths of --start-timeout: a host whose handshake hangs is then failed by the launcher
    # with its cause, before the driver's own --start-timeout says only "did not contact".
    connect_timeout: float = 27.0
    remote_cwd: str | None = None  # default: the driver's working directory
    python: str = "python3"
    stop_grace: float = 5.0
    warm_start: bool = True  # start each host's template, fork its workers from it
    preload: tuple[str, ...] = ()

    @classmethod
    def from_settings(cls, s: "JobSettings") -> "SSHOptions":
        return cls(port=s.ssh_port, user=s.ssh_user, identity_file=s.ssh_identity_file,
                   known_hosts=s.ssh_known_hosts, accept_unknown_hosts=s.ssh_accept_unknown_hosts,
                   connect_timeout=START_SHARE * s.start_timeout, remote_cwd=s.remote_cwd, python=s.remote_python,
                   stop_grace=s.stop_grace, warm_start=s.warm_start, preload=tuple(s.preload))

    @property
    def known_hosts_path(self) -> str:
        return self.known_hosts or os.path.expanduser("~/.ssh/known_hosts")


def _host_key_policy(accept_unknown: bool, known_hosts: str) -> "paramiko.MissingHostKeyPolicy":
    import paramiko

    class Reject(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            raise LaunchError(
                f"its host key ({key.get_name()} {key.fingerprint}) is not in {known_hosts}; check the "
                f"fingerprint and add it (ssh-keyscan), or pass --ssh-accept-unknown-hosts")

    class Accept(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client: Any, hostname: str, key: Any) -> None:
            log.warning("%s: accepting its unknown host key %s %s without checking it "
                        "(--ssh-accept-unknown-hosts)", hostname, key.get_name(), key.fingerprint)

    return Accept() if accept_unknown else Reject()


class HostConnections:
    """The SSH connections to one host: normally one, more only when sshd's MaxSessions is hit."""

    def __init__(self, host: str, opts: SSHOptions):
        self.host = host
        self.opts = opts
        self.user, self.name = split_user(host, opts.user)
        self.clients: list[paramiko.SSHClient] = []
        self._lock = threading.Lock()
        self._failure: tuple[float, LaunchError] | None = None
        self.closed = False
        # The socket of a connection being made (its handshake may hang for --start-timeout:
        # a host that accepts TCP and never answers): close() shuts it, so a stopping job does
        # not wait for that.
        self._connecting: socket.socket | None = None
        self._no_new = False  # abort_connecting(): no connection is made any more

    @property
    def target(self) -> str:
        return f"{self.user}@{self.name}:{self.opts.port}"

    def _live(self) -> list["paramiko.SSHClient"]:
        return [c for c in self.clients if (t := c.get_transport()) is not None and t.is_active()]

    def open_session(self, deadline: float, patient: bool = False) -> "paramiko.Channel":
        """A new session channel, on an existing connection when one has room. ``patient``: a
        host that refuses the connection (or has no route yet) is tried again until the
        deadline, as a machine whose sshd is still starting does (see :meth:`_connect`)."""
        import paramiko

        asked_at = time.monotonic()
        for client in self._live():
            try:
                return client.get_transport().open_session(timeout=max(0.5, deadline - time.monotonic()))
            except (paramiko.ChannelException, paramiko.SSHException, EOFError):
                continue  # full (MaxSessions) or dying: try the next, then a new connection
        with self._lock:  # one connect at a time per host; those who waited share its outcome
            if self._failure is not None and self._failure[0] >= asked_at:
                raise self._failure[1]
            self.clients = self._live()  # forget dead connections
            for client in self.clients:  # someone else connected while we waited
                try:
                    return client.get_transport().open_session(timeout=max(0.5, deadline - time.monotonic()))
                except (paramiko.ChannelException, paramiko.SSHException, EOFError):
                    continue
            try:
                client = self._connect(deadline, patient)
            except LaunchError as exc:
                self._failure = (time.monotonic(), exc)
                raise
            self.clients.append(client)
            try:
                return client.get_transport().open_session(timeout=max(0.5, deadline - time.monotonic()))
            except (paramiko.SSHException, EOFError) as exc:
                raise LaunchError(f"connected to {self.target} but could not open a session: {exc}") from None

    def _connect(self, deadline: float, patient: bool = False) -> "paramiko.SSHClient":
        """Connect and authenticate. ``patient``: a refused connection, or no route to the host,
        is tried again until the deadline. A host that discovery lists as soon as it is
        provisioned (a spot node, an autoscaled group) often does not run sshd yet: failing it
        at once would blacklist a healthy machine, by default for good. Only newcomers to a
        running job are patient: the survivors train meanwhile, whereas in the first round a
        refused host would hold every other one."""
        began = time.monotonic()
        pause = _RETRY_FIRST
        while True:
            if self.closed or self._no_new:
                raise LaunchError("the job is stopping")
            timeout = deadline - time.monotonic()
            if timeout <= 0:
                raise LaunchError(f"no time left to connect to {self.target} (--start-timeout)", unreachable=True)
            try:
                sock = socket.create_connection((self.name, self.opts.port), timeout=timeout)
                break
            except socket.gaierror as exc:
                raise LaunchError(f"cannot resolve host name {self.name!r}: {exc.strerror}") from None
            except socket.timeout:
                raise LaunchError(f"cannot connect to {self.target}: no answer within {timeout:.3g} s "
                                  f"(--start-timeout)", unreachable=True) from None
            except OSError as exc:
                why = exc.strerror or str(exc)
                if not (patient and exc.errno in _NOT_UP_YET):
                    raise LaunchError(f"cannot connect to {self.target}: {why}", unreachable=True) from None
                left = deadline - time.monotonic()
                if left < _RETRY_LAST:
                    raise LaunchError(f"cannot connect to {self.target}: {why}, for "
                                      f"{time.monotonic() - began:.0f} s of trying (is sshd running there, on "
                                      f"port {self.opts.port}?)", unreachable=True) from None
                time.sleep(min(pause, left - _RETRY_LAST / 2))  # (the last try: just before the deadline)
                pause = min(_RETRY_MAX, pause * 2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # 65 -> 20-25 ms per connect
        self._connecting = sock
        try:
            if self.closed or self._no_new:  # (read after the write above: see abort_connecting)
                sock.close()
                raise LaunchError("the job is stopping")
            return self._handshake(sock, deadline)
        finally:
            self._connecting = None

    def _handshake(self, sock: socket.socket, deadline: float) -> "paramiko.SSHClient":
        import paramiko

        client = paramiko.SSHClient()
        known = self.opts.known_hosts_path
        if os.path.exists(known):
            try:
                client.load_system_host_keys(known)  # read-only: never written back
            except (OSError, paramiko.SSHException) as exc:
                sock.close()
                raise LaunchError(f"cannot read the known hosts file {known}: {exc}") from None
        client.set_missing_host_key_policy(_host_key_policy(self.opts.accept_unknown_hosts, known))
        remaining = max(0.1, deadline - time.monotonic())
        try:
            client.connect(self.name, port=self.opts.port, username=self.user, sock=sock,
                           key_filename=self.opts.identity_file, timeout=remaining, banner_timeout=remaining,
                           auth_timeout=remaining, channel_timeout=remaining)
        except LaunchError as exc:
            client.close()
            raise LaunchError(f"refusing to connect to {self.target}: {exc}") from None
        except paramiko.BadHostKeyException as exc:
            client.close()
            raise LaunchError(
                f"refusing to connect to {self.target}: its host key ({exc.key.fingerprint}) does not match "
                f"the one in {known} ({exc.expected_key.fingerprint}). Someone may be impersonating the "
                f"host, or it was reinstalled (then remove the old key: ssh-keygen -R)") from None
        except paramiko.AuthenticationException as exc:
            client.close()
            tried = f"-i {self.opts.identity_file}, " if self.opts.identity_file else ""
            raise LaunchError(f"{self.target} refused our key(s) (tried {tried}the SSH agent and ~/.ssh keys): "
                              f"{exc}") from None
        except (paramiko.SSHException, EOFError, OSError) as exc:
            client.close()
            text = str(exc) or type(exc).__name__
            if self.closed or self._no_new:
                raise LaunchError("the job is stopping") from None
            if time.monotonic() >= deadline - 0.05 or isinstance(exc, socket.timeout) or "banner" in text:
                # (paramiko's own words for a timeout, "No existing session", say nothing more)
                raise LaunchError(f"{self.target} accepted the connection but did not complete the SSH handshake "
                                  f"within {self.opts.connect_timeout:g} s (of --start-timeout "
                                  f"{self.opts.connect_timeout / START_SHARE:g} s)", unreachable=True) from None
            raise LaunchError(f"SSH to {self.target} failed: {text}") from None
        if self.closed:  # the job stopped while we connected
            client.close()
            raise LaunchError("the job is stopping")
        return client

    def run(self, command: str, timeout: float) -> int:
        """Run a short command on a new channel; its exit status (-1 if unknown)."""
        chan = self.open_session(time.monotonic() + timeout)
        try:
            chan.settimeout(timeout)
            chan.exec_command(command)
            chan.shutdown_write()
            if not chan.status_event.wait(timeout):
                return -1
            return chan.recv_exit_status()
        finally:
            chan.close()

    def abort_connecting(self) -> None:
        """Make no new connection, and give up the one being made (its handshake may hang for
        --start-timeout): the job is stopping. The connector sets ``_connecting`` and then
        reads the flag; this sets the flag and then reads ``_connecting``: one of the two sees
        the other."""
        self._no_new = True
        sock = self._connecting
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # the handshake's read returns at once
            except OSError:
                pass

    def close(self) -> None:
        self.closed = True
        self.abort_connecting()
        for client in self.clients:
            client.close()


# --- remote workers --------------------------------------------------------------------------
@dataclass
class _Remote:
    worker_id: str
    host: str
    mark: str  # per-launch marker of the bootstrap's report lines on stdout
    channel: Any = None
    pgid: int | None = None  # the worker's process group, once the bootstrap reported it
    error: dict | None = None  # the bootstrap's report of why it could not start the worker
    exit_report: int | None = None  # the worker's status, as reported by the watchdog
    cancel: int | None = None  # a signal asked for before the worker's group was known
    started: threading.Event = field(default_factory=threading.Event)  # reported, or gone
    finished: threading.Event = field(default_factory=threading.Event)  # the watchdog is done
    reported: bool = False  # on_exit was called (once: on the watchdog's "dying" or at the end)
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=6))
    threads: list[threading.Thread] = field(default_factory=list)
    stderr_pump: threading.Thread | None = None


@dataclass
class _Template:
    """A host's warm-start template, as the driver sees it."""

    host: str
    socket: str | None = None  # once it serves
    failure: str | None = None  # why it never served
    ended: bool = False  # its channel closed
    warned: bool = False  # its failure was said (once)
    channel: Any = None
    ready: threading.Event = field(default_factory=threading.Event)  # serving, or never will
    stderr_tail: deque = field(default_factory=lambda: deque(maxlen=5))


class SSHLauncher:
    """Runs workers on remote hosts; same interface as :class:`LocalLauncher` plus ``host``.

    ``launch()`` returns at once: connecting (in parallel across hosts, reusing one connection
    per host), starting the remote bootstrap and waiting for it happen on a thread per worker,
    so the driver loop never blocks on the network. Every launch ends in exactly one
    ``on_exit(worker_id, code)``; a launch that fails logs the host and the cause first.
    """

    def __init__(self, sink: Output, on_exit: OnExit, options: SSHOptions):
        import paramiko  # noqa: F401  (fail here, not in a worker thread, if it is missing)

        # paramiko logs its own view of every failure we report with the host and the cause.
        plog = logging.getLogger("paramiko")
        if plog.level == logging.NOTSET and not log.isEnabledFor(logging.DEBUG):
            plog.setLevel(logging.CRITICAL)
        self._sink = sink
        self._on_exit = on_exit
        self.opts = options
        self._hosts: dict[str, HostConnections] = {}
        self._remotes: dict[str, _Remote] = {}
        self._templates: dict[str, _Template] = {}
        self._lock = threading.Lock()
        self._stopping = False

    def connections(self, host: str) -> HostConnections:
        with self._lock:
            conns = self._hosts.get(host)
            if conns is None:
                conns = self._hosts[host] = HostConnections(host, self.opts)
                if self._stopping:  # a launch thread that comes after stop_all: it connects nowhere
                    conns.abort_connecting()
            return conns

    # --- launching ------------------------------------------------------------------------
    def launch(self, worker_id: str, command: list[str], env: dict[str, str], host: str | None = None,
               keys: bytes | None = None) -> None:
        if host is None:
            raise ValueError("SSHLauncher.launch needs the host")
        r = _Remote(worker_id, host, f"@@elasticrun:{secrets.token_hex(8)}@@ ")
        with self._lock:
            self._remotes[worker_id] = r
        t = threading.Thread(target=self._run, args=(r, command, env, keys), name=f"elasticrun-ssh-{worker_id}",
                             daemon=True)
        r.threads.append(t)
        t.start()

    def _run(self, r: _Remote, command: list[str], env: dict[str, str], keys: bytes | None) -> None:
        code, detail = 255, ""
        try:
            code = self._start_and_wait(r, command, env, keys)
        except LaunchError as exc:
            code, detail = exc.code, words.never_started(str(exc), unreachable=exc.unreachable)
            log.error("%s: could not start worker %s over SSH: %s", r.host, r.worker_id, exc)
        except Exception as exc:  # a bug or an unexpected paramiko error: still a failed worker
            log.error("%s: could not start worker %s over SSH: %s: %s", r.host, r.worker_id,
                      type(exc).__name__, exc)
        finally:
            r.started.set()
            if r.channel is not None:
                r.channel.close()
            r.finished.set()
            self._report_exit(r, code, detail)
            self._forget(r)

    def _forget(self, r: _Remote) -> None:
        """Once its output is all out (its channel is closed: the pumps are at its end), the
        worker is forgotten: a job that replaces workers for days keeps no record (channel,
        buffers, threads) of each one. If a pump is still copying, the worker is kept for drain()."""
        for t in r.threads:
            if t is not threading.current_thread():
                t.join(2.0)
        with self._lock:
            if not any(t.is_alive() for t in r.threads if t is not threading.current_thread()):
                self._remotes.pop(r.worker_id, None)

    def knows(self, worker_id: str) -> bool:
        """The worker was started here and is not yet forgotten."""
        return worker_id in self._remotes

    def _report_exit(self, r: _Remote, code: int, detail: str = "") -> None:
        """``on_exit`` exactly once per worker: when the watchdog's notice says it is dying
        (before the kernel has torn it down), or when the watchdog is done."""
        with self._lock:
            if r.reported:
                return
            r.reported = True
        self._on_exit(r.worker_id, code, detail)

    def _start_and_wait(self, r: _Remote, command: list[str], env: dict[str, str], keys: bytes | None) -> int:
        import paramiko

        conns = self.connections(r.host)
        deadline = time.monotonic() + self.opts.connect_timeout
        if self._stopping or r.cancel is not None:
            return -(r.cancel or 15)
        chan = conns.open_session(deadline, patient=env.get(envvars.JOINING) == "1")
        r.channel = chan
        if self._stopping or r.cancel is not None:
            return -(r.cancel or 15)
        job_id = env.get(envvars.JOB_ID, "-")
        cwd = self.opts.remote_cwd or os.getcwd()
        warm = self._template_socket(r, command, env, cwd, deadline)
        if self._stopping or r.cancel is not None:
            return -(r.cancel or 15)
        try:
            chan.exec_command(remote_command(self.opts.python, job_id, r.worker_id))
            chan.sendall(launch_payload(command, env, cwd, self.opts.stop_grace, r.mark, keys, warm=warm,
                                        notice=True))
        except (OSError, EOFError, paramiko.SSHException) as exc:
            raise LaunchError(f"{conns.target} did not run the bootstrap: {exc or type(exc).__name__}") from None
        out = threading.Thread(target=self._pump_stdout, args=(r, chan.makefile("rb")),
                               name=f"elasticrun-output-{r.worker_id}-stdout", daemon=True)
        err = threading.Thread(target=self._pump_stderr, args=(r, chan.makefile_stderr("rb")),
                               name=f"elasticrun-output-{r.worker_id}-stderr", daemon=True)
        r.threads += [out, err]
        r.stderr_pump = err
        out.start()
        err.start()
        if not r.started.wait(max(2.0, deadline - time.monotonic())):  # python + login shell start
            chan.close()  # the bootstrap, if it ever runs, sees EOF and stops
            raise LaunchError(f"the remote bootstrap did not start within {self.opts.connect_timeout:g} s "
                              f"(--start-timeout)")
        if r.pgid is None:
            raise self._bootstrap_failure(r, chan, out)
        if r.cancel is not None:
            self._send_signal(r, r.cancel)
        chan.status_event.wait()  # set by the exit status, or when the channel/connection closes
        status = chan.exit_status  # -1 if none came
        out.join(2.0)  # the watchdog's exit report comes before its exit status
        if r.exit_report is not None:
            return r.exit_report
        if status >= 0:
            return decode_exit_status(status)
        if not self._stopping:
            log.error("%s: lost the SSH connection to worker %s; counting it as failed", r.host, r.worker_id)
        return 255

    def _bootstrap_failure(self, r: _Remote, chan: Any, out: threading.Thread) -> LaunchError:
        """Why the bootstrap reported no worker: its own report, or the shell's exit status."""
        chan.status_event.wait(5.0)
        status = chan.exit_status  # -1 if none came
        out.join(1.0)
        if r.stderr_pump is not None:
            r.stderr_pump.join(1.0)  # the shell's message
        said = " | ".join(r.stderr_tail)
        if r.error is not None:
            kind, detail = r.error.get("error"), r.error.get("detail", "")
            if kind == "cwd":
                return LaunchError(f"{detail} (the remote working directory is the driver's unless "
                                   f"--remote-cwd is given)", 126)
            if kind == "not_found":
                return LaunchError(detail, 127)
            return LaunchError(f"cannot start the worker command: {detail}", 126)
        if status == 127:
            return LaunchError(f"{self.opts.python!r} was not found there: elasticrun needs Python 3 on every "
                               f"remote host (name it with --remote-python). The remote shell said: {said}", 127)
        if status == 126:
            return LaunchError(f"{self.opts.python!r} cannot be run there: {said}", 126)
        if status < 0:
            return LaunchError("the SSH connection closed before the worker started", 255)
        return LaunchError(f"the remote bootstrap ({self.opts.python!r}) exited with code {status} before starting "
                           f"the worker: {said or 'no message'}", status or 255)

    def _pump_stdout(self, r: _Remote, f: Any) -> None:
        try:
            for line in lines(f, hold=r.mark):
                if r.mark in line:
                    before, _, rest = line.partition(r.mark)
                    if before:
                        self._sink.write(r.worker_id, "stdout", before)
                    try:
                        msg = json.loads(rest)
                    except ValueError:
                        msg = {}
                    if "pid" in msg:
                        r.pgid = int(msg["pgid"])
                        r.started.set()
                    elif "fallback" in msg:
                        log.debug("%s: worker %s starts fresh, not from the warm-start template: %s", r.host,
                                  r.worker_id, msg["fallback"])
                    elif "error" in msg:
                        r.error = msg
                        r.started.set()
                    elif "exit" in msg:
                        r.exit_report = int(msg["exit"])
                    elif "dying" in msg:
                        self._report_exit(r, int(msg["dying"]))
                    continue
                self._sink.write(r.worker_id, "stdout", line)
        except Exception as exc:  # the connection died under us
            log.debug("%s: stdout of %s: %s", r.host, r.worker_id, exc)
        finally:
            r.started.set()

    def _pump_stderr(self, r: _Remote, f: Any) -> None:
        try:
            for line in lines(f):
                if r.pgid is None:
                    r.stderr_tail.append(line)
                self._sink.write(r.worker_id, "stderr", line)
        except Exception as exc:
            log.debug("%s: stderr of %s: %s", r.host, r.worker_id, exc)

    # --- warm start ------------------------------------------------------------------------
    def _template_socket(self, r: _Remote, command: list[str], env: dict[str, str], cwd: str,
                         deadline: float) -> str | None:
        """The socket of ``r.host``'s template (started now if need be), or None: fresh."""
        cmd, _ = warmstart.python_command(command)
        if not self.opts.warm_start or cmd is None:
            return None
        with self._lock:
            t = self._templates.get(r.host)
            if t is None or (t.ended and t.socket is not None):  # none yet, or it served and died
                t = self._templates[r.host] = _Template(r.host)
                threading.Thread(target=self._run_template, args=(t, cmd, env, cwd), daemon=True,
                                 name=f"elasticrun-template-{r.host}").start()
        wait = min(self.opts.connect_timeout / 2, max(0.0, deadline - time.monotonic()))
        if not t.ready.wait(wait):
            log.debug("%s: the warm-start template is not ready after %.1f s: worker %s starts fresh", r.host,
                      wait, r.worker_id)
            return None
        if t.socket is None or t.ended:
            with self._lock:
                warn, t.warned = not t.warned and not self._stopping, True
            if warn:
                log.warning("%s: no warm-start template there (%s); its workers start as new processes", r.host,
                            str(t.failure)[:300])
            return None
        return t.socket

    def _run_template(self, t: _Template, cmd: warmstart.PythonCommand, env: dict[str, str], cwd: str) -> None:
        """The template's channel, from its start to its end (on its own thread)."""
        import paramiko

        mark = f"@@elasticrun:{secrets.token_hex(8)}@@ "
        try:
            conns = self.connections(t.host)
            chan = conns.open_session(time.monotonic() + self.opts.connect_timeout)
            t.channel = chan
            if self._stopping:
                return
            job_id = env.get(envvars.JOB_ID, "-")
            argv = template_argv(cmd.interpreter, f"elasticrun-{job_id}", cmd, self.opts.preload, self.opts.stop_grace)
            chan.exec_command(remote_command(self.opts.python, job_id, "template"))
            chan.sendall(launch_payload(argv, warmstart.with_room(warmstart.template_environment(env)), cwd, self.opts.stop_grace, mark,
                                        template=True))
            err = threading.Thread(target=self._template_stderr, args=(t, chan.makefile_stderr("rb")), daemon=True,
                                   name=f"elasticrun-template-{t.host}-err")
            err.start()
            for line in lines(chan.makefile("rb"), hold=mark):
                info = parse_ready(line)
                if info is not None and t.socket is None:
                    t.socket = info["socket"]
                    log.debug("%s: the warm-start template is ready (%s s): %s", t.host, info.get("seconds"), t.socket)
                    for module, why in (info.get("failed") or {}).items():
                        log.warning("--preload %s: the warm-start template on %s cannot import it: %s", module,
                                    t.host, why)
                    t.ready.set()
                elif mark in line:
                    try:
                        t.failure = json.loads(line.partition(mark)[2]).get("detail")
                    except ValueError:
                        pass
                else:
                    log.debug("%s: template: %s", t.host, line)
            err.join(1.0)
        except (LaunchError, OSError, EOFError, paramiko.SSHException) as exc:
            t.failure = str(exc) or type(exc).__name__
        except Exception as exc:  # never a reason for a job to fail: its workers start fresh
            t.failure = f"{type(exc).__name__}: {exc}"
        finally:
            t.ended = True
            if t.socket is None:
                t.failure = t.failure or f"it exited: {' | '.join(t.stderr_tail) or 'no message'}"
            t.ready.set()
            if t.channel is not None:
                t.channel.close()

    def _template_stderr(self, t: _Template, f: Any) -> None:
        try:
            for line in lines(f):
                t.stderr_tail.append(line)
                log.debug("%s: template: %s", t.host, line)
        except Exception as exc:
            log.debug("%s: template stderr: %s", t.host, exc)

    # --- stopping --------------------------------------------------------------------------
    def _send_signal(self, r: _Remote, sig: int) -> None:
        """``kill -SIG -- -PGID`` over a second channel; close the channel if that fails."""
        if r.pgid is None or r.finished.is_set():
            return
        try:
            status = self.connections(r.host).run(f"kill -{int(sig)} -- -{int(r.pgid)}", timeout=5.0)
            log.debug("%s: kill -%d -- -%d: status %d", r.host, sig, r.pgid, status)
        except Exception as exc:
            # The watchdog stops the worker itself once its stdin (this channel) closes.
            log.warning("%s: could not signal worker %s (%s); closing its channel instead", r.host,
                        r.worker_id, exc)
            if r.channel is not None:
                r.channel.close()

    def signal(self, worker_id: str, sig: int) -> None:
        """Signal the worker's whole remote process group, without blocking the caller."""
        r = self._remotes.get(worker_id)
        if r is None or r.finished.is_set():
            return
        if r.pgid is None:
            r.cancel = sig  # the launch thread sends it as soon as the group is known
            if r.pgid is None:
                return
        threading.Thread(target=self._send_signal, args=(r, sig), name=f"elasticrun-kill-{worker_id}",
                         daemon=True).start()

    def pid(self, worker_id: str) -> int | None:
        r = self._remotes.get(worker_id)
        return r.pgid if r else None

    def stop_all(self, grace: float) -> None:
        """SIGTERM every remote group, SIGKILL after ``grace``, then close every connection.
        Connections still being made are given up at once: nothing runs there yet, and a
        handshake that hangs must not hold the job's end for --start-timeout."""
        self._stopping = True
        with self._lock:
            live = [r for r in self._remotes.values() if not r.finished.is_set()]
            started = {r.host for r in live if r.pgid is not None}  # their signals may need a connection
            hosts = [c for h, c in self._hosts.items() if h not in started]
        for conns in hosts:
            conns.abort_connecting()
        for r in live:
            if r.pgid is None:
                r.cancel = 15
        self._signal_all(live, 15)
        deadline = time.monotonic() + grace
        for r in live:
            r.finished.wait(max(0.0, deadline - time.monotonic()))
        left = [r for r in live if not r.finished.is_set()]
        self._signal_all(left, 9)
        deadline = time.monotonic() + 5.0
        for r in left:
            if not r.finished.wait(max(0.0, deadline - time.monotonic())) and r.channel is not None:
                r.channel.close()
        with self._lock:
            hosts = list(self._hosts.values())
        for conns in hosts:  # anything still running sees EOF and is stopped by its watchdog
            conns.close()

    def _signal_all(self, remotes: list[_Remote], sig: int) -> None:
        threads = [threading.Thread(target=self._send_signal, args=(r, sig), daemon=True) for r in remotes]
        for t in threads:
            t.start()
        for t in threads:
            t.join(6.0)

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [t for r in self._remotes.values() for t in r.threads]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
