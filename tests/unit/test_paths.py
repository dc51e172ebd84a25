"""check_writable_file / check_writable_dir: one line naming the flag and the reason."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elasticrun.common.paths import check_writable_dir, check_writable_file

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
