"""Peers that attack the driver's sockets, for tests and ``benchmarks/hostile_peer.py``.

``RawPeer`` speaks ZMTP 3.0 by hand with the NULL mechanism (no keys at all), as anyone on the
network can: it needs no ZeroMQ and keeps nothing itself, so it can send a 20 MiB subscription
without building libzmq's subscription trie in the attacking process. Peers that speak CURVE
(with a wrong client key, or with stolen keys) are ordinary pyzmq sockets made by the tests.
"""

from __future__ import annotations

import os
import socket
import struct
import time

MIB = 1 << 20


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MIB


def tcp_address(endpoint: str) -> tuple[str, int]:
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    return host.strip("[]"), int(port)


class RawPeer:
    """A ZMTP 3.0 peer with the NULL mechanism: greeting, READY as ``socket_type``, then frames."""

    def __init__(self, endpoint: str, socket_type: bytes):
        self.sock = socket.create_connection(tcp_address(endpoint), timeout=5)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 * MIB)
        greeting = b"\xff" + b"\0" * 8 + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + b"\0" * 31
        ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
        self.sent = 0
        self.refused = False
        self._send(greeting + bytes([0x04, len(ready)]) + ready)

    def _send(self, data: bytes) -> None:
        if self.refused:
            return
        try:
            self.sock.sendall(data)
            self.sent += len(data)
        except OSError:  # the server hung up: what a CURVE server does to a NULL peer
            self.refused = True

    def frame(self, body: bytes) -> None:
        head = bytes([0x02]) + struct.pack(">Q", len(body)) if len(body) > 255 else bytes([0x00, len(body)])
        self._send(head + body)

    def close(self) -> None:
        self.sock.close()


def subscription_flood(endpoint: str) -> RawPeer:
    """The issue's attack on a PUB socket: 20 distinct subscriptions just under 1 MiB (which a
    1 MiB MAXMSGSIZE on the PUB lets through), then one of 20 MiB."""
    peer = RawPeer(endpoint, b"SUB")
    for _ in range(20):
        peer.frame(b"\x01" + os.urandom(8) + b"a" * (MIB - 64))
    peer.frame(b"\x01" + b"a" * (20 * MIB))
    return peer


def frame_flood(endpoint: str) -> RawPeer:
    """Big request frames on a ROUTER socket: 20 just under 1 MiB, then one of 20 MiB."""
    peer = RawPeer(endpoint, b"DEALER")
    for _ in range(20):
        peer.frame(os.urandom(8) + b"x" * (MIB - 64))
    peer.frame(b"x" * (20 * MIB))
    return peer


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)
