"""Issue 12: what a peer without the job's keys can make the driver allocate.

    python benchmarks/hostile_peer.py [--attack subscriptions frames] [--settle 1.5]

Runs a real job (the ``elasticrun`` command, two local workers that join and then wait) and,
while it runs, a peer with no keys at all that speaks ZMTP by hand (``tests/integration/
hostile.py``), as anyone who can reach the driver's ports can:

  subscriptions  on the PUB port of trees that had one (today's driver has one port, which
                 gets them): 20 distinct subscriptions just under 1 MiB, then one of
                 20 MiB (a PUB socket stores subscriptions in a trie, ~48 bytes per byte);
  frames         on the ROUTER port: 20 frames just under 1 MiB, then one of 20 MiB.

A PUB socket takes in its subscriptions when it next publishes, so the discovery script then
drops one host, which makes the driver notify every worker of ``hosts_updated``. Reported: the driver's RSS
before the attack, after the publish, its peak over --settle seconds, what the driver logged
about the peer, and how long the driver took to exit on SIGTERM afterwards. The workers find
the driver through the addresses in their environment, as the attacker does here (they are
not secret), so the script runs unchanged against older trees (PYTHONPATH=OLD_TREE).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

import hostile  # noqa: E402

WORKER = """
import os, sys, time
import elasticrun.torch as hvd
hvd.init()
stop = os.path.join(sys.argv[1], "stop")
deadline = time.monotonic() + 300
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.05)
"""


def _worker_env(pid: int) -> dict[str, str]:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            items = [i.split(b"=", 1) for i in f.read().split(b"\0") if b"=" in i]
    except OSError:  # a child that has ended meanwhile (a discovery run)
        return {}
    return {k.decode(): v.decode(errors="replace") for k, v in items}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``: workers forked from a warm-start template are its grandchildren."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    parent[int(entry)] = int(f.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, frontier = [], {pid}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier}
        out.extend(frontier)
    return out


def run(attack: str, settle: float, tmp: str) -> dict:
    hosts = os.path.join(tmp, "hosts")
    with open(hosts, "w") as f:
        f.write("localhost:1\n127.0.0.1:1\n")
    discover = os.path.join(tmp, "discover.sh")
    with open(discover, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts}\n")
    os.chmod(discover, 0o755)
    events = os.path.join(tmp, "events.jsonl")
    worker = os.path.join(tmp, "worker.py")
    with open(worker, "w") as f:
        f.write(WORKER)
    log = open(os.path.join(tmp, "driver.log"), "w+")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    driver = subprocess.Popen([sys.executable, "-m", "elasticrun", "-np", "2", "--min-np", "1",
                               "--host-discovery-script", discover, "--discovery-interval", "0.2",
                               "--events", events, sys.executable, worker, tmp],
                              stdout=log, stderr=log, env=env, cwd=tmp, start_new_session=True)
    res: dict = {"attack": attack}
    try:
        def workers_up():
            kids = _descendants(driver.pid)
            envs = [_worker_env(p) for p in kids]
            ready = [e for e in envs if "ELASTICRUN_CONTROL_ADDR" in e]
            started = os.path.exists(events) and '"round_formed"' in open(events).read()
            return ready if len(ready) == 2 and started else None

        envs = hostile.wait_for(workers_up, 90, "two workers in round 0")
        time.sleep(1.0)
        res["rss_before"] = hostile.rss_mib(driver.pid)
        port = "ELASTICRUN_NOTIFY_ADDR" if attack == "subscriptions" and "ELASTICRUN_NOTIFY_ADDR" in envs[0] else \
            "ELASTICRUN_CONTROL_ADDR"
        addr = envs[0][port]
        started = time.monotonic()
        peer = (hostile.subscription_flood if attack == "subscriptions" else hostile.frame_flood)(addr)
        res["sent_mib"] = peer.sent / hostile.MIB
        res["refused"] = peer.refused
        res["attack_s"] = time.monotonic() - started
        time.sleep(0.5)
        with open(hosts, "w") as f:  # the driver notifies hosts_updated (a PUB took in what it was sent)
            f.write("localhost:1\n")
        hostile.wait_for(lambda: '"notification_sent"' in open(events).read(), 30, "the driver's publish")
        peak = hostile.rss_mib(driver.pid)
        end = time.monotonic() + settle
        while time.monotonic() < end:
            peak = max(peak, hostile.rss_mib(driver.pid))
            time.sleep(0.05)
        res["rss_after"] = hostile.rss_mib(driver.pid)
        res["rss_peak"] = peak
        peer.close()
        started = time.monotonic()
        driver.send_signal(signal.SIGTERM)
        try:
            driver.wait(120)
            res["sigterm_exit_s"] = time.monotonic() - started
        except subprocess.TimeoutExpired:
            res["sigterm_exit_s"] = None
        log.seek(0)
        text = log.read()
        res["dropped_frames_logged"] = text.count("dropped a control frame")
        res["refusals_logged"] = text.count("refused a connection")
        return res
    finally:
        open(os.path.join(tmp, "stop"), "w").close()
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait()
        log.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--attack", nargs="+", default=["subscriptions", "frames"], choices=["subscriptions", "frames"])
    p.add_argument("--settle", type=float, default=1.5, help="seconds to watch the RSS after the publish")
    args = p.parse_args()
    print("| attack (no keys) | sent | peer cut off | driver RSS before | after publish | peak | "
          "frames logged as dropped | refusals logged | SIGTERM -> exit |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for attack in args.attack:
        with tempfile.TemporaryDirectory(prefix="hostile-") as tmp:
            r = run(attack, args.settle, tmp)
        exit_s = f"{r['sigterm_exit_s']:.1f} s" if r.get("sigterm_exit_s") is not None else "> 120 s"
        print(f"| {attack} | {r['sent_mib']:.1f} MiB | {'yes' if r['refused'] else 'no'} | "
              f"{r['rss_before']:.0f} MiB | {r['rss_after']:.0f} MiB | {r['rss_peak']:.0f} MiB | "
              f"{r['dropped_frames_logged']} | {r['refusals_logged']} | {exit_s} |", flush=True)
        print(json.dumps(r), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
