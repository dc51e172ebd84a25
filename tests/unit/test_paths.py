"""check_writable_file / check_writable_dir: one line naming the flag and the reason; read_bounded:
a file the user names (--hostfile, --config-file) is read within a bound of size and of time."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from elasticrun.common.diagnostics import open_beneath
from elasticrun.common.paths import (check_writable_dir, check_writable_file, obeyed_file_problem, open_user_file, planted,
                                    read_bounded)
from elasticrun.discovery.sources import discovery_command
from elasticrun.driver.cli.parser import read_hostfile

pytestmark = pytest.mark.timeout(30)


def refused(check, path, flag="--flag") -> str:
    with pytest.raises(ValueError) as err:
        check(str(path), flag)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{flag} {path}: "), message
    return message[len(f"{flag} {path}: "):]


def test_missing_parents_are_created_and_no_file_is_left(tmp_path: Path):
    target = tmp_path / "a" / "b" / "events.jsonl"
    check_writable_file(str(target), "--events")
    assert target.parent.is_dir() and not target.exists()
    check_writable_dir(str(tmp_path / "out" / "logs"), "--output-filename")
    assert (tmp_path / "out" / "logs").is_dir() and list((tmp_path / "out" / "logs").iterdir()) == []


def test_an_existing_file_is_kept_as_it_is(tmp_path: Path):
    target = tmp_path / "events.jsonl"
    target.write_text("old\n")
    check_writable_file(str(target), "--events")
    assert target.read_text() == "old\n"


def test_a_file_where_a_directory_is_needed(tmp_path: Path):
    (tmp_path / "file").write_text("")
    assert refused(check_writable_file, tmp_path / "file" / "x" / "events.jsonl") == f"{tmp_path}/file is not a directory"
    assert refused(check_writable_dir, tmp_path / "file") == f"{tmp_path}/file is not a directory"
    assert refused(check_writable_dir, "/dev/null/out") == "/dev/null is not a directory"


def test_a_directory_where_a_file_is_needed(tmp_path: Path):
    assert refused(check_writable_file, tmp_path) == "is a directory"


def test_a_directory_that_cannot_be_created():
    assert refused(check_writable_file, "/proc/x/y") == "cannot create directory /proc/x: no such file or directory"


def test_a_fifo_without_reader_does_not_block(tmp_path: Path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert refused(check_writable_file, fifo).startswith("cannot write to it: ")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_permission_denied(tmp_path: Path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert refused(check_writable_file, locked / "events.jsonl") == "cannot write to it: permission denied"
        assert refused(check_writable_dir, locked / "sub").endswith("permission denied")
        assert refused(check_writable_dir, locked) == "cannot write in it: permission denied"
    finally:
        locked.chmod(0o700)


def test_a_directory_nobody_may_write_in():
    # Even root cannot create files in sysfs; it stands in for a read-only file system.
    if not os.path.isdir("/sys/kernel"):
        pytest.skip("no /sys")
    assert refused(check_writable_dir, "/sys/kernel").startswith("cannot write in it: ")


# --- read_bounded ---------------------------------------------------------------------------------
def test_a_regular_file_is_read_up_to_one_byte_past_the_limit(tmp_path: Path):
    (tmp_path / "small").write_bytes(b"localhost:2\n")
    (tmp_path / "big").write_bytes(b"x" * 5000)
    assert read_bounded(str(tmp_path / "small"), 100) == b"localhost:2\n"
    assert read_bounded(str(tmp_path / "big"), 100) == b"x" * 101  # the caller refuses it


def test_a_fifo_written_by_another_process_is_read_to_its_end(tmp_path: Path):
    fifo = tmp_path / "hosts"
    os.mkfifo(fifo)

    def write() -> None:
        time.sleep(0.2)  # the reader is waiting by now: its open did not block
        with open(fifo, "wb") as f:
            f.write(b"localhost:1\n")
            f.flush()
            time.sleep(0.1)
            f.write(b"127.0.0.1:1\n")

    t = threading.Thread(target=write)
    t.start()
    try:
        assert read_bounded(str(fifo), 1000, timeout=10) == b"localhost:1\n127.0.0.1:1\n"
    finally:
        t.join()


@pytest.mark.parametrize("writer", [False, True])
def test_a_fifo_that_never_ends_is_an_error_at_the_deadline_not_a_hang(tmp_path: Path, writer: bool):
    fifo = tmp_path / "hosts"
    os.mkfifo(fifo)
    held = os.open(fifo, os.O_RDWR) if writer else None  # open for writing, never closed
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError) as err:
            read_bounded(str(fifo), 1000, timeout=0.3)
        assert 0.3 <= time.monotonic() - started < 5
        assert err.value.strerror is None and "did not end within 0.3 s" in str(err.value)
    finally:
        if held is not None:
            os.close(held)


def test_a_config_file_fifo_that_never_ends_is_one_line_at_the_deadline(tmp_path: Path, monkeypatch, capsys):
    """--config-file reads through read_bounded too (the --hostfile case runs end to end in
    tests/integration/test_cli.py, with the real 10 s)."""
    from elasticrun.common import paths
    from elasticrun.driver.cli.command import parse_settings

    fifo = tmp_path / "cluster.toml"
    os.mkfifo(fifo)
    monkeypatch.setattr(paths, "READ_TIMEOUT_S", 0.3)
    with pytest.raises(SystemExit) as exit_:
        parse_settings(["-np", "1", "-H", "localhost", "--config-file", str(fifo), "python", "x.py"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (f"elasticrun: error: --config-file {fifo}: it did not end within 0.3 s (a "
                                       f"pipe or FIFO that is never closed?) (see elasticrun --help)\n")


def test_a_directory_and_endless_devices_are_refused_or_cut(tmp_path: Path):
    with pytest.raises(IsADirectoryError):
        read_bounded(str(tmp_path), 1000)
    assert read_bounded("/dev/zero", 1000) == b"\0" * 1001
    assert read_bounded("/dev/null", 1000) == b""


# --- a shared, sticky directory (/tmp): what a neighbour planted is not followed or written ---------
NEIGHBOUR = 65534  # nobody


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    d = tmp_path / "tmp"
    d.mkdir()
    d.chmod(0o1777)  # as /tmp
    return d


def _own(path: Path, uid: int) -> None:
    os.chown(path, uid, uid, follow_symlinks=False)


def _planted_link(at: Path, victim: Path) -> Path:
    """A file of yours (``victim``, "precious") and a link to it at ``at`` that the neighbour made."""
    victim.write_text("precious\n")
    at.symlink_to(victim)
    _own(at, NEIGHBOUR)
    return at


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make files of another user")


@needs_root
def test_a_neighbours_link_in_a_shared_directory_is_refused_up_front_and_at_the_open(shared, tmp_path):
    victim = tmp_path / "bashrc"
    link = _planted_link(shared / "t.json", victim)
    why = refused(check_writable_file, link, "--timeline-filename")
    assert why == (f"it is a symbolic link that uid {NEIGHBOUR} put in a shared directory (not followed); "
                   f"remove it or choose another path")
    with pytest.raises(OSError) as caught:
        open_user_file(str(link), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert "symbolic link that uid 65534" in caught.value.strerror
    assert victim.read_text() == "precious\n"


@needs_root
def test_a_neighbours_file_and_a_hard_link_in_a_shared_directory_are_not_written(shared, tmp_path):
    theirs = shared / "events.jsonl"
    theirs.write_text("")
    _own(theirs, NEIGHBOUR)
    assert "belongs to uid 65534" in refused(check_writable_file, theirs, "--events")
    mine = tmp_path / "notes"
    mine.write_text("precious\n")
    os.link(mine, shared / "t2.json")  # (protected_hardlinks=0: anyone may link to a file of yours)
    assert "other hard links" in planted(str(shared / "t2.json"))
    with pytest.raises(OSError):
        open_user_file(str(shared / "t2.json"), os.O_WRONLY | os.O_TRUNC)
    assert mine.read_text() == "precious\n"


def test_your_own_links_and_files_anywhere_are_yours_to_choose(shared, tmp_path):
    real = tmp_path / "real.json"
    (shared / "mine.json").symlink_to(real)  # made by you (the directory's other users are not you)
    assert planted(str(shared / "mine.json")) == ""
    fd = open_user_file(str(shared / "mine.json"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(fd, b"x"), os.close(fd)
    assert real.read_text() == "x"
    assert planted("/dev/stdout") == ""  # (/dev is not a shared sticky directory)
    check_writable_file(str(shared / "new.json"), "--events")  # nothing there yet


def test_a_link_planted_after_the_look_is_not_followed(shared, tmp_path, monkeypatch):
    """Between planted()'s look and the open, a link appears: O_NOFOLLOW refuses it."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    target = shared / "race.json"
    import elasticrun.common.paths as paths

    real = paths._look

    def look_then_plant(path: str) -> tuple[str, bool]:
        seen = real(path)
        target.symlink_to(victim)
        return seen

    monkeypatch.setattr(paths, "_look", look_then_plant)
    with pytest.raises(OSError):
        open_user_file(str(target), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    assert victim.read_text() == "precious\n"


# --- the whole way to a path, not only its last part (a hostile-neighbour audit) -----------------------
def _neighbours_dir(shared: Path, name: str) -> Path:
    """A directory a neighbour made in a shared directory (``mkdir /tmp/tl``): theirs, 0755."""
    d = shared / name
    d.mkdir()
    _own(d, NEIGHBOUR)
    return d


@needs_root
@pytest.mark.parametrize("flag", ["--timeline-filename", "--events"])
def test_a_link_in_a_directory_a_neighbour_made_in_a_shared_one_is_refused(shared, tmp_path, flag):
    """``mkdir /tmp/tl; ln -s ~you/precious /tmp/tl/timeline.json``: the link is not in the
    sticky directory, so the kernel's rule (and the last part's check) let the job truncate or
    append to your file."""
    victim = tmp_path / "precious"
    theirs = _neighbours_dir(shared, "tl")
    link = _planted_link(theirs / "timeline.json", victim)
    why = refused(check_writable_file, link, flag)
    assert why.startswith(f"{theirs} is a directory that nobody made in {shared}, which anyone may write: "
                          f"they choose which file the job writes"), why
    with pytest.raises(OSError):
        open_user_file(str(link), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    with pytest.raises(OSError):
        open_beneath(str(theirs), ["events.jsonl"])
    assert victim.read_text() == "precious\n"


@needs_root
def test_an_output_directory_a_neighbour_made_or_linked_is_refused(shared, tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    theirs = _neighbours_dir(shared, "out")
    link = shared / "out2"
    link.symlink_to(private)
    _own(link, NEIGHBOUR)
    for given in (theirs, link, theirs / "logs"):
        assert "nobody made in" in refused(check_writable_dir, given, "--output-filename")
        with pytest.raises(OSError):
            open_beneath(str(given), ["rank.0", "stdout"])
    assert list(private.iterdir()) == [] and list(theirs.iterdir()) == []
    mine = shared / "mine"  # made by you in the shared directory: yours to use
    check_writable_dir(str(mine), "--output-filename")
    os.close(open_beneath(str(mine), ["rank.0", "stdout"]))


@needs_root
def test_a_file_the_job_obeys_is_refused_where_a_neighbour_could_choose_or_change_it(shared, tmp_path):
    theirs = _neighbours_dir(shared, "team")
    planted_config = theirs / "job.toml"
    planted_config.write_text('host-discovery-script = "id > /tmp/pwned"\n')
    assert "nobody made in" in obeyed_file_problem(str(planted_config))
    anyones = tmp_path / "open.toml"
    anyones.write_text("np = 2\n")
    anyones.chmod(0o666)
    assert obeyed_file_problem(str(anyones)) == f"anyone may change it (mode 0666): chmod o-w {anyones}"
    anyones.chmod(0o644)
    assert obeyed_file_problem(str(anyones)) == ""
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:1\n")
    script.chmod(0o777)
    with pytest.raises(ValueError, match="anyone may change it"):
        discovery_command(str(script))
    with pytest.raises(ValueError, match="anyone may change it"):
        discovery_command(f"{script} --zone a")
    script.chmod(0o755)
    assert discovery_command(str(script)) == [str(script)]
    for flag, read in (("--hostfile", read_hostfile),):
        with pytest.raises(ValueError, match="nobody made in"):
            read(str(planted_config))
    assert obeyed_file_problem("/dev/stdin") == ""  # --hostfile <(make_hosts), your own descriptors


@needs_root
def test_the_timeline_commands_output_never_follows_a_planted_link(shared, tmp_path):
    from elasticrun.timeline.render import TimelineError, write
    from test_timeline import hand_written

    victim = tmp_path / "precious"
    link = _planted_link(shared / "job-timeline.svg", victim)
    with pytest.raises(TimelineError, match="symbolic link"):
        write(hand_written(), str(link))
    assert victim.read_text() == "precious\n"
