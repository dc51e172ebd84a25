"""Test training script that logs every committed sample index, to prove exactly-once.

Trained indices are buffered in memory and written to this process's log only when a commit's
save completes; a restore (after HorovodInternalError) discards the buffer. So the union of all
logs is exactly the committed history, and tests can check every index of every epoch appears
in it once. Sizes are chosen so that no sampler padding occurs: batch 6 and a dataset of a
multiple of 6 samples divide evenly over 1, 2 or 3 workers at every commit point.

Progress is written as EPOCH*1000+BATCH to --progress for the discovery schedule.
"""

import argparse
import glob
import json
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import elasticrun.torch as hvd
from elasticrun.worker import runtime

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--samples", type=int, default=240)
p.add_argument("--batch-size", type=int, default=6)
p.add_argument("--commit-every", type=int, default=4)
p.add_argument("--check-every-step", action="store_true", help="state.check_host_updates() between commits")
p.add_argument("--restore-at-interrupt", default=None, metavar="HOST:SLOT",
               help="that worker turns its first host-update interrupt into a failed collective (once), as "
                    "if it had seen a round abort first: it rolls back while its peers keep their state")
p.add_argument("--sleep", type=float, default=0.01)
p.add_argument("--log-dir", required=True)
p.add_argument("--progress", required=True)
p.add_argument("--await-size", action="append", default=[], help="EPOCH:BATCH:SIZE")
p.add_argument("--kill", default=None, help="HOST:SLOT@EPOCH:BATCH: SIGKILL that worker there (once)")
p.add_argument("--sigterm", default=None, help="HOST:SLOT@EPOCH:BATCH: that worker gets SIGTERM there (once)")
p.add_argument("--sigterm-twice", action="store_true",
               help="--sigterm's worker gets a second SIGTERM 0.1 s after the first (a machine's shutdown "
                    "signals every process, and the worker's watchdog forwards its own)")
p.add_argument("--sigterm-group", default=None,
               help="HOST:SLOT@EPOCH:BATCH: that worker's whole process group (it and its DataLoader's workers) "
                    "gets SIGTERM there (once), as a machine's shutdown or Slurm's preemption sends it")
p.add_argument("--loader-workers", type=int, default=0, help="the DataLoader's worker processes")
p.add_argument("--loader-context", default="fork", choices=["fork", "spawn", "forkserver"],
               help="how the DataLoader starts them (spawn and forkserver import this script again)")
p.add_argument("--kill-all", default=None, metavar="EPOCH:BATCH",
               help="every worker SIGKILLs itself there (once per host): the whole job is lost")
p.add_argument("--classes", type=int, default=2, help="the model's outputs (a different model to resume into)")
p.add_argument("--adam", action="store_true", help="Adam, not SGD (another optimizer to resume into)")
p.add_argument("--slow-start", default=None, metavar="HOST:SECONDS",
               help="workers on HOST take that much longer to start (before hvd.init())")
p.add_argument("--sigterm-at-start", default=None, metavar="HOST",
               help="the first worker on HOST gets SIGTERM before hvd.init() (a reclaim while it imports or "
                    "loads its data: no handler of elasticrun's is installed yet)")
p.add_argument("--slow", default=None, metavar="HOST:SLOT:SECONDS[@EPOCH:BATCH]",
               help="that worker sleeps SECONDS in every step (a straggler), from that step on")
p.add_argument("--no-commit", action="store_true", help="never commit (nor at the end of an epoch)")
p.add_argument("--clip", action="store_true",
               help="Horovod's clipping pattern: synchronize(), clip, then step() under skip_synchronize()")
p.add_argument("--ballast", type=float, default=0.0, metavar="MB",
               help="the model also holds a buffer of MB megabytes (a state too big for a small disk)")
p.add_argument("--commit-before-run", action="store_true",
               help="state.commit() once before hvd.elastic.run (the script's initial state, before any resume)")
