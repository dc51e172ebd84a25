"""What the driver decides about durable copies: when to ask for one, how far training has
gone, and when a stop's last copy is settled. Pure: no threads, sockets, files or clocks (the
driver passes its times in); ``driver.py`` carries the decisions out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CopySchedule", "FinalCopy", "PROGRESS_EVERY", "Progress", "final_copy_verdict"]

#: At most this often (seconds) the furthest progress is written to the checkpoint directory.
PROGRESS_EVERY = 2.0


#: While every holder of the state is leaving: a copy not whole this long after it was asked for
#: is asked for again (seconds).
URGENT_RETRY = 2.0


class CopySchedule:
    """When to ask the workers for a durable copy (pure; the driver's clock is passed in).

    The first copy is asked for as soon as a round trains (a job that dies early still leaves
    one); then every ``interval`` seconds after the last request, so that the copy on disk is
    never older than ``interval`` plus the time to the next commit and its transfer. A request
    that is not whole within ``interval`` is replaced by the next one.
    """

    def __init__(self, interval: float):
        self.interval = interval
        self.last_id = 0
        self._last_at: float | None = None
        self.completed: set[int] = set()

    def due(self, now: float) -> bool:
        return self._last_at is None or now - self._last_at >= self.interval

    def ask(self, now: float, training: bool, force: bool = False, urgent: bool = False) -> int | None:
        """The id of a request to publish now, or None: only while a round trains (not before
        the first, nor while one is aborted and re-formed), when due or ``force``d (a stop's
        last copy). ``urgent`` (every holder of the state is leaving, and none can hand it over):
        due as soon as the last request is written, or URGENT_RETRY after it, so that the copy
        they leave behind is at most one copy's time old whenever their --sigterm-grace ends."""
        if not training:
            return None
        if urgent and self._last_at is not None and (
                self.last_id in self.completed or now - self._last_at >= URGENT_RETRY):
            return self.request(now)
        if not (force or self.due(now)):
            return None
        return self.request(now)

    def next_deadline(self) -> float | None:
        return None if self._last_at is None else self._last_at + self.interval

    def request(self, now: float) -> int:
        self.last_id += 1
        self._last_at = now
        return self.last_id

    def written(self, request: int) -> None:
        self.completed.add(request)


@dataclass
class Progress:
    """How far training has gone, as the workers report it: the furthest (steps, commit) any
    worker has reported, when (wall time: a resume says how much training it redoes), and
    when that commit was first heard of (monotonic: the status line's "last commit N s ago")."""

    steps: int = 0
    commit: int = 0
    at: float = 0.0
    commit_at: float | None = None
    _written_at: float = -math.inf

    def report(self, steps: int, commit: int, now: float, wall: float, keep_file: bool) -> bool:
        """A worker's report; True when the progress file is to be written now (``keep_file``:
        there is a checkpoint directory): at a new furthest point, at most every
        :data:`PROGRESS_EVERY` s (it only shortens "N steps back" after a resume).

        Steps and commits are each the furthest reported: a worker that joined late counts
        steps from its first sync, and one a step behind may hold a newer commit (a pair
        compared steps first ignored its commits, and the "last commit" went stale)."""
        if steps <= self.steps and commit <= self.commit:
            return False
        if commit > self.commit:
            self.commit, self.commit_at = commit, now
        if steps > self.steps:
            self.steps, self.at = steps, wall
        if keep_file and now - self._written_at > PROGRESS_EVERY:
            self._written_at = now
            return True
        return False


@dataclass(frozen=True)
class FinalCopy:
    """What the driver sees while it waits for a stop's last durable copy."""

    written: bool  # a copy newer than the one on disk at the request has been written
    failure: str | None  # why the newest copy begun after the request failed, if one did
    service_alive: bool
    workers_alive: bool
    waited: float  # seconds since the request
    newest_commit: int  # the furthest commit the workers have reported
    base_commit: int  # the commit of the copy on disk at the request (0: none)


def final_copy_verdict(seen: FinalCopy, commit_news: float) -> str | None:
    """None: keep waiting; "": the copy is written; else why there will be none. A copy can
    only be of a commit made after the request, so no commit newer than the copy on disk
    within ``commit_news`` s means none is coming (a job stopped between commits)."""
    if seen.written:
        return ""
    if seen.failure is not None:
        return seen.failure
    if not seen.service_alive:
        return "the durable-copy service has stopped"
    if not seen.workers_alive:
        return "every worker is gone"
    if seen.waited >= commit_news and seen.newest_commit <= seen.base_commit:
        return f"no commit newer than commit {seen.base_commit} was made"
    return None
