"""The exceptions of the elastic programming model (horovod's names, so scripts port as-is)."""

from __future__ import annotations


class HorovodInternalError(RuntimeError):
    """A collective failed (a peer died, the round was aborted, or it timed out).

    ``elastic.run`` answers it by restoring the last commit and re-forming the group.
    """


class CollectiveTimeout(HorovodInternalError):
    """A collective did not complete within the collective timeout on this rank.

    Unlike a connection error (a peer died: the driver sees that too), only this rank knows;
    it tells the driver when it asks for the next round, so the round is aborted for all.
    """


class DeviceGroupError(RuntimeError):
    """The round's NCCL group failed to form the same way several rounds in a row, none of
    them aborted: a cause that a new round does not change (two ranks on one GPU, a device
    ordinal that does not exist, a broken GPU). Not a :class:`HorovodInternalError`: restoring
    and re-forming would only fail again, forever."""


class HostsUpdatedInterrupt(RuntimeError):
    """Hosts were added or removed; raised on every rank at the same commit/check.

    ``skip_sync`` is True when hosts were only removed: every remaining rank already holds
    the same live state, so the re-sync after the reset can be skipped.
    """

    def __init__(self, skip_sync: bool):
        super().__init__("hosts updated" + (" (removals only)" if skip_sync else ""))
        self.skip_sync = skip_sync
