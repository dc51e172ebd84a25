"""Launch -> first step of a real job, with warm worker start and without, in the same run.

    python benchmarks/launch.py [--repeats 5] [--hosts localhost:2,127.0.0.1:2] [--old-tree DIR]

Each repeat runs the same short job twice, in alternating order: with warm worker start (the
default: workers forked from a per-host template that has imported torch and elasticrun) and
with ``--no-warm-start`` (every worker a new ``python`` process). The job: a tiny model,
``hvd.DistributedOptimizer`` inside ``elastic.run``, 10 steps, committing every step.

Measured, from the moment ``elasticrun`` is started (wall clock, this process):

* **first step**: the first training step of round 0 completed on every rank (each rank prints
  the time after its first ``optimizer.step()``, whose allreduce includes every rank);
* **first launch**: the driver's first ``worker_started`` (its own start-up and discovery);
* **job**: until the ``elasticrun`` command exits (its workers done, templates stopped).

Then, unless ``--additions 0``, one longer job per mode (localhost:2 found by a discovery
script polled every ``--discovery-interval`` s, default 1.0) has 127.0.0.1:2 added to
discovery's output ``--additions`` times (and removed again between additions):

* **host added -> first step including it**: from writing the host into the file discovery
  reads to the first completed step of the round that includes the new workers (the job's
  event log). Target: at most the discovery interval + 0.3 s.

Modes alternate (warm, cold, cold, warm, ...) so that drifts of this machine's speed hit both.
``--old-tree DIR`` adds a third mode: the same job run by another elasticrun tree
(``PYTHONPATH=DIR``, e.g. ``git archive main elasticrun | tar -x -C DIR``), for before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)


def _job():
    """The tiny model both workers train: (hvd, F, model, optimizer, state, x, y)."""
    import torch
    import torch.nn.functional as F

    import elasticrun.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model = torch.nn.Linear(16, 4)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    return hvd, F, model, opt, state, torch.randn(8, 16), torch.randint(0, 4, (8,))


def worker(steps: int) -> None:
    """The launch jobs' worker: prints when its first step is done, stops after ``steps``."""
    hvd, F, model, opt, state, x, y = _job()

    @hvd.elastic.run
    def train(state):
        while state.step < steps:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            if state.step == 0:
                print(f"FIRST_STEP {time.time():.6f}", flush=True)
            state.step += 1
            state.commit()

    train(state)


def loop_worker(stop_file: str) -> None:
    """The addition jobs' worker: trains until ``stop_file`` exists."""
    hvd, F, model, opt, state, x, y = _job()

    @hvd.elastic.run
    def train(state):
        while not (state.step % 20 == 0 and state.step and os.path.exists(stop_file)):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
            state.step += 1
            time.sleep(0.01)
            state.commit()

    train(state)


class Journal:
    """The job's event log, read as it grows."""

    def __init__(self, path: str):
        self.path, self.events, self._offset = path, [], 0

    def wait_for(self, pred, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            if os.path.exists(self.path):
                with open(self.path, encoding="utf-8") as f:
                    f.seek(self._offset)
                    chunk = f.read()
                complete = chunk[: chunk.rfind("\n") + 1]
                self._offset += len(complete.encode())
                self.events += [json.loads(line) for line in complete.splitlines() if line.strip()]
            for e in self.events[seen:]:
                if pred(e):
                    return e
            seen = len(self.events)
            time.sleep(0.01)
        raise TimeoutError(f"waited {timeout:g} s for {what}")


def addition_job(mode: str, additions: int, interval: float) -> list[float]:
    """Seconds from a host's appearance in discovery to the first step including it, per addition."""
    tmp = tempfile.mkdtemp(prefix="elasticrun-addition-")
    hosts, events, stop = (os.path.join(tmp, n) for n in ("hosts", "events.jsonl", "stop"))
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts}\n")
    os.chmod(script, 0o755)
    one, two = "localhost:2\n", "localhost:2\n127.0.0.1:2\n"
    with open(hosts, "w") as f:
        f.write(one)
    cmd = [sys.executable, "-m", "elasticrun", "-np", "2", "--min-np", "2", "--max-np", "4",
           "--host-discovery-script", script, "--discovery-interval", f"{interval:g}", "--events", events,
           "--log-level", "WARNING", *(["--no-warm-start"] if mode == "cold" else []),
           sys.executable, HERE, "--loop-worker", stop]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    journal = Journal(events)
    seconds = []
    try:
        journal.wait_for(lambda e: e["kind"] == "rendezvous_complete", 120, "training to start")
        for _ in range(additions):
            time.sleep(0.5)
            with open(hosts, "w") as f:
                f.write(two)
            added = time.time()
            grown = journal.wait_for(lambda e: e["kind"] == "round_formed" and e.get("size") == 4
                                     and e["t"] > added, 60, "a round with the added host")
            step = journal.wait_for(lambda e: e["kind"] == "first_step" and e.get("round") == grown["round"], 60,
                                    "the first step including the added host")
            seconds.append(step["t"] - added)
            with open(hosts, "w") as f:
                f.write(one)
            removed = time.time()
            shrunk = journal.wait_for(lambda e: e["kind"] == "round_formed" and e.get("size") == 2
                                      and e["t"] > removed, 60, "a round without the host")
            journal.wait_for(lambda e: e["kind"] == "first_step" and e.get("round") == shrunk["round"], 60,
                             "a step without the host")
        open(stop, "w").close()
        driver.wait(timeout=60)
    finally:
        if driver.poll() is None:
            driver.terminate()
            driver.wait(timeout=30)
        shutil.rmtree(tmp, ignore_errors=True)
    return seconds


