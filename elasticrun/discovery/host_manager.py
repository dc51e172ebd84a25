"""The set of usable hosts: join order, blacklist and cooldown (pure state, injected clock).

Why join order matters: ranks are assigned host by host in this order, so hosts that have
been in the job longest (whose workers hold the newest committed state) keep the lowest
ranks, and rank 0, the source of every ``state.sync()``, is always a survivor when one
exists. A host that leaves (removed from discovery, or blacklisted) loses its place; when it
comes back it is appended at the end like any new host, because it has no state to offer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Collection, Mapping


#: Why a host is draining (HostManager.draining()).
NOTICE = "notice"  # discovery listed it `draining`
LEAVING = "leaving"  # one of its workers received SIGTERM


@dataclass(frozen=True)
class HostChange:
    """What one discovery result changed in the set of usable hosts."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    resized: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.resized)


@dataclass
class _Blacklisting:
    count: int
    until: float | None  # None: permanent


def cooldown_delay(count: int, low: float, high: float, jitter: float) -> float:
    """Delay before the ``count``-th blacklisting of a host expires.

    Doubles with every blacklisting, so a host that keeps failing is tried less and less
    often; ``jitter`` in [0, 1) spreads hosts that failed together so they do not all return
    (and fail) at the same moment. Clamped to [low, high].
    """
    delay = low * (2 ** min(count - 1, 62)) * (1.0 + 0.25 * jitter)
    return max(low, min(high, delay))


