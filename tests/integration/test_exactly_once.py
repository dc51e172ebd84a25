"""Exactly-once data per epoch, proven from the committed sample logs of real elastic jobs."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import PROGRESS_DISCOVERY, SCRIPTS, assert_each_sample_once

pytestmark = pytest.mark.timeout(240)

SAMPLES, EPOCHS = 240, 3


def committed(log_dir) -> list[dict]:
    """The committed sample entries of all workers."""
    return [json.loads(line) for path in log_dir.glob("samples-*.jsonl") for line in path.read_text().splitlines()]


def sizes_seen(log_dir) -> set[int]:
    return {e["size"] for e in committed(log_dir)}


def assert_exactly_once(log_dir) -> None:
    assert_each_sample_once(committed(log_dir), EPOCHS, SAMPLES)


def sample_cmd(job, *extra: str) -> list[str]:
    logs = job.tmp / "samples"
    logs.mkdir(exist_ok=True)
    return [sys.executable, str(SCRIPTS / "sample_train.py"), "--log-dir", str(logs), "--progress",
            str(job.progress), "--epochs", str(EPOCHS), "--samples", str(SAMPLES), *extra]


def test_exactly_once_with_a_host_added_and_one_removed_mid_epoch(job):
    # Epoch 0 on two hosts; a third joins in the middle of epoch 1 (batch 5) and one leaves in
    # the middle of epoch 2 (batch 6): both resets happen mid-epoch.
    schedule = ("0:localhost:1,127.0.0.1:1;1005:localhost:1,127.0.0.1:1,127.0.0.2:1;"
                "2006:localhost:1,127.0.0.2:1")
    r = job.run(["-np", "2", "--min-np", "1", "--max-np", "3", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.1"],
                sample_cmd(job, "--await-size=1:8:3", "--await-size=2:12:2", "--commit-every", "1"),
                HOSTS_SCHEDULE=schedule)
    assert r.returncode == 0, r.output
    assert sizes_seen(job.tmp / "samples") == {2, 3}
    assert r.stderr.count("[elasticrun] round ") == 3, r.stderr  # grow and shrink, in-process
    assert_exactly_once(job.tmp / "samples")


def test_exactly_once_with_host_checks_between_commits(job):
    """Hosts change at a check_host_updates() between commits: the leaving worker's batches
    since the last commit are in every survivor's live model, so they must count as trained
    (the interrupt commits them over the old world) and must not be trained again. Commits
    only at the end of epochs, so every interrupt is at a check between commits."""
    schedule = ("0:localhost:1,127.0.0.1:1;1005:localhost:1,127.0.0.1:1,127.0.0.2:1;"
                "2006:localhost:1,127.0.0.2:1")
    r = job.run(["-np", "2", "--min-np", "1", "--max-np", "3", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.1"],
                sample_cmd(job, "--await-size=1:9:3", "--await-size=2:13:2", "--commit-every", "1000",
                           "--check-every-step"),
                HOSTS_SCHEDULE=schedule)
    assert r.returncode == 0, r.output
    assert sizes_seen(job.tmp / "samples") == {2, 3}
    assert r.stderr.count("[elasticrun] round ") == 3, r.stderr
    assert_exactly_once(job.tmp / "samples")


def test_ranks_split_between_interrupt_and_rollback_all_sync(job):
    """At a host removal, rank 0 rolls back (as if it had seen a round abort first) while its
    peers take the interrupt, which says "removals only: no sync". The driver hears of the
    roll-back at the rendezvous and tells everyone to sync; if each rank decided alone, rank 0
    would sync while the others trained, pairing unrelated collectives."""
    schedule = "0:localhost:1,127.0.0.1:1,127.0.0.2:1;1006:localhost:1,127.0.0.2:1"
    r = job.run(["-np", "3", "--min-np", "1", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.1", "--collective-timeout", "15"],
                sample_cmd(job, "--await-size=1:13:2", "--commit-every", "1000", "--check-every-step",
                           "--restore-at-interrupt", "localhost:0"),
                HOSTS_SCHEDULE=schedule)
    assert r.returncode == 0, r.output
    assert (job.tmp / "samples" / "restored-at-interrupt").exists()
    assert sizes_seen(job.tmp / "samples") == {2, 3}
    assert_exactly_once(job.tmp / "samples")


def test_worker_killed_mid_epoch_redoes_only_uncommitted_work(job):
    r = job.run(["-np", "3", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1"],
                sample_cmd(job, "--kill=127.0.0.2:0@1:7", "--commit-every", "4"))
    assert r.returncode == 0, r.output
    assert "127.0.0.2[0] (rank 2) exited with code -9" in r.stderr
    assert sizes_seen(job.tmp / "samples") == {2, 3}
    assert_exactly_once(job.tmp / "samples")
    result = json.loads((job.tmp / "samples" / "result.json").read_text())
    assert result["final_loss"] < result["initial_loss"] * 0.7, result
    assert result["accuracy"] > 0.9, result


def test_rolling_replacement_hands_the_state_over(job):
    """Issue 11: new capacity arrives and the old leaves before the newcomers have started
    (a rolling spot replacement). Training must go on from the old workers' state: they
    hand it over (a round with the lowest-ranked old worker as rank 0 and the newcomers, who
    sync from it), and only then leave. Before the fix, round 1 was the newcomers alone and
    trained every epoch again from a fresh model."""
    schedule = "0:localhost:2;1004:localhost:2,127.0.0.1:2;1005:127.0.0.1:2"
    # The newcomers take 2 s more to start, so the old host is gone before they are ready
    # (with warm start they were once ready before the next step, and all four formed round 1).
    r = job.run(["-np", "2", "--min-np", "2", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.1"],
                sample_cmd(job, "--await-size=1:8:3", "--commit-every", "1", "--slow-start", "127.0.0.1:2"),
                HOSTS_SCHEDULE=schedule)
    assert r.returncode == 0, r.output
    assert "handing the state over from 2 to 3 worker(s)" in r.stderr, r.stderr
    assert "state_lost" not in r.stderr and "without any worker that held" not in r.stderr
    assert r.stderr.count("[elasticrun] round ") == 3, r.stderr  # 2 old; 1 old + 2 new; 2 new
    assert "round 2: 2 worker(s) on 1 host(s)" in r.stderr, r.stderr
    # The hand-over round may take no step of its own (the leavers' removal is applied at the
    # very next step), so what proves the hand-over is that the newcomers' round 2 trained on
    # from the old state: samples from rounds 0 and 2, and every sample exactly once.
    logged = committed(job.tmp / "samples")
    assert {e["round"] for e in logged} >= {0, 2}, sorted({(e["round"], e["size"]) for e in logged})
    assert {e["size"] for e in logged} <= {2, 3}
    assert_exactly_once(job.tmp / "samples")


def test_removal_is_not_held_back_by_a_host_still_starting(job):
    """Issue 11.2: a host leaves while an added host's worker is still starting. The removal
    takes effect at once (the round shrinks to 1), the newcomer joins when it is ready (the
    round grows to 2); before the fix the removal waited for the newcomer."""
    schedule = ("0:localhost:1,127.0.0.1:1;1003:localhost:1,127.0.0.1:1,127.0.0.2:1;"
                "1004:localhost:1,127.0.0.2:1")
    r = job.run(["-np", "2", "--min-np", "1", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.1"],
                sample_cmd(job, "--await-size=1:6:1", "--await-size=2:3:2", "--commit-every", "1",
                           "--slow-start", "127.0.0.2:4"),
                HOSTS_SCHEDULE=schedule)
    assert r.returncode == 0, r.output
    assert "round 1: 1 worker(s) on 1 host(s)" in r.stderr, r.stderr
    assert "round 2: 2 worker(s) on 2 host(s)" in r.stderr, r.stderr
    assert sizes_seen(job.tmp / "samples") == {1, 2}
    assert_exactly_once(job.tmp / "samples")
