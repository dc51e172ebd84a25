"""Uneven data inside an elastic loop: each epoch every rank trains 4 steps and commits, then
rank k trains 3*k more (its extra data), calls hvd.join(), and commits the epoch. With
``kill``, the last rank of a 3-rank round SIGKILLs itself after its second join. Each entry
into the loop and the end print whether the ranks' parameters are bit for bit the same."""

import hashlib
import os
import sys

import torch
import torch.nn.functional as F

import elasticrun.torch as hvd

hvd.init()
torch.manual_seed(0)
torch.set_num_threads(1)
model = torch.nn.Linear(8, 2)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters())
x, y = torch.randn(6, 8), torch.zeros(6, dtype=torch.long)
kill = sys.argv[1:] == ["kill"]
state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0)


def step() -> None:
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def same() -> str:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()
    return "same" if len(set(hvd.allgather_object(digest))) == 1 else "DIFFERENT"


@hvd.elastic.run
def train(state: hvd.elastic.TorchState) -> None:
    print(f"entry rank={hvd.rank()} size={hvd.size()} epoch={state.epoch} replicas={same()}", flush=True)
    while state.epoch < 3:
        for _ in range(4):
            step()
        state.commit()
        for _ in range(3 * hvd.rank()):
            step()
        hvd.join()
        state.epoch += 1
        if kill and state.epoch == 2 and hvd.size() == 3 and hvd.rank() == 2:
            os.kill(os.getpid(), 9)
        state.commit()


train(state)
print(f"end rank={hvd.rank()} size={hvd.size()} replicas={same()}", flush=True)
