"""Issue 24 on real jobs: every rank's exit counts (plain commands too), a `.py` runs as torchrun
runs it, and a console that says each thing once, without contradiction.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

import pytest
from conftest import SCRIPTS, assert_nothing_left
from sshd import ssh_server, sshd_clean  # noqa: F401  (fixtures)

pytestmark = pytest.mark.timeout(180)


def elasticrun_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("[elasticrun]") or line.startswith("elasticrun:")]


def test_a_plain_command_runs_every_rank_to_its_end_and_fails_when_one_fails(job):
    r = job.run(["-np", "2", "-H", "localhost:2"],
                ["bash", "-c", "sleep $((1+2*HOROVOD_RANK)); echo done $HOROVOD_RANK; exit $HOROVOD_RANK"])
    assert r.returncode == 1, r.output
    assert "done 0" in r.stdout and "done 1" in r.stdout, r.output  # rank 1 was not killed when rank 0 ended
    assert elasticrun_lines(r.stderr)[-1] == "elasticrun: The job failed after " + \
        elasticrun_lines(r.stderr)[-1].split("after ", 1)[1], r.stderr
    assert "rank 1 (localhost[1]) exited with code 1." in r.stderr, r.stderr
    assert "training finished" not in r.stderr and "blacklisted" not in r.stderr, r.stderr
    assert "summary: 2 process(es) that never called hvd.init(), 1 failed" in r.stderr, r.stderr


def test_a_plain_command_that_fails_early_stops_the_others_at_once(job):
    """A rank failing before any worker reached the driver, in a job that cannot change size:
    as horovodrun, the job fails at once naming the rank, and the others are stopped (they ran
    to their end, or to --start-timeout, while a host was blacklisted as if elastic)."""
    started = time.monotonic()
    r = job.run(["-np", "3", "-H", "localhost:2,127.0.0.1:1"],
                ["bash", "-c", 'if [ "$HOROVOD_RANK" = 1 ]; then sleep 0.5; exit 3; fi; sleep 60; echo done'])
    assert r.returncode == 1, r.output
    assert time.monotonic() - started < 30 and "done" not in r.stdout, r.output
    assert "rank 1 (localhost[1]) exited with code 3." in r.stderr, r.stderr
    assert "blacklisted" not in r.stderr and "all workers failed" not in r.stderr, r.stderr
    assert "never called hvd.init(), 1 failed" in r.stderr, r.stderr  # the others were stopped


def test_a_plain_command_may_outlive_the_start_timeout(job):
    r = job.run(["-np", "2", "-H", "localhost:2", "--start-timeout", "1"],
                ["bash", "-c", "sleep 3; echo done $HOROVOD_RANK"])
    assert r.returncode == 0, r.output
    assert "done 0" in r.stdout and "done 1" in r.stdout
    assert "running them as plain processes" in r.stderr and "all 2 process(es) exited 0" in r.stderr, r.stderr


def test_a_slow_import_taken_for_a_plain_command_is_said_to_be_elastic_after_all(job):
    """The console said "running them as plain processes (... the job fails if one fails)";
    when a worker reaches the driver after all, the job recovers from failures again, and the
    console takes the first line back instead of contradicting it silently."""
    script = job.tmp / "slow.py"
    script.write_text("import time\ntime.sleep(2.5)\nimport torch\nimport elasticrun.torch as hvd\nhvd.init()\n"
                      "hvd.allreduce(torch.ones(1))\n")
    r = job.run(["-np", "2", "-H", "localhost:2", "--start-timeout", "1"], [sys.executable, str(script)])
    assert r.returncode == 0, r.output
    plain = r.stderr.index("running them as plain processes")
    after = r.stderr.index("called hvd.init() after all (")
    assert plain < after and "the job is elastic again" in r.stderr[after:], r.stderr


def test_a_rank_that_fails_after_another_finished_fails_the_job(job):
    script = job.tmp / "late.py"
    script.write_text("import sys, time\nimport torch\nimport elasticrun.torch as hvd\nhvd.init()\n"
                      "hvd.allreduce(torch.ones(1))\n"
                      "if hvd.rank() == 1:\n    time.sleep(1.5)\n    print('rank 1 fails late', flush=True)\n"
                      "    sys.exit(3)\n")
    r = job.run(["-np", "2", "-H", "localhost:2"], [sys.executable, str(script)])
    assert r.returncode == 1, r.output
    assert "rank 1 fails late" in r.stdout
    assert "rank 1 (localhost[1]) exited with code 3, after rank 0 finished" in r.stderr, r.stderr
    assert "job succeeded" not in r.stderr


def test_a_py_file_runs_with_this_python_as_torchrun_does(job):
    script = job.tmp / "hello.py"
    script.write_text("import elasticrun.torch as hvd\nhvd.init()\nprint('hello from rank', hvd.rank(), flush=True)\n")
    r = job.run(["-np", "2", "-H", "localhost:2"], [str(script)])
    assert r.returncode == 0, r.output
    assert "hello from rank 0" in r.stdout and "hello from rank 1" in r.stdout


def test_a_host_is_blacklisted_once_however_many_of_its_workers_fail(job):
    script = job.tmp / "fail.py"
    script.write_text("import sys\nimport elasticrun.torch as hvd\nhvd.init()\nsys.exit(2)\n")
    r = job.run(["-np", "2", "-H", "localhost:2"], [sys.executable, str(script)])
    assert r.returncode == 1, r.output
    assert r.stderr.count("host localhost blacklisted") == 1, r.stderr


def test_a_quiet_job_says_how_it_goes_and_routine_copies_stay_off_the_console(job):
    ckpt = job.tmp / "ckpt"
    logs = job.tmp / "samples"
    logs.mkdir()
    r = job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--status-interval", "1", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-interval", "0.3"],
                [sys.executable, str(SCRIPTS / "sample_train.py"), "--log-dir", str(logs), "--progress",
                 str(job.progress), "--epochs", "2", "--samples", "240", "--commit-every", "2", "--sleep", "0.03"])
    assert r.returncode == 0, r.output
    status = [line for line in r.stderr.splitlines() if "] status: " in line]
    assert status, r.stderr
    assert "round 0, 2 worker(s) on 2 host(s), step " in status[-1] and "last commit" in status[-1], status
    assert "durable copy" in status[-1] and " s old" in status[-1], status
    assert sum("durable copy" in line and "written" in line for line in r.stderr.splitlines()) == 1, r.stderr
    # graceful ends are not errors: no worker writes "exiting" on its stderr
    assert "exiting." not in r.stderr, r.stderr


def test_a_slow_teardown_after_the_script_is_no_hang(job):
    """32 ranks on 2 cores take seconds to tear their interpreters down (torch frees its memory,
    libraries run destructors): no heartbeat comes then, and the job must not call them hung.
    Here an exit handler that runs after elasticrun's (registered before hvd.init()) takes 3 s
    against a 1 s heartbeat timeout; and a rank that calls hvd.shutdown() and then works on
    (post-processing) is not killed either."""
    script = job.tmp / "slow_exit.py"
    script.write_text(
        "import atexit, time\nimport torch\nimport elasticrun.torch as hvd\n"
        "atexit.register(time.sleep, 3)\n"
        "hvd.init()\nhvd.allreduce(torch.ones(1))\n"
        "if hvd.rank() == 1:\n    hvd.shutdown()\n    time.sleep(3)\n    print('post-processing done', flush=True)\n")
    r = job.run(["-np", "2", "-H", "localhost:2", "--heartbeat-timeout", "1"], [sys.executable, str(script)])
    assert r.returncode == 0, r.output
    assert "post-processing done" in r.stdout, r.output
    assert "no heartbeat" not in r.stderr and "training finished" in r.stderr, r.stderr


def test_a_dismissed_worker_whose_script_stops_its_helper_after_training_still_ends(job):
    """The dismissal's SystemExit comes from inside the elastic function, so the script's
    code after it, which stops a non-daemon helper process, never ran, and Python waited for
    the helper at exit: the worker the console said "exits 0" lived on until the job's end,
    holding its slot. Now it ends within its grace (ELASTICRUN_EXIT_GRACE, 30 s by default),
    says why, and its launcher stops the helper."""
    marker = job.tmp / "shrink"
    discover = job.tmp / "discover.sh"
    discover.write_text(f"#!/bin/sh\necho localhost:1\n[ -f {marker} ] || echo 127.0.0.1:1\n")
    discover.chmod(0o755)
    script = job.tmp / "helper.py"
    script.write_text(
        "import multiprocessing as mp, os, sys, time\nimport torch\nimport elasticrun.torch as hvd\n"
        "def helper():\n    time.sleep(3600)\n"
        "if __name__ == '__main__':\n"
        "    hvd.init()\n"
        "    p = mp.get_context('fork').Process(target=helper); p.start()\n"
        f"    open(os.path.join({str(job.tmp)!r}, f'helper-{{hvd.rank()}}'), 'w').write(str(p.pid))\n"
        "    state = hvd.elastic.ObjectState(step=0)\n"
        "    @hvd.elastic.run\n"
        "    def train(state):\n"
        "        while state.step < 2000:\n"
        "            hvd.allreduce(torch.ones(1)); state.step += 1; time.sleep(0.01)\n"
        f"            if state.step == 20 and hvd.size() == 2:\n"
        f"                open({str(marker)!r}, 'w').close()\n"
        f"            other = os.path.join({str(job.tmp)!r}, 'helper-1')\n"
        "            if hvd.size() == 1 and state.step % 10 == 0 and os.path.exists(other):\n"
        "                try:\n                    os.kill(int(open(other).read()), 0)\n"
        "                except ProcessLookupError:\n"
        "                    print(f'the dismissed worker\\'s helper is gone at step {state.step}', flush=True)\n"
        "                    return\n"
        "            state.commit()\n"
        "    train(state)\n"
        "    p.terminate(); p.join()  # (after training: never reached by a dismissed worker)\n")
    r = job.run(["-np", "2", "--min-np", "1", "--host-discovery-script", str(discover), "--discovery-interval", "0.5"],
                [sys.executable, str(script)], timeout=120, ELASTICRUN_EXIT_GRACE="3")
    assert r.returncode == 0, r.output
    assert "127.0.0.1[0] exits 0: no place" in r.stderr, r.stderr
    assert "dismissed 3 s ago and still running" in r.stderr, r.stderr
    assert "helper is gone at step" in r.stdout, r.output


@pytest.mark.parametrize("where", ["local", "local, no warm start", "ssh"])
def test_what_a_worker_starts_in_a_session_of_its_own_ends_with_it(job, where, request):
    """A worker's child in a new session (`setsid`, `start_new_session=True`, a daemon) is out of
    reach of every signal to the worker's process group: it used to outlive the job."""
    hosts = ["-H", "localhost:1"] if where.startswith("local") else \
        ["-H", "127.0.0.2:1", *request.getfixturevalue("sshd_clean").ssh_args()]
    flags = ["--no-warm-start"] if "no warm" in where else []
    script = job.tmp / "escape.py"
    script.write_text("import subprocess\n"
                      "p = subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
                      "print('escaped', p.pid, flush=True)\n")
    r = job.run(["-np", "1", *hosts, *flags], [sys.executable, str(script)])  # (asserts nothing is left)
    assert r.returncode == 0, r.output
    pid = int(r.stdout.split("escaped ", 1)[1].split()[0])
    said = [line for line in r.stderr.splitlines() if "left running outside its process group" in line]
    assert len(said) == 1 and f"stopped 1 process(es)" in said[0] and f"{pid} (sleep 300)" in said[0], r.stderr


