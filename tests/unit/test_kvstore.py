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
    assert kv.keep_only("round1/") == [("g0", "store_error", {"error": "forgotten: the round of keys round0/missing is over"})]
    assert set(kv.data) == {"round1/a"}
    assert [token for token, _, _ in kv.expire(now=10)] == ["g1"]  # round 0's waiter was answered, not kept


def test_malformed_and_unknown_operations_are_errors_not_crashes():
    kv = KVStore()
    assert kv.handle("t", {"op": "set"}, now=0)[0][1] == "store_error"
    assert kv.handle("t", {"op": "explode"}, now=0) == [("t", "store_error", {"error": "unknown store operation 'explode'"})]


def test_a_read_with_a_prefix_brings_back_what_was_written_since_under_it():
    kv = KVStore()
    for rank in range(3):
        kv.handle("s", {"op": "set", "key": f"round1/0/{rank}", "value": b64(f"addr{rank}")}, now=0)
    kv.handle("s", {"op": "set", "key": "round1/other", "value": b64("x")}, now=0)
    [(_, _, body)] = kv.handle("w", {"op": "wait", "keys": ["round1/0/0"], "dir": "round1/0/", "since": 0}, now=0)
    assert body["snapshot"] == {f"round1/0/{r}": b64(f"addr{r}") for r in range(3)}
    # Only what is new since the last snapshot; a rewrite sends its newest value once.
    kv.handle("s", {"op": "set", "key": "round1/0/3", "value": b64("addr3")}, now=0)
    kv.handle("s", {"op": "set", "key": "round1/0/1", "value": b64("moved")}, now=0)
    [(_, _, again)] = kv.handle("g", {"op": "get", "key": "round1/0/3", "dir": "round1/0/", "since": body["seq"]},
                                now=0)
    assert again["value"] == b64("addr3")
    assert again["snapshot"] == {"round1/0/3": b64("addr3"), "round1/0/1": b64("moved")}
    [(_, _, none)] = kv.handle("g", {"op": "get", "key": "round1/0/3", "dir": "round1/0/", "since": again["seq"]},
                               now=0)
    assert none["snapshot"] == {} and none["seq"] >= again["seq"]
    # Without a prefix, replies are as before.
    assert kv.handle("g", {"op": "get", "key": "round1/0/3"}, now=0) == [("g", "store_result", {"value": b64("addr3")})]


def test_a_waiter_answered_later_gets_its_snapshot_then_and_deleted_keys_are_left_out():
    kv = KVStore()
    kv.handle("s", {"op": "set", "key": "r/0", "value": b64("a")}, now=0)
    kv.handle("s", {"op": "set", "key": "r/gone", "value": b64("b")}, now=0)
    kv.handle("d", {"op": "delete", "key": "r/gone"}, now=0)
    assert kv.handle("w", {"op": "wait", "keys": ["r/1"], "dir": "r/", "since": 0, "timeout": 5}, now=0) == []
    replies = kv.handle("s", {"op": "set", "key": "r/1", "value": b64("c")}, now=1)
    assert replies[1] == ("w", "store_result", {"snapshot": {"r/0": b64("a"), "r/1": b64("c")}, "seq": 3})


def test_a_snapshot_is_bounded_and_the_rest_comes_with_the_next_read():
    from elasticrun.driver.kvstore import SNAPSHOT_BYTES

    kv = KVStore()
    big = "x" * (SNAPSHOT_BYTES // 3)
    for i in range(5):
        kv.handle("s", {"op": "set", "key": f"r/{i}", "value": b64(big)}, now=0)
    seen: dict[str, str] = {}
    since, reads = 0, 0
    while len(seen) < 5:
        [(_, _, body)] = kv.handle("w", {"op": "wait", "keys": ["r/0"], "dir": "r/", "since": since}, now=0)
        assert sum(len(v) for v in body["snapshot"].values()) <= SNAPSHOT_BYTES
        seen.update(body["snapshot"])
        since, reads = body["seq"], reads + 1
    assert reads >= 2 and sorted(seen) == [f"r/{i}" for i in range(5)]


def test_compaction_keeps_snapshots_right_when_a_counter_is_rewritten_without_end():
    kv = KVStore()
    kv.handle("s", {"op": "set", "key": "r/addr", "value": b64("a")}, now=0)
    for _ in range(3000):
        kv.handle("a", {"op": "add", "key": "r/count", "amount": 1}, now=0)
    assert len(kv._order) <= 4 * len(kv.data) + 1024
    [(_, _, body)] = kv.handle("g", {"op": "get", "key": "r/addr", "dir": "r/", "since": 0}, now=0)
    assert body["snapshot"] == {"r/addr": b64("a"), "r/count": b64("3000")}


def test_several_keys_are_deleted_in_one_request():
    """A join's keys, as it ends: its news and the operations' descriptors, which otherwise
    grew the driver's memory for as long as the round lasted."""
    kv = KVStore()
    for n in range(5):
        kv.handle("s", {"op": "set", "key": f"round1/op{n}", "value": b64("x")}, now=0)
    assert kv.handle("d", {"op": "delete", "keys": ["round1/op1", "round1/op2", "round1/none", 7]}, now=0) == [
        ("d", "store_result", {"value": 2})]
    assert sorted(kv.data) == ["round1/op0", "round1/op3", "round1/op4"]
    assert kv.handle("d", {"op": "delete", "keys": 3}, now=0)[0][1] == "store_error"  # malformed, not a crash
