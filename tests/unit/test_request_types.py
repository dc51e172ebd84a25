"""Request bodies read into typed requests (driver/request_types.py): any body, from a worker
that holds the job's key but may send anything, gives bounded typed fields and never raises."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticrun.driver import request_types as rt

pytestmark = pytest.mark.timeout(60)

values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=3000),
                      lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5),
                      max_leaves=20)
bodies = st.dictionaries(st.sampled_from(["worker", "steps", "commit", "pace", "bye", "error", "restored",
                                          "has_state", "gpus", "why", "req", "waiting", "stalled", "in",
                                          "until"])
                         | st.text(max_size=5), values)


@given(bodies)
def test_any_body_gives_typed_bounded_fields(body):
    hb = rt.Heartbeat.parse(body)
    assert isinstance(hb.worker, str) and len(hb.worker) <= 200
    assert hb.steps is None or (isinstance(hb.steps, int) and not isinstance(hb.steps, bool))
    assert hb.bye is None or len(hb.bye) <= 20
    assert hb.waiting is None or (isinstance(hb.waiting, float) and hb.waiting >= 0)
    assert isinstance(hb.stalled, bool) and (hb.waiting is not None or not hb.stalled)
    assert hb.op is None or (isinstance(hb.op, str) and 0 < len(hb.op) <= 80 and hb.stalled)
    assert hb.until is None or (isinstance(hb.until, str) and 0 < len(hb.until) <= 60 and hb.stalled)
    r = rt.Rendezvous.parse(body)
    assert r.error is None or len(r.error) <= 300
    assert isinstance(r.restored, bool) and isinstance(r.has_state, bool)
    assert len(r.gpus) <= 1024 and all(isinstance(g, str) and len(g) <= 100 for g in r.gpus)
    for limit in (100, 500, 1000):
        assert len(rt.Report.parse(body, "why", "SIGTERM", limit).text) <= limit


def test_well_formed_bodies_keep_their_values():
    hb = rt.Heartbeat.parse({"worker": "w3", "steps": 12, "commit": 4, "bye": "exit",
                             "pace": {"round": 1, "steps": 5, "step": 0.1, "wait": 0.01, "compute": 0.09}})
    assert (hb.worker, hb.steps, hb.commit, hb.bye) == ("w3", 12, 4, "exit") and hb.pace is not None
    assert rt.Heartbeat.parse({"worker": "w3", "steps": True}).steps is None  # a bool is no count
    hb = rt.Heartbeat.parse({"worker": "w3", "waiting": 61.5, "stalled": True})
    assert (hb.waiting, hb.stalled) == (61.5, True)
    assert rt.Heartbeat.parse({"worker": "w3"}).waiting is None
    for bad in (-1, float("nan"), float("inf"), "61", True, [1]):  # no wait: and so never stalled
        hb = rt.Heartbeat.parse({"worker": "w3", "waiting": bad, "stalled": True})
        assert (hb.waiting, hb.stalled) == (None, False)
    assert rt.Heartbeat.parse({"worker": "w3", "waiting": 3, "stalled": "yes"}).stalled is False
    hb = rt.Heartbeat.parse({"worker": "w3", "waiting": 61.5, "stalled": True, "in": "allreduce loss" + "x" * 100})
    assert hb.op == ("allreduce loss" + "x" * 100)[:80]
    assert rt.Heartbeat.parse({"worker": "w3", "waiting": 1.5, "in": "allreduce loss"}).op is None  # not stalled
    r = rt.Rendezvous.parse({"worker": "w1", "error": "peer died", "restored": True, "gpus": ["GPU-1"]})
    assert r == rt.Rendezvous("w1", "peer died", True, False, ("GPU-1",))
    assert rt.Rendezvous.parse({"worker": "w1", "restored": "yes"}).restored is False  # only true is true
    assert rt.Report.parse({"worker": "w2"}, "why", "SIGTERM", 100) == rt.Report("w2", "SIGTERM")
