"""What an ``ElasticSampler`` costs a commit, by how many indices the epoch has processed.

    python benchmarks/sampler_commit.py [--sizes 1000000,10000000] [--new 1024] [--baseline-tree DIR]

For each dataset size D, the sampler records 90% of D, is committed once (its handler's
``news()`` then ``save()``, what ``state.commit()`` runs for it besides the merge's
allgather), then records ``--new`` indices and is committed again, 5 times: the median of those
is the cost of an ordinary commit deep into an epoch. ``restore`` is the handler's restore
after that (a failure's). The whole commit runs on the training thread with the GIL held: the
worker's heartbeat thread waits all that time (``--heartbeat-timeout``, 5 s by default).
``--baseline-tree DIR``: the same, in the same run, for the checkout in DIR (a worktree of an
older commit), and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import _trees


def measure(size: int, new: int) -> dict[str, float]:
    from elasticrun.worker.sampler import ElasticSampler
    from elasticrun.worker.state_handlers import SamplerStateHandler

    sampler = ElasticSampler(range(size), shuffle=False, world=lambda: (0, 1))
    handler = SamplerStateHandler(sampler)
    done = int(size * 0.9)
    sampler.record_indices(range(done))
    t = time.perf_counter()
    handler.news()
    handler.save()
    first = time.perf_counter() - t
    times = []
    for k in range(5):
        sampler.record_indices(range(done + k * new, done + (k + 1) * new))
        t = time.perf_counter()
        handler.news()
        handler.save()
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    handler.restore()
    return {"first": first, "commit": statistics.median(times), "restore": time.perf_counter() - t}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000000,10000000", help="dataset sizes, comma-separated")
    p.add_argument("--new", type=int, default=1024, help="indices recorded between two commits")
    _trees.add_arguments(p, "the sampler's commit")
    a = p.parse_args()
    _trees.setup(p, a, os.path.join("elasticrun", "worker", "sampler.py"))
    sizes = [int(s) for s in a.sizes.split(",")]
    got = {str(s): measure(s, a.new) for s in sizes}
    if a.json:
        print(json.dumps(got))
        return
    base = (_trees.measure_in(__file__, a.baseline_tree, ["--sizes", a.sizes, "--new", str(a.new)])
            if a.baseline_tree else None)
    print(f"{'indices':>10} {'processed':>10} | {'first commit':>12} {'commit':>10} {'restore':>8}"
          + (" | baseline: commit, ratio" if base else ""))
    for s in sizes:
        m = got[str(s)]
        line = (f"{s:>10} {int(s * 0.9):>10} | {m['first'] * 1000:>9.1f} ms {m['commit'] * 1000:>7.2f} ms "
                f"{m['restore']:>6.2f} s")
        if base:
            b = base[str(s)]
            line += f" | {b['commit'] * 1000:.2f} ms, {m['commit'] / b['commit']:.4f}x"
        print(line)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
