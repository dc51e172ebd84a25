"""A newcomer fetches the committed model from rank 0 before it joins (worker/prefetch.py).

Real jobs: one host trains, a second is added; its worker fetches rank 0's committed host
tensors while the survivors train, and the join's sync skips those that no commit wrote
since. Every rank logs a checksum of the whole model and optimizer state at every commit:
ranks that logged the same commit must agree, whatever the fetch skipped.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import pytest

from conftest import PROGRESS_DISCOVERY, SCRIPTS

pytestmark = pytest.mark.timeout(120)

SCRIPT = SCRIPTS / "prefetch_train.py"


def commits(log_dir: Path) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = collections.defaultdict(list)
    for path in log_dir.glob("commits-*.jsonl"):
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            out[entry["commit"]].append(entry)
    return out


def run(job, *extra: str, newcomers: int = 1, launcher: tuple[str, ...] = (), first: str = "localhost:1",
        size: int | None = None, **env: str):
    log_dir = job.tmp / "commits"
    log_dir.mkdir()
    np = sum(int(h.rpartition(":")[2]) for h in first.split(","))
    size = size or np + newcomers  # the final world's
    r = job.run(["-np", str(np), "--min-np", "1", "--max-np", str(np + newcomers), "--host-discovery-script",
                 str(PROGRESS_DISCOVERY), "--discovery-interval", "0.1", "--log-level", "INFO", "--events", str(job.tmp / "events.jsonl"), *launcher],
                [sys.executable, str(SCRIPT), "--log-dir", str(log_dir), "--progress", str(job.progress),
                 "--size", str(size), *extra],
                HOSTS_SCHEDULE=f"0:{first};1:{first},127.0.0.1:{newcomers}", **env)
    assert r.returncode == 0, r.output
    history = commits(log_dir)
    joined = [c for c, entries in history.items() if any(e["host"] == "127.0.0.1" for e in entries)]
    assert joined, r.output  # the newcomers took part
    for c in joined:
        assert len(history[c]) == size, history[c]  # every rank of the final world logged it
    disagreeing = {c: entries for c, entries in history.items() if len({e["checksum"] for e in entries}) > 1}
    assert not disagreeing, disagreeing
    return r


def events(job) -> list[dict]:
    return [json.loads(line) for line in (job.tmp / "events.jsonl").read_text().splitlines()]


def test_unchanged_tensors_are_fetched_before_the_join_and_skipped_by_its_sync(job):
    r = run(job)
    log = events(job)
    fetched = [e for e in log if e["kind"] == "state_fetched"]
    assert len(fetched) == 1 and fetched[0]["host"] == "127.0.0.1" and fetched[0]["bytes"] > 8e6, fetched
    joined = [e for e in log if e["kind"] == "round_formed" and e["size"] == 2]
    assert fetched[0]["t"] < joined[0]["t"]  # before the survivors heard of it
    skipped = [e for e in log if e["kind"] == "sync_done" and e.get("skipped")]
    assert sorted(e["host"] for e in skipped) == ["127.0.0.1", "localhost"], skipped  # every rank skipped it
    assert "fetched 8.4 MB of the committed model from rank 0" in r.stderr, r.output
    assert "sent 8.4 MB of the committed model to newcomer" in r.stderr, r.output
    # The ballast and the frozen parameter: no commit wrote them since the fetch.
    assert "8.4 of the 8.4 MB fetched before are unchanged: the sync sends only the rest" in r.stderr, r.output


def test_tensors_written_after_the_fetch_are_sent_again(job):
    r = run(job, "--change-every", "1")  # every commit changes the ballast: never skipped
    assert "fetched 8.4 MB of the committed model from rank 0" in r.stderr, r.output
    assert "0.0 of the 8.4 MB fetched before are unchanged: the sync sends only the rest" in r.stderr, r.output


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_without_fetching_the_sync_sends_everything(job, how):
    r = run(job, launcher=("--no-prefetch",)) if how == "flag" else run(job, ELASTICRUN_PREFETCH="0")
    assert "fetched" not in r.stderr and "of the committed model to newcomer" not in r.stderr, r.output
    assert "model and optimizer state sent to every rank" in r.stderr, r.output  # the join's sync, to the newcomer


def test_with_background_commits(job):
    r = run(job, "--change-every", "3", "--background-commit")
    assert "fetched 8.4 MB of the committed model from rank 0" in r.stderr, r.output


def test_two_newcomers_fetch_at_once(job):
    r = run(job, newcomers=2)
    assert r.stderr.count("fetched 8.4 MB of the committed model from rank 0") == 2, r.output


def test_a_newcomer_killed_in_its_fetch_is_replaced_and_the_next_one_joins(job):
    """The newcomer dies as the transfer begins: rank 0's send fails beside training (the
    survivors never hear of that worker), its host comes back after the cooldown, and the
    replacement fetches and joins."""
    r = run(job, "--die-in-fetch", "newcomer", launcher=("--blacklist-cooldown-range", "1", "1"))
    assert (job.tmp / "commits" / "died-in-fetch").exists()
    assert "exited with code -9" in r.stderr, r.output
    assert "fetched 8.4 MB of the committed model from rank 0" in r.stderr, r.output  # the replacement


def test_rank_0_killed_while_it_sends_the_newcomer_joins_with_a_full_sync(job):
    """Rank 0 dies in the middle of serving a fetch: the survivors recover without it, the
    newcomer's fetch fails and it joins with a sync that sends everything."""
    r = run(job, "--die-in-fetch", "server", first="localhost:1,127.0.0.2:1", size=2)
    assert (job.tmp / "commits" / "died-in-fetch").exists()
    assert "no fetch of the committed model before joining" in r.stderr, r.output
    assert "fetched " not in r.stderr, r.output
