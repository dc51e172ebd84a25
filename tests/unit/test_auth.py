"""The job's keys and the ZAP gate: the pure decision, then real CURVE sockets in this process."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest
import zmq
from zmq.utils import z85

from elasticrun.common import auth

pytestmark = pytest.mark.timeout(60)


def _request(key: bytes, mechanism: bytes = b"CURVE", domain: bytes = auth.ZAP_DOMAIN.encode(),
             version: bytes = b"1.0") -> list[bytes]:
    return [version, b"req-7", domain, b"192.0.2.1", b"", mechanism, key]


# --- keys -------------------------------------------------------------------------------------
def test_every_job_gets_fresh_keys_and_the_blob_round_trips():
    a, b = auth.JobKeys.generate(), auth.JobKeys.generate()
    assert len({a.secret, b.secret}) == 2 and len({a.worker.client_secret, b.worker.client_secret}) == 2
    assert a.worker.server_public != b.worker.server_public
    assert zmq.curve_public(a.server_secret) == a.worker.server_public
    assert zmq.curve_public(a.worker.client_secret) == a.worker.client_public
    blob = a.worker.encode()
    assert auth.WorkerKeys.decode(blob) == a.worker
    assert a.server_secret not in blob  # the server's secret key never leaves the driver
    assert len(blob) < 400


def test_repr_never_shows_key_material():
    keys = auth.JobKeys.generate()
    text = repr(keys) + str(keys) + repr(keys.worker)
    for material in (keys.secret.hex(), keys.server_secret.decode(), keys.worker.client_secret.decode(),
                     keys.worker.client_public.decode(), keys.worker.server_public.decode()):
        assert material not in text


@pytest.mark.parametrize("blob", [
    b"", b"not json", b"[]", b'{"v": 1}', b'{"v": 2, "secret": "00", "server_public": "x", "client_public": "x", '
                                         b'"client_secret": "x"}',
])
def test_malformed_blobs_are_refused_without_echoing_them(blob):
    with pytest.raises(auth.BadKeys) as exc:
        auth.WorkerKeys.decode(blob)
    assert "malformed" in str(exc.value)


def test_wrong_key_lengths_are_refused():
    good = json.loads(auth.JobKeys.generate().worker.encode())
    for field, value in (("secret", "00" * 16), ("client_secret", "short")):
        with pytest.raises(auth.BadKeys) as exc:
            auth.WorkerKeys.decode(json.dumps(dict(good, **{field: value})).encode())
        assert value not in str(exc.value)


# --- the ZAP decision (pure) -------------------------------------------------------------------
def test_zap_admits_only_the_jobs_client_key():
    ours = os.urandom(32)
    reply, why = auth.zap_reply(_request(ours), [ours])
    assert reply == [b"1.0", b"req-7", b"200", b"OK", b"worker", b""] and why is None
    reply, why = auth.zap_reply(_request(os.urandom(32)), [ours])
    assert reply[:3] == [b"1.0", b"req-7", b"400"] and why == "192.0.2.1: not the job's client key"


@pytest.mark.parametrize("request_, expected", [
    (_request(b"k" * 32, mechanism=b"NULL"), "mechanism 'NULL' instead of CURVE"),
    (_request(b"k" * 32, mechanism=b"PLAIN"), "mechanism 'PLAIN' instead of CURVE"),
    (_request(b"k" * 32, domain=b"other"), "unknown ZAP domain"),
    (_request(b"k" * 31), "malformed CURVE credentials"),
    (_request(b"k" * 32)[:6], "malformed CURVE credentials"),
])
def test_zap_refuses_other_mechanisms_domains_and_bad_credentials(request_, expected):
    reply, why = auth.zap_reply(request_, [b"k" * 32])
    assert reply[2] == b"400" and expected in why


@pytest.mark.parametrize("request_", [[], [b"1.0"], [b"2.0", b"id", b"d", b"a", b"", b"CURVE", b"k" * 32]])
def test_zap_answers_malformed_requests_with_500(request_):
    reply, why = auth.zap_reply(request_, [b"k" * 32])
    assert reply[0] == b"1.0" and reply[2] == b"500" and why == "malformed ZAP request"


# --- real sockets: a CURVE server behind the ZAP handler ----------------------------------------
class _Served:
    """Whoever answers the ZAP requests: the handler's own thread, or (``inline``) this test's
    thread, as the driver's loop does (``pump`` answers what is queued, as the loop would
    when the handler's socket is readable)."""

    def __init__(self, zap: auth.ZapAuthenticator, inline: bool):
        self.zap = zap
        self.sock = None
        if inline:
            self.sock = zap.start_inline()
        else:
            zap.start()

    def pump(self) -> None:
        if self.sock is not None:
            self.zap.serve()

    def poll(self, sock: zmq.Socket, ms: int) -> bool:
        """``sock.poll(ms)``, answering ZAP requests meanwhile."""
        end = time.monotonic() + ms / 1000
        while True:
            self.pump()
            if sock.poll(5):
                return True
            if time.monotonic() >= end:
                return False


