"""Processes a worker forks (a DataLoader's workers, a ``fork`` Pool) are not the worker.

A machine's shutdown (systemd), Slurm's preemption or ``kill -- -PGID`` sends SIGTERM to every
process of the job at once: the worker and each process it forked. The worker answers its
SIGTERM with a graceful leave at its next commit (``runtime._install_sigterm``). Its DataLoader's
workers, with SIGTERM's default action, died at once, and the worker's next batch then failed
(``DataLoader worker (pid N) is killed by signal: Terminated``): a failure, a rollback to the last
commit and a blacklisted host instead of the leave. Forked children also inherit the worker's
handlers, and must not act as the worker (tell the driver it leaves, report its failure, or
leave the job at exit) through sockets and pipes that are the worker's.

So, in a process forked from a worker:

* a SIGTERM that reached the worker too (within :data:`WINDOW` of the worker's first one) is not
  the child's to die of: it goes on serving batches while the worker leaves, and ends with the
  worker (``PR_SET_PDEATHSIG``, SIGKILL), or earlier when the worker's DataLoader shuts it down;
* a SIGTERM the worker sends it (``Process.terminate()``: a DataLoader shutting its workers
  down, multiprocessing's exit handler ending its daemonic children, ``Pool.terminate()``) ends
  it at once, as it would without elasticrun: a DataLoader worker exits 0, as torch's handler has
  it when the parent sent the signal, any other child dies of it. The worker notes each child it
  sends one (:func:`_note_sent`). Before it did, a leaving worker's exit, its children stopped by
  multiprocessing within a second of its own SIGTERM, waited on children that took that signal
  for the group's, until --sigterm-grace ended it; and every exit printed torch's
  ``DataLoader worker (pid N) is killed by signal: Terminated`` a second later;
* any other SIGTERM (a ``kill PID``) ends it as SIGTERM's default action would, once the worker
  has not got one within :data:`WINDOW`: that wait is the price of telling the two apart. (The
  child's handler may run seconds after the signal, once a long C call returns: a SIGTERM that
  comes after the worker's, by up to :data:`LATE`, is taken for the worker's; the worker is
  leaving then, and the child ends with it.)
* the worker's excepthook and exit handler do nothing (:func:`in_forked_child`).

Children started by ``spawn`` or ``forkserver`` (Python 3.14's default on Linux; Horovod's
examples ask for it) run a new interpreter. The mark is a memfd, which they open through
``/proc/WORKER/fd/N`` (:data:`elasticrun.common.env.WORKER_MARK`), and they get the same handling
(:func:`adopt`) first thing (:mod:`elasticrun.worker.spawned`: the forkserver preloads it, a spawn
child's command line imports it), before they import the script again (and torch with it, for
seconds). A forkserver passes it on to what it forks. torch's DataLoader worker code is wrapped
once the script imports ``elasticrun.torch`` (:func:`after_torch_import`). Such a process, or any
other that inherits the mark without being the worker, joins nothing at ``hvd.init()``
(:func:`worker_above`).

A script that sets its own SIGTERM handler keeps it, in the worker and in its children.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import struct
import sys
import threading
import time
from typing import Any

from elasticrun.common import env

#: How far apart the worker's SIGTERM and a child's may be to count as one signal sent to both.
#: The worker records its own when its Python handler runs, which waits for the main thread to
#: leave a C call (a kernel, a collective): a child waits this long for it before dying.
WINDOW = 1.0
_WINDOW_NS = int(WINDOW * 1e9)
#: How much later than the signal a child's handler may run and still count it as the worker's
#: (sent with the worker's, or by it): Python runs a handler only once the call it is in returns,
#: and a DataLoader worker may be in one C call for seconds (a decode, a transform). Measured
#: from the handler alone, such a child took the group's SIGTERM for its own and died (the
#: worker's next batch failed: a rollback and a blacklisted host instead of a leave), or waited
#: a second more after the worker's terminate().
LATE = 120.0
_LATE_NS = int(LATE * 1e9)
_POLL = 0.005
_PR_SET_PDEATHSIG = 1

# Shared with every child forked later: CLOCK_MONOTONIC ns of the worker's SIGTERM, then _SLOTS
# slots of (pid, ns) of the SIGTERMs the worker sent its children, a child's at its pid's slot
# or one of the next ones (:func:`_note_sent`).
_mark: mmap.mmap | None = None
_SLOTS = 255
_SIZE = 16 + 16 * _SLOTS  # one page
_PROBE = 8  # slots a pid may take: its own (pid % _SLOTS) and the next ones, while taken
_noting = threading.RLock()  # (a DataLoader's __del__ may end its workers from a collection in here)
_torch_worker = False  # this process is a DataLoader worker (torch set its signal handlers)
_worker_pid = 0  # the armed worker's pid (0: not armed)
_worker_handler: Any = None


def arm(handler: Any) -> None:
    """In the worker, once its SIGTERM ``handler`` is installed: make the shared mark and have
    every process it starts from now on treat SIGTERM as this module says."""
    global _mark, _worker_pid, _worker_handler
    if _worker_pid == os.getpid():
        return
    _worker_pid = os.getpid()
    _worker_handler = handler
    try:  # a forked child shares the mapping; a spawned one opens the memfd by its /proc path
        fd = os.memfd_create("elasticrun-sigterm-mark", os.MFD_CLOEXEC)  # never closed (children open it by path)
        os.ftruncate(fd, _SIZE)
        _mark = mmap.mmap(fd, _SIZE)
        os.environ[env.WORKER_MARK] = f"{_worker_pid}:{fd}"
    except (AttributeError, OSError):  # no memfd (not Linux): forked children only
        _mark = mmap.mmap(-1, _SIZE)
        os.environ.pop(env.WORKER_MARK, None)
    os.register_at_fork(after_in_child=_after_fork_in_child)
    _first_in_what_it_starts()
    _note_what_it_sends()


def _note_what_it_sends() -> None:
    """Have multiprocessing's ``Popen._send_signal`` (``terminate()`` of a Process, of a Pool's
    workers, of a DataLoader's) note, in the worker, which child it sends SIGTERM and when."""
    try:
        from multiprocessing import popen_fork
    except ImportError:
        return  # (not POSIX)
    original = getattr(popen_fork.Popen, "_send_signal", None)
    if original is None or getattr(original, "_elasticrun", False):
        return

    def _send_signal(self: Any, sig: int) -> Any:
        if sig == signal.SIGTERM and getattr(self, "returncode", 0) is None and isinstance(self.pid, int):
            _note_sent(self.pid)
        return original(self, sig)

    _send_signal._elasticrun = True  # type: ignore[attr-defined]  # (so a second arm() does not wrap it again)
    setattr(popen_fork.Popen, "_send_signal", _send_signal)  # (private, so not in typeshed's stubs)


