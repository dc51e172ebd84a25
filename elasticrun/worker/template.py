"""The warm-start template: one process per host that imports torch once and forks workers.

    python -c OWN_MAIN elasticrun.worker.template --name elasticrun-JOB [--preload MOD,...] [--script PATH | --module MOD]

Started by the driver (this machine's hosts) or over SSH by the remote bootstrap (other hosts),
with the environment every worker of the job shares. It imports torch, elasticrun's worker
modules and the ``--preload`` modules, pays torch's lazy first-optimizer import, stops the
thread pool OpenBLAS starts when it loads, then listens on a unix socket in a new private
directory (mode 0700, named after ``--name``) and prints one line on stdout:
``elasticrun-template ready {"socket": PATH, ...}``. For each request (the wire format is in
``elasticrun/common/warmstart.py``) it either answers ``fallback`` (start a fresh process
instead) or forks the worker, which then runs the user's script as ``python script.py`` would:

* its own session and process group; the standard streams and the key pipe it was sent; its
  own environment (replacing the template's), working directory, ``sys.argv``,
  ``sys.orig_argv``, ``sys.executable`` and ``sys.path[0]``; new standard stream objects
  (buffered as that interpreter's would be); the signal handlers the template changed put back;
  Python's ``random``, numpy's global generator and torch's default generator reseeded from
  ``os.urandom``; a new ``multiprocessing`` auth key;
* the script in a new ``__main__`` module (``-m``: the module, through runpy as ``python -m``
  does); ``sys.exit(n)`` gives n, an uncaught exception prints its traceback through
  ``sys.excepthook`` and gives 1, and the interpreter then shuts down as usual (non-daemon
  threads joined, ``atexit`` handlers run).

The template waits for its children (it is the only process that can) and sends each exit
status to the client that asked; a client that disconnects first gets its worker stopped
(SIGTERM, then SIGKILL after the grace period). It never starts a thread: it serves with one
``epoll`` loop, and checks ``/proc/self/task`` before every fork (more than one thread: it
answers ``fallback``). It ends when its standard input reaches EOF (the driver, or the SSH
connection, is gone) or on SIGTERM/SIGINT/SIGHUP: it stops its workers the same way, removes
its directory and exits.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import ctypes
import gc
import importlib
import importlib.machinery
import io
import json
import linecache
import os
import random
import runpy
import secrets
import selectors
import signal
import socket
import struct
import sys
import time
import traceback
import types
import zipfile
from dataclasses import dataclass, field
from typing import Any, NoReturn

from elasticrun.common import env as envvars
from elasticrun.common import warmstart
from elasticrun.common.warmstart import PythonCommand

#: Imported by every template (``--bare`` skips them: the tests of the mechanics).
DEFAULT_PRELOAD = ("torch", "elasticrun.torch", "cloudpickle")
#: Signals the template handles itself, put back as they were for each worker.
HANDLED = (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
#: torch's switch to count GPUs through NVML, which does not initialize CUDA (fork-safe).
NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
#: A client has this long to send its whole request.
REQUEST_SECONDS = 30.0
#: After SIGKILL, how long to wait for a worker to be reaped when stopping.
REAP_SECONDS = 10.0


def say(text: str) -> None:
    """A line on the template's stderr (the driver logs it at DEBUG)."""
    try:
        os.write(2, f"elasticrun-template[{os.getpid()}]: {text}\n".encode(errors="replace"))
    except OSError:
        pass


# --- the process as a whole ------------------------------------------------------------------
def thread_names() -> list[str]:
    """The names of this process's threads (/proc/self/task)."""
    names = []
    for tid in sorted(os.listdir("/proc/self/task")):
        try:
            with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
                names.append(f.read().strip())
        except OSError:
            names.append("?")
    return names


def stop_blas_threads() -> list[str]:
    """Stop OpenBLAS's thread pool (numpy's starts one per core when it loads).

    The same call OpenBLAS makes itself before a fork (``blas_thread_shutdown_``, its
    pthread_atfork handler); it starts the pool again at its next threaded call, which in a
    worker is after the fork, with the settings it read when it loaded.
    """
    stopped: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            libs = sorted({line.split()[-1] for line in f if "openblas" in line.rsplit("/", 1)[-1].lower()})
    except OSError:
        return stopped
    for path in libs:
        try:
            lib = ctypes.CDLL(path)
            fn = getattr(lib, "blas_thread_shutdown_", None)
            if fn is not None:
                fn()
                stopped.append(os.path.basename(path))
        except OSError:
            continue
    return stopped


