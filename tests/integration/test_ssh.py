"""Launching over SSH against a real sshd (no mocks): 127.0.0.2-127.0.0.5 play remote hosts.

The sshd (see ``sshd.py``) has its own host key, config and authorized_keys in a temp dir and
is stopped by PID. Every test checks that nothing it started still runs under sshd, and the
``job`` fixture additionally that no process carrying the job's tag is left on the machine.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import time

import pytest

from conftest import PROGRESS_DISCOVERY, tagged_pids
from elasticrun.driver.launch.ssh import SSHLauncher, SSHOptions
from sshd import cmdline, descendants, ssh_server, sshd_clean  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(120)

SECRET = "c0ffee" * 10
KEYS = b'{"v": 1, "secret": "' + SECRET.encode() + b'"}'  # the launcher only passes the blob on


class _Sink:
    def __init__(self) -> None:
        self.lines: list[tuple[str, str, str]] = []

    def write(self, worker_id: str, stream: str, line: str) -> None:
        self.lines.append((worker_id, stream, line))


class _Exits:
    def __init__(self) -> None:
        self.codes: dict[str, int] = {}
        self._cv = threading.Condition()

    def __call__(self, worker_id: str, code: int, detail: str = "") -> None:
        with self._cv:
            assert worker_id not in self.codes, f"{worker_id} reported twice"
            self.codes[worker_id] = code
            self._cv.notify_all()

    def wait(self, *ids: str, timeout: float = 20) -> dict[str, int]:
        with self._cv:
            assert self._cv.wait_for(lambda: all(i in self.codes for i in ids), timeout), \
                f"no exit for {[i for i in ids if i not in self.codes]} within {timeout} s"
            return {i: self.codes[i] for i in ids}


def _launcher(server, **kw) -> tuple[SSHLauncher, _Sink, _Exits]:
    sink, exits = _Sink(), _Exits()
    opts = dict(port=server.port, identity_file=str(server.client_key), known_hosts=str(server.known_hosts),
                connect_timeout=10.0, stop_grace=2.0)
    opts.update(kw)
    return SSHLauncher(sink, exits, SSHOptions(**opts)), sink, exits


def _env(**extra: str) -> dict[str, str]:
    return dict(PATH=os.environ["PATH"], **extra)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def _sleepers(server) -> list[int]:
    return [p for p in server.workload() if cmdline(p).startswith("sleep")]


# --- the launcher on its own (fast: no torch) ---------------------------------------------------------
def test_output_env_connection_reuse_and_tree_kill(sshd_clean, tmp_path):
    server = sshd_clean
    launcher, sink, exits = _launcher(server)
    script = 'echo out $GREETING; pwd; echo err >&2; echo "keys $(cat <&$ELASTICRUN_SECRET_FD)"; sleep 300 & sleep 300'
    launcher.launch("w1", ["sh", "-c", script], _env(GREETING="hello there"), host="127.0.0.2", keys=KEYS)
    launcher.launch("w2", ["sh", "-c", "sleep 301 & echo quick; exit 3"], _env(), host="127.0.0.2")
    assert exits.wait("w2") == {"w2": 3}
    # w2's orphan went with it: the watchdog kills what is left of the group when the worker exits
    _wait_for(lambda: not any(cmdline(p) == "sleep 301" for p in server.workload()), 2, "w2's orphan to die")
    # and, its output out, the launcher forgets it (a job that replaces workers for days keeps no
    # channel or thread of each one)
    _wait_for(lambda: not launcher.knows("w2"), 5, "w2 to be forgotten")
    assert ("w2", "stdout", "quick") in sink.lines and launcher.knows("w1")
    _wait_for(lambda: len(_sleepers(server)) == 2, 10, "w1's two sleeps")
    assert ("w1", "stdout", "out hello there") in sink.lines
    assert ("w1", "stdout", os.getcwd()) in sink.lines  # the driver's working directory
    assert ("w1", "stderr", "err") in sink.lines and ("w2", "stdout", "quick") in sink.lines
    assert ("w1", "stdout", f"keys {KEYS.decode()}") in sink.lines  # through the pipe
    assert not any("@@elasticrun" in line for _, _, line in sink.lines)  # reports never reach the user
    assert len(launcher.connections("127.0.0.2").clients) == 1  # both workers on one connection
    # The keys are in no environment and on no command line of the remote side.
    shell = next(p for p in server.workload() if "echo out" in cmdline(p))
    assert b"ELASTICRUN_SECRET_FD=" in open(f"/proc/{shell}/environ", "rb").read()
    for pid in server.sessions():
        assert SECRET not in cmdline(pid)
        assert SECRET.encode() not in open(f"/proc/{pid}/environ", "rb").read()
    started = time.monotonic()
    launcher.signal("w1", signal.SIGTERM)
    assert exits.wait("w1") == {"w1": -15}
    assert server.wait_idle(5) == []  # the shell, both sleeps and the watchdog
    assert time.monotonic() - started < 3
    launcher.stop_all(2)
    launcher.drain(2)


def test_lost_connection_kills_the_remote_tree(sshd_clean):
    """What a SIGKILLed driver leaves: a dead TCP connection. The watchdog stops the group."""
    server = sshd_clean
    launcher, _, exits = _launcher(server)
    launcher.launch("w1", ["sh", "-c", "sleep 300 & sleep 300"], _env(), host="127.0.0.3")
    _wait_for(lambda: len(_sleepers(server)) == 2, 10, "the sleeps")
    for client in launcher.connections("127.0.0.3").clients:
        client.get_transport().sock.close()  # no goodbye, like a killed process
    started = time.monotonic()
    assert server.wait_idle(10) == []
    assert time.monotonic() - started < 3
    assert exits.wait("w1")["w1"] != 0
    launcher.stop_all(1)


def test_stopping_gives_up_a_handshake_that_hangs_at_once(sshd_clean):
    """A host that accepts TCP and never speaks SSH holds a launch for --start-timeout; a job
    that ends meanwhile (its other workers finished) must not wait that out."""
    server = sshd_clean
    silent = socket.socket()
    silent.bind(("127.0.0.6", server.port))
    silent.listen(8)
    try:
        launcher, _, exits = _launcher(server, connect_timeout=30.0)
        launcher.launch("w1", ["sleep", "300"], _env(), host="127.0.0.6")
        silent.settimeout(10)
        conn, _ = silent.accept()  # connected: the handshake begins, and gets no answer
        started = time.monotonic()
        launcher.stop_all(2.0)
        assert exits.wait("w1", timeout=5)["w1"] != 0
        assert time.monotonic() - started < 5, "stop_all waited for the hung handshake"
        launcher.drain(2.0)
        conn.close()
    finally:
        silent.close()


def test_more_workers_than_max_sessions_and_stop_all(sshd_clean):
    """sshd allows 4 sessions per connection here: a 5th worker gets a second connection."""
    server = sshd_clean
    launcher, _, exits = _launcher(server)
    ids = [f"w{i}" for i in range(5)]
    for wid in ids:
        launcher.launch(wid, ["sh", "-c", "sleep 300"], _env(), host="127.0.0.4")
    _wait_for(lambda: len(_sleepers(server)) == 5, 15, "5 sleeps")
    assert len(launcher.connections("127.0.0.4").clients) == 2
    started = time.monotonic()
    launcher.stop_all(2)
    assert set(exits.wait(*ids).values()) == {-15}
    assert time.monotonic() - started < 3
    assert server.wait_idle(5) == []


def test_launch_failures_name_the_host_and_the_cause(sshd_clean, caplog):
    server = sshd_clean
    silent = socket.socket()  # accepts connections and never says a word
    silent.bind(("127.0.0.6", 0))
    silent.listen()
    exits = _Exits()
    base = dict(port=server.port, identity_file=str(server.client_key), known_hosts=str(server.known_hosts),
                connect_timeout=1.5, stop_grace=1.0)
    cases = {  # worker: (host, options, what the error must say)
        "unreachable": ("127.0.0.9", {}, "cannot connect to root@127.0.0.9"),
        "unknown_key": ("127.0.0.5", {}, f"is not in {server.known_hosts}"),
        "refused_key": ("nobody@127.0.0.2", {}, f"nobody@127.0.0.2:{server.port} refused our key"),
        "other_key": ("127.0.0.4", {"identity_file": str(server.other_key)}, "refused our key"),
        "bad_cwd": ("127.0.0.3", {"remote_cwd": "/nonexistent/dir"}, "cannot change to directory /nonexistent/dir"),
        "silent": ("127.0.0.6", {"port": silent.getsockname()[1]},
                   "did not complete the SSH handshake within 1.5 s (of --start-timeout"),
    }
    launchers = []
    try:
        started = time.monotonic()
        with caplog.at_level(logging.ERROR, logger="elasticrun"):
            for wid, (host, opts, _) in cases.items():
                launchers.append(SSHLauncher(_Sink(), exits, SSHOptions(**{**base, **opts})))
                launchers[-1].launch(wid, ["true"], _env(), host=host)
            codes = exits.wait(*cases, timeout=15)
        assert time.monotonic() - started < 6  # in parallel, each connect bounded by 1.5 s
        assert all(code != 0 for code in codes.values()), codes
        for wid, (host, _, cause) in cases.items():
            line = next((r.getMessage() for r in caplog.records if f" worker {wid} " in r.getMessage()), "")
            assert line.startswith(f"{host}: could not start worker {wid} over SSH: ") and cause in line, \
                (wid, caplog.text)
        assert "Connection refused" in caplog.text
    finally:
        silent.close()
        for launcher in launchers:
            launcher.stop_all(1)


class _Forward:
    """A TCP port that forwards every connection to ``target``: sshd "starting" on another
    address, once the test opens it."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(listen)
        self.sock.listen()
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            up = socket.create_connection(self.target, timeout=5)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            try:
                b.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def close(self) -> None:
        """Stop listening. (A close() alone leaves the socket listening while the accepting
        thread is blocked in accept(): a later test's connection there would be forwarded.)"""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        except OSError:
            pass
        self.sock.close()
        self.thread.join(5)
        assert not self.thread.is_alive(), "the forward still accepts"


