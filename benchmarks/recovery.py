"""Recovery time of a real elastic job, split into phases from the job's event log.

    python benchmarks/recovery.py [--trials 20] [--slots 1] [--state-mb 0] [--state-kind buffer] [--commit-every 1]
                                  [--prepare-s 0] [--no-prefetch] [--ssh]

One long job on two hosts (``localhost``, ``127.0.0.1``; ``--slots`` workers each) trains a
tiny model, committing every step. Each trial:

* **kill**: SIGKILL a worker of the second host; measure from the kill to the first completed
  step on the new (smaller) world. The host is blacklisted with a 1 s cooldown, then comes back:
* **add**: from the host's return to the first step that includes the new worker; and how long
  the survivors stalled (from their interrupt to their first step on the new world). Before it
  asks for its place, the newcomer fetches rank 0's committed model (worker/prefetch.py): how
  long that took, and the survivors' slowest step meanwhile (they train on while rank 0 sends).

Then ``--graceful`` trials remove the second host from discovery and add it back:

* **remove**: from the notification to the first step on the new world (no rollback), and the
  survivors' stall.

``--ssh``: the same on two hosts reached over SSH (``127.0.0.2``, ``127.0.0.3``: a throwaway
sshd of the test suite's, ``tests/integration/sshd.py``, needs ``openssh-server``), so each worker
is started and watched by the SSH launcher's remote watchdog instead of the local launcher.

Phases of a kill (medians): detect (kill -> a survivor's collective fails), decide (kill -> the
driver forms the next round), rendezvous + process group, restore + sync, first step. The
baseline, measured in this run, is the floor of what any in-process recovery must pay on this
machine: forming a fresh 2-rank gloo group (one long-lived store, new prefix) plus one tiny
allreduce.
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
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = os.path.abspath(__file__)
# The host whose workers survive and the one whose worker each trial kills (--ssh: two loopback
# addresses an sshd listens on). The workers read them from their environment too.
SURVIVOR = os.environ.get("RECOVERY_SURVIVOR_HOST", "localhost")
VICTIM = os.environ.get("RECOVERY_VICTIM_HOST", "127.0.0.1")


# --- the training worker --------------------------------------------------------------------
def worker(stop_file: str, state_mb: int = 0, commit_every: int = 1, prepare_s: float = 0.0,
           state_kind: str = "buffer") -> None:
    import torch
    import torch.nn.functional as F

    import elasticrun.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    if prepare_s and os.environ.get("ELASTICRUN_HOSTNAME") != SURVIVOR:
        # Every worker of the second host (the one that leaves and comes back) loads its data
        # before its first sync; round 0's too, which only delays the start.
        time.sleep(prepare_s)
    model = torch.nn.Linear(16, 4)
    if state_mb and state_kind == "buffer":  # state every newcomer must receive: synced, committed, not trained
        model.register_buffer("ballast", torch.ones(state_mb << 18))
    elif state_mb:  # a parameter: frozen (an embedding nobody trains), or trained by every step
        model.ballast = torch.nn.Parameter(torch.ones(state_mb << 18), requires_grad=state_kind == "trained")
    trained = state_mb and state_kind == "trained"
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    # The first host's worker (a survivor in every trial) notes when each step ended: the
    # benchmark reads its slowest step while a newcomer fetched.
    survivor = os.environ.get("ELASTICRUN_HOSTNAME") == SURVIVOR
    ended: list[float] = []

    @hvd.elastic.run
    def train(state):
        while True:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            if trained:
                loss = loss + model.ballast[:1].sum() * 1e-9  # a gradient as large as the parameter
            loss.backward()
            opt.step()
            state.step += 1
            if survivor:
                ended.append(time.time())
            time.sleep(0.005)  # a short step, so kills land at random points of it
            if state.step % commit_every == 0:
                state.commit()
            # Rank 0 alone looks at the stop file and says it to all: ranks looking each for
            # themselves see it at different steps, and one that leaves first ends the job.
            if state.step % 20 == 0 and hvd.broadcast_object(os.path.exists(stop_file), 0, "stop"):
                return

    train(state)
    if survivor:
        with open(f"{stop_file}.steps-{os.getpid()}.json", "w") as f:
            json.dump(ended, f)


# --- the baseline ---------------------------------------------------------------------------
def _floor_rank(rank: int, size: int, port: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timedelta(seconds=60))
    times = []
    for i in range(repeats):
        store.add(f"ready{i}", 1)  # a barrier: every rank starts forming at about the same time
        while int(store.get(f"ready{i}")) < size:
            time.sleep(0.0005)
        start = time.perf_counter()
        pg = dist.ProcessGroupGloo(dist.PrefixStore(f"r{i}", store), rank, size, timedelta(seconds=30))
        pg.allreduce([torch.ones(2)]).wait()
        times.append(time.perf_counter() - start)
        holder = [pg]
        threading.Thread(target=holder.clear, daemon=True).start()  # teardown off the clock
        time.sleep(0.05)
    if rank == 0:
        out.put(statistics.median(times))


def reform_floor_processes(size: int, repeats: int = 7) -> float:
    """Median seconds for ``size`` processes (as many as the job has, on the same cores) to
    form a fresh gloo group on a long-lived store's new prefix and run one tiny allreduce."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_floor_rank, args=(r, size, port, repeats, out)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=300)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def reform_floor(repeats: int = 15) -> float:
    """Median seconds to form a 2-rank gloo group on a new prefix and run a tiny allreduce."""
    import torch
    import torch.distributed as dist

    store = dist.HashStore()
    times = []
    for i in range(repeats):
        done: list[float] = []

        def rank(r: int) -> None:
            pg = dist.ProcessGroupGloo(dist.PrefixStore(f"r{i}", store), r, 2, timedelta(seconds=10))
            pg.allreduce([torch.ones(2)]).wait()
            done.append(time.perf_counter())
            holder = [pg]
            threading.Thread(target=holder.clear, daemon=True).start()  # teardown off the clock

        start = time.perf_counter()
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        times.append(max(done) - start)
    return statistics.median(times)


