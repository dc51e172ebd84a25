"""Shards of a commit from real senders (CURVE, HMAC) to the driver's durable-copy service and
onto disk, then fetched back for a restore; and the byte layout they share."""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
import zmq
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.common.auth import JobKeys, ZapAuthenticator
from elasticrun.common.protocol import copy_id, copy_name
from elasticrun.driver.durable import checkpoints as ck
from elasticrun.driver.durable.service import DurableService
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

    cdir = ck.CheckpointDir.open(str(tmp_path))
    svc = DurableService(ctx, keys, "job", cdir, on_written=on_written,
                         on_failed=lambda began, line: warned.append(line), lineage="L")
    endpoint = svc.bind("tcp://127.0.0.1")
    svc.start()
    yield ctx, keys, endpoint, svc, written, warned, done
    svc.stop()
    zap.stop()
    ctx.term()
    cdir.close()


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
    assert svc.directory.scan().newest.manifest == d.manifest  # verified from disk
    info, meta, data = durable.fetch(ctx, endpoint, keys.worker, "job")
    assert (info["commit"], meta) == (42, b"pickled rest")
    back = [torch.empty_like(t) for t in tensors]
    durable.fill_range(back, entries, 0, data)
    assert all(torch.equal(a, b) for a, b in zip(tensors, back))


def test_a_copy_of_a_commit_older_than_the_newest_copy_is_refused_and_the_newest_kept(service):
    """Commits only move forward in a job: a copy of an older one is a state that went back
    (a resume whose restore was lost). Written, the two-copy rotation would have replaced the
    copy the job resumed from with the script's initial state within two intervals."""
    ctx, keys, endpoint, svc, written, warned, done = service
    t = [torch.ones(10)]
    entries = durable.layout([("x", t[0])])
    s = durable.DurableSender(ctx, endpoint, keys.worker, "job")
    try:
        def hand_off(request: int, commit: int) -> None:
            deadline = time.monotonic() + 10
            while s.busy and time.monotonic() < deadline:  # (the last one's reply first)
                time.sleep(0.02)
            assert s.hand_off(request, 0, 1, commit=commit, steps=4, tensors=t, entries=entries, meta=lambda: b"m")

        hand_off(1, 2142)
        assert done.wait(30), warned
        for request in (2, 2, 3):  # each said once, however many ranks begin it
            hand_off(request, 1)
        hand_off(4, 2142)  # (the same commit again, as a stop's last copy may be: written)
        deadline = time.monotonic() + 10
        while len(written) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        s.close()
    assert [d.manifest.commit for d in written] == [2142, 2142], written
    assert svc.directory.scan().newest.manifest.commit == 2142
    assert len(warned) == 2 and all(w.startswith(
        "durable copy not written: it is of commit 1, older than the newest copy (ckpt-000001, commit 2142), which "
        "is kept") for w in warned), warned


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
    assert svc.directory.scan().newest is None and [p.name for p in tmp_path.iterdir()] == ["key"]


def test_a_later_rounds_copy_replaces_an_unfinished_one_and_the_warning_names_both(service):
    """All of round 0's workers died mid-copy; round 1 restored an older commit and sends its own
    copy. The unfinished one is dropped, in words a user reads (rounds and commits, not the
    ids on the wire), and the new one is written."""
    ctx, keys, endpoint, svc, written, warned, done = service
    t = [torch.ones(10)]
    entries = durable.layout([("x", t[0])])
    ch = durable._Channel(ctx, endpoint, keys.worker, "job")
    s = durable.DurableSender(ctx, endpoint, keys.worker, "job")
    try:  # round 0's rank 1 begins its shard (answered: the copy is being written), then dies
        ch.request("ckpt_begin", {"id": copy_id(0, 17), "rank": 1, "world": 2, "commit": 17, "steps": 34,
                                  "saved_at": 0.0, "data_bytes": 40, "meta_bytes": 0}, timeout=5)
        assert s.hand_off(copy_id(1, 14), 0, 1, commit=14, steps=28, tensors=t, entries=entries, meta=lambda: b"m")
        assert done.wait(30), warned
    finally:
        s.close()
        ch.close()
    assert warned == ["durable copy not written (round 0's copy of commit 17 was not whole when round 1's copy of "
                      "commit 14 began); training goes on from the in-memory commits"], warned
    assert [d.manifest.commit for d in written] == [14]