def test_a_newcomer_whose_sshd_is_still_starting_is_tried_again(sshd_clean, tmp_path, caplog):
    """Discovery lists a spot node before its sshd is up: a newcomer's connection refused is
    tried again within the connect time (before, it failed at once and the host was
    blacklisted, by default for good). In the first round a refused host still fails at once."""
    server = sshd_clean
    known = tmp_path / "known_hosts"  # 127.0.0.12 answers with the test sshd's key, through the forward
    key = server.known_hosts.read_text().splitlines()[0].split(" ", 1)[1]
    known.write_text(server.known_hosts.read_text() + f"[127.0.0.12]:{server.port} {key}\n")
    launcher, _, exits = _launcher(server, known_hosts=str(known), connect_timeout=20.0)
    forward = None
    try:
        with caplog.at_level(logging.ERROR, logger="elasticrun"):
            launcher.launch("newcomer", ["true"], _env(ELASTICRUN_JOINING="1"), host="127.0.0.12")
            launcher.launch("first", ["true"], _env(), host="127.0.0.10")
            assert exits.wait("first")["first"] != 0  # refused, and not tried again: its error is said
            assert "127.0.0.10: could not start worker first over SSH: cannot connect to" in caplog.text
            assert "newcomer" not in caplog.text  # still trying
            forward = _Forward(("127.0.0.12", server.port), ("127.0.0.2", server.port))  # sshd is up
            assert exits.wait("newcomer", timeout=30) == {"newcomer": 0}, caplog.text
            # One whose sshd never comes is given up on at the connect time, saying so.
            brief, _, brief_exits = _launcher(server, connect_timeout=1.5)
            try:
                started = time.monotonic()
                brief.launch("never", ["true"], _env(ELASTICRUN_JOINING="1"), host="127.0.0.11")
                assert brief_exits.wait("never")["never"] != 0
                assert 1.0 < time.monotonic() - started < 5
                assert (f"127.0.0.11: could not start worker never over SSH: cannot connect to "
                        f"{server.user}@127.0.0.11:{server.port}: Connection refused, for 1 s of trying (is sshd "
                        f"running there, on port {server.port}?)") in caplog.text, caplog.text
            finally:
                brief.stop_all(1)
    finally:
        if forward is not None:
            forward.close()
        launcher.stop_all(1)


