"""--no-prefetch: on by default, off by flag, variable or config file; the workers hear it."""

from __future__ import annotations

import pytest

from elasticrun.common import env as envvars
from elasticrun.driver.assignment import SlotInfo
from elasticrun.driver.cli import command as cli
from elasticrun.driver.environment import worker_environment

pytestmark = pytest.mark.timeout(30)


def test_on_by_default_off_by_flag_variable_or_file(monkeypatch, tmp_path):
    monkeypatch.delenv("ELASTICRUN_PREFETCH", raising=False)
    assert cli.parse_settings(["-np", "1", "python", "t.py"]).prefetch is True
    assert cli.parse_settings(["-np", "1", "--no-prefetch", "python", "t.py"]).prefetch is False
    for text, on in (("1", True), ("on", True), ("0", False), ("false", False), ("OFF", False)):
        monkeypatch.setenv("ELASTICRUN_PREFETCH", text)
        assert cli.parse_settings(["-np", "1", "python", "t.py"]).prefetch is on, text
    monkeypatch.delenv("ELASTICRUN_PREFETCH")
    toml = tmp_path / "c.toml"
    toml.write_text("no-prefetch = true\n")
    assert cli.parse_settings(["-np", "1", "--config-file", str(toml), "python", "t.py"]).prefetch is False


@pytest.mark.parametrize("flags, told", [((), "1"), (("--no-prefetch",), "0")])
def test_the_workers_are_told(monkeypatch, flags, told):
    monkeypatch.delenv("ELASTICRUN_PREFETCH", raising=False)
    s = cli.parse_settings(["-np", "1", *flags, "python", "t.py"])
    info = SlotInfo(host="h", slot=0, rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
    given = worker_environment(s, info, job_id="j", worker_id="w", control_addr="a",
                               base_env={}, remote=True)
    assert given[envvars.PREFETCH] == told
