"""Goodput under chaos: committed samples/s while a worker is SIGKILLed every 10 s, against
the same job without faults, same run.

    python benchmarks/goodput.py [--seconds 60] [--every 10]

A job on 2 hosts x 2 slots (localhost, 127.0.0.1; discovery lists both all along) trains a
small model on an ElasticSampler, committing every 10 steps, for --seconds of wall time. In
the chaos run a worker of 127.0.0.1 is SIGKILLed every --every seconds: the survivors roll
back and carry on, the host is blacklisted for a 1 s cooldown and then comes back (its workers
start again and join). Every worker logs the indices of the batches each commit saved, so the
committed history is exact: goodput is committed samples per second, and every index must
appear at most once per epoch (duplicated) and exactly once in each completed epoch (lost).
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
SAMPLES = 4800


def worker(args) -> None:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import elasticrun.torch as hvd
    from elasticrun.worker import runtime

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hvd.init()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 32, generator=gen)
    y = (x.sum(1) > 0).long()
    data = TensorDataset(x, y, torch.arange(SAMPLES))
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    log = open(os.path.join(args.dir, f"samples-{os.getpid()}.jsonl"), "a")
    with open(os.path.join(args.dir, f"pid-{runtime.get().hostname}-{runtime.get().slot}"), "w") as f:
        f.write(str(os.getpid()))
    pending: list[str] = []

    class State(hvd.elastic.TorchState):
        def save(self):
            super().save()
            now = time.time()  # when these batches became committed history
            log.writelines(json.dumps(dict(e, t=now)) + "\n" for e in pending)
            log.flush()
            pending.clear()

        def restore(self):
            super().restore()
            pending.clear()

    state = State(model=model, optimizer=opt, sampler=sampler, epoch=0, batch=0, stop=False)
    end = float(args.end)

    @hvd.elastic.run
    def train(state):
        while not state.stop:
            for idx, (xb, yb, ib) in enumerate(loader):
                opt.zero_grad()
                F.cross_entropy(model(xb), yb).backward()
                opt.step()
                state.sampler.record_batch(idx, 8)
                pending.append({"epoch": state.epoch, "indices": ib.tolist()})
                time.sleep(args.sleep)
                state.batch += 1
                if state.batch % 10 == 0:
                    # Every rank stops at the same commit: rank 0's clock decides.
                    state.stop = bool(hvd.broadcast(torch.tensor([float(time.time() >= end)]), 0).item())
                    state.commit()
                    if state.stop:
                        return
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()

    train(state)


def run(args, chaos: bool) -> dict:
    tmp = tempfile.mkdtemp(prefix="elasticrun-goodput-")
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as f:
        f.write("#!/bin/sh\necho localhost:2\necho 127.0.0.1:2\n")
    os.chmod(script, 0o755)
    start = time.time() + 8.0  # the job's clock starts once workers are up (see below)
    cmd = [sys.executable, "-m", "elasticrun", "-np", "4", "--min-np", "2", "--host-discovery-script", script,
           "--discovery-interval", "0.2", "--blacklist-cooldown-range", "1", "1",
           sys.executable, HERE, "--worker", "--dir", tmp, "--sleep", str(args.sleep),
           "--end", str(start + args.seconds)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    kills = 0
    try:
        rng = random.Random(1)
        while time.time() < start:
            time.sleep(0.05)
        while chaos and time.time() < start + args.seconds - args.every / 2:
            time.sleep(args.every)
            pids = glob.glob(os.path.join(tmp, "pid-127.0.0.1-*"))
            for path in rng.sample(pids, 1) if pids else []:
                try:
                    with open(path) as f:
                        os.kill(int(f.read()), signal.SIGKILL)
                    kills += 1
                except (OSError, ValueError):
                    pass
        _, err = proc.communicate(timeout=args.seconds + 300)
        if proc.returncode != 0:
            raise RuntimeError(f"the job failed ({proc.returncode}):\n{err[-3000:]}")
        per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
        committed = 0
        for path in glob.glob(os.path.join(tmp, "samples-*.jsonl")):
            with open(path) as f:
                for line in f:
                    e = json.loads(line)
                    per_epoch[e["epoch"]].update(e["indices"])
                    if start <= e["t"] <= start + args.seconds:  # goodput over the measured window only
                        committed += len(e["indices"])
        duplicated = sum(n - 1 for c in per_epoch.values() for n in c.values() if n > 1)
        last = max(per_epoch, default=0)
        lost = sum(SAMPLES - len(c) for e, c in per_epoch.items() if e < last)
        return {"samples_per_s": committed / args.seconds, "committed": committed, "duplicated": duplicated,
                "lost": lost, "kills": kills, "epochs": last + 1}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--every", type=float, default=10.0, help="seconds between kills")
    p.add_argument("--sleep", type=float, default=0.01, help="per step (a stand-in for compute)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    p.add_argument("--end", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    calm = run(args, chaos=False)
    chaos = run(args, chaos=True)
    print(f"2 hosts x 2 slots, {args.seconds:g} s of training, commit every 10 steps")
    for name, r in (("no faults", calm), (f"a worker SIGKILLed every {args.every:g} s", chaos)):
        print(f"{name:<36} {r['samples_per_s']:8.1f} committed samples/s  kills {r['kills']:>2}  "
              f"lost {r['lost']}  duplicated {r['duplicated']}  ({r['epochs']} epoch(s))")
    print(f"goodput with faults / without: {chaos['samples_per_s'] / calm['samples_per_s']:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
