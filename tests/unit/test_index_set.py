"""elasticrun.worker.index_set: a sampler's processed set as one byte per sample.

Every whole-set step works in slices (so that no single call holds the GIL over millions of
indices); these tests shrink the slices so that a small set crosses many of them, and compare
every operation with a plain ``set``."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.worker import index_set
from elasticrun.worker.index_set import IndexSet, Records, to_list
from elasticrun.worker.sampler import ElasticSampler
from elasticrun.worker.state_handlers import SamplerStateHandler

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def small_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_set, "SLICE", 7)
    monkeypatch.setattr(index_set, "SMALL", 5)
    monkeypatch.setattr(Records, "FOLD", 11)


N = 61
ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, N - 1)),
    st.tuples(st.just("discard"), st.integers(-2, N + 2)),
    st.tuples(st.just("update"), st.lists(st.integers(0, N - 1), max_size=30)),
    st.tuples(st.just("put"), st.lists(st.integers(0, N - 1), max_size=30)),
    st.tuples(st.just("ior"), st.sets(st.integers(0, N - 1), max_size=30)),
    st.tuples(st.just("clear"), st.none()),
), max_size=25)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_it_is_a_set_of_the_indices(steps: list) -> None:
    s, model = IndexSet(N), set()
    for op, arg in steps:
        if op == "add":
            s.add(arg)
            model.add(arg)
        elif op == "discard":
            s.discard(arg)
            model.discard(arg)
        elif op == "update":
            s.update(arg, iter(arg[:3]))
            model.update(arg)
        elif op == "put":
            assert s.put(arg) == len(set(arg) - model)
            model.update(arg)
        elif op == "ior":
            s |= arg
            model |= arg
        else:
            s.clear()
            model.clear()
        assert len(s) == len(model) and s == model and model == s
        assert list(s) == sorted(model) == s.sorted_list()
        assert all((i in s) == (i in model) for i in range(-3, N + 3))
    again = pickle.loads(pickle.dumps(s))
    assert again == s and again is not s and IndexSet.unpacked(N, s.packed()) == s
    c = s.copy()
    c.add(0)
    c.discard(1)
    assert s == model  # a copy is independent
    other = IndexSet(N, range(0, N, 3))
    assert s.minus(other) == sorted(model - set(range(0, N, 3)))
    assert s.issubset_of(other) == (model <= set(range(0, N, 3)))
    order = torch.randperm(N)
    assert order[s.keep_mask(order)].tolist() == [i for i in order.tolist() if i not in model]
    assert (s & {1, 2, 3}) == (model & {1, 2, 3}) and (s | {70}) == (model | {70})


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 65])
def test_packing_round_trips_at_every_length(n: int) -> None:
    for members in (set(), set(range(n)), set(range(0, n, 3)), {n - 1} if n else set()):
        s = IndexSet(n, members)
        assert len(s.packed()) == -(-n // 8)
        back = IndexSet.unpacked(n, s.packed())
        assert back == members and len(back) == len(members)
    with pytest.raises(ValueError, match="bytes for a set of"):
        IndexSet.unpacked(n, b"\0" * (-(-n // 8) + 1))


@pytest.mark.parametrize("bad", [[-1], [N], [3, 4, 5, 6, 7, 8, N + 5], list(range(20)) + [-4]])
def test_an_index_out_of_range_is_refused_and_adds_nothing(bad: list[int]) -> None:
    s = IndexSet(N, [1, 2])
    with pytest.raises(ValueError, match=f"indices out of range for a dataset of {N}"):
        s.put(bad)
    with pytest.raises(ValueError):
        s.update(iter(bad))
    assert s == {1, 2} and len(s) == 2


def test_only_changes_by_hand_count_as_edits() -> None:
    s = IndexSet(N)
    s.put([1, 2, 3])
    s.put_checked([4])
    assert s.edits == 0
    s.add(5)
    s.discard(5)
    s.discard(40)  # (not there: no change)
    s.update([6])
    s.clear()
    assert s.edits == 4


@pytest.mark.parametrize("given", [
    list(range(0, 40, 3)), tuple(range(12)), range(3, 50, 2), [3.0, 5, True, "7", 9, 11], iter(range(30)),
    torch.arange(0, 60, 4), torch.tensor([2.0, 4.0, 6.0, 8.0, 10.0, 12.0]), [], torch.zeros(0)])
def test_checked_int64_is_int_of_each_in_slices(given: object) -> None:
    """What a list comprehension of ``int(i)`` gave (floats, bools, numeric strings), as one
    int64 tensor built a slice at a time."""
    expected = [int(i) for i in (given.clone() if isinstance(given, torch.Tensor) else given)]  # type: ignore[attr-defined]
    if not isinstance(given, torch.Tensor) and not isinstance(given, (list, tuple, range)):
        given = iter(expected)
    t = index_set.checked_int64(given, N)  # type: ignore[arg-type]
    assert t.dtype == torch.int64 and t.tolist() == expected


@pytest.mark.parametrize("bad", [[1, 2, 3, 4, 5, 6, 7, 8, N], [-1] * 9, [1, 2, 3, 4, 5, 6, 7, 8, 2**70],
                                 torch.tensor([1, 2, -3])])
def test_checked_int64_refuses_an_index_out_of_range_by_name(bad: object) -> None:
    with pytest.raises(ValueError, match=f"indices out of range for a dataset of {N}: \\[(-|{N}|{2**70})"):
        index_set.checked_int64(bad, N)  # type: ignore[arg-type]


def test_a_sampler_merges_thousands_as_it_records_a_batch() -> None:
    """A merge of another rank's news (thousands: a tensor) and a batch's record (a list) leave
    the sampler, its records and its handler's news the same."""
    merged = ElasticSampler(range(N), shuffle=True, seed=3, world=lambda: (1, 3))
    batched = ElasticSampler(range(N), shuffle=True, seed=3, world=lambda: (1, 3))
    hm, hb = SamplerStateHandler(merged), SamplerStateHandler(batched)
    hm.save()
    hb.save()
    news = list(range(0, N, 2))
    merged.merge_processed(news)  # (over SMALL: a tensor)
    for i in news:
        batched.merge_processed([i])  # (one at a time: a list)
    assert merged.processed_indices == batched.processed_indices == set(news)
    assert hm.news() == hb.news() == (0, news)
    assert list(merged) == list(batched)
    with pytest.raises(ValueError, match="out of range"):
        merged.merge_processed(list(range(N - 3, N + 3)))
    assert merged.processed_indices == set(news)


