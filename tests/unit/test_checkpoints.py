"""The durable copies on the driver's disk: atomic, checksummed, the newest two kept, and a
broken copy never taken for a whole one (elasticrun/driver/checkpoints.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from elasticrun.driver import checkpoints as ck

pytestmark = pytest.mark.timeout(60)


def write(directory, number=None, commit=5, data=b"0123456789" * 100, world=2, meta=b"meta"):
    number = number or ck.next_number(str(directory))
    w = ck.Writer(str(directory), number, commit=commit, steps=commit * 10, saved_at=1000.0 + number, job="j",
                  world=world, data_bytes=len(data), meta=meta)
    size = -(-len(data) // world)
    for r in range(world):
        part = data[r * size:(r + 1) * size]
        for i in range(0, len(part), 64):  # in pieces, out of order is fine
            w.write(r * size + i, part[i:i + 64])
        w.shard_done(r * size, len(part), hashlib.sha256(part).hexdigest())
    assert w.complete
    return w.commit(keep=2)


def test_a_copy_is_written_whole_and_read_back(tmp_path):
    d = write(tmp_path)
    assert os.path.basename(d.path) == "ckpt-000001" and d.manifest.commit == 5
    assert ck.newest(str(tmp_path)).manifest == d.manifest
    assert ck.read_range(d.path, "data.bin", 10, 5) == b"01234"
    assert ck.read_range(d.path, "meta.bin", 0, 100) == b"meta"
    assert oct(os.stat(os.path.join(d.path, "data.bin")).st_mode & 0o777) == "0o600"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_only_the_newest_two_are_kept(tmp_path):
    for commit in (1, 2, 3, 4):
        write(tmp_path, commit=commit)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000003", "ckpt-000004"]
    assert ck.newest(str(tmp_path)).manifest.commit == 4


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "no manifest", "bad manifest", "bad meta"])
def test_a_broken_newest_copy_falls_back_to_the_older_one_with_one_line(tmp_path, damage):
    write(tmp_path, commit=1)
    newest = write(tmp_path, commit=2)
    data = os.path.join(newest.path, "data.bin")
    if damage == "flip a byte":
        with open(data, "r+b") as f:
            f.seek(700)
            b = f.read(1)
            f.seek(700)
            f.write(bytes([b[0] ^ 1]))
    elif damage == "truncate":
        os.truncate(data, 300)
    elif damage == "no manifest":
        os.remove(os.path.join(newest.path, "manifest.json"))
    elif damage == "bad manifest":
        with open(os.path.join(newest.path, "manifest.json"), "w") as f:
            json.dump({"format": 1, "number": "x"}, f)
    else:
        with open(os.path.join(newest.path, "meta.bin"), "wb") as f:
            f.write(b"METR")
    said: list[str] = []
    found = ck.newest(str(tmp_path), said.append)
    assert found is not None and found.manifest.commit == 1
    assert len(said) == 1 and "ckpt-000002 is unusable" in said[0] and "\n" not in said[0], said


def test_a_write_that_fails_leaves_the_durable_copies_alone(tmp_path):
    good = write(tmp_path, commit=1)
    w = ck.Writer(str(tmp_path), 2, commit=2, steps=0, saved_at=0, job="j", world=1, data_bytes=10, meta=b"m")
    w.write(0, b"01234")
    assert not w.complete
    w.abort()  # a rank died mid-transfer, or the disk filled up
    assert ck.newest(str(tmp_path)).path == good.path
    assert os.listdir(tmp_path) == ["ckpt-000001"]


def test_bytes_outside_the_copy_and_damaged_shards_are_refused(tmp_path):
    w = ck.Writer(str(tmp_path), 1, commit=1, steps=0, saved_at=0, job="j", world=1, data_bytes=10, meta=b"m")
    with pytest.raises(ck.CheckpointError, match="outside"):
        w.write(8, b"xyz")
    w.write(0, b"0123456789")
    with pytest.raises(ck.CheckpointError, match="damaged"):
        w.shard_done(0, 10, hashlib.sha256(b"something else").hexdigest())
    w.abort()


def test_an_unwritable_directory_is_one_line(tmp_path):
    target = tmp_path / "file"
    target.write_text("not a directory")
    with pytest.raises(ck.CheckpointError, match="cannot write in") as info:
        ck.Writer(str(target), 1, commit=1, steps=0, saved_at=0, job="j", world=1, data_bytes=1, meta=b"")
    assert "\n" not in str(info.value)


def test_a_full_disk_is_one_line_and_loses_nothing(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        good = write(mnt, commit=1, data=b"x" * 1000)
        w = ck.Writer(str(mnt), 2, commit=2, steps=0, saved_at=0, job="j", world=1, data_bytes=1 << 20, meta=b"m")
        with pytest.raises(ck.CheckpointError, match="No space left") as info:
            w.write(0, b"y" * (1 << 20))
        assert "\n" not in str(info.value)
        w.abort()
        assert ck.newest(str(mnt)).path == good.path
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_numbers_continue_after_copies_of_earlier_jobs(tmp_path):
    write(tmp_path, commit=1)
    write(tmp_path, commit=2)
    (tmp_path / ".tmp-ckpt-000009-123").mkdir()  # a driver died while writing
    ck.clean_stale(str(tmp_path))
    assert ck.next_number(str(tmp_path)) == 3
    assert sorted(os.listdir(tmp_path)) == ["ckpt-000001", "ckpt-000002"]


def test_copies_are_asked_for_at_once_then_every_interval():
    from elasticrun.driver.durable import CopySchedule

    s = CopySchedule(60.0)
    assert s.due(0.0) and s.next_deadline() is None
    assert s.request(5.0) == 1
    assert not s.due(64.9) and s.next_deadline() == 65.0
    assert s.due(65.0) and s.request(65.0) == 2
