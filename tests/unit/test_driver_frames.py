"""The driver's request handling never lets an exception escape, whatever arrives on its
ROUTER: garbage, authenticated requests with bodies of any shape, messages of any number of
frames; and what it refuses is logged as a few lines and counts."""

from __future__ import annotations

import itertools
import logging

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elasticrun.common.protocol import Codec
from elasticrun.common.settings import JobSettings
from elasticrun.discovery.sources import FixedHosts
from elasticrun.driver.driver import ElasticDriver, _receive
from elasticrun.driver.functions import FunctionService
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


_SEQ = itertools.count(1)  # one sequence for every frame the tests forge: none is a replay


def _driver() -> ElasticDriver:
    """A driver that has not run: it serves frames given to handle_frame, its replies collected
    in ``sent`` through its public ``reply_to``; no socket, no private attribute."""
    settings_ = JobSettings(command=["true"], np=1, min_np=1, max_np=1, hosts={"localhost": 1})
    d = ElasticDriver(settings_, FixedHosts({"localhost": 1}), Launchers(settings_),
                      services=[FunctionService(b"x" * 100, [])])
    d.sent = []  # type: ignore[attr-defined]
    d.reply_to = d.sent.append  # type: ignore[attr-defined]
    return d


@pytest.fixture(scope="module")
def driver():
    d = _driver()
    yield d
    d.close()


@given(type_=st.sampled_from(TYPES) | st.text(max_size=10), body=bodies)
@settings(max_examples=400, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_authenticated_requests_of_any_shape_never_raise(driver, type_, body):
    sender = Codec(driver.keys.secret, driver.job_id, "fuzzer", _counter=_SEQ)
    driver.handle_frame(b"identity", sender.encode(type_, body))


def test_the_fuzzed_requests_were_accepted_and_answered(driver):
    """The sanity check of the test above: its frames are genuine, so they reach a handler."""
    sender = Codec(driver.keys.secret, driver.job_id, "fuzzer", _counter=_SEQ)
    before = len(driver.sent)
    driver.handle_frame(b"identity", sender.encode("heartbeat", {"worker": "w1", "req": 5}))
    reply = Codec(driver.keys.secret, driver.job_id, "fuzzer").decode(driver.sent[before][1])
    assert reply.type == "heartbeat_ack" and reply.body["re"] == 5


@given(frame=st.binary(max_size=200))
@settings(max_examples=200, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
def test_garbage_never_raises(driver, frame):
    driver.handle_frame(b"identity", frame)


def test_refusals_are_a_few_lines_and_counts(caplog):
    driver = _driver()  # a fresh one: its counts are not what the tests above left
    with caplog.at_level(logging.WARNING, logger="elasticrun"):
        for i in range(10_000):
            driver.handle_frame(b"identity", b"garbage, long enough to hold a MAC: %d" % i)
        driver.flush_counts()
    driver.close()
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


def test_a_pending_handover_asks_for_a_durable_copy_at_once(caplog):
    """Every holder of the state is leaving (SIGTERM, a draining notice) and no newcomer can take
    it over: with --checkpoint-dir the driver asks for a copy of the newest commit then, not at
    the next --checkpoint-interval, so that losing them costs no training."""
    from elasticrun.common.events import Kind
    from elasticrun.driver import registry as reg
    from elasticrun.driver.durable.decisions import CopySchedule

    d = _driver()
    try:
        published = []
        d._publish = lambda type_, body: published.append((type_, body))  # type: ignore[method-assign]
        d._copies = CopySchedule(interval=3600.0)
        d._copies.request(0.0)  # the round's first copy was asked for a moment ago: none is due
        d.registry.round = 0  # a round trains
        with caplog.at_level(logging.WARNING, logger="elasticrun"):
            d._execute([reg.Event(Kind.HANDOVER_PENDING, {"hosts": ["b"]})])
        assert published == [("durable_request", {"id": 2})]
        assert "asking for a durable copy of the newest commit now" in caplog.text
        d._copies = None  # without --checkpoint-dir: nothing to ask
        published.clear()
        d._execute([reg.Event(Kind.HANDOVER_PENDING, {"hosts": ["b"]})])
        assert published == []
    finally:
        d.close()
