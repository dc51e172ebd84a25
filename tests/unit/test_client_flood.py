"""A worker's client logs refused frames as a few lines and a count, not one line each."""

from __future__ import annotations

import logging
import re
import threading

import pytest
import zmq

from elasticrun.common import auth
from elasticrun.common.protocol import Codec
from elasticrun.worker.client import DriverClient

pytestmark = pytest.mark.timeout(60)

JOB = "job-1"


def test_garbage_replies_are_counted_and_the_real_one_is_returned(caplog):
    ctx = zmq.Context()
    keys = auth.JobKeys.generate()
    SECRET = keys.secret
    zap = auth.ZapAuthenticator(ctx, [keys.worker.client_public]).start()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, 0)  # a ROUTER drops what exceeds its high-water mark
    auth.secure_server(router, keys, 1 << 20)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = DriverClient(ctx, f"tcp://127.0.0.1:{port}", keys.worker, JOB, "w")
    driver = Codec(SECRET, JOB, "driver")
    try:
        with caplog.at_level(logging.WARNING, logger="elasticrun.worker"):
            # The request is sent before request() waits; answer it from here once it arrives.
            def answer() -> None:
                assert router.poll(10_000)
                identity, frame = router.recv_multipart()
                req = Codec(SECRET, JOB, "peek").decode(frame)  # a fresh codec: no replay state
                for i in range(3000):
                    router.send_multipart([identity, b"garbage long enough to carry a MAC %d" % i if i % 2 else b"x"])
                router.send_multipart([identity, driver.encode("ack", {"re": req.body["req"]}, to=req.sender)])

            t = threading.Thread(target=answer)
            t.start()
            reply = client.request("ping", {}, timeout=20, what="a ping")
            t.join(10)
            assert reply.type == "ack"
            client.close()
    finally:
        router.close(0)
        zap.stop()
        ctx.term()
    lines = [r.getMessage() for r in caplog.records if "control frame" in r.getMessage()]
    assert len(lines) <= 8, lines
    full = [l for l in lines if l.startswith("dropped a control frame")]
    counted = sum(int(m.group(1).replace(",", "")) for l in lines if (m := re.match(r"([\d,]+) more", l)))
    assert len(full) + counted == 3000, lines
    assert any("too short" in l and "bad MAC" in l for l in lines if " more " in l), lines