def cuda_initialized() -> bool:
    """Whether this process has initialized CUDA (a fork after that leaves the child's CUDA
    unusable). Asks torch only if something imported it: never initializes anything itself."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    try:
        return bool(cuda is not None and cuda.is_initialized())
    except Exception:
        return False


def preload(modules: list[str]) -> dict[str, str]:
    """Import ``modules``; the ones that failed, with why."""
    failed = {}
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # a module's import may raise anything, even SystemExit
            failed[name] = f"{type(exc).__name__}: {exc}"
    return failed


def main_path_entry(cmd: PythonCommand, cwd: str) -> str | None:
    """``sys.path[0]`` as ``python`` sets it: the script's real directory, or (``-m``) the cwd;
    None for elasticrun's own modules (``cmd.safe``: nothing is put first)."""
    if cmd.safe:
        return None
    if cmd.kind == "module":
        return cwd
    return os.path.dirname(os.path.realpath(script_path(cmd, cwd)))


def script_path(cmd: PythonCommand, cwd: str) -> str:
    """The script's ``__file__``: absolute, as given otherwise (not normalised), as Python has it."""
    return cmd.target if os.path.isabs(cmd.target) else os.path.join(cwd, cmd.target)


def same_interpreter(a: str, b: str) -> bool:
    """The same executable in the same directory (a venv is its directory, not the binary)."""
    return (os.path.dirname(os.path.abspath(a)) == os.path.dirname(os.path.abspath(b))
            and os.path.realpath(a) == os.path.realpath(b))


#: Directories of templates that are gone: what each start removes at most (bounded work).
SWEEP_AT_MOST = 64
#: An empty directory older than this is a template's that died before it could bind.
EMPTY_STALE_SECONDS = 60.0


def sweep_stale_dirs(base: str, prefix: str = "elasticrun-", now: float | None = None) -> int:
    """Remove this user's template directories in ``base`` whose template is gone; how many.

    A template removes its directory whenever it ends, and the driver removes the directory of
    a template it had to kill; only a SIGKILL of both (a killed session or process group)
    leaves one, and each such job would leave another in /tmp for good. Only a directory that
    is this user's own, mode 0700, not a link, holding nothing but a ``template.sock`` over a
    minute old with no one listening on it (ECONNREFUSED), or holding nothing for over a minute,
    is removed: a live template answers the connection (and drops it quietly), and no one else
    can change what is inside a 0700 directory of ours."""
    removed = 0
    now = time.time() if now is None else now
    try:
        entries = [e for e in os.scandir(base) if e.name.startswith(prefix)]
    except OSError:
        return 0
    for entry in entries:
        if removed >= SWEEP_AT_MOST:
            break
        try:
            st = entry.stat(follow_symlinks=False)
            if (entry.is_symlink() or not entry.is_dir(follow_symlinks=False) or st.st_uid != os.getuid()
                    or st.st_mode & 0o777 != 0o700):
                continue
            inside = os.listdir(entry.path)
            if inside == ["template.sock"]:
                sock_path = os.path.join(entry.path, "template.sock")
                # A socket bound but not yet listened on refuses too: only an old one is judged.
                if now - os.lstat(sock_path).st_mtime < EMPTY_STALE_SECONDS or not socket_is_dead(sock_path):
                    continue
                os.unlink(sock_path)
            elif inside or now - st.st_mtime < EMPTY_STALE_SECONDS:
                continue
            os.rmdir(entry.path)
            removed += 1
        except OSError:
            continue  # gone meanwhile, or not ours to judge
    return removed