# --- driving the job ------------------------------------------------------------------------
class Journal:
    """Follows the job's event log as it grows."""

    def __init__(self, path: str):
        self.path = path
        self.events: list[dict] = []
        self._offset = 0

    def poll(self) -> None:
        if not os.path.exists(self.path):
            return
        with open(self.path, encoding="utf-8") as f:
            f.seek(self._offset)
            chunk = f.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._offset += len(complete.encode())
        self.events += [json.loads(line) for line in complete.splitlines() if line.strip()]

    def wait_for(self, pred, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            self.poll()
            for e in self.events[seen:]:
                if pred(e):
                    return e
            seen = len(self.events)
            time.sleep(0.02)
        raise TimeoutError(f"waited {timeout:g} s for {what}")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def run_job(args) -> dict[str, list[float]]:
    tmp = tempfile.mkdtemp(prefix="elasticrun-recovery-")
    hosts_file, events, stop_file = (os.path.join(tmp, n) for n in ("hosts", "events.jsonl", "stop"))
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts_file}\n")
    os.chmod(script, 0o755)
    both = f"{SURVIVOR}:{args.slots}\n{VICTIM}:{args.slots}\n"
    with open(hosts_file, "w") as f:
        f.write(both)
    n = 2 * args.slots
    cmd = [sys.executable, "-m", "elasticrun", "-np", str(n), "--min-np", str(args.slots), "--max-np", str(n),
           "--host-discovery-script", script, "--discovery-interval", "0.1", "--events", events,
           "--blacklist-cooldown-range", "1", "1", "--log-level", "WARNING",
           *(["--no-prefetch"] if getattr(args, "no_prefetch", False) else []), *getattr(args, "ssh_args", []),
           sys.executable, HERE, "--worker", stop_file, "--state-mb", str(args.state_mb),
           "--state-kind", getattr(args, "state_kind", "buffer"),
           "--commit-every", str(args.commit_every), "--prepare-s", str(args.prepare_s)]
    # The driver's console goes to a file: a pipe nobody reads fills (64 KiB) and blocks it.
    console = open(os.path.join(tmp, "console.log"), "w")
    driver = subprocess.Popen(cmd, stdout=console, stderr=subprocess.STDOUT, start_new_session=True)
    journal = Journal(events)
    out: dict[str, list[float]] = {k: [] for k in (
        "kill", "detect", "decide", "rendezvous", "group", "restore+sync", "first_step", "add", "add_stall",
        "fetch", "fetch_slowest", "before_slowest", "steady_step", "remove", "remove_stall")}
    fetches: list[tuple[float, float]] = []  # (start, end) of each newcomer's fetch

    def first_step_of(round_: int, timeout: float = 30) -> dict:
        return journal.wait_for(lambda e: e["kind"] == "first_step" and e.get("round") == round_, timeout,
                                f"the first step of round {round_}")

    def full_world(after: float = 0.0) -> int:
        e = journal.wait_for(lambda e: e["kind"] == "round_formed" and e.get("size") == n and e["t"] > after,
                             60 + 15 * args.slots, f"a round of {n}")
        return e["round"]

    try:
        rnd = full_world()
        journal.wait_for(lambda e: e["kind"] == "first_step" or (e["kind"] == "rendezvous_complete" and e["round"] == rnd),
                         60, "training to start")
        for trial in range(args.trials):
            journal.poll()
            victims = [e for e in journal.events if e["kind"] == "worker_started" and e["host"] == VICTIM]
            pid = _pid_of(victims[-1]["worker"])
            time.sleep(0.2)  # let training run a little
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            formed = journal.wait_for(lambda e: e["kind"] == "round_formed" and e["t"] > t_kill, 30, "the next round")
            step = first_step_of(formed["round"])
            journal.poll()
            mine = [e for e in journal.events if e["t"] >= t_kill and e.get("host") == SURVIVOR
                    and e["source"] == "worker"]

            def at(kind: str) -> dict:
                return next(e for e in mine if e["kind"] == kind)
            out["kill"].append(step["t"] - t_kill)
            out["detect"].append(at("failure_detected")["t"] - t_kill)
            out["decide"].append(formed["t"] - t_kill)
            out["rendezvous"].append(at("rendezvous_complete")["t"] - at("restore")["t"])
            out["group"].append(at("group_formed")["ms"] / 1000)
            out["restore+sync"].append((at("restore")["ms"] + at("sync_done")["ms"]) / 1000)
            out["first_step"].append(step["t"] - at("sync_done")["t"])
            # The host comes back after its cooldown: measure the addition.
            back = journal.wait_for(lambda e: e["kind"] == "host_whitelisted" and e["t"] > t_kill, 30, "the host's return")
            grown = journal.wait_for(lambda e: e["kind"] == "round_formed" and e["t"] > back["t"] and e.get("size") == n,
                                     60 + 15 * args.slots, "the world to grow back")  # slots start at once
            step = first_step_of(grown["round"])
            interrupt = [e for e in journal.events if e["kind"] == "interrupt" and e["t"] > back["t"]]
            out["add"].append(step["t"] - back["t"])
            out["add_stall"].append(step["t"] - min(e["t"] for e in interrupt))
            fetched = [e for e in journal.events if e["kind"] == "state_fetched" and e["t"] > back["t"]]
            if fetched:
                out["fetch"].append(fetched[0]["ms"] / 1000)
                fetches.append((fetched[0]["t"] - fetched[0]["ms"] / 1000, fetched[0]["t"]))
        for trial in range(args.graceful):
            changed = time.time()
            with open(hosts_file, "w") as f:
                f.write(f"localhost:{args.slots}\n")
            sent = journal.wait_for(lambda e: e["kind"] == "notification_sent" and e.get("removed")
                                    and e["t"] > changed, 30, "the removal")
            formed = journal.wait_for(lambda e: e["kind"] == "round_formed" and e["t"] > sent["t"], 30, "the next round")
            step = first_step_of(formed["round"])
            journal.poll()
            interrupt = [e for e in journal.events if e["kind"] == "interrupt" and e["t"] >= sent["t"]]
            out["remove"].append(step["t"] - sent["t"])
            out["remove_stall"].append(step["t"] - min(e["t"] for e in interrupt))
            changed = time.time()
            with open(hosts_file, "w") as f:
                f.write(both)
            first_step_of(full_world(after=changed))
            time.sleep(0.3)
        open(stop_file, "w").close()
        try:
            driver.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sys.exit(f"the job did not end within 60 s of the stop file; its console: {console.name}")
        ended = sorted(t for name in os.listdir(tmp) if name.startswith("stop.steps-")
                       for t in _read_json(os.path.join(tmp, name)))
        gaps = [(b, b - a) for a, b in zip(ended, ended[1:])]
        for start, end in fetches:  # the longest step that overlapped the fetch, and before it
            during = [g for t, g in gaps if t > start and t - g < end]
            before = [g for t, g in gaps if start - (end - start) < t <= start]
            if during and before:
                out["fetch_slowest"].append(max(during))
                out["before_slowest"].append(max(before))
        out["steady_step"] = [statistics.median(g for _, g in gaps)] if gaps else []
    finally:
        console.close()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGTERM)
            driver.wait(timeout=30)
        if args.keep_events:
            shutil.copyfile(events, args.keep_events)
    return out


