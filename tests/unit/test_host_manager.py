"""Unit tests for elasticrun.discovery.host_manager: join order, blacklist and cooldown."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.discovery.host_manager import HostChange, HostManager, cooldown_delay

pytestmark = pytest.mark.timeout(60)


def order(hm: HostManager) -> list[str]:
    return [h for h, _ in hm.available()]


def seeded(seed: int = 1234, cooldown=(10.0, 1000.0)) -> tuple[HostManager, random.Random]:
    """A host manager with a seeded RNG and a twin RNG that predicts its jitter draws."""
    return HostManager(cooldown_range=cooldown, rng=random.Random(seed)), random.Random(seed)


# --- HostChange ------------------------------------------------------------------------------
def test_host_change_truthiness():
    assert not HostChange()
    assert HostChange(added=("a",))
    assert HostChange(removed=("a",))
    assert HostChange(resized=("a",))


# --- cooldown_delay --------------------------------------------------------------------------
class TestCooldownDelay:
    def test_first_blacklisting_without_jitter_is_low(self):
        assert cooldown_delay(1, 10.0, 1000.0, 0.0) == 10.0

    def test_doubles_per_blacklisting(self):
        assert [cooldown_delay(n, 10.0, 1e9, 0.0) for n in range(1, 6)] == [10.0, 20.0, 40.0, 80.0, 160.0]

    def test_jitter_adds_up_to_a_quarter(self):
        assert cooldown_delay(1, 10.0, 1000.0, 0.5) == pytest.approx(11.25)
        assert cooldown_delay(3, 10.0, 1000.0, 0.999) == pytest.approx(40 * (1 + 0.25 * 0.999))

    def test_clamped_to_high(self):
        assert cooldown_delay(10, 10.0, 100.0, 0.0) == 100.0
        assert cooldown_delay(5, 10.0, 100.0, 0.0) == 100.0  # 160 -> 100

    def test_clamp_boundary_precisely(self):
        assert cooldown_delay(4, 10.0, 100.0, 0.0) == 80.0
        assert cooldown_delay(4, 10.0, 100.0, 0.9) == pytest.approx(98.0)  # 80 * 1.225: not clamped
        assert cooldown_delay(4, 10.0, 100.0, 0.999) == pytest.approx(99.98)
        assert cooldown_delay(4, 10.0, 90.0, 0.5) == 90.0  # 80 * 1.125 = 90 exactly
        assert cooldown_delay(4, 10.0, 89.0, 0.5) == 89.0
    def test_huge_count_does_not_overflow(self):
        assert cooldown_delay(10_000, 1.0, 3600.0, 0.5) == 3600.0

    def test_high_below_low_never_goes_below_low(self):
        assert cooldown_delay(1, 10.0, 5.0, 0.0) == 10.0

    @given(count=st.integers(1, 200), low=st.floats(0.001, 1e4), span=st.floats(0, 1e6),
           jitter=st.floats(0, 1, exclude_max=True))
    @settings(max_examples=300)
    def test_property_clamped_and_monotonic(self, count, low, span, jitter):
        high = low + span
        d = cooldown_delay(count, low, high, jitter)
        assert low <= d <= high
        assert cooldown_delay(count + 1, low, high, jitter) >= d
        assert cooldown_delay(count, low, high, 0.0) <= d  # jitter only lengthens


# --- join order ------------------------------------------------------------------------------
class TestJoinOrder:
    def test_initial_order_is_discovery_order(self):
        hm = HostManager()
        change = hm.update({"b": 1, "a": 2, "c": 3}, now=0)
        assert order(hm) == ["b", "a", "c"]
        assert hm.available() == [("b", 1), ("a", 2), ("c", 3)]
        assert change == HostChange(added=("b", "a", "c"))

    def test_new_hosts_are_appended_regardless_of_discovery_order(self):
        hm = HostManager()
        hm.update({"b": 1, "c": 1}, now=0)
        change = hm.update({"a": 1, "c": 1, "b": 1}, now=1)
        assert order(hm) == ["b", "c", "a"]
        assert change == HostChange(added=("a",))

    def test_removed_host_loses_its_place_and_reappears_at_the_end(self):
        hm = HostManager()
        hm.update({"a": 1, "b": 1, "c": 1}, now=0)
        change = hm.update({"b": 1, "c": 1}, now=1)
        assert change == HostChange(removed=("a",))
        assert order(hm) == ["b", "c"]
        change = hm.update({"a": 1, "b": 1, "c": 1}, now=2)
        assert change == HostChange(added=("a",))
        assert order(hm) == ["b", "c", "a"]

    def test_unchanged_discovery_reports_no_change(self):
        hm = HostManager()
        hm.update({"a": 1, "b": 2}, now=0)
        change = hm.update({"b": 2, "a": 1}, now=1)
        assert not change
        assert order(hm) == ["a", "b"]

    def test_resize_detected_and_order_kept(self):
        hm = HostManager()
        hm.update({"a": 1, "b": 2}, now=0)
        change = hm.update({"a": 4, "b": 2}, now=1)
        assert change == HostChange(resized=("a",))
        assert hm.available() == [("a", 4), ("b", 2)]

    def test_mixed_change(self):
        hm = HostManager()
        hm.update({"a": 1, "b": 2, "c": 1}, now=0)
        change = hm.update({"a": 1, "c": 3, "d": 1}, now=1)
        assert change == HostChange(added=("d",), removed=("b",), resized=("c",))
        assert order(hm) == ["a", "c", "d"]

    def test_everything_removed(self):
        hm = HostManager()
        hm.update({"a": 1, "b": 1}, now=0)
        change = hm.update({}, now=1)
        assert change == HostChange(removed=("a", "b"))
        assert hm.available() == []
        assert hm.discovered() == {}
        assert not hm.all_blacklisted()

    def test_discovered_returns_a_copy(self):
        hm = HostManager()
        source = {"a": 1}
        hm.update(source, now=0)
        source["b"] = 2
        hm.discovered()["c"] = 3
        assert hm.discovered() == {"a": 1}

    @given(st.lists(st.dictionaries(st.sampled_from("abcdef"), st.integers(1, 4)), max_size=12))
    @settings(max_examples=200)
    def test_property_order_model(self, updates):
        """Order = previous order minus vanished hosts, then newcomers in discovery order."""
        hm = HostManager()
        model: list[str] = []
        for t, discovered in enumerate(updates):
            before = dict(hm.available())
            change = hm.update(discovered, now=t)
            model = [h for h in model if h in discovered] + [h for h in discovered if h not in model]
            assert order(hm) == model
            assert hm.available() == [(h, discovered[h]) for h in model]
            assert set(change.added) == set(discovered) - set(before)
            assert set(change.removed) == set(before) - set(discovered)
            assert set(change.resized) == {h for h in discovered if h in before and before[h] != discovered[h]}


# --- blacklisting: permanent -----------------------------------------------------------------
class TestPermanentBlacklist:
    def test_blacklist_is_permanent_without_cooldown(self):
        hm = HostManager()
        assert hm.is_permanent()
        hm.update({"a": 1, "b": 1}, now=0)
        assert hm.blacklist("a", now=1) is None
        assert hm.is_blacklisted("a") and not hm.is_blacklisted("b")
        assert order(hm) == ["b"]
        assert hm.blacklisted() == ["a"]
        for t in (10, 1e6, 1e12):
            assert not hm.refresh(now=t)
            assert hm.update({"a": 1, "b": 1}, now=t) == HostChange()
            assert order(hm) == ["b"]
        assert hm.next_expiry() is None

    def test_blacklisted_host_not_added_when_rediscovered(self):
        hm = HostManager()
        hm.update({"a": 1}, now=0)
        hm.blacklist("a", now=1)
        hm.update({}, now=2)
        change = hm.update({"a": 1}, now=3)
        assert change == HostChange()
        assert hm.available() == []

    def test_blacklist_undiscovered_host(self):
        hm = HostManager()
        hm.update({"a": 1}, now=0)
        hm.blacklist("z", now=1)
        assert hm.is_blacklisted("z")
        change = hm.update({"a": 1, "z": 1}, now=2)
        assert change == HostChange()
        assert order(hm) == ["a"]

    def test_all_blacklisted(self):
        hm = HostManager()
        assert not hm.all_blacklisted()  # nothing discovered
        hm.update({"a": 1, "b": 1}, now=0)
        hm.blacklist("a", now=1)
        assert not hm.all_blacklisted()
        hm.blacklist("b", now=1)
        assert hm.all_blacklisted()
        hm.update({"b": 1}, now=2)
        assert hm.all_blacklisted()
        hm.update({"b": 1, "c": 1}, now=3)
        assert not hm.all_blacklisted()

    def test_blacklisted_sorted(self):
        hm = HostManager()
        hm.update({"c": 1, "a": 1, "b": 1}, now=0)
        hm.blacklist("c", now=1)
        hm.blacklist("a", now=1)
        assert hm.blacklisted() == ["a", "c"]

    def test_blacklist_removes_from_available_immediately(self):
        hm = HostManager()
        hm.update({"a": 1, "b": 1, "c": 1}, now=0)
        hm.blacklist("b", now=0)
        assert hm.available() == [("a", 1), ("c", 1)]


# --- blacklisting: cooldown ------------------------------------------------------------------
class TestCooldown:
    def test_not_permanent(self):
        hm, _ = seeded()
        assert not hm.is_permanent()

    def test_returns_until_from_cooldown_delay(self):
        hm, twin = seeded(seed=7, cooldown=(10.0, 1000.0))
        hm.update({"a": 1}, now=0)
        until = hm.blacklist("a", now=5.0)
        assert until == pytest.approx(5.0 + cooldown_delay(1, 10.0, 1000.0, twin.random()))
        assert 15.0 <= until < 5.0 + 12.5

    def test_exponential_growth_per_blacklisting(self):
        hm, twin = seeded(seed=42, cooldown=(10.0, 1000.0))
        hm.update({"a": 1}, now=0)
        now = 0.0
        delays = []
        for count in range(1, 9):
            until = hm.blacklist("a", now=now)
            expected = cooldown_delay(count, 10.0, 1000.0, twin.random())
            assert until - now == pytest.approx(expected)
            delays.append(until - now)
            now = until
            hm.refresh(now)
            assert not hm.is_blacklisted("a")
        # 10*2^(n-1)*(1..1.25), clamped to 1000
        eps = 1e-9
        for n, d in enumerate(delays, start=1):
            assert min(1000.0, 10.0 * 2 ** (n - 1)) - eps <= d <= min(1000.0, 12.5 * 2 ** (n - 1)) + eps
        assert delays[-1] == pytest.approx(1000.0)  # 10 * 2**7 = 1280, clamped
        assert delays[:7] == sorted(delays[:7])

    def test_delay_never_below_low_or_above_high(self):
        hm = HostManager(cooldown_range=(30.0, 60.0), rng=random.Random(3))
        hm.update({"a": 1}, now=0)
        now = 0.0
        for _ in range(6):
            until = hm.blacklist("a", now=now)
            assert 30.0 - 1e-9 <= until - now <= 60.0 + 1e-9
            now = until
            hm.refresh(now)

    def test_blocked_until_cooldown_ends_then_back_at_the_end(self):
        hm, twin = seeded(seed=1, cooldown=(10.0, 100.0))
        hm.update({"a": 1, "b": 2, "c": 1}, now=0)
        until = hm.blacklist("a", now=1.0)
        assert until == pytest.approx(1.0 + cooldown_delay(1, 10.0, 100.0, twin.random()))
        assert order(hm) == ["b", "c"]
        assert hm.next_expiry() == until
        assert not hm.refresh(until - 1e-6)
        assert hm.is_blacklisted("a")
        change = hm.refresh(until)
        assert change == HostChange(added=("a",))
        assert order(hm) == ["b", "c", "a"]
        assert not hm.is_blacklisted("a")
        assert hm.next_expiry() is None
        assert hm.blacklisted() == ["a"]  # entry kept so that the next cooldown doubles

    def test_a_cooldown_that_ended_before_another_blacklisting_still_lets_its_host_back(self):
        """refresh() skips the rebuild when no cooldown ended since the last update; a
        blacklisting in between moves the clock on without an update, and must not hide one."""
        hm, _ = seeded(cooldown=(10.0, 10.0))
        hm.update({"a": 1, "b": 1, "c": 1}, now=0)
        hm.blacklist("a", now=0)  # until 10
        hm.blacklist("b", now=12)  # after a's cooldown ended; no refresh came between
        assert hm.refresh(13.0) == HostChange(added=("a",))
        assert order(hm) == ["c", "a"]
        assert not hm.refresh(14.0)
        assert hm.refresh(22.0) == HostChange(added=("b",))

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.sampled_from(["refresh", "blacklist", "update", "pardon", "drain"]),
                              st.sampled_from(["a", "b", "c", "d"]), st.floats(0.0, 15.0)), max_size=30))
    def test_refresh_answers_as_a_full_update_would(self, script):
        hm = HostManager(cooldown_range=(5.0, 20.0), rng=random.Random(0))
        ref = HostManager(cooldown_range=(5.0, 20.0), rng=random.Random(0))
        now = 0.0
        for m in (hm, ref):
            m.update({"a": 1, "b": 2, "c": 1, "d": 1}, now=0.0)
        for op, host, dt in script:
            now += dt
            for m in (hm, ref):
                if op == "refresh":
                    got = m.refresh(now) if m is hm else m.update(m.discovered(), now)
                elif op == "blacklist":
                    got = m.blacklist(host, now)
                elif op == "update":
                    got = m.update({h: 1 for h in "abcd" if h != host}, now)
                elif op == "pardon":
                    got = m.pardon(host, now)
                else:
                    got = m.drain(host, now)
                if m is hm:
                    mine = got
            assert mine == got, (op, host, now)
            assert hm.available() == ref.available()

    def test_expired_host_also_returns_on_update(self):
        hm, _ = seeded(cooldown=(10.0, 10.0))
        hm.update({"a": 1, "b": 1}, now=0)
        assert hm.blacklist("a", now=0) == 10.0
        change = hm.update({"a": 1, "b": 1}, now=10.0)
        assert change == HostChange(added=("a",))
        assert order(hm) == ["b", "a"]

    def test_expiry_while_undiscovered_host_is_not_added(self):
        hm, _ = seeded(cooldown=(10.0, 10.0))
        hm.update({"a": 1, "b": 1}, now=0)
        hm.blacklist("a", now=0)
        hm.update({"b": 1}, now=1)
        assert hm.next_expiry() is None  # not discovered: nothing to wait for
        assert not hm.refresh(20.0)
        assert hm.update({"a": 1, "b": 1}, now=21.0) == HostChange(added=("a",))

    def test_next_expiry_is_the_earliest(self):
        hm = HostManager(cooldown_range=(10.0, 10.0), rng=random.Random(0))
        hm.update({"a": 1, "b": 1, "c": 1}, now=0)
        hm.blacklist("a", now=5)   # until 15
        hm.blacklist("b", now=2)   # until 12
        assert hm.next_expiry() == 12.0
        hm.refresh(12.0)
        assert order(hm) == ["c", "b"]
        assert hm.next_expiry() == 15.0
        hm.refresh(15.0)
        assert order(hm) == ["c", "b", "a"]
        assert hm.next_expiry() is None

    def test_blocked_names_only_hosts_still_kept_out(self):
        """The summary named every host ever blacklisted as blacklisted, also those back."""
        hm = HostManager(cooldown_range=(10.0, 10.0), rng=random.Random(0))
        hm.update({"a": 1, "b": 1}, now=0)
        hm.blacklist("a", now=1)  # until 11
        hm.blacklist("b", now=5)  # until 15
        assert hm.blocked() == ["a", "b"] == hm.blacklisted()
        hm.refresh(12.0)
        assert hm.blocked() == ["b"] and hm.blacklisted() == ["a", "b"]

    def test_all_blacklisted_with_cooldown(self):
        hm = HostManager(cooldown_range=(10.0, 10.0), rng=random.Random(0))
        hm.update({"a": 1}, now=0)
        hm.blacklist("a", now=0)
        assert hm.all_blacklisted()
        hm.refresh(10.0)
        assert not hm.all_blacklisted()

    def test_clock_never_goes_backwards(self):
        hm = HostManager(cooldown_range=(10.0, 10.0), rng=random.Random(0))
        hm.update({"a": 1, "b": 1}, now=0)
        hm.blacklist("a", now=0)
        hm.refresh(10.0)
        assert order(hm) == ["b", "a"]
        # An older timestamp must not re-block a host whose cooldown already ended.
        hm.update({"a": 1, "b": 1}, now=3.0)
        assert order(hm) == ["b", "a"]

    def test_reblacklisting_during_cooldown_counts(self):
        hm = HostManager(cooldown_range=(10.0, 1000.0), rng=random.Random(0))
        hm.update({"a": 1}, now=0)
        first = hm.blacklist("a", now=0)
        second = hm.blacklist("a", now=1)
        assert second - 1 >= 20.0 > first

    @given(seed=st.integers(0, 2**32 - 1), low=st.floats(0.5, 100), factor=st.floats(1, 100),
           events=st.lists(st.tuples(st.sampled_from("abc"), st.floats(0, 50)), max_size=15))
    @settings(max_examples=150)
    def test_property_blacklist_cycle(self, seed, low, factor, events):
        high = low * factor
        hm = HostManager(cooldown_range=(low, high), rng=random.Random(seed))
        twin = random.Random(seed)
        hm.update({"a": 1, "b": 1, "c": 1}, now=0)
        now = 0.0
        counts = {"a": 0, "b": 0, "c": 0}
        untils: dict[str, float] = {}
        for host, dt in events:
            now += dt
            hm.refresh(now)
            for h, u in untils.items():
                assert hm.is_blacklisted(h) == (now < u)
            counts[host] += 1
            until = hm.blacklist(host, now)
            expected = cooldown_delay(counts[host], low, high, twin.random())
            assert until == pytest.approx(now + expected)
            assert low * (1 - 1e-9) <= until - now <= high * (1 + 1e-9)
            untils[host] = until
            assert host not in order(hm)
            expiries = [u for u in untils.values() if u > now]
            assert hm.next_expiry() == (min(expiries) if expiries else None)