def test_unknown_host_key_only_with_the_flag_and_never_a_changed_one(sshd_clean, tmp_path, caplog):
    server = sshd_clean
    exits = _Exits()
    wrong = tmp_path / "known_hosts"  # 127.0.0.2 listed with another key: a changed host key
    other = (server.directory / "id_other.pub").read_text().split()[:2]
    wrong.write_text(f"[127.0.0.2]:{server.port} {other[0]} {other[1]}\n")
    base = dict(port=server.port, identity_file=str(server.client_key), connect_timeout=5.0, stop_grace=1.0,
                accept_unknown_hosts=True)
    accepting = SSHLauncher(_Sink(), exits, SSHOptions(known_hosts=str(server.known_hosts), **base))
    changed = SSHLauncher(_Sink(), exits, SSHOptions(known_hosts=str(wrong), **base))
    with caplog.at_level(logging.WARNING, logger="elasticrun"):
        accepting.launch("unknown", ["true"], _env(), host="127.0.0.5")
        changed.launch("changed", ["true"], _env(), host="127.0.0.2")
        assert exits.wait("unknown", "changed") == {"unknown": 0, "changed": 255}
    assert "accepting its unknown host key ssh-ed25519 SHA256:" in caplog.text
    assert "127.0.0.2: could not start worker changed" in caplog.text and "does not match" in caplog.text
    accepting.stop_all(1)
    changed.stop_all(1)


