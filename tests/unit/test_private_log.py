"""Ray's log file in /tmp (elasticrun/driver/launch/ray_launcher.py): a neighbour on the machine
cannot make the driver write it through a link, or into a file of theirs."""

from __future__ import annotations

import logging
import os
import stat

import pytest

from elasticrun.driver.launch.ray_launcher import PrivateLog

pytestmark = pytest.mark.timeout(30)


def record(text: str) -> logging.LogRecord:
    return logging.LogRecord("ray", logging.WARNING, __file__, 1, text, None, None)


def test_the_file_is_made_on_the_first_record_and_only_its_owner_can_read_it(tmp_path):
    h = PrivateLog(str(tmp_path), "elasticrun-ray")
    assert os.listdir(tmp_path) == []  # nothing until Ray says something
    h.emit(record("node 1 died"))
    h.close()
    [name] = os.listdir(tmp_path)
    assert name.startswith(f"elasticrun-ray-{os.getpid()}-") and name.endswith(".log")
    assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    h.emit(record("node 2 died"))  # reopened after close(): the same file, appended to
    h.close()
    assert (tmp_path / name).read_text().splitlines() == ["node 1 died", "node 2 died"]


def test_a_name_someone_planted_first_is_not_written_through(tmp_path):
    h = PrivateLog(str(tmp_path), "elasticrun-ray")
    victim = tmp_path / "victim"
    victim.write_text("theirs\n")
    os.symlink(victim, h.baseFilename)  # (the name is random: here the test knows it)
    h.emit(record("secret-looking ray chatter"))  # dropped quietly: no traceback, no write
    h.close()
    assert victim.read_text() == "theirs\n"
    os.unlink(h.baseFilename)
    planted = open(h.baseFilename, "w")  # a plain file made first: not appended to either
    planted.close()
    h2 = PrivateLog(str(tmp_path), "elasticrun-ray")
    h2.baseFilename = h.baseFilename
    h2.emit(record("x"))
    h2.close()
    assert os.path.getsize(h.baseFilename) == 0


def test_two_handlers_never_share_a_name(tmp_path):
    assert PrivateLog(str(tmp_path), "p").baseFilename != PrivateLog(str(tmp_path), "p").baseFilename
