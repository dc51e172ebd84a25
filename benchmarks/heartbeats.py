"""What one heartbeat costs the driver's loop in Python: the frame's MAC check and parse, the
registry's note, the reply's encoding and MAC (no sockets: ZeroMQ's own cost is in
``driver_scale.py``).

    python benchmarks/heartbeats.py [--workers 4096] [--beats 30000] [--repeats 5] [--rounds 3]
                                    [--baseline-tree DIR]

At 4,096 workers the driver answers about 2,000 heartbeats a second (``--heartbeat-timeout``
can ask for more), on the one thread that also decides, so this is a floor on its load. The
heartbeats come from ``--workers`` workers the registry knows (launched, not yet in a round),
each with its steps, commit and pace, as a training worker's. Printed beside it, from the same
run: the bare floor of any authenticated message, a JSON heartbeat MAC-checked and parsed and
a JSON reply encoded and MACed, with nothing else. ``--baseline-tree DIR``: the same handler
of another checkout (e.g. ``git worktree add /tmp/before <commit>``). Each measurement runs in
a process of its own, this tree's and the baseline's alternating ``--rounds`` times: medians.
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import statistics
import sys
import time

import _trees


def _best(fn, repeats: int, n: int) -> float:
    """The fastest of ``repeats`` runs of ``fn`` (CPU time of this process), per item, in us."""
    best = float("inf")
    for _ in range(repeats):
        t = time.process_time()
        fn()
        best = min(best, time.process_time() - t)
    return best / n * 1e6


def measure_driver(workers: int, beats: int, repeats: int) -> float:
    """The driver's handler: ``ElasticDriver.handle_frame`` for ``beats`` heartbeats."""
    from elasticrun.common.protocol import Codec
    from elasticrun.common.settings import JobSettings
    from elasticrun.discovery.sources import FixedHosts
    from elasticrun.driver.driver import ElasticDriver
    from elasticrun.driver.launch.launchers import Launchers
    from elasticrun.driver.registry import Launch

    hosts = {f"h{i}": 4 for i in range(workers // 4)}
    s = JobSettings(command=["true"], np=workers, min_np=workers, max_np=workers, hosts=hosts)
    d = ElasticDriver(s, FixedHosts(hosts), Launchers(s))
    sent: list = []
    d.reply_to = sent.append  # the replies are encoded and kept, not sent: no sockets
    try:
        d.registry.discovered(hosts, time.monotonic())
        ids = [a.worker_id for a in d.registry.decide(time.monotonic()) if isinstance(a, Launch)]
        if len(ids) != workers:
            raise SystemExit(f"the registry launched {len(ids)} workers, not {workers}")
        codecs = [Codec(d.keys.secret, d.job_id, w) for w in ids]
        frames = [codecs[i % workers].encode("heartbeat", {
            "worker": ids[i % workers], "steps": 1000 + i, "commit": 100 + i // workers, "req": i,
            "pace": {"n": 8, "compute": 0.0123, "wait": 0.0021}}) for i in range(beats)]

        def run() -> None:
            sent.clear()
            for c in codecs:  # the same frames again: not replays to the driver
                d._rx.forget(c.sender)
            for i, f in enumerate(frames):
                d.handle_frame(b"identity-%d" % (i % workers), f)
            if len(sent) != beats:
                raise SystemExit(f"{len(sent)} replies to {beats} heartbeats")
        return _best(run, repeats, beats)
    finally:
        d.close()


def measure_bare(beats: int, repeats: int) -> float:
    """The floor: HMAC-SHA256 and JSON both ways on frames of the same size, nothing else."""
    key = os.urandom(32)
    payload = json.dumps({"v": 1, "t": "heartbeat", "job": "0123456789ab", "from": "w-0123456789", "seq": 1,
                          "to": None, "body": {"worker": "w-0123456789", "steps": 1000, "commit": 100, "req": 1,
                                               "pace": {"n": 8, "compute": 0.0123, "wait": 0.0021}}}).encode()
    frames = [hmac.digest(key, payload, "sha256") + payload] * beats
    reply = {"v": 1, "t": "heartbeat_ack", "job": "0123456789ab", "from": "driver", "seq": 1, "to": "w-0123456789",
             "body": {"round": 0, "aborted": False, "reason": "", "updates": [], "durable": 0, "re": 1}}

    def run() -> None:
        for f in frames:
            if not hmac.compare_digest(f[:32], hmac.digest(key, f[32:], "sha256")):
                raise SystemExit("bad MAC")
            json.loads(f[32:])
            out = json.dumps(reply, separators=(",", ":")).encode()
            hmac.digest(key, out, "sha256")
    return _best(run, repeats, beats)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4096, help="workers the registry knows (a multiple of 4)")
    p.add_argument("--beats", type=int, default=30000, help="heartbeats per run")
    p.add_argument("--repeats", type=int, default=5, help="runs (the fastest is shown)")
    p.add_argument("--rounds", type=int, default=3, help="measurements of each tree, alternating (medians)")
    _trees.add_arguments(p, "the driver's handler")
    a = p.parse_args()
    if a.workers < 4 or a.workers % 4 or a.beats < 1 or a.repeats < 1 or a.rounds < 1:
        p.error("--workers must be a positive multiple of 4; --beats, --repeats and --rounds at least 1")
    _trees.setup(p, a, os.path.join("elasticrun", "driver", "driver.py"))
    if a.json:
        print(json.dumps(measure_driver(a.workers, a.beats, a.repeats)))
        return 0
    def child(tree: str) -> float:  # one measurement, in a process importing ``tree``'s elasticrun
        return float(_trees.measure_in(__file__, tree, ["--workers", str(a.workers), "--beats", str(a.beats),
                                                         "--repeats", str(a.repeats)]))

    runs: dict[str, list[float]] = {"mine": [], "base": []}
    for _ in range(a.rounds):  # alternating, so that a slower minute of the machine hits both
        runs["mine"].append(child(a.tree))
        if a.baseline_tree:
            runs["base"].append(child(a.baseline_tree))
    mine = statistics.median(runs["mine"])
    base = statistics.median(runs["base"]) if runs["base"] else None
    bare = measure_bare(a.beats, a.repeats)
    print(f"One heartbeat in the driver's loop, {a.workers:,} workers known, {a.beats:,} heartbeats "
          f"(fastest of {a.repeats} runs, CPU time; median of {a.rounds} processes)\n")
    print("| measure | us per heartbeat | / bare |")
    print("| --- | ---: | ---: |")
    print(f"| bare: MAC + JSON, in and out | {bare:.1f} | 1.00 |")
    print(f"| the driver's handler | {mine:.1f} | {mine / bare:.2f} |")
    if base is not None:
        print(f"| the baseline tree's handler | {base:.1f} | {base / bare:.2f} |")
        print(f"\nthis tree / the baseline tree: {mine / base:.2f}x (this tree: "
              f"{', '.join(f'{x:.1f}' for x in runs['mine'])}; baseline: {', '.join(f'{x:.1f}' for x in runs['base'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