def socket_is_dead(path: str) -> bool:
    """No process listens on the unix socket ``path`` (its owner is gone)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(path)
        return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False  # not a socket, a full backlog, ...: not ours to remove
    finally:
        s.close()


def make_private_dir(name: str) -> str:
    """A new directory only this user can enter, named ``NAME-RANDOM``; the first usable base
    is first swept of directories earlier templates left (:func:`sweep_stale_dirs`)."""
    candidates = [os.environ.get("XDG_RUNTIME_DIR"), os.environ.get("TMPDIR"), "/tmp"]
    for base in [b for b in candidates if b]:
        if len(base) > 60 or not os.path.isdir(base) or not os.access(base, os.W_OK | os.X_OK):
            continue  # unix socket paths are short (108 bytes)
        swept = sweep_stale_dirs(base)
        if swept:
            say(f"removed {swept} director{'y' if swept == 1 else 'ies'} of templates that are gone in {base}")
        for _ in range(10):
            path = os.path.join(base, f"{name[:40]}-{secrets.token_hex(4)}")
            try:
                os.mkdir(path, 0o700)
            except FileExistsError:
                continue
            os.chmod(path, 0o700)
            return path
    raise OSError("no directory for the template's socket (XDG_RUNTIME_DIR, TMPDIR, /tmp)")


def proc_areas() -> tuple[int, int, int, int] | None:
    """This process's argument and environment areas (start, end, start, end) from
    /proc/self/stat, or None (an old kernel, or no /proc)."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b") ", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(x) for x in fields[48 - 3:52 - 3])
    except (OSError, IndexError, ValueError):
        return None
    return (arg_start, arg_end, env_start, env_end) if arg_start < arg_end and env_start < env_end else None


def show_as(areas: tuple[int, int, int, int] | None, original_env: bytes, command: list[str],
            env: dict[str, str]) -> None:
    """In a forked worker: make ``/proc/self/cmdline`` and ``/proc/self/environ`` (what ``ps``,
    ``top`` and monitoring read) show the worker's command and environment, not the
    template's, by writing over the areas the kernel reads them from. Left as they are if
    they do not fit (a template not started with room for them)."""
    if areas is None:
        return
    arg_start, arg_end, env_start, env_end = areas
    # The environment first: whoever sees the worker's command line sees its environment too.
    block = warmstart.environ_area(original_env, env)
    if block is not None and len(original_env) == env_end - env_start:
        ctypes.memmove(env_start, block, len(block))
    argv = warmstart.argv_area(arg_end - arg_start, command)
    if argv is not None:
        ctypes.memmove(arg_start, argv, len(argv))


# --- serving ---------------------------------------------------------------------------------
@dataclass
class Client:
    sock: socket.socket
    since: float
    buf: bytearray = field(default_factory=bytearray)
    fds: list[int] = field(default_factory=list)
    need: int | None = None
    child: int | None = None

    def close_fds(self) -> None:
        for fd in self.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds = []


def leave_seconds(env: dict[str, Any]) -> float:
    """A worker's limit for a graceful leave (its ``--sigterm-grace``) from its request's
    environment; 0 if not said."""
    try:
        value = float(env.get(envvars.SIGTERM_GRACE) or 0.0)
    except (TypeError, ValueError):
        return 0.0
    return value if 0.0 <= value < 1e6 else 0.0


@dataclass
class Child:
    pid: int
    client: Client | None
    grace: float
    leave: float = 0.0  # its --sigterm-grace: how long a graceful leave may take
    kill_at: float | None = None  # SIGKILL due then (a stop began)


@dataclass
class WorkerJob:
    """What a forked child runs once it has left the template's loop."""

    cmd: PythonCommand
    path: str  # the script's __file__, or "" for -m
    interpreter: str


