"""Unit tests for elasticrun.worker.sampler.ElasticSampler.

The property tests simulate every rank of an elastic job in one process: ranks iterate
their partitions in lockstep through a BatchSampler (as a DataLoader would), record their
batches, and at resizes, commits and failures the processed sets are merged, saved and
restored the way the TorchState handler does it.
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader

from elasticrun.worker import sampler as sampler_mod
from elasticrun.worker.sampler import ElasticSampler

pytestmark = pytest.mark.timeout(60)


def make(n: int, rank: int, size: int, **kwargs) -> ElasticSampler:
    return ElasticSampler(range(n), world=lambda: (rank, size), **kwargs)


def ranks(n: int, size: int, state: dict | None = None, **kwargs) -> list[ElasticSampler]:
    """One sampler per rank of a world of ``size``, synced to ``state`` (as a broadcast would)."""
    out = [make(n, r, size, **kwargs) for r in range(size)]
    if state is not None:
        for s in out:
            s.load_state_dict(state)
    return out


def merge(samplers: list[ElasticSampler]) -> dict:
    """Allgather + union of the processed sets, as TorchState does before save/sync."""
    gathered = [s.state_dict()["processed_indices"] for s in samplers]
    for s in samplers:
        for part in gathered:
            s.merge_processed(part)
    states = [s.state_dict() for s in samplers]
    assert all(st_ == states[0] for st_ in states)
    return states[0]


# --------------------------------------------------------------------------- partition


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 3, 7, 12, 60, 61])
@pytest.mark.parametrize("shuffle", [False, True])
def test_partition_padding(size: int, n: int, shuffle: bool) -> None:
    parts = [list(s) for s in ranks(n, size, shuffle=shuffle)]
    lengths = {len(p) for p in parts}
    assert len(lengths) == 1  # lockstep: equal lengths
    flat = [i for p in parts for i in p]
    assert set(flat) == set(range(n))  # everything assigned
    assert len(flat) == -(-n // size) * size  # only the documented padding is extra
    for p in parts:
        assert len(p) == len(set(p))  # no rank gets an index twice


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n", [0, 1, 3, 7, 12, 60, 61])
def test_partition_drop_last(size: int, n: int) -> None:
    parts = [list(s) for s in ranks(n, size, drop_last=True)]
    assert len({len(p) for p in parts}) == 1
    flat = [i for p in parts for i in p]
    assert len(flat) == len(set(flat)) == n - n % size  # disjoint, only the tail dropped


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_partition_covers_only_remaining(size: int, drop_last: bool) -> None:
    n, done = 23, {0, 5, 6, 9, 22}
    state = {"epoch": 0, "processed_indices": sorted(done)}
    parts = [list(s) for s in ranks(n, size, state, drop_last=drop_last)]
    assert len({len(p) for p in parts}) == 1
    flat = set(i for p in parts for i in p)
    assert not flat & done
    left = n - len(done)
    assert len(flat) == (left - left % size if drop_last else left)


def test_padding_when_fewer_remaining_than_ranks() -> None:
    state = {"epoch": 0, "processed_indices": list(range(1, 10))}
    parts = [list(s) for s in ranks(10, 4, state)]
    assert parts == [[0]] * 4
    assert [list(s) for s in ranks(10, 4, state, drop_last=True)] == [[]] * 4


# --------------------------------------------------------------------------- exactly once


@dataclass
class Segment:
    size: int  # world size during this segment
    batches: int  # lockstep batches to run (capped by what is left)
    commit_every: int  # commit after every this many batches (0: never)
    fail: bool  # end with a HorovodInternalError (else a graceful resize)


@dataclass
class Run:
    trained: list[int] = field(default_factory=list)  # everything ever trained
    committed: list[int] = field(default_factory=list)  # trained in committed work
    padding: int = 0  # padded samples handed out over all resets


def simulate(n: int, batch_size: int, segments: list[Segment], **kwargs) -> Run:
    """Run one epoch through ``segments``, then finish it on a single rank."""
    run = Run()
    committed_state = make(n, 0, 1, **kwargs).state_dict()
    live_state = committed_state
    pending: list[int] = []  # trained since the last commit

    def commit(samplers: list[ElasticSampler]) -> dict:
        nonlocal pending
        state = merge(samplers)
        run.committed += pending
        pending = []
        # The committed processed set is exactly the committed history.
        assert set(state["processed_indices"]) == set(run.committed)
        return state

    # Surviving ranks keep their sampler objects (restored in place, as TorchState does);
    # new ranks start fresh and receive the state by broadcast. ``worlds`` holds the
    # mutable (rank, size) each sampler's provider reads.
    samplers: list[ElasticSampler] = []
    worlds: list[list[int]] = []
    for seg in [*segments, Segment(1, 10**9, 0, False)]:
        del samplers[seg.size :], worlds[seg.size :]
        for r in range(len(samplers), seg.size):
            worlds.append([r, seg.size])
            provider = lambda w=worlds[r]: (w[0], w[1])  # noqa: E731
            samplers.append(ElasticSampler(range(n), world=provider, **kwargs))
        for w in worlds:
            w[1] = seg.size
        for s in samplers:
            s.load_state_dict(live_state)
        left = n - len(live_state["processed_indices"])
        run.padding += sum(len(s) for s in samplers) - left
        assert len({len(s) for s in samplers}) == 1
        loaders = [iter(BatchSampler(s, batch_size, drop_last=False)) for s in samplers]
        for b in range(seg.batches):
            batches = [next(it, None) for it in loaders]
            if batches[0] is None:
                assert all(x is None for x in batches)  # lockstep
                break
            for s, batch in zip(samplers, batches):
                run.trained += batch
                pending += batch
                s.record_batch(b, batch_size)
            if seg.commit_every and (b + 1) % seg.commit_every == 0:
                committed_state = commit(samplers)
        if seg.fail:
            pending = []  # work since the commit is lost and will be redone
            live_state = committed_state
        else:
            live_state = merge(samplers)
    committed_state = commit(samplers)
    assert set(committed_state["processed_indices"]) == set(range(n))
    return run


segment = st.builds(
    Segment,
    size=st.integers(1, 5),
    batches=st.integers(0, 8),
    commit_every=st.integers(0, 3),
    fail=st.booleans(),
)
graceful = st.builds(Segment, size=st.integers(1, 5), batches=st.integers(0, 8),
                     commit_every=st.just(0), fail=st.just(False))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 40), batch_size=st.integers(1, 4), shuffle=st.booleans(),
       segments=st.lists(graceful, max_size=6))
def test_exactly_once_across_resizes(n, batch_size, shuffle, segments) -> None:
    run = simulate(n, batch_size, segments, shuffle=shuffle, drop_last=True)
    assert sorted(run.trained) == list(range(n))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 40), batch_size=st.integers(1, 4), shuffle=st.booleans(),
       segments=st.lists(segment, max_size=6))
def test_committed_history_exactly_once_with_failures(n, batch_size, shuffle, segments) -> None:
    run = simulate(n, batch_size, segments, shuffle=shuffle, drop_last=True)
    assert sorted(run.committed) == list(range(n))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 40), batch_size=st.integers(1, 4),
       segments=st.lists(graceful, max_size=6))
def test_padding_only_duplicates_padded_samples(n, batch_size, segments) -> None:
    run = simulate(n, batch_size, segments)
    assert set(run.trained) == set(range(n))
    assert len(run.trained) - n <= run.padding
    if run.padding == 0:
        assert sorted(run.trained) == list(range(n))


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
def test_padding_default_exactly_once_when_divisible(size: int) -> None:
    # 60 divides by every size tried, so an epoch without mid-epoch resets needs no padding.
    run = simulate(60, 4, [Segment(size, 10**9, 2, False)])
    assert run.padding == 0
    assert sorted(run.trained) == list(range(60))


# --------------------------------------------------------------------------- iteration


def test_iteration_resumes_after_recorded_batches() -> None:
    s = make(20, 1, 2, shuffle=False)
    assert list(s) == list(range(1, 20, 2)) and len(s) == 10
    s.record_batch(0, 3)
    assert s.processed_indices == {1, 3, 5}
    assert list(s) == [7, 9, 11, 13, 15, 17, 19] and len(s) == 7
    # A new pass numbers its batches from its own start.
    assert s.get_indices(0, 3) == [7, 9, 11]
    s.record_batch(1, 3)  # out of order: does not move the resume point yet
    assert len(s) == 7
    s.record_batch(0, 3)
    assert list(s) == [19] and len(s) == 1
    s.reset()  # repartition what is left over the world
    assert len(s) == 6 and not set(s) & s.processed_indices


def test_works_with_dataloader() -> None:
    s = make(10, 0, 1, shuffle=False)
    loader = DataLoader(torch.arange(10) * 10, batch_size=4, sampler=s)
    for b, batch in enumerate(loader):
        assert batch.tolist() == [10 * i for i in s.get_indices(b, 4)]
        s.record_batch(b, 4)
        if b == 0:
            break
    assert [batch.tolist() for batch in loader] == [[40, 50, 60, 70], [80, 90]]


def test_reset_rereads_world() -> None:
    world = [0, 1]
    s = ElasticSampler(range(12), shuffle=False, world=lambda: tuple(world))
    s.record_batch(0, 4)
    world[:] = [2, 4]
    s.reset()
    assert (s.rank, s.num_replicas) == (2, 4)
    assert list(s) == [6, 10]


def test_default_world_provider_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_mod, "_world_provider", lambda: (1, 2))
    s = ElasticSampler(range(4), shuffle=False)
    assert (s.rank, s.num_replicas) == (1, 2) and list(s) == [1, 3]


def test_invalid_input_is_refused() -> None:
    with pytest.raises(ValueError):
        make(4, 2, 2)
    s = make(4, 0, 1)
    with pytest.raises(ValueError):
        s.record_indices([4])
    with pytest.raises(ValueError):
        s.load_state_dict({"epoch": 1, "processed_indices": [-1]})
    assert s.epoch == 0  # a refused state leaves the sampler unchanged


# --------------------------------------------------------------------------- shuffling


def test_shuffle_is_deterministic_per_seed_and_epoch() -> None:
    n = 50
    order = list(make(n, 0, 1, seed=7))
    assert sorted(order) == list(range(n)) and order != list(range(n))
    assert list(make(n, 0, 1, seed=7)) == order
    # Every rank of a larger world sees the same epoch order, rank r taking order[r::size].
    for size in (2, 5):
        for r, s in enumerate(ranks(n, size, seed=7)):
            assert list(s) == order[r::size]
    assert list(make(n, 0, 1, seed=8)) != order
    s = make(n, 0, 1, seed=7)
    s.set_epoch(1)
    assert list(s) != order and sorted(s) == list(range(n))
    assert list(make(n, 0, 1, shuffle=False)) == list(range(n))


def test_set_epoch_clears_progress() -> None:
    s = make(10, 0, 1)
    s.record_batch(0, 5)
    s.set_epoch(3)
    assert s.epoch == 3 and s.processed_indices == set() and len(s) == 10


# --------------------------------------------------------------------------- state


def test_state_dict_round_trip() -> None:
    s = make(30, 1, 3, seed=4)
    s.set_epoch(2)
    s.record_batch(0, 4)
    s.record_indices([0, 29])
    state = pickle.loads(pickle.dumps(s.state_dict()))
    assert state == {"epoch": 2, "processed_indices": sorted(s.processed_indices)}
    assert all(type(i) is int for i in state["processed_indices"])

    t = make(30, 1, 3, seed=4)
    t.load_state_dict(state)
    assert t.epoch == 2 and t.processed_indices == s.processed_indices
    s.reset()
    assert list(t) == list(s)
    # The loaded set is a copy: recording later does not change the saved state.
    before = list(state["processed_indices"])
    t.record_indices(range(30))
    assert state["processed_indices"] == before


def test_the_length_of_a_pass_stays_fixed_while_its_batches_are_recorded() -> None:
    """Horovod's imagenet elastic example warms its learning rate up with
    ``epoch + (batch_idx + 1) / len(train_loader)`` at every step: the length must be the pass's,
    as Horovod's ``num_samples`` is, not what is left of it (that ran the warmup ahead: 6/5
    instead of 6/10 at batch 5)."""
    s = make(40, 1, 2, shuffle=False)
    loader = DataLoader(torch.arange(40), batch_size=2, sampler=s)
    fractions = []
    for b, _ in enumerate(loader):
        fractions.append((b + 1) / len(loader))
        s.record_batch(b, 2)
    assert fractions == [(b + 1) / 10 for b in range(10)]
    s.merge_processed(range(0, 40, 2))  # the other rank's, as a commit merges them
    s.reset()  # (a reset after the epoch: nothing is left of it, and no pass repeats it)
    assert len(s) == 0 and list(s) == []


def test_a_pass_after_the_whole_epoch_was_recorded_without_set_epoch_repeats_it(caplog) -> None:
    """As Horovod's sampler and torch's DistributedSampler do: a script that forgets
    set_epoch() trains each epoch on the same samples, said once, never on none at all."""
    s = make(20, 0, 2, shuffle=False)
    for b, _ in enumerate(DataLoader(torch.arange(20), batch_size=5, sampler=s)):
        s.record_batch(b, 5)
    with caplog.at_level(logging.WARNING, logger="elasticrun.worker"):
        again = [list(batch) for batch in DataLoader(torch.arange(20), batch_size=5, sampler=s)]
        third = list(s)
    assert sum(again, []) == list(range(0, 20, 2)) == third
    assert len([r for r in caplog.records if "without set_epoch()" in r.getMessage()]) == 1
    assert s.get_indices(1, 5) == [10, 12, 14, 16, 18]  # its batches number from its own start
    s.set_epoch(1)
    assert list(s) == list(range(0, 20, 2))  # a new epoch: a new pass, no warning
    assert len([r for r in caplog.records if "without set_epoch()" in r.getMessage()]) == 1


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_horovod_samplers_state_dict_resumes_where_that_job_stopped(shuffle: bool) -> None:
    """Horovod's ElasticSampler saves ``{"epoch", "processed_num"}``: the first processed_num
    indices of its epoch order (``random.Random(seed + epoch).shuffle``). A script resuming from
    a checkpoint a Horovod job saved must train the rest of that epoch, each sample once."""
    import random

    s = make(40, 1, 4, seed=7, shuffle=shuffle)
    s.load_state_dict({"epoch": 3, "processed_num": 12})
    horovod_order = list(range(40))
    if shuffle:
        random.Random(7 + 3).shuffle(horovod_order)
    assert s.epoch == 3 and s.processed_indices == set(horovod_order[:12])
    assert sorted(s.remaining_indices) == sorted(horovod_order[12:])
    assert s.num_samples == len(s) == 7 and s.total_size == 28  # Horovod's attributes: 28 left over 4 ranks


def test_horovods_sampler_attributes() -> None:
    s = make(10, 0, 3)
    assert (s.num_samples, s.total_size) == (4, 12)  # 10 padded to 12 over 3 ranks
