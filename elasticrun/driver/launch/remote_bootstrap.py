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
   period (after the worker's ``--sigterm-grace`` and then the grace period when the signal
   was its own: the host is going, and the worker may be leaving gracefully); when the worker
   exits on its own, it SIGKILLs what is left of the group (the worker's children), reports
   the worker's exit status (one marker line) and exits.

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

The job's reaper (the driver's machine). The local launcher also runs this file itself, with
the request ``{"reap": {"job", "grace"}}`` and its stdin a pipe from the driver, before its
first worker: when the pipe ends without the driver's ``done`` (the driver was SIGKILLed), it
stops every process of the job on that machine (:func:`reap`). Remote hosts need none: each
worker's watchdog there already outlives the driver.

Report lines are ``mark`` followed by JSON: ``{"pid", "pgid", "watchdog"}`` once the worker's
group exists (with ``"warm": true`` when a template forked it), ``{"error", "detail"}`` when
the worker could not be started (``error`` is ``cwd``, ``not_found`` or ``exec``),
``{"fallback"}`` (see above), ``{"exit"}`` with its status as ``subprocess`` gives it
(negative for a signal). The watchdog's own exit status is the worker's in the shell's
convention (128+N for signal N), 126/127 when it could not start it, 255 when the worker
could not be reaped, 125 for a bug here.
"""

import array
import ctypes
import errno
import json
import mmap
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
#: elasticrun.common.env.DEATH_FD: the worker's death notice (below).
DEATH_FD = "ELASTICRUN_DEATH_FD"
#: elasticrun.common.env.JOB_ID and WORKER_ID: every worker's environment names both, and so
#: does that of every process it starts, unless that process clears it (:func:`sweep`).
JOB_ID = "ELASTICRUN_JOB_ID"
#: The worker's own limit for a graceful leave after SIGTERM (elasticrun.common.env.SIGTERM_GRACE).
SIGTERM_GRACE = "ELASTICRUN_SIGTERM_GRACE"
WORKER_ID = "ELASTICRUN_WORKER_ID"


# --- the death notice: hearing that the worker is dying before it is torn down ---------------
# What it is and why: elasticrun/common/deathnotice.py, which holds the worker's side (and this
# layout, checked equal by tests/unit/test_remote_bootstrap.py). This is the side of whoever
# watches the worker: the local launcher (driver/launch/local.py) and this watchdog.
NOTICE_BYTES = 4096
NOTICE_MUTEX_AT = 0  # pthread_mutex_t: 40 bytes (x86-64), 48 (aarch64); 128 reserved
NOTICE_SEM_AT = 128  # sem_t: 32 bytes; 64 reserved
NOTICE_PID_AT = 192  # the pid of the process that armed it (int)
#: One byte the watcher sets before it stops the worker because the driver's connection is gone
#: (its channel closed): the SIGTERM that follows is no warning that the machine goes.
NOTICE_STOP_AT = 256
_CLOCK_MONOTONIC = 1
#: Longest single wait of a notice; every wait also ends when ``done()`` turns true.
NOTICE_SLICE_SECONDS = 5.0
#: Longest wait, once the worker has exited, for its notice to report before it is reaped.
NOTICE_FIRST_SECONDS = 1.0
_notice_lib = []  # type: List[Any]


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def notice_libc() -> Any:
    """The C library if it has every call a notice needs (Linux, glibc >= 2.30), else None."""
    if _notice_lib:
        return _notice_lib[0]
    lib = None
    if sys.platform.startswith("linux"):
        try:
            lib = ctypes.CDLL(None, use_errno=True)
        except OSError:
            lib = None
    vp, ts, i = ctypes.c_void_p, ctypes.POINTER(_Timespec), ctypes.c_int
    calls = (("pthread_mutexattr_init", [vp]), ("pthread_mutexattr_setpshared", [vp, i]),
             ("pthread_mutexattr_setrobust", [vp, i]), ("pthread_mutex_init", [vp, vp]),
             ("pthread_mutex_trylock", [vp]), ("pthread_mutex_clocklock", [vp, i, ts]),
             ("pthread_mutex_unlock", [vp]), ("sem_init", [vp, i, ctypes.c_uint]), ("sem_post", [vp]),
             ("sem_clockwait", [vp, i, ts]), ("memfd_create", [ctypes.c_char_p, ctypes.c_uint]),
             ("mmap", [vp, ctypes.c_size_t, i, i, i, ctypes.c_long]))
    if lib is not None and all(hasattr(lib, name) for name, _ in calls):
        for name, args in calls:
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        lib.mmap.restype = ctypes.c_void_p
    else:
        lib = None
    _notice_lib.append(lib)
    return lib


def _deadline(seconds: float) -> _Timespec:
    t = time.clock_gettime(time.CLOCK_MONOTONIC) + seconds
    return _Timespec(int(t), int((t % 1) * 1e9))


def dying_status(pid: int) -> Optional[int]:
    """The exit status the kernel has set for dying process ``pid`` (as ``subprocess`` gives
    it: negative for a signal), or None if it is 0, unreadable, or ``pid`` is gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        status = int(fields[49])  # field 52 (exit_code); fields[0] is field 3 (state)
    except (OSError, IndexError, ValueError):
        return None
    return exit_code(status) if status else None


