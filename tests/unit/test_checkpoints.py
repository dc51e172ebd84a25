"""The durable copies on the driver's disk: atomic, checksummed, signed, the newest two of a
lineage kept, a broken copy never taken for a whole one, and a directory trusted only when it
is the user's alone (elasticrun/driver/durable/checkpoints.py)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess

import pytest

from elasticrun.driver.durable import checkpoints as ck

pytestmark = pytest.mark.timeout(60)

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (another user's files, a small tmpfs)")


@pytest.fixture
def cdir(tmp_path):
    d = ck.CheckpointDir.open(str(tmp_path / "ckpt"))
    yield d
    d.close()


def write(d: ck.CheckpointDir, number=None, commit=5, data=b"0123456789" * 100, world=2, meta=b"meta",
          lineage="L1", keep=2):
    number = number or d.next_number()
    w = ck.Writer(d, number, commit=commit, steps=commit * 10, saved_at=1000.0 + number, job="j",
                  lineage=lineage, world=world, data_bytes=len(data), meta=meta)
    size = -(-len(data) // world)
    for r in range(world):
        part = data[r * size:(r + 1) * size]
        for i in range(0, len(part), 64):  # in pieces, out of order is fine
            w.write(r * size + i, part[i:i + 64])
        w.shard_done(r * size, len(part), hashlib.sha256(part).hexdigest())
    assert w.complete
    return w.commit(keep=keep)


def copies(d: ck.CheckpointDir) -> list[str]:
    return sorted(n for n in os.listdir(d.path) if "ckpt-" in n)


def test_a_copy_is_written_whole_signed_and_read_back(cdir):
    d = write(cdir)
    assert d.name == "ckpt-000001" and d.manifest.commit == 5
    assert cdir.scan().newest.manifest == d.manifest
    assert cdir.read_range(d, "data.bin", 10, 5) == b"01234"
    assert cdir.read_range(d, "meta.bin", 0, 100) == b"meta"
    assert oct(os.stat(os.path.join(d.path, "data.bin")).st_mode & 0o777) == "0o600"
    assert oct(os.stat(cdir.path).st_mode & 0o777) == "0o700"
    assert oct(os.stat(os.path.join(cdir.path, "key")).st_mode & 0o777) == "0o600"
    assert "mac" in json.loads(open(os.path.join(d.path, "manifest.json")).read())
    assert not [n for n in os.listdir(cdir.path) if n.startswith(".tmp")]


def test_only_the_newest_two_of_the_lineage_are_kept(cdir):
    for commit in (1, 2, 3, 4):
        write(cdir, commit=commit)
    assert copies(cdir) == ["ckpt-000003", "ckpt-000004"]
    assert cdir.scan().newest.manifest.commit == 4


def test_rotation_never_deletes_another_jobs_copies(cdir):
    """A copy this job did not write (another lineage: another job, or a run before --fresh)
    stays, whatever rotation does to this job's own."""
    write(cdir, commit=1, lineage="theirs")
    write(cdir, commit=2, lineage="theirs")
    for commit in (3, 4, 5):
        write(cdir, commit=commit, lineage="mine")
    assert copies(cdir) == ["ckpt-000001", "ckpt-000002", "ckpt-000004", "ckpt-000005"]


@pytest.mark.parametrize("damage", ["flip a byte", "truncate", "no manifest", "bad manifest", "bad meta",
                                    "resigned by a stranger", "old format"])
def test_a_broken_newest_copy_is_named_and_the_older_one_found(cdir, damage):
    write(cdir, commit=1)
    newest = write(cdir, commit=2)
    data = os.path.join(newest.path, "data.bin")
    manifest = os.path.join(newest.path, "manifest.json")
    if damage == "flip a byte":
        with open(data, "r+b") as f:
            f.seek(700)
            b = f.read(1)
            f.seek(700)
            f.write(bytes([b[0] ^ 1]))
    elif damage == "truncate":
        os.truncate(data, 300)
    elif damage == "no manifest":
        os.remove(manifest)
    elif damage == "bad manifest":
        with open(manifest, "w") as f:
            json.dump({"format": 2, "number": "x"}, f)
    elif damage == "bad meta":
        with open(os.path.join(newest.path, "meta.bin"), "wb") as f:
            f.write(b"METR")
    elif damage == "resigned by a stranger":  # new meta, checksums updated, but no key to sign with
        obj = json.loads(open(manifest).read())
        with open(os.path.join(newest.path, "meta.bin"), "wb") as f:
            f.write(b"evil")
        obj["meta"] = {"bytes": 4, "sha256": hashlib.sha256(b"evil").hexdigest()}
        with open(manifest, "w") as f:
            json.dump(obj, f)
    else:
        obj = json.loads(open(manifest).read())
        obj["format"] = 1
        with open(manifest, "w") as f:
            json.dump(obj, f)
    scan = cdir.scan()
    assert scan.newest is not None and scan.newest.manifest.commit == 1
    [(name, why)] = scan.unusable
    assert name == "ckpt-000002" and why and "\n" not in why
    if damage in ("resigned by a stranger", "old format"):
        assert "not signed with this directory's key" in why
    assert os.path.exists(newest.path)  # a scan deletes nothing