def test_to_list_in_slices_is_tolist() -> None:
    t = torch.randperm(50)
    assert to_list(t) == t.tolist() and to_list(t[::3]) == t[::3].tolist() and to_list(t[:0]) == []


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, N - 1), max_size=9), st.booleans()), max_size=6),
       st.sets(st.integers(0, N - 1)))
def test_records_give_what_is_new_to_a_set_before_and_after_they_fold(records: list, done: set) -> None:
    """A record is a batch's list or (a merge of thousands) a tensor: both are what is new."""
    r = Records(N)
    parts = [p for p, _ in records]
    for p, as_tensor in records:
        r.add(torch.tensor(p, dtype=torch.int64) if as_tensor else p)
    recorded = {i for p in parts for i in p}
    assert r.absent_from(IndexSet(N, done)) == sorted(recorded - done)
    assert len(r) >= len(recorded)


def test_a_sampler_takes_in_a_plain_set_assigned_by_hand() -> None:
    """Scripts written for Horovod's sampler may assign ``processed_indices`` a set: the next
    reset takes it in, its handler sees the change, and a bad index is one clear error."""
    s = ElasticSampler(range(20), shuffle=False, world=lambda: (0, 2))
    h = SamplerStateHandler(s)
    s.processed_indices = {0, 1, 2, 3}
    assert h.news() == (0, [0, 1, 2, 3])
    s.reset()
    assert isinstance(s.processed_indices, IndexSet) and list(s) == list(range(4, 20, 2))
    assert s.state_dict() == {"epoch": 0, "processed_indices": [0, 1, 2, 3]}
    s.processed_indices = {25}
    with pytest.raises(ValueError, match="indices out of range for a dataset of 20: \\[25\\]"):
        s.reset()


def test_a_handlers_commits_and_restores_across_a_folded_record() -> None:
    """A script that commits once an epoch: its records fold into a bitmap, and the commit
    still saves exactly what was recorded, and a restore goes back to it."""
    s = ElasticSampler(range(N), shuffle=True, world=lambda: (1, 3))
    h = SamplerStateHandler(s)
    s.record_indices([5, 6])
    h.save()
    for b in range(4):
        s.record_batch(b, 4)
    recorded = {5, 6} | {i for b in range(4) for i in s.get_indices(b, 4)}
    assert s._recorded._mask is not None  # (16 recorded, past the shrunk FOLD of 11)
    assert h.news() == (0, sorted(recorded - {5, 6}))
    h.save()
    assert h._processed == recorded
    s.record_indices([0, 1, 2])
    h.restore()
    assert s.processed_indices == recorded and h.news() == (0, [])



def test_a_dataset_that_grows_between_epochs_is_followed() -> None:
    """A dataset appended to (its length read again at every reset and record): the processed
    set and the records grow with it, and the handler's next commit compares the whole set."""
    data = list(range(30))
    s = ElasticSampler(data, shuffle=False, world=lambda: (0, 1))
    h = SamplerStateHandler(s)
    s.record_indices([1, 2])
    h.save()
    data.extend(range(30, 50))
    s.record_indices([40, 3])
    assert s.processed_indices == {1, 2, 3, 40} and h.news() == (0, [3, 40])
    h.save()
    assert h._processed == {1, 2, 3, 40}
    s.reset()
    assert len(s) == 46
