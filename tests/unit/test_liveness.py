"""common/liveness.py: a worker on the driver's machine tells a stopped driver from a gone one."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from elasticrun.common import liveness

pytestmark = pytest.mark.timeout(30)


def test_a_process_is_running_then_stopped_then_running_then_gone():
    proc = subprocess.Popen(["sleep", "30"])
    try:
        ident = liveness.identity(proc.pid)
        assert ident is not None and liveness.state(ident) == "running"
        os.kill(proc.pid, signal.SIGSTOP)
        assert _soon(lambda: liveness.state(ident) == "stopped")
        os.kill(proc.pid, signal.SIGCONT)
        assert _soon(lambda: liveness.state(ident) == "running")
    finally:
        proc.kill()
        proc.wait()
    assert liveness.state(ident) == "gone"


def test_a_reused_pid_another_machine_and_nonsense_are_not_the_driver():
    me = liveness.identity()
    assert me is not None and liveness.state(me) == "running"
    boot, pid, start = me.rsplit(":", 2)
    assert liveness.state(f"{boot}:{pid}:{int(start) + 1}") == "gone"  # the same pid, another process
    assert liveness.state(f"another-boot:{pid}:{start}") == "elsewhere"
    assert liveness.state("nonsense") == "elsewhere" and liveness.state("") == "elsewhere"


def _soon(predicate, tries: int = 200) -> bool:
    import time

    for _ in range(tries):
        if predicate():
            return True
        time.sleep(0.01)
    return False
