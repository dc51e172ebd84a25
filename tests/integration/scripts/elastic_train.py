"""Test training script: elastic loop with injected faults, logging what rank 0 sees.

Each epoch runs --batches allreduce steps and commits after every batch. Rank 0 appends one
JSON line per epoch start to --log (epoch, rank, size, host, rendezvous count, round) and
writes the epoch number to --progress, which the tests' discovery scripts read to change
the host list as training advances.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch

import elasticrun.torch as hvd
from elasticrun.worker import runtime

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=6)
p.add_argument("--batches", type=int, default=5)
p.add_argument("--sleep", type=float, default=0.02)
p.add_argument("--log", required=True)
p.add_argument("--progress", default=None)
p.add_argument("--fail", action="append", default=[],
               help="HOST:SLOT@EPOCH:MODE (MODE exception|sigkill|latekill|exit|sigstop|stall); once per marker dir")
p.add_argument("--marker-dir", default=None)
p.add_argument("--await-size", action="append", default=[],
               help="EPOCH:SIZE: at the start of EPOCH, wait (checking for host updates) until size() == SIZE")
p.add_argument("--await-round", action="append", default=[],
               help="EPOCH:ROUND: at the start of EPOCH, wait (checking for host updates) until the job's round "
                    "is ROUND or later (a change that leaves the size as it was; the same number on every rank)")
p.add_argument("--ported-broadcast", action="store_true",
               help="call Horovod's broadcast_parameters before the elastic function, as a ported script may")
p.add_argument("--prepare-epochs", type=int, default=0,
               help="a worker joining the running job waits after hvd.init() until rank 0 has trained this "
                    "many more epochs (a slow model build the survivors must not wait for)")
args = p.parse_args()

hvd.init()
rt = runtime.get()


def epoch_now() -> int:
    try:
        return int(open(args.progress).read() or 0)
    except (OSError, ValueError):
        return 0


if args.prepare_epochs and rt.joining:
    first, deadline = epoch_now(), time.monotonic() + 60
    launched_for = (hvd.rank(), hvd.size())  # the planned place: no round joined for it
    assert rt.round == -1 and launched_for[1] >= 2, f"a newcomer takes no place at hvd.init(): {rt.current_round}"
    # Never past the epoch before one rank 0 holds at (--await-size): that epoch is the last it
    # announces until this worker is in (a newcomer that started late, on a slow machine).
    holds = [int(spec.split(":")[0]) for spec in args.await_size if int(spec.split(":")[0]) > first]
    target = min([first + args.prepare_epochs] + [h - 1 for h in holds])
    while epoch_now() < target:
        if time.monotonic() > deadline:
            sys.exit(f"the survivors stalled at epoch {epoch_now()} while {rt.hostname} prepared")
        time.sleep(0.02)
    print(f"prepared while the survivors trained epochs {first} to {epoch_now()} "
          f"(launched as rank {launched_for[0]} of {launched_for[1]})", flush=True)
state = hvd.elastic.ObjectState(epoch=0, batch=0, total=0.0)
if args.ported_broadcast:  # every rank of round 0 together; a newcomer alone, while the others sync
    hvd.broadcast_parameters({"w": torch.zeros(4)}, root_rank=0)


def maybe_fail(epoch: int) -> None:
    me = f"{rt.hostname}:{rt.slot}"
    for spec in args.fail:
        who, rest = spec.split("@")
        at, mode = rest.split(":")
        if who not in (me, "*") or int(at) != epoch:
            continue
        marker = os.path.join(args.marker_dir, f"{who.replace(':', '_')}-{at}-{mode}-{me.replace(':', '_')}")
        if os.path.exists(marker):
            continue
        open(marker, "w").close()
        print(f"injecting {mode} on {me} at epoch {epoch}", flush=True)
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "latekill":  # peers are already blocked in the next collective, waiting for us
            time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "exit":
            os._exit(3)
        if mode == "stall":  # alive and heartbeating, but late to its next collective (by far more
            time.sleep(8)    # than the test's 2 s collective timeout, however slow the machine)
            return
        if mode == "sigstop":  # hung: alive but silent
            os.kill(os.getpid(), signal.SIGSTOP)
        raise RuntimeError(f"injected failure on {me}")


def _hold(state, reached, what: str) -> None:
    """Wait (checking for host updates, so that the change can come) until ``reached()``."""
    deadline = time.monotonic() + 90
    while not reached():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} at epoch {state.epoch}")
        time.sleep(0.05)
        state.check_host_updates()


def await_size(state) -> None:
    """Hold training at an epoch until the job has reached the expected round and the world
    has the expected size (makes tests deterministic)."""
    for spec in args.await_round:
        epoch, number = map(int, spec.split(":"))
        if state.epoch == epoch:
            _hold(state, lambda: rt.round >= number, f"the job never reached round {number}")
    for spec in args.await_size:
        epoch, size = map(int, spec.split(":"))
        if state.epoch == epoch:
            _hold(state, lambda: hvd.size() == size, f"the world never reached size {size}")


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        if state.batch == 0:
            await_size(state)
        if state.batch == 0 and hvd.rank() == 0:
            with open(args.log, "a") as f:
                f.write(json.dumps({"epoch": state.epoch, "rank": hvd.rank(), "size": hvd.size(),
                                    "host": rt.hostname, "rendezvous": rt.rendezvous_count,
                                    "round": rt.round}) + "\n")
            if args.progress:
                with open(args.progress + ".tmp", "w") as f:
                    f.write(str(state.epoch))
                os.replace(args.progress + ".tmp", args.progress)
        while state.batch < args.batches:
            maybe_fail(state.epoch)
            t = torch.ones(8)
            hvd.allreduce_(t, op=hvd.Sum)
            assert int(t[0]) == hvd.size(), (t, hvd.size())
            state.total += float(t[0])
            state.batch += 1
            time.sleep(args.sleep)
            state.commit()
        state.epoch += 1
        state.batch = 0
        state.commit()
    return state.total


total = train(state)
print(f"finished rank={hvd.rank()} size={hvd.size()} epochs={state.epoch}", flush=True)