class Template:
    def __init__(self, listener: socket.socket, socket_path: str, grace: float, startup_env: dict[str, str],
                 handlers: dict[int, Any], areas: tuple[int, int, int, int] | None = None,
                 original_env: bytes = b""):
        """``startup_env``, ``handlers``: the environment and the signal handlers the process
        started with (before any import), which its workers' must match, and get back."""
        self.pid = os.getpid()
        self.listener = listener
        self.socket_path = socket_path
        self.grace = grace
        self.startup_env = startup_env
        self.handlers = handlers
        self.areas, self.original_env = areas, original_env
        # What the imports changed in os.environ: a fresh worker's imports would do it too.
        self.import_env = {k: v for k, v in os.environ.items() if startup_env.get(k) != v}
        self.import_unset = [k for k in startup_env if k not in os.environ]
        self.clients: dict[int, Client] = {}  # by socket fd
        self.children: dict[int, Child] = {}
        self.stopping = False
        self.stop_deadline: float | None = None
        self.sel = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)

    # -- signals -----------------------------------------------------------------------------
    def install_handlers(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop (wakeup fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, self._on_stop_signal)

    def _on_stop_signal(self, signum: int, frame: Any) -> None:
        self.begin_stop(f"signal {signal.Signals(signum).name}", leaving=True)

    # -- the loop ----------------------------------------------------------------------------
    def serve(self) -> WorkerJob | None:
        """Serve until told to stop: None. In a forked child: the job it is to run."""
        self.sel.register(0, selectors.EVENT_READ, "driver")
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(self.wake_r, selectors.EVENT_READ, "wake")
        while True:
            self.reap()
            now = time.monotonic()
            self.timers(now)
            if self.stopping and (not self.children or (self.stop_deadline and now >= self.stop_deadline)):
                if self.children:
                    say(f"{len(self.children)} worker(s) not reaped within {REAP_SECONDS:g} s after SIGKILL")
                return None
            for key, _ in self.sel.select(self.next_timeout(now)):
                what = key.data
                if what == "driver":
                    self.read_driver()
                elif what == "accept":
                    self.accept()
                elif what == "wake":
                    try:
                        while os.read(self.wake_r, 512):
                            pass
                    except OSError:
                        pass
                else:
                    job = self.on_client(what)
                    if job is not None:
                        return job  # the child, on its way out of the loop

    def next_timeout(self, now: float) -> float:
        due = [c.since + REQUEST_SECONDS for c in self.clients.values() if c.child is None]
        due += [c.kill_at for c in self.children.values() if c.kill_at is not None]
        if self.stop_deadline is not None:
            due.append(self.stop_deadline)
        return max(0.0, min(due) - now) if due else 60.0

    def timers(self, now: float) -> None:
        for client in [c for c in self.clients.values() if c.child is None and now > c.since + REQUEST_SECONDS]:
            say("a client sent no whole request within %g s" % REQUEST_SECONDS)
            self.drop(client)
        for child in self.children.values():
            if child.kill_at is not None and now >= child.kill_at:
                child.kill_at = None
                killpg(child.pid, signal.SIGKILL)

    def read_driver(self) -> None:
        try:
            data = os.read(0, 4096)
        except OSError:
            data = b""
        if not data:
            self.sel.unregister(0)
            self.begin_stop("its standard input was closed (the driver is gone)")
            self.driver_gone(time.monotonic())

    def driver_gone(self, now: float) -> None:
        """No leave can complete without the driver: a SIGKILL due later than ``grace`` from
        now (a stop begun by a signal) is brought forward."""
        for child in self.children.values():
            if child.kill_at is not None:
                child.kill_at = min(child.kill_at, now + child.grace)
        if self.stopping and self.children:
            self.stop_deadline = max(c.kill_at or now for c in self.children.values()) + REAP_SECONDS

    def begin_stop(self, why: str, leaving: bool = False) -> None:
        """Stop the workers: SIGTERM, SIGKILL after their grace. ``leaving``: this template was
        signalled itself (the host is going, and so were its workers, which an elastic worker
        takes as notice to leave at its next commit): SIGKILL only after their
        ``--sigterm-grace`` and then the grace, so that a graceful leave is not cut short."""
        if self.stopping or os.getpid() != self.pid:  # never in a child still on its way out
            return
        self.stopping = True
        say(f"stopping: {why}")
        try:
            self.sel.unregister(self.listener)
        except (KeyError, ValueError):
            pass
        self.listener.close()
        try:
            os.unlink(self.socket_path)
        except OSError:
            pass
        for client in [c for c in self.clients.values() if c.child is None]:
            self.drop(client)
        now = time.monotonic()
        for child in self.children.values():
            self.stop_child(child, now, leaving)
        self.stop_deadline = max([c.kill_at or now for c in self.children.values()] + [now]) + REAP_SECONDS

    def stop_child(self, child: Child, now: float, leaving: bool = False) -> None:
        if child.kill_at is None:
            killpg(child.pid, signal.SIGTERM)
            child.kill_at = now + child.grace + (child.leave if leaving else 0.0)

    def accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                say(f"accept: {exc}")
                return
            uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
            if uid != os.getuid():  # the directory is private; this is the second lock
                say(f"refused a connection from uid {uid}")
                sock.close()
                continue
            sock.setblocking(False)
            client = Client(sock, time.monotonic())
            self.clients[sock.fileno()] = client
            self.sel.register(sock, selectors.EVENT_READ, client)

    def drop(self, client: Client) -> None:
        client.close_fds()
        self.clients.pop(client.sock.fileno(), None)
        try:
            self.sel.unregister(client.sock)
        except (KeyError, ValueError):
            pass
        client.sock.close()

    def send(self, client: Client, **fields: Any) -> None:
        try:
            client.sock.setblocking(True)
            client.sock.settimeout(2.0)
            client.sock.sendall(warmstart.reply(**fields))
        except OSError:
            pass  # the client is gone: its EOF (or the exit) ends it
        finally:
            try:
                client.sock.setblocking(False)
            except OSError:
                pass

    def on_client(self, client: Client) -> WorkerJob | None:
        try:
            data, fds, flags, _ = socket.recv_fds(client.sock, 1 << 16, len(warmstart.FD_NAMES))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError:
            data, fds, flags = b"", [], 0
        client.fds += fds
        if flags & socket.MSG_CTRUNC:
            self.send(client, fallback="too many descriptors came with the request")
            self.drop(client)
            return None
        if not data:  # the client is gone
            if client.child is not None and client.child in self.children:
                self.children[client.child].client = None
                self.stop_child(self.children[client.child], time.monotonic())
            self.drop(client)
            return None
        if client.child is not None:
            return None  # nothing more is expected from it
        client.buf += data
        try:
            if client.need is None and len(client.buf) >= 4:
                client.need = warmstart.request_length(bytes(client.buf[:4]))
            if client.need is None or len(client.buf) < 4 + client.need:
                return None
            req = warmstart.decode_request(bytes(client.buf[4:4 + client.need]), len(client.fds))
        except warmstart.WireError as exc:
            self.send(client, fallback=str(exc))
            self.drop(client)
            return None
        return self.start_worker(client, req)

    # -- forking ----------------------------------------------------------------------------
    def refusal(self, req: dict[str, Any]) -> tuple[str, PythonCommand | None, str]:
        """(why this request must start fresh, or "", the command, its interpreter's path)."""
        cmd, why = warmstart.python_command(req["command"])
        if cmd is None:
            return why, None, ""
        env, cwd = req["env"], req["cwd"]
        if self.stopping:
            return "the template is stopping", None, ""
        if not os.path.isdir(cwd):
            return f"no directory {cwd}", None, ""
        interpreter = warmstart.interpreter_path(cmd, env, cwd)
        if interpreter is None:
            return f"{cmd.interpreter} was not found on the worker's PATH", None, ""
        if not same_interpreter(interpreter, sys.executable):
            return f"{interpreter} is not this template's interpreter ({sys.executable})", None, ""
        different = warmstart.startup_differences(self.startup_env, env)
        if different:
            return (f"the worker's {', '.join(different[:4])}{' ...' if len(different) > 4 else ''} "
                    f"differ{'s' if len(different) == 1 else ''} from the template's (read when Python "
                    f"starts)"), None, ""
        if cmd.kind == "script":
            path = script_path(cmd, cwd)
            if not os.path.isfile(path):
                return f"{path} is not a file", None, ""
            if zipfile.is_zipfile(path):
                return f"{path} is a zip archive", None, ""
        threads = thread_names()
        if len(threads) != 1:
            return (f"the template has {len(threads)} threads ({', '.join(threads)}): forking it is not "
                    f"safe"), None, ""
        if cuda_initialized():
            return ("CUDA was initialized in the template (by a --preload module): a process forked after "
                    "that cannot use the GPU"), None, ""
        return "", cmd, interpreter

    def start_worker(self, client: Client, req: dict[str, Any]) -> WorkerJob | None:
        why, cmd, interpreter = self.refusal(req)
        if cmd is None:
            self.send(client, fallback=why)
            self.drop(client)
            return None
        sync_r, sync_w = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):
                pass
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(sync_r)
            os.close(sync_w)
            self.send(client, fallback=f"fork failed: {exc.strerror or exc}")
            self.drop(client)
            return None
        if pid == 0:
            os.close(sync_r)
            return self.become_worker(client, req, cmd, interpreter, sync_w)
        os.close(sync_w)
        wait_for_byte(sync_r, 5.0)  # the child is in its own session: its group can be signalled
        os.close(sync_r)
        client.close_fds()
        client.child = pid
        self.children[pid] = Child(pid, client, float(req["grace"]), leave_seconds(req.get("env") or {}))
        self.send(client, pid=pid)
        return None

    def become_worker(self, client: Client, req: dict[str, Any], cmd: PythonCommand, interpreter: str,
                      sync_w: int) -> WorkerJob:
        """In the forked child: become the worker (everything but running the script)."""
        try:
            signal.set_wakeup_fd(-1)
            for sig, handler in self.handlers.items():  # before anyone can signal the new group
                if handler is not None:
                    signal.signal(sig, handler)
            signal.pthread_sigmask(signal.SIG_SETMASK, set())
            os.setsid()
            os.write(sync_w, b"s")
            os.close(sync_w)
            fds = list(client.fds)
            client.fds = []  # they are the worker's now
            self.close_everything()
            for target, fd in enumerate(fds[:3]):
                os.dup2(fd, target)
            for fd in set(fds[:3]):
                if fd > 2:
                    os.close(fd)
            worker_env = dict(req["env"])
            for name in self.import_unset:  # where the worker's value is the template's, the
                if worker_env.get(name) == self.startup_env.get(name):  # imports did this to it
                    worker_env.pop(name, None)
            for name, value in self.import_env.items():
                if worker_env.get(name) == self.startup_env.get(name):
                    worker_env[name] = value
            worker_env.pop(envvars.SECRET_FD, None)  # only the pipe sent with the request may be named
            worker_env.pop(envvars.DEATH_FD, None)  # and only the notice sent with it
            extra = fds[3:]
            for name, sent in ((envvars.SECRET_FD, req.get("keys")), (envvars.DEATH_FD, req.get("notice"))):
                if sent and extra:
                    fd = extra.pop(0)
                    os.set_inheritable(fd, True)  # as subprocess's pass_fds leaves it
                    worker_env[name] = str(fd)
            cwd = req["cwd"]
            os.chdir(cwd)
            os.environ.clear()
            os.environ.update(worker_env)
            time.tzset()
            try:
                show_as(self.areas, self.original_env, list(req["command"]), worker_env)
            except (OSError, ValueError, TypeError):
                pass  # only what ps shows
            become_main(cmd, req["command"], interpreter, cwd, warmstart.unbuffered(cmd, worker_env))
            return WorkerJob(cmd, script_path(cmd, cwd) if cmd.kind == "script" else "", interpreter)
        except BaseException:
            try:
                os.write(2, ("elasticrun: the warm-start template could not set up this worker:\n"
                             + traceback.format_exc()).encode(errors="replace"))
            finally:
                os._exit(127)

    def close_everything(self) -> None:
        """In the child: close every descriptor the template holds (but 0-2, replaced next)."""
        for client in list(self.clients.values()):
            client.close_fds()
            client.sock.close()
        self.clients = {}
        self.children = {}
        self.sel.close()
        self.listener.close()
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    # -- children ----------------------------------------------------------------------------
    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            child = self.children.pop(pid, None)
            if child is None:
                continue
            if child.client is not None:
                self.send(child.client, exit=warmstart.exit_code(status))
                self.drop(child.client)


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def wait_for_byte(fd: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        poller = selectors.DefaultSelector()
        try:
            poller.register(fd, selectors.EVENT_READ)
            if poller.select(left):
                try:
                    os.read(fd, 1)
                except OSError:
                    pass
                return
        finally:
            poller.close()


# --- the child: becoming `python script.py` --------------------------------------------------
def become_main(cmd: PythonCommand, command: list[str], interpreter: str, cwd: str, unbuffered: bool) -> None:
    """What the interpreter sets up before running a script, done again for this worker."""
    sys.argv = cmd.argv
    sys.orig_argv = list(command)
    sys.executable = interpreter
    set_main_path(main_path_entry(cmd, cwd))
    importlib.invalidate_caches()
    linecache.clearcache()
    standard_streams(unbuffered)
    reseed()


_main_path: list[str] = []  # the entry set_main_path put first on sys.path (none: [])


def set_main_path(entry: str | None) -> None:
    """Put ``entry`` first on ``sys.path`` as the interpreter would for the worker's command,
    in place of the template's own (the template starts through OWN_MAIN, which puts none)."""
    if _main_path and sys.path and sys.path[0] == _main_path[0]:
        del sys.path[0]
    _main_path.clear()
    if entry is not None and not getattr(sys.flags, "safe_path", False):  # (-P: Python 3.11+)
        sys.path.insert(0, entry)
        _main_path.append(entry)


def standard_streams(unbuffered: bool) -> None:
    """New ``sys.stdin``/``stdout``/``stderr`` over descriptors 0-2, as Python makes them:
    the template's encoding and errors (the same locale), buffered as ``-u``/PYTHONUNBUFFERED
    and a terminal would have them."""
    made = []
    for fd, name, write, old in ((0, "<stdin>", False, sys.__stdin__), (1, "<stdout>", True, sys.__stdout__),
                                 (2, "<stderr>", True, sys.__stderr__)):
        buffered = not (write and unbuffered)
        # Typed Any: the streams are given the names and modes a terminal's have, which the
        # IO stubs declare read-only.
        buf: Any = open(fd, "wb" if write else "rb", buffering=-1 if buffered else 0, closefd=False)
        raw = buf.raw if buffered else buf
        raw.name = name
        encoding = getattr(old, "encoding", None) or "utf-8"
        errors = getattr(old, "errors", None) or ("backslashreplace" if fd == 2 else "strict")
        stream: Any = io.TextIOWrapper(buf, encoding=encoding, errors=errors, newline="\n",
                                       line_buffering=buffered and (raw.isatty() or fd == 2),
                                       write_through=not buffered)
        stream.mode = "w" if write else "r"
        made.append(stream)
    sys.stdin, sys.stdout, sys.stderr = made
    for name, stream in zip(("__stdin__", "__stdout__", "__stderr__"), made):
        setattr(sys, name, stream)  # the originals, as a new interpreter has them (Final in the stubs)


def reseed() -> None:
    """No random state shared with the template or the other workers: reseed what a fresh
    process seeds from the OS at start (Python's ``random``, numpy's global generator, torch's
    default generator), and give ``multiprocessing`` a new auth key."""
    random.seed(os.urandom(32))
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed(int.from_bytes(os.urandom(4), "little"))
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "default_generator"):
        torch.default_generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
    process = sys.modules.get("multiprocessing.process")
    if process is not None:
        process.current_process().authkey = os.urandom(32)


