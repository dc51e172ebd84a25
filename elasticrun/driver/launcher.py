"""Starting and stopping worker processes on this machine.

Each worker runs in its own session (and so its own process group), so that stopping it
signals the whole tree it started (data-loader workers, shells, ``torchrun``-style children),
and so that a Ctrl-C on the driver's terminal reaches only the driver, which then stops the
workers in order instead of leaving half of them running.
"""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from elasticrun.common import secretpipe
from elasticrun.driver.output import Output, pump


@lru_cache(maxsize=256)
def is_local_host(host: str) -> bool:
    """True if ``host`` names this machine (a loopback address or one of its own addresses)."""
    name = host.rsplit("@", 1)[-1]
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(name, None)}
    except socket.gaierror:
        return False
    own: set[str] = set()
    for candidate in (socket.gethostname(), socket.getfqdn()):
        try:
            own |= {info[4][0] for info in socket.getaddrinfo(candidate, None)}
        except socket.gaierror:
            pass
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in own for a in addresses)


@dataclass
class _Proc:
    popen: subprocess.Popen
    threads: list[threading.Thread] = field(default_factory=list)


class LocalLauncher:
    """Runs workers as child processes; reports each exit through ``on_exit(worker_id, code)``."""

    def __init__(self, sink: Output, on_exit: Callable[[str, int], None]):
        self._sink = sink
        self._on_exit = on_exit
        self._procs: dict[str, _Proc] = {}
        self._lock = threading.Lock()

    def launch(self, worker_id: str, command: list[str], env: dict[str, str], keys: bytes | None = None) -> None:
        """Start ``command``; raise OSError (e.g. command not found) if it cannot start.

        ``keys``: the job's key blob, handed over through an inherited pipe (its descriptor
        number in ``ELASTICRUN_SECRET_FD``), never through the environment.
        """
        fd = secretpipe.hand_over(keys) if keys is not None else None
        try:
            if fd is not None:
                env = dict(env, **{secretpipe.FD_VAR: str(fd)})
            popen = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True,
                                     pass_fds=() if fd is None else (fd,))
        finally:
            if fd is not None:
                os.close(fd)  # the worker holds the only reference now
        proc = _Proc(popen)
        assert popen.stdout is not None and popen.stderr is not None
        proc.threads = [pump(popen.stdout, worker_id, "stdout", self._sink),
                        pump(popen.stderr, worker_id, "stderr", self._sink)]
        with self._lock:
            self._procs[worker_id] = proc
        threading.Thread(target=self._watch, args=(worker_id, popen), name=f"elasticrun-wait-{worker_id}",
                         daemon=True).start()

    def _watch(self, worker_id: str, popen: subprocess.Popen) -> None:
        self._on_exit(worker_id, popen.wait())

    def pid(self, worker_id: str) -> int | None:
        proc = self._procs.get(worker_id)
        return proc.popen.pid if proc else None

    def signal(self, worker_id: str, sig: int) -> None:
        """Signal the worker's whole process group (it may outlive the worker itself)."""
        proc = self._procs.get(worker_id)
        if proc is not None:
            try:
                os.killpg(proc.popen.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def stop_all(self, grace: float) -> None:
        """SIGTERM every process group the job started, then SIGKILL what is left after ``grace``."""
        with self._lock:
            ids = list(self._procs)
        for wid in ids:
            self.signal(wid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for wid in ids:
            popen = self._procs[wid].popen
            try:
                popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for wid in ids:
            # Also reaches children that outlived their worker in the same group.
            self.signal(wid, signal.SIGKILL)
        for wid in ids:
            try:
                self._procs[wid].popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    def drain(self, timeout: float) -> None:
        """Wait (bounded) for the output of exited workers to be copied out."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [t for p in self._procs.values() for t in p.threads]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
