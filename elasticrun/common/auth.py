"""Who may talk to the driver: the job's keys, CURVE on every socket, and a ZAP gate.

Two layers protect the control plane (see docs/security.md):

* **CURVE** (ZeroMQ's CurveZMQ) on every connection between the driver and its workers. The
  driver's ROUTER sockets are CURVE servers with a per-job server key pair; workers are CURVE
  clients with a per-job client key pair. A peer that does not know the server's public key
  cannot complete the handshake, and one that does but presents another client key is
  refused by the driver's ZAP handler (:class:`ZapAuthenticator`), so no frame of an
  unauthenticated peer ever reaches a socket. CURVE also encrypts the traffic.
  CURVE without a ZAP handler accepts *any* client key (measured), so the handler is bound
  before the sockets and lives as long as they do.
* **HMAC** (``elasticrun.common.protocol``): every message is authenticated with the job
  secret, sequence-numbered against replays and bound to its job and recipient.

Everything a worker needs (the HMAC secret, the server's public key and the client key pair)
travels as one small blob, :class:`WorkerKeys`, through an inherited pipe
(``elasticrun.common.secretpipe``), never through the environment or a command line.

This module has no process or network side effects except :class:`ZapAuthenticator`.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable

from elasticrun.common.protocol import new_secret

log = logging.getLogger("elasticrun")

#: Where libzmq sends its authentication requests (RFC 27/ZAP), per context.
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
#: The ZAP domain of elasticrun's server sockets; requests for any other domain are refused.
ZAP_DOMAIN = "elasticrun"
#: A connection that has not completed its handshake within this time is dropped (libzmq's
#: default is 30 s): it bounds how long an unauthenticated peer can hold a connection.
HANDSHAKE_SECONDS = 10.0
_KEY_FIELDS = ("secret", "server_public", "client_public", "client_secret")


class CurveUnavailable(RuntimeError):
    """This pyzmq/libzmq cannot do CURVE, so the driver cannot keep strangers out."""


class BadKeys(ValueError):
    """A key blob could not be read; the message never contains key material."""


def require_curve() -> None:
    import zmq

    if not zmq.has("curve"):
        raise CurveUnavailable(
            f"this pyzmq ({zmq.__version__}, libzmq {zmq.zmq_version()}) was built without CURVE, so the "
            f"driver could not keep unauthenticated peers off its sockets. Install a pyzmq wheel "
            f"(pip install --force-reinstall pyzmq), which bundles a libzmq with CURVE.")


@dataclass(frozen=True)
class WorkerKeys:
    """What a worker needs to reach the driver. ``repr`` never shows the keys."""

    secret: bytes = field(repr=False)  # HMAC-SHA256 key, 32 raw bytes
    server_public: bytes = field(repr=False)  # Z85, 40 bytes each
    client_public: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)

    def encode(self) -> bytes:
        """The blob handed to a worker (JSON, ASCII)."""
        return json.dumps({"v": 1, "secret": self.secret.hex(), "server_public": self.server_public.decode(),
                           "client_public": self.client_public.decode(),
                           "client_secret": self.client_secret.decode()}).encode()

    @classmethod
    def decode(cls, blob: bytes) -> "WorkerKeys":
        try:
            obj = json.loads(blob)
            values = {k: obj[k] for k in _KEY_FIELDS}
            if obj.get("v") != 1 or not all(isinstance(v, str) for v in values.values()):
                raise ValueError
            keys = cls(secret=bytes.fromhex(values["secret"]), server_public=values["server_public"].encode(),
                       client_public=values["client_public"].encode(),
                       client_secret=values["client_secret"].encode())
        except (ValueError, KeyError, TypeError, UnicodeError, RecursionError):
            raise BadKeys(f"the job's keys are malformed ({len(blob)} bytes that are not elasticrun's key "
                          f"blob)") from None
        if len(keys.secret) != 32 or not all(len(k) == 40 for k in
                                             (keys.server_public, keys.client_public, keys.client_secret)):
            raise BadKeys("the job's keys have the wrong lengths")
        return keys


@dataclass(frozen=True)
class JobKeys:
    """The driver's keys for one job: the workers' bundle plus the server's secret key."""

    worker: WorkerKeys
    server_secret: bytes = field(repr=False)

    @classmethod
    def generate(cls) -> "JobKeys":
        require_curve()
        import zmq

        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(WorkerKeys(new_secret(), server_public, client_public, client_secret), server_secret)

    @property
    def secret(self) -> bytes:
        return self.worker.secret


def secure_server(sock: Any, keys: JobKeys, max_frame: int) -> None:
    """Make ``sock`` a CURVE server of the job (before it binds). Frames over ``max_frame``
    bytes drop the connection, handshake commands included."""
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.HANDSHAKE_IVL, int(HANDSHAKE_SECONDS * 1000))
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())


def secure_client(sock: Any, keys: WorkerKeys, max_frame: int) -> None:
    """Make ``sock`` a CURVE client of the job (before it connects): it talks only to the
    driver holding the server key, and is admitted only with the job's client key."""
    import zmq

    sock.setsockopt(zmq.MAXMSGSIZE, max_frame)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)


