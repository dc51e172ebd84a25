"""The words of a collective mismatch (elasticrun/worker/agreement.py) and who is off the script
at a reset's sync (elasticrun/worker/elastic.py): pure, no processes."""

from __future__ import annotations

import pytest

from elasticrun.worker.agreement import message
from elasticrun.worker.elastic import SYNC_SIGNATURE, off_script

pytestmark = pytest.mark.timeout(30)

SYNC = dict(SYNC_SIGNATURE, root=None, tensors=None)
PORTED = {"collective": "broadcast_parameters", "root": 0,
          "tensors": tuple(("float32", (32, 64), "cpu") for _ in range(40))}


def test_different_collectives_are_named_alone_and_the_advice_fits_the_drivers_line():
    """The driver keeps a failure's first 500 characters: the advice to remove the calls was cut
    off after the tensors' listing."""
    text = "CollectiveMismatch: " + message([SYNC, SYNC, PORTED], [0, 1, 2])
    assert "collective (ranks 0, 1: hvd.elastic.run's state sync; rank 2: broadcast_parameters)" in text
    assert "tensors" not in text and "root (" not in text
    assert "remove those calls" in text[:500], text


def test_the_same_collective_names_each_argument_that_differs():
    text = message([{"collective": "allreduce", "shape": (2, 3)}, {"collective": "allreduce", "shape": (3, 3)}],
                   [0, 1])
    assert text.startswith("allreduce: the ranks called it with different arguments, so it did not run: "
                           "shape (rank 0: (2, 3); rank 1: (3, 3)). Every rank must call"), text


@pytest.mark.parametrize("signatures,ranks,rank,off", [
    ([SYNC, SYNC, PORTED], [0, 1, 2], 0, [2]),       # the holders go on without the newcomer
    ([SYNC, SYNC, PORTED], [0, 1, 2], 1, [2]),
    ([SYNC, SYNC, PORTED], [0, 1, 2], 2, []),        # the newcomer raises the mismatch
    ([PORTED, SYNC, SYNC], [0, 1, 2], 1, []),        # rank 0 elsewhere: nobody is better placed
    ([SYNC, None, PORTED, PORTED], [0, 1, 2, 3], 0, [2, 3]),  # (None: a rank in join(), which takes any)
])
def test_who_is_off_the_script_at_the_sync(signatures, ranks, rank, off):
    assert off_script(signatures, ranks, rank) == off