@pytest.fixture(params=["thread", "inline"])
def server(request):
    """A ROUTER set up as the driver's, behind the ZAP handler, on loopback."""
    keys = auth.JobKeys.generate()
    ctx = zmq.Context()
    zap = auth.ZapAuthenticator(ctx, [keys.worker.client_public], log_limit=2)
    served = _Served(zap, request.param == "inline")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    auth.secure_server(router, keys, 1 << 20)
    control = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    yield keys, ctx, served, router, control
    router.close(0)
    zap.stop()
    ctx.term()


def _client(ctx, kind: int, addr: str, keys: auth.WorkerKeys | None) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        auth.secure_client(sock, keys, 1 << 20)
    sock.connect(addr)
    return sock


def _exchange(served: _Served, router, dealer, seconds: float) -> tuple[int, int]:
    """Let the dealer send for ``seconds``, the router answering each frame as the driver
    answers a heartbeat; (frames the router got, answers the dealer got)."""
    got_router = got_dealer = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            dealer.send(b"hello", zmq.NOBLOCK)
        except zmq.Again:
            pass
        while served.poll(router, 10):
            identity, _ = router.recv_multipart()
            router.send_multipart([identity, b"note"])
            got_router += 1
        while dealer.poll(0):
            dealer.recv()
            got_dealer += 1
    return got_router, got_dealer


def test_the_jobs_key_gets_in_and_any_other_is_refused(server, caplog):
    keys, ctx, served, router, control = server
    zap = served.zap
    other_pub, other_sec = zmq.curve_keypair()
    strangers = {  # none of them may get a frame in or out
        "no CURVE": None,
        "another client key": auth.WorkerKeys(keys.secret, keys.worker.server_public, other_pub, other_sec),
        "another server key": auth.WorkerKeys(keys.secret, zmq.curve_keypair()[0], keys.worker.client_public,
                                              keys.worker.client_secret),
    }
    cctx = zmq.Context()
    try:
        with caplog.at_level(logging.WARNING, logger="elasticrun"):
            for what, k in strangers.items():  # two connections each (requests and heartbeats)
                for _ in range(2):
                    dealer = _client(cctx, zmq.DEALER, control, k)
                    assert _exchange(served, router, dealer, 0.3) == (0, 0), what
                    dealer.close(0)
            dealer = _client(cctx, zmq.DEALER, control, keys.worker)
            got_router, got_dealer = _exchange(served, router, dealer, 0.6)
            assert got_router > 0 and got_dealer > 0
    finally:
        cctx.destroy(0)
    # Only the peer that knew the server key reached ZAP; the others failed the handshake before.
    assert zap.refused >= 2 and zap.admitted == 1
    refusals = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert refusals[0] == "refused a connection to the driver: 127.0.0.1: not the job's client key"
    assert len(refusals) == 2 and "further refusals are only counted" in refusals[-1]  # log_limit=2


def test_without_the_zap_handler_curve_admits_any_client_key():
    """Why the handler is essential (and bound before the sockets): libzmq's default admits all."""
    keys = auth.JobKeys.generate()
    ctx = zmq.Context()
    try:
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        auth.secure_server(router, keys, 1 << 20)
        control = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        other_pub, other_sec = zmq.curve_keypair()
        stranger = _client(ctx, zmq.DEALER, control,
                           auth.WorkerKeys(keys.secret, keys.worker.server_public, other_pub, other_sec))
        stranger.send(b"in")
        assert router.poll(5000), "a stranger's frame should get through without ZAP"
        assert router.recv_multipart()[1] == b"in"
    finally:
        ctx.destroy(0)


def test_an_oversized_frame_drops_its_connection_and_a_zap_handler_binds_once(server):
    keys, ctx, served, router, control = server
    with pytest.raises(RuntimeError, match="cannot bind the ZAP authentication handler"):
        auth.ZapAuthenticator(ctx, [keys.worker.client_public]).start()
    with pytest.raises(RuntimeError, match="cannot bind the ZAP authentication handler"):
        auth.ZapAuthenticator(ctx, [keys.worker.client_public]).start_inline()
    cctx = zmq.Context()
    try:
        big = _client(cctx, zmq.DEALER, control, keys.worker)
        big.send(b"a" * (2 << 20))  # over the limit: the connection is dropped, the frame never stored
        small = _client(cctx, zmq.DEALER, control, keys.worker)
        small.send(b"in")
        assert served.poll(router, 5000)
        assert router.recv_multipart()[1] == b"in"
        assert not served.poll(router, 300)
    finally:
        cctx.destroy(0)


def test_the_server_secret_key_is_not_the_clients():
    keys = auth.JobKeys.generate()
    assert z85.decode(keys.worker.client_secret) != z85.decode(keys.server_secret)
