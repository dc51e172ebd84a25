"""LogLimiter: the first few occurrences in full, then counted summaries; bounded memory."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.common.ratelimit import OVERFLOW, LimitedLog, LogLimiter

pytestmark = pytest.mark.timeout(60)


def total_in(lines: list[str]) -> int:
    """Occurrences a list of summary lines accounts for ("1,234 more ...")."""
    return sum(int(line.split(" more ")[0].replace(",", "")) for line in lines)


def test_first_few_in_full_then_one_summary_with_counts_by_reason():
    lim = LogLimiter(first=3, interval=10.0)
    shown = []
    for i in range(50_000):
        shown += lim.hit("dropped control frames", f"dropped a control frame: #{i}", 100.0 + i * 1e-5,
                         "bad MAC" if i % 10 else "too short")
    assert shown == ["dropped a control frame: #0", "dropped a control frame: #1", "dropped a control frame: #2"]
    lines = lim.flush(100.5)
    assert len(lines) == 1
    assert lines[0] == "49,997 more dropped control frames: 44,998 bad MAC, 4,999 too short"


def test_at_most_one_summary_per_interval_and_nothing_lost():
    lim = LogLimiter(first=2, interval=10.0)
    lines: list[str] = []
    n = 0
    for step in range(600):  # a steady flood for 60 s, flushed after every batch of 10
        now = step * 0.1
        for _ in range(10):
            lines += lim.hit("c", "full line", now, "r")
            n += 1
        lines += lim.flush(now)
    lines += lim.flush(60.0, force=True)
    full = [l for l in lines if l == "full line"]
    summaries = [l for l in lines if l != "full line"]
    assert len(full) == 2
    assert 6 <= len(summaries) <= 8  # the first at once, then one per 10 s, then the final one
    assert total_in(summaries) + len(full) == n


def test_summary_waits_for_the_interval_and_force_flushes():
    lim = LogLimiter(first=1, interval=10.0)
    assert lim.hit("c", "a", 0.0) == ["a"]
    lim.hit("c", "b", 0.0)
    assert len(lim.flush(0.0)) == 1  # the first summary may come at once
    lim.hit("c", "c", 1.0)
    assert lim.flush(5.0) == []  # the next one only 10 s after the previous
    assert lim.flush(10.0) == ["1 more c in the last 9.0 s: 1 other"]
    lim.hit("c", "d", 11.0)
    assert lim.flush(12.0, force=True) == ["1 more c in the last 1.0 s: 1 other"]
    lim.hit("c", "e", 20.0)
    assert lim.flush(45.0) == ["1 more c in the last 25 s: 1 other"]


def test_a_quiet_category_is_forgotten_and_shown_in_full_again():
    lim = LogLimiter(first=1, interval=10.0)
    assert lim.hit("c", "a", 0.0) == ["a"]
    assert lim.hit("c", "b", 1.0) == []
    lim.flush(1.0)
    assert lim.flush(20.0) == [] and len(lim) == 0
    assert lim.hit("c", "again", 21.0) == ["again"]


def test_counted_occurrences_are_summarized_never_shown():
    lim = LogLimiter(first=5)
    lim.count("invalid discovery lines", 99_980, 0.0, "invalid lines not kept")
    lim.count("invalid discovery lines", 0, 0.0)
    assert lim.flush(0.0) == ["99,980 more invalid discovery lines: 99,980 invalid lines not kept"]


def test_reasons_per_category_are_bounded():
    lim = LogLimiter(first=0, max_reasons=3)
    for i in range(1000):
        lim.hit("c", "x", 0.0, f"reason {i}")
    (line,) = lim.flush(0.0)
    assert line == "1,000 more c: 998 other, 1 reason 0, 1 reason 1"


def test_categories_are_bounded_and_overflow_is_counted():
    lim = LogLimiter(first=1, max_categories=4)
    shown = []
    for i in range(10_000):
        shown += lim.hit(f"category {i}", f"problem {i}", float(i) * 1e-3)
        shown += lim.hit(f"category {i}", f"problem {i} again", float(i) * 1e-3)  # counted: pending
        assert len(lim) <= 4
    lines = lim.flush(10.0, force=True)
    assert len(lines) <= 4
    # Every occurrence is either shown or in a summary, overflow included.
    assert len(shown) + total_in(lines) == 20_000
    assert any(line.split(":")[0].split(" in the last")[0].endswith(OVERFLOW) for line in lines)


def test_idle_categories_make_room_for_new_ones():
    lim = LogLimiter(first=5, max_categories=2)
    assert lim.hit("a", "a", 0.0) == ["a"]
    assert lim.hit("b", "b", 1.0) == ["b"]
    assert lim.hit("c", "c", 2.0) == ["c"]  # "a" has nothing pending: it goes
    assert len(lim) == 2 and lim.flush(2.0) == []


@given(events=st.lists(st.tuples(st.integers(0, 20), st.integers(0, 3), st.floats(0, 5)), max_size=300),
       first=st.integers(0, 4), max_categories=st.integers(1, 5))
@settings(max_examples=150, deadline=None)
def test_property_bounded_and_nothing_lost(events, first, max_categories):
    lim = LogLimiter(first=first, interval=2.0, max_categories=max_categories, max_reasons=2)
    now, shown, summaries = 0.0, 0, []
    for category, reason, dt in events:
        now += dt
        shown += len(lim.hit(f"c{category}", "line", now, f"r{reason}"))
        if dt > 3:
            summaries += lim.flush(now)
        assert len(lim) <= max_categories
    summaries += lim.flush(now, force=True)
    assert shown + total_in(summaries) == len(events)
    assert lim.flush(now + 100.0) == [] and len(lim) == 0


def test_limited_log_logs_through_the_logger(caplog):
    clock = [0.0]
    logger = logging.getLogger("test-ratelimit")
    limited = LimitedLog(logger, clock=lambda: clock[0], limiter=LogLimiter(first=2))
    with caplog.at_level(logging.WARNING, logger="test-ratelimit"):
        for i in range(100):
            limited.warn("dropped control frames", f"dropped a control frame: {i}", "bad MAC")
        limited.flush()
        clock[0] = 1.0
        limited.warn("dropped control frames", "late", "bad MAC")
        limited.flush()  # not due yet
        limited.flush(force=True)
    assert [r.getMessage() for r in caplog.records] == [
        "dropped a control frame: 0", "dropped a control frame: 1",
        "98 more dropped control frames: 98 bad MAC",
        "1 more dropped control frames: 1 bad MAC"]