def _note_sent(pid: int) -> None:
    """In the worker, just before it sends ``pid`` (its child) SIGTERM: in the first of the
    pid's :data:`_PROBE` slots that holds this pid, nothing, or a note older than :data:`WINDOW`
    (so a note stays readable for as long as its child may look for it, even when the worker
    sends SIGTERM to children whose pids share a slot within that time); all taken: its own."""
    if _mark is None or os.getpid() != _worker_pid:
        return
    now = time.monotonic_ns()
    with _noting:  # (a DataLoader's shutdown and the exit handler may run in two threads)
        slots = _probe(pid)
        for slot in slots:
            noted, at = struct.unpack_from("qq", _mark, slot)
            if noted in (pid, 0) or now - at > _WINDOW_NS:
                break
        else:
            slot = slots[0]
        struct.pack_into("q", _mark, slot + 8, now)  # the time first: a reader that sees the
        struct.pack_into("q", _mark, slot, pid)      # pid sees its time


def _probe(pid: int) -> list[int]:
    """The offsets of ``pid``'s slots, in the order they are tried."""
    return [16 + 16 * ((pid + i) % _SLOTS) for i in range(_PROBE)]


def _sent_by_worker(got: int) -> bool:
    """This process's SIGTERM, which came at ``got``, is one the worker noted sending it."""
    if _mark is None:  # (its parent may be a forkserver: the pid the worker noted says it all)
        return False
    pid = os.getpid()
    for slot in _probe(pid):
        noted, at = struct.unpack_from("qq", _mark, slot)
        if noted == pid and -_WINDOW_NS <= got - at <= _LATE_NS:
            return True
    return False