@pytest.mark.parametrize("why", ["newer format", "I/O error"])
def test_a_copy_that_cannot_be_read_now_stops_the_scan_instead_of_an_older_copy(cdir, monkeypatch, why):
    """Not damage: a copy of a newer elasticrun, or a disk that fails a read (EIO, a stale NFS
    handle, permissions). Taking the older copy for it (and moving it aside) would redo work
    and hide the copy from the version or the disk that can read it."""
    import errno
    write(cdir, commit=1)
    newest = write(cdir, commit=2)
    if why == "newer format":
        manifest = os.path.join(newest.path, "manifest.json")
        obj = json.loads(open(manifest).read())
        obj.pop("mac")
        obj["format"] = ck.FORMAT + 1
        obj["mac"] = __import__("hmac").new(cdir.key(), ck.canonical(obj), hashlib.sha256).hexdigest()
        with open(manifest, "w") as f:
            json.dump(obj, f)
    else:
        real = os.pread

        def failing(fd, n, at):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(newest.path):
                raise OSError(errno.EIO, "Input/output error")
            return real(fd, n, at)
        monkeypatch.setattr(os, "pread", failing)
    scan = cdir.scan()
    assert scan.newest is None and scan.unusable == []
    name, said = scan.blocked
    assert name == "ckpt-000002"
    assert ("written by a newer elasticrun" in said) if why == "newer format" else ("input/output error" in said.lower())


def test_an_unusable_copy_is_moved_aside_and_its_number_never_reused(cdir):
    write(cdir, commit=1)
    bad = write(cdir, commit=2)
    os.remove(os.path.join(bad.path, "manifest.json"))
    assert cdir.move_aside("ckpt-000002") == "unusable-ckpt-000002"
    assert cdir.next_number() == 3
    assert sorted(os.listdir(os.path.join(cdir.path, "unusable-ckpt-000002"))) == ["data.bin", "meta.bin"]


