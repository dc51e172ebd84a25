"""The driver's rendezvous key/value store (pure): blocking reads become waiters."""

import base64

import pytest

from elasticrun.driver.kvstore import KVStore

pytestmark = pytest.mark.timeout(30)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_get_waits_until_set_and_wait_expires_naming_the_key():
    kv = KVStore()
    assert kv.handle("g", {"op": "get", "key": "round1/a", "timeout": 5}, now=0) == []
    replies = kv.handle("s", {"op": "set", "key": "round1/a", "value": b64("x")}, now=1)
    assert replies == [("s", "store_result", {}), ("g", "store_result", {"value": b64("x")})]
    assert kv.handle("w", {"op": "wait", "keys": ["round1/b"], "timeout": 2}, now=1) == []
    assert kv.expire(now=2.5) == []  # deadline is 1 + 2 s
    assert kv.expire(now=3.0) == [("w", "store_error", {"error": "timed out waiting for keys round1/b"})]


def test_keep_only_drops_old_rounds_keys_and_waiters():
    kv = KVStore()
    kv.handle("s0", {"op": "set", "key": "round0/a", "value": b64("old")}, now=0)
    kv.handle("s1", {"op": "set", "key": "round1/a", "value": b64("new")}, now=0)
    kv.handle("g0", {"op": "get", "key": "round0/missing", "timeout": 5}, now=0)
    kv.handle("g1", {"op": "get", "key": "round1/missing", "timeout": 5}, now=0)
    kv.keep_only("round1/")
    assert set(kv.data) == {"round1/a"}
    assert [token for token, _, _ in kv.expire(now=10)] == ["g1"]  # round 0's waiter is gone


def test_malformed_and_unknown_operations_are_errors_not_crashes():
    kv = KVStore()
    assert kv.handle("t", {"op": "set"}, now=0)[0][1] == "store_error"
    assert kv.handle("t", {"op": "explode"}, now=0) == [("t", "store_error", {"error": "unknown store operation 'explode'"})]