@pytest.mark.parametrize("hangs", ["first run", "later run"])
def test_elasticrun_killed_with_sigkill_leaves_no_discovery_script_behind(job, hangs):
    """A discovery run that hangs (with a child of its own) when the driver is SIGKILLed: the
    reaper, started before the first run, stops it; it used to run on, with its child."""
    count, hung = job.tmp / "count", job.tmp / "hung"
    first = "echo localhost:1; exit 0" if hangs == "later run" else ":"
    script = job.tmp / "discover.sh"
    script.write_text("#!/bin/bash\n"
                      f"n=$(( $(cat {count} 2>/dev/null || echo 0) + 1 )); echo $n > {count}\n"
                      f"if [ $n = 1 ]; then {first}; fi\n"
                      f"sleep 300 & touch {hung}; wait\n")
    script.chmod(0o755)
    job.start(["-np", "1", "--min-np", "1", "--host-discovery-script", str(script), "--discovery-interval", "0.2"],
              ["bash", "-c", "sleep 300"])
    deadline = time.monotonic() + 60
    while not hung.exists():
        assert time.monotonic() < deadline and job.proc.poll() is None, "the discovery script did not hang"
        time.sleep(0.05)
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(10)
    assert_nothing_left(job.tag, within=10)
    job.proc.communicate(timeout=10)


