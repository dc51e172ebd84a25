"""Which host updates a worker has seen, and when every rank agrees to act on them.

The driver announces every change of the host set as a ``hosts_updated`` notification with a
strictly increasing timestamp ``ts`` and whether it added hosts. Ranks hear of it at
different moments, so no rank may act on its own: at a check point (``commit()``,
``check_host_updates()``) all ranks agree, through one collective, on

* whether *some* rank has an update newer than the last one handled (then every rank raises
  ``HostsUpdatedInterrupt`` at that same call), and
* whether some such update *added* hosts (newcomers need the state: the reset must sync; an
  update that only removed hosts leaves every survivor holding the same live state).

The agreement happens in one of two ways, and :class:`HostUpdates` serves both: the
DistributedOptimizer appends :meth:`~HostUpdates.local_flags` to its first gradient bucket
and reports the reduced flags with :meth:`~HostUpdates.agreed` (no extra collective per step),
or the check point reduces :meth:`~HostUpdates.proposal` with MAX and calls
:meth:`~HostUpdates.settle`. A rendezvous brings a worker up to the driver's latest update
(:meth:`~HostUpdates.handled`).

Pure: no torch, no threads, no clock. Threads: the runtime's control thread is the only one
that calls :meth:`~HostUpdates.record` (under the runtime's lock); everything else runs on the
training thread. ``record`` publishes what the training thread reads in one attribute
assignment, so the readers on the training path take no lock and never see half an update.
"""

from __future__ import annotations

__all__ = ["HostUpdates"]


class HostUpdates:
    """The host updates one worker has seen and handled."""

    def __init__(self) -> None:
        self._seen: set[float] = set()  # timestamps recorded (to report each one once)
        # (newest ts seen, newest ts among those that added hosts); 0.0: none. One tuple, so
        # that a reader on the training thread gets both from the same moment.
        self._newest: tuple[float, float] = (0.0, 0.0)
        self._handled = 0.0  # updates up to this ts are dealt with (by a reset)
        # (round, some rank has an update pending, some pending update added hosts), agreed
        # through a gradient allreduce since the last check point.
        self._agreed: tuple[int, bool, bool] | None = None

    # --- control thread -----------------------------------------------------------------
    def record(self, ts: float, added: bool) -> bool:
        """Note the update of timestamp ``ts``; True if it is new to this worker.

        The driver repeats its latest updates in heartbeat replies, so most calls repeat
        one already recorded. Whether an update removed hosts needs no record: any update
        interrupts, only additions force a sync.
        """
        if ts in self._seen:
            return False
        self._seen.add(ts)
        newest, newest_added = self._newest
        self._newest = (max(newest, ts), max(newest_added, ts) if added else newest_added)
        return True

    # --- training thread ----------------------------------------------------------------
    @property
    def handled_ts(self) -> float:
        """Updates up to this timestamp need no interrupt."""
        return self._handled

    def handled(self, ts: float) -> None:
        """Updates up to ``ts`` are dealt with: a rendezvous brought this worker to the round
        the driver formed after them."""
        if ts > self._handled:
            self._handled = ts

    def local_flags(self) -> tuple[bool, bool]:
        """(this worker has seen an update newer than the handled ones, one of those added
        hosts): what it contributes to an agreement by sum or max."""
        newest, newest_added = self._newest
        handled = self._handled
        return newest > handled, newest_added > handled

    def agreed(self, round_: int, pending: bool, added: bool) -> None:
        """The flags every rank of round ``round_`` reduced in a gradient allreduce (any
        rank's flag set makes the reduced flag set)."""
        self._agreed = (round_, pending, added)

    def forget_agreed(self) -> None:
        """Drop flags agreed in a gradient allreduce without acting on them: after ``join()``,
        where the ranks ran different steps, some ranks hold flags and others none, and a
        check point must take the same path on every rank (its own collective, which sees
        every update the dropped flags saw)."""
        self._agreed = None

    def take_agreed(self, round_: int) -> tuple[bool, bool] | None:
        """At a check point of round ``round_``: the flags agreed in a gradient allreduce of
        this round since the last check point, as (interrupt, added), or None if there were
        none (then the check point agrees by itself: :meth:`proposal`). Consumes them.

        Every rank ran the same steps, so every rank gets the same answer. On an interrupt,
        every update seen so far counts as handled: the rendezvous that follows brings every
        rank to the driver's latest anyway.
        """
        agreed, self._agreed = self._agreed, None
        if agreed is None or agreed[0] != round_:
            return None
        _, pending, added = agreed
        if pending:
            self.handled(self._newest[0])
        return pending, added

    def proposal(self) -> tuple[float, bool]:
        """(the newest timestamp this worker knows, handled or not; whether an unhandled
        update added hosts): reduced with MAX over the ranks, then :meth:`settle`."""
        newest, newest_added = self._newest
        handled = self._handled
        return max(newest, handled), newest_added > handled

    def settle(self, ts: float) -> bool:
        """With the MAX over the ranks of :meth:`proposal`'s timestamp: True if this is an
        interrupt (some rank knows an update newer than the handled ones), which is then
        handled. Every rank handled the same updates (resets bring all to the same
        timestamp), so all reach the same answer."""
        if ts > self._handled:
            self._handled = ts
            return True
        return False
