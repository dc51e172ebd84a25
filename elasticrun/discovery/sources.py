"""Where hosts come from: a user's discovery script or callable, or a fixed list (``-H`` / ``--hostfile``)."""

from __future__ import annotations

import errno
import os
import selectors
import shlex
import shutil
import signal
import subprocess
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Mapping, NoReturn

from elasticrun.common import env as envvars
from elasticrun.common.hosts import MAX_HOSTS, HostList, HostSpecError, parse_discovery_output, parse_host_entry
from elasticrun.common.paths import obeyed_file_problem

#: A discovery script's stdout is read up to this many bytes and lines; past either, the
#: script is killed and the run fails. A host per line needs far less (10,000 hosts are
#: ~300 KB), and the driver's memory must not follow a script that prints without end.
MAX_OUTPUT_BYTES = 1 << 20
MAX_OUTPUT_LINES = 100_000
#: Of its stderr only the last bytes are kept (shown when the script fails).
STDERR_TAIL_BYTES = 64 << 10


class DiscoveryError(RuntimeError):
    """The discovery script failed (non-zero exit, timeout, could not start, too much output)."""


def _check_host_count(found: HostList, what: str) -> HostList:
    if len(found.hosts) > MAX_HOSTS:
        raise DiscoveryError(f"{what} listed {len(found.hosts):,} hosts, more than the {MAX_HOSTS:,} allowed")
    return found


def discovery_command(spec: str) -> list[str]:
    """The argv that runs ``--host-discovery-script SPEC``: the path of an executable file, or,
    as horovodrun allows, a command line for ``/bin/sh`` (``"python discover.py --zone a"``).

    Checked before the job starts, so that a typo is one clear line, not a job that waits for
    hosts: ValueError names what is wrong (missing, not executable, bad quoting, unknown
    command).
    """
    if os.path.isfile(spec):
        if not os.access(spec, os.R_OK | os.X_OK):
            raise ValueError(f"{spec}: not executable (try chmod +x {spec})")
        why = obeyed_file_problem(spec)
        if why:
            raise ValueError(f"{spec}: {why}")
        return [os.path.abspath(spec)]
    try:
        words = shlex.split(spec)
    except ValueError as exc:
        raise ValueError(f"{spec!r}: cannot split it into words ({exc})") from None
    if not words:
        raise ValueError("empty command")
    first = words[0]
    if os.sep in first:
        if not os.path.isfile(first):
            raise ValueError(f"{first}: no such file")
        if not os.access(first, os.X_OK):
            raise ValueError(f"{first}: not executable (try chmod +x {first})")
        why = obeyed_file_problem(first)
        if why:
            raise ValueError(f"{first}: {why}")
    elif shutil.which(first) is None:
        raise ValueError(f"{first}: no such file" if len(words) == 1 else f"{first}: command not found")
    return ["/bin/sh", "-c", spec]


