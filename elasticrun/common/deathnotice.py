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
* a thread of whoever watches the worker (``DeathNotice.wait``, in
  ``driver/launch/remote_bootstrap.py``, which the local launcher and the remote watchdog on an
  SSH host both use: that file may import nothing of elasticrun) waits for the semaphore,
  checks that the worker itself armed it (not a process a wrapper script started), then waits
  for the mutex.
  ``EOWNERDEAD`` means the worker's main thread is exiting, and its exit status is already
  in ``/proc/PID/stat`` (field 52, set before ``exit_mm``). A nonzero status is reported at
  once; status 0 (a clean exit, or an ``exec``, which releases robust mutexes too) is left to
  ``waitpid``, so nothing is reported early that ``waitpid`` could contradict.

This module is the worker's side. The notice is only ever an earlier copy of what ``waitpid``
will say. Where it cannot be set
up (not Linux, no glibc 2.30 ``*_clocklock``/``sem_clockwait``, a worker that never calls
``hvd.init()`` or calls it off the main thread), nothing is armed and the launcher hears of
exits from ``waitpid`` alone.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import sys
import threading
from functools import lru_cache

from elasticrun.common import env

log = logging.getLogger("elasticrun")

# The layout the watcher's side (remote_bootstrap.DeathNotice) makes; tests check they agree.
NOTICE_BYTES = 4096
NOTICE_MUTEX_AT = 0
NOTICE_SEM_AT = 128
NOTICE_PID_AT = 192
NOTICE_STOP_AT = 256  # set by the watcher before it stops the worker for the driver's sake


@lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The C library, if it has the calls a worker needs to arm a notice (Linux, glibc)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    if not all(hasattr(lib, n) for n in ("pthread_mutex_trylock", "sem_post", "mmap")):
        return None
    lib.pthread_mutex_trylock.argtypes = [ctypes.c_void_p]
    lib.sem_post.argtypes = [ctypes.c_void_p]
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    lib.mmap.restype = ctypes.c_void_p
    return lib


_armed: int | None = None  # the address of the worker's mapping (never unmapped)


def arm_from_environment() -> bool:
    """In a worker: lock the watcher's notice, if it handed one over (``ELASTICRUN_DEATH_FD``).

    Must run on the main thread: the lock belongs to the thread that takes it, and only the
    main thread lives exactly as long as the process. The memory is mapped with the C
    library's ``mmap`` and never unmapped: a Python ``mmap`` would be closed as the interpreter
    finalizes, and the kernel cannot mark a lock in memory that is gone, so the watcher would
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
        base = lib.mmap(None, NOTICE_BYTES, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass
    if base in (None, ctypes.c_void_p(-1).value):
        log.debug("no early death notice: cannot map descriptor %d: %s", fd, os.strerror(ctypes.get_errno()))
        return False
    if lib.pthread_mutex_trylock(ctypes.c_void_p(base + NOTICE_MUTEX_AT)) != 0:
        return False  # (the mapping stays: 4 KiB, once per process)
    _armed = base
    ctypes.c_int.from_address(base + NOTICE_PID_AT).value = os.getpid()
    lib.sem_post(ctypes.c_void_p(base + NOTICE_SEM_AT))
    return True


def stopped_by_watcher() -> bool:
    """Whether the process watching this worker (the SSH watchdog) has said that it stops the
    worker because the driver's connection is gone: its SIGTERM is then no warning that the
    machine goes, and the worker must not report it as one. False without an armed notice."""
    base = _armed
    return base is not None and ctypes.c_char.from_address(base + NOTICE_STOP_AT).value == b"\x01"