# --- whole jobs through the elasticrun command ------------------------------------------------------
def _on_host(tag: str, host: str) -> list[int]:
    """The job's processes started for ``host``."""
    needle = f"ELASTICRUN_HOSTNAME={host}".encode()
    found = []
    for pid in tagged_pids(tag):
        try:
            if needle in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                found.append(pid)
        except OSError:
            pass
    return found


def test_two_ssh_hosts_one_added_one_removed(job, sshd_clean):
    """127.0.0.2 + .3 over SSH; .4 joins at epoch 2; .3 leaves at epoch 4. Survivors keep going,
    and the removed host's worker is gone while the job still runs."""
    schedule = "0:127.0.0.2:1,127.0.0.3:1;2:127.0.0.2:1,127.0.0.3:1,127.0.0.4:1;4:127.0.0.2:1,127.0.0.4:1"
    job.start(["-np", "2", "--min-np", "1", "--max-np", "3", *sshd_clean.ssh_args(),
               "--host-discovery-script", str(PROGRESS_DISCOVERY), "--discovery-interval", "0.2"],
              job.train_cmd("--await-size=3:3", "--await-size=5:2", epochs=20, sleep=0.05), HOSTS_SCHEDULE=schedule)
    _wait_for(lambda: job.log.exists() and '"epoch": 5' in job.log.read_text() or job.proc.poll() is not None,
              60, "epoch 5")
    _wait_for(lambda: not _on_host(job.tag, "127.0.0.3"), 5, "the removed host's worker to exit")
    assert job.proc.poll() is None, "the job ended before the check meant anything"
    r = job.finish()
    assert r.returncode == 0, r.output
    by_epoch = {e["epoch"]: e for e in r.log}
    assert sorted(by_epoch) == list(range(20)), r.log
    assert [by_epoch[e]["size"] for e in (0, 3, 5)] == [2, 3, 2], r.log
    assert all(e["rank"] == 0 and e["host"] == "127.0.0.2" for e in r.log)  # rank 0 never moved
    assert r.log[-1]["rendezvous"] >= 3  # initial + grow + shrink, in the same remote process
    assert "[0]<stdout>:finished rank=0 size=2" in r.stdout and "[1]<stdout>:finished rank=1 size=2" in r.stdout
    assert "host 127.0.0.4 added" in r.stderr and "host 127.0.0.3 removed" in r.stderr, r.stderr
    assert sshd_clean.wait_idle(10) == []


def test_worker_killed_on_an_ssh_host(job, sshd_clean):
    r = job.run(["-np", "3", "--min-np", "2", "-H", "127.0.0.2:1,127.0.0.3:1,127.0.0.4:1", *sshd_clean.ssh_args()],
                job.train_cmd("--fail=127.0.0.4:0@2:sigkill", epochs=4))
    assert r.returncode == 0, r.output
    assert [e["size"] for e in r.log][:2] == [3, 3] and r.log[-1]["size"] == 2, r.log
    assert r.log[-1]["rendezvous"] == 2  # the survivors re-formed in-process, once
    assert "127.0.0.4[0] (rank 2) exited with code -9" in r.stderr, r.stderr
    assert "host 127.0.0.4 blacklisted" in r.stderr


