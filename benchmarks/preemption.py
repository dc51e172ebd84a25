"""Steps redone when a worker is lost with, and without, a warning.

    python benchmarks/preemption.py [--commit-every 20] [--repeats 3]

A 3-rank job (hosts localhost, 127.0.0.1, 127.0.0.2, from a discovery file) trains a small
model, committing every --commit-every steps. Midway between two commits, the worker of
127.0.0.2 is

  (a) SIGKILLed (no warning: the survivors roll back to the last commit),
  (b) SIGTERMed (a reclaim notice: it leaves at the next commit),
  (c) announced 5 s ahead: discovery lists its host `draining`, and it is SIGKILLed 5 s later.

Rank 0 counts the optimizer steps it completed and the job's committed steps at the end: the
difference is the work redone. (b) and (c) must redo nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
HOSTS = ["localhost:1", "127.0.0.1:1", "127.0.0.2:1"]


def worker(args) -> None:
    import torch
    import torch.nn.functional as F

    import elasticrun.torch as hvd
    from elasticrun.worker import runtime

    torch.set_num_threads(1)
    torch.manual_seed(0)
    hvd.init()
    model = torch.nn.Linear(32, 32)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    done = [0]
    with open(os.path.join(args.dir, f"pid-{runtime.get().hostname}"), "w") as f:
        f.write(str(os.getpid()))

    @hvd.elastic.run
    def train(state):
        while state.step < args.steps:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            done[0] += 1
            state.step += 1
            if hvd.rank() == 0:
                with open(os.path.join(args.dir, "progress.tmp"), "w") as f:
                    f.write(str(state.step))
                os.replace(os.path.join(args.dir, "progress.tmp"), os.path.join(args.dir, "progress"))
            time.sleep(args.sleep)
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    if hvd.rank() == 0:
        print("PREEMPT-RESULT " + json.dumps({"completed": done[0], "committed": state.step}), flush=True)


def trial(args, mode: str) -> int:
    tmp = tempfile.mkdtemp(prefix="elasticrun-preempt-")
    hosts = os.path.join(tmp, "hosts")
    with open(hosts, "w") as f:
        f.write("\n".join(HOSTS) + "\n")
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts}\n")
    os.chmod(script, 0o755)
    cmd = [sys.executable, "-m", "elasticrun", "-np", "3", "--min-np", "2", "--host-discovery-script", script,
           "--discovery-interval", "0.1", sys.executable, HERE, "--worker", "--dir", tmp, "--steps", str(args.steps),
           "--commit-every", str(args.commit_every), "--sleep", str(args.sleep)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        at = args.commit_every * 3 + args.commit_every // 2  # midway between two commits
        deadline = time.monotonic() + 120
        while _progress(tmp) < at:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the job never reached step {at}: {proc.communicate()[1][-2000:]}")
            time.sleep(0.01)
        with open(os.path.join(tmp, "pid-127.0.0.2")) as f:
            pid = int(f.read())
        if mode == "sigkill":
            os.kill(pid, signal.SIGKILL)
        elif mode == "sigterm":
            os.kill(pid, signal.SIGTERM)
        else:  # announced 5 s ahead, then reclaimed
            with open(hosts, "w") as f:
                f.write("\n".join(HOSTS[:2] + ["127.0.0.2:1 draining"]) + "\n")
            time.sleep(5.0)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # gone already: it left gracefully
        out, err = proc.communicate(timeout=180)
        for line in out.splitlines():
            text = line.split(">:", 1)[-1]
            if text.startswith("PREEMPT-RESULT "):
                r = json.loads(text[len("PREEMPT-RESULT "):])
                return r["completed"] - r["committed"]
        raise RuntimeError(f"no result (exit {proc.returncode}):\n{err[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


def _progress(d: str) -> int:
    try:
        with open(os.path.join(d, "progress")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--commit-every", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--sleep", type=float, default=0.02, help="per step (a stand-in for compute)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    print(f"3 ranks, commit every {args.commit_every} steps, worker lost midway between two commits")
    for mode, what in (("sigkill", "(a) SIGKILLed"), ("sigterm", "(b) SIGTERMed"),
                       ("announced", "(c) announced 5 s ahead (draining), then SIGKILLed")):
        redone = [trial(args, mode) for _ in range(args.repeats)]
        print(f"{what:<55} steps redone: {' '.join(map(str, redone))} (median {statistics.median(redone):g})",
              flush=True)


if __name__ == "__main__":
    main()
