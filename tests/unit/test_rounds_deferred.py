"""A worker launched into a running job takes its place when first needed (rounds.defer)."""

from __future__ import annotations

import pytest

from elasticrun.worker import rounds


def _round(number: int, rank: int, size: int) -> rounds.Round:
    return rounds.Round(number, rank, size, collective_timeout=1.0, host_updates=None, aborted={},
                        emit=lambda *a, **k: None)


@pytest.fixture(autouse=True)
def clean():
    rounds.uninstall()
    yield
    rounds.uninstall()


def test_placed_gives_the_launch_place_without_joining():
    joins = []
    rounds.defer(_round(-1, 2, 3), lambda: joins.append(1))
    assert (rounds.placed().rank, rounds.placed().size) == (2, 3)
    assert joins == []


def test_the_first_collective_joins_once_and_then_sees_the_joined_round():
    joined = _round(4, 1, 2)
    calls = []

    def join():
        calls.append(1)
        rounds.install(joined)

    rounds.defer(_round(-1, 2, 3), join)
    assert rounds.current() is joined
    assert rounds.current() is joined and rounds.placed() is joined
    assert calls == [1]


def test_a_failed_join_raises_and_is_tried_again_at_the_next_collective():
    def fail():
        raise TimeoutError("no place in the next round")

    rounds.defer(_round(-1, 1, 2), fail)
    for _ in range(2):
        with pytest.raises(TimeoutError):
            rounds.current()
    assert rounds.placed().rank == 1


def test_shutdown_before_joining_leaves_nothing_to_join():
    pending = _round(-1, 1, 2)
    rounds.defer(pending, lambda: pytest.fail("joined after shutdown"))
    rounds.uninstall(pending)
    with pytest.raises(ValueError, match="hvd.init"):
        rounds.current()
    with pytest.raises(ValueError, match="hvd.init"):
        rounds.placed()