@dataclass
class HostManager:
    """Discovered hosts, their join order and the blacklist.

    ``cooldown_range=None`` makes blacklisting permanent (horovodrun's default).
    """

    cooldown_range: tuple[float, float] | None = None
    rng: random.Random = field(default_factory=random.Random)
    _discovered: dict[str, int] = field(default_factory=dict)
    _order: list[str] = field(default_factory=list)
    _blacklist: dict[str, _Blacklisting] = field(default_factory=dict)
    # Hosts about to go away, and who said so: NOTICE (discovery listed them `draining`; it
    # lasts while it lists them so) or LEAVING (one of their workers got SIGTERM; it lasts
    # until discovery stops listing the host, which is then new if it ever comes back).
    _draining: dict[str, str] = field(default_factory=dict)
    # LEAVING hosts where a worker that said so still runs: they stay LEAVING even while
    # discovery misses them for a while (a flap must not give that worker a place again).
    _held: set[str] = field(default_factory=set)
    _now: float = float("-inf")
    # Every cooldown that ended by then has let its host back (``update`` looked after it).
    _settled_at: float = float("-inf")

    # -- inputs ---------------------------------------------------------------------------
    def update(self, discovered: Mapping[str, int], now: float,
               draining: Collection[str] | None = None) -> HostChange:
        """Take a new discovery result (``draining``: the hosts it says are about to go; None:
        as before); return how the usable hosts changed."""
        before = dict(self.available())
        self._discovered = dict(discovered)
        self._now = max(self._now, now)
        for host, why in list(self._draining.items()):
            if ((host not in self._discovered and host not in self._held)
                    or (why == NOTICE and draining is not None and host not in draining)):
                del self._draining[host]
        for host in draining or ():
            if host in self._discovered:
                self._draining.setdefault(host, NOTICE)
        self._order = [h for h in self._order if h in self._discovered and self._usable(h)]
        ordered = set(self._order)  # (a list's `in` made this O(hosts^2): every decision refreshes)
        self._order += [h for h in self._discovered if h not in ordered and self._usable(h)]
        self._settled_at = self._now
        return self._diff(before)

    def drain(self, host: str, now: float, hold: bool = False) -> HostChange:
        """A worker of ``host`` was told it will be stopped (SIGTERM): the host is going. It
        stays so until discovery stops listing it (a NOTICE becomes LEAVING: a notice that
        drops out of the next listing no longer lets the host back). ``hold``: that worker
        still runs, so the host stays LEAVING until :meth:`release`, listed or not."""
        if host in self._discovered or hold:
            self._draining[host] = LEAVING
        if hold:
            self._held.add(host)
        return self.update(self._discovered, now)

    def release(self, host: str, now: float) -> HostChange:
        """The last worker of ``host`` that said it was leaving has exited: from now on its
        LEAVING lasts, as any other, until discovery stops listing the host."""
        self._held.discard(host)
        return self.update(self._discovered, now)

    def blacklist(self, host: str, now: float) -> float | None:
        """Blacklist ``host`` after a failure; return when it may come back (None: never)."""
        self._now = max(self._now, now)
        entry = self._blacklist.get(host)
        count = (entry.count if entry else 0) + 1
        until = None
        if self.cooldown_range is not None:
            low, high = self.cooldown_range
            until = now + cooldown_delay(count, low, high, self.rng.random())
        self._blacklist[host] = _Blacklisting(count, until)
        if host in self._order:
            self._order.remove(host)
        return until

    def pardon(self, host: str, now: float) -> HostChange:
        """Forget ``host``'s blacklisting (the whole job was lost at once: no host is to blame)."""
        self._blacklist.pop(host, None)
        return self.update(self._discovered, now)

    def refresh(self, now: float) -> HostChange:
        """Let hosts whose cooldown has ended back in; return what that changed."""
        now = max(self._now, now)
        if not any(e.until is not None and self._settled_at < e.until <= now for e in self._blacklist.values()):
            # No cooldown ended since the last update: nothing else changes with time alone
            # (every decision refreshes; rebuilding the host order is O(hosts)).
            self._now = self._settled_at = now
            return HostChange()
        return self.update(self._discovered, now)

    # -- queries --------------------------------------------------------------------------
    def available(self) -> list[tuple[str, int]]:
        """Usable hosts with their slots, in assignment order."""
        return [(h, self._discovered[h]) for h in self._order]

    def is_blacklisted(self, host: str) -> bool:
        return self._is_blocked(host)

    def blacklisted(self) -> list[str]:
        """Every host ever blacklisted (its entry outlives the cooldown, which doubles next time)."""
        return sorted(self._blacklist)

    def blocked(self) -> list[str]:
        """The blacklisted hosts still kept out (as of the last refresh)."""
        return sorted(h for h in self._blacklist if self._is_blocked(h))

    def discovered(self) -> dict[str, int]:
        return dict(self._discovered)

    def all_blacklisted(self) -> bool:
        """Every discovered host is blacklisted (and there is at least one)."""
        return bool(self._discovered) and all(self._is_blocked(h) for h in self._discovered)

    def next_expiry(self) -> float | None:
        """The earliest time a blacklisted, discovered host may come back."""
        times = [e.until for h, e in self._blacklist.items()
                 if e.until is not None and e.until > self._now and h in self._discovered]
        return min(times) if times else None

    def draining(self) -> dict[str, str]:
        """Hosts about to go away: host -> NOTICE (discovery) or LEAVING (a worker's SIGTERM)."""
        return dict(self._draining)

    def is_permanent(self) -> bool:
        return self.cooldown_range is None

    # -- internals ------------------------------------------------------------------------
    def _usable(self, host: str) -> bool:
        return not self._is_blocked(host) and host not in self._draining

    def _is_blocked(self, host: str) -> bool:
        entry = self._blacklist.get(host)
        if entry is None:
            return False
        # The entry (and its count) stays after expiry so that the next cooldown doubles.
        return entry.until is None or self._now < entry.until

    def _diff(self, before: dict[str, int]) -> HostChange:
        after = dict(self.available())
        return HostChange(
            added=tuple(h for h in after if h not in before),
            removed=tuple(h for h in before if h not in after),
            resized=tuple(h for h in after if h in before and before[h] != after[h]),
        )
