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


class Running:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def test_an_old_group_is_released_only_once_the_collectives_its_round_left_running_have_ended() -> None:
    released = threading.Event()
    work = Running()
    runtime._drop_in_background(Tracked(released), [work], delay=0.01)
    assert not released.wait(0.3)  # looked at ~30 times: still running, still held
    assert any(h and h[1] == [work] for _t, h in runtime._pending_drops)
    work.done = True
    assert released.wait(5.0)


def test_at_exit_a_group_whose_collective_still_runs_is_kept_and_so_is_the_collective() -> None:
    released = threading.Event()
    work = Running()
    runtime._drop_in_background(Tracked(released), [work], delay=0.01)
    runtime._settle_drops(timeout=2.0)
    work.done = True
    assert not released.wait(0.3)  # kept for good: gloo's thread never frees its tensors in the teardown
    assert not runtime._pending_drops


def test_a_collective_that_never_says_it_ended_holds_its_group_no_longer_than_asked() -> None:
    released = threading.Event()
    runtime._drop_in_background(Tracked(released), [Running()], delay=0.01, at_most=0.2)
    assert released.wait(5.0)
