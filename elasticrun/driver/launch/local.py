"""Starting and stopping worker processes on this machine.

Each worker runs in its own session (and so its own process group), so that stopping it
signals the whole tree it started (data-loader workers, shells, ``torchrun``-style children),
and so that a Ctrl-C on the driver's terminal reaches only the driver, which then stops the
workers in order instead of leaving half of them running. Workers start warm (forked by this
machine's template, ``driver/launch/warm.py``) when they can, as new processes otherwise.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import IO, Callable

from elasticrun.common import env as envvars, secretpipe, warmstart
from elasticrun.driver import network
from elasticrun.driver.output import Output, pump
from elasticrun.driver.launch import remote_bootstrap
from elasticrun.driver.launch.remote_bootstrap import DeathNotice, said_swept, sweep
from elasticrun.driver.launch.warm import LocalTemplate, Unavailable, WarmWorker, start_worker

log = logging.getLogger("elasticrun")


@lru_cache(maxsize=256)
def is_local_host(host: str) -> bool:
    """True if ``host`` names this machine (a loopback address or one of its own addresses).
    Names are resolved once (``network.resolve``: the driver's loop asks at every launch)."""
    try:
        addresses = {str(sockaddr[0]) for _, sockaddr in network.resolve(host.rsplit("@", 1)[-1])}
    except OSError:
        return False
    return any(ipaddress.ip_address(a.split("%")[0]).is_loopback or a in network.own_addresses() for a in addresses)


_CLEAN_UP_AFTER_S = 0.25  # after a worker's exit, before what it left behind is stopped


@dataclass
class _Proc:
    worker_id: str
    popen: subprocess.Popen | None = None  # a fresh process
    warm: WarmWorker | None = None  # a worker a template forked
    pid: int | None = None  # also its process group (its own session), once known
    cancel: int | None = None  # a signal asked for before the pid was known
    threads: list[threading.Thread] = field(default_factory=list)
    finished: threading.Event = field(default_factory=threading.Event)  # reaped
    notice: DeathNotice | None = None  # hears of its death before it is reaped
    reported: bool = False  # on_exit was called (once: by the notice or by the reaper)
    job_id: str | None = None  # (its environment's ELASTICRUN_JOB_ID: what it left behind names it)
    cleaned: threading.Event = field(default_factory=threading.Event)  # what it left behind is stopped
    open_streams: int = 0  # its output pipes not yet read to their end


class LocalLauncher:
    """Runs workers as child processes; reports each exit through ``on_exit(worker_id, code)``.

    Exactly once per worker, and as early as the kernel lets anyone know: a worker that armed
    its death notice (``common/deathnotice.py``, at ``hvd.init()``) is reported dying
    0.2-0.5 ms after it was killed, before its address space is torn down, which takes
    8-35 ms for a torch process; ``finished`` is set only once it is reaped.

    With a :class:`~elasticrun.driver.launch.warm.LocalTemplate`, a worker whose command the template
    can run (``python script.py``, ``python -m module``) is forked by it instead of started as
    a new interpreter: ``launch`` then returns at once and a thread waits (at most
    ``ready_timeout``) for the template, asks it, and waits for the worker's exit, which the
    template reports. Whenever the template cannot (another command, interpreter or start-up
    environment, threads, the template gone), the worker starts fresh, with one debug line.
    """

    def __init__(self, sink: Output, on_exit: Callable[[str, int], None], template: LocalTemplate | None = None,
                 ready_timeout: float = 15.0, grace: float = 5.0):
        self._sink = sink
        self._on_exit = on_exit
        self._procs: dict[str, _Proc] = {}
        self._lock = threading.Lock()
        self._template = template
        self._ready_timeout = ready_timeout
        self._grace = grace
        self._stopping = False
        self._warned = False
        self._stop_event = threading.Event()  # set by stop_all: launches waiting for the template give up
        self._reaper: subprocess.Popen | None = None  # ends the job here if the driver dies without stopping it

    def launch(self, worker_id: str, command: list[str], env: dict[str, str], keys: bytes | None = None) -> None:
        """Start ``command``; raise OSError (e.g. command not found) if it cannot start.

        ``keys``: the job's key blob, handed over through an inherited pipe (its descriptor
        number in ``ELASTICRUN_SECRET_FD``), never through the environment.
        """
        proc = _Proc(worker_id, job_id=env.get(envvars.JOB_ID))
        self.start_reaper(proc.job_id)
        if self._template is not None and not self._template.usable and warmstart.python_command(command)[0]:
            self._warn_gone(None)
        if self._template is not None and self._template.usable and warmstart.python_command(command)[0]:
            with self._lock:
                self._procs[worker_id] = proc
            t = threading.Thread(target=self._launch_warm, args=(proc, command, env, keys),
                                 name=f"elasticrun-wait-{worker_id}", daemon=True)
            proc.threads.append(t)
            t.start()
            return
        self._start_fresh(proc, command, env, keys)
        with self._lock:
            self._procs[worker_id] = proc
        threading.Thread(target=self._watch, args=(proc,), name=f"elasticrun-wait-{worker_id}", daemon=True).start()

    def start_reaper(self, job_id: str | None) -> None:
        """Before the first worker here, start the job's reaper (``remote_bootstrap.reap``): a
        small process in a session of its own whose stdin is a pipe from the driver. If the driver
        dies without stopping the job (SIGKILL, the OOM killer), it stops every process of the job
        on this machine and says so; nothing else would stop a fresh worker for seconds (its
        heartbeats go unanswered), nor ever the children a worker started, in its group or out."""
        if job_id is None or self._reaper is not None or self._stopping:
            return
        request = json.dumps({"reap": {"job": job_id, "grace": self._grace}})
        try:
            reaper = subprocess.Popen([sys.executable, "-I", "-S", remote_bootstrap.__file__], stdin=subprocess.PIPE,
                                      stdout=subprocess.DEVNULL, start_new_session=True, text=True)
            assert reaper.stdin is not None
            reaper.stdin.write(request + "\n")
            reaper.stdin.flush()
        except OSError as exc:
            log.warning("cannot start this job's reaper (%s): if elasticrun is killed with SIGKILL, its workers here "
                        "stop by themselves once the driver is silent long enough, but what they started does not",
                        exc.strerror or exc)
            return
        self._reaper = reaper

    def _dismiss_reaper(self) -> None:
        """The job is stopped: the reaper exits without looking (bounded wait, then it is reaped)."""
        reaper, self._reaper = self._reaper, None
        if reaper is None:
            return
        try:
            assert reaper.stdin is not None
            reaper.stdin.write(remote_bootstrap.REAPER_DONE)
            reaper.stdin.close()
        except OSError:
            pass
        try:
            reaper.wait(2.0)
        except subprocess.TimeoutExpired:
            reaper.kill()
            reaper.wait()

    def _start_fresh(self, proc: _Proc, command: list[str], env: dict[str, str], keys: bytes | None) -> None:
        fd = secretpipe.hand_over(keys) if keys is not None else None
        notice = DeathNotice.create()
        try:
            pass_fds = [] if fd is None else [fd]
            env = {k: v for k, v in env.items() if k != envvars.DEATH_FD}
            if fd is not None:
                env[secretpipe.FD_VAR] = str(fd)
            if notice is not None and notice.fd is not None:
                env[envvars.DEATH_FD] = str(notice.fd)
                pass_fds.append(notice.fd)
            popen = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, start_new_session=True, pass_fds=pass_fds)
        except BaseException:
            if notice is not None:
                notice.discard()
            raise
        finally:
            if fd is not None:
                os.close(fd)  # the worker holds the only reference now
        proc.popen, proc.pid = popen, popen.pid
        assert popen.stdout is not None and popen.stderr is not None
        self._pump(proc, popen.stdout, popen.stderr)
        self._await_death(proc, notice)

    def _pump(self, proc: _Proc, stdout: IO[bytes], stderr: IO[bytes]) -> None:
        """Copy the worker's output out, each stream on a thread of its own."""
        def closed() -> None:
            with self._lock:
                proc.open_streams -= 1
                self._forget(proc)

        with self._lock:
            proc.open_streams += 2
        proc.threads += [pump(stdout, proc.worker_id, "stdout", self._sink, closed),
                         pump(stderr, proc.worker_id, "stderr", self._sink, closed)]

    def _forget(self, proc: _Proc) -> None:
        """(With the lock held.) A worker that has been reported, reaped and swept, and whose
        output is all out, is forgotten: a job that replaces workers for days keeps no record of
        each one (threads, pipes), and the job's stop never signals its process group id, which
        may by then be another process's (pids wrap, at 32,768 on many machines)."""
        if proc.cleaned.is_set() and proc.open_streams <= 0 and self._procs.get(proc.worker_id) is proc:
            del self._procs[proc.worker_id]

    def knows(self, worker_id: str) -> bool:
        """The worker was started here and is not yet forgotten."""
        return worker_id in self._procs

    def _await_death(self, proc: _Proc, notice: DeathNotice | None) -> None:
        """Start the thread that reports the worker's death from its notice, before it is reaped."""
        if notice is None:
            return
        proc.notice = notice

        def run() -> None:
            assert proc.pid is not None
            code = notice.wait(proc.pid, proc.finished.is_set)
            if code is not None:
                log.debug("%s: dying with %d (death notice)", proc.worker_id, code)
                self._report(proc, code)

        threading.Thread(target=run, name=f"elasticrun-notice-{proc.worker_id}", daemon=True).start()

    def _report(self, proc: _Proc, code: int) -> None:
        """``on_exit`` exactly once per worker, from whichever hears first: its notice or its reaper."""
        with self._lock:
            if proc.reported:
                return
            proc.reported = True
        self._on_exit(proc.worker_id, code)

    def _reaped(self, proc: _Proc, code: int) -> None:
        proc.finished.set()
        if proc.notice is not None:
            proc.notice.wake()  # its notice may still wait for an arming that will never come
        self._report(proc, code)
        try:
            self._clean_up(proc)
        finally:
            proc.cleaned.set()
            with self._lock:
                self._forget(proc)

    def _clean_up(self, proc: _Proc) -> None:
        """After the driver has heard of the exit: stop what the worker left running, as a
        remote watchdog does: its process group, then its descendants in sessions of their own.

        A moment later (at once when the job stops): the exit of a killed worker starts a
        recovery, and on a machine with few cores the scan of /proc (10 us a process, 0.7 ms
        here) would run beside the survivors' first steps. (Run at once, 4 x 15 kills on 2
        cores put kill -> first step p95 0.1-5.5 ms above the tree before, within its noise;
        it waits anyway: the recovery is the one moment where a millisecond counts.)"""
        self._stop_event.wait(_CLEAN_UP_AFTER_S)
        self._killpg(proc, signal.SIGKILL)
        stopped = sweep(proc.job_id, proc.worker_id, proc.pid)
        if stopped:  # on the worker's stderr, as a remote watchdog says it
            self._sink.write(proc.worker_id, "stderr", "elasticrun: " + said_swept(stopped))

    def _watch(self, proc: _Proc) -> None:
        assert proc.popen is not None
        self._reaped(proc, proc.popen.wait())

    def _launch_warm(self, proc: _Proc, command: list[str], env: dict[str, str], keys: bytes | None) -> None:
        """On the worker's thread: start it warm (or fresh), then wait for its exit."""
        code = 255
        try:
            assert self._template is not None
            if self._stopping or proc.cancel is not None:
                code = -(proc.cancel or signal.SIGTERM)
                return
            try:
                proc.warm = self._ask_template(proc, command, env, keys)
            except Unavailable as exc:
                if not self._template.usable and not self._stopping:
                    self._warn_gone(exc)
                else:
                    log.debug("%s: starting a fresh process, not a warm one: %s", proc.worker_id, exc)
            if proc.warm is None:
                if self._stopping or proc.cancel is not None:
                    code = -(proc.cancel or signal.SIGTERM)
                    return
                try:
                    self._start_fresh(proc, command, env, keys)
                except OSError as exc:
                    log.error("could not start %r: %s", command[0], exc.strerror or exc)
                    code = 127
                    return
                if proc.cancel is not None:
                    self.signal(proc.worker_id, proc.cancel)
                assert proc.popen is not None
                code = proc.popen.wait()
                return
            if proc.cancel is not None:
                self.signal(proc.worker_id, proc.cancel)
            status = proc.warm.wait()
            if status is None:  # the template is gone: no one can reap the worker; stop it
                log.error("%s: the warm-start template exited while worker %s ran; stopping the worker",
                          "this machine", proc.worker_id)
                self._killpg(proc, signal.SIGKILL)
                status = -signal.SIGKILL
            code = status
        except Exception as exc:  # a bug here must still end in exactly one on_exit
            log.error("%s: %s: %s", proc.worker_id, type(exc).__name__, exc)
        finally:
            self._reaped(proc, code)

    def _warn_gone(self, exc: Exception | None) -> None:
        """One warning line, the first time a launch finds this machine's template gone."""
        with self._lock:
            if self._warned or self._stopping:
                return
            self._warned = True
        assert self._template is not None
        why = str(exc) if exc is not None else self._template.why_gone()
        log.warning("warm start: this machine's template is gone (%s); its workers start as new processes",
                    why[:300])

    def _ask_template(self, proc: _Proc, command: list[str], env: dict[str, str], keys: bytes | None) -> WarmWorker:
        assert self._template is not None
        path = self._template.wait_ready(self._ready_timeout, self._stop_event)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        theirs = [os.open(os.devnull, os.O_RDONLY), out_w, err_w]
        notice = DeathNotice.create()
        # The notice's descriptor is the notice's to close (discard() or its wait), never ours:
        # closed twice, the number may by then be another thread's socket or pipe.
        notice_fd = notice.fd if notice is not None else None
        try:
            if keys is not None:
                theirs.append(secretpipe.hand_over(keys))
            if notice_fd is not None:
                theirs.append(notice_fd)
            worker_env = {k: v for k, v in env.items() if k not in (secretpipe.FD_VAR, envvars.DEATH_FD)}
            warm = start_worker(path, command, worker_env, os.getcwd(), theirs, self._grace,
                                keys=keys is not None, notice=notice is not None)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            if notice is not None:
                notice.discard()
            raise
        finally:
            for fd in theirs:  # sent: the template (and then the worker) holds its own copies
                if fd != notice_fd:
                    os.close(fd)
        proc.pid = warm.pid
        self._pump(proc, os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb"))
        self._await_death(proc, notice)
        return warm

    def pid(self, worker_id: str) -> int | None:
        proc = self._procs.get(worker_id)
        return proc.pid if proc else None

    @staticmethod
    def _killpg(proc: _Proc, sig: int) -> None:
        if proc.pid is not None:
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def signal(self, worker_id: str, sig: int) -> None:
        """Signal the worker's whole process group (it may outlive the worker itself)."""
        proc = self._procs.get(worker_id)
        if proc is None or proc.finished.is_set():
            return
        if proc.pid is None:
            proc.cancel = sig  # its launch thread sends it once the group exists, or never starts it
            if proc.pid is None:
                return
        self._killpg(proc, sig)

    def stop_all(self, grace: float) -> None:
        """SIGTERM every process group the job started, then SIGKILL what is left after ``grace``."""
        self._stopping = True
        self._stop_event.set()
        with self._lock:
            procs = list(self._procs.values())
        for proc in procs:
            self.signal(proc.worker_id, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for proc in procs:
            proc.finished.wait(max(0.0, deadline - time.monotonic()))
        for proc in procs:
            # Also reaches children that outlived their worker in the same group; not a group
            # already swept after its worker's exit, whose id may be another process's by now.
            if not proc.cleaned.is_set():
                self._killpg(proc, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        for proc in procs:
            proc.finished.wait(max(0.0, deadline - time.monotonic()))
        for proc in procs:  # (their sweeps: a /proc scan each)
            proc.cleaned.wait(max(0.0, deadline - time.monotonic()))
        self._dismiss_reaper()

    def drain(self, timeout: float) -> None:
        """Wait (bounded) for the output of exited workers to be copied out."""
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [t for p in self._procs.values() for t in p.threads if t.name.startswith("elasticrun-output")]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
