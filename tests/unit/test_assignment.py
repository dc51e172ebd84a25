"""Unit tests for elasticrun.driver.assignment.assign (rank/local/cross assignment)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.driver.assignment import SlotInfo, assign

pytestmark = pytest.mark.timeout(60)


def triples(infos):
    return [(i.host, i.slot, i.rank) for i in infos]


def test_empty_host_list():
    assert assign([], None) == []
    assert assign([], 4) == []


def test_single_host():
    out = assign([("a", 3)], None)
    assert out == [
        SlotInfo("a", 0, 0, 3, 0, 3, 0, 1),
        SlotInfo("a", 1, 1, 3, 1, 3, 0, 1),
        SlotInfo("a", 2, 2, 3, 2, 3, 0, 1),
    ]


def test_host_by_host_slot_by_slot_in_given_order():
    out = assign([("b", 2), ("a", 1), ("c", 2)], None)
    assert triples(out) == [("b", 0, 0), ("b", 1, 1), ("a", 0, 2), ("c", 0, 3), ("c", 1, 4)]
    assert {i.size for i in out} == {5}


def test_local_size_per_host():
    out = assign([("a", 2), ("b", 3)], None)
    assert [i.local_size for i in out] == [2, 2, 3, 3, 3]
    assert all(i.local_rank == i.slot for i in out)


def test_cross_rank_and_size_uneven_hosts():
    out = {i.key: i for i in assign([("a", 2), ("b", 1), ("c", 3)], None)}
    # local rank 0 exists on a, b, c; local rank 1 on a, c; local rank 2 only on c.
    assert (out["a", 0].cross_rank, out["a", 0].cross_size) == (0, 3)
    assert (out["b", 0].cross_rank, out["b", 0].cross_size) == (1, 3)
    assert (out["c", 0].cross_rank, out["c", 0].cross_size) == (2, 3)
    assert (out["a", 1].cross_rank, out["a", 1].cross_size) == (0, 2)
    assert (out["c", 1].cross_rank, out["c", 1].cross_size) == (1, 2)
    assert (out["c", 2].cross_rank, out["c", 2].cross_size) == (0, 1)


def test_max_np_truncates_mid_host():
    out = assign([("a", 2), ("b", 2), ("c", 2)], 3)
    assert triples(out) == [("a", 0, 0), ("a", 1, 1), ("b", 0, 2)]
    assert all(i.size == 3 for i in out)
    b0 = out[2]
    # b's local_size reflects the truncated count, and cross sizes only count used workers.
    assert (b0.local_size, b0.cross_rank, b0.cross_size) == (1, 1, 2)
    assert (out[1].cross_rank, out[1].cross_size) == (0, 1)


def test_max_np_at_host_boundary_drops_later_hosts():
    out = assign([("a", 2), ("b", 2)], 2)
    assert triples(out) == [("a", 0, 0), ("a", 1, 1)]
    assert out[0].cross_size == 1


def test_max_np_larger_than_total():
    assert len(assign([("a", 2), ("b", 1)], 100)) == 3


def test_max_np_zero():
    assert assign([("a", 2)], 0) == []


def test_as_dict_and_key():
    info = assign([("a", 1), ("b", 2)], None)[2]
    assert info.key == ("b", 1)
    assert info.as_dict() == {"host": "b", "slot": 1, "rank": 2, "size": 3, "local_rank": 1,
                              "local_size": 2, "cross_rank": 0, "cross_size": 1, "homogeneous": False}


hosts_lists = st.lists(st.integers(1, 6), max_size=8).map(lambda slots: [(f"h{i}", s) for i, s in enumerate(slots)])
# Host order must not depend on names: shuffle the names independently of the order.
shuffled_hosts = st.lists(st.integers(1, 6), max_size=8).flatmap(
    lambda slots: st.permutations([f"host{i}" for i in range(len(slots))]).map(
        lambda names: list(zip(names, slots))))


@given(hosts=st.one_of(hosts_lists, shuffled_hosts), max_np=st.one_of(st.none(), st.integers(0, 40)))
@settings(max_examples=400)
def test_property(hosts, max_np):
    out = assign(hosts, max_np)
    total = sum(s for _, s in hosts)
    size = total if max_np is None else min(total, max_np)

    # Ranks contiguous 0..size-1 and every worker knows the size.
    assert [i.rank for i in out] == list(range(size))
    assert all(i.size == size for i in out)

    # Host by host in the given order, slot by slot, filling a prefix of the host list.
    expected_keys = [(h, s) for h, n in hosts for s in range(n)][:size]
    assert [i.key for i in out] == expected_keys

    used = {}
    for i in out:
        used[i.host] = used.get(i.host, 0) + 1
    for i in out:
        assert i.local_rank == i.slot
        assert i.local_size == used[i.host]
        assert 0 <= i.slot < i.local_size

    # cross_size = hosts with a worker at this local rank; cross_rank = index among them (in order).
    used_order = list(dict.fromkeys(i.host for i in out))
    for i in out:
        peers = [h for h in used_order if used[h] > i.local_rank]
        assert i.cross_size == len(peers)
        assert i.cross_rank == peers.index(i.host)

    # (cross_rank, local_rank) is unique, and cross ranks at each local rank are 0..cross_size-1.
    by_local: dict[int, list[int]] = {}
    for i in out:
        by_local.setdefault(i.local_rank, []).append(i.cross_rank)
    for ranks in by_local.values():
        assert sorted(ranks) == list(range(len(ranks)))


@given(hosts=hosts_lists, extra=st.integers(1, 6), max_np=st.one_of(st.none(), st.integers(1, 40)))
def test_property_appending_a_host_keeps_existing_places(hosts, extra, max_np):
    """Survivors first: adding a host at the end never moves an existing worker's (host, slot, rank)."""
    before = {i.key: i.rank for i in assign(hosts, max_np)}
    after = {i.key: i.rank for i in assign(hosts + [("new", extra)], max_np)}
    for key, rank in before.items():
        assert after[key] == rank


def test_a_workers_local_rank_is_its_slot_also_in_a_round_that_lacks_the_lower_slots():
    """A round formed before slot 0's newcomer is ready: the slot-1 worker is local rank 1 then
    and later (a GPU script's set_device(hvd.local_rank()) and the driver's slot GPU agree)."""
    from elasticrun.driver.assignment import assign_keys

    (only,) = assign_keys([("a", 1)])
    assert (only.local_rank, only.local_size, only.cross_rank, only.cross_size) == (1, 2, 0, 1)
    later = {i.slot: i for i in assign_keys([("a", 1), ("a", 0), ("b", 1)])}
    assert later[1].local_rank == 1 and later[0].local_rank == 0 and later[1].local_size == 2
    b1 = next(i for i in assign_keys([("a", 1), ("a", 0), ("b", 1)]) if i.host == "b")
    assert (b1.local_rank, b1.local_size, b1.cross_rank, b1.cross_size) == (1, 2, 1, 2)


def test_a_round_is_homogeneous_when_every_host_has_as_many_places():
    assert all(i.homogeneous for i in assign([("a", 2), ("b", 2)], None))
    assert not any(i.homogeneous for i in assign([("a", 2), ("b", 1)], None))
    assert not any(i.homogeneous for i in assign([("a", 2), ("b", 2)], 3))  # max_np cuts b to 1 place
    assert all(i.homogeneous for i in assign([("a", 3)], None))
