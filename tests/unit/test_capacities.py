"""The pure decisions behind the capacity-capped allgather (elasticrun/worker/capacities.py)."""

from __future__ import annotations

import itertools

import pytest

from elasticrun.worker.capacities import LIMIT, Capacities, beyond, gather_capacities, pieces


def test_an_unknown_key_has_no_capacities_and_a_stored_one_is_returned() -> None:
    caps = Capacities()
    assert caps.get(("allgather", None, ())) is None
    caps.put(("allgather", None, ()), (3,))
    assert caps.get(("allgather", None, ())) == (3,)
    caps.put(("allgather", None, ()), (5,))
    assert caps.get(("allgather", None, ())) == (5,) and len(caps) == 1


def test_the_least_recently_used_key_is_dropped_past_the_limit() -> None:
    caps = Capacities(limit=3)
    for k in "abc":
        caps.put(k, (1,))
    assert caps.get("a") == (1,)  # a is now the most recent
    caps.put("d", (1,))
    assert caps.get("b") is None and [caps.get(k) for k in "acd"] == [(1,)] * 3 and len(caps) == 3


def test_two_groups_making_the_same_calls_keep_the_same_keys() -> None:
    calls = [f"k{i % 7}" if i % 3 else f"x{i}" for i in range(200)]
    a, b = Capacities(limit=5), Capacities(limit=5)
    for key in calls:
        for caps in (a, b):
            if caps.get(key) is None:
                caps.put(key, (len(key),))
    assert list(a._caps.items()) == list(b._caps.items())


def test_the_default_limit_bounds_memory() -> None:
    caps = Capacities()
    for i in range(LIMIT + 50):
        caps.put(i, (i,))
    assert len(caps) == LIMIT and caps.get(0) is None and caps.get(LIMIT + 49) == (LIMIT + 49,)


def test_beyond_is_what_passes_each_capacity() -> None:
    assert beyond([5, 2, 0, 7], [3, 3, 0, 7]) == [2, 0, 0, 0]


def test_the_next_capacity_of_each_tensor_is_the_largest_count() -> None:
    assert gather_capacities([[3, 0, 1], [5, 0, 1], [2, 0, 4]]) == (5, 0, 4)
    assert gather_capacities([]) == ()


@pytest.mark.parametrize("counts", list(itertools.product([0, 1, 3, 5], repeat=3)))
@pytest.mark.parametrize("cap", [0, 1, 3, 5])
def test_pieces_place_every_row_once(counts: tuple[int, ...], cap: int) -> None:
    rest = max(0, max(counts) - cap)
    placed = pieces(counts, cap, rest)
    for n, (first, second) in zip(counts, placed):
        assert first + second == n and first <= cap and second <= rest
        assert second == 0 or first == cap  # the second exchange carries only rows past the capacity


def test_pieces_refuse_rows_that_fit_nowhere() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        pieces([7], 3, 2)


def test_only_capacities_under_the_byte_limit_are_sent_ahead() -> None:
    from elasticrun.worker.capacities import SPECULATE_BYTES, usable

    row = 4096
    fits = SPECULATE_BYTES // row
    assert usable([fits, fits + 1, 0, 7], [row, row, row, 1]) == (fits, 0, 0, 7)
