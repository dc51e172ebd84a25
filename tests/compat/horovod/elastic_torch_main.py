"""The elastic test program of Horovod's own integration tests, in spirit: a tiny model
trained for a few epochs inside hvd.elastic.run, committing every few batches, logging one
JSON line per epoch (rank 0), and an exit schedule that makes chosen workers fail at given
(epoch, batch) points, by an exception or by killing themselves. Written against
horovod.torch (it reads HOROVOD_RANK and HOROVOD_HOSTNAME, as Horovod's does); tests/compat
runs it with only the import line changed."""

import argparse
import json
import os
import signal
import time

import torch
import torch.nn.functional as F

import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch Elastic Test")
parser.add_argument("--batches-per-epoch", type=int, default=10)
parser.add_argument("--batches-per-commit", type=int, default=1)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--epoch-wait", type=float, default=0)
parser.add_argument("--logfile", default="/tmp/logfile.txt")
parser.add_argument("--discovery-schedule", default="[]",
                    help="JSON list of [epoch, hosts]: the hosts discovery lists from that epoch on (null: last)")
parser.add_argument("--discovery-wait", type=int, default=3,
                    help="seconds rank 0 waits for the driver's word of an expected host change (<= 0: no wait)")
parser.add_argument("--exit-schedule", default="{}",
                    help="JSON mapping '[epoch, batch]' to the list of start ranks that exit there")
parser.add_argument("--exit-mode", default="exception", help="exception | kill")
args = parser.parse_args()

hvd.init()

torch.manual_seed(0)
batch_size = 32
data = torch.randn(batch_size, 2)
target = torch.LongTensor(batch_size).random_() % 2

lr = 0.001
model = torch.nn.Sequential(torch.nn.Linear(2, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size())
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

hostname = os.environ.get("HOROVOD_HOSTNAME")
start_rank = int(os.environ.get("HOROVOD_RANK", 0))
exit_schedule = json.loads(args.exit_schedule) if args.exit_schedule else {}
discovery_schedule = json.loads(args.discovery_schedule)
epoch_to_hosts = {epoch: hosts for epoch, hosts in discovery_schedule if epoch is not None}
default_hosts = discovery_schedule[-1][1] if discovery_schedule else []


def check_exit(epoch, batch):
    ranks_to_exit = exit_schedule.get(json.dumps([epoch, batch]), [])
    if start_rank in ranks_to_exit:
        if args.exit_mode == "exception":
            raise RuntimeError(f"check_rank and exit epoch={epoch} batch={batch} start_rank={start_rank} "
                               f"rank={hvd.rank()}")
        os.kill(os.getpid(), signal.SIGKILL)


def log_state(state):
    state_dict = {"epoch": state.epoch, "batch": state.batch, "commits": state.commits, "hostname": hostname,
                  "start_rank": start_rank, "rank": hvd.rank(), "size": hvd.size(), "rendezvous": state.rendezvous}
    with open(args.logfile, "a") as f:
        f.write(json.dumps(state_dict) + os.linesep)


@hvd.elastic.run
def train(state):
    state.rendezvous += 1
    while state.epoch < args.epochs:
        print(f"epoch {state.epoch} batch {state.batch}")
        while state.batch < args.batches_per_epoch:
            check_exit(state.epoch, state.batch)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            state.batch += 1
            if state.batch % args.batches_per_commit == 0:
                state.commits += 1
                state.commit()
        if hvd.rank() == 0:
            log_state(state)
            current_hosts = epoch_to_hosts.get(state.epoch, default_hosts)
            next_hosts = epoch_to_hosts.get(state.epoch + 1, default_hosts)
            if args.discovery_wait > 0 and current_hosts != next_hosts:
                # As Horovod's: poll the state's queue of the driver's host notifications.
                print(f"host changes: {current_hosts} -> {next_hosts}")
                start = int(time.time())
                while state._host_messages.empty():
                    if int(time.time()) - start > args.discovery_wait:
                        raise TimeoutError("Timed out waiting for notifications from driver.")
                    time.sleep(0.1)
        if args.epoch_wait > 0:
            time.sleep(args.epoch_wait)
        state.epoch += 1
        state.batch = 0
        state.commits += 1
        state.commit()


def on_state_reset():
    for param_group in optimizer.param_groups:
        param_group["lr"] = lr * hvd.size()


state = hvd.elastic.TorchState(model, optimizer, batch=0, epoch=0, commits=0, rendezvous=0)
state.register_reset_callbacks([on_state_reset])
train(state)