def test_every_request_is_answered_and_none_ends_the_service(service):
    """Malformed and hostile requests from an authenticated peer (offset -1, a missing copy, a
    wrong type, a file that is not there) each get an error, and the service still serves."""
    ctx, keys, endpoint, svc, written, warned, done = service
    ch = durable._Channel(ctx, endpoint, keys.worker, "job")
    try:
        for type_, body in [("ckpt_read", {"number": 1, "file": "meta", "offset": -1, "size": 10}),
                            ("ckpt_read", {"number": "x", "file": "meta", "offset": 0, "size": 10}),
                            ("ckpt_info", {}),
                            ("ckpt_begin", {"id": 1, "rank": 5, "world": 2, "commit": 1, "steps": 1, "saved_at": 0,
                                            "data_bytes": 10, "meta_bytes": 1}),
                            ("ckpt_begin", {"id": -3}),
                            ("ckpt_data", {"id": 9, "offset": 0}),
                            ("ckpt_end", {"id": 9}),
                            ("ckpt_nonsense", {"id": 1})]:
            with pytest.raises(RuntimeError):
                ch.request(type_, body, timeout=5)
        assert svc.is_alive()
    finally:
        ch.close()
    # Still serving: a whole copy goes through.
    t = [torch.arange(100, dtype=torch.float32)]
    entries = durable.layout([("x", t[0])])
    s = durable.DurableSender(ctx, endpoint, keys.worker, "job")
    try:
        assert s.hand_off(2, 0, 1, commit=3, steps=3, tensors=t, entries=entries, meta=lambda: b"m")
        assert done.wait(30), warned
    finally:
        s.close()
    info, meta, data = durable.fetch(ctx, endpoint, keys.worker, "job")
    assert info["commit"] == 3 and meta == b"m"


def test_refused_shards_are_said_once_then_counted(service, monkeypatch, caplog):
    """A full disk refuses every copy; with copies one after another (every holder leaving)
    each rank said two lines per attempt. Now the first refusal is said, the rest counted."""
    ctx, keys, endpoint, svc, written, warned, done = service
    t = [torch.ones(10)]
    entries = durable.layout([("x", t[0])])
    s = durable.DurableSender(ctx, endpoint, keys.worker, "job")

    def refused(c):
        raise ValueError(f"{copy_name(c.request)} is not being written")

    monkeypatch.setattr(s, "_send", refused)
    try:
        with caplog.at_level(logging.WARNING, logger="elasticrun"):
            for i in range(1, 21):
                deadline = time.monotonic() + 5
                while not s.hand_off(copy_id(0, i), 1, 2, commit=i, steps=i, tensors=t, entries=entries,
                                     meta=lambda: b""):
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            deadline = time.monotonic() + 5
            while s.busy and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        s.close()
    said = [m for m in caplog.messages if "could not send its shard" in m or "durable-copy shards not sent" in m]
    # The first in full; the other 19 counted: a summary at once, then one a minute (and at the close).
    assert len(said) <= 3 and "the driver's log says why" in said[0], said
    assert sum(int(m.split()[0]) for m in said[1:]) == 19, said


