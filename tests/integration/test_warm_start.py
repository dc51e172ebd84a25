"""Warm worker start on real jobs: workers forked from a per-host template that has imported
torch and elasticrun (elasticrun/worker/template.py), against the same jobs started cold.

``scripts/warm_probe.py`` records whether torch was already imported when its first line ran
(a forked worker) or not (a new interpreter), its random draws, argv, cwd and rank.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import SCRIPTS, assert_nothing_left, tagged_pids
from sshd import ssh_server, sshd_clean  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(180)

PROBE = SCRIPTS / "warm_probe.py"


def _results(out: Path, n: int) -> list[dict]:
    found = sorted(out.glob("rank-*.json"))
    assert len(found) == n, [p.name for p in found]
    return [json.loads(p.read_text()) for p in found]


def _out(job) -> Path:
    out = job.tmp / "out"
    out.mkdir(exist_ok=True)
    return out


def _wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout:g} s for {what}")
        time.sleep(0.05)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def test_workers_are_forked_warm_and_run_the_script_as_python_would(job):
    out = _out(job)
    r = job.run(["-np", "3", "-H", "localhost:2,127.0.0.1:1"], [sys.executable, str(PROBE), str(out), "x y"])
    assert r.returncode == 0, r.output
    res = _results(out, 3)
    assert all(x["warm"] for x in res), res  # torch was imported before the script's first line
    assert all(x["threads_at_start"] == 1 for x in res), res  # nothing forked after a thread started
    assert [x["rank"] for x in res] == [0, 1, 2] and {x["env_rank"] for x in res} == {"0", "1", "2"}
    assert all(x["total"] == 3.0 and x["size"] == 3 for x in res)  # gloo across forked workers
    assert all(x["argv"] == [str(PROBE), str(out), "x y"] and x["cwd"] == str(job.tmp) for x in res)
    for key in ("python_random", "torch_random", "numpy_random"):  # no shared RNG state
        assert len({x[key] for x in res}) == 3, (key, res)
    assert len({x["pid"] for x in res}) == 3
    assert "[0]<stdout>:probe rank 0 warm=True" in r.stdout, r.stdout  # the usual output path
    assert "warm start" not in r.stderr, r.stderr


@pytest.mark.parametrize("how", ["flag", "variable"])
def test_no_warm_start_starts_every_worker_fresh(job, how):
    out = _out(job)
    flag, env = (["--no-warm-start"], {}) if how == "flag" else ([], {"ELASTICRUN_WARM_START": "0"})
    r = job.run(["-np", "2", "-H", "localhost:2", *flag], [sys.executable, str(PROBE), str(out)], **env)
    assert r.returncode == 0, r.output
    res = _results(out, 2)
    assert not any(x["warm"] for x in res), res
    assert len({x["python_random"] for x in res}) == 2


def test_a_command_that_is_not_a_python_script_starts_fresh(job):
    out = _out(job)
    r = job.run(["-np", "2", "-H", "localhost:2"], ["bash", "-c", f'exec "{sys.executable}" "{PROBE}" "{out}"'])
    assert r.returncode == 0, r.output
    assert not any(x["warm"] for x in _results(out, 2))
    assert "warm start" not in r.stderr, r.stderr


def test_an_exit_status_reaches_the_driver_as_for_a_fresh_worker(job):
    out = _out(job)
    r = job.run(["-np", "1", "-H", "localhost:1"], [sys.executable, str(PROBE), str(out), "--exit", "3"])
    assert _results(out, 1)[0]["warm"]
    assert r.returncode != 0 and "exited with code 3" in r.stderr, r.output


@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_missing_script_fails_as_python_says_it(job, where, request):
    """The template will not run a script it cannot find: the worker starts fresh and python
    says what is wrong (the local launcher once closed the death notice's descriptor twice on
    that path: "OSError: [Errno 9] Bad file descriptor", code 255, python's line never shown)."""
    if where == "local":
        hosts = ["-H", "localhost:1"]
    else:
        hosts = ["-H", "127.0.0.2:1", *request.getfixturevalue("sshd_clean").ssh_args()]
    missing = job.tmp / "no_such_train.py"
    r = job.run(["-np", "1", *hosts], [sys.executable, str(missing)])
    assert r.returncode != 0, r.output
    assert f"can't open file '{missing}'" in r.stdout + r.stderr, r.output
    assert "exited with code 2" in r.stderr and "Bad file descriptor" not in r.output, r.output


def test_a_template_that_dies_means_fresh_workers_and_one_warning(job):
    out = _out(job)
    dying = job.tmp / "dies_on_import.py"
    dying.write_text("import os\nos._exit(3)\n")
    script = job.tmp / "probe.py"
    script.write_text(PROBE.read_text())  # next to the module, so the template's sys.path finds it
    r = job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--preload", "dies_on_import"],
                [sys.executable, str(script), str(out)])
    assert r.returncode == 0, r.output
    assert not any(x["warm"] for x in _results(out, 2))
    warnings = [line for line in r.stderr.splitlines() if "warm start" in line]
    assert len(warnings) == 1 and "template is gone" in warnings[0] and "code 3" in warnings[0], r.stderr