class DeathNotice(object):
    """A process-shared robust mutex and a semaphore in a memfd, handed to one worker.

    Make one with :meth:`create` (None where this machine cannot), hand :attr:`fd` to the
    worker (``ELASTICRUN_DEATH_FD``), close your copy (:meth:`close_fd`) once it has it, then
    call :meth:`wait` once, from one thread: it returns as the worker dies and unmaps the
    memory. :meth:`wake` (any thread) ends a wait still waiting for the worker to arm, e.g.
    once ``waitpid`` has reaped it."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self.fd = lib.memfd_create(b"elasticrun-death-notice", 1)  # type: Optional[int]  # 1: MFD_CLOEXEC
        if self.fd is None or self.fd < 0:
            raise OSError(ctypes.get_errno(), "memfd_create failed")
        self._base = None  # type: Optional[int]
        try:
            os.ftruncate(self.fd, NOTICE_BYTES)
            self._map = mmap.mmap(self.fd, NOTICE_BYTES)  # type: Optional[mmap.mmap]
            self._view = ctypes.c_char.from_buffer(self._map)  # type: Any
            base = self._base = ctypes.addressof(self._view)
            attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t: 4 or 8 bytes
            mutex, sem = ctypes.c_void_p(base + NOTICE_MUTEX_AT), ctypes.c_void_p(base + NOTICE_SEM_AT)
            if (lib.pthread_mutexattr_init(attr) or lib.pthread_mutexattr_setpshared(attr, 1)  # 1: SHARED
                    or lib.pthread_mutexattr_setrobust(attr, 1)  # 1: PTHREAD_MUTEX_ROBUST
                    or lib.pthread_mutex_init(mutex, attr) or lib.sem_init(sem, 1, 0)):
                raise OSError("cannot set up a process-shared robust mutex")
        except BaseException:
            self._unmap()
            self.close_fd()
            raise
        self._mutex, self._sem = mutex, sem

    @classmethod
    def create(cls) -> "Optional[DeathNotice]":
        """A new notice, or None where this machine cannot give one."""
        lib = notice_libc()
        if lib is None:
            return None
        try:
            return cls(lib)
        except (OSError, ValueError):
            return None

    def close_fd(self) -> None:
        """Close this process's copy of the descriptor (the worker holds its own)."""
        fd, self.fd = self.fd, None
        if fd is not None and fd >= 0:
            os.close(fd)

    def _unmap(self) -> None:
        with self._lock:
            self._base = None
            self._view = None  # releases the buffer export; the mapping may close now
            m = getattr(self, "_map", None)  # (not there if the constructor failed before it)
            if m is not None:
                m.close()
                self._map = None

    def mark_stop(self) -> None:
        """Say, before this watcher's SIGTERM, that it stops the worker because the driver's
        connection is gone: the worker then does not report the signal as its machine going
        (a host "leaving" is kept out until discovery lists it anew; a lost connection is a
        failure, blacklisted by the job's policy)."""
        with self._lock:
            if self._base is not None:
                ctypes.c_char.from_address(self._base + NOTICE_STOP_AT).value = b"\x01"

    def wake(self) -> None:
        """End a wait for the worker to arm (harmless once the wait is over)."""
        with self._lock:
            if self._base is not None:
                self._lib.sem_post(self._sem)

    def discard(self) -> None:
        """Give the notice up without waiting (a worker that never started)."""
        self.close_fd()
        self._unmap()

    def wait(self, pid: int, done: Callable[[], bool]) -> Optional[int]:
        """Block until worker ``pid``'s main thread is dying: its exit status (negative for a
        signal). None if it exited with status 0 (or ``exec``-ed), never armed the notice, a
        process it started armed it instead, or ``done()`` turned true first."""
        try:
            self.close_fd()
            while True:  # for the worker to lock the mutex (or a wake)
                if done():
                    return None
                if self._lib.sem_clockwait(self._sem, _CLOCK_MONOTONIC, _deadline(NOTICE_SLICE_SECONDS)) == 0:
                    break
                if ctypes.get_errno() not in (errno.ETIMEDOUT, errno.EINTR):
                    return None
            with self._lock:
                if self._base is None:
                    return None
                armed_by = ctypes.c_int.from_address(self._base + NOTICE_PID_AT).value
            if armed_by != pid:
                # Armed by another process: a wrapper (``bash run.sh``) passed the descriptor on to
                # the python it ran. Its death is not the worker's exit: waitpid's to report.
                return None
            while not done():  # for the mutex: the kernel hands it over as the worker dies
                rc = self._lib.pthread_mutex_clocklock(self._mutex, _CLOCK_MONOTONIC,
                                                       _deadline(NOTICE_SLICE_SECONDS))
                if rc == errno.ETIMEDOUT:
                    continue
                if rc == errno.EOWNERDEAD:
                    # Ours now: unlock it before the mapping goes, so that it leaves this
                    # thread's robust list (the kernel walks that list when the thread ends,
                    # and the address may hold another notice by then).
                    self._lib.pthread_mutex_unlock(self._mutex)
                    return dying_status(pid)
                if rc == 0:  # not locked: a wake, not an arming
                    self._lib.pthread_mutex_unlock(self._mutex)
                return None
            return None
        finally:
            self._unmap()


