"""What a rank's samplers recorded before it called ``hvd.join()``, for the others' commits.

A rank that runs out of data trains its last steps, then joins: those steps' gradients are in
every replica (the others averaged them), but the batches were recorded only in its own
``ElasticSampler``, and its next commit comes after ``join()``. The others commit meanwhile,
each merging what every rank recorded since the last commit (``SamplerStateHandler.merge``),
and a joined rank has no sampler there: it contributes nothing. So the commits made while it
sat in ``join()`` held its batches' gradients without its batches, and any reset that rolled
back to one of them (a host lost, the joined rank's host removed, a SIGTERM) handed those
batches out again: trained twice.

So a rank publishes, as it joins, what its running elastic state's samplers recorded since
its last commit: on the round's store (the driver's, authenticated; JSON, never a pickle),
compressed and in parts that fit a message. A commit on another rank merges it for each
rank that contributes nothing to the gather because it is in ``join()``.
"""

from __future__ import annotations

import json
import zlib
from typing import Any, Callable

from elasticrun.worker.exceptions import HorovodInternalError
from elasticrun.worker.rounds import Round
from elasticrun.worker.waiting import join_key

#: Bytes of one part on the store (base64 in a message under the 1 MiB frame limit).
PART = 256 * 1024

# sampler name -> (epoch, indices recorded since the last commit), of the state hvd.elastic.run runs
_pending: Callable[[], dict[str, tuple[int, list[int]]]] | None = None
# (round, join generation, rank) -> what that rank published
_read: dict[tuple[int, int, int], dict[str, tuple[int, list[int]]]] = {}


def pending_from(news: Callable[[], dict[str, tuple[int, list[int]]]] | None) -> None:
    """Have ``join()`` publish what ``news()`` returns (``hvd.elastic.run`` sets its state's)."""
    global _pending
    _pending = news


def publish(r: Round, gen: int) -> None:
    """In ``join()``, before this rank is counted as joined (so it is there by the time any
    other rank sees it contribute nothing)."""
    assert r.store is not None
    news = _pending() if _pending is not None else {}
    blob = zlib.compress(json.dumps({k: [int(e), [int(i) for i in v]] for k, (e, v) in news.items()}).encode())
    parts = [blob[i:i + PART] for i in range(0, len(blob), PART)]
    for n, part in enumerate(parts):
        r.store.set(join_key(f"{gen}/news/{r.rank}/{n}"), part)  # type: ignore[arg-type]  # stub: str; bytes work
    r.store.set(join_key(f"{gen}/news/{r.rank}"), str(len(parts)))


def published(r: Round, rank: int) -> dict[str, tuple[int, list[int]]]:
    """What ``rank``, now in ``join()`` in round ``r``, published as it joined."""
    key = (r.number, r.join_gen, rank)
    got = _read.get(key)
    if got is None:
        assert r.store is not None
        gen = r.join_gen
        try:
            count = int(r.store.get(join_key(f"{gen}/news/{rank}")))
            blob = b"".join(bytes(r.store.get(join_key(f"{gen}/news/{rank}/{n}"))) for n in range(count))
            data: Any = json.loads(zlib.decompress(blob)) if blob else {}
            got = {str(k): (int(v[0]), [int(i) for i in v[1]]) for k, v in data.items()}
        except Exception as exc:  # (an aborted round's store, the driver gone): this commit cannot complete
            raise HorovodInternalError(f"what rank {rank} recorded before it joined could not be read from the "
                                       f"round's store: {exc}") from exc
        for old in [k for k in _read if k[:2] != key[:2]]:  # (only the current join is read again)
            del _read[old]
        _read[key] = got
    return got