def test_a_lost_ssh_session_is_a_failure_and_the_host_comes_back_after_its_cooldown(job, sshd_clean):
    """127.0.0.3's SSH sessions drop (sshd still listens there): its watchdog stops the worker.
    That is a failure, not the host going: it is blacklisted for the cooldown like any failed
    host, and then trains again (a host "leaving" is kept out until discovery lists it anew:
    here, never). Whether the worker's SIGTERM handler or the driver's view of the lost
    connection comes first is a race this test does not steer; tests/unit/test_remote_bootstrap.py
    checks the watchdog's word and the handler that heeds it."""
    job.start(["-np", "2", "--min-np", "1", "-H", "127.0.0.2:1,127.0.0.3:1", "--blacklist-cooldown-range", "1", "2",
               *sshd_clean.ssh_args()],
              # at epoch 6, held until the failure's round (1) and the comeback's (2) have formed
              job.train_cmd("--await-round=6:2", "--await-size=6:2", epochs=9, sleep=0.1))
    _wait_for(lambda: job.log.exists() and '"epoch": 1' in job.log.read_text() or job.proc.poll() is not None,
              60, "epoch 1")
    assert job.proc.poll() is None, "the job ended before the check meant anything"
    sessions = sshd_clean.connections_to("127.0.0.3")
    assert sessions, "no SSH session to 127.0.0.3"
    for pid in sessions:
        os.kill(pid, signal.SIGKILL)
    r = job.finish()
    assert r.returncode == 0, r.output
    assert "127.0.0.3: lost the SSH connection to worker" in r.stderr, r.stderr
    assert "host 127.0.0.3 leaving" not in r.stderr and "SIGTERM: leaving the job" not in r.stderr, r.stderr
    # (said once the round settles: "was blacklisted ... already over" if that took the cooldown)
    assert ("host 127.0.0.3 blacklisted for " in r.stderr or "host 127.0.0.3 was blacklisted for " in r.stderr) \
        and "127.0.0.3 is back after its blacklist cooldown" in r.stderr, r.stderr
    assert [e["size"] for e in r.log][-1] == 2, r.log  # it trains again


def test_unusable_hosts_are_blacklisted_and_the_job_goes_on(job, sshd_clean):
    """Discovery adds a host nobody answers on and one that refuses our key: both fail like
    workers (logged with the cause, blacklisted) while the two good hosts keep training. The
    refused connection is tried again first (9/10 of --start-timeout: its sshd may be starting);
    the job trains for longer than that."""
    schedule = "0:127.0.0.2:1,127.0.0.3:1;1:127.0.0.2:1,127.0.0.3:1,127.0.0.9:1,nobody@127.0.0.4:1"
    r = job.run(["-np", "2", "--min-np", "2", *sshd_clean.ssh_args(), "--host-discovery-script",
                 str(PROGRESS_DISCOVERY), "--discovery-interval", "0.2", "--start-timeout", "6"],
                job.train_cmd(epochs=16, sleep=0.1), HOSTS_SCHEDULE=schedule)
    assert r.returncode == 0, r.output
    assert [e["size"] for e in r.log] == [2] * 16, r.log
    assert r.log[-1]["rendezvous"] == 1, r.log  # the failed launches never disturbed the round
    assert "127.0.0.9: could not start worker" in r.stderr and "Connection refused, for 5 s of trying" in r.stderr, \
        r.stderr
    assert "nobody@127.0.0.4: could not start worker" in r.stderr and "refused our key" in r.stderr
    assert "host 127.0.0.9 blacklisted" in r.stderr and "host nobody@127.0.0.4 blacklisted" in r.stderr


def test_a_first_round_whose_hosts_do_not_answer_waits_for_discovery_to_list_others(job, sshd_clean):
    """Discovery lists a spot node that is already gone (nothing listens on 127.0.0.9): its start
    is refused. The job ended 0.2 s after its start ("all workers failed ... exited with code
    255"), while discovery listed a usable host moments later. It now waits, saying so."""
    calls = job.tmp / "calls"
    script = job.tmp / "discover.sh"
    script.write_text(f"#!/bin/sh\nn=$(cat {calls} 2>/dev/null || echo 0); echo $((n+1)) > {calls}\n"
                      "echo 127.0.0.9:1\nif [ \"$n\" -ge 4 ]; then echo 127.0.0.2:1; fi\n")
    script.chmod(0o755)
    r = job.run(["-np", "1", *sshd_clean.ssh_args(), "--host-discovery-script", str(script),
                 "--discovery-interval", "0.3", "--elastic-timeout", "60"], job.train_cmd(epochs=2))
    assert r.returncode == 0, r.output
    assert ("127.0.0.9[0] (rank 0) never started: unreachable: cannot connect to "
            f"{sshd_clean.user}@127.0.0.9:{sshd_clean.port}: Connection refused") in r.stderr, r.stderr
    assert ("no listed host could be reached (127.0.0.9): waiting up to --elastic-timeout 60 s for discovery "
            "to list others") in r.stderr, r.stderr
    assert "round 0: 1 worker(s) on 1 host(s)" in r.stderr and "job succeeded" in r.stderr, r.stderr
    assert [e["size"] for e in r.log] == [1, 1], r.log


