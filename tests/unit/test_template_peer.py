"""The launch side of warm start sends the worker's environment and the job's key pipe only to a
template of this user (driver/launch/warm.py and remote_bootstrap.py, SO_PEERCRED).

The template's private directory is removed when the template stops; anyone on the machine can
then make a directory at the same path with a socket of theirs before a launch still on its way
connects. Here such a listener runs as another user (nobody): both clients must refuse it before
they send a byte, and it must receive nothing."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from elasticrun.driver.launch import remote_bootstrap as rb
from elasticrun.driver.launch.warm import Unavailable, start_worker

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root to listen as another user")]

LISTENER = textwrap.dedent("""
    import os, socket, sys
    path = sys.argv[1]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(path)
    os.chmod(path, 0o777)
    os.setgid(65534); os.setuid(65534)  # nobody: a neighbour, not the job's user
    s.listen(4)
    print("ready", flush=True)
    s.settimeout(20)
    while True:
        try:
            c, _ = s.accept()
        except socket.timeout:
            break
        c.settimeout(2)
        try:
            msg, fds, _, _ = socket.recv_fds(c, 1 << 16, 8)
        except (socket.timeout, OSError):
            msg, fds = b"", []
        c.close()
        print("received", len(msg) + len(fds), flush=True)
""")


@pytest.fixture
def stranger(tmp_path):
    tmp_path.chmod(0o777)
    sock = tmp_path / "template.sock"
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, str(sock)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    yield sock, proc.stdout
    proc.kill()
    proc.wait()


def test_the_local_launcher_refuses_a_template_socket_of_another_user(stranger):
    sock, out = stranger
    r, w = os.pipe()
    try:
        with pytest.raises(Unavailable, match=r"served by uid 65534, not this user's"):
            start_worker(str(sock), ["python", "train.py"], {"HF_TOKEN": "secret"}, "/", [r, 1, 2, r], 5.0,
                         timeout=5.0)
    finally:
        os.close(r), os.close(w)
    assert out.readline().strip() == "received 0"  # a connection, and not one byte or descriptor


def test_the_remote_watchdog_refuses_a_template_socket_of_another_user(stranger):
    sock, out = stranger
    got = rb.warm_spawn(str(sock), ["python", "train.py"], {"HF_TOKEN": "secret"}, "/", 5.0, keys="KEYS", timeout=5.0)
    assert isinstance(got, str) and "served by uid 65534, not this user's" in got, got
    assert out.readline().strip() == "received 0"