def test_nothing_in_the_directory_is_reached_through_a_link(cdir, tmp_path):
    """A link planted at a copy's file, the progress file's temporary name or a copy itself is
    never followed: the file it points to is neither read nor written."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    d = write(cdir, commit=1)
    os.remove(os.path.join(d.path, "meta.bin"))
    os.symlink(victim, os.path.join(d.path, "meta.bin"))
    [(_, why)] = cdir.scan().unusable
    assert "symbolic link" in why
    os.symlink(victim, os.path.join(cdir.path, ".progress.json.tmp"))
    cdir.save_progress(7, 3)
    assert victim.read_text() == "precious" and cdir.load_progress()[:2] == (7, 3)
    cdir.save_progress(9, 4, at=1234.5)  # when the steps were heard of, not when the file was written
    assert cdir.load_progress() == (9, 4, 1234.5)
    os.symlink(tmp_path, os.path.join(cdir.path, "ckpt-000009"))
    assert "ckpt-000009" in dict(cdir.scan().unusable)
    os.symlink(victim, os.path.join(cdir.path, "progress.json.x"))
    os.replace(os.path.join(cdir.path, "progress.json.x"), os.path.join(cdir.path, "progress.json"))
    assert cdir.load_progress() == (0, 0, 0.0) and victim.read_text() == "precious"


def test_the_lock_admits_one_job_and_names_the_holder(tmp_path):
    path = str(tmp_path / "ckpt")
    first = ck.CheckpointDir.open(path)
    first.lock("job-one")
    second = ck.CheckpointDir.open(path)
    try:
        with pytest.raises(ck.DirectoryInUse, match=rf"in use by job job-one \(pid {os.getpid()} on host "):
            second.lock("job-two")
        first.close()  # the holder ends (a kill -9 releases the flock the same way)
        second.lock("job-two")
    finally:
        second.close()


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    path = str(tmp_path / "ckpt")
    code = ("import os, sys; from elasticrun.driver.durable import checkpoints as ck; "
            f"d = ck.CheckpointDir.open({path!r}); d.lock('gone'); os.kill(os.getpid(), 9)")
    assert subprocess.run([os.sys.executable, "-c", code]).returncode == -9
    d = ck.CheckpointDir.open(path)
    try:
        d.lock("next")
    finally:
        d.close()


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777, 0o722])
def test_a_directory_others_can_write_is_refused_in_one_line(tmp_path, mode):
    path = tmp_path / "shared"
    path.mkdir()
    os.chmod(path, mode)
    with pytest.raises(ValueError) as info:
        ck.check_directory(str(path))
    assert f"chmod 700 {path}" in str(info.value) and "writable to group or others" in str(info.value)
    assert "\n" not in str(info.value)


def test_a_missing_directory_is_created_private(tmp_path):
    ck.check_directory(str(tmp_path / "a" / "ckpt"))
    assert oct(os.stat(tmp_path / "a" / "ckpt").st_mode & 0o777) == "0o700"


def test_a_key_others_can_read_is_refused(cdir):
    cdir.key()
    os.chmod(os.path.join(cdir.path, "key"), 0o644)
    again = ck.CheckpointDir.open(cdir.path)
    try:
        with pytest.raises(ck.UntrustedDirectory, match="open to group or others"):
            again.key()
    finally:
        again.close()


@root_only
def test_a_directory_or_copy_of_another_user_is_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)
    with pytest.raises(ValueError, match="belongs to nobody, not to you"):
        ck.check_directory(str(theirs))
    d = ck.CheckpointDir.open(str(tmp_path / "ckpt"))
    try:
        good = write(d, commit=1)
        planted = write(d, commit=2)
        os.chown(os.path.join(planted.path, "meta.bin"), 65534, 65534)
        scan = d.scan()
        assert scan.newest.path == good.path and "belongs to nobody" in scan.unusable[0][1]
    finally:
        d.close()


NOBODY = 65534


def _shared(path):
    """A directory like /tmp: anyone may write it, the sticky bit set, root's."""
    path.mkdir()
    os.chmod(path, 0o1777)
    return path


@root_only
def test_a_link_someone_else_planted_is_not_followed_to_a_directory_of_yours(tmp_path):
    """mallory: ln -s /home/you/other /tmp/teamckpt. The link's target is yours (it would pass
    as yours): the job would lock, write and rotate copies there."""
    yours = tmp_path / "yours"
    yours.mkdir(mode=0o700)
    (yours / "lock").write_text("IMPORTANT")
    link = _shared(tmp_path / "tmp") / "teamckpt"
    link.symlink_to(yours)
    os.lchown(link, NOBODY, NOBODY)
    with pytest.raises(ValueError) as info:
        ck.check_directory(str(link))
    assert str(info.value) == (f"--checkpoint-dir {link}: {link} is a symbolic link that nobody made in "
                               f"{link.parent}, which anyone may write: they choose where the copies go; use a "
                               f"directory of your own (for example under your home)")
    assert (yours / "lock").read_text() == "IMPORTANT" and sorted(os.listdir(yours)) == ["lock"]
    elsewhere = tmp_path / "private"  # their link in a directory only they may write: the same
    elsewhere.mkdir()
    (elsewhere / "ckpt").symlink_to(yours)
    os.lchown(elsewhere / "ckpt", NOBODY, NOBODY)
    with pytest.raises(ck.UnsafePath, match="is a symbolic link that nobody made: they choose"):
        ck.CheckpointDir.open(str(elsewhere / "ckpt"))


def test_a_link_of_your_own_is_followed(tmp_path):
    real = tmp_path / "real"
    (real / "sub").mkdir(mode=0o700, parents=True)
    (tmp_path / "via").symlink_to(real)
    (tmp_path / "ckpt").symlink_to("via/sub")
    ck.check_directory(str(tmp_path / "ckpt"))
    d = ck.CheckpointDir.open(str(tmp_path / "ckpt"))
    try:
        d.key()
    finally:
        d.close()
    assert (real / "sub" / "key").exists()