def _read_json(path: str) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _pid_of(worker_id: str) -> int:
    """The PID of the worker process with ELASTICRUN_WORKER_ID=worker_id (this machine)."""
    needle = f"ELASTICRUN_WORKER_ID={worker_id}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        return int(entry)
            except OSError:
                continue
    raise LookupError(f"no process for worker {worker_id}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="kill (and re-add) trials")
    p.add_argument("--graceful", type=int, default=5, help="graceful removal trials")
    p.add_argument("--slots", type=int, default=1, help="workers per host (2 hosts)")
    p.add_argument("--sweep", metavar="SLOTS,...",
                   help="instead: kill trials at 2 hosts x each of these slot counts (e.g. 1,2,4,8: 2 to 16 "
                        "ranks), each against a floor of its own size")
    p.add_argument("--keep-events", metavar="FILE", help="copy the job's event log there (for elasticrun timeline)")
    p.add_argument("--state-mb", type=int, default=0,
                   help="add this many MiB to the state (a model buffer): what a newcomer's sync carries")
    p.add_argument("--state-kind", choices=("buffer", "frozen", "trained"), default="buffer",
                   help="what --state-mb is: a buffer (sent to every rank by a sync), a frozen parameter, or "
                        "a parameter every step trains (its gradient allreduced, its commit copied every time)")
    p.add_argument("--commit-every", type=int, default=1, help="commit every N steps (1)")
    p.add_argument("--prepare-s", type=float, default=0.0,
                   help="the second host's workers sleep this long after hvd.init() (loading their data)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="run the job with --no-prefetch: the join's sync carries the whole state")
    p.add_argument("--ssh", action="store_true",
                   help="both hosts over SSH: a throwaway sshd (tests/integration/sshd.py) on 127.0.0.2 and "
                        "127.0.0.3 of this machine, workers started by the SSH launcher and its remote watchdog")
    p.add_argument("--worker", metavar="STOP_FILE", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.state_mb, args.commit_every, args.prepare_s, args.state_kind)
        return
    if args.ssh:
        with tempfile.TemporaryDirectory(prefix="elasticrun-recovery-sshd-") as d:
            sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "tests", "integration"))
            from sshd import SSHServer  # a dev tool: the test suite's real sshd

            server = SSHServer(Path(d), ["127.0.0.2", "127.0.0.3"]).start()
            try:
                global SURVIVOR, VICTIM
                SURVIVOR, VICTIM = "127.0.0.2", "127.0.0.3"
                os.environ.update(RECOVERY_SURVIVOR_HOST=SURVIVOR, RECOVERY_VICTIM_HOST=VICTIM)  # the workers'
                args.ssh_args = server.ssh_args()
                report(args)
            finally:
                server.stop()
        return
    report(args)


