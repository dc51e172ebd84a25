"""ResetTracker: one line per reset with cause, sizes and time to resume; summary at exit."""

import pytest

from elasticrun.driver.resets import ResetTracker

pytestmark = pytest.mark.timeout(30)


def test_failure_reset_is_measured_from_trigger_to_first_step():
    r = ResetTracker()
    r.round_formed(0, 3)
    r.trigger("failure", "b[0] exited with code -9", t=10.0)
    r.trigger("hosts", "hosts removed", t=10.5)  # folded into the same reset: the first cause counts
    r.round_formed(1, 2)
    assert r.first_step(0, t=10.6) is None  # a step of another round does not close it
    done = r.first_step(1, t=10.05)
    assert done is not None
    assert done["cause"] == "b[0] exited with code -9" and done["from_size"] == 3 and done["to_size"] == 2
    assert done["seconds"] == pytest.approx(0.05)
    assert "reset 1 (b[0] exited with code -9): 3 -> 2 worker(s), training again 50 ms after it" == done["line"]
    assert r.first_step(1, t=11.0) is None  # closed once


def test_summary_counts_resets_by_cause():
    r = ResetTracker()
    r.round_formed(0, 2)
    r.trigger("hosts", "hosts added", t=1.0)
    r.round_formed(1, 3)
    r.first_step(1, t=1.2)
    r.trigger("failure", "x", t=2.0)
    r.round_formed(2, 2)
    r.first_step(2, t=2.1)
    text = r.summary(["h3"])
    assert text.startswith("3 round(s), 2 reset(s) (1 after failures, 1 after host changes), 0.30 s")
    assert text.endswith("blacklisted hosts: h3")
    assert r.summary([], ["h1", "h2"]).endswith("blacklisted hosts: none (back after a cooldown: h1, h2)")


def test_no_reset_before_the_first_round():
    r = ResetTracker()
    r.trigger("failure", "startup failure", t=1.0)  # before round 0: not a reset
    r.round_formed(0, 2)
    assert r.first_step(0, t=2.0) is None
    assert r.summary([]).startswith("1 round(s), 0 reset(s) (none)")


def test_an_update_during_a_reset_is_a_reset_of_its_own():
    # Storm: round 1's first step is shipped after the next update already ended round 1.
    r = ResetTracker()
    r.round_formed(0, 3)
    r.trigger("hosts", "hosts removed", t=1.0)
    r.round_formed(1, 2)
    r.trigger("hosts", "hosts removed", t=1.05)  # before round 1's first step reached the driver
    first = r.first_step(1, t=1.04)
    assert first is not None and first["from_size"] == 3 and first["to_size"] == 2
    r.round_formed(2, 1)
    second = r.first_step(2, t=1.1)
    assert second is not None and second["from_size"] == 2 and second["to_size"] == 1
    assert second["seconds"] == pytest.approx(0.05)
    assert r.summary([]).startswith("3 round(s), 2 reset(s) (2 after host changes)")


def test_a_round_that_never_trained_is_folded_into_the_next_reset():
    r = ResetTracker()
    r.round_formed(0, 4)
    r.trigger("failure", "a died", t=1.0)
    r.round_formed(1, 3)
    r.trigger("failure", "b died while re-forming", t=1.1)  # round 1 never took a step
    r.round_formed(2, 2)
    done = r.first_step(2, t=1.3)
    assert done is not None and done["cause"] == "a died" and done["from_size"] == 4 and done["to_size"] == 2
    assert done["seconds"] == pytest.approx(0.3)
    assert "reset 2 (a died): 4 -> 2 worker(s), through 2 rounds" in done["line"]
    # Counted as the registry counts them (its finish line says "3 round(s), 2 reset(s)").
    assert r.summary([]).startswith("3 round(s), 2 reset(s) (2 after failures), 0.30 s spent recovering "
                                    "(1 ended before training resumed)")


def test_summary_agrees_with_the_registry_when_the_job_ends_right_after_a_reset():
    """Issue 11: "summary: 2 round(s), 0 reset(s)" was followed by "training finished after 2
    round(s), 1 reset(s)": a reset counts when its round forms, not when its first step is
    reported (the job may end before that report arrives)."""
    r = ResetTracker()
    r.round_formed(0, 2)
    r.trigger("hosts", "hosts added", t=1.0)
    r.round_formed(1, 3)
    assert r.summary([]).startswith("2 round(s), 1 reset(s) (1 after host changes), 0.00 s spent recovering "
                                    "(1 ended before training resumed)")


def test_a_second_host_update_before_the_round_adds_what_it_changed():
    """A host lost slots (removed), then a newcomer was ready (added): one reset for both, named
    for both (it said "hosts removed")."""
    r = ResetTracker()
    r.round_formed(0, 3)
    r.trigger("hosts", "hosts removed", t=5.0)
    r.trigger("hosts", "hosts added and removed", t=5.5)
    r.round_formed(1, 3)
    done = r.first_step(1, t=5.6)
    assert done is not None and done["cause"] == "hosts added and removed" and done["seconds"] == pytest.approx(0.6)


def test_a_failure_while_a_host_update_is_pending_makes_it_a_failures_reset():
    """A host was added; before the round acted on it a worker went silent and the round was
    aborted (a rollback): it was "reset 1 (hosts added)", timed from the update (during which
    the workers trained on), and counted after host changes."""
    r = ResetTracker()
    r.round_formed(0, 2)
    r.trigger("hosts", "hosts added", t=5.0)
    r.trigger("failure", "b[0] sent no heartbeat for 5.0 s", t=7.0)
    r.round_formed(1, 2)
    done = r.first_step(1, t=7.1)
    assert done is not None and done["trigger"] == "failure" and done["seconds"] == pytest.approx(0.1)
    assert done["line"] == ("reset 1 (b[0] sent no heartbeat for 5.0 s; hosts added meanwhile): 2 -> 2 worker(s), "
                            "training again 100 ms after it")
    assert "(1 after failures)" in r.summary([])


def test_a_reset_whose_round_never_formed_counts_when_the_job_does_not_succeed():
    """An abort whose recovery timed out (too few workers came back) or was stopped: the summary
    said "1 round(s), 0 reset(s) (none), 0.00 s spent recovering" after 10 s without training."""
    r = ResetTracker()
    r.round_formed(0, 2)
    r.trigger("failure", "b[0] exited with code -9", t=3.7)
    text = r.summary([], end=13.8)  # the job timed out at 13.8
    assert text.startswith("1 round(s), 1 reset(s) (1 after failures), 10.10 s spent recovering "
                           "(1 ended before training resumed)"), text
    assert r.summary([]).startswith("1 round(s), 0 reset(s) (none), 0.00 s")  # (a job that succeeded meanwhile)


def test_a_reset_is_open_from_its_trigger_until_training_resumes():
    r = ResetTracker()
    r.round_formed(0, 3)
    assert r.open_since() is None
    r.trigger("hosts", "hosts added", t=5.0)
    assert r.open_since() is None  # the workers train on to their next commit
    r.round_formed(1, 2)
    assert r.open_since() == 5.0  # formed, not training yet (the sync, the reset callbacks)
    r.first_step(1, t=9.0)
    assert r.open_since() is None
