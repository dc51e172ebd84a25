"""Recovery on Ray nodes against the same job with the local launcher, same run.

    python benchmarks/ray_recovery.py [--trials 10] [--blocks 2]

Starts a local Ray cluster (``ray.cluster_utils.Cluster``: a head without CPUs and two nodes
of one CPU, dashboard off), then runs ``--blocks`` pairs of jobs, alternating: the job of
``recovery.py`` (2 workers, tiny model, commit every step) once with the local launcher on
two hosts (``localhost``, ``127.0.0.1`` from a discovery script) and once with
``--ray-address`` on the two Ray nodes. Each job does ``--trials`` kills: SIGKILL the worker of
the second host, measure kill -> the first completed step on the new (smaller) world from
the event log; the host comes back after a 1 s blacklist cooldown, and host back -> first
step including the new worker is measured too (on Ray that includes creating the worker's
actor). Ratios are Ray / local, medians over all trials. Goal: kill -> first step within 1.2x.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recovery import HERE as WORKER_SCRIPT  # noqa: E402
from recovery import Journal, _pid_of, pct  # noqa: E402


def run_job(source: list[str], victim_host: str, trials: int) -> dict[str, list[float]]:
    """One job of two workers, ``trials`` kills of the worker on ``victim_host``."""
    tmp = tempfile.mkdtemp(prefix="elasticrun-ray-recovery-")
    events, stop_file = os.path.join(tmp, "events.jsonl"), os.path.join(tmp, "stop")
    cmd = [sys.executable, "-m", "elasticrun", "-np", "2", "--min-np", "1", "--max-np", "2", *source,
           "--discovery-interval", "0.1", "--events", events, "--blacklist-cooldown-range", "1", "1",
           "--log-level", "WARNING", sys.executable, WORKER_SCRIPT, "--worker", stop_file]
    driver = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    journal = Journal(events)
    out: dict[str, list[float]] = {"kill": [], "detect": [], "decide": [], "formed": [], "add": []}

    def first_step_of(round_: int) -> dict:
        return journal.wait_for(lambda e: e["kind"] == "first_step" and e.get("round") == round_, 60,
                                f"the first step of round {round_}")

    try:
        rnd = journal.wait_for(lambda e: e["kind"] == "round_formed" and e.get("size") == 2, 120, "a round of 2")["round"]
        journal.wait_for(lambda e: e["kind"] == "first_step" or (e["kind"] == "rendezvous_complete"
                                                                 and e["round"] == rnd), 120, "training to start")
        for _ in range(trials):
            journal.poll()
            victims = [e for e in journal.events if e["kind"] == "worker_started" and e["host"] == victim_host]
            pid = _pid_of(victims[-1]["worker"])
            time.sleep(0.3)
            t_kill = time.time()
            os.kill(pid, signal.SIGKILL)
            formed = journal.wait_for(lambda e: e["kind"] == "round_formed" and e["t"] > t_kill, 60, "the next round")
            step = first_step_of(formed["round"])
            journal.poll()
            detect = [e for e in journal.events if e["t"] >= t_kill and e["kind"] == "failure_detected"]
            out["kill"].append(step["t"] - t_kill)
            out["decide"].append(formed["t"] - t_kill)
            out["formed"].append(step["t"] - formed["t"])
            if detect:
                out["detect"].append(min(e["t"] for e in detect) - t_kill)
            back = journal.wait_for(lambda e: e["kind"] == "host_whitelisted" and e["t"] > t_kill, 60,
                                    "the host's return")
            grown = journal.wait_for(lambda e: e["kind"] == "round_formed" and e["t"] > back["t"] and e.get("size") == 2,
                                     120, "the world to grow back")
            out["add"].append(first_step_of(grown["round"])["t"] - back["t"])
        open(stop_file, "w").close()
        driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGTERM)
            driver.wait(timeout=60)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=10, help="kills per job")
    p.add_argument("--blocks", type=int, default=2, help="pairs of jobs (local, Ray), alternating")
    args = p.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    store = 80 * 1024 ** 2
    cluster = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, include_dashboard=False,
                                                                object_store_memory=store))
    try:
        nodes = [cluster.add_node(num_cpus=1, object_store_memory=store) for _ in range(2)]
        cluster.wait_for_nodes()
        script = os.path.join(tempfile.mkdtemp(prefix="elasticrun-ray-recovery-"), "discover.sh")
        with open(script, "w") as f:
            f.write("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
        os.chmod(script, 0o755)
        runs = {"local": (["--host-discovery-script", script], "127.0.0.1"),
                "ray": (["--ray-address", cluster.address], nodes[1].node_id)}
        results: dict[str, dict[str, list[float]]] = {k: {} for k in runs}
        for block in range(args.blocks):
            for name, (source, victim) in runs.items():
                started = time.monotonic()
                got = run_job(source, victim, args.trials)
                for key, values in got.items():
                    results[name].setdefault(key, []).extend(values)
                print(f"block {block + 1}, {name}: kill -> first step p50 {statistics.median(got['kill']) * 1000:.1f} ms "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()

    print(f"\n2 workers (one per host / Ray node), tiny model, commit every step; {args.blocks} x {args.trials} kills "
          f"per launcher, alternating")
    labels = {"kill": "kill -> first step on the new world", "detect": "  kill -> a survivor's collective fails",
              "decide": "  kill -> driver forms the next round",
              "formed": "  round formed -> first step", "add": "host back -> first step including it"}
    print(f"{'measure':<40} {'launcher':<7} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'ray/local':>10}")
    for key, label in labels.items():
        base = statistics.median(results["local"][key]) if results["local"].get(key) else None
        for name in runs:
            values = results[name].get(key) or []
            if not values:
                continue
            p50 = statistics.median(values)
            ratio = f"{p50 / base:>10.2f}" if name == "ray" and base else ""
            print(f"{label if name == 'local' else '':<40} {name:<7} {p50 * 1000:>8.1f} {pct(values, 0.95) * 1000:>8.1f} "
                  f"{max(values) * 1000:>8.1f} {ratio}")


if __name__ == "__main__":
    main()