def report(args: argparse.Namespace) -> None:
    """Run the job (or the sweep) and print its table."""
    if args.sweep:
        sweep(args)
        return
    floor = reform_floor()
    out = run_job(args)
    size = f"tiny model + {args.state_mb} MiB of state ({args.state_kind})" if args.state_mb else "tiny model"
    every = "every step" if args.commit_every == 1 else f"every {args.commit_every} steps"
    prepare = f"; the second host's workers prepare {args.prepare_s:g} s after hvd.init()" if args.prepare_s else ""
    print(f"2 hosts x {args.slots} slot(s), {size}, commit {every}; {args.trials} kill trials, "
          f"{args.graceful} graceful removals{prepare}")
    print(f"baseline (this run): form a 2-rank gloo group on a new prefix + one tiny allreduce: "
          f"{floor * 1000:.1f} ms")
    print(f"{'measure':<46} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'p50/base':>9}")
    labels = {
        "kill": "kill -> first step on the new world",
        "detect": "  detect: kill -> a survivor's collective fails",
        "decide": "  decide: kill -> driver forms the next round",
        "rendezvous": "  restore done -> assignment received",
        "group": "  process group formed",
        "restore+sync": "  restore + sync",
        "first_step": "  sync done -> first step",
        "add": "host back -> first step including it",
        "add_stall": "  survivors' stall (interrupt -> first step)",
        "fetch": "  before it: the newcomer's fetch of the commit",
        "fetch_slowest": "  survivors' slowest step during the fetch",
        "before_slowest": "  (their slowest as long just before it)",
        "steady_step": "  (a survivor's median step, the whole job)",
        "remove": "graceful removal: notification -> first step",
        "remove_stall": "  survivors' stall (interrupt -> first step)",
    }
    for key, label in labels.items():
        values = out[key]
        if values:
            p50 = statistics.median(values)
            print(f"{label:<46} {p50 * 1000:>8.1f} {pct(values, 0.95) * 1000:>8.1f} {max(values) * 1000:>8.1f} "
                  f"{p50 / floor:>9.2f}")


