"""The watch behind a newcomer's fetch (worker/prefetch.py): while it is set, a commit
writes only what differs from the committed copy and names it; a tensor it does not name
still holds the bytes a newcomer read. And the saves a sync that skipped tensors makes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from elasticrun.worker import copier
from elasticrun.worker.copier import Watch, same_bytes
from elasticrun.worker.state_handlers import ModelStateHandler

pytestmark = pytest.mark.timeout(60)


BIG = copier.MEMMOVE_MAX_BYTES // 4 + 1000  # float32 elements: compared, not just copied


def model() -> nn.Module:
    m = nn.Linear(4, 3)
    m.register_buffer("ballast", torch.randn(BIG))
    m.register_buffer("big", torch.randn(BIG))
    return m


SMALL = {"weight", "bias"}  # copied and named at every watched commit: cheaper to send again than to compare


# --------------------------------------------------------------------------- same_bytes


def test_same_bytes_compares_bytes_not_values() -> None:
    a = torch.tensor([1.0, float("nan"), 0.0])
    assert same_bytes(a, a.clone())  # NaN is itself, byte for byte
    b = a.clone()
    b[2] = -0.0
    assert not same_bytes(a, b)  # == says equal; a copy would change the bytes
    assert not same_bytes(a, a.to(torch.float64))
    assert not same_bytes(torch.randn(4, 4), torch.randn(4, 4).t())  # not contiguous: never "same"
    assert same_bytes(torch.empty(0), torch.empty(0))


def test_same_bytes_over_many_slices_finds_a_difference_in_the_last() -> None:
    n = (copier._CMP_SLICE * 2 + 4096) // 4  # three slices, the last short
    a = torch.zeros(n)
    b = a.clone()
    assert same_bytes(a, b)
    b[-1] = 1
    assert not same_bytes(a, b)


# --------------------------------------------------------------------------- the model's watch


def test_a_watched_commit_names_only_what_it_wrote() -> None:
    m = model()
    h = ModelStateHandler(m)
    epoch, offered = h.watch(7)
    assert epoch == 7 and [n for n, _ in offered] == ["weight", "bias", "ballast", "big"]
    committed = {n: b for n, b in offered}
    ballast_before = committed["ballast"].clone()
    with torch.no_grad():
        m.weight.add_(1)
        m.big[-1] += 1  # the last byte only: the whole tensor is compared
    h.save()
    assert torch.equal(committed["weight"], m.weight) and torch.equal(committed["big"], m.big)  # still a commit
    assert torch.equal(committed["ballast"], ballast_before)
    watch = h.end_watch()
    assert watch is not None and watch.changed == SMALL | {"big"} and not watch.everything
    assert watch.unchanged(watch.names) == ["ballast"]
    assert h.end_watch() is None


def test_a_second_fetch_goes_on_with_the_watch_under_way() -> None:
    m = model()
    h = ModelStateHandler(m)
    h.watch(1)
    with torch.no_grad():
        m.big.add_(1)
    h.save()
    epoch, _ = h.watch(2)  # a second newcomer: the same watch, what changed since the first still named
    assert epoch == 1
    watch = h.end_watch()
    assert watch is not None and watch.changed == SMALL | {"big"}


def test_a_commit_that_reallocates_its_buffers_marks_everything() -> None:
    m = model()
    h = ModelStateHandler(m)
    h.watch(1)
    m.weight = nn.Parameter(torch.randn(3, 4))  # a new tensor: the plan is rebuilt
    h.save()
    watch = h.end_watch()
    assert watch is not None and watch.everything and watch.unchanged(watch.names) == []


def test_a_watch_no_fetch_renewed_ends_at_a_later_commit(monkeypatch) -> None:
    m = model()
    h = ModelStateHandler(m)
    h.watch(1)
    monkeypatch.setattr(Watch, "LIFETIME_S", -1.0)
    h.save()
    assert h.end_watch() is None  # the next fetch starts a watch of its own


def test_background_commits_copy_everything_now_while_watched() -> None:
    m = model()
    h = ModelStateHandler(m)
    guarded = frozenset({id(m.weight), id(m.bias)})
    later = h.save_deferred(guarded)
    assert callable(later)  # unwatched: the parameters are copied later, on the commit thread
    later()
    h.watch(1)
    assert h.save_deferred(guarded) is None  # watched: all of it now, compared as it goes
    watch = h.end_watch()
    assert watch is not None and watch.changed == SMALL


def test_a_background_copy_queued_before_the_watch_names_what_it_copies() -> None:
    m = model()
    h = ModelStateHandler(m)
    guarded = frozenset({id(m.weight), id(m.bias)})
    with torch.no_grad():
        m.weight.add_(1)
    later = h.save_deferred(guarded)  # queued, not run yet
    h.watch(1)  # a fetch begins and reads the committed weight: not yet this commit's
    assert callable(later)
    later()
    watch = h.end_watch()
    assert watch is not None and {"weight", "bias"} <= watch.changed


def test_a_save_after_a_skipping_sync_copies_only_the_rest() -> None:
    m = model()
    h = ModelStateHandler(m)
    _, offered = h.watch(1)
    h.end_watch()
    committed = dict(offered)
    old_ballast = committed["ballast"].clone()
    with torch.no_grad():
        m.ballast.add_(1)  # (a sync would never leave a kept tensor different: this shows it is not copied)
        m.weight.add_(1)
    h.save(keep=frozenset({"ballast"}))
    assert torch.equal(committed["weight"], m.weight)
    assert torch.equal(committed["ballast"], old_ballast)