def worker_above() -> int | None:
    """The pid of the worker this process descends from, if it is not that worker itself: a
    DataLoader's ``spawn``/``forkserver`` worker importing the script again, or any process the
    worker started that inherited its environment. (A worker the launcher started has its keys'
    pipe in its environment; a descendant never has: the worker took it out.)"""
    if _worker_pid:
        return _worker_pid if os.getpid() != _worker_pid else None
    pid, _ = _parse_mark(os.environ.get(env.WORKER_MARK))
    return pid if pid and pid != os.getpid() and env.SECRET_FD not in os.environ else None


def _parse_mark(value: str | None) -> tuple[int, int]:
    try:
        pid, fd = (int(part) for part in (value or "").split(":"))
        return pid, fd
    except ValueError:
        return 0, -1


def worker_got_sigterm() -> None:
    """From the worker's SIGTERM handler: note when its first SIGTERM came (for its children)."""
    if _mark is not None and os.getpid() == _worker_pid and not _marked():
        struct.pack_into("q", _mark, 0, time.monotonic_ns())


def in_forked_child() -> bool:
    """True in a process forked from the worker, or started by its ``spawn``/``forkserver`` and
    adopted (it is not the worker the driver knows)."""
    return _worker_pid != 0 and os.getpid() != _worker_pid


def _marked() -> int:
    return struct.unpack_from("q", _mark, 0)[0] if _mark is not None else 0


def _after_fork_in_child() -> None:
    try:
        if signal.getsignal(signal.SIGTERM) not in [h for h in (_worker_handler, _child_sigterm) if h is not None]:
            return  # the script's own handler, or one a child set: theirs
        signal.signal(signal.SIGTERM, _child_sigterm)
    except (ValueError, OSError):  # not the main thread: the child keeps what it inherited
        return
    _after_torch_worker_handlers()


def adopt(started: bool = False) -> None:
    """In a process a worker's ``spawn`` or ``forkserver`` started: handle SIGTERM as a forked
    child does, with the worker's mark opened through ``/proc``. ``started``: from
    :mod:`elasticrun.worker.spawned`, first thing in such a process; else at this module's
    import, which counts only while multiprocessing imports the script again (a script run some
    other way is left as it is)."""
    global _mark, _worker_pid
    pid, fd = _parse_mark(os.environ.get(env.WORKER_MARK))
    if not pid or pid == os.getpid() or env.SECRET_FD in os.environ or _worker_pid:
        return
    mp = sys.modules.get("multiprocessing")  # True while spawn or a forkserver imports the script
    if not started and (mp is None or not getattr(mp.current_process(), "_inheriting", False)):
        return
    try:
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # set by someone already: theirs
        # (O_NONBLOCK: were the pid another process's now, its descriptor could be a FIFO)
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            mark = mmap.mmap(handle, _SIZE, access=mmap.ACCESS_READ)
        finally:
            os.close(handle)
        signal.signal(signal.SIGTERM, _child_sigterm)
    except (OSError, ValueError):  # the worker is gone, or this is not the main thread
        return
    _mark, _worker_pid = mark, pid
    os.register_at_fork(after_in_child=_after_fork_in_child)  # a forkserver's children
    _after_torch_worker_handlers()