def reporter(mark: str, stream: IO[str]) -> Callable[..., None]:
    """``report(**fields)``: one ``mark + JSON`` line on ``stream``, never raising."""

    lock = threading.Lock()  # the notice's thread reports too

    def report(**fields: object) -> None:
        try:
            with lock:
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


def spawn(program: str, argv: List[str], env: Dict[str, str], keys: Optional[str],
          notice: "Optional[DeathNotice]" = None) -> Tuple[int, int, int]:
    """Fork the worker as the leader of a new process group, held before ``exec``.

    Returns (pid, gate, errors): the worker runs ``program`` (``execve``) once :func:`release`
    opens ``gate``, and ``errors`` tells whether that failed. ``keys`` (ASCII) reach it through a
    fresh pipe named by ``ELASTICRUN_SECRET_FD``; ``notice``, through ``ELASTICRUN_DEATH_FD``.
    """
    env.pop(DEATH_FD, None)  # only the notice this bootstrap makes may be named there
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
            if notice is not None and notice.fd is not None:
                os.set_inheritable(notice.fd, True)
                env[DEATH_FD] = str(notice.fd)
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
    if notice is not None:
        notice.close_fd()  # the worker holds its own
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


def stop_on_signals(stop: threading.Event, signalled: Optional[threading.Event] = None) -> None:
    """SIGTERM, SIGINT and SIGHUP (the host shutting down, an admin's ``kill``, a hang-up) set
    ``signalled``, then ``stop``. The driver never signals the watchdog: it signals the worker's
    group, or closes the channel."""
    def on_signal(*_: Any) -> None:
        if signalled is not None:
            signalled.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)


def leave_seconds(env: Mapping[str, str]) -> float:
    """The worker's limit for a graceful leave (its ``--sigterm-grace``), 0 if not said."""
    try:
        value = float(env.get(SIGTERM_GRACE) or 0.0)
    except ValueError:
        return 0.0
    return value if 0.0 <= value < 1e6 else 0.0


