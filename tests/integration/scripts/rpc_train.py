"""torch.distributed.rpc with distributed autograd inside an elastic job, across a reset.

RPC is initialised from the environment elasticrun keeps current (MASTER_ADDR/MASTER_PORT,
RANK, WORLD_SIZE) and re-initialised in a reset callback, as docs/porting-from-horovod.md
says. Every step each rank runs a remote multiplication on the next rank inside a distributed
autograd context and checks the gradients that come back. The worker started as rank
``--die-rank`` exits at step ``--die-at``; the others carry on in a smaller world.
"""

import argparse
import json
import os

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

import elasticrun.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--die-at", type=int, default=3)
parser.add_argument("--die-rank", type=int, default=2)
parser.add_argument("--log", required=True)
args = parser.parse_args()

hvd.init()
torch.set_num_threads(1)
START_RANK = int(os.environ["HOROVOD_RANK"])


def start_rpc() -> None:
    rpc.init_rpc(f"worker{hvd.rank()}", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                 rpc_backend_options=rpc.TensorPipeRpcBackendOptions(init_method="env://", rpc_timeout=30))


def restart_rpc() -> None:
    rpc.shutdown(graceful=False)
    start_rpc()


start_rpc()
state = hvd.elastic.ObjectState(step=0)
state.register_reset_callbacks([restart_rpc])


@hvd.elastic.run
def train(state):
    while state.step < args.steps:
        if state.step == args.die_at and START_RANK == args.die_rank:
            os._exit(1)
        hvd.barrier()  # a peer that died is noticed here (HorovodInternalError), not inside an RPC
        peer = (hvd.rank() + 1) % hvd.size()
        with dist_autograd.context() as ctx:
            a = torch.full((3,), float(hvd.rank() + 1), requires_grad=True)
            b = torch.full((3,), 2.0, requires_grad=True)
            loss = rpc.rpc_sync(f"worker{peer}", torch.mul, args=(a, b)).sum()
            dist_autograd.backward(ctx, [loss])
            grads = dist_autograd.get_gradients(ctx)
            ok = torch.equal(grads[a], b.detach()) and torch.equal(grads[b], a.detach())
        hvd.barrier()
        with open(args.log, "a") as f:
            f.write(json.dumps({"step": state.step, "rank": hvd.rank(), "size": hvd.size(), "peer": peer, "ok": ok,
                                "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
                                "start_rank": START_RANK}) + "\n")
        state.step += 1
        state.commit()


train(state)
rpc.shutdown(graceful=False)
