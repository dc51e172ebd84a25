"""Discovery failing run after run is said again every 10 minutes, and its end is said."""

from __future__ import annotations

from elasticrun.discovery.streak import REMINDER, FailureStreak


def test_a_streak_is_said_every_reminder_and_its_end_once():
    s = FailureStreak()
    assert s.failed(0.0, "exit 1") is None  # the first is the caller's own line
    assert all(s.failed(float(t), "exit 1") is None for t in range(1, int(REMINDER)))
    line = s.failed(REMINDER, "exit 1: no route")
    assert line == (f"discovery has failed {int(REMINDER) + 1} run(s) in a row, for {REMINDER:.0f} s (the last: exit 1: "
                    f"no route); the job keeps the hosts it last found")
    assert s.failed(REMINDER + 1, "exit 1") is None
    assert s.failed(2 * REMINDER, "exit 1") is not None
    assert s.succeeded(2 * REMINDER + 5) == (f"discovery works again, after {int(REMINDER) + 3} failed run(s) in "
                                             f"{2 * REMINDER + 5:.0f} s")
    assert s.succeeded(2 * REMINDER + 6) is None  # said once
    assert s.failed(5000.0, "again") is None  # a new streak: its first failure is the caller's line


def test_a_long_reason_is_cut():
    s = FailureStreak()
    s.failed(0.0, "x")
    line = s.failed(REMINDER, "y" * 5000)
    assert line is not None and len(line) < 500
