"""Stragglers (issue 16): the workers' step measurements (``worker/pace.py``) and the driver's
pure decision (``driver/stragglers.py``), fed the way heartbeats feed them."""

from __future__ import annotations

import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.common.settings import STRAGGLER_WINDOW
from elasticrun.driver import words
from elasticrun.driver.stragglers import (
    HOLD,
    MIN_EXCESS,
    RATIO,
    REPEAT,
    Pace,
    StragglerDetector,
    eviction_pays,
    median_without,
)
from elasticrun.worker.pace import StepPace

pytestmark = pytest.mark.timeout(60)

W = STRAGGLER_WINDOW


def pace(compute: float, step: float | None = None, round_: int = 0, steps: int = W) -> Pace:
    step = max(step if step is not None else compute, compute)
    return Pace(round_, steps, step, step - compute, compute)


def feed(det: StragglerDetector, computes: dict[str, float], round_: int = 0, steps: int = W, at: float = 0.0):
    """One worker per host ``h`` (worker ``h/0``) reports; then one evaluation at time ``at``."""
    slowest = max(computes.values())
    for host, c in computes.items():
        det.report(f"{host}/0", host, pace(c, slowest + 0.001, round_, steps))
    return det.evaluate(round_, {f"{h}/0": h for h in computes}, at)


# --- the worker's measurements --------------------------------------------------------------
def run_steps(p: StepPace, steps: list[tuple[float, float]], t0: float = 100.0) -> float:
    """Record steps of (duration, wait) after a first step at ``t0``; return the clock."""
    t = t0
    p.record(t, 0.0)
    for duration, wait in steps:
        t += duration
        p.record(t, wait)
    return t


def test_the_first_step_of_a_round_only_starts_the_clock():
    p = StepPace()
    p.new_round(3)
    assert p.summary() is None
    p.record(1.0, 0.5)
    assert p.summary() is None  # the first step follows the sync: not a training step
    p.record(1.1, 0.02)
    s = p.summary()
    assert s["round"] == 3 and s["steps"] == 1
    assert s["step"] == pytest.approx(0.1) and s["wait"] == pytest.approx(0.02) and s["compute"] == pytest.approx(0.08)


def test_the_window_keeps_the_last_steps_and_a_new_round_starts_afresh():
    p = StepPace(window=4)
    p.new_round(0)
    run_steps(p, [(1.0, 0.0)] * 4 + [(0.1, 0.05)] * 4)
    s = p.summary()
    assert s["steps"] == 4 and s["step"] == pytest.approx(0.1) and s["compute"] == pytest.approx(0.05)
    p.new_round(1)
    assert p.summary() is None


def test_one_slow_step_moves_no_median():
    p = StepPace()
    p.new_round(0)
    run_steps(p, [(0.1, 0.06)] * (W - 1) + [(5.0, 0.0)])
    assert p.summary()["compute"] == pytest.approx(0.04)


def test_compute_is_the_median_of_step_minus_wait():
    """The slow rank waits little and computes long; the fast ones wait for it."""
    slow, fast = StepPace(), StepPace()
    for p in (slow, fast):
        p.new_round(0)
    run_steps(slow, [(0.25, 0.01)] * W)
    run_steps(fast, [(0.25, 0.21)] * W)
    assert slow.summary()["compute"] == pytest.approx(0.24) and fast.summary()["compute"] == pytest.approx(0.04)
    assert slow.summary()["step"] == fast.summary()["step"]


def test_a_summary_is_what_the_driver_parses():
    p = StepPace()
    p.new_round(2)
    run_steps(p, [(0.1, 0.03)] * W)
    assert Pace.parse(p.summary()) == Pace(2, W, pytest.approx(0.1), pytest.approx(0.03), pytest.approx(0.07))


