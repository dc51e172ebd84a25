"""Shards of a commit from real senders (CURVE, HMAC) to the driver's durable-copy service and
onto disk, then fetched back for a restore; and the byte layout they share."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import zmq
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.common.auth import JobKeys, ZapAuthenticator
from elasticrun.driver import checkpoints as ck
from elasticrun.driver.durable import DurableService
from elasticrun.worker import durable

pytestmark = pytest.mark.timeout(120)


@given(st.lists(st.integers(0, 40), max_size=6), st.integers(1, 5), st.data())
def test_shards_cover_the_bytes_once_and_copy_back_exactly(sizes, world, data):
    tensors = [torch.arange(n, dtype=torch.int16) * (i + 1) for i, n in enumerate(sizes)]
    entries = durable.layout([(f"t{i}", t) for i, t in enumerate(tensors)])
    total = sum(e.nbytes for e in entries)
    pieces = []
    for r in range(world):
        off, size = durable.shard_range(total, r, world)
        buf = bytearray(size)
        durable.copy_range(tensors, entries, off, memoryview(buf))
        pieces.append((off, bytes(buf)))
    assert sum(len(b) for _, b in pieces) == total and [o for o, _ in pieces] == sorted(o for o, _ in pieces)
    whole = b"".join(b for _, b in pieces)
    assert whole == b"".join(bytes(t.untyped_storage()) for t in tensors)
    back = [torch.empty_like(t) for t in tensors]
    cut = data.draw(st.integers(0, total), label="cut")
    durable.fill_range(back, entries, 0, whole[:cut])
    durable.fill_range(back, entries, cut, whole[cut:])
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


@pytest.fixture
def service(tmp_path):
    ctx = zmq.Context()
    keys = JobKeys.generate()
    zap = ZapAuthenticator(ctx, [keys.worker.client_public]).start()
    written, warned = [], []
    done = threading.Event()

    def on_written(d, seconds):
        written.append(d)
        done.set()

    svc = DurableService(ctx, keys, "job", str(tmp_path), on_written=on_written, warn=warned.append)
    endpoint = svc.bind("tcp://127.0.0.1")
    svc.start()
    yield ctx, keys, endpoint, svc, written, warned, done
    svc.stop()
    zap.stop()
    ctx.term()


def test_two_ranks_send_their_shards_and_a_restore_reads_the_copy_back(service, tmp_path):
    ctx, keys, endpoint, svc, written, warned, done = service
    tensors = [torch.randn(300_000), torch.arange(1000, dtype=torch.int64)]  # ~1.2 MB: several chunks each
    entries = durable.layout([("w", tensors[0]), ("i", tensors[1])])
    senders = [durable.DurableSender(ctx, endpoint, keys.worker, "job") for _ in range(2)]
    try:
        for rank, s in enumerate(senders):
            assert s.hand_off(7, rank, 2, commit=42, steps=420, tensors=tensors, entries=entries,
                              meta=lambda: b"pickled rest")
        assert done.wait(60), warned
    finally:
        for s in senders:
            s.close()
    [d] = written
    assert (d.manifest.commit, d.manifest.steps, d.manifest.world) == (42, 420, 2) and not warned
    assert ck.newest(str(tmp_path)).manifest == d.manifest  # verified from disk
    info, meta, data = durable.fetch(ctx, endpoint, keys.worker, "job")
    assert (info["commit"], meta) == (42, b"pickled rest")
    back = [torch.empty_like(t) for t in tensors]
    durable.fill_range(back, entries, 0, data)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


def test_a_copy_whose_rank_never_finishes_is_dropped_and_the_old_one_stays(service, tmp_path):
    ctx, keys, endpoint, svc, written, warned, done = service
    svc._stale_after = 0.5
    t = [torch.ones(10)]
    entries = durable.layout([("x", t[0])])
    s = durable.DurableSender(ctx, endpoint, keys.worker, "job")
    try:
        assert s.hand_off(1, 0, 2, commit=1, steps=1, tensors=t, entries=entries, meta=lambda: b"m")  # rank 1 never sends
        deadline = time.monotonic() + 10
        while not warned and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        s.close()
    assert warned and "not all ranks sent their shards" in warned[0] and not written
    assert ck.newest(str(tmp_path)) is None and not [p for p in tmp_path.iterdir()]
