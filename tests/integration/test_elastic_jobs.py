"""End-to-end elastic jobs on this machine: real driver, real workers, real gloo.

``localhost``, ``127.0.0.1``, ``127.0.0.2``... are distinct hosts that all launch locally.
Each test checks what rank 0 logged at every epoch start (rank, size, host, rendezvous
count) and, through the ``job`` fixture, that no process of the job is left running.
"""

from __future__ import annotations

import os
import re
import sys
import signal
import time

import pytest

from conftest import PROGRESS_DISCOVERY, SCRIPTS

pytestmark = pytest.mark.timeout(240)

TWO = "localhost:{s},127.0.0.1:{s}"
THREE = "localhost:{s},127.0.0.1:{s},127.0.0.2:{s}"


def sizes(log: list[dict]) -> list[int]:
    return [e["size"] for e in log]


def discovery(schedule: str) -> dict[str, str]:
    return {"HOSTS_SCHEDULE": schedule}


@pytest.mark.parametrize("slots", [1, 2])
def test_hosts_added_then_removed(job, slots):
    """Grow from 2 to 3 hosts at epoch 2, shrink to 1 host at epoch 4; survivors keep training."""
    schedule = (f"0:{TWO.format(s=slots)};2:{THREE.format(s=slots)};4:localhost:{slots}")
    r = job.run(["-np", str(2 * slots), "--min-np", str(slots), "--max-np", str(3 * slots),
                 "--host-discovery-script", str(PROGRESS_DISCOVERY), "--discovery-interval", "0.2"],
                job.train_cmd(f"--await-size=3:{3 * slots}", f"--await-size=5:{slots}", epochs=7),
                **discovery(schedule))
    assert r.returncode == 0, r.output
    by_epoch = {e["epoch"]: e for e in r.log}
    assert sorted(by_epoch) == list(range(7)), r.log
    assert by_epoch[0]["size"] == 2 * slots
    assert by_epoch[3]["size"] == 3 * slots, r.log  # the added host joined
    assert by_epoch[5]["size"] == by_epoch[6]["size"] == slots, r.log  # the removals took effect
    assert all(e["rank"] == 0 and e["host"] == "localhost" for e in r.log)  # rank 0 never moved
    assert r.log[-1]["rendezvous"] >= 3  # initial + grow + shrink, in the same process
    assert "training finished" in r.stderr


def test_survivors_train_while_a_newcomer_prepares(job):
    """A worker launched into a running job takes its place at its first sync, not at
    hvd.init(): while it prepares (here: waits for rank 0 to train two more epochs, which
    would never happen if the survivors waited for it), the survivors train; then it joins
    them in one reset."""
    schedule = f"0:{TWO.format(s=1)};2:{THREE.format(s=1)}"
    r = job.run(["-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.2"],
                job.train_cmd("--prepare-epochs=2", "--await-size=8:3", epochs=9), **discovery(schedule))
    assert r.returncode == 0, r.output
    assert "prepared while the survivors trained epochs" in r.output, r.output
    by_epoch = {e["epoch"]: e for e in r.log}
    assert by_epoch[8]["size"] == 3, r.log
    assert by_epoch[8]["rendezvous"] == 2, r.log  # round 0, then one reset that took the newcomer in
    assert all(e["rank"] == 0 and e["host"] == "localhost" for e in r.log)