@pytest.mark.parametrize("body", [None, [], {}, {"round": 0, "steps": 20, "step": 1, "wait": 0},
                                  {"round": 0, "steps": 20, "step": 1, "wait": 0, "compute": float("nan")},
                                  {"round": 0, "steps": 20, "step": 1, "wait": -1, "compute": 1},
                                  {"round": True, "steps": 20, "step": 1, "wait": 0, "compute": 1},
                                  {"round": 0, "steps": 0, "step": 1, "wait": 0, "compute": 1},
                                  {"round": 0, "steps": "20", "step": 1, "wait": 0, "compute": 1},
                                  {"round": 0, "steps": 20, "step": "1", "wait": 0, "compute": 1}])
def test_a_malformed_pace_is_ignored(body):
    assert Pace.parse(body) is None


# --- the driver's rule ------------------------------------------------------------------------
def test_a_host_at_twice_the_others_is_named_once_with_its_figures():
    det = StragglerDetector()
    newly, recovered = feed(det, {"a": 0.010, "b": 0.011, "c": 0.012, "d": 0.030})
    assert [s.host for s in newly] == ["d"] and recovered == []
    assert words.straggler(newly[0].fields()) == ("host d is a straggler: 30 ms of compute per step against 11 ms (median of the "
                                "others) over the last 20 steps")
    assert feed(det, {"a": 0.010, "b": 0.011, "c": 0.012, "d": 0.031}) == ([], [])  # said once
    assert set(det.named()) == {"d"}


def test_nothing_is_compared_before_a_full_window():
    det = StragglerDetector()
    assert feed(det, {"a": 0.01, "b": 0.5}, steps=W - 1) == ([], [])
    assert [s.host for s in feed(det, {"a": 0.01, "b": 0.5})[0]] == ["b"]


def test_below_the_ratio_or_the_margin_nobody_is_named():
    det = StragglerDetector()
    assert feed(det, {"a": 0.100, "b": 0.100, "c": 0.149}) == ([], [])  # under 1.5x
    # 3x, but 0.2 ms a step: the jitter of a tiny model, not a straggler
    assert feed(det, {"a": 0.0001, "b": 0.0001, "c": 0.0003}) == ([], [])


def test_two_hosts_the_other_is_the_reference_and_only_the_slower_can_be_named():
    det = StragglerDetector()
    newly, _ = feed(det, {"a": 0.020, "b": 0.050})
    assert [s.host for s in newly] == ["b"]
    assert "against 20 ms (the other host)" in words.straggler(newly[0].fields())
    assert feed(StragglerDetector(), {"a": 0.020, "b": 0.029}) == ([], [])


def test_the_fast_odd_one_out_makes_no_stragglers_of_the_rest():
    assert feed(StragglerDetector(), {"a": 0.001, "b": 0.010, "c": 0.010}) == ([], [])


def test_a_host_that_speeds_up_is_no_longer_named_once_that_has_held():
    det = StragglerDetector()
    feed(det, {"a": 0.01, "b": 0.01, "c": 0.05}, at=0)
    assert feed(det, {"a": 0.01, "b": 0.01, "c": 0.012}, at=1) == ([], [])  # not slow since 1 s
    assert feed(det, {"a": 0.01, "b": 0.01, "c": 0.012}, at=1 + HOLD - 0.1) == ([], [])
    assert set(det.named()) == {"c"}
    assert feed(det, {"a": 0.01, "b": 0.01, "c": 0.012}, at=1 + HOLD) == ([], ["c"])
    assert det.named() == {}