@root_only
@pytest.mark.parametrize("parent,why", [
    (0o777, "belongs to nobody and anyone may write it: they could move the copies away"),
    (0o1777, "belongs to nobody and anyone may write it: they could move the copies away"),
])
def test_a_parent_directory_someone_else_controls_is_refused(tmp_path, parent, why):
    team = tmp_path / "team"  # mallory: mkdir -m777 /tmp/team; you: --checkpoint-dir /tmp/team/job
    team.mkdir()
    os.chmod(team, parent)
    os.chown(team, NOBODY, NOBODY)
    with pytest.raises(ValueError, match=why.replace("(", r"\(").replace(")", r"\)")):
        ck.check_directory(str(team / "job"))
    assert not (team / "job").exists()


@root_only
def test_a_directory_someone_else_made_in_a_shared_one_is_refused_on_the_way(tmp_path):
    theirs = _shared(tmp_path / "tmp") / "team"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, NOBODY, NOBODY)
    with pytest.raises(ck.UnsafePath, match=f"{theirs} is a directory that nobody made in"):
        ck.CheckpointDir.open(str(theirs / "job"))


@root_only
def test_a_team_directory_only_its_group_may_write_is_trusted_as_its_group(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    os.chmod(project, 0o2770)
    os.chown(project, NOBODY, NOBODY)
    ck.check_directory(str(project / "you" / "ckpt"))
    assert oct(os.stat(project / "you" / "ckpt").st_mode & 0o777) == "0o700"


def test_a_world_writable_scratch_volume_of_root_or_yours_is_a_parent_like_tmp(tmp_path):
    """A Kubernetes emptyDir is 0777 without the sticky bit; the pod is its only user."""
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    os.chmod(scratch, 0o777)
    ck.check_directory(str(scratch / "ckpt"))
    assert oct(os.stat(scratch / "ckpt").st_mode & 0o777) == "0o700"


def test_a_parent_that_is_a_file_is_named(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValueError, match=f"{tmp_path / 'afile'} is not a directory"):
        ck.check_directory(str(tmp_path / "afile" / "sub"))


def test_a_write_that_fails_leaves_the_durable_copies_alone(cdir):
    good = write(cdir, commit=1)
    w = ck.Writer(cdir, 2, commit=2, steps=0, saved_at=0, job="j", lineage="L1", world=1, data_bytes=10, meta=b"m")
    w.write(0, b"01234")
    assert not w.complete
    w.abort()  # a rank died mid-transfer, or the disk filled up
    assert cdir.scan().newest.path == good.path
    assert copies(cdir) == ["ckpt-000001"]


def test_bytes_outside_the_copy_and_damaged_shards_are_refused(cdir):
    w = ck.Writer(cdir, 1, commit=1, steps=0, saved_at=0, job="j", lineage="L1", world=1, data_bytes=10, meta=b"m")
    with pytest.raises(ck.CheckpointError, match="outside"):
        w.write(8, b"xyz")
    with pytest.raises(ck.CheckpointError, match="outside"):
        w.write(-1, b"x")
    with pytest.raises(ck.CheckpointError, match="outside"):
        w.shard_done(5, 10, "0" * 64)
    w.write(0, b"0123456789")
    with pytest.raises(ck.CheckpointError, match="damaged"):
        w.shard_done(0, 10, hashlib.sha256(b"something else").hexdigest())
    w.abort()


def test_a_file_where_the_directory_should_be_is_one_line(tmp_path):
    target = tmp_path / "file"
    target.write_text("not a directory")
    with pytest.raises(ValueError, match="is not a directory") as info:
        ck.check_directory(str(target))
    assert "\n" not in str(info.value)


@root_only
def test_a_full_disk_is_one_line_and_loses_nothing(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=700", "tmpfs", str(mnt)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        d = ck.CheckpointDir.open(str(mnt))
        good = write(d, commit=1, data=b"x" * 1000)
        w = ck.Writer(d, 2, commit=2, steps=0, saved_at=0, job="j", lineage="L1", world=1, data_bytes=1 << 20,
                      meta=b"m")
        with pytest.raises(ck.CheckpointError, match="No space left") as info:
            w.write(0, b"y" * (1 << 20))
        assert "\n" not in str(info.value)
        w.abort()
        assert d.scan().newest.path == good.path
        d.close()
        full = mnt / "full"  # a full disk before the job: the lock's note cannot be written
        full.mkdir(mode=0o700)
        with open(mnt / "filler", "wb") as f:
            try:
                f.write(b"z" * (1 << 20))
            except OSError:
                pass
        d = ck.CheckpointDir.open(str(full))
        with pytest.raises(ck.CheckpointError, match="cannot write .*/lock: No space left"):
            d.lock("job")  # was: a traceback out of ftruncate/write
        d.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(cdir):
    """Only its owner can plant one, but it hung the job's start with no line (open blocked)."""
    os.mkfifo(os.path.join(cdir.path, "key"), 0o600)
    with pytest.raises(ck.UntrustedDirectory, match="key is not a regular file"):
        cdir.key()


@root_only
def test_a_link_planted_where_the_directory_was_about_to_be_made_is_refused(tmp_path, monkeypatch):
    """mallory wins the race between the check (nothing at /tmp/ckpt) and mkdir (EEXIST was
    taken as "made meanwhile": the open followed her link to a directory of yours)."""
    yours = tmp_path / "yours"
    yours.mkdir(mode=0o700)
    shared = _shared(tmp_path / "tmp")
    target = shared / "ckpt"
    real_mkdir = os.mkdir

    def racing_mkdir(path, mode=0o777, *a, **k):
        if str(path) == str(target):
            target.symlink_to(yours)
            os.lchown(target, NOBODY, NOBODY)
            raise FileExistsError(17, "File exists", str(path))
        return real_mkdir(path, mode, *a, **k)

    monkeypatch.setattr(ck.os, "mkdir", racing_mkdir)
    with pytest.raises(ck.UnsafePath, match="is a symbolic link that nobody made in"):
        ck.CheckpointDir.open(str(target))
    assert sorted(os.listdir(yours)) == []


def test_numbers_continue_after_copies_of_earlier_jobs(cdir):
    write(cdir, commit=1)
    write(cdir, commit=2)
    os.mkdir(os.path.join(cdir.path, ".tmp-ckpt-000009-123"))  # a driver died while writing
    cdir.clean_stale()
    assert cdir.next_number() == 3
    assert copies(cdir) == ["ckpt-000001", "ckpt-000002"]


def test_copies_are_asked_for_at_once_then_every_interval():
    from elasticrun.driver.durable.decisions import CopySchedule

    s = CopySchedule(60.0)
    assert s.due(0.0) and s.next_deadline() is None
    assert s.request(5.0) == 1
    assert not s.due(64.9) and s.next_deadline() == 65.0
    assert s.due(65.0) and s.request(65.0) == 2


def test_a_directory_moved_or_deleted_while_open_is_seen_so(tmp_path):
    """Copies go on through the descriptor; the stop's line named the old path, where a rerun
    of the same command found nothing (or a new, empty directory) and started from scratch."""
    d = ck.CheckpointDir.open(str(tmp_path / "ck"))
    try:
        assert not d.moved()
        os.rename(tmp_path / "ck", tmp_path / "ck2")
        assert d.moved()
        os.mkdir(tmp_path / "ck", 0o700)  # a new one at the old path is not it either
        assert d.moved()
    finally:
        d.close()
    e = ck.CheckpointDir.open(str(tmp_path / "gone"))
    try:
        os.rmdir(tmp_path / "gone")
        assert e.moved()
    finally:
        e.close()


def test_a_missing_key_with_copies_present_is_said_so(cdir):
    """A new key was made, and every copy was then 'not signed with this directory's key'."""
    write(cdir, commit=1, data=b"x" * 100)
    os.unlink(os.path.join(cdir.path, "key"))
    again = ck.CheckpointDir.open(cdir.path)
    try:
        with pytest.raises(ck.UntrustedDirectory, match=r"key is missing, but the directory holds copies \(ckpt-000001\)"):
            again.key()
        assert not os.path.exists(os.path.join(cdir.path, "key"))
    finally:
        again.close()


@root_only
def test_a_read_only_file_system_is_named_as_such(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o700)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,mode=700", "tmpfs", str(ro)], capture_output=True).returncode:
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        with pytest.raises(ck.CheckpointError, match="cannot write in it: it is on a read-only file system"):
            ck.CheckpointDir.open(str(ro))
    finally:
        subprocess.run(["umount", str(ro)], check=False)