p.add_argument("--exit-at", default=None, metavar="RANK:STEPS",
               help="that rank's script returns (exit 0) after STEPS optimizer steps, while the others train on")
p.add_argument("--die-before-run", default=None, metavar="MARKER",
               help="rank 0 SIGKILLs itself before hvd.elastic.run (so before it restores a durable copy) "
                    "if MARKER exists, removing it (once)")
args = p.parse_args()

if args.slow_start:
    host, seconds = args.slow_start.rsplit(":", 1)
    if os.environ.get("ELASTICRUN_HOSTNAME") == host:
        time.sleep(float(seconds))

if args.sigterm_at_start == os.environ.get("ELASTICRUN_HOSTNAME"):
    try:
        os.close(os.open(os.path.join(args.log_dir, "sigterm-at-start"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        pass  # (once: a worker started there later runs normally)
    else:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # (never reached: SIGTERM's default action ends the process)

torch.manual_seed(0)
torch.set_num_threads(1)
hvd.init()
rt = runtime.get()

gen = torch.Generator().manual_seed(1234)
x = torch.randn(args.samples, 8, generator=gen)
y = (x @ torch.randn(8, generator=gen) > 0).long()
dataset = TensorDataset(x, y, torch.arange(args.samples))

model = torch.nn.Linear(8, args.classes)
if args.ballast:
    model.register_buffer("ballast", torch.zeros(int(args.ballast * (1 << 18))))
optimizer = hvd.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=1e-3) if args.adam
                                     else torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.loader_workers,
                    multiprocessing_context=args.loader_context if args.loader_workers else None)

log_path = os.path.join(args.log_dir, f"samples-{os.getpid()}.jsonl")
pending: list[str] = []


def flush() -> None:
    """The batches since the last save are committed: log them with that commit's number."""
    if pending:
        with open(log_path, "a") as f:
            f.writelines(json.dumps(dict(e, commit=state.commit_seq)) + "\n" for e in pending)
        pending.clear()


class LoggedState(hvd.elastic.TorchState):
    """Writes the buffered sample log when a save completes or a host-update interrupt keeps
    the live state; drops it on restore."""

    def save(self):
        super().save()
        flush()

    def restore(self):
        super().restore()
        pending.clear()
        join_kill_all()

    def check_host_updates(self):
        try:
            super().check_host_updates()
        except hvd.HostsUpdatedInterrupt:
            # The live model is kept, with the gradients of every batch since the last commit
            # (by the survivors, even if this worker leaves): those batches are history now.
            flush()
            marker = os.path.join(args.log_dir, "restored-at-interrupt")
            if args.restore_at_interrupt == f"{rt.hostname}:{rt.slot}" and not os.path.exists(marker):
                open(marker, "w").close()
                raise hvd.HorovodInternalError("simulated: this rank saw the round abort before the agreement")
            raise


def loss_on_all() -> float:
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


state = LoggedState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0)
initial_loss = loss_on_all()


def maybe_signal(epoch: int, batch: int) -> None:
    me = f"{rt.hostname}:{rt.slot}"
    if args.sigterm:
        who, at = args.sigterm.split("@")
        marker = os.path.join(args.log_dir, "sigterm")
        if who == me and tuple(map(int, at.split(":"))) == (epoch, batch) and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)  # as a cloud's reclaim notice would
            if args.sigterm_twice:  # the same notice again, as its SSH watchdog forwards a shutdown's
                time.sleep(0.1)
                os.kill(os.getpid(), signal.SIGTERM)
    if args.sigterm_group:
        who, at = args.sigterm_group.split("@")
        marker = os.path.join(args.log_dir, "sigterm-group")
        if who == me and tuple(map(int, at.split(":"))) == (epoch, batch) and not os.path.exists(marker):
            open(marker, "w").close()
            os.killpg(os.getpgid(0), signal.SIGTERM)
    if args.kill_all and tuple(map(int, args.kill_all.split(":"))) == (epoch, batch):
        marker = os.path.join(args.log_dir, f"killed-all-{me}")
        if not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