def test_a_pace_that_swings_with_the_load_is_not_named_and_cleared_every_few_seconds():
    """The first naming needs only a window of slow steps (a real straggler is named at once);
    after that, each change of verdict must hold HOLD s in a row, and a swing back resets it."""
    det = StragglerDetector()
    slow, fast = {"a": 0.01, "b": 0.01, "c": 0.05}, {"a": 0.01, "b": 0.01, "c": 0.011}
    said: list[tuple[float, str]] = []
    for i in range(200):  # 100 s: c's pace swings every 1.5 s, evaluated every 0.5 s
        t = i * 0.5
        newly, recovered = feed(det, slow if int(t / 1.5) % 2 == 0 else fast, at=t)
        said += [(t, f"named {s.host}") for s in newly] + [(t, f"cleared {h}") for h in recovered]
    assert said == [(0.0, "named c")]  # named at once, then never cleared: it never ran fast for HOLD s
    for t in range(200, 200 + int(HOLD) + 1):  # it runs fast for good
        feed(det, fast, at=float(t))
    assert det.named() == {}
    swings = []
    for i in range(int(REPEAT // 2)):  # cleared recently: named again only after HOLD s of slow steps
        t = 232 + i
        newly, _ = feed(det, slow if i % 4 < 2 else fast, at=float(t))
        swings += [s.host for s in newly]
    assert swings == []
    t0 = 232 + REPEAT // 2
    assert feed(det, slow, at=t0) == ([], []) and feed(det, slow, at=t0 + HOLD - 1) == ([], [])
    assert [s.host for s in feed(det, slow, at=t0 + HOLD)[0]] == ["c"]


def test_a_host_is_as_slow_as_its_slowest_worker():
    det = StragglerDetector()
    for w, (host, c) in {"a0": ("a", 0.01), "a1": ("a", 0.01), "b0": ("b", 0.01), "b1": ("b", 0.04),
                         "c0": ("c", 0.01)}.items():
        det.report(w, host, pace(c, 0.05))
    newly, _ = det.evaluate(0, {"a0": "a", "a1": "a", "b0": "b", "b1": "b", "c0": "c"})
    assert [s.host for s in newly] == ["b"] and newly[0].compute == 0.04


def test_paces_of_another_round_or_of_non_members_do_not_count():
    det = StragglerDetector()
    det.report("a/0", "a", pace(0.01, round_=1))
    det.report("b/0", "b", pace(0.5, round_=0))
    assert det.evaluate(1, {"a/0": "a", "b/0": "b"}) == ([], [])  # b's pace is of round 0
    assert det.paces() == {"a": 0.01}
    det.report("b/0", "b", pace(0.5, round_=1))
    assert det.evaluate(1, {"a/0": "a"}) == ([], [])  # b/0 is no member
    assert det.paces() == {"a": 0.01}


def test_a_named_host_stays_named_across_rounds_until_shown_otherwise():
    det = StragglerDetector()
    feed(det, {"a": 0.01, "b": 0.01, "c": 0.05})
    assert feed(det, {"a": 0.01, "b": 0.01, "c": 0.05}, round_=1, steps=3) == ([], [])
    assert set(det.named()) == {"c"}
    assert feed(det, {"a": 0.01, "b": 0.01, "c": 0.05}, round_=1) == ([], [])  # still: not said again
    feed(det, {"a": 0.01, "b": 0.01}, round_=2)  # c left the job
    assert det.named() == {}


def test_a_report_asks_for_a_decision_only_when_it_may_change_one():
    det = StragglerDetector()
    assert det.report("a/0", "a", pace(0.01)) is True  # a full window nobody has judged
    assert det.report("b/0", "b", pace(0.01, steps=5)) is False  # not full yet
    det.report("b/0", "b", pace(0.01))
    det.evaluate(0, {"a/0": "a", "b/0": "b"})
    assert det.report("a/0", "a", pace(0.011)) is False  # noise
    assert det.report("a/0", "a", pace(0.05)) is True  # crosses b's threshold
    det.evaluate(0, {"a/0": "a", "b/0": "b"})
    assert det.report("a/0", "a", pace(0.05)) is False  # named already
    assert det.report("a/0", "a", pace(0.01)) is True  # back to normal


def test_a_named_hosts_figures_are_the_latest():
    det = StragglerDetector()
    feed(det, {"a": 0.01, "b": 0.01, "c": 0.05})
    assert feed(det, {"a": 0.01, "b": 0.01, "c": 0.5}) == ([], [])  # not said again ...
    assert det.named()["c"].compute == 0.5  # ... but its figures are the new ones


def test_nothing_new_nothing_to_evaluate():
    det = StragglerDetector()
    feed(det, {"a": 0.01, "b": 0.05})
    assert det.evaluate(0, {"a/0": "a", "b/0": "b"}) == ([], [])


def test_eviction_pays_only_when_the_rest_train_more_samples_per_second():
    # 4 workers at 200 ms a step, one of them drags by 150 ms: 3 at 50 ms beat 4 at 200
    assert eviction_pays(4, 1, 0.200, 0.160, 0.010)
    # 2 hosts, 1.6x: 1 worker at 110 ms trains fewer samples than 2 at 170
    assert not eviction_pays(2, 1, 0.170, 0.160, 0.100)
    assert eviction_pays(2, 1, 0.300, 0.290, 0.100)  # 3x: it pays
    assert not eviction_pays(2, 2, 1.0, 1.0, 0.0)  # nobody would be left


# --- properties -------------------------------------------------------------------------------
@given(st.lists(st.floats(0, 10, allow_nan=False), min_size=2, max_size=30), st.data())
def test_median_without_is_the_median_of_the_rest(values, data):
    values.sort()
    i = data.draw(st.integers(0, len(values) - 1))
    assert median_without(values, i) == pytest.approx(statistics.median(values[:i] + values[i + 1:]))


computes = st.dictionaries(st.sampled_from([f"h{i}" for i in range(12)]),
                           st.floats(0.0, 2.0, allow_nan=False, allow_infinity=False), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(computes)
def test_who_is_named_is_exactly_the_rule(paces):
    """An independent statement of the rule, against the detector (O(H log H))."""
    newly, recovered = feed(StragglerDetector(), paces)
    assert recovered == []
    expected = set()
    if len(paces) >= 2:
        everyone = statistics.median(paces.values())
        for h, c in paces.items():
            ref = statistics.median([v for g, v in paces.items() if g != h])
            if c > RATIO * ref and c - ref > MIN_EXCESS and c > everyone:
                expected.add(h)
    assert {s.host for s in newly} == expected
    assert len(expected) <= len(paces) // 2  # stragglers are never the majority
    if len(paces) == 2:
        assert len(expected) <= 1


@settings(max_examples=200, deadline=None)
@given(computes, st.integers(0, 8))
def test_a_uniform_slowdown_names_nobody_new(paces, k):
    """Every host slower by the same factor (a bigger batch, a slower model) is no straggler
    (factors 2**k: exact in floating point, so no comparison flips by rounding)."""
    factor = 2.0 ** k
    det = StragglerDetector(min_excess=0.0)
    before = {s.host for s in feed(det, paces)[0]}
    after = {s.host for s in feed(StragglerDetector(min_excess=0.0), {h: c * factor for h, c in paces.items()})[0]}
    assert after == before


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 12), st.floats(0.005, 0.5), st.integers(0, W // 2 - 1),
       st.lists(st.floats(0.9, 1.1), min_size=W, max_size=W))
def test_a_host_slow_in_at_most_half_its_steps_is_never_named(hosts, base, slow_steps, jitter):
    """Through the worker's own windows: one host has ``slow_steps`` (fewer than half of 20) steps
    ten times slower, every host has +-10 % noise: nobody is named."""
    det = StragglerDetector()
    members = {}
    for i in range(hosts):
        p = StepPace()
        p.new_round(0)
        steps = []
        for k in range(W):
            c = base * jitter[(k + i) % W] * (10 if i == 0 and k < slow_steps else 1)
            steps.append((c + 0.001, 0.001))
        run_steps(p, steps)
        det.report(f"w{i}", f"h{i}", Pace.parse(p.summary()))
        members[f"w{i}"] = f"h{i}"
    assert det.evaluate(0, members) == ([], [])