def test_an_optimizer_copy_fits_only_the_same_kind_of_optimizer() -> None:
    """Another optimizer's copy is refused (torch would merge its options in); options that
    only a newer torch adds (one side has them, the other lacks none of its own) are not."""
    import pytest
    import torch

    from elasticrun.worker import durable

    model = torch.nn.Linear(3, 2)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9).state_dict()
    adam = torch.optim.Adam(model.parameters(), lr=1e-3).state_dict()
    durable.check_optimizer_fits("optimizer", sgd, sgd)
    with pytest.raises(durable.DurableMismatch, match=r"optimizer.param_groups\[0\]: another optimizer's options"):
        durable.check_optimizer_fits("optimizer", adam, sgd)
    older = {**sgd, "param_groups": [{k: v for k, v in g.items() if k != "fused"} for g in sgd["param_groups"]]}
    durable.check_optimizer_fits("optimizer", sgd, older)  # a copy from a torch without "fused"
    two = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1).state_dict()
    with pytest.raises(durable.DurableMismatch, match="has 1 parameter group.s., the durable copy 2"):
        durable.check_optimizer_fits("optimizer", sgd, two)


@pytest.fixture
def small_disk(tmp_path):
    """A 2.6 MB tmpfs: room for two copies of 1 MB, not three."""
    import subprocess

    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2600k,mode=700", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    yield mnt
    assert subprocess.run(["umount", str(mnt)], capture_output=True).returncode == 0, "the test left the disk busy"


def _copies(mnt, lineage: str, commits: range) -> tuple[list, list[str]]:
    """Hand off a 1 MB copy of each commit to a service of ``lineage`` on ``mnt``, one at a
    time; (the copies written, the lines of those that failed)."""
    ctx = zmq.Context()
    keys = JobKeys.generate()
    zap = ZapAuthenticator(ctx, [keys.worker.client_public]).start()
    written, warned = [], []
    cdir = ck.CheckpointDir.open(str(mnt))
    svc = DurableService(ctx, keys, "job", cdir, on_written=lambda d, s: written.append(d),
                         on_failed=lambda began, line: warned.append(line), lineage=lineage)
    endpoint = svc.bind("tcp://127.0.0.1")
    svc.start()
    t = [torch.randn(250_000)]  # 1 MB
    entries = durable.layout([("x", t[0])])
    s = durable.DurableSender(ctx, endpoint, keys.worker, "job")
    try:
        for n in commits:
            before = len(written) + len(warned)
            assert s.hand_off(n, 0, 1, commit=n, steps=n, tensors=t, entries=entries, meta=lambda: b"m")
            deadline = time.monotonic() + 30
            while len(written) + len(warned) == before and time.monotonic() < deadline:
                time.sleep(0.02)
        assert svc.directory.scan().newest is not None
        return written, warned
    finally:
        s.close()
        svc.stop()
        zap.stop()
        ctx.term()
        cdir.close()


def test_a_disk_with_room_for_two_copies_still_gets_new_ones(small_disk):
    """Rotation removed old copies only after the new one was whole, so a directory needed
    room for keep + 1 copies: with room for two, every copy from the third on failed, and the
    copy on disk stayed at the second while training went on."""
    written, warned = _copies(small_disk, "L", range(1, 6))
    assert [d.manifest.commit for d in written] == [1, 2, 4, 5], warned
    assert len(warned) == 1 and "No space left on device" in warned[0] and "from now on" in warned[0], warned
    assert "earlier run" not in warned[0]
    cdir = ck.CheckpointDir.open(str(small_disk))
    try:
        assert cdir.scan().newest.manifest.commit == 5
    finally:
        cdir.close()  # (the disk is unmounted after the test)
    assert len([p for p in small_disk.iterdir() if p.name.startswith("ckpt-")]) == 2  # the newest two: 4 and 5


def test_a_full_disk_names_the_copies_of_an_earlier_run_it_never_removes(small_disk):
    """A copy kept from an earlier run (``--fresh`` keeps them) takes the room: the new job's
    copies fail, and the line said only that the disk was full, not what fills it."""
    _copies(small_disk, "EARLIER", range(1, 2))
    written, warned = _copies(small_disk, "L", range(1, 4))
    assert [d.manifest.commit for d in written] == [1], warned
    assert "No space left on device" in warned[0], warned
    assert "also holds 1 copy of an earlier run that this job never removes (ckpt-000001)" in warned[0], warned
    assert (small_disk / "ckpt-000001").is_dir()  # (not this job's to remove)
