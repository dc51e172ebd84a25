"""Small details of horovod.torch's API that a ported script may rely on (pure: no world)."""

from __future__ import annotations

import pytest

from elasticrun.worker import issuing
from elasticrun.worker.elastic import ObjectState, State
from elasticrun.worker.issuing import Average, Sum

pytestmark = pytest.mark.timeout(30)


def test_average_is_deprecated_in_horovods_words():
    with pytest.warns(DeprecationWarning, match=r"Parameter `average` has been replaced with `op`"):
        assert issuing.resolve_op(None, True) == Average
    with pytest.warns(DeprecationWarning):
        assert issuing.resolve_op(None, False) == Sum


def test_state_and_object_state_take_horovods_framework_arguments():
    """Horovod's ObjectState(bcast_object, get_rank, **kwargs) and State(bcast_object, get_rank):
    by position or name; neither is taken for state."""
    calls = []

    def bcast(obj):
        calls.append(obj)
        return obj

    s = ObjectState(bcast, lambda: 0, epoch=2)
    assert s._object_keys == ["epoch"] and s.epoch == 2
    s.sync()
    assert calls and s.epoch == 2  # its sync used the broadcast it was given
    named = ObjectState(bcast_object=bcast, get_rank=lambda: 0, epoch=1, batch=3)
    assert named._object_keys == ["epoch", "batch"]

    class Custom(State):
        def __init__(self):
            super().__init__(bcast_object=bcast, get_rank=lambda: 0)

    assert Custom()._get_rank() == 0


def test_horovod_torch_elastic_imports_port_by_their_import_line():
    """``from horovod.torch.elastic import ElasticSampler, TorchState`` (Horovod's elastic is a
    module) must work as ``from elasticrun.torch.elastic import ...``."""
    import importlib

    import elasticrun.torch as hvd

    module = importlib.import_module("elasticrun.torch.elastic")
    assert module is hvd.elastic
    from elasticrun.torch.elastic import ElasticSampler, TorchState, run  # noqa: F401

    assert TorchState is hvd.elastic.TorchState and run is hvd.elastic.run
    assert set(module.__all__) <= set(vars(module))


def test_async_handles_can_be_dict_keys_as_horovods_int_handles():
    from elasticrun.worker.waiting import Handle

    a, b = (Handle(work=None, what="allreduce", finish=lambda: None) for _ in range(2))
    table = {a: "first", b: "second"}
    assert table[a] == "first" and table[b] == "second" and a != b
