"""An ``ElasticSampler`` over tens of millions of samples: what each whole-set step costs in
time, in the longest hold of the GIL, and in memory.

    python benchmarks/sampler_scale.py [--sizes 1000000,20000000] [--baseline-tree DIR]

For each dataset size D (shuffled, rank 0 of 4), the sampler records 90% of D in batches of
65,536, each followed by a commit (its handler's ``news()`` and ``save()``, what
``state.commit()`` runs for it besides the merge's allgather), then: ``commit`` (1,024 new
indices, median of 5), ``restore`` (a failure's), ``sync`` (a reset's: the root's set broadcast
and every rank's news gathered, here through a pickle round trip in a world of one, which is
what gloo's object collectives do around the wire), ``after sync`` (the next commit, which
compares the whole set), ``durable copy`` (the sampler's part of a durable copy as rank 0 makes
it on the training thread: its state split from its tensors, which are written raw, and the rest
pickled; an older tree's is its ``state_dict()``), ``set_epoch``,
``join news`` (90% of the next epoch recorded with no commit, then ``hvd.join()``'s publishing
of those indices on the round's store, here a dict, and another rank's reading of them), ``join
merge`` (that rank's merge of them into its own sampler, which each of its commits does while
the other sits in ``join()``), and ``epoch commit``: the commit after them (a script that commits
once an epoch).

``GIL`` is the longest a thread that wakes every millisecond waited to run during the step: a
worker's heartbeat thread waits as long, and a worker silent for ``--heartbeat-timeout`` (5 s
by default) is taken for hung and killed. ``MB`` is the process's resident memory that the
sampler and its handler's committed copy take at 90% processed.
``--baseline-tree DIR``: the same, in the same run, for the checkout in DIR (a worktree of an
older commit).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import threading
import time
from types import SimpleNamespace
from typing import Any, Callable

import _trees
import torch

STEPS = ("commit", "restore", "sync", "after sync", "durable copy", "set_epoch", "join news", "join merge",
         "epoch commit")


class Ticker:
    """A thread that wakes every millisecond and keeps the longest wait between two wakes."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def timed(self, fn: Callable[[], Any]) -> tuple[float, float]:
        """(seconds ``fn`` took, the longest wait of the ticker meanwhile)."""
        time.sleep(0.005)
        self.longest = 0.0
        t = time.perf_counter()
        fn()
        took = time.perf_counter() - t
        time.sleep(0.003)  # (the ticker's wake after a hold that ended with fn)
        return took, self.longest

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def durable_part(sampler: Any) -> None:
    """What rank 0 does for the sampler's part of a durable copy (worker/durable.py's give)."""
    import cloudpickle

    from elasticrun.worker import durable

    state = getattr(sampler, "_durable_state_dict", sampler.state_dict)()
    tensors, structure = durable.split_tensors(state)
    cloudpickle.dumps(structure)


class DictStore:
    """The round's store, as a dict (what join() sets and gets, without the wire)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        return self.data[key]


def join_news_round_trip(handler: Any, got: dict[str, Any]) -> None:
    """A rank joins and publishes what it recorded since its last commit; another reads it."""
    from elasticrun.worker import join_news

    r = SimpleNamespace(store=DictStore(), rank=0, number=1, join_gen=1)
    join_news.pending_from(lambda: {"sampler": handler.news()})
    join_news.publish(r, 1)
    got.update(join_news.published(r, 0))


def measure(size: int) -> dict[str, Any]:
    from elasticrun.worker import collectives, rounds
    from elasticrun.worker.sampler import ElasticSampler
    from elasticrun.worker.state_handlers import SamplerStateHandler

    # A world of one for the sync: the object collectives' pickling, without the wire.
    rounds.current = lambda: SimpleNamespace(rank=0, size=1)  # type: ignore[assignment]
    collectives.broadcast_object = lambda obj, **_: pickle.loads(pickle.dumps(obj))  # type: ignore[assignment]
    collectives.allgather_object = lambda obj, *_: [pickle.loads(pickle.dumps(obj))]  # type: ignore[assignment]

    ticker = Ticker()
    order = torch.randperm(size).tolist()
    before = _rss_mb()
    sampler = ElasticSampler(range(size), shuffle=True, seed=1, world=lambda: (0, 4))
    handler = SamplerStateHandler(sampler)
    done = int(size * 0.9)
    got: dict[str, Any] = {}

    def commit() -> None:
        handler.news()
        handler.save()

    for a in range(0, done, 65536):
        sampler.record_indices(order[a:min(done, a + 65536)])
        commit()
    memory = _rss_mb() - before
    runs = []
    for k in range(5):
        sampler.record_indices(order[done + k * 1024:done + (k + 1) * 1024])
        runs.append(ticker.timed(commit))
    got["commit"] = (statistics.median(r[0] for r in runs), max(r[1] for r in runs))
    got["restore"] = ticker.timed(handler.restore)
    got["sync"] = ticker.timed(lambda: handler.sync(0))
    got["after sync"] = ticker.timed(commit)
    got["durable copy"] = ticker.timed(lambda: durable_part(sampler))
    got["set_epoch"] = ticker.timed(lambda: sampler.set_epoch(1))
    for a in range(0, done, 65536):
        sampler.record_indices(order[a:min(done, a + 65536)])
    read: dict[str, Any] = {}
    got["join news"] = ticker.timed(lambda: join_news_round_trip(handler, read))
    assert read["sampler"][1] == handler.news()[1], "the news read is not the news published"
    other = ElasticSampler(range(size), shuffle=True, seed=1, world=lambda: (1, 4))
    other.set_epoch(1)
    got["join merge"] = ticker.timed(lambda: other.merge_processed(read["sampler"][1]))
    assert len(other.processed_indices) == len(read["sampler"][1])
    del other
    got["epoch commit"] = ticker.timed(commit)
    ticker.stop()
    got["MB"] = memory
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1000000,20000000", help="dataset sizes, comma-separated")
    _trees.add_arguments(p, "the sampler")
    a = p.parse_args()
    _trees.setup(p, a, os.path.join("elasticrun", "worker", "sampler.py"))
    sizes = [int(s) for s in a.sizes.split(",")]
    if a.json:
        print(json.dumps({str(s): measure(s) for s in sizes}))
        return
    for s in sizes:
        trees = [("this", _trees.measure_in(__file__, a.tree, ["--sizes", str(s)])[str(s)])]
        if a.baseline_tree:
            trees.append(("baseline", _trees.measure_in(__file__, a.baseline_tree, ["--sizes", str(s)])[str(s)]))
        print(f"{s:,} samples, {int(s * 0.9):,} processed: seconds / longest GIL hold in seconds")
        print(f"  {'tree':<9}" + "".join(f"{k:>18}" for k in STEPS) + f"{'MB':>8}")
        for name, m in trees:
            print(f"  {name:<9}" + "".join(f"{m[k][0]:>8.3f} / {m[k][1]:>6.3f}" for k in STEPS)
                  + f"{m['MB']:>8.0f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
