"""Test training script for a newcomer's fetch of the committed model (worker/prefetch.py).

The model has trained layers, a frozen parameter and a large buffer ("ballast") that each
worker initialises from its own seed: a newcomer holds other values than the job until the
fetch or the sync gives it the job's, so a rank that missed any byte logs another checksum.
With ``--change-every K`` every rank adds 1 to one element of the ballast at every K-th
commit (the same on all ranks, rolled back by a restore as any state), so commits made
while a newcomer fetches overwrite it and the join's sync must send it again.

At step ``--grow-at`` host 127.0.0.1 is listed; the survivors train on (committing every
step) until the world has ``--size`` ranks, 127.0.0.1's among them, then ``--after`` more steps. Every commit appends
``{"commit", "rank", "size", "host", "checksum"}`` to ``--log-dir/commits-PID.jsonl``.
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

import elasticrun.torch as hvd
from state_checksum import checksum as state_checksum  # (this directory)

p = argparse.ArgumentParser()
p.add_argument("--log-dir", required=True)
p.add_argument("--progress", required=True)
p.add_argument("--ballast-mb", type=int, default=8)
p.add_argument("--change-every", type=int, default=0)
p.add_argument("--grow-at", type=int, default=5)
p.add_argument("--size", type=int, default=2)
p.add_argument("--after", type=int, default=10)
p.add_argument("--background-commit", action="store_true", help="TorchState(background_commit=True)")
p.add_argument("--die-in-fetch", choices=("newcomer", "server"),
               help="SIGKILL that side of the first fetch as its transfer begins (once: a marker in --log-dir)")
args = p.parse_args()

if args.die_in_fetch:  # a fault inside the library's fetch, from this script only
    import signal

    from elasticrun.worker import prefetch

    _group = prefetch._Conn.group
    marker = os.path.join(args.log_dir, "died-in-fetch")

    def die(*_a):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)

    class Dying:
        send = recv = staticmethod(die)

    def group(self, who, rank):
        pg = _group(self, who, rank)
        side = 1 if args.die_in_fetch == "newcomer" else 0
        return Dying() if rank == side and not os.path.exists(marker) else pg

    prefetch._Conn.group = group

hvd.init()
torch.set_num_threads(1)
torch.manual_seed(os.getpid())  # every worker starts from its own values
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
model[0].register_parameter("frozen", torch.nn.Parameter(torch.randn(1000), requires_grad=False))
model.register_buffer("ballast", torch.randn(args.ballast_mb << 18))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters())
gen = torch.Generator().manual_seed(7)
x, y = torch.randn(64, 8, generator=gen), torch.randint(0, 2, (64,), generator=gen)
log_path = os.path.join(args.log_dir, f"commits-{os.getpid()}.jsonl")


def checksum() -> str:
    return state_checksum(model, opt)


class LoggedState(hvd.elastic.TorchState):
    def save(self):
        super().save()
        if self.__dict__.get("_constructed"):
            with open(log_path, "a") as f:
                f.write(json.dumps({"commit": self.commit_seq, "rank": hvd.rank(), "size": hvd.size(),
                                    "host": os.environ.get("ELASTICRUN_HOSTNAME"), "checksum": checksum()}) + "\n")


state = LoggedState(model=model, optimizer=opt, step=0, grown=-1, background_commit=args.background_commit)


@hvd.elastic.run
def train(state):
    deadline = time.monotonic() + 60
    while True:
        if state.step == args.grow_at and hvd.rank() == 0:
            with open(args.progress, "w") as f:
                f.write("1")  # the discovery script now lists the second host
        if (state.grown < 0 and state.step >= args.grow_at and state.step % 5 == 0 and hvd.size() >= args.size
                and "127.0.0.1" in hvd.allgather_object(os.environ.get("ELASTICRUN_HOSTNAME"))):
            state.grown = state.step  # the added host (127.0.0.1) is in
        if state.grown >= 0 and state.step >= state.grown + args.after:
            return
        assert time.monotonic() < deadline, "the newcomer never joined"
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1
        if args.change_every and state.step % args.change_every == 0:
            with torch.no_grad():
                model.ballast[state.step % model.ballast.numel()] += 1
        time.sleep(0.01)
        state.commit()


train(state)
