"""Run real ``elasticrun`` jobs and prove they leave no process behind.

Every job gets a unique ``ELASTICRUN_TEST_TAG`` in its environment; the driver, its workers
and anything they start inherit it, so after the job a scan of /proc finds every survivor.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import pytest

# The jobs run as from a terminal whatever started the suite: a script's background job has
# SIGINT ignored, every process started from here would inherit that, and the driver (as any
# program) leaves an ignored SIGINT ignored. The Ctrl-C tests would then test nothing.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# Likewise SIGHUP under nohup (a CI runner, `nohup ./run_tests.sh &`): the driver leaves an
# ignored SIGHUP ignored, and the hang-up tests would then test nothing. A handler that does
# nothing keeps this process safe from a hang-up as nohup meant, and, unlike SIG_IGN, is not
# inherited: every process started from here gets SIGHUP's default at its exec.
if signal.getsignal(signal.SIGHUP) is signal.SIG_IGN:
    signal.signal(signal.SIGHUP, lambda signum, frame: None)

SCRIPTS = Path(__file__).parent / "scripts"
TRAIN = SCRIPTS / "elastic_train.py"
PROGRESS_DISCOVERY = SCRIPTS / "progress_discovery.sh"


def tagged_pids(tag: str) -> list[int]:
    """PIDs of live processes whose environment carries ``tag``."""
    needle = f"ELASTICRUN_TEST_TAG={tag}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    with open(f"/proc/{entry}/stat", "rb") as s:
                        if s.read().split(b") ")[-1][:1] != b"Z":  # zombies hold nothing
                            found.append(int(entry))
        except OSError:
            continue
    return found



def env_of(pid: int) -> dict[str, str]:
    """The environment process ``pid`` started with ({} once it is gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
        return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}
    except OSError:
        return {}


def assert_each_sample_once(history: Iterable[dict], epochs: int, samples: int) -> None:
    """Every index of every epoch appears exactly once in the committed sample entries
    (``{"epoch", "indices"}`` each), and the history covers epochs 0..epochs-1."""
    per_epoch: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    for e in history:
        per_epoch[e["epoch"]].update(e["indices"])
    assert sorted(per_epoch) == list(range(epochs))
    for epoch, counts in per_epoch.items():
        missing = sorted(set(range(samples)) - set(counts))
        repeated = sorted(i for i, n in counts.items() if n > 1)
        assert not missing and not repeated, f"epoch {epoch}: missing {missing}, repeated {repeated}"

def growing_discovery(directory: Path) -> tuple[Path, list[str]]:
    """A discovery script listing localhost and 127.0.0.1 (one slot each), and 127.0.0.2 as
    well once the returned marker file exists (a training script makes it to grow the job);
    the job's flags that use it."""
    grow = directory / "grow"
    script = directory / "discover.sh"
    script.write_text(f"#!/bin/sh\nprintf 'localhost:1\\n127.0.0.1:1\\n'\n[ -f {grow} ] && echo 127.0.0.2:1\nexit 0\n")
    script.chmod(0o755)
    return grow, ["-np", "2", "--min-np", "2", "--host-discovery-script", str(script), "--discovery-interval", "1"]


def assert_nothing_left(tag: str, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while True:
        left = tagged_pids(tag)
        if not left:
            return
        if time.monotonic() > deadline:
            described = []
            for pid in left:  # do not leak them into the next test, but still fail this one
                try:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
                    described.append(f"{pid}: {cmdline[:200]}")
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            pytest.fail("processes left behind by the job:\n" + "\n".join(described))
        time.sleep(0.05)


@dataclass
class JobResult:
    returncode: int
    stdout: str
    stderr: str
    log: list[dict]
    seconds: float  # wall time of the whole elasticrun command

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


class Job:
    """Builds and runs one elasticrun job in a temp dir."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.tag = uuid.uuid4().hex
        self.log = tmp_path / "rank0.jsonl"
        self.progress = tmp_path / "progress"
        self.markers = tmp_path / "markers"
        self.markers.mkdir()
        self.proc: subprocess.Popen | None = None
        self.started = 0.0

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, ELASTICRUN_TEST_TAG=self.tag, PROGRESS_FILE=str(self.progress),
                   OMP_NUM_THREADS="1", **extra)
        env.pop("ELASTICRUN_CONTROL_ADDR", None)
        return env

    def train_cmd(self, *extra: str, epochs: int = 6, batches: int = 5, sleep: float = 0.02) -> list[str]:
        return [sys.executable, str(TRAIN), "--log", str(self.log), "--progress", str(self.progress),
                "--marker-dir", str(self.markers), "--epochs", str(epochs), "--batches", str(batches),
                "--sleep", str(sleep), *extra]

    def start(self, launcher_args: list[str], command: list[str], driver: list[str] | None = None,
              **env: str) -> subprocess.Popen:
        """``driver``: what runs in place of ``python -m elasticrun`` (a wrapper script)."""
        self.started = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, *(driver or ["-m", "elasticrun"]), *launcher_args, *command],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=self.env(**env), cwd=self.tmp, start_new_session=True)
        return self.proc

    def finish(self, timeout: float = 120) -> JobResult:
        assert self.proc is not None
        try:
            out, err = self.proc.communicate(timeout=timeout)
            seconds = time.monotonic() - self.started
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
            pytest.fail(f"elasticrun did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
        assert_nothing_left(self.tag)
        log = [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []
        return JobResult(self.proc.returncode, out, err, log, seconds)

    def run(self, launcher_args: list[str], command: list[str], timeout: float = 120, **env: str) -> JobResult:
        self.start(launcher_args, command, **env)
        return self.finish(timeout)


@pytest.fixture
def job(tmp_path: Path):
    j = Job(tmp_path)
    yield j
    if j.proc is not None and j.proc.poll() is None:
        os.killpg(j.proc.pid, signal.SIGKILL)
        j.proc.wait()
    assert_nothing_left(j.tag)
