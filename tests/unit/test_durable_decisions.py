"""The driver's decisions about durable copies (driver/durable/decisions.py): pure, so every
case is a few lines."""

from __future__ import annotations

import dataclasses

import pytest

from elasticrun.driver.durable.decisions import (
    PROGRESS_EVERY,
    URGENT_RETRY,
    CopySchedule,
    FinalCopy,
    Progress,
    final_copy_verdict,
)


def test_a_copy_is_asked_for_only_while_a_round_trains():
    s = CopySchedule(60.0)
    assert s.ask(0.0, training=False) is None  # before the first round, or while one re-forms
    assert s.ask(1.0, training=True) == 1  # at once when one trains
    assert s.ask(30.0, training=True) is None  # not due
    assert s.ask(30.0, training=True, force=True) == 2  # a stop's last copy
    assert s.ask(89.9, training=True) is None and s.ask(90.0, training=True) == 3
    assert s.ask(500.0, training=False, force=True) is None  # nothing trains: nothing could answer


def test_while_every_holder_is_leaving_copies_follow_one_another():
    """Nobody can take the state over before the leavers' --sigterm-grace ends: each copy is
    asked for as soon as the last is written (or URGENT_RETRY after it, if it never is), so
    that what they leave on disk is at most one copy's time old, not --checkpoint-interval."""
    s = CopySchedule(60.0)
    assert s.ask(0.0, training=True) == 1
    assert s.ask(1.0, training=True, urgent=True) is None  # the last one is not written yet
    s.written(1)
    assert s.ask(1.5, training=True, urgent=True) == 2  # written: the next at once
    assert s.ask(1.6, training=True, urgent=True) is None
    assert s.ask(1.5 + URGENT_RETRY, training=True, urgent=True) == 3  # never whole: asked again
    assert s.ask(30.0, training=True) is None  # the leavers gone: the interval again
    assert s.ask(4.0, training=False, urgent=True) is None  # nothing trains: nothing could answer


def test_progress_keeps_the_furthest_point_and_when_its_commit_was_first_heard():
    p = Progress()
    assert p.report(10, 1, now=100.0, wall=1e9, keep_file=True)  # the first point is written at once
    assert (p.steps, p.commit, p.at, p.commit_at) == (10, 1, 1e9, 100.0)
    assert not p.report(5, 1, now=101.0, wall=1e9 + 1, keep_file=True)  # behind: ignored
    assert not p.report(12, 1, now=101.0, wall=1e9 + 1, keep_file=True)  # further, but written 1 s ago
    assert (p.steps, p.commit_at) == (12, 100.0)  # the same commit: its first time stays
    assert p.report(20, 2, now=100.0 + PROGRESS_EVERY + 0.1, wall=1e9 + 3, keep_file=True)
    assert p.commit_at == 100.0 + PROGRESS_EVERY + 0.1
    assert not p.report(30, 3, now=500.0, wall=1e9 + 400, keep_file=False)  # no checkpoint directory
    assert (p.steps, p.commit) == (30, 3)
    # A worker a step behind the furthest, with a newer commit (the old workers died; it joined
    # later): its commit counts, and when it was first heard.
    p.report(29, 4, now=600.0, wall=1e9 + 500, keep_file=False)
    assert (p.steps, p.commit, p.commit_at, p.at) == (30, 4, 600.0, 1e9 + 400)


WAITING = FinalCopy(written=False, failure=None, service_alive=True, workers_alive=True, waited=0.5,
                    newest_commit=7, base_commit=7)


@pytest.mark.parametrize("change, verdict", [
    ({}, None),  # a commit may still come
    ({"written": True, "failure": "disk full"}, ""),  # written wins over an older failure
    ({"failure": "disk full"}, "disk full"),
    ({"service_alive": False}, "the durable-copy service has stopped"),
    ({"workers_alive": False}, "every worker is gone"),
    ({"waited": 1.5}, "no commit newer than commit 7 was made"),
    ({"waited": 1.5, "newest_commit": 8}, None),  # a newer commit was made: its copy is coming
    ({"waited": 30.0, "failure": "disk full", "service_alive": False}, "disk full"),  # the first reason
])
def test_a_stops_last_copy_is_settled_as_soon_as_its_outcome_is_known(change, verdict):
    assert final_copy_verdict(dataclasses.replace(WAITING, **change), commit_news=1.5) == verdict
