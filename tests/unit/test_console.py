"""The driver's console (driver/console.py): a console nobody reads never blocks the driver's
own lines, loses none of its workers' lines, and says how many of its own it could not print."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from elasticrun.driver.console import Console, ConsoleHandler

pytestmark = pytest.mark.timeout(30)


class Stalled:
    """A stream whose writes block until :meth:`read` (a terminal after Ctrl-S)."""

    def __init__(self) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()  # a write has begun
        self.text: list[str] = []

    def write(self, text: str) -> int:
        self.entered.set()
        assert self.open.wait(20), "never read"
        self.text.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def read(self) -> None:
        self.open.set()


def test_the_drivers_own_lines_never_wait_for_a_console_nobody_reads() -> None:
    err = Stalled()
    console = Console({"stdout": None, "stderr": err}, capacity=40, reserve=20)  # 10 and 5 lines of 4
    console.write("stderr", "l00\n", wait=False)
    assert err.entered.wait(5)  # the writer holds it, blocked
    started = time.monotonic()
    for n in range(1, 100):
        console.write("stderr", f"l{n:02}\n", wait=False)
    assert time.monotonic() - started < 1.0  # (the loop used to block on the first line)
    err.read()
    console.close()
    lines = "".join(err.text).splitlines()
    # The first went to the writer at once; 15 more were queued; the rest were counted.
    assert lines[:16] == [f"l{n:02}" for n in range(16)], lines
    assert lines[16:] == ["[elasticrun] 84 line(s) of the driver's own were not printed: the console was not read "
                          "meanwhile"], lines


def test_a_workers_lines_wait_for_room_and_none_is_lost() -> None:
    out = Stalled()
    console = Console({"stdout": out, "stderr": None}, capacity=4, reserve=2)
    done = threading.Event()

    def worker() -> None:
        for n in range(20):
            console.write("stdout", f"{n}\n", wait=True)
        done.set()

    threading.Thread(target=worker, daemon=True).start()
    assert not done.wait(0.5)  # it waits while nobody reads
    out.read()
    assert done.wait(5)
    console.close()
    assert "".join(out.text) == "".join(f"{n}\n" for n in range(20))


def test_lines_keep_their_order_across_streams_and_a_closed_stream_is_dropped() -> None:
    class Closed:
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self) -> None:
            pass

    err = Stalled()
    err.read()
    console = Console({"stdout": Closed(), "stderr": err})
    log = logging.getLogger("test_console")
    handler = ConsoleHandler(console)
    handler.setFormatter(logging.Formatter("[elasticrun] %(message)s"))
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("first")
        console.write("stdout", "to a closed pipe\n", wait=True)
        console.write("stderr", "[0]<stderr>:a worker's\n", wait=True)
        log.warning("last")
        console.close()
    finally:
        log.removeHandler(handler)
    assert "".join(err.text) == "[elasticrun] first\n[0]<stderr>:a worker's\n[elasticrun] last\n"
    assert console.gone("stdout") and not console.gone("stderr")
    console.write("stderr", "after close\n", wait=False)  # written directly once the thread has ended
    assert err.text[-1] == "after close\n"