def one_job(hosts: str, np: int, mode: str, steps: int, old_tree: str | None = None) -> dict[str, float]:
    """``mode``: "warm", "cold" (--no-warm-start) or "old" (the tree at ``old_tree``)."""
    tmp = tempfile.mkdtemp(prefix="elasticrun-launch-")
    events = os.path.join(tmp, "events.jsonl")
    cmd = [sys.executable, "-m", "elasticrun", "-np", str(np), "-H", hosts, "--events", events,
           "--log-level", "WARNING", *(["--no-warm-start"] if mode == "cold" else []),
           sys.executable, HERE, "--worker", str(steps)]
    env = dict(os.environ)
    if mode == "old":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (old_tree, env.get("PYTHONPATH")) if p)
    start = time.time()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    ended = time.time()
    if out.returncode != 0:
        raise RuntimeError(f"the job failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    log = [json.loads(line) for line in open(events, encoding="utf-8") if line.strip()]
    steps = [float(line.split("FIRST_STEP ", 1)[1]) for line in out.stdout.splitlines() if "FIRST_STEP " in line]
    if len(steps) != np:
        raise RuntimeError(f"{len(steps)} of {np} ranks reported their first step:\n{out.stdout}\n{out.stderr}")
    first_step = max(steps)
    first_launch = min(e["t"] for e in log if e["kind"] == "worker_started")
    shutil.rmtree(tmp, ignore_errors=True)
    return {"first_step": first_step - start, "first_launch": first_launch - start, "job": ended - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="jobs per mode")
    p.add_argument("--hosts", default="localhost:2,127.0.0.1:2", help="-H of the job (default: 2 hosts x 2 slots)")
    p.add_argument("--steps", type=int, default=10, help="training steps per job")
    p.add_argument("--old-tree", metavar="DIR", help="also run the job with the elasticrun package in DIR")
    p.add_argument("--additions", type=int, default=3, help="host additions per mode (one job each)")
    p.add_argument("--discovery-interval", type=float, default=1.0, help="of the addition jobs")
    p.add_argument("--worker", metavar="STEPS", type=int, help=argparse.SUPPRESS)
    p.add_argument("--loop-worker", metavar="STOP_FILE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    if args.loop_worker is not None:
        loop_worker(args.loop_worker)
        return
    np = sum(int(h.rpartition(":")[2] or 1) for h in args.hosts.split(","))
    modes = ["warm", "cold"] + (["old"] if args.old_tree else [])
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for i in range(args.repeats):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            results[mode].append(one_job(args.hosts, np, mode, args.steps, args.old_tree))
    names = {"warm": "warm", "cold": "--no-warm-start", "old": "old tree"}
    if args.repeats:
        report(args, np, modes, names, results)
    if args.additions:
        added = {m: addition_job(m, args.additions, args.discovery_interval) for m in ("warm", "cold")}
        print(f"host added -> first step including it (discovery interval {args.discovery_interval:g} s, target "
              f"<= {args.discovery_interval + 0.3:.1f} s):")
        for m in ("warm", "cold"):
            print(f"  {names[m]:<16} p50 {statistics.median(added[m]):.3f}  max {max(added[m]):.3f}  all:",
                  " ".join(f"{v:.3f}" for v in added[m]))


def report(args: argparse.Namespace, np: int, modes: list[str], names: dict[str, str],
           results: dict[str, list[dict[str, float]]]) -> None:
    print(f"-H {args.hosts} (-np {np}), {args.steps} steps, {args.repeats} jobs per mode, alternating")
    print(f"{'measure (s from starting elasticrun)':<36}" + "".join(f" {names[m] + ' p50':>20} {'max':>6}" for m in modes)
          + f" {'warm/cold':>9}")
    for key, label in (("first_step", "launch -> first step of round 0"),
                       ("first_launch", "launch -> first worker started"),
                       ("job", "launch -> elasticrun exits")):
        cells = ""
        for m in modes:
            values = [r[key] for r in results[m]]
            cells += f" {statistics.median(values):>20.3f} {max(values):>6.3f}"
        ratio = statistics.median(r[key] for r in results["warm"]) / statistics.median(r[key] for r in results["cold"])
        print(f"{label:<36}{cells} {ratio:>9.2f}")
    for m in modes:
        print(f"first step per job ({names[m]}):", " ".join(f"{r['first_step']:.3f}" for r in results[m]))


if __name__ == "__main__":
    main()