@pytest.mark.parametrize("where", ["local", "local, no warm start"])
def test_elasticrun_killed_with_sigkill_leaves_no_worker_and_nothing_a_worker_started(job, where):
    """Nothing stops the job when the driver is SIGKILLed (the OOM killer, `kill -9`) but the
    reaper it starts before its first worker here: a worker's children, in its process group or
    in a session of their own, used to outlive the job (a fresh worker's too, after its own
    heartbeats' 5 s)."""
    flags = ["--no-warm-start"] if "no warm" in where else []
    script = job.tmp / "helpers.py"
    script.write_text("import os, subprocess, sys, time\n"
                      "import elasticrun.torch as hvd\n"
                      "hvd.init()\n"
                      "a = subprocess.Popen(['sleep', '303'])\n"
                      "b = subprocess.Popen(['sleep', '304'], start_new_session=True)\n"
                      "path = os.path.join(sys.argv[1], str(hvd.rank()))\n"
                      "open(path + '.tmp', 'w').write(f'{a.pid} {b.pid}')\n"
                      "os.rename(path + '.tmp', path)  # whole when seen\n"
                      "time.sleep(300)\n")
    job.start(["-np", "2", "-H", "localhost:1,127.0.0.1:1", *flags], [sys.executable, str(script), str(job.markers)])
    deadline = time.monotonic() + 60
    while len(list(job.markers.glob("[0-9]"))) < 2:
        assert time.monotonic() < deadline and job.proc.poll() is None, "the workers did not start their helpers"
        time.sleep(0.05)
    helpers = [int(pid) for f in job.markers.glob("[0-9]") for pid in f.read_text().split()]
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(10)
    assert_nothing_left(job.tag, within=10)
    _, err = job.proc.communicate(timeout=10)  # (the reaper held the driver's stderr to its end)
    said = [line for line in err.splitlines() if "ended without stopping job" in line]
    assert len(said) == 1 and said[0].startswith(f"elasticrun: the driver (pid {job.proc.pid}) "), err
    count = int(said[0].split("stopped the ", 1)[1].split()[0])
    assert len(helpers) == 4 and count >= 2, said  # the escaped helpers, at least (the template may be first)


