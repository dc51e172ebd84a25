"""Hearing that a worker is dying before the kernel has torn it down.

A process killed with SIGKILL releases its address space before it closes its sockets or can
be reaped (``do_exit``: ``exit_mm`` before ``exit_files`` and ``exit_notify``). For a process
that imported torch that takes 8-14 ms, 20-35 ms with 300 MB of tensors (benchmarks/README.md,
"Detection and decision"), and neither its peers' sockets nor the launcher's ``waitpid`` hear of
the death any sooner. One thing happens first: at the start of ``exit_mm`` the kernel walks the
dying thread's *robust futex list*, marks each process-shared robust mutex it holds "owner
died" and wakes a waiter (``futex_exit_release``), 0.2 ms after the kill. So:

* the launcher puts a process-shared robust mutex and a semaphore in a memfd and hands it to
  the worker (its descriptor number in ``ELASTICRUN_DEATH_FD``);
* the worker's main thread locks the mutex in ``hvd.init()``, writes its pid and posts the
  semaphore (:func:`arm_from_environment`);
* a launcher thread (:meth:`Notice.wait`) waits for the semaphore, checks that the worker
  itself armed it (not a process a wrapper script started), then waits for the mutex.
  ``EOWNERDEAD`` means the worker's main thread is exiting, and its exit status is already
  in ``/proc/PID/stat`` (field 52, set before ``exit_mm``). A nonzero status is reported at
  once; status 0 (a clean exit, or an ``exec``, which releases robust mutexes too) is left to
  ``waitpid``, so nothing is reported early that ``waitpid`` could contradict.

The notice is only ever an earlier copy of what ``waitpid`` will say. Where it cannot be set
up (not Linux, no glibc 2.30 ``*_clocklock``/``sem_clockwait``, a worker that never calls
``hvd.init()`` or calls it off the main thread), nothing is armed and the launcher hears of
exits from ``waitpid`` alone.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
import time
from functools import lru_cache
from typing import Callable

from elasticrun.common import env

log = logging.getLogger("elasticrun")

_SIZE = 4096
_MUTEX_AT = 0  # pthread_mutex_t: 40 bytes (x86-64), 48 (aarch64); 128 reserved
_SEM_AT = 128  # sem_t: 32 bytes; 64 reserved
_PID_AT = 192  # the pid of the process that armed it (int)
_ATTR_BYTES = 64  # pthread_mutexattr_t: 4 or 8 bytes
_CLOCK_MONOTONIC = 1
_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1
#: Longest single wait; every wait also ends when ``done()`` turns true (checked between slices).
SLICE_SECONDS = 5.0


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The C library, if it has every call the notice needs (glibc >= 2.30 on Linux)."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    names = ("pthread_mutexattr_init", "pthread_mutexattr_setpshared", "pthread_mutexattr_setrobust",
             "pthread_mutex_init", "pthread_mutex_trylock", "pthread_mutex_clocklock", "pthread_mutex_unlock",
             "sem_init", "sem_post", "sem_clockwait")
    if not all(hasattr(lib, n) for n in names + ("mmap",)):
        return None
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.mmap.restype = ctypes.c_void_p
    vp, ts = ctypes.c_void_p, ctypes.POINTER(_Timespec)
    for name, args in (("pthread_mutexattr_init", [vp]), ("pthread_mutexattr_setpshared", [vp, ctypes.c_int]),
                       ("pthread_mutexattr_setrobust", [vp, ctypes.c_int]), ("pthread_mutex_init", [vp, vp]),
                       ("pthread_mutex_trylock", [vp]), ("pthread_mutex_clocklock", [vp, ctypes.c_int, ts]),
                       ("pthread_mutex_unlock", [vp]), ("sem_init", [vp, ctypes.c_int, ctypes.c_uint]),
                       ("sem_post", [vp]), ("sem_clockwait", [vp, ctypes.c_int, ts])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return lib


def supported() -> bool:
    """Whether this machine can arm a death notice."""
    return _libc() is not None


def _deadline(seconds: float) -> _Timespec:
    t = time.clock_gettime(time.CLOCK_MONOTONIC) + seconds
    return _Timespec(int(t), int((t % 1) * 1e9))


def exit_status(pid: int) -> int | None:
    """The exit status the kernel has set for dying process ``pid`` (as ``subprocess`` gives
    it: negative for a signal), or None if it is 0, unreadable, or ``pid`` is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        status = int(fields[49])  # field 52 (exit_code); fields[0] is field 3 (state)
    except (OSError, IndexError, ValueError):
        return None
    if status == 0:
        return None
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class Notice:
    """The launcher's side: the memory a worker arms, and the wait for its death.

    Create one per worker (:meth:`create`), hand :attr:`fd` to the worker, close your copy
    (:meth:`close_fd`) once it has it, then call :meth:`wait` once, from one thread, which
    unmaps the memory when it returns. :meth:`wake` (any thread) ends a wait that is still
    waiting for the worker to arm, e.g. once ``waitpid`` has reaped it.
    """

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self.fd: int | None = os.memfd_create("elasticrun-death-notice", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, _SIZE)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, _SIZE)
        except BaseException:
            os.close(self.fd)
            raise
        self._view: ctypes.c_char | None = ctypes.c_char.from_buffer(self._map)
        base = ctypes.addressof(self._view)
        self._mutex, self._sem = ctypes.c_void_p(base + _MUTEX_AT), ctypes.c_void_p(base + _SEM_AT)
        attr = ctypes.create_string_buffer(_ATTR_BYTES)
        if (lib.pthread_mutexattr_init(attr) or lib.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED)
                or lib.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST)
                or lib.pthread_mutex_init(self._mutex, attr) or lib.sem_init(self._sem, 1, 0)):
            self._unmap()
            self.close_fd()
            raise OSError("cannot set up a process-shared robust mutex")

    @classmethod
    def create(cls) -> Notice | None:
        """A new notice, or None where this machine cannot give one."""
        lib = _libc()
        if lib is None:
            return None
        try:
            return cls(lib)
        except OSError as exc:
            log.debug("no early death notice: %s", exc)
            return None

    def close_fd(self) -> None:
        """Close the launcher's copy of the descriptor (the worker holds its own)."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def _unmap(self) -> None:
        with self._lock:
            self._view = None  # releases the buffer export; the mapping may close now
            if self._map is not None:
                self._map.close()
                self._map = None

    def wake(self) -> None:
        """End a wait for the worker to arm (harmless after the wait is over)."""
        with self._lock:
            if self._map is not None:
                self._lib.sem_post(self._sem)

    def wait(self, pid: int, done: Callable[[], bool]) -> int | None:
        """Block until worker ``pid``'s main thread is dying: its exit status (negative for a
        signal). None if it exited with status 0, never armed the notice, or ``done()`` turned
        true first (check it before you :meth:`wake`)."""
        try:
            self.close_fd()
            while True:  # for the worker to lock the mutex (or a wake)
                if done():
                    return None
                if self._lib.sem_clockwait(self._sem, _CLOCK_MONOTONIC, _deadline(SLICE_SECONDS)) == 0:
                    break
                if ctypes.get_errno() not in (errno.ETIMEDOUT, errno.EINTR):
                    return None
            with self._lock:
                assert self._view is not None
                armed_by = ctypes.c_int.from_address(ctypes.addressof(self._view) + _PID_AT).value
            if armed_by != pid:
                # Armed by another process: a wrapper (``bash run.sh``) passed the descriptor on to
                # the python it ran. Its death is not the worker's exit: waitpid's to report.
                return None
            while not done():  # for the mutex: the kernel hands it over as the worker dies
                rc = self._lib.pthread_mutex_clocklock(self._mutex, _CLOCK_MONOTONIC, _deadline(SLICE_SECONDS))
                if rc == errno.ETIMEDOUT:
                    continue
                if rc == errno.EOWNERDEAD:
                    return exit_status(pid)
                if rc == 0:  # not locked: a wake, not an arming
                    self._lib.pthread_mutex_unlock(self._mutex)
                return None
            return None
        finally:
            self._unmap()


_armed: int | None = None  # the address of the worker's mapping (never unmapped)


def arm_from_environment() -> bool:
    """In a worker: lock the launcher's notice, if it handed one over (``ELASTICRUN_DEATH_FD``).

    Must run on the main thread: the lock belongs to the thread that takes it, and only the
    main thread lives exactly as long as the process. The memory is mapped with the C
    library's ``mmap`` and never unmapped: a Python ``mmap`` would be closed as the interpreter
    finalizes, and the kernel cannot mark a lock in memory that is gone, so the launcher would
    wait for it forever."""
    global _armed
    value = os.environ.pop(env.DEATH_FD, None)
    if value is None or _armed is not None:
        return False
    try:
        fd = int(value)
    except ValueError:
        return False
    try:
        lib = _libc()
        if lib is None or threading.current_thread() is not threading.main_thread():
            return False
        base = lib.mmap(None, _SIZE, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    if base in (None, ctypes.c_void_p(-1).value):
        log.debug("no early death notice: cannot map descriptor %d: %s", fd, os.strerror(ctypes.get_errno()))
        return False
    if lib.pthread_mutex_trylock(ctypes.c_void_p(base + _MUTEX_AT)) != 0:
        return False  # (the mapping stays: 4 KiB, once per process)
    _armed = base
    ctypes.c_int.from_address(base + _PID_AT).value = os.getpid()
    lib.sem_post(ctypes.c_void_p(base + _SEM_AT))
    return True