def join_kill_all() -> None:
    """--kill-all: a worker whose step failed because another one killed itself there first
    (its last collective ended on that worker before it ended here) dies too, at its restore:
    it would never reach the point itself, waiting for a round that cannot form."""
    me = f"{rt.hostname}:{rt.slot}"
    if (args.kill_all and glob.glob(os.path.join(args.log_dir, "killed-all-*"))
            and not os.path.exists(os.path.join(args.log_dir, f"killed-all-{me}"))):
        open(os.path.join(args.log_dir, f"killed-all-{me}"), "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_slow(epoch: int, batch: int) -> None:
    """A straggler: this worker computes SECONDS longer in every step (from EPOCH:BATCH on)."""
    if not args.slow:
        return
    who, _, since = args.slow.partition("@")
    host, slot, seconds = who.rsplit(":", 2)
    if f"{rt.hostname}:{rt.slot}" == f"{host}:{slot}" and (epoch, batch) >= tuple(map(int, (since or "0:0").split(":"))):
        time.sleep(float(seconds))


def maybe_kill(epoch: int, batch: int) -> None:
    maybe_signal(epoch, batch)
    if not args.kill:
        return
    who, at = args.kill.split("@")
    e, b = map(int, at.split(":"))
    marker = os.path.join(args.log_dir, "killed")
    if who == f"{rt.hostname}:{rt.slot}" and (e, b) == (epoch, batch) and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)


def await_size(epoch: int, batch: int) -> None:
    for spec in args.await_size:
        e, b, size = map(int, spec.split(":"))
        if (e, b) == (epoch, batch):
            deadline = time.monotonic() + 90
            while hvd.size() != size:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"world never reached size {size} at {e}:{b}")
                time.sleep(0.05)
                state.check_host_updates()


@hvd.elastic.run
def train(state):
    while state.epoch < args.epochs:
        offset = state.batch
        for idx, (xb, yb, ib) in enumerate(loader):
            state.batch = offset + idx + 1
            optimizer.zero_grad()
            maybe_slow(state.epoch, state.batch)
            F.cross_entropy(model(xb), yb).backward()
            if args.clip:
                optimizer.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
            state.sampler.record_batch(idx, args.batch_size)
            pending.append({"epoch": state.epoch, "batch": state.batch, "indices": ib.tolist(), "size": hvd.size(),
                            "round": rt.round, "rank": hvd.rank(), "t": time.time(),
                            "job": os.environ.get("ELASTICRUN_JOB_ID")})
            if hvd.rank() == 0:
                with open(args.progress + ".tmp", "w") as f:
                    f.write(str(state.epoch * 1000 + state.batch))
                os.replace(args.progress + ".tmp", args.progress)
            maybe_kill(state.epoch, state.batch)
            if args.exit_at:
                who, steps = map(int, args.exit_at.split(":"))
                if hvd.rank() == who and rt.steps == steps:
                    raise SystemExit(0)
            time.sleep(args.sleep)
            if args.no_commit:
                pass
            elif state.batch % args.commit_every == 0:
                state.commit()
            elif args.check_every_step:
                state.check_host_updates()
            await_size(state.epoch, state.batch)
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        if not args.no_commit:
            state.commit()


if __name__ == "__main__":  # (a DataLoader's spawn/forkserver worker imports this script again)
    if args.commit_before_run:
        state.commit()
    if args.die_before_run and hvd.rank() == 0 and os.path.exists(args.die_before_run):
        os.unlink(args.die_before_run)
        os.kill(os.getpid(), signal.SIGKILL)
    train(state)
    if hvd.rank() == 0:
        with torch.no_grad():
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        with open(os.path.join(args.log_dir, "result.json"), "w") as f:
            json.dump({"initial_loss": initial_loss, "final_loss": loss_on_all(), "accuracy": accuracy,
                       "size": hvd.size()}, f)
