"""Handing the keys over through an inherited pipe: read once, bounded, never blocking the launcher."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

import pytest

from elasticrun.common import secretpipe

pytestmark = pytest.mark.timeout(60)

BLOB = b'{"v": 1, "secret": "5ec7e7"}'


def test_round_trip_reads_once_and_closes_the_descriptor():
    fd = secretpipe.hand_over(BLOB)
    environ = {secretpipe.FD_VAR: str(fd), "OTHER": "x"}
    assert secretpipe.receive(environ) == BLOB
    assert environ == {"OTHER": "x"}  # children will not look for a descriptor that is gone
    with pytest.raises(OSError):
        os.fstat(fd)
    with pytest.raises(secretpipe.SecretUnavailable, match="started without its keys"):
        secretpipe.receive(environ)


def test_the_read_end_is_not_inherited_unless_passed():
    fd = secretpipe.hand_over(BLOB)
    try:
        assert not os.get_inheritable(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("value, expected", [
    ("abc", "is not a file descriptor number"),
    ("1", "is not a file descriptor number"),  # stdout is no key pipe
    ("987654", "cannot be read: it is not open"),
    ("1023", "cannot be read: it is not open"),
])
def test_bad_descriptor_numbers(value, expected):
    with pytest.raises(secretpipe.SecretUnavailable, match=expected):
        secretpipe.receive({secretpipe.FD_VAR: value})


def test_descriptor_numbers_past_select_s_limit_work():
    """The number is the launcher's: a driver with 1,024 workers holds thousands of descriptors."""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] <= 1500:
        pytest.skip("RLIMIT_NOFILE is too low here to open descriptor 1500")
    fd = secretpipe.hand_over(BLOB)
    high = os.dup2(fd, 1500, inheritable=False)
    os.close(fd)
    assert secretpipe.receive({secretpipe.FD_VAR: str(high)}) == BLOB


def test_an_empty_pipe_says_the_keys_were_read_already():
    fd = secretpipe.hand_over(b"")
    with pytest.raises(secretpipe.SecretUnavailable, match="were read already"):
        secretpipe.receive({secretpipe.FD_VAR: str(fd)})


def test_a_writer_that_never_closes_times_out_with_a_clear_error():
    r, w = os.pipe()
    try:
        os.write(w, b"partial")
        started = time.monotonic()
        with pytest.raises(secretpipe.SecretUnavailable, match=f"did not arrive on descriptor {r} within 0.3 s"):
            secretpipe.receive({secretpipe.FD_VAR: str(r)}, timeout=0.3)
        assert time.monotonic() - started < 2
    finally:
        os.close(w)


def test_more_than_a_key_blob_is_refused():
    with pytest.raises(ValueError, match="over the 4096-byte limit"):
        secretpipe.hand_over(b"x" * (secretpipe.MAX_BYTES + 1))
    r, w = os.pipe()
    os.write(w, b"x" * (secretpipe.MAX_BYTES + 10))
    os.close(w)
    with pytest.raises(secretpipe.SecretUnavailable, match="holds more than a key blob"):
        secretpipe.receive({secretpipe.FD_VAR: str(r)})


def test_a_child_reads_its_keys_and_its_own_children_get_none():
    fd = secretpipe.hand_over(BLOB)
    code = ("import os, subprocess, sys;"
            "from elasticrun.common import secretpipe;"
            "sys.stdout.buffer.write(secretpipe.receive() + b'|');"
            "sys.stdout.flush();"
            "subprocess.run([sys.executable, '-c', 'import os; print(sorted(os.environ).count(\"ELASTICRUN_SECRET_FD\"),"
            " len(os.listdir(\"/proc/self/fd\")))'])")
    try:
        r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{secretpipe.FD_VAR: str(fd)}),
                           pass_fds=(fd,), capture_output=True, timeout=30)
    finally:
        os.close(fd)
    assert r.returncode == 0, r.stderr
    keys, grandchild = r.stdout.split(b"|")
    assert keys == BLOB
    count, open_fds = grandchild.split()
    assert count == b"0" and int(open_fds) <= 4  # stdin, stdout, stderr and listdir's own


def test_a_child_that_never_reads_does_not_block_the_launcher():
    started = time.monotonic()
    fd = secretpipe.hand_over(BLOB)
    try:
        child = subprocess.Popen(["sleep", "0.2"], pass_fds=(fd,))
    finally:
        os.close(fd)
    assert time.monotonic() - started < 1.0
    assert child.wait(10) == 0