def wait_after_sigterm(done: Callable[[], bool], grace: float, leave: float,
                       signalled: Optional[threading.Event], driver_gone: Optional[threading.Event]) -> None:
    """Once the worker's group got SIGTERM: wait until ``done()``, at most ``grace``.

    When this watchdog was signalled itself (a spot host shutting down signals every process;
    the worker got its SIGTERM too, which to an elastic worker is notice to leave), the worker
    may take up to ``leave`` (its ``--sigterm-grace``) to reach its next commit and go: then the
    wait is ``leave + grace``, so that the watchdog does not turn a graceful leave into a kill
    (and a rollback). Once the driver's connection is gone no leave can complete, so the wait
    ends at most ``grace`` after that."""
    now = time.time()
    deadline = now + grace
    if signalled is not None and signalled.is_set() and not (driver_gone is not None and driver_gone.is_set()):
        deadline = now + leave + grace
    while not done() and time.time() < deadline:
        if driver_gone is not None and driver_gone.is_set():
            deadline = min(deadline, time.time() + grace)
            driver_gone = None
        time.sleep(0.02)


def killpg(pgid: int, sig: int) -> None:
    """Signal a process group that may be gone already."""
    try:
        os.killpg(pgid, sig)
    except OSError:
        pass


def left_behind(job_id: str, worker_id: Optional[str]) -> List[int]:
    """The processes (this user's: others' environments cannot be read) whose environment
    names worker ``worker_id`` of job ``job_id`` (any worker of it: None): the worker's
    descendants, wherever they are, also those that left its process group (``setsid``, a daemon)."""
    want = [("%s=%s" % (JOB_ID, job_id)).encode()]
    if worker_id is not None:
        want.append(("%s=%s" % (WORKER_ID, worker_id)).encode())
    me = os.getpid()
    found = []  # type: List[int]
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open("/proc/%s/environ" % name, "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:  # gone, or not ours
            continue
        if all(w in entries for w in want):
            found.append(int(name))
    return found


def sweep(job_id: Optional[str], worker_id: Optional[str], group: Optional[int] = None) -> List[Tuple[int, str]]:
    """SIGKILL what worker ``worker_id`` left running once it and its process group (``group``,
    already sent SIGKILL) are gone: processes it started in a session of their own (``setsid``,
    ``start_new_session=True``, a daemon that forked twice), which no signal to its group
    reaches. Each would otherwise outlive the job, holding its CPUs, memory or GPU. Returns
    them as (pid, command); not those already exiting (their command line is gone)."""
    if not job_id or not worker_id:
        return []
    stopped = []  # type: List[Tuple[int, str]]
    for pid in left_behind(job_id, worker_id):
        try:
            if group is not None and os.getpgid(pid) == group:
                continue  # dying of the group's SIGKILL
            command = command_of(pid)
            os.kill(pid, signal.SIGKILL)
        except OSError:  # gone meanwhile
            continue
        if command:
            stopped.append((pid, command))
    return stopped


def command_of(pid: int) -> str:
    """Process ``pid``'s command line, shortened ('' once it is gone or exiting)."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()[:80]
    except OSError:
        return ""


def signal_tree(pid: int, sig: int) -> None:
    """Signal ``pid``'s whole process group when it leads one (a worker, or what it started in
    a session of its own), else ``pid`` alone."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except OSError:  # gone meanwhile
        pass


#: How long :func:`end_job` goes on SIGKILLing what the job's processes fork meanwhile.
END_JOB_KILL_SECONDS = 5.0


