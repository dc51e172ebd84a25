"""Old rounds' groups at exit: never torn down on a daemon thread while the interpreter
finalizes (that ends in std::terminate inside gloo's destructor, exit code -6)."""

from __future__ import annotations

import threading

from elasticrun.worker import runtime


class Tracked:
    def __init__(self, released: threading.Event) -> None:
        self.released = released

    def __del__(self) -> None:
        self.released.set()


def test_a_release_not_started_is_cancelled_and_the_group_kept() -> None:
    released = threading.Event()
    runtime._drop_in_background(Tracked(released), delay=30.0)
    runtime._settle_drops(timeout=2.0)
    assert not runtime._pending_drops
    assert not released.wait(0.2)  # kept: the process is ending, the OS closes its sockets


def test_a_finished_release_is_forgotten_and_a_due_one_happens() -> None:
    released = threading.Event()
    runtime._drop_in_background(Tracked(released), delay=0.0)
    assert released.wait(5.0)
    runtime._pending_drops[-1][0].join(5.0)  # its timer thread has ended
    runtime._drop_in_background(object(), delay=30.0)  # prunes the finished one
    assert len(runtime._pending_drops) == 1
    runtime._settle_drops(timeout=2.0)
    assert not runtime._pending_drops