def after_torch_import() -> None:
    """Once torch is imported (the runtime's import): in a process the worker started, have
    torch's DataLoader worker code give SIGTERM back to this module (a forkserver's child
    imports torch only after it was forked)."""
    if _worker_pid and os.getpid() != _worker_pid:
        _after_torch_worker_handlers()


def _first_in_what_it_starts() -> None:
    """Have each new interpreter the worker's multiprocessing starts import
    :mod:`elasticrun.worker.spawned` first thing, not only when it imports the script again
    (seconds later, after torch):

    * the ``forkserver``, through its preload list (the modules the script listed are kept): a
      DataLoader's forkserver workers are its children, and torch's watchdog ends them when
      their parent changes, so it must outlive such a SIGTERM too; and Python 3.11 never
      imports the script in it (it passes the forkserver no main path), whatever the list says;
    * each ``spawn`` child, through the ``-c`` program of its command line
      (``multiprocessing.spawn.get_command_line``, wrapped)."""
    try:
        from multiprocessing import forkserver, spawn
    except ImportError:
        return  # (not POSIX)
    try:
        server: Any = getattr(forkserver, "_forkserver", None)
        modules = list(getattr(server, "_preload_modules", None) or ["__main__"])
        if SPAWNED not in modules:
            forkserver.set_forkserver_preload(modules + [SPAWNED])
    except (AttributeError, TypeError):
        pass
    original = spawn.get_command_line
    if getattr(original, "_elasticrun", False):
        return

    def get_command_line(**kwds: Any) -> list[str]:
        args = list(original(**kwds))
        for i, arg in enumerate(args[:-1]):
            if arg == "-c" and args[i + 1].startswith("from multiprocessing.spawn import"):
                args[i + 1] = FIRST + args[i + 1]
                break
        return args

    get_command_line._elasticrun = True  # type: ignore[attr-defined]  # (so a second arm() does not wrap it again)
    spawn.get_command_line = get_command_line


#: The module :func:`_first_in_what_it_starts` has every new interpreter import first.
SPAWNED = "elasticrun.worker.spawned"
#: What a spawn child's ``-c`` program starts with. It runs before multiprocessing sets the
#: child's ``sys.path`` to the worker's: where elasticrun cannot be imported yet, the child
#: starts as it would have (it may still adopt when it imports the script).
FIRST = f"try:\n    import {SPAWNED}\nexcept Exception:\n    pass\n"


def _after_torch_worker_handlers() -> None:
    """A DataLoader worker sets C handlers first thing (``_set_worker_signal_handlers``): for
    SIGSEGV, SIGBUS and SIGFPE (a message before dying), and for SIGTERM (exit 0 if the parent
    sent it, else die of it). Python cannot see a signal's sender, so SIGTERM gets this module's
    handler back after them; the others stay torch's."""
    handling: Any = sys.modules.get("torch.utils.data._utils.signal_handling")
    original = getattr(handling, "_set_worker_signal_handlers", None)
    if handling is None or original is None or getattr(original, "_elasticrun", False):
        return

    def set_worker_signal_handlers(*args: Any, **kwargs: Any) -> Any:
        global _torch_worker
        result = original(*args, **kwargs)
        _torch_worker = True
        try:
            signal.signal(signal.SIGTERM, _child_sigterm)
        except (ValueError, OSError):
            pass
        return result

    set_worker_signal_handlers._elasticrun = True  # type: ignore[attr-defined]  # (a forkserver's child inherits it set)
    handling._set_worker_signal_handlers = set_worker_signal_handlers


def _child_sigterm(signum: int, frame: Any) -> None:
    """A forked child's SIGTERM: the worker's too (go on), or its own (die of it)."""
    got = time.monotonic_ns()
    parent = os.getppid()
    if _sent_by_worker(got):  # its parent ends it: as without elasticrun, at once
        if _torch_worker:
            os._exit(0)  # (torch's own handler: exit 0 when the parent sent it)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    while True:
        mark = _marked()
        if mark and -_WINDOW_NS <= got - mark <= _LATE_NS:  # (its handler may run late: see LATE)
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


adopt()