def test_the_driver_killed_9_leaves_no_template_and_no_worker(job):
    out = _out(job)
    job.start(["-np", "2", "-H", "localhost:1,127.0.0.1:1"],
              [sys.executable, str(PROBE), str(out), "--hold", "120"])
    _wait_for(lambda: len(list(out.glob("rank-*.json"))) == 2, 60, "both workers to run")
    assert all(x["warm"] for x in _results(out, 2))
    running = [p for p in tagged_pids(job.tag) if p != job.proc.pid]
    templates = [p for p in running if "elasticrun.worker.template" in _cmdline(p)]
    reapers = [p for p in running if "remote_bootstrap.py" in _cmdline(p)]  # the job's reaper
    assert len(templates) == 1 and len(reapers) == 1 and len(running) == 4, [_cmdline(p)[:80] for p in running]
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(10)
    assert_nothing_left(job.tag, within=15)  # SIGTERM from the template, SIGKILL after the grace


def test_ssh_hosts_fork_their_workers_from_their_own_template(job, sshd_clean):
    out = _out(job)
    r = job.run(["-np", "3", "-H", "127.0.0.2:2,127.0.0.3:1", *sshd_clean.ssh_args()],
                [sys.executable, str(PROBE), str(out)])
    assert r.returncode == 0, r.output
    res = _results(out, 3)
    assert all(x["warm"] for x in res), res
    assert all(x["threads_at_start"] == 1 for x in res), res
    assert len({x["torch_random"] for x in res}) == 3 and all(x["total"] == 3.0 for x in res)
    assert "warm start" not in r.stderr, r.stderr
    assert sshd_clean.wait_idle(10) == []


def test_ssh_driver_killed_9_leaves_nothing_remote(job, sshd_clean):
    out = _out(job)
    job.start(["-np", "2", "-H", "127.0.0.2:1,127.0.0.3:1", *sshd_clean.ssh_args()],
              [sys.executable, str(PROBE), str(out), "--hold", "120"])
    _wait_for(lambda: len(list(out.glob("rank-*.json"))) == 2, 90, "both workers to run")
    assert all(x["warm"] for x in _results(out, 2))
    assert any("elasticrun.worker.template" in _cmdline(p) for p in tagged_pids(job.tag))
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(10)
    assert_nothing_left(job.tag, within=20)
    assert sshd_clean.wait_idle(10) == []


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return 0


def _workers_on(tag: str, host: str) -> list[int]:
    """The job's workers started for ``host`` (templates carry no host name in their environment)."""
    needle = f"ELASTICRUN_HOSTNAME={host}".encode()
    found = []
    for pid in tagged_pids(tag):
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            pass
    return found


def test_ssh_host_lost_with_its_template_comes_back_warm_from_a_new_one(job, sshd_clean):
    """A spot machine vanishes: its worker and its template die at once. After the cooldown the
    host returns; its new worker is forked from a new template there (not started fresh, not
    refused), and the survivor trains on in its own process throughout."""
    job.start(["-np", "2", "--min-np", "1", "-H", "127.0.0.2:1,127.0.0.3:1", *sshd_clean.ssh_args(),
               "--blacklist-cooldown-range", "1", "1"],
              job.train_cmd("--await-size=3:1", "--await-size=5:2", epochs=40, sleep=0.05))
    _wait_for(lambda: job.log.exists() and '"epoch": 2' in job.log.read_text() or job.proc.poll() is not None,
              90, "epoch 2")  # epoch 3 then waits until the world has shrunk to 1
    assert job.proc.poll() is None, job.finish(timeout=5).output
    [old] = _workers_on(job.tag, "127.0.0.3")
    template = _ppid(old)
    assert "elasticrun.worker.template" in _cmdline(template), _cmdline(template)
    os.kill(template, signal.SIGKILL)  # the machine is gone: everything on it at once
    os.kill(old, signal.SIGKILL)

    def new_worker() -> int | None:
        fresh = [p for p in _workers_on(job.tag, "127.0.0.3") if p != old]
        return fresh[0] if fresh else None

    _wait_for(lambda: new_worker() is not None or job.proc.poll() is not None, 60, "a new worker on 127.0.0.3")
    assert job.proc.poll() is None, job.finish(timeout=5).output
    parent = _ppid(new_worker())
    assert parent != template and "elasticrun.worker.template" in _cmdline(parent), _cmdline(parent)
    r = job.finish()
    assert r.returncode == 0, r.output
    sizes = [e["size"] for e in r.log]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2, r.log
    assert all(e["rank"] == 0 and e["host"] == "127.0.0.2" for e in r.log)
    assert "host 127.0.0.3 blacklisted" in r.stderr, r.stderr
    # The lost template is named with its worker's end; its successor served without a fallback.
    assert "the warm-start template on this host went away while the worker ran" in r.stderr, r.stderr
    assert "no warm-start template there" not in r.stderr and "warm start" not in r.stderr, r.stderr
    assert sshd_clean.wait_idle(10) == []
