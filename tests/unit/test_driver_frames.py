"""The driver's request handling never lets an exception escape, whatever arrives on its
ROUTER: garbage, authenticated requests with bodies of any shape, messages of any number of
frames; and what it refuses is logged as a few lines and counts."""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticrun.common.protocol import Codec
from elasticrun.common.ratelimit import LimitedLog
from elasticrun.common.settings import JobSettings
from elasticrun.discovery.sources import FixedHosts
from elasticrun.driver.driver import ElasticDriver, _receive
from elasticrun.driver.functions import FunctionService
from elasticrun.driver.kvstore import KVStore
from elasticrun.driver.launch.launchers import Launchers

pytestmark = pytest.mark.timeout(120)

TYPES = ["heartbeat", "store", "events", "failing", "function", "result", "rendezvous", "nonsense", ""]
KEYS = ["worker", "req", "part", "parts", "kind", "data", "events", "error", "restored", "round", "rank",
        "op", "key", "value", "keys", "timeout", "traceback", "t"]
values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=30)
    | st.sampled_from(["w1", "value", "error", "set", "get", "first_step", "aGVsbG8="]),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5),
                                                                      children, max_size=4),
    max_leaves=15,
)
bodies = st.dictionaries(st.sampled_from(KEYS), values, max_size=6)


class _Socket:
    """Stands in for the ROUTER and PUB sockets: records what the driver sends."""

    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send_multipart(self, parts: list[bytes], flags: int = 0) -> None:
        self.sent.append(parts)

    def send(self, frame: bytes, flags: int = 0) -> None:
        self.sent.append(frame)


_SEQ = itertools.count(1)  # one sequence for every frame the tests forge: none is a replay


@pytest.fixture(scope="module")
def driver():
    d = ElasticDriver(JobSettings(command=["true"], np=1, min_np=1, max_np=1, hosts={"localhost": 1}),
                      FixedHosts({"localhost": 1}), Launchers(JobSettings(command=["true"], np=1, min_np=1, max_np=1)),
                      services=[FunctionService(b"x" * 100, [])])
    d._router, d._pub = _Socket(), _Socket()
    d._rx = Codec(d._keys.secret, d.job_id, "driver-rx")
    d._pub_codec = Codec(d._keys.secret, d.job_id, "driver-pub")
    d._store = KVStore()
    yield d
    os.close(d._wake_r)
    os.close(d._wake_w)


@given(type_=st.sampled_from(TYPES) | st.text(max_size=10), body=bodies)
@settings(max_examples=400, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_authenticated_requests_of_any_shape_never_raise(driver, type_, body):
    sender = Codec(driver._keys.secret, driver.job_id, "fuzzer", _counter=_SEQ)
    driver._on_frame(b"identity", sender.encode(type_, body))


def test_the_fuzzed_requests_were_accepted_and_answered(driver):
    """The sanity check of the test above: its frames are genuine, so they reach _dispatch."""
    sender = Codec(driver._keys.secret, driver.job_id, "fuzzer", _counter=_SEQ)
    before = len(driver._router.sent)
    driver._on_frame(b"identity", sender.encode("heartbeat", {"worker": "w1", "req": 5}))
    reply = Codec(driver._keys.secret, driver.job_id, "fuzzer").decode(driver._router.sent[before][1])
    assert reply.type == "heartbeat_ack" and reply.body["re"] == 5


@given(frame=st.binary(max_size=200))
@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_garbage_never_raises(driver, frame):
    driver._on_frame(b"identity", frame)


def test_refusals_are_a_few_lines_and_counts(driver, caplog):
    driver._limited = LimitedLog(logging.getLogger("elasticrun"))  # not what the tests above left
    with caplog.at_level(logging.WARNING, logger="elasticrun"):
        for i in range(10_000):
            driver._on_frame(b"identity", b"garbage, long enough to hold a MAC: %d" % i)
        driver._limited.flush(force=True)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 6, lines
    assert lines[0].startswith("dropped a control frame: bad MAC")
    assert lines[-1].startswith("9,995 more dropped control frames") and lines[-1].endswith(" bad MAC")


@pytest.mark.parametrize("frames", [1, 2, 3, 7])
def test_receive_takes_messages_of_any_number_of_frames(frames):
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    try:
        for s in (router, dealer):
            s.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        dealer.send_multipart([b"frame %d" % i for i in range(frames)])
        dealer.send(b"next")
        assert router.poll(10_000)
        parts, n = _receive(router)
        assert n == frames + 1 and len(parts) == 2 and parts[1] == b"frame 0"  # the identity comes first
        assert router.poll(10_000)
        parts, n = _receive(router)
        assert n == 2 and parts[1] == b"next"  # the extra frames were consumed, nothing else
        with pytest.raises(zmq.Again):
            _receive(router)
    finally:
        router.close(0)
        dealer.close(0)
        ctx.term()