def test_a_rank_busy_alone_holds_the_others_said_but_not_failed(job):
    """Horovod's pattern: rank 0 evaluates (or saves) alone while the others wait in a
    collective. That is no failure (it failed at 60 s, then reset again and again under
    elastic.run); the wait says so once it is long (as Horovod's stall check does)."""
    script = job.tmp / "slow_root.py"
    script.write_text("import time, torch\nimport elasticrun.torch as hvd\nhvd.init()\n"
                      "if hvd.rank() == 0:\n    time.sleep(3.5)\n"
                      "x = hvd.broadcast(torch.ones(2) * (hvd.rank() + 1), root_rank=0, name='x')\n"
                      "print('got', x.tolist(), flush=True)\n")
    r = job.run(["-np", "2", "-H", "localhost:2", "--collective-timeout", "5"], [sys.executable, str(script)])
    assert r.returncode == 0, r.output
    assert r.stdout.count("got [1.0, 1.0]") == 2, r.output
    # (said at half the timeout, 2.5 s: the seconds printed are those waited by then, whenever rank 1 started)
    assert re.search(r"rank 1: broadcast x from rank 0 \(its arguments\) has waited [23] s for the other ranks",
                     r.stderr), r.stderr
    assert "waiting up to --collective-timeout 5 s" in r.stderr, r.stderr


CHATTY = """
import sys, time, torch
import elasticrun.torch as hvd
hvd.init()
model = torch.nn.Linear(4, 1)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01))
state = hvd.elastic.TorchState(model, opt, step=0)

@hvd.elastic.run
def train(state):
    while state.step < 150:
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
        for _ in range(10):
            print("x" * 4000, flush=True)
        state.step += 1
        state.commit()
        time.sleep(0.01)

train(state)
print("trained", state.step, flush=True)
"""


def job_took(out: str) -> float:
    return float(out.split("job succeeded in ", 1)[1].split(" s", 1)[0])


def test_a_console_nobody_reads_for_a_while_does_not_fail_the_job(job):
    """The console's reader pauses (Ctrl-S, a stalled SSH session to the login node, a log pipe
    that backs up) while workers print: the driver's loop blocked on its own status line, its
    workers heard nothing for 5 s and exited, and the job failed with every host blacklisted."""
    import subprocess

    script = job.tmp / "chatty.py"
    script.write_text(CHATTY)
    proc = subprocess.Popen([sys.executable, "-m", "elasticrun", "-np", "2", "-H", "localhost:2",
                             "--status-interval", "1", sys.executable, str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=job.env(),
                            cwd=job.tmp, start_new_session=True)
    try:
        time.sleep(14)  # the scenario itself: nobody reads the console for 14 s
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 0, out[-3000:]
    assert out.count("trained 150") == 2 and "has not answered" not in out, out[-3000:]
    assert "host localhost blacklisted" not in out and "job succeeded" in out, out[-3000:]
    assert job_took(out) > 10  # (training outlasted the pause: 12 MB of output, more than the queue holds)
    assert_nothing_left(job.tag)

