"""What one registry decision costs while N workers trickle into round 0 (pure registry: no
sockets, no threads), the driver's loop CPU per decision at 1,024 and 4,096 workers; and, with
``--age``, whether a long-lived job's decisions slow with the workers it has replaced.

    python benchmarks/decisions.py [--workers 1024 4096] [--batch 16] [--repeats 3]
                                   [--baseline-tree DIR]
    python benchmarks/decisions.py --age 4000 [--baseline-tree DIR]

``--age CYCLES``: a 2-host job (``-np 2 --min-np 1``) whose second host leaves and comes back
once a cycle, 0.5 s apart on the registry's clock (a spot host flapping at every discovery run,
for CYCLES x 1 s of the job's life), its workers doing at once what the driver asks. It prints
the registry's time for a cycle's decisions (a leave and a join: two resets), over the first
and the last 200 cycles, and the records the registry holds at the end.

Every worker is launched by the first decision; then they ask for their places ``--batch`` at a
time, with a decision (and ``next_deadline``, as the driver's loop calls it) after each batch,
until round 0 forms. ``--baseline-tree DIR``: the same measurement, in the same run, of the
registry of another checkout (e.g. ``git worktree add /tmp/before <commit>``), as a ratio.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import sys
import time

import _trees


def measure(n: int, batch: int) -> dict:
    """One trickle of ``n`` workers into round 0: the first decision, then the rest's mean."""
    from elasticrun.discovery.host_manager import HostManager
    from elasticrun.driver.registry import Launch, Registry, RegistryConfig

    ids = itertools.count()
    config = RegistryConfig(np=n, min_np=n, max_np=None, reset_limit=None, elastic_timeout=600.0,
                            start_timeout=60.0, heartbeat_timeout=5.0)
    reg = Registry(config, HostManager(cooldown_range=None, rng=random.Random(0)), lambda: f"w{next(ids)}")
    now = 0.0
    reg.discovered({f"h{i}": 4 for i in range(n // 4)}, now)
    t = time.perf_counter()
    wids = [a.worker_id for a in reg.decide(now) if isinstance(a, Launch)]
    reg.next_deadline()
    first = time.perf_counter() - t
    spent, decisions = 0.0, 0
    for i in range(0, n, batch):
        now += 0.001
        for w in wids[i:i + batch]:
            reg.rendezvous(w, now)
            reg.heartbeat(w, now)
        t = time.perf_counter()
        reg.decide(now)
        reg.next_deadline()
        spent += time.perf_counter() - t
        decisions += 1
    if reg.round != 0:
        raise SystemExit(f"round 0 did not form with {n} workers (round {reg.round})")
    return {"first_ms": first * 1e3, "mean_ms": spent / decisions * 1e3, "decisions": decisions}


def age(cycles: int) -> dict:
    """One job flapping ``cycles`` times: its decisions' time per cycle, early and late."""
    from elasticrun.discovery.host_manager import HostManager
    from elasticrun.driver.registry import AbortRound, Dismiss, Kill, Launch, Notify, Registry, RegistryConfig, \
        WorkerState

    ids = itertools.count()
    config = RegistryConfig(np=2, min_np=1, max_np=None, reset_limit=None, elastic_timeout=600.0,
                            start_timeout=60.0, heartbeat_timeout=None)
    reg = Registry(config, HostManager(cooldown_range=None, rng=random.Random(0)), lambda: f"w{next(ids)}")
    spent = 0.0

    def decide(now: float) -> list:
        nonlocal spent
        t = time.perf_counter()
        acts = list(reg.decide(now))
        reg.next_deadline()
        spent += time.perf_counter() - t
        return acts

    now, per_cycle = 0.0, []
    queue: list = []
    for cycle in range(cycles + 1):
        before = spent
        for hosts in ({"a": 1, "b": 1}, {"a": 1}) if cycle else ({"a": 1, "b": 1},):
            reg.discovered(hosts, now)
            queue += decide(now)
            while queue:  # the workers do at once what the driver asks
                act = queue.pop(0)
                if isinstance(act, Launch):
                    reg.rendezvous(act.worker_id, now)
                elif isinstance(act, (Kill, Dismiss)) and not reg.workers[act.worker_id].exited:
                    reg.exited(act.worker_id, 0 if isinstance(act, Dismiss) else -15, now, "")
                elif isinstance(act, (Notify, AbortRound)):
                    for w in list(reg.workers.values()):
                        if w.state is WorkerState.RUNNING:
                            reg.rendezvous(w.id, now, has_state=True)
                else:
                    continue
                queue += decide(now)
            now += 0.5
        if cycle:
            per_cycle.append(spent - before)
    if reg.round < 2 * cycles - 1:
        raise SystemExit(f"the job did not reset at every flap (round {reg.round} after {cycles} cycles)")
    window = min(200, cycles)
    return {"early_ms": statistics.mean(per_cycle[:window]) * 1e3,
            "late_ms": statistics.mean(per_cycle[-window:]) * 1e3,
            "records": len(reg.workers), "resets": reg.reset_count}


def run_all(workers: list[int], batch: int, repeats: int) -> dict[int, dict]:
    out = {}
    for n in workers:
        runs = [measure(n, batch) for _ in range(repeats)]
        out[n] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[1024, 4096])
    p.add_argument("--batch", type=int, default=16, help="workers asking for a place between two decisions")
    p.add_argument("--repeats", type=int, default=3, help="trickles per size (medians shown)")
    p.add_argument("--age", type=int, metavar="CYCLES", help="instead: a job whose second host flaps CYCLES times")
    _trees.add_arguments(p, "the registry")
    a = p.parse_args()
    _trees.setup(p, a, os.path.join("elasticrun", "driver", "registry.py"))
    if a.age:
        return main_age(a)
    if a.json:
        print(json.dumps(run_all(a.workers, a.batch, a.repeats)))
        return 0
    base = None
    if a.baseline_tree:  # a process of its own, importing that tree's elasticrun
        got = _trees.measure_in(__file__, a.baseline_tree, ["--batch", str(a.batch), "--repeats", str(a.repeats),
                                                            "--workers", *map(str, a.workers)])
        base = {int(k): v for k, v in got.items()}
    mine = run_all(a.workers, a.batch, a.repeats)
    print(f"Registry decisions while N workers ask for round 0, {a.batch} between two decisions "
          f"(medians of {a.repeats})\n")
    print("| workers | decisions | first decision (launch all) | each decision after | baseline: each | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, r in mine.items():
        b = base.get(n) if base else None
        print(f"| {n:,} | {r['decisions']:.0f} | {r['first_ms']:.1f} ms | {r['mean_ms']:.2f} ms | "
              + (f"{b['mean_ms']:.2f} ms | {r['mean_ms'] / b['mean_ms']:.2f}x |" if b else "- | - |"))
    return 0


def main_age(a: argparse.Namespace) -> int:
    if a.age < 1:
        raise SystemExit("--age: at least 1 cycle")
    if a.json:
        print(json.dumps(age(a.age)))
        return 0
    base = _trees.measure_in(__file__, a.baseline_tree, ["--age", str(a.age)]) if a.baseline_tree else None
    mine = age(a.age)
    window = min(200, a.age)
    print(f"A job whose second host flaps {a.age:,} times (a leave and a join a cycle, 0.5 s apart): "
          f"the registry's decisions per cycle, mean of the first and the last {window} cycles\n")
    print("| tree | first cycles | last cycles | last / first | records at the end | resets |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, r in (("this", mine), ("baseline", base)):
        if r is not None:
            print(f"| {name} | {r['early_ms']:.2f} ms | {r['late_ms']:.2f} ms | {r['late_ms'] / r['early_ms']:.1f}x | "
                  f"{r['records']:,} | {r['resets']:,} |")
    if base is not None:
        print(f"\nlast cycles, this / baseline: {mine['late_ms'] / base['late_ms']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
