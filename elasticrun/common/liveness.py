"""Whether a process of this machine is still there: the driver, for its local workers.

A worker that hears nothing from the driver for ``ELASTICRUN_DRIVER_TIMEOUT`` exits, so that a
job whose driver is gone leaves nothing behind. But a driver that is only stopped (Ctrl-Z,
``kill -STOP``, a debugger) is not gone: its workers must not all exit, and then be blamed for
it, because it did not answer for a few seconds. A worker on the driver's machine can tell the
two apart: the driver's process is still there, stopped. It is named by the machine's
boot id, its pid and its start time, so that a pid reused by another process, or a worker in
another pid namespace (a container on the same machine), is never mistaken for it. Workers on
other machines cannot tell, and keep the timeout.
"""

from __future__ import annotations

import os

__all__ = ["identity", "state"]

_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _boot_id() -> str | None:
    try:
        with open(_BOOT_ID, encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def _stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time in clock ticks since boot) of ``pid``, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()  # after "pid (comm) ": the name may hold anything
    return (fields[0], fields[19]) if len(fields) > 19 else None


def identity(pid: int | None = None) -> str | None:
    """``BOOT_ID:PID:START`` of ``pid`` (this process by default), or None without /proc."""
    pid = os.getpid() if pid is None else pid
    boot, st = _boot_id(), _stat(pid)
    if boot is None or st is None:
        return None
    return f"{boot}:{pid}:{st[1]}"


def state(ident: str) -> str:
    """What became of the process ``ident`` names: "running", "stopped" (SIGSTOP, Ctrl-Z, a
    debugger), "gone", or "elsewhere" (another machine or boot, another pid namespace, or no
    /proc to look at: nothing can be said)."""
    try:
        boot, pid, start = ident.rsplit(":", 2)
        number = int(pid)
    except ValueError:
        return "elsewhere"
    if boot != _boot_id():
        return "elsewhere"
    st = _stat(number)
    if st is None or st[1] != start or st[0] in ("Z", "X"):
        return "gone"  # (or a pid reused since, or a zombie; in another pid namespace: as before, gone)
    return "stopped" if st[0] in ("T", "t") else "running"