@dataclass
class ScriptDiscovery:
    """Runs the user's script (``path``: see :func:`discovery_command`); its stdout lists
    ``host[:slots]`` per line.

    The script runs in its own process group so that a timeout kills it *and* anything it
    started (``kubectl``, ``ssh``...), and a hung script can never hang the driver.
    """

    path: str
    default_slots: int
    timeout: float
    _running: subprocess.Popen | None = None
    _closed: bool = False
    _env: dict[str, str] | None = None  # None: the driver's own

    def tag(self, job_id: str) -> None:
        """Run the script with the job's id in its environment (and so whatever it starts): the
        job's reaper finds the job's processes by it, and stops them if the driver is killed
        with SIGKILL (a hung run would otherwise hold on, with its children, forever)."""
        self._env = dict(os.environ, **{envvars.JOB_ID: job_id})

    def describe(self) -> str:
        return f"discovery script {self.path}"

    def close(self) -> None:
        """Kill a run in flight (the job is ending) and refuse new ones."""
        self._closed = True
        proc = self._running
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def discover(self) -> HostList:
        if self._closed:
            raise DiscoveryError("discovery is closed: the job is ending")
        try:
            argv = discovery_command(self.path)
        except ValueError as exc:
            raise DiscoveryError(f"cannot run the discovery script: {exc}") from None
        try:
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, start_new_session=True, env=self._env)
        except OSError as exc:
            raise DiscoveryError(f"{self.path} could not be started: {_why_not_started(argv[0], exc)}") from None
        self._running = proc
        if self._closed:  # close() ran between the check and the start
            self.close()
        try:
            out, err = self._read(proc, time.monotonic() + self.timeout)
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            self._running = None
            for pipe in (proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
        if proc.returncode != 0:
            tail = err.decode("utf-8", errors="replace").strip()[-2000:] or "(no stderr)"
            raise DiscoveryError(f"{self.path} exited with code {proc.returncode}; its stderr:\n{tail}")
        found = parse_discovery_output(out.decode("utf-8", errors="replace"), self.default_slots)
        return _check_host_count(found, self.path)

    def _read(self, proc: subprocess.Popen, deadline: float) -> tuple[bytes, bytes]:
        """stdout (at most MAX_OUTPUT_BYTES and MAX_OUTPUT_LINES) and the tail of stderr, read
        as they come, until the script exits; kill it past a limit or the deadline.

        The run ends when the script does, not when its pipes close: a process it left in the
        background (``cmd &``, ``setsid``, ``ssh -f``) inherits them and may hold them open for
        good. What is in them when the script exits is still read (:data:`DRAIN_AFTER_EXIT_S`);
        then what is left of the script's process group is killed, as after a timeout."""
        out, err, lines = bytearray(), bytearray(), 0
        with selectors.DefaultSelector() as sel:
            assert proc.stdout is not None and proc.stderr is not None
            sel.register(proc.stdout, selectors.EVENT_READ, "out")
            sel.register(proc.stderr, selectors.EVENT_READ, "err")
            drain_until: float | None = None  # set once the script has exited
            while sel.get_map():
                now = time.monotonic()
                if drain_until is None and _exited(proc):
                    drain_until = min(deadline, now + DRAIN_AFTER_EXIT_S)
                if drain_until is not None and now >= drain_until:
                    _kill_group(proc)  # a background process holds the pipes: what it left in the group goes
                    break
                remaining = deadline - now
                if remaining <= 0:
                    self._timed_out(proc)
                wait = min(remaining, EXIT_POLL_S) if drain_until is None else drain_until - now
                for key, _ in sel.select(wait):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        sel.unregister(key.fileobj)
                    elif key.data == "err":
                        err += chunk
                        del err[:-STDERR_TAIL_BYTES]
                    else:
                        out += chunk
                        lines += chunk.count(b"\n")
                        if len(out) > MAX_OUTPUT_BYTES or lines > MAX_OUTPUT_LINES:
                            _kill_group(proc)
                            limit = "1 MiB" if len(out) > MAX_OUTPUT_BYTES else f"{MAX_OUTPUT_LINES:,} lines"
                            raise DiscoveryError(f"{self.path} printed more than {limit}; it was killed "
                                                 f"(a discovery script prints one host per line)")
        try:  # both pipes are closed: the script is exiting (or closed them and goes on)
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self._timed_out(proc)
        return bytes(out), bytes(err)

    def _timed_out(self, proc: subprocess.Popen) -> NoReturn:
        _kill_group(proc)
        raise DiscoveryError(f"{self.path} did not finish within {self.timeout:g} s "
                             f"(--discovery-timeout); it was killed")


def _why_not_started(path: str, exc: OSError) -> str:
    """Why exec of the script at ``path`` failed, in words that lead to the fix. The kernel's
    own error misleads for a script: "No such file or directory" for a file that is there
    means its ``#!`` interpreter is missing (with CRLF line endings it is ``/bin/sh\\r``), and
    "Exec format error" means it has no ``#!`` line, or one behind a byte-order mark."""
    if exc.errno not in (errno.ENOENT, errno.ENOEXEC) or not os.path.isfile(path):
        return str(exc.strerror)
    try:
        with open(path, "rb") as f:
            first = f.readline(256).rstrip(b"\n")
    except OSError:
        return str(exc.strerror)
    if exc.errno == errno.ENOEXEC and first.startswith(b"\xef\xbb\xbf#!"):
        return ("it starts with a byte-order mark, before its #! line (an editor's UTF-8 BOM: save it without "
                "one, or run sed -i '1s/^\\xEF\\xBB\\xBF//' on it)")
    if exc.errno == errno.ENOEXEC and not first.startswith((b"#!", b"\x7fELF")):
        return "it has no #! line (add one, e.g. #!/bin/sh)"
    if exc.errno == errno.ENOENT and first.startswith(b"#!"):
        interpreter = first[2:].lstrip(b" \t").split(b" ")[0].split(b"\t")[0].decode(errors="replace")
        if first.endswith(b"\r"):
            return f"its #! interpreter {interpreter!r} was not found (CRLF line endings: run dos2unix on it)"
        return f"its #! interpreter {interpreter!r} was not found"
    return str(exc.strerror)


#: After the script has exited, how long what is already in its pipes is still read.
DRAIN_AFTER_EXIT_S = 0.1
#: How often the script's exit is looked for while its pipes are open.
EXIT_POLL_S = 0.05


def _exited(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has exited, without reaping it (its pid stays its group's id)."""
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the script and everything it started; reap it (SIGKILL: at once)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(5.0)
    except subprocess.TimeoutExpired:  # unkillable (stuck in the kernel): not worth hanging the driver for
        pass


@dataclass
class FixedHosts:
    """A host list given on the command line: elastic for failures, never grows."""

    hosts: dict[str, int]

    def describe(self) -> str:
        return "host list " + ",".join(f"{h}:{s}" for h, s in self.hosts.items())

    def close(self) -> None:
        pass

    def discover(self) -> HostList:
        return HostList(hosts=dict(self.hosts))


class CallableDiscovery:
    """A Python callable returning ``{host: slots}`` (``elasticrun.run(discovery=...)``).

    Each call runs on its own daemon thread and is waited for at most ``timeout`` seconds: a
    callable that raises, hangs or returns something else counts as a failed discovery run
    (the driver keeps the last known hosts). A hung call cannot be interrupted in Python, so
    no new call starts until it returns; its thread is abandoned when the job ends.
    """

    def __init__(self, fn: Callable[[], Mapping[str, int]], timeout: float):
        self.fn = fn
        self.timeout = timeout
        self._closed = threading.Event()
        self._busy: threading.Thread | None = None
        self._name = getattr(fn, "__qualname__", None) or repr(fn)

    def describe(self) -> str:
        return f"discovery callable {self._name}"

    def close(self) -> None:
        self._closed.set()

    def discover(self) -> HostList:
        if self._closed.is_set():
            raise DiscoveryError("discovery is closed: the job is ending")
        if self._busy is not None and self._busy.is_alive():
            raise DiscoveryError(f"{self._name}() has still not returned from an earlier call")
        box: dict[str, object] = {}
        done = threading.Event()

        def call() -> None:
            try:
                box["value"] = self.fn()
            except BaseException as exc:  # reported to the driver, never raised on this thread
                box["error"] = exc
                box["trace"] = traceback.format_exc()
            finally:
                done.set()

        self._busy = threading.Thread(target=call, name="elasticrun-discovery-call", daemon=True)
        self._busy.start()
        deadline = time.monotonic() + self.timeout
        while not done.wait(min(0.05, max(0.0, deadline - time.monotonic()))):
            if self._closed.is_set():
                raise DiscoveryError("discovery is closed: the job is ending")
            if time.monotonic() >= deadline:
                raise DiscoveryError(f"{self._name}() did not return within {self.timeout:g} s "
                                     f"(discovery_timeout); no new call starts until it does")
        if "error" in box:
            tail = str(box["trace"]).strip()[-2000:]
            raise DiscoveryError(f"{self._name}() raised {type(box['error']).__name__}: {box['error']}\n{tail}")
        return hosts_from_mapping(box.get("value"), self._name)


def hosts_from_mapping(value: object, name: str) -> HostList:
    """Check a callable's ``{host: slots}``; a bad entry is reported and skipped, like a bad line.

    More than MAX_HOSTS entries is a failed run, refused before looking at any of them."""
    if not isinstance(value, Mapping):
        raise DiscoveryError(f"{name}() returned {type(value).__name__}, expected a dict {{host: slots}}")
    try:
        size = len(value)
        if size > MAX_HOSTS:
            raise DiscoveryError(f"{name}() returned {size:,} hosts, more than the {MAX_HOSTS:,} allowed")
        result = HostList()
        for host, slots in value.items():
            if not isinstance(host, str) or isinstance(slots, bool) or not isinstance(slots, int):
                result.error(f"entry {_cut(host)}: {_cut(slots)}: expected a host name and a whole number of slots")
                continue
            try:
                host, slots = parse_host_entry(f"{host}:{slots}", 1)
            except (HostSpecError, ValueError) as exc:  # ValueError: an int too long to print
                result.error(f"entry {_cut(host)}: {exc}")
                continue
            result.add(host, slots, f"entry {host!r}")
    except DiscoveryError:
        raise
    except Exception as exc:  # a Mapping of the caller's own making may raise anything
        raise DiscoveryError(f"{name}() returned a {type(value).__name__} that could not be read: "
                             f"{type(exc).__name__}: {str(exc)[:200]}") from None
    return _check_host_count(result, f"{name}()")


def _cut(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
