"""The driver's stop signals, as a small state machine (``ElasticDriver._on_signal``): where a
signal finds the main thread decides whether it interrupts at once, waits for the end of the
loop's step, or hurries a stop already under way. No process, no socket: a bare driver object."""

from __future__ import annotations

import signal

import pytest

from elasticrun.driver.driver import ElasticDriver, _Interrupted


def bare() -> ElasticDriver:
    d = ElasticDriver.__new__(ElasticDriver)
    d._wake_w = -1  # no loop to wake: the write fails quietly, as after the driver closed
    return d


def test_a_stop_signal_is_no_exception_that_error_handlers_catch():
    assert not issubclass(_Interrupted, Exception)
    try:
        try:
            raise _Interrupted(signal.SIGTERM)
        except Exception:  # what a request's handler and logging's emit catch
            pytest.fail("an 'except Exception' caught the stop signal")
    except _Interrupted as exc:
        assert exc.signum == signal.SIGTERM and str(exc) == "SIGTERM"


def test_outside_a_step_it_interrupts_at_once_and_the_stop_cannot_be_interrupted():
    d = bare()
    with pytest.raises(_Interrupted):
        d._on_signal(signal.SIGTERM, None)
    assert d._stopping and not d._hurry
    d._on_signal(signal.SIGINT, None)  # a second one, while stopping: no raise
    assert d._hurry


def test_inside_a_step_it_waits_for_the_step_and_a_second_one_hurries():
    d = bare()
    d._in_step = True
    d._on_signal(signal.SIGHUP, None)  # no raise: the loop raises it at the step's end
    assert d._pending_signal == signal.SIGHUP and not d._stopping and not d._hurry
    d._on_signal(signal.SIGTERM, None)
    assert d._pending_signal == signal.SIGHUP and d._hurry  # the first one names the stop
