"""How failed NCCL formations add up (runtime.formation_failed): only the same failure, round
after round and never in an aborted round, ends a worker; anything else may well pass."""

from __future__ import annotations

from elasticrun.worker.runtime import FORMATION_ATTEMPTS, formation_failed


def test_the_same_failure_adds_up_numbers_aside() -> None:
    failures: list[str] = []
    formation_failed(failures, "NCCL error\nLast error:\nDuplicate GPU: rank 1 and rank 0 on device 1000")
    formation_failed(failures, "NCCL error\nLast error:\nDuplicate GPU: rank 3 and rank 2 on device 1000")
    assert len(failures) == 2
    assert failures[-1] == "NCCL error Last error: Duplicate GPU: rank 3 and rank 2 on device 1000"
    assert len(formation_failed(failures, "NCCL error\nLast error:\nDuplicate GPU: rank 1 and rank 0 on device 1000")) \
        == FORMATION_ATTEMPTS == 3


def test_another_failure_or_an_aborted_round_starts_anew() -> None:
    failures: list[str] = []
    formation_failed(failures, "invalid device ordinal")
    formation_failed(failures, "invalid device ordinal")
    assert formation_failed(failures, "connection reset by peer") == ["connection reset by peer"]
    formation_failed(failures, "connection reset by peer")
    assert formation_failed(failures, None) == []  # a peer died: the round was aborted


def test_a_message_is_kept_bounded() -> None:
    failures: list[str] = []
    formation_failed(failures, "x" * 100_000)
    formation_failed(failures, "")
    assert failures == ["(no message)"]
    assert len(formation_failed([], "y" * 100_000)[0]) == 800
