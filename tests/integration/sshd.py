"""A real OpenSSH server for tests: its own host key, config and authorized_keys in a temp dir.

It listens on one port on several loopback addresses (127.0.0.2, 127.0.0.3, ... each play a
host), runs as the current user, and is stopped by PID. Tests use it to launch real workers
over SSH and to check that nothing the job started is left running under it.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/local/sbin/sshd")


class SSHDUnavailable(Exception):
    """sshd cannot run here; the message says why (used as the skip reason)."""


def find_sshd() -> str:
    for path in SSHD_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("sshd")
    if found:
        return os.path.abspath(found)
    raise SSHDUnavailable("sshd is not installed (apt-get install openssh-server; run_tests.sh does it as root)")


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True, timeout=30)


def _free_port(addresses: list[str]) -> int:
    """A port free on every address (checked by binding them all at once)."""
    for _ in range(50):
        first = socket.socket()
        first.bind((addresses[0], 0))
        port = first.getsockname()[1]
        held = [first]
        try:
            for addr in addresses[1:]:
                s = socket.socket()
                held.append(s)
                s.bind((addr, port))
            return port
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise SSHDUnavailable(f"no free port common to {addresses}")


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == b"Z":
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    return children


def descendants(pid: int) -> list[int]:
    """Live (non-zombie) descendants of ``pid``."""
    children = _children_map()
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


@dataclass
class SSHServer:
    directory: Path
    addresses: list[str]
    max_sessions: int = 10
    untrusted: tuple[str, ...] = ()  # listened on, but left out of known_hosts
    port: int = 0
    proc: subprocess.Popen | None = None
    user: str = field(default_factory=getpass.getuser)

    # --- files -------------------------------------------------------------------------------
    @property
    def client_key(self) -> Path:
        return self.directory / "id_client"

    @property
    def other_key(self) -> Path:
        """A key that is *not* authorized (for the refused-key test)."""
        return self.directory / "id_other"

    @property
    def known_hosts(self) -> Path:
        return self.directory / "known_hosts"

    @property
    def log(self) -> Path:
        return self.directory / "sshd.log"

    def ssh_args(self) -> list[str]:
        """The elasticrun flags that reach this server with its key, checking its host key."""
        return ["--launcher", "ssh", "-p", str(self.port), "-i", str(self.client_key),
                "--ssh-known-hosts", str(self.known_hosts)]

    def start(self) -> "SSHServer":
        sshd = find_sshd()
        if not shutil.which("ssh-keygen"):
            raise SSHDUnavailable("ssh-keygen is not installed")
        self.directory.mkdir(parents=True, exist_ok=True)
        host_key = self.directory / "ssh_host_ed25519_key"
        _keygen(host_key, "elasticrun-test-host")
        _keygen(self.client_key, "elasticrun-test-client")
        _keygen(self.other_key, "elasticrun-test-other")
        authorized = self.directory / f"authorized_keys_{self.user}"
        authorized.write_text((self.directory / "id_client.pub").read_text())
        authorized.chmod(0o600)
        self.port = _free_port(self.addresses)
        config = self.directory / "sshd_config"
        config.write_text("\n".join([
            *(f"ListenAddress {a}:{self.port}" for a in self.addresses),
            f"HostKey {host_key}",
            # %u: per-user files, so `nobody@host` has no authorized key (refused-key test).
            f"AuthorizedKeysFile {self.directory}/authorized_keys_%u",
            f"PidFile {self.directory}/sshd.pid",
            "PermitRootLogin prohibit-password",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "UseDNS no",
            f"MaxSessions {self.max_sessions}",
            "MaxStartups 100:30:200",
            "LogLevel INFO",
            "",
        ]))
        known = self.directory / "ssh_host_ed25519_key.pub"
        key_type, key_b64 = known.read_text().split()[:2]
        self.known_hosts.write_text("".join(f"[{a}]:{self.port} {key_type} {key_b64}\n" for a in self.addresses
                                            if a not in self.untrusted))
        try:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
        except OSError as exc:
            raise SSHDUnavailable(f"cannot create /run/sshd: {exc.strerror}") from None
        check = subprocess.run([sshd, "-t", "-f", str(config)], capture_output=True, text=True, timeout=30)
        if check.returncode != 0:
            raise SSHDUnavailable(f"sshd rejects its test config: {check.stderr.strip()}")
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL,
                                         stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + 10
        pending = list(self.addresses)
        while pending:
            if self.proc.poll() is not None:
                raise SSHDUnavailable(f"sshd exited with code {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise SSHDUnavailable(f"sshd did not listen on {pending} within 10 s: {self.log.read_text()[-2000:]}")
            try:
                socket.create_connection((pending[0], self.port), timeout=1).close()
                pending.pop(0)
            except OSError:
                time.sleep(0.02)
        return self

    # --- what runs under it ------------------------------------------------------------------
    def sessions(self) -> list[int]:
        """Processes started under sshd (session handlers and anything they started)."""
        return descendants(self.proc.pid) if self.proc is not None else []

    def connections_to(self, address: str) -> list[int]:
        """sshd's session processes serving a connection to ``address`` (one "host"): killing
        them drops that host's SSH sessions, as a network blip or a restarted sshd would, while
        sshd still listens there."""
        octets = [int(x) for x in address.split(".")]
        local = "%08X:%04X" % (octets[3] << 24 | octets[2] << 16 | octets[1] << 8 | octets[0], self.port)
        inodes = set()
        with open("/proc/net/tcp", encoding="ascii") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[1] == local and fields[3] == "01":  # ESTABLISHED
                    inodes.add(f"socket:[{fields[9]}]")
        found = []
        for pid in self.sessions():
            if not cmdline(pid).startswith("sshd"):
                continue
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
                if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in fds):
                    found.append(pid)
            except OSError:
                continue
        return found

    def workload(self) -> list[int]:
        """Processes under sshd other than sshd's own session processes."""
        return [p for p in self.sessions() if not cmdline(p).startswith("sshd")]

    def wait_idle(self, within: float) -> list[int]:
        """Wait until nothing runs under sshd; return what is left (empty when idle)."""
        deadline = time.monotonic() + within
        while True:
            left = self.workload()
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    def describe(self, pids: list[int]) -> str:
        return ", ".join(f"{p}: {cmdline(p)[:120]}" for p in pids)

    def stop(self) -> None:
        """Stop sshd by PID; also any session it still has (they would keep connections open)."""
        if self.proc is None:
            return
        leftovers = self.sessions()
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc = None


@pytest.fixture(scope="module")
def ssh_server(tmp_path_factory):
    """An sshd on 127.0.0.2-127.0.0.5 (127.0.0.5's key is not in known_hosts), MaxSessions 4."""
    server = SSHServer(tmp_path_factory.mktemp("sshd"), ["127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5"],
                       max_sessions=4, untrusted=("127.0.0.5",))
    try:
        server.start()
    except SSHDUnavailable as exc:
        pytest.skip(f"cannot run a test sshd: {exc}")
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot run a test sshd: {type(exc).__name__}: {exc}")
    yield server
    server.stop()


@pytest.fixture
def sshd_clean(ssh_server):
    """After the test, nothing the test started may still run under sshd (checked, then killed)."""
    yield ssh_server
    left = ssh_server.wait_idle(10)
    if left:
        what = ssh_server.describe(left)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        pytest.fail(f"processes left running under sshd: {what}")