PHASES = ("detect", "decide", "rendezvous", "group", "restore+sync", "first_step")


def sweep(args) -> None:
    """Recovery against world size: 2 hosts x 1, 2, 4, 8 slots (2 .. 16 ranks), each against the
    floor of its own size measured in the same run."""
    rows = []
    for slots in [int(x) for x in args.sweep.split(",")]:
        n = 2 * slots
        floor = reform_floor_processes(n)
        out = run_job(argparse.Namespace(**dict(vars(args), slots=slots, graceful=0)))
        kill = statistics.median(out["kill"])
        rows.append((n, floor, kill, pct(out["kill"], 0.95), {k: statistics.median(out[k]) for k in PHASES}))
        print(f"{n:>3} ranks: kill -> first step p50 {kill * 1000:.1f} ms (p95 {rows[-1][3] * 1000:.1f}); "
              f"floor {floor * 1000:.1f} ms; " + ", ".join(f"{k} {v * 1000:.1f}" for k, v in rows[-1][4].items()),
              flush=True)
    print(f"\n{'ranks':>5} {'floor ms':>9} {'kill->step p50':>15} {'p95':>8} {'/floor':>7} {'/2 ranks':>9}  "
          + " ".join(f"{k:>12}" for k in PHASES))
    base = rows[0][2]
    for n, floor, kill, p95, phases in rows:
        print(f"{n:>5} {floor * 1000:>9.1f} {kill * 1000:>15.1f} {p95 * 1000:>8.1f} {kill / floor:>7.2f} "
              f"{kill / base:>9.2f}  " + " ".join(f"{phases[k] * 1000:>12.1f}" for k in PHASES))


if __name__ == "__main__":
    main()