def test_a_host_whose_handshake_hangs_at_the_start_is_named_with_its_cause(job, sshd_clean):
    """A host that accepts TCP and never speaks SSH (a node still booting) held round 0 for
    --start-timeout and was then said to have "not contacted the driver" (advice about
    hvd.init() and firewalls), its real cause coming after. The launcher now gives up first."""
    silent = socket.socket()
    silent.bind(("127.0.0.8", sshd_clean.port))
    silent.listen()
    try:
        r = job.run(["-np", "2", "--min-np", "2", "--max-np", "3", "-H", "127.0.0.2:1,127.0.0.3:1,127.0.0.8:1",
                     "--start-timeout", "6", *sshd_clean.ssh_args()], job.train_cmd(epochs=2))
    finally:
        silent.close()
    assert r.returncode == 0, r.output
    assert "127.0.0.8: could not start worker w" in r.stderr and "over SSH: root@127.0.0.8:" in r.stderr, r.stderr
    assert ("accepted the connection but did not complete the SSH handshake within 5.4 s (of --start-timeout "
            "6 s)") in r.stderr, r.stderr
    assert "did not contact the driver" not in r.stderr and "No existing session" not in r.stderr, r.stderr
    assert [e["size"] for e in r.log] == [2, 2], r.log


def test_env_flags_and_remote_cwd(job, sshd_clean, tmp_path):
    """-x NAME forwards a variable, -x NAME=VALUE sets one, --no-forward-env drops the rest."""
    r = job.run(["-np", "1", "-H", "127.0.0.3", *sshd_clean.ssh_args(), "--no-forward-env",
                 "-x", "ELASTICRUN_TEST_TAG", "-x", "GREETING=hi there", "--remote-cwd", str(tmp_path)],
                ["sh", "-c", 'echo "$GREETING|${PROGRESS_FILE:-unset}|$ELASTICRUN_TEST_TAG|$PWD"'], timeout=60)
    assert r.returncode == 0, r.output
    assert f"[0]<stdout>:hi there|unset|{job.tag}|{tmp_path}" in r.stdout, r.output


@pytest.mark.parametrize("case", ["missing python", "command not found"])
def test_clear_error_when_the_remote_cannot_run_the_worker(job, sshd_clean, case):
    if case == "missing python":
        extra, command, expected = ["--remote-python", "python3-not-installed"], job.train_cmd(epochs=1), \
            "'python3-not-installed' was not found there: elasticrun needs Python 3"
    else:
        extra, command, expected = [], ["no-such-trainer", "--epochs", "1"], "command not found: no-such-trainer"
    r = job.run(["-np", "2", "-H", "127.0.0.2:1,127.0.0.3:1", *sshd_clean.ssh_args(), *extra], command, timeout=60)
    assert r.returncode == 1, r.output
    for host in ("127.0.0.2", "127.0.0.3"):
        assert f"{host}: could not start worker" in r.stderr and expected in r.stderr, r.stderr
    assert "The job failed" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_driver_stopped_or_killed_leaves_nothing_remote(job, sshd_clean, sig):
    job.start(["-np", "2", "-H", "127.0.0.2:1,127.0.0.3:1", *sshd_clean.ssh_args()],
              job.train_cmd(epochs=1000, batches=5, sleep=0.05))
    _wait_for(lambda: job.log.exists() and job.log.read_text().count("\n") >= 2, 60, "training to start")
    workers = [p for p in tagged_pids(job.tag) if p != job.proc.pid]
    assert len(workers) >= 2 and all(p in descendants(sshd_clean.proc.pid) for p in workers), workers
    started = time.monotonic()
    os.kill(job.proc.pid, sig)
    job.proc.wait(30)
    _wait_for(lambda: not tagged_pids(job.tag), 10, "every worker to exit")
    elapsed = time.monotonic() - started
    assert sshd_clean.wait_idle(5) == []
    r = job.finish(timeout=5)
    assert r.returncode == (-9 if sig == signal.SIGKILL else 128 + sig), r.output
    # The watchdog sees the connection drop: well before the workers' own 5 s driver timeout.
    assert elapsed < 4, elapsed
    sys.stderr.write(f"{signal.Signals(sig).name}: remote workers gone {elapsed:.2f} s after the signal\n")
