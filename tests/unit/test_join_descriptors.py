"""Every operation a rank in hvd.join() may be asked to mirror has a mirror (worker/join.py),
and descriptors travel through the round's store intact (pickled)."""

import inspect
import pickle

import pytest
import torch

from elasticrun.worker import descriptors, join

pytestmark = pytest.mark.timeout(60)


def kinds() -> list[type[descriptors.Op]]:
    return [c for _, c in inspect.getmembers(descriptors, inspect.isclass)
            if issubclass(c, descriptors.Op) and c is not descriptors.Op]


def test_every_mirrored_kind_has_a_mirror_and_no_other_has_one():
    mirrored = {c for c in kinds() if c.mirrored}
    assert mirrored == set(join.MIRRORS), (
        f"descriptor classes without a join mirror: {sorted(c.__name__ for c in mirrored - set(join.MIRRORS))}; "
        f"mirrors of classes not marked mirrored: {sorted(c.__name__ for c in set(join.MIRRORS) - mirrored)}")
    assert len(mirrored) >= 6


FAMILIES = ("issuing", "reductions", "gathers", "broadcast")


def test_the_op_families_issue_only_known_descriptors():
    """A descriptor built where collectives are issued is one of the classes here (no tuple
    conventions)."""
    source = "\n".join(inspect.getsource(__import__(f"elasticrun.worker.{m}", fromlist=["x"])) for m in FAMILIES)
    used = {name for name in dir(descriptors) if f"ops.{name}(" in source}
    assert used and used <= {c.__name__ for c in kinds()}
    assert "ops.Allreduce(" in source and "desc: tuple" not in source


def test_descriptors_survive_the_store():
    d = descriptors.Alltoall((3,), torch.float16, ((1, 2), (0, 4)))
    back = pickle.loads(pickle.dumps((d, "cpu")))
    assert back == (d, "cpu") and back[0].kind == "Alltoall"


def test_an_operation_without_a_mirror_is_refused_by_name():
    with pytest.raises(ValueError, match="cannot take part in.*PartOf"):
        join._mirror(None, descriptors.PartOf("VarAllgather"), "cpu")  # type: ignore[arg-type]