def run_worker(job: WorkerJob) -> int:
    """Run the script (or module) as ``__main__``; its exit status (SystemExit propagates)."""
    main: Any = types.ModuleType("__main__")  # given __cached__ and the rest a script's __main__ has
    main.__dict__.update(__builtins__=builtins, __annotations__={})
    sys.modules["__main__"] = main
    cmd = job.cmd
    try:
        if cmd.kind == "script":
            try:
                with open(job.path, "rb") as f:
                    source = f.read()
            except OSError as exc:
                sys.stderr.write(f"{cmd.interpreter}: can't open file {job.path!r}: [Errno {exc.errno}] "
                                 f"{exc.strerror}\n")
                return 2
            main.__file__ = job.path
            main.__cached__ = None
            main.__loader__ = importlib.machinery.SourceFileLoader("__main__", job.path)
            code = compile(source, job.path, "exec", dont_inherit=True)
            exec(code, main.__dict__)
        else:
            # A preloaded module runs anew as __main__, as in a fresh process (a package runs
            # its __main__ submodule, which must be new too).
            loaded = sys.modules.get(cmd.target)
            if loaded is not None and not hasattr(loaded, "__path__"):
                del sys.modules[cmd.target]
            sys.modules.pop(cmd.target + ".__main__", None)
            run_as_main = getattr(runpy, "_run_module_as_main", None)  # what `python -m` calls
            if run_as_main is not None:
                run_as_main(cmd.target, True)
            else:
                runpy.run_module(cmd.target, run_name="__main__", alter_sys=True)
    except SystemExit:
        raise  # the interpreter turns it into the exit status, as for `python script.py`
    except KeyboardInterrupt as exc:
        raise exc.with_traceback(_user_frames(exc.__traceback__))  # the interpreter dies of SIGINT
    except BaseException as exc:
        tb = _user_frames(exc.__traceback__)
        exc.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        sys.excepthook(type(exc), exc, tb)
        return 1
    return 0


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback without the template's own frames at its top."""
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    return tb


