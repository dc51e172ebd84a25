"""Processes a worker forks (a DataLoader's workers, a ``fork`` Pool) are not the worker.

A machine's shutdown (systemd), Slurm's preemption or ``kill -- -PGID`` sends SIGTERM to every
process of the job at once: the worker and each process it forked. The worker answers its
SIGTERM with a graceful leave at its next step (``runtime._install_sigterm``). Its DataLoader's
workers, with SIGTERM's default action, died at once, and the worker's next batch then failed
(``DataLoader worker (pid N) is killed by signal: Terminated``): a failure, a rollback to the last
commit and a blacklisted host instead of the leave. Forked children also inherit the worker's
handlers, and must not act as the worker (tell the driver it leaves, report its failure, or
leave the job at exit) through sockets and pipes that are the worker's.

So, in a process forked from a worker:

* a SIGTERM that reached the worker too (within :data:`WINDOW` of the worker's first one) is not
  the child's to die of: it goes on serving batches while the worker leaves, and ends with the
  worker (``PR_SET_PDEATHSIG``, SIGKILL), or earlier when the worker's DataLoader shuts it down;
* any other SIGTERM (``Process.terminate()``, ``Pool.terminate()``, a ``kill PID``) ends it as
  SIGTERM's default action would, once the worker has not got one within :data:`WINDOW`: that
  wait is the price of telling the two apart;
* the worker's excepthook and exit handler do nothing (:func:`in_forked_child`).

A script that sets its own SIGTERM handler keeps it, in the worker and in its children. Children
started by ``spawn`` or ``forkserver`` run a new interpreter: none of this reaches them, and a
machine-wide SIGTERM ends them at once (docs/durability.md says so).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import struct
import sys
import time
from typing import Any

#: How far apart the worker's SIGTERM and a child's may be to count as one signal sent to both.
#: The worker records its own when its Python handler runs, which waits for the main thread to
#: leave a C call (a kernel, a collective): a child waits this long for it before dying.
WINDOW = 1.0
_WINDOW_NS = int(WINDOW * 1e9)
_POLL = 0.005
_PR_SET_PDEATHSIG = 1

_mark: mmap.mmap | None = None  # shared with every child forked later: CLOCK_MONOTONIC ns of the worker's SIGTERM
_worker_pid = 0  # the armed worker's pid (0: not armed)
_worker_handler: Any = None


def arm(handler: Any) -> None:
    """In the worker, once its SIGTERM ``handler`` is installed: make the shared mark and have
    every process it forks from now on treat SIGTERM as this module says."""
    global _mark, _worker_pid, _worker_handler
    if _mark is not None:
        return
    _mark = mmap.mmap(-1, 8)  # anonymous and MAP_SHARED: a forked child sees the worker's writes
    _worker_pid = os.getpid()
    _worker_handler = handler
    os.register_at_fork(after_in_child=_after_fork_in_child)


def worker_got_sigterm() -> None:
    """From the worker's SIGTERM handler: note when its first SIGTERM came (for its children)."""
    if _mark is not None and os.getpid() == _worker_pid and not _marked():
        struct.pack_into("q", _mark, 0, time.monotonic_ns())


def in_forked_child() -> bool:
    """True in a process forked from the worker (it is not the worker the driver knows)."""
    return _worker_pid != 0 and os.getpid() != _worker_pid


def _marked() -> int:
    return struct.unpack_from("q", _mark, 0)[0] if _mark is not None else 0


def _after_fork_in_child() -> None:
    try:
        if signal.getsignal(signal.SIGTERM) is not _worker_handler:
            return  # the script's own handler, or one a child set: theirs
        signal.signal(signal.SIGTERM, _child_sigterm)
    except (ValueError, OSError):  # not the main thread: the child keeps what it inherited
        return
    _after_torch_worker_handlers()


def _after_torch_worker_handlers() -> None:
    """A DataLoader worker sets C handlers first thing (``_set_worker_signal_handlers``): for
    SIGSEGV, SIGBUS and SIGFPE (a message before dying), and for SIGTERM (exit 0 if the parent
    sent it, else die of it). Python cannot see a signal's sender, so SIGTERM gets this module's
    handler back after them; the others stay torch's."""
    handling: Any = sys.modules.get("torch.utils.data._utils.signal_handling")
    original = getattr(handling, "_set_worker_signal_handlers", None)
    if handling is None or original is None:
        return

    def set_worker_signal_handlers(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            signal.signal(signal.SIGTERM, _child_sigterm)
        except (ValueError, OSError):
            pass
        return result

    handling._set_worker_signal_handlers = set_worker_signal_handlers


def _child_sigterm(signum: int, frame: Any) -> None:
    """A forked child's SIGTERM: the worker's too (go on), or its own (die of it)."""
    got = time.monotonic_ns()
    parent = os.getppid()
    while True:
        mark = _marked()
        if mark and abs(mark - got) <= _WINDOW_NS:
            _end_with_parent(parent)
            return
        if mark or time.monotonic_ns() - got > _WINDOW_NS or os.getppid() != parent:
            break
        time.sleep(_POLL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _end_with_parent(parent: int) -> None:
    """Die (SIGKILL) when the parent does, as a child of the leaving worker must not outlive it."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the DataLoader's own watchdog still notices the parent's end (within 5 s)
    if os.getppid() != parent:  # it ended before the request took effect
        os._exit(128 + signal.SIGTERM)
