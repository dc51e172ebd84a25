"""Notifications: strictly increasing timestamps and a bounded replay list."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.driver.notifications import Notifications

pytestmark = pytest.mark.timeout(30)


def test_timestamps_are_the_wall_clock_when_it_moves_on():
    n = Notifications()
    assert n.last_ts == 0.0 and n.recent() == []
    assert n.publish(True, False, wall=100.0).ts == 100.0
    assert n.publish(False, True, wall=101.5).ts == 101.5
    assert n.recent() == [[100.0, True, False], [101.5, False, True]]


@given(st.lists(st.floats(min_value=0, max_value=1e9), min_size=1, max_size=50))
def test_timestamps_strictly_increase_whatever_the_clock_does(walls):
    n = Notifications(keep=4)
    stamps = [n.publish(True, True, w).ts for w in walls]
    assert all(b > a for a, b in zip(stamps, stamps[1:]))
    assert n.last_ts == stamps[-1]
    assert [u[0] for u in n.recent()] == stamps[-4:]  # bounded, newest kept