# --- the template's life ---------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m elasticrun.worker.template", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default="elasticrun", help="prefix of the private directory's name")
    p.add_argument("--preload", action="append", default=[], metavar="MOD[,MOD...]",
                   help="also import these modules (repeatable)")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--script", metavar="PATH", help="the workers' script: sys.path[0] while preloading")
    what.add_argument("--module", metavar="MOD", help="the workers' -m module: sys.path[0] is the cwd")
    p.add_argument("--own-module", action="store_true",
                   help="--module is elasticrun's own (run through OWN_MAIN): no sys.path[0] for it")
    p.add_argument("--grace", type=float, default=5.0, help="SIGTERM -> SIGKILL when stopping a worker")
    p.add_argument("--bare", action="store_true", help="import nothing but this module (tests)")
    p.add_argument("--room", default="", help="filler: room for a worker's command line in /proc/PID/cmdline")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    areas = proc_areas()
    original_env = ctypes.string_at(areas[2], areas[3] - areas[2]) if areas is not None else b""
    os.environ.pop(warmstart.ROOM_VAR, None)
    startup_env = dict(os.environ)
    handlers: dict[int, Any] = {s: signal.getsignal(s) for s in HANDLED}
    args = parse_args(sys.argv[1:] if argv is None else argv)
    cwd = os.getcwd()
    if args.script or args.module:
        what = PythonCommand("python", "script" if args.script else "module", args.script or args.module, (),
                             safe=args.own_module)
        set_main_path(main_path_entry(what, cwd))
    # No collections while importing: torch's import makes millions of objects and the
    # collector's passes over them cost ~0.3 s of the ~1.8 s (enabled again before serving).
    gc.disable()
    modules = [] if args.bare else list(DEFAULT_PRELOAD)
    modules += [m.strip() for item in args.preload for m in item.split(",") if m.strip()]
    # A preload module's ``torch.cuda.is_available()`` at import (``device = "cuda" if ...``)
    # would initialize the CUDA driver (cuInit), which leaves every forked worker without a
    # GPU while torch.cuda.is_initialized() stays False. torch asks NVML instead (fork-safe)
    # while this is set; set only for the imports here, so no worker inherits it.
    nvml_check = NVML_CHECK not in os.environ
    if nvml_check:
        os.environ[NVML_CHECK] = "1"
    try:
        failed = preload(modules)
        if not args.bare and "elasticrun.torch" not in failed:
            from elasticrun.worker import runtime

            runtime.warm_up()
    finally:
        if nvml_check:
            os.environ.pop(NVML_CHECK, None)
    blas = stop_blas_threads()
    directory = make_private_dir(args.name)
    path = os.path.join(directory, "template.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(128)
    listener.setblocking(False)
    template = Template(listener, path, args.grace, startup_env, handlers, areas, original_env)
    template.install_handlers()
    threads = thread_names()
    if len(threads) != 1:
        say(f"{len(threads)} threads after the imports ({', '.join(threads)}): every worker starts fresh")
    if cuda_initialized():
        say("CUDA was initialized by the imports (a --preload module): every worker starts fresh, since a "
            "process forked after CUDA's initialization cannot use the GPU")
    # The imported modules' objects stay out of every later collection (the workers' pages stay
    # shared, copy-on-write). No gc.collect() first: it costs 0.15 s for a few thousand cycles
    # the imports left, which the freeze keeps (a few hundred KiB).
    gc.freeze()
    gc.enable()
    print(warmstart.READY_PREFIX + json.dumps({
        "socket": path, "pid": os.getpid(), "python": sys.executable, "preloaded": [m for m in modules if m not in failed],
        "failed": failed, "threads": len(threads), "blas_stopped": blas, "cuda_initialized": cuda_initialized(),
        "seconds": round(time.monotonic() - started, 3)}), flush=True)
    job = template.serve()
    if job is not None:  # a forked child: run the worker in place of the template
        return run_worker(job)
    try:
        os.unlink(path)
    except OSError:
        pass
    try:
        os.rmdir(directory)
    except OSError:
        pass
    end_template()


def end_template() -> NoReturn:
    """The template's own end, without the interpreter's teardown: freeing torch's modules one
    by one takes ~0.45 s here, and the job's end waits for this exit. No user code ran in this
    process but the ``--preload`` imports, whose ``atexit`` handlers still run; it never started a
    thread; what it printed is flushed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
