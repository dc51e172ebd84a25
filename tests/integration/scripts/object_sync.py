"""An elastic job whose every sync goes through pickled objects: ObjectState, a TorchState
with an ElasticSampler (its sync gathers index sets), broadcast_object and allgather_object.
Run with tests/integration/scripts/no_numpy on PYTHONPATH, it proves none of them needs numpy."""

import json
import sys

import torch

import elasticrun.torch as hvd

try:
    import numpy  # noqa: F401
    sys.exit("numpy is importable: this test would prove nothing")
except ImportError:
    pass

hvd.init()
state = hvd.elastic.ObjectState(epoch=0, notes={"from": hvd.rank()})
sampler = hvd.elastic.ElasticSampler(list(range(12)), shuffle=False)
tstate = hvd.elastic.TorchState(model=torch.nn.Linear(2, 2), sampler=sampler, step=0)


@hvd.elastic.run
def train(state, tstate):
    gathered = hvd.allgather_object({"rank": hvd.rank()})
    token = hvd.broadcast_object({"token": "from rank 0"} if hvd.rank() == 0 else None, root_rank=0)
    state.epoch += 1
    state.commit()
    tstate.commit()
    return gathered, token


gathered, token = train(state, tstate)
print(json.dumps({"rank": hvd.rank(), "notes": state.notes, "gathered": gathered, "token": token}), flush=True)