def test_a_newcomer_off_the_script_fails_alone_and_the_survivors_train_on(job):
    """A ported script kept Horovod's broadcast_parameters before the elastic function: round 0
    runs it together, but a newcomer calls it while the survivors sync the state. Every rank
    raised CollectiveMismatch, the job ended and every host was blacklisted; now the newcomer
    fails with the advice, its host is blacklisted, and the survivors go on from their commit."""
    schedule = f"0:{TWO.format(s=1)};2:{THREE.format(s=1)}"
    r = job.run(["-np", "2", "--min-np", "2", "--max-np", "3", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.2"],
                job.train_cmd("--ported-broadcast", "--await-round=4:2", epochs=6), **discovery(schedule))
    assert r.returncode == 0, r.output
    assert sizes(r.log) == [2] * 6, r.log
    assert all(e["rank"] == 0 and e["host"] == "localhost" for e in r.log)
    failed = [line for line in r.stderr.splitlines() if "127.0.0.2[0]" in line and "failed: CollectiveMismatch" in line]
    assert failed and "broadcast_parameters" in failed[0] and "remove those calls" in failed[0], r.stderr
    assert "host 127.0.0.2 blacklisted" in r.stderr, r.stderr
    assert "host localhost blacklisted" not in r.stderr and "host 127.0.0.1 blacklisted" not in r.stderr, r.stderr


def test_a_listed_host_whose_name_does_not_resolve_is_said_and_left_unused(job):
    """A node listed before its DNS record exists: its name is looked up off the driver's loop
    (a lookup can take the resolver's 5 s, and a loop that waited for one was taken for gone by
    every worker), said once, and left out until it resolves: no worker fails there, nothing
    is blacklisted, and the job trains on the others."""
    r = job.run(["-np", "1", "--max-np", "2", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.2"],
                job.train_cmd(epochs=3), HOSTS_SCHEDULE="0:localhost:1,nosuch-node.invalid:1")
    assert r.returncode == 0, r.output
    assert r.stderr.count("cannot resolve host name 'nosuch-node.invalid'") == 1, r.stderr
    assert "nosuch-node.invalid is not used until it resolves" in r.stderr, r.stderr
    assert "blacklisted hosts: none" in r.stderr and "never started" not in r.stderr, r.stderr
    assert {e["size"] for e in r.log} == {1}, r.log


@pytest.mark.parametrize("mode", ["exception", "sigkill", "latekill"])
@pytest.mark.parametrize("hosts", ["discovery", "fixed"])
def test_one_rank_fails_and_survivors_continue(job, mode, hosts):
    """Survivors recover in-process; none may sit out the collective timeout (30 s here)."""
    if hosts == "discovery":
        source = ["--host-discovery-script", str(PROGRESS_DISCOVERY)]
        env = discovery(f"0:{THREE.format(s=1)}")
    else:
        source, env = ["-H", THREE.format(s=1)], {}
    r = job.run(["-np", "3", "--min-np", "2", "--collective-timeout", "30", *source],
                job.train_cmd(f"--fail=127.0.0.2:0@2:{mode}", epochs=5), **env)
    assert r.returncode == 0, r.output
    assert r.seconds < 25, f"recovery waited for a timeout ({r.seconds:.1f} s)\n{r.stderr}"
    assert sizes(r.log)[:2] == [3, 3] and sizes(r.log)[-1] == 2, r.log
    assert r.log[-1]["rendezvous"] == 2  # survivors re-formed in-process, once
    assert "host 127.0.0.2 blacklisted" in r.stderr
    expected = "failed: RuntimeError: injected failure" if mode == "exception" else "exited with code -9"
    assert f"127.0.0.2[0] (rank 2) {expected}" in r.stderr


def test_ranks_not_talking_to_the_victim_abandon_their_collective(job):
    """With 4 ranks, some survivors wait on a peer that already left for the next round, not on
    the dead one: only the driver's abort (not a socket error) can free them before the timeout."""
    r = job.run(["-np", "4", "--min-np", "3", "--collective-timeout", "30",
                 "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1,127.0.0.3:1"],
                job.train_cmd("--fail=127.0.0.3:0@1:latekill", epochs=3, batches=4))
    assert r.returncode == 0, r.output
    assert r.seconds < 25, f"recovery waited for a timeout ({r.seconds:.1f} s)\n{r.stderr}"
    assert [e["size"] for e in r.log][-1] == 3


def test_fixed_single_host_recovers_from_failure(job):
    """-H with one host and --min-np: fault tolerance without scaling, on a single host."""
    r = job.run(["-np", "2", "--min-np", "1", "-H", "localhost:2"],
                job.train_cmd("--fail=localhost:1@1:exception", epochs=3))
    # localhost[1] failing blacklists localhost, the only host, for good (as horovodrun does):
    # its healthy worker has nobody to hand the state to, so the job fails, saying why.
    assert r.returncode == 1, r.output
    assert "localhost[1] (rank 1) failed: RuntimeError: injected failure" in r.stderr, r.stderr
    assert "every host is blacklisted after failures: localhost" in r.stderr, r.stderr


def test_all_ranks_fail(job):
    r = job.run(["-np", "2", "-H", TWO.format(s=1)], job.train_cmd("--fail=*@1:exit", epochs=3))
    assert r.returncode == 1, r.output
    assert "all workers failed" in r.stderr, r.stderr
    assert "exited with code 3" in r.stderr
    assert "[elasticrun] summary: 1 round(s)" in r.stderr  # failures end with the summary too


def test_failure_on_every_host(job):
    """Host failures in successive rounds exhaust the hosts: the job fails naming them."""
    r = job.run(["-np", "2", "--min-np", "1", "-H", TWO.format(s=1)],
                job.train_cmd("--fail=127.0.0.1:0@1:exception", "--fail=localhost:0@2:exception", epochs=4))
    assert r.returncode == 1, r.output
    assert "The job failed" in r.stderr
    assert "blacklisted" in r.stderr


def test_elastic_timeout_expires(job):
    """Discovery could list the host again (or another): the job waits, up to --elastic-timeout."""
    r = job.run(["-np", "2", "--min-np", "2", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--elastic-timeout", "1.5"],
                job.train_cmd("--fail=127.0.0.1:0@1:sigkill", epochs=4), **discovery(f"0:{TWO.format(s=1)}"))
    assert r.returncode == 1, r.output
    assert "timed out after 1.5 s (--elastic-timeout) waiting for 2 slots" in r.stderr, r.stderr


def test_a_fixed_host_list_that_can_never_give_min_np_again_fails_at_once(job):
    """-H and permanent blacklisting: no host can come back, so waiting --elastic-timeout (600 s)
    would be for nothing (docs/troubleshooting.md: `can never be met again`)."""
    r = job.run(["-np", "2", "--min-np", "2", "-H", TWO.format(s=1)],
                job.train_cmd("--fail=127.0.0.1:0@1:sigkill", epochs=4))
    assert r.returncode == 1, r.output
    assert "--min-np 2 can never be met again: usable hosts" in r.stderr, r.stderr
    assert "giving up in" not in r.stderr, r.stderr  # no wait


@pytest.mark.parametrize("limit,ok", [(1, False), (2, True)])
def test_reset_limit(job, limit, ok):
    """Two resets are needed (a failure, then a removal): limit 1 fails, limit 2 succeeds."""
    schedule = f"0:{THREE.format(s=1)};3:localhost:1,127.0.0.2:1"  # at epoch 3, 127.0.0.1 leaves
    r = job.run(["-np", "3", "--min-np", "1", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.2", "--reset-limit", str(limit)],
                job.train_cmd("--fail=127.0.0.2:0@1:exception", "--await-size=4:1", epochs=5),
                **discovery(schedule))
    if ok:
        assert r.returncode == 0, r.output
        assert sizes(r.log) == [3, 3, 2, 2, 2, 1], r.log  # epoch 1 is redone after the rollback
    else:
        assert r.returncode == 1, r.output
        assert f"reset limit {limit} exceeded" in r.stderr, r.stderr


def test_blacklisted_host_returns_after_cooldown(job):
    r = job.run(["-np", "2", "--min-np", "1", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--blacklist-cooldown-range", "1", "2", "--discovery-interval", "0.2"],
                job.train_cmd("--fail=127.0.0.1:0@1:exception", "--await-size=3:2", epochs=4),
                **discovery(f"0:{TWO.format(s=1)}"))
    assert r.returncode == 0, r.output
    s = sizes(r.log)
    assert s[0] == 2 and 1 in s and s[-1] == 2, r.log  # lost the host, then got it back
    assert r.log[-1]["rendezvous"] == 3  # the survivor stayed the same process throughout
    assert "host 127.0.0.1 is back after its blacklist cooldown" in r.stderr


def test_output_prefixes_and_per_rank_files(job):
    out_dir = job.tmp / "logs"
    r = job.run(["-np", "2", "-H", TWO.format(s=1), "--output-filename", str(out_dir)],
                job.train_cmd(epochs=1, batches=2))
    assert r.returncode == 0, r.output
    assert "[0]<stdout>:finished rank=0" in r.stdout and "[1]<stdout>:finished rank=1" in r.stdout
    assert "finished rank=1" in (out_dir / "rank.1" / "stdout").read_text()


def test_a_driver_started_with_stdout_closed_keeps_every_worker(job):
    """``elasticrun ... >&-`` (a daemon's closed stdout): Python gives the driver no sys.stdout.
    The pump of the first line a worker printed died of it, the worker's next print got EPIPE,
    and each healthy host was blacklisted for it. Now the console is gone from the start, the
    per-rank files get everything, and training goes on."""
    wrapper = job.tmp / "closed_stdout.py"
    wrapper.write_text("import os, sys\nos.close(1)\n"
                       "os.execv(sys.executable, [sys.executable, '-m', 'elasticrun', *sys.argv[1:]])\n")
    out_dir = job.tmp / "logs"
    chatty = [sys.executable, "-c", "import time, elasticrun.torch as hvd; hvd.init()\n"
              "for i in range(20): print('line', i, flush=True); time.sleep(0.01)\n"
              "hvd.allreduce(__import__('torch').ones(1))"]
    job.start(["-np", "2", "-H", TWO.format(s=1), "--output-filename", str(out_dir)], chatty,
              driver=[str(wrapper)])
    r = job.finish()
    assert r.returncode == 0, r.output
    assert "failed" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout == ""
    for rank in (0, 1):
        assert (out_dir / f"rank.{rank}" / "stdout").read_text().count("line ") == 20


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_every_worker(job, sig):
    job.start(["-np", "2", "-H", TWO.format(s=1)], job.train_cmd(epochs=1000, batches=5, sleep=0.05))
    deadline = time.monotonic() + 60
    while not (job.log.exists() and job.log.read_text().count("\n") >= 2):  # training is under way
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.05)
    os.kill(job.proc.pid, sig)
    # Read the driver's stderr up to its "received" line (byte by byte: nothing read ahead is
    # lost to finish()), so that a second signal lands while it stops the workers.
    seen = b""
    while f"received {sig.name}: stopping".encode() not in seen:
        byte = os.read(job.proc.stderr.fileno(), 1)
        assert byte, seen.decode()
        seen += byte
    os.kill(job.proc.pid, sig)  # an impatient second Ctrl-C must not break the stop
    r = job.finish(timeout=30)  # asserts that nothing is left behind
    stderr = seen.decode() + r.stderr
    assert r.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr, stderr
    # The exit summary, as at a normal end, comes after the workers are stopped.
    assert re.search(r"^\[elasticrun\] summary: 1 round\(s\), 0 reset\(s\) .*; blacklisted hosts: none$",
                     stderr, re.M), stderr


@pytest.mark.parametrize("inside", [
    "elasticrun.driver.driver:ElasticDriver._on_heartbeat",  # a request's handler (any error there is logged)
    "elasticrun.driver.console:ConsoleHandler.emit",  # a console line (logging reports its errors and goes on)
    "elasticrun.driver.registry:Registry.decide",  # a decision, between reading the events and acting on them
])
def test_one_sigterm_stops_the_job_wherever_it_lands(job, inside):
    """The driver's SIGTERM used to be an Exception raised wherever the signal landed: in a
    request's handler or a log line's write, which take any Exception for an error of theirs,
    it was said ("ignored a 'heartbeat' request ...: _Interrupted: SIGTERM") and the job went on."""
    when = job.tmp / "signal-now"
    job.start(["-np", "2", "-H", TWO.format(s=1), "--status-interval", "0.2"],
              job.train_cmd(epochs=1000, batches=5, sleep=0.05),
              driver=[str(SCRIPTS / "signal_inside.py")], SIGNAL_IN=inside, SIGNAL_WHEN=str(when))
    deadline = time.monotonic() + 60
    while not (job.log.exists() and job.log.read_text().count("\n") >= 2):  # training is under way
        assert time.monotonic() < deadline, "the job never started training"
        time.sleep(0.05)
    when.touch()
    touched = time.monotonic()
    r = job.finish(timeout=60)  # asserts that nothing is left behind
    took = time.monotonic() - touched
    assert r.returncode == 128 + signal.SIGTERM, r.stderr
    assert "received SIGTERM: stopping 2 worker(s)" in r.stderr, r.stderr
    for never in ("_Interrupted", "Traceback", "Logging error", "ignored a"):
        assert never not in r.stderr, r.stderr
    assert took < 20, f"took {took:.1f} s\n{r.stderr}"


def test_misconfigured_discovery_script_fails_at_once(job, tmp_path):
    script = tmp_path / "broken.sh"
    script.write_text("#!/bin/sh\necho 'cannot reach the scheduler' >&2\nexit 4\n")
    script.chmod(0o755)
    r = job.run(["-np", "2", "--host-discovery-script", str(script)], job.train_cmd(epochs=1))
    assert r.returncode == 2, r.output
    assert "misconfigured" in r.stderr and "exited with code 4" in r.stderr
    assert "cannot reach the scheduler" in r.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_a_hanging_first_discovery_stops_it(job, tmp_path, sig):
    """A discovery script that hangs (a scheduler's API that does not answer) and a stop before
    it has answered: the driver stops the script, says so in one line, and exits 128+N. It
    used to die of the SIGTERM without a word and leave the script running (a Ctrl-C gave a
    traceback)."""
    script, started = tmp_path / "hangs.sh", tmp_path / "asked"
    script.write_text(f"#!/bin/sh\ntouch {started}\nsleep 600\n")
    script.chmod(0o755)
    job.start(["-np", "2", "--host-discovery-script", str(script), "--discovery-timeout", "300"],
              job.train_cmd(epochs=1))
    deadline = time.monotonic() + 30
    while not started.exists():
        assert time.monotonic() < deadline and job.proc.poll() is None, "the discovery script never ran"
        time.sleep(0.02)
    os.kill(job.proc.pid, sig)
    r = job.finish(timeout=30)  # asserts that nothing is left behind: the script's sleep included
    assert r.returncode == 128 + sig, r.output
    assert r.stderr.strip() == f"[elasticrun] received {sig.name} before any worker started: stopped", r.stderr


def test_the_first_wait_for_discovered_slots_is_the_elastic_timeout(job):
    """As horovodrun's (wait_for_available_slots): an autoscaled cluster's nodes take minutes
    to appear, longer than --start-timeout, which bounds a started worker's first contact."""
    r = job.run(["-np", "3", "--host-discovery-script", str(PROGRESS_DISCOVERY), "--start-timeout", "0.5",
                 "--elastic-timeout", "1.5"],
                job.train_cmd(epochs=1), **discovery(f"0:{TWO.format(s=1)}"))
    assert r.returncode == 1, r.output
    assert "timed out after 1.5 s (--elastic-timeout) waiting for 3 slots" in r.stderr, r.stderr


def test_the_first_wait_for_np_starts_with_min_np_discovered_slots_when_it_runs_out(job):
    """With --min-np below -np, the job starts with the slots discovery gives by then instead of
    failing (horovodrun fails), as the wait's line says."""
    r = job.run(["-np", "3", "--min-np", "2", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--elastic-timeout", "1.5"],
                job.train_cmd(epochs=1), **discovery(f"0:{TWO.format(s=1)}"))
    assert r.returncode == 0, r.output
    assert "the job starts with the slots usable then if they are --min-np 2 or more" in r.stderr, r.stderr
    assert ("discovery listed 2 usable slot(s), not -np 3, within --elastic-timeout 1.5 s: starting with 2 "
            "(--min-np 2)") in r.stderr, r.stderr
    assert "round 0: 2 worker(s) on 2 host(s)" in r.stderr, r.stderr


def test_discovery_command_line_with_arguments(job, tmp_path):
    """As with horovodrun, the discovery "script" may be a command line with arguments."""
    script = tmp_path / "discover.py"
    script.write_text("import sys\nfor host in sys.argv[1:]:\n    print(host)\n")
    command = f"{sys.executable} {script} localhost:1 '127.0.0.1:1'"
    r = job.run(["-np", "2", "--host-discovery-script", command], job.train_cmd(epochs=1))
    assert r.returncode == 0, r.output
    assert "round 0: 2 worker(s) on 2 host(s)" in r.stderr, r.stderr


def test_fixed_hosts_use_every_slot_and_survive_losing_one_host(job):
    """Issue 11.3, as Horovod: with --min-np the job is elastic and uses every slot of -H
    (--max-np unbounded); -np is what it waits for. Losing a host leaves 2 free slots."""
    r = job.run(["-np", "2", "--min-np", "2", "-H", "localhost:2,127.0.0.1:2"],
                job.train_cmd("--fail=localhost:0@2:exception", epochs=4))
    assert r.returncode == 0, r.output
    assert "round 0: 4 worker(s) on 2 host(s)" in r.stderr, r.stderr
    assert sizes(r.log)[:2] == [4, 4] and sizes(r.log)[-1] == 2, r.log
    assert "host localhost blacklisted" in r.stderr


@pytest.mark.parametrize("max_np", [None, "4"])
def test_without_min_np_the_job_is_np_processes(job, max_np):
    """As horovodrun (its _is_elastic): --max-np alone does not make a job elastic; it is said."""
    extra = ["--max-np", max_np] if max_np else []
    r = job.run(["-np", "2", *extra, "-H", "localhost:2,127.0.0.1:2"], job.train_cmd(epochs=1))
    assert r.returncode == 0, r.output
    assert "round 0: 2 worker(s) on 1 host(s)" in r.stderr, r.stderr
    said = "--max-np 4 has no effect without --min-np or a discovery script (as with horovodrun)"
    assert (said in r.stderr) == bool(max_np), r.stderr


def test_no_host_option_runs_np_workers_here(job):
    """horovodrun -np 2 python train.py runs on localhost:2; so does elasticrun."""
    r = job.run(["-np", "2"], job.train_cmd(epochs=1))
    assert r.returncode == 0, r.output
    assert "round 0: 2 worker(s) on 1 host(s)" in r.stderr, r.stderr
    assert sizes(r.log) == [2]


def test_script_arguments_that_look_like_ours_belong_to_the_script(job, tmp_path):
    """--n would be an ambiguous abbreviation of our --num-proc/...; after the command it is
    the script's."""
    script = tmp_path / "args.py"
    script.write_text("import sys\nprint('argv=' + ' '.join(sys.argv[1:]), flush=True)\n")
    r = job.run(["-np", "1", "-H", "localhost:1"], [sys.executable, str(script), "--n", "3", "--verbose", "-np", "7"])
    assert r.returncode == 0, r.output
    assert "[0]<stdout>:argv=--n 3 --verbose -np 7" in r.stdout, r.output
