"""Discovery output is read with limits: a script or callable cannot make the driver's memory
(or its log) follow whatever it prints or returns."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping

import pytest

from elasticrun.common.hosts import MAX_HOSTS, MAX_SLOTS_PER_HOST
from elasticrun.discovery.sources import (
    MAX_OUTPUT_LINES,
    CallableDiscovery,
    DiscoveryError,
    ScriptDiscovery,
    hosts_from_mapping,
)

pytestmark = pytest.mark.timeout(60)


def script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "discover.sh"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return str(path)


def group_gone(pgid: int, within: float = 5.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_endless_output_is_cut_at_1_mib_and_the_script_killed(tmp_path):
    path = script(tmp_path, f"echo $$ > {tmp_path}/pid\nyes localhost:1")
    started = time.monotonic()
    with pytest.raises(DiscoveryError) as err:
        ScriptDiscovery(path, 1, 10.0).discover()
    assert time.monotonic() - started < 5.0  # at the limit, not at the timeout
    assert str(err.value) == (f"{path} printed more than 1 MiB; it was killed "
                              f"(a discovery script prints one host per line)")
    assert group_gone(int((tmp_path / "pid").read_text()))  # `yes` too, not only the shell


def test_endless_short_lines_are_cut_at_the_line_limit(tmp_path):
    path = script(tmp_path, "yes")
    with pytest.raises(DiscoveryError, match=f"printed more than {MAX_OUTPUT_LINES:,} lines; it was killed"):
        ScriptDiscovery(path, 1, 10.0).discover()


def test_output_up_to_the_limits_is_read(tmp_path):
    path = script(tmp_path, f"echo localhost:2; yes '# padding' | head -n {MAX_OUTPUT_LINES - 1}")
    assert ScriptDiscovery(path, 1, 10.0).discover().hosts == {"localhost": 2}


def test_memory_stays_bounded_while_a_script_prints_100_mb(tmp_path):
    """In a fresh interpreter, so the peak RSS is this discovery run's."""
    path = script(tmp_path, "yes localhost:1 | head -c 100000000")
    code = ("import resource, sys\nfrom elasticrun.discovery.sources import ScriptDiscovery, DiscoveryError\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            f"try:\n    ScriptDiscovery({path!r}, 1, 20.0).discover()\nexcept DiscoveryError as e:\n    print(e)\n"
            "print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr
    message, grown_mb = r.stdout.strip().splitlines()
    assert "printed more than 1 MiB" in message
    assert int(grown_mb) < 20, r.stdout


def test_stderr_keeps_only_a_tail(tmp_path):
    path = script(tmp_path, "echo first >&2; yes 'noise on stderr' | head -c 20000000 >&2; echo 'the real cause' >&2; "
                            "exit 3")
    with pytest.raises(DiscoveryError) as err:
        ScriptDiscovery(path, 1, 20.0).discover()
    message = str(err.value)
    assert "exited with code 3" in message and message.endswith("the real cause")
    assert "first" not in message and len(message) < 2200


def test_timeout_is_kept(tmp_path):
    path = script(tmp_path, "echo localhost:1; sleep 30")
    started = time.monotonic()
    with pytest.raises(DiscoveryError, match=r"did not finish within 0.5 s \(--discovery-timeout\); it was killed"):
        ScriptDiscovery(path, 1, 0.5).discover()
    assert time.monotonic() - started < 3.0


def test_invalid_utf8_is_an_invalid_line_not_a_crash(tmp_path):
    path = script(tmp_path, r"printf 'localhost:1\n\377\376bad\n'")
    found = ScriptDiscovery(path, 1, 10.0).discover()
    assert found.hosts == {"localhost": 1}
    assert len(found.errors) == 1 and found.errors[0].startswith("line 2:")


def test_absurd_slot_counts_are_invalid_lines(tmp_path):
    path = script(tmp_path, "echo localhost:99999999999999999999; echo 127.0.0.1:2")
    found = ScriptDiscovery(path, 1, 10.0).discover()
    assert found.hosts == {"127.0.0.1": 2}
    assert f"a host has at most {MAX_SLOTS_PER_HOST} slots" in found.errors[0]


def test_too_many_hosts_fail_the_run(tmp_path):
    path = script(tmp_path, f"seq -f 'h%g' 1 {MAX_HOSTS + 1}")
    with pytest.raises(DiscoveryError, match=f"listed {MAX_HOSTS + 1:,} hosts, more than the {MAX_HOSTS:,} allowed"):
        ScriptDiscovery(path, 1, 10.0).discover()


def test_many_bad_lines_are_counted_not_kept(tmp_path):
    path = script(tmp_path, "echo localhost:1; yes 'bad host' | head -n 99999")
    found = ScriptDiscovery(path, 1, 10.0).discover()
    assert found.hosts == {"localhost": 1}
    assert len(found.errors) + found.more_errors == 99_999 and len(found.errors) <= 20


# --- callables --------------------------------------------------------------------------------
def test_a_callable_returning_a_huge_dict_fails_before_reading_it():
    class Huge(Mapping):
        def __len__(self) -> int:
            return 10**9

        def __getitem__(self, key):
            raise AssertionError("read")

        def __iter__(self) -> Iterator[str]:
            raise AssertionError("read")

    with pytest.raises(DiscoveryError, match=f"returned 1,000,000,000 hosts, more than the {MAX_HOSTS:,} allowed"):
        hosts_from_mapping(Huge(), "hosts")
    big = {f"h{i}": 1 for i in range(MAX_HOSTS + 1)}
    with pytest.raises(DiscoveryError, match="more than the"):
        CallableDiscovery(lambda: big, 5.0).discover()


def test_a_mapping_that_raises_is_a_failed_run():
    class Broken(dict):
        def items(self):
            raise RuntimeError("boom")

    with pytest.raises(DiscoveryError, match="could not be read: RuntimeError: boom"):
        hosts_from_mapping(Broken(a=1), "hosts")


def test_callable_entries_with_absurd_values_are_reported_briefly():
    found = hosts_from_mapping({"a": 2, "b": 10**30, "c": 10**5000, "x" * 10_000: 1, "d": "2"}, "hosts")
    assert found.hosts == {"a": 2}
    assert len(found.errors) == 4 and all(len(e) < 300 for e in found.errors), found.errors


# --- a script that leaves a process in the background ------------------------------------------
@pytest.mark.parametrize("how", ["in its group", "in a session of its own"])
def test_a_run_ends_with_the_script_even_if_a_background_process_holds_its_output(tmp_path, how):
    """`cmd &` (or `setsid cmd &`, `ssh -f`) inherits the script's stdout and stderr and may hold
    them for good: the run used to wait for them to close, then report a timeout ("did not
    finish ... it was killed") about a script that had printed its hosts and exited 0."""
    start = "setsid sleep 600" if how != "in its group" else "sleep 600"
    path = script(tmp_path, f"echo $$ > {tmp_path}/pid\n{start} &\necho $! > {tmp_path}/bg\necho localhost:2\n"
                            "echo 127.0.0.1:1")
    started = time.monotonic()
    found = ScriptDiscovery(path, 1, 20.0).discover()
    took = time.monotonic() - started
    background = int((tmp_path / "bg").read_text())
    try:
        assert found.hosts == {"localhost": 2, "127.0.0.1": 1}
        assert took < 10.0, took  # at the script's exit, not at the 20 s timeout
        if how == "in its group":  # what is left of its group goes, as after a timeout
            assert group_gone(int((tmp_path / "pid").read_text())), "the background sleep in the script's group lived on"
    finally:
        try:
            os.kill(background, 9)
        except OSError:
            pass


def test_a_script_that_exits_with_output_still_in_the_pipe_loses_none_of_it(tmp_path):
    hosts = "".join(f"echo 10.0.{i // 250}.{i % 250 + 1}:1\n" for i in range(3000))  # ~45 KB in the pipe
    path = script(tmp_path, "sleep 600 &\n" + hosts)
    found = ScriptDiscovery(path, 1, 20.0).discover()
    assert len(found.hosts) == 3000