# --- ZAP (pure) ----------------------------------------------------------------------------------
def zap_reply(frames: list[bytes], allowed: Iterable[bytes]) -> tuple[list[bytes], str | None]:
    """The reply to one ZAP request (RFC 27), and why it was refused (None when admitted).

    Admitted: version 1.0, our domain, mechanism CURVE, and a client key in ``allowed`` (raw
    32-byte keys). Anything else is refused; a request that is not ZAP at all gets 500.
    """
    if len(frames) < 6 or frames[0] != b"1.0":
        request_id = frames[1] if len(frames) > 1 else b""
        return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""], "malformed ZAP request"
    request_id, domain, address, mechanism = frames[1], frames[2], frames[3], frames[5]
    credentials = frames[6:]
    who = address.decode("ascii", "replace")[:64]
    if domain != ZAP_DOMAIN.encode():
        why = f"{who}: unknown ZAP domain"
    elif mechanism != b"CURVE":
        why = f"{who}: mechanism {mechanism.decode('ascii', 'replace')[:16]!r} instead of CURVE"
    elif len(credentials) != 1 or len(credentials[0]) != 32:
        why = f"{who}: malformed CURVE credentials"
    elif not any(hmac.compare_digest(credentials[0], key) for key in allowed):
        why = f"{who}: not the job's client key"
    else:
        return [b"1.0", request_id, b"200", b"OK", b"worker", b""], None
    return [b"1.0", request_id, b"400", b"not a worker of this job", b"", b""], why


class ZapAuthenticator:
    """Answers libzmq's authentication requests for one context: on a thread of its own
    (``start()``), or from the caller's poll loop (``start_inline()``, then ``serve()``: the
    driver's loop, which could otherwise trade the GIL with this thread up to a dozen times per
    handshake).

    Admits only the given CURVE client public keys (Z85). Either start returns once the
    handler is bound (before that, libzmq would admit everyone), ``stop()`` before the
    context is terminated. Refusals are logged, at most ``log_limit`` of them, then counted.
    """

    def __init__(self, ctx: Any, allowed_z85: Iterable[bytes], log_limit: int = 20):
        from zmq.utils import z85

        self._ctx = ctx
        self._allowed = tuple(z85.decode(k) for k in allowed_z85)
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()  # stop() wakes the handler at once
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._log_limit = log_limit
        self._inline: Any = None  # the socket, when served from the caller's loop (start_inline)
        self.refused = 0
        self.admitted = 0

    def start(self, timeout: float = 10.0) -> "ZapAuthenticator":
        self._thread = threading.Thread(target=self._run, name="elasticrun-zap", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self._stop.set()
            raise RuntimeError(f"the ZAP authentication handler did not start within {timeout:g} s")
        if self._error is not None:
            self._thread.join(timeout)
            self._close_pipe()
            raise RuntimeError(f"cannot bind the ZAP authentication handler ({ZAP_ENDPOINT}): "
                               f"{self._error}") from self._error
        return self

    def _close_pipe(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def _bind(self) -> Any:
        """The handler's REP socket, bound (raises zmq.ZMQError, e.g. another handler is bound)."""
        import zmq

        sock = self._ctx.socket(zmq.REP)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            sock.close(0)  # or the context could never be terminated
            raise
        return sock

    def start_inline(self) -> Any:
        """Serve from the caller's own poll loop instead of a thread: bind now (in the calling
        thread, which must be the one that polls) and return the socket to poll; call
        :meth:`serve` when it is readable, :meth:`stop` from the same thread at the end.

        Why: a handshake's ZAP request read and answered on a thread of its own can cost up to
        a dozen GIL hand-overs between that thread and the loop (pyzmq gives up the GIL around
        every frame sent or received: 7 in, 6 out), so while thousands of workers connect, the
        loop waits on the handler's thread and the other way round. Served from the loop, the
        same work runs without them (benchmarks/README.md: round 0 at 4,096 workers, the
        Python threads' CPU 0.84x)."""
        import zmq

        try:
            self._inline = self._bind()
        except zmq.ZMQError as exc:
            self._close_pipe()
            raise RuntimeError(f"cannot bind the ZAP authentication handler ({ZAP_ENDPOINT}): {exc}") from exc
        return self._inline

    def serve(self, sock: Any = None) -> None:
        """Answer every request that is queued (a thousand workers connecting at once are two
        to three thousand handshakes waiting for this), then return."""
        import zmq

        sock = sock if sock is not None else self._inline
        for _ in range(10_000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply, why = zap_reply(frames, self._allowed)
            sock.send_multipart(reply)
            if why is None:
                self.admitted += 1
                continue
            self.refused += 1
            if self.refused <= self._log_limit:
                log.warning("refused a connection to the driver: %s%s", why, " (further refusals are "
                            "only counted)" if self.refused == self._log_limit else "")

    def _run(self) -> None:
        import zmq

        try:
            sock = self._bind()
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if sock in dict(poller.poll(1000)):
                    self.serve(sock)
        except zmq.ZMQError as exc:  # the context is going away
            log.debug("ZAP handler stopped: %s", exc)
        finally:
            sock.close(0)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the handler (its socket is closed when this returns) before the context ends."""
        if self._inline is not None:  # served inline: the caller's thread closes it
            self._inline.close(0)
            self._inline = None
        if self._wake_w < 0:
            return  # stopped already
        self._stop.set()
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("the ZAP authentication handler did not stop within %g s", timeout)
                return  # its pipe stays open for it
        self._close_pipe()
        if self.refused > self._log_limit:
            log.warning("refused %d connections to the driver in all", self.refused)
