"""What each thread of this process has cost so far, ZeroMQ's own I/O threads included.

py-spy and ``time.process_time`` cannot say which thread spent a process's CPU; Linux's
/proc can, by thread, under the names the threads gave themselves (``ZMQbg/IO/0``: ZeroMQ's
I/O threads, which run every CURVE handshake and encryption)."""

from __future__ import annotations

import os


def thread_cpu() -> dict[int, tuple[str, float]]:
    """CPU seconds (user + system) of each live thread of this process, by thread id, with its
    name; empty where /proc is missing (not Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[int, tuple[str, float]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue  # the thread ended
        out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)  # utime + stime
    return out


def spent(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[int, tuple[str, float]]:
    """Each thread's CPU between two :func:`thread_cpu` readings (a thread born between them
    counts from zero)."""
    return {tid: (name, cpu - before.get(tid, (name, 0.0))[1]) for tid, (name, cpu) in after.items()}
