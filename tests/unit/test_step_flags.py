"""The step's agreement flags pack and unpack the same way in both places they travel."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.worker.step_flags import StepFlags

pytestmark = pytest.mark.timeout(60)


@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=8))
def test_a_sum_over_ranks_sets_each_flag_some_rank_set(ranks):
    """As in the gradient bucket: summed (or averaged) over the ranks, any rank's flag is set."""
    encoded = [StepFlags(1.0 if p else 0.0, a, w, b).encode() for p, a, w, b in ranks]
    for scale in (1.0, 1.0 / len(ranks)):  # Sum, Average
        reduced = [sum(column) * scale for column in zip(*encoded)]
        flags = StepFlags.decode(reduced)
        assert (flags.pending > 0, flags.added, flags.wanted, flags.busy) == tuple(
            any(r[i] for r in ranks) for i in range(4))


@given(st.lists(st.tuples(st.floats(0, 1e9), st.booleans(), st.booleans(), st.booleans()), min_size=1, max_size=8))
def test_a_max_over_ranks_keeps_the_newest_timestamp(ranks):
    """As in the check point's own allreduce (MAX): pending is the newest timestamp."""
    encoded = [StepFlags(ts, a, w, b).encode() for ts, a, w, b in ranks]
    flags = StepFlags.decode([max(column) for column in zip(*encoded)])
    assert flags.pending == max(r[0] for r in ranks)
    assert (flags.added, flags.wanted, flags.busy) == tuple(any(r[i] for r in ranks) for i in (1, 2, 3))


def test_a_buffer_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="3 values, expected 4"):
        StepFlags.decode([0.0, 0.0, 0.0])
