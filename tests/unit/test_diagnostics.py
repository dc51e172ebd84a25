"""Files elasticrun names inside the user's --output-filename directory (rank.N/stdout,
events.jsonl): opened without following a link planted below it, and only when a regular file
(elasticrun/common/diagnostics.py). A shared, group-writable log directory must not let a
teammate point the job's appends at another of the user's files, nor block its output with a FIFO."""

from __future__ import annotations

import logging
import os
import threading

import pytest

from elasticrun.common.diagnostics import DiagnosticFile, open_beneath
from elasticrun.common.events import EventLog

pytestmark = pytest.mark.timeout(30)


def _append(directory, names, text: str) -> None:
    fd = open_beneath(str(directory), names)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def test_it_creates_what_is_missing_and_appends(tmp_path):
    _append(tmp_path, ["rank.0", "stdout"], "a\n")
    _append(tmp_path, ["rank.0", "stdout"], "b\n")
    _append(tmp_path, ["events.jsonl"], "e\n")
    assert (tmp_path / "rank.0" / "stdout").read_text() == "a\nb\n"
    assert (tmp_path / "events.jsonl").read_text() == "e\n"


def test_the_directory_given_may_itself_be_a_link(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "logs").symlink_to(tmp_path / "real")  # the user's own choice of path
    _append(tmp_path / "logs", ["rank.1", "stderr"], "x\n")
    assert (tmp_path / "real" / "rank.1" / "stderr").read_text() == "x\n"


@pytest.mark.parametrize("planted", ["file", "directory"])
def test_a_planted_link_is_not_followed(tmp_path, planted):
    victim_dir = tmp_path / "home"
    victim_dir.mkdir()
    victim = victim_dir / "stdout"
    victim.write_text("precious\n")
    logs = tmp_path / "shared"
    logs.mkdir()
    if planted == "file":
        (logs / "rank.0").mkdir()
        (logs / "rank.0" / "stdout").symlink_to(victim)
        said = "stdout is a symbolic link (not followed)"
    else:
        (logs / "rank.0").symlink_to(victim_dir)
        said = "rank.0 is a symbolic link (not followed)"
    with pytest.raises(OSError) as caught:
        _append(logs, ["rank.0", "stdout"], "job output\n")
    assert caught.value.strerror == said
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize("reader", [False, True])
def test_a_fifo_is_refused_at_once(tmp_path, reader):
    os.mkfifo(tmp_path / "events.jsonl")
    held = os.open(tmp_path / "events.jsonl", os.O_RDONLY | os.O_NONBLOCK) if reader else None
    try:
        with pytest.raises(OSError) as caught:  # (a blocking open would wait here for a reader)
            open_beneath(str(tmp_path), ["events.jsonl"])
        assert caught.value.strerror == "events.jsonl is not a regular file"
    finally:
        if held is not None:
            os.close(held)


def test_a_diagnostic_file_beneath_a_directory_warns_once_and_drops_the_line(tmp_path, caplog):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "rank.0").mkdir()
    (tmp_path / "rank.0" / "stdout").symlink_to(victim)
    f = DiagnosticFile(str(tmp_path / "rank.0" / "stdout"), "rank 0's stdout file", beneath=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="elasticrun"):
        assert not f.write("one\n") and not f.write("two\n")
    f.close()
    assert victim.read_text() == "precious\n"
    warned = [r.getMessage() for r in caplog.records if "cannot write rank 0's stdout file" in r.getMessage()]
    assert len(warned) == 1 and "stdout is a symbolic link (not followed); training goes on" in warned[0], warned


def test_an_event_log_beneath_a_directory_is_written_there_and_a_user_named_one_may_be_a_link(tmp_path):
    log = EventLog(str(tmp_path / "events.jsonl"), beneath=str(tmp_path))
    log.write("probe", x=1)
    log.close()
    assert '"kind":"probe"' in (tmp_path / "events.jsonl").read_text()
    target = tmp_path / "mine.jsonl"
    (tmp_path / "named.jsonl").symlink_to(target)  # --events PATH: the user's path, links and all
    log = EventLog(str(tmp_path / "named.jsonl"))
    log.write("probe", x=2)
    log.close()
    assert '"x":2' in target.read_text()


def test_writes_from_many_threads_stay_whole_lines(tmp_path):
    f = DiagnosticFile(str(tmp_path / "rank.0" / "stdout"), "rank 0's stdout file", beneath=str(tmp_path))
    threads = [threading.Thread(target=lambda i=i: [f.write(f"{i}:{'y' * 500}\n") for _ in range(200)])
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    f.close()
    lines = (tmp_path / "rank.0" / "stdout").read_text().splitlines()
    assert len(lines) == 800 and all(line.endswith("y" * 500) for line in lines)


def test_a_hard_link_planted_beneath_the_output_directory_is_not_appended_to(tmp_path):
    """A teammate's hard link in a shared --output-filename DIR to another file of yours
    (possible where fs.protected_hardlinks is 0, as in many containers): not written."""
    victim = tmp_path / "precious"
    victim.write_text("precious\n")
    logs = tmp_path / "shared"
    (logs / "rank.0").mkdir(parents=True)
    os.link(victim, logs / "rank.0" / "stdout")
    with pytest.raises(OSError) as caught:
        _append(logs, ["rank.0", "stdout"], "job output\n")
    assert caught.value.strerror == "stdout has other hard links (not written)"
    assert victim.read_text() == "precious\n"