def end_job(job_id: str, grace: float) -> List[Tuple[int, str]]:
    """Stop every process of job ``job_id`` on this machine as the driver would have: SIGTERM
    (to each one's group where it leads one), SIGKILL to what is left after ``grace``, and again
    to what they fork meanwhile. Returns what was running, as (pid, command)."""
    found = [(pid, command_of(pid)) for pid in left_behind(job_id, None)]
    found = [(pid, command) for pid, command in found if command]
    if not found:
        return []
    groups = []  # type: List[int]
    for pid, _ in found:
        try:
            if os.getpgid(pid) == pid:
                groups.append(pid)
        except OSError:
            pass
        signal_tree(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while left_behind(job_id, None) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pgid in groups:  # once: members that do not carry the job's ids (``env -i``) go with them
        killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + END_JOB_KILL_SECONDS
    while True:
        left = left_behind(job_id, None)
        if not left or time.monotonic() > deadline:
            return found
        for pid in left:
            signal_tree(pid, signal.SIGKILL)
        time.sleep(0.05)


#: What the driver writes before it closes a reaper's stdin when it stopped the job itself.
REAPER_DONE = "done"


def reap(job_id: str, grace: float, stdin: IO[str]) -> int:
    """The job's last guard on the driver's machine (``{"reap": ...}``, started by the local
    launcher in a session of its own, before the first worker here): it reads its stdin, a pipe
    from the driver, to the end. The driver says :data:`REAPER_DONE` once it has stopped the job
    itself; EOF without it means the driver died without doing so (SIGKILL, the OOM killer), and
    then nothing else would stop a fresh worker for seconds, nor ever the children it started in
    its process group or outside it. So this stops them all (:func:`end_job`) and says so."""
    driver = os.getppid()
    try:
        said = stdin.read()
    except (OSError, ValueError):
        said = ""
    if said.strip() == REAPER_DONE:
        return 0
    stopped = end_job(job_id, grace)
    if stopped:
        shown = ", ".join("%d (%s)" % s for s in stopped[:5]) + (", ..." if len(stopped) > 5 else "")
        try:
            sys.stderr.write("elasticrun: the driver (pid %d) ended without stopping job %s; stopped the %d "
                             "process(es) it left on this machine: %s\n" % (driver, job_id, len(stopped), shown))
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
    return 0


def said_swept(stopped: List[Tuple[int, str]]) -> str:
    """One line naming what :func:`sweep` stopped (at most five of them)."""
    shown = ", ".join("%d (%s)" % s for s in stopped[:5]) + (", ..." if len(stopped) > 5 else "")
    return ("stopped %d process(es) the worker left running outside its process group (started in a new "
            "session): %s" % (len(stopped), shown))


def until_stopped(stop: threading.Event, waiter: Callable[[], None], name: str, driver_fd: int,
                  driver_gone: Optional[threading.Event] = None) -> None:
    """Run ``waiter`` (which sets ``stop`` once the worker is done) and a reader of ``driver_fd``
    (which sets ``driver_gone`` and ``stop`` at EOF: the driver's connection is gone, or it
    closed this channel) on daemon threads; return once ``stop`` is set, by either or by a signal."""
    def watch_driver() -> None:
        try:
            while os.read(driver_fd, 4096):
                pass
        except OSError:
            pass
        if driver_gone is not None:
            driver_gone.set()
        stop.set()

    threading.Thread(target=waiter, name=name, daemon=True).start()
    threading.Thread(target=watch_driver, name="bootstrap-driver", daemon=True).start()
    while not stop.wait(1.0):
        pass


def hear_death(notice: "Optional[DeathNotice]", pid: int, done: threading.Event,
               report: Optional[Callable[..., None]]) -> Optional[threading.Thread]:
    """On a thread (returned): ``report(dying=code)`` as soon as the worker's notice says it is
    dying (before the kernel has torn it down: the driver counts the worker gone at once)."""
    if notice is None or report is None:
        return None

    def run() -> None:
        code = notice.wait(pid, done.is_set)
        if code is not None:
            report(dying=code)

    thread = threading.Thread(target=run, name="bootstrap-notice", daemon=True)
    thread.start()
    return thread


def let_the_notice_speak(pid: int, notice: "Optional[DeathNotice]", heard: Optional[threading.Thread]) -> None:
    """Once the worker has exited, and before it is reaped: let its notice's thread report.

    The notice's exit status is read from the dead worker's ``/proc`` entry, which reaping
    removes. The kernel hands the notice over at the start of the worker's teardown, before
    the worker can be waited for, so by now the thread only needs to be scheduled; but on a
    busy host the reaper could be first, and the early report was lost (or came after the
    exit's). Waiting here keeps the reports in the order they happened: ``dying``, ``exit``."""
    if notice is None or heard is None or not hasattr(os, "waitid"):
        return
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
    except OSError:
        return
    notice.wake()  # a notice never armed stops waiting for its arming
    heard.join(NOTICE_FIRST_SECONDS)


def own_stop(notice: "Optional[DeathNotice]", driver_gone: threading.Event,
             signalled: Optional[threading.Event]) -> None:
    """Before this watchdog's SIGTERM: if it stops the worker because the driver's channel
    closed (and not because the watchdog was signalled itself, as a machine going signals
    every process), say so in the notice (:meth:`DeathNotice.mark_stop`)."""
    if notice is not None and driver_gone.is_set() and not (signalled is not None and signalled.is_set()):
        notice.mark_stop()


def watch(pid: int, grace: float, stop: threading.Event, driver_fd: int = 0,
          notice: "Optional[DeathNotice]" = None, report: Optional[Callable[..., None]] = None,
          leave: float = 0.0, signalled: Optional[threading.Event] = None) -> Optional[int]:
    """Wait for the worker ``pid`` to exit, ``driver_fd`` to reach EOF or ``stop``; then clean up.

    If the worker is still running: SIGTERM to its group, SIGKILL after ``grace`` (after
    ``leave + grace`` if ``signalled``: :func:`wait_after_sigterm`). Either
    way, SIGKILL to whatever is left of the group (the worker's own children). Returns the
    worker's wait status, or None if it was not reaped within REAP_SECONDS. With a ``notice``,
    ``report(dying=code)`` may come first (:func:`hear_death`).
    """
    status: List[int] = []
    reaped = threading.Event()
    heard = hear_death(notice, pid, reaped, report)

    def wait_child() -> None:
        let_the_notice_speak(pid, notice, heard)
        status.append(os.waitpid(pid, 0)[1])
        reaped.set()
        if notice is not None:
            notice.wake()
        stop.set()

    driver_gone = threading.Event()
    until_stopped(stop, wait_child, "bootstrap-wait", driver_fd, driver_gone)
    if not status:  # asked to stop, or the driver is gone: SIGTERM the group, SIGKILL after grace
        own_stop(notice, driver_gone, signalled)
        killpg(pid, signal.SIGTERM)
        wait_after_sigterm(lambda: bool(status), grace, leave, signalled, driver_gone)
    killpg(pid, signal.SIGKILL)  # whatever is left of the group: the worker's own children too
    deadline = time.time() + REAP_SECONDS
    while not status and time.time() < deadline:
        time.sleep(0.02)
    return status[0] if status else None


def encode_request(command: List[str], env: Mapping[str, str], cwd: str, grace: float, keys: bool,
                   notice: bool = False) -> bytes:
    """A template request (elasticrun.common.warmstart.encode_request, byte for byte)."""
    fields = {"v": 1, "command": list(command), "env": dict(env), "cwd": cwd, "grace": float(grace),
              "keys": bool(keys)}  # type: Dict[str, Any]
    if notice:
        fields["notice"] = True
    body = json.dumps(fields, sort_keys=True).encode("ascii")
    return struct.pack(">I", len(body)) + body


def warm_spawn(path: str, command: List[str], env: Dict[str, str], cwd: str, grace: float,
               keys: Optional[str], timeout: float = 10.0, notice: "Optional[DeathNotice]" = None) -> Any:
    """Ask the template at ``path`` to fork the worker: (connection, pid, what followed the
    answer) or, when it will not, why (a string; then the worker starts fresh)."""
    null = os.open(os.devnull, os.O_RDONLY)
    fds = [null, 1, 2]  # the worker's stdin; stdout and stderr are this channel's
    ours = [null]  # to close once sent
    if keys is not None:  # tiny: fits the pipe's buffer
        key_r, key_w = os.pipe()
        os.write(key_w, keys.encode("ascii"))
        os.close(key_w)
        fds.append(key_r)
        ours.append(key_r)
    if notice is not None and notice.fd is not None:
        fds.append(notice.fd)  # the notice closes its own copy when it waits
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    handed = False  # the socket is the watchdog's once the template answered
    try:
        sock.settimeout(timeout)
        sock.connect(path)
        # Only to a listener of this user: a template that stopped removes its private
        # directory, and anyone may make one at the same path before this launch connects.
        # The request carries the worker's environment and the job's key pipe.
        uid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[1]
        if uid != os.getuid():
            return "refused the template's socket: it is served by uid %d, not this user's (%d)" % (uid, os.getuid())
        data = encode_request(command, env, cwd, grace, keys is not None, len(fds) > len(ours) + 2)
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
        for fd in ours:
            os.close(fd)
        if not handed:
            sock.close()


def watch_warm(pid: int, conn: socket.socket, rest: bytes, grace: float, stop: threading.Event,
               driver_fd: int = 0, notice: "Optional[DeathNotice]" = None,
               report: Optional[Callable[..., None]] = None, leave: float = 0.0,
               signalled: Optional[threading.Event] = None) -> Optional[int]:
    """:func:`watch` for a worker the template forked: its exit status (``subprocess``-style)
    comes from ``conn``. None if the template went away first (the worker is then killed)."""
    status = []  # type: List[int]
    gone = threading.Event()  # the template answered, or is gone
    hear_death(notice, pid, gone, report)

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
        if notice is not None:
            notice.wake()
        stop.set()

    driver_gone = threading.Event()
    until_stopped(stop, wait_template, "bootstrap-template", driver_fd, driver_gone)
    if not gone.is_set():  # asked to stop, or the driver is gone
        own_stop(notice, driver_gone, signalled)
        killpg(pid, signal.SIGTERM)
        wait_after_sigterm(gone.is_set, grace, leave, signalled, driver_gone)
    killpg(pid, signal.SIGKILL)  # whatever is left of the group
    gone.wait(REAP_SECONDS)
    conn.close()
    return status[0] if status else None


def exit_code(status: int) -> int:
    """A wait status as ``subprocess`` reports it: the exit code, or -N for signal N."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def swept(job_id: Optional[str], worker_id: Optional[str], group: int) -> None:
    """:func:`sweep`, said on the worker's stderr (the driver shows it with the worker's rank)."""
    stopped = sweep(job_id, worker_id, group)
    if stopped:
        try:
            sys.stderr.write("elasticrun: %s\n" % said_swept(stopped))
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def main(stdin: IO[str], stdout: IO[str]) -> int:
    """Read the launch request, start the worker, watch it; the watchdog's exit status."""
    cfg = json.loads(stdin.readline())
    if "reap" in cfg:
        return reap(str(cfg["reap"]["job"]), float(cfg["reap"]["grace"]), stdin)
    report = reporter(cfg["mark"], stdout)
    env = worker_env(os.environ, cfg["env"])
    keys = cfg.pop("keys", None)  # the job's keys: through a pipe, never the environment
    command, cwd, grace = cfg["command"], cfg["cwd"], float(cfg["grace"])
    leave = leave_seconds(env)
    ids = env.get(JOB_ID), env.get(WORKER_ID)
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

    notice = DeathNotice.create() if cfg.get("notice") else None
    warm = cfg.get("warm")
    if warm:
        env.pop(DEATH_FD, None)  # only the notice sent with the request may be named there
        started = warm_spawn(str(warm["socket"]), command, env, os.getcwd(), grace, keys, notice=notice)
        if isinstance(started, str):
            report(fallback=started)
        else:
            conn, pid, rest = started
            keys = cfg = None
            report(pid=pid, pgid=pid, watchdog=os.getpid(), warm=True)
            stop, signalled = threading.Event(), threading.Event()
            stop_on_signals(stop, signalled)
            code = watch_warm(pid, conn, rest, grace, stop, notice=notice, report=report, leave=leave,
                              signalled=signalled)
            swept(*ids, group=pid)
            if code is None:
                sys.stderr.write("elasticrun: the warm-start template on this host went away while the worker "
                                 "ran; the worker was stopped\n")
                return 255
            report(exit=code)
            return code if code >= 0 else 128 - code

    if notice is not None and notice.fd is None:  # a template that fell back had it
        notice = DeathNotice.create()
    pid, gate, errors = spawn(found, command, env, keys, notice)
    keys = cfg = None  # the watchdog keeps no copy
    report(pid=pid, pgid=pid, watchdog=os.getpid())
    failed = release(gate, errors)
    if failed:
        os.waitpid(pid, 0)
        if notice is not None:
            notice.discard()
        report(error="exec", detail=failed.decode("utf-8", "replace"))
        return 126

    stop, signalled = threading.Event(), threading.Event()
    stop_on_signals(stop, signalled)
    status = watch(pid, grace, stop, notice=notice, report=report, leave=leave, signalled=signalled)
    swept(*ids, group=pid)
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
