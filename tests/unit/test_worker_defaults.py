"""A worker started without the driver's timing variables falls back to the job's defaults,
the same values JobSettings gives the driver (one source: ``elasticrun.common.settings``)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from elasticrun.common import env
from elasticrun.common.settings import JobSettings
from elasticrun.worker import runtime

pytestmark = pytest.mark.timeout(30)


class FakeChannel:
    made: list[dict[str, Any]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        FakeChannel.made.append(kwargs)

    def start(self) -> None:
        pass

    def stop(self, bye: str = "exit") -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass


class FakeClient:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


def test_fallbacks_are_the_job_settings_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ELASTICRUN_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(env.CONTROL_ADDR, "tcp://127.0.0.1:1")
    monkeypatch.setenv(env.JOB_ID, "job")
    monkeypatch.setattr(runtime, "job_keys", lambda: None)
    monkeypatch.setattr(runtime, "DriverClient", FakeClient)
    monkeypatch.setattr(runtime, "ControlChannel", FakeChannel)
    FakeChannel.made = []
    rt = runtime.Runtime()
    try:
        job = JobSettings(command=["x"], np=1, min_np=1, max_np=1)
        assert not rt.standalone
        assert rt.collective_timeout == job.collective_timeout
        assert rt.rendezvous_timeout == job.elastic_wait_limit
        (channel,) = FakeChannel.made
        assert channel["interval"] == job.heartbeat_interval
        assert channel["driver_timeout"] == job.driver_timeout
    finally:
        rt.shutdown()


def test_the_driver_environment_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ELASTICRUN_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(env.COLLECTIVE_TIMEOUT, "7.5")
    monkeypatch.setenv(env.RENDEZVOUS_TIMEOUT, "12")
    rt = runtime.Runtime()
    assert rt.standalone and rt.collective_timeout == 7.5 and rt.rendezvous_timeout == 12.0
