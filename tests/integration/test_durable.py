"""Issue 14 on real jobs: warnings (SIGTERM, a draining host) become lossless exits, and with
--checkpoint-dir the job survives losing every worker, or its driver.

Exactly-once is proven from the committed sample logs (tests/integration/scripts/sample_train.py:
each batch is logged with the commit that saved it). After a resume from a durable copy of
commit C, the batches that the lost workers committed after C were never durable: they are
left out of the committed history, and must be trained again, exactly once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    PROGRESS_DISCOVERY,
    SCRIPTS,
    assert_each_sample_once,
    assert_nothing_left,
    env_of,
    tagged_pids,
)

pytestmark = pytest.mark.timeout(240)

SAMPLES, EPOCHS = 240, 3
#: The driver's line after a resume; "(about N s of training)" only when it heard of a later step.
RESUMED = (r"resumed from checkpoint of .*, (at least \d+ steps back( \(at least [\d.]+ s of training\))?|no later step "
           r"known to the driver) \(commit \d+, ")


def entries(log_dir: Path) -> list[dict]:
    return [json.loads(line) for p in log_dir.glob("samples-*.jsonl") for line in p.read_text().splitlines()]


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def assert_exactly_once(history: list[dict]) -> None:
    assert_each_sample_once(history, EPOCHS, SAMPLES)


def sample_cmd(job, *extra: str) -> list[str]:
    logs = job.tmp / "samples"
    logs.mkdir(exist_ok=True)
    return [sys.executable, str(SCRIPTS / "sample_train.py"), "--log-dir", str(logs), "--progress",
            str(job.progress), "--epochs", str(EPOCHS), "--samples", str(SAMPLES), *extra]


def progress(job) -> int:
    try:
        return int(job.progress.read_text())
    except (OSError, ValueError):
        return -1


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


# --- warnings become graceful exits --------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["step", "synchronize"])
def test_a_worker_told_to_stop_leaves_at_its_next_commit_without_a_rollback(job, pattern):
    """SIGTERM to one worker of 4 (a reclaim notice): its host is out at the next commit (every
    3 steps here), the survivors lose nothing (no rollback, no sample twice), the worker exits 0.
    The agreement rides in the steps' gradient allreduce: the commit needs no collective of its
    own. Also with Horovod's clipping pattern (``synchronize()``, clip, ``step()`` under
    ``skip_synchronize()``), where the step's end is the explicit ``synchronize()``."""
    extra = ["--clip"] if pattern == "synchronize" else []
    r = job.run(["-np", "4", "--min-np", "3", "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1,127.0.0.3:1",
                 "--events", str(job.tmp / "events.jsonl")],
                sample_cmd(job, "--commit-every", "3", "--sigterm", "127.0.0.3:0@1:3", "--sleep", "0.05", *extra))
    assert r.returncode == 0, r.output
    assert "host 127.0.0.3 leaving (SIGTERM)" in r.stderr, r.stderr
    assert "aborted" not in r.stderr and "exited with code" not in r.stderr, r.stderr  # no rollback, no failure
    assert "127.0.0.3[0] exits 0: no place for 127.0.0.3[0] in the next round" in r.stderr
    log = entries(job.tmp / "samples")
    assert {e["size"] for e in log} == {4, 3}
    assert_exactly_once(log)
    # Out at its next commit: the leaving worker trained at most the 3 batches of a commit, and one
    # more whose step the leave reached after the agreeing allreduce, after its SIGTERM.
    after = [e for e in log if e["epoch"] == 1 and e["size"] == 4 and e["batch"] > 3]
    assert len({e["batch"] for e in after}) <= 4, sorted({e["batch"] for e in after})
    interrupts = [e for e in events(job.tmp / "events.jsonl") if e["kind"] == "interrupt"]
    assert interrupts and all(e.get("agreed_in") == "gradient allreduce" for e in interrupts), interrupts


def test_the_same_sigterm_twice_within_a_second_is_one_leave(job):
    """A machine's shutdown signals every process: the worker, and the SSH watchdog (or warm-start
    template) over it, which forwards its own SIGTERM to the worker's group. The worker took the
    second for a user insisting and stopped at once: a rollback instead of a leave."""
    r = job.run(["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.2:1"],
                sample_cmd(job, "--commit-every", "1000", "--sigterm", "127.0.0.2:0@1:3", "--sigterm-twice",
                           "--sleep", "0.05"))
    assert r.returncode == 0, r.output
    assert "host 127.0.0.2 leaving (SIGTERM)" in r.stderr, r.stderr
    assert "a second SIGTERM" not in r.output and "aborted" not in r.stderr, r.output
    assert "127.0.0.2[0] exits 0: no place for 127.0.0.2[0] in the next round" in r.stderr, r.stderr
    log = entries(job.tmp / "samples")
    assert {e["size"] for e in log} == {2, 1}
    assert_exactly_once(log)


@pytest.mark.parametrize("context", ["fork", "forkserver"])
def test_a_sigterm_to_every_process_of_a_worker_with_dataloader_workers_is_still_a_leave(job, context):
    """A machine's shutdown or Slurm's preemption sends SIGTERM to every process at once: the
    worker and its DataLoader's workers. Those must not die of it while the worker leaves (its
    next batch then failed: a rollback and a blacklisted host instead of a leave). forkserver
    (Python 3.14's default, Horovod's examples' choice): its workers import the script again,
    hvd.init() at its top included, and are the forkserver's children."""
    r = job.run(["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.2:1"],
                sample_cmd(job, "--commit-every", "1000", "--loader-context", context, "--sigterm-group",
                           "127.0.0.2:0@1:3", "--sleep", "0.05",
                           # (each epoch's loader workers import torch and the script: keep them few)
                           "--loader-workers", "2" if context == "fork" else "1"))
    assert r.returncode == 0, r.output
    assert "host 127.0.0.2 leaving (SIGTERM)" in r.stderr, r.stderr
    assert "127.0.0.2[0] exits 0: no place for 127.0.0.2[0] in the next round" in r.stderr, r.stderr
    assert "aborted" not in r.stderr and "blacklisted hosts: none" in r.stderr, r.stderr
    assert "killed by signal" not in r.output and "Traceback" not in r.output, r.output
    log = entries(job.tmp / "samples")
    assert {e["size"] for e in log} == {2, 1}
    assert_exactly_once(log)


def test_a_host_discovery_lists_as_draining_is_out_at_the_next_commit(job):
    """Commits every 2 steps: the host is out at the first commit after the notice's agreement."""
    schedule = "0:localhost:1,127.0.0.1:1,127.0.0.2:1;1004:localhost:1,127.0.0.1:1,127.0.0.2:1 draining"
    r = job.run(["-np", "3", "--min-np", "2", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.1", "--events", str(job.tmp / "events.jsonl")],
                sample_cmd(job, "--commit-every", "2", "--sleep", "0.05", "--await-size=2:5:2"), HOSTS_SCHEDULE=schedule)
    assert r.returncode == 0, r.output
    assert "host 127.0.0.2 is about to go (discovery lists it draining)" in r.stderr, r.stderr
    assert "aborted" not in r.stderr
    log = entries(job.tmp / "samples")
    assert {e["size"] for e in log} == {3, 2}
    assert_exactly_once(log)
    ev = events(job.tmp / "events.jsonl")
    noticed = next(e["t"] for e in ev if e["kind"] == "host_draining")
    formed = next(e["t"] for e in ev if e["kind"] == "round_formed" and e["t"] > noticed)
    steps = [e for e in log if e["rank"] == 0 and noticed < e["t"] < formed]
    assert len(steps) <= 3, f"{len(steps)} steps between the notice and the new round"
    assert not any(e["kind"] == "worker_started" and e["host"] == "127.0.0.2" and e["t"] > noticed for e in ev)


def test_a_sigterm_before_hvd_init_is_a_leave_and_the_host_may_come_back(job):
    """A worker reclaimed while it starts (importing torch, loading its data: before hvd.init()
    installs the handler that says "leaving") dies of the SIGTERM. That is the same news as a
    leave: its host is going. It used to get the host blacklisted for good, so a pod that
    Kubernetes brings back under its name never got a worker again. Now the host is moved out
    and, once discovery lists it anew, it trains with the job."""
    # Listed at batch 2 of epoch 1, absent from 12 to 30 (the driver must see it gone after the
    # leave to take it back), listed again from 30; rank 0 holds at epoch 2, batch 10 until it is in.
    schedule = "0:localhost:1;1002:localhost:1,127.0.0.1:1;1012:localhost:1;1030:localhost:1,127.0.0.1:1"
    ev_path = job.tmp / "events.jsonl"
    r = job.run(["-np", "1", "--max-np", "2", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.1", "--events", str(ev_path)],
                sample_cmd(job, "--commit-every", "2", "--sleep", "0.05", "--sigterm-at-start", "127.0.0.1",
                           "--await-size=2:10:2"),
                HOSTS_SCHEDULE=schedule)
    assert r.returncode == 0, r.output
    err = r.stderr
    assert re.search(r"127\.0\.0\.1\[0\] \(rank \d+\) exited with code -15\n.*host 127\.0\.0\.1 leaving \(SIGTERM\)",
                     err), err
    assert "blacklisted" not in err.replace("blacklisted hosts: none", ""), err
    assert "aborted" not in err, err  # it was not a member: the round trained on untouched
    log = entries(job.tmp / "samples")
    assert_exactly_once(log)
    # Back once discovery listed it anew: a second worker there trained with the job.
    assert any(e["size"] == 2 for e in log), sorted({(e["epoch"], e["size"]) for e in log})
    started = [e for e in events(ev_path) if e["kind"] == "worker_started" and e["host"] == "127.0.0.1"]
    assert len(started) == 2, started


# --- the job outlives its workers ----------------------------------------------------------------
def committed_history(log: list[dict], ev: list[dict]) -> tuple[list[dict], dict]:
    """The committed history across one resume from a durable copy: batches committed after
    the restored commit by the workers that were lost are not part of it."""
    resumed = next(e for e in ev if e["kind"] == "resumed")
    lost = [e for e in log if e["round"] < resumed["round"] and e["commit"] > resumed["commit"]]
    return [e for e in log if e not in lost], resumed


def test_every_worker_lost_then_resumed_from_the_durable_copy(job):
    """The whole pool is reclaimed at once (every worker SIGKILLed mid-epoch); discovery lists
    the hosts again: the driver waits, starts new workers, and rank 0 restores the newest
    durable copy. Nothing committed is lost; what was done since the copy is redone once."""
    ckpt, ev_path = job.tmp / "ckpt", job.tmp / "events.jsonl"
    r = job.run(["-np", "2", "--min-np", "2", "--host-discovery-script", str(PROGRESS_DISCOVERY),
                 "--discovery-interval", "0.1", "--checkpoint-dir", str(ckpt), "--checkpoint-interval", "0.3",
                 "--events", str(ev_path)],
                sample_cmd(job, "--commit-every", "2", "--kill-all", "1:13", "--sleep", "0.03"),
                HOSTS_SCHEDULE="0:localhost:1,127.0.0.1:1")
    assert r.returncode == 0, r.output
    assert "every worker is gone; waiting up to --elastic-timeout" in r.stderr, r.stderr
    # Losing every worker at once is no host's fault: none is named blacklisted, then let back.
    assert "blacklisted" not in r.stderr.replace("blacklisted hosts: none", ""), r.stderr
    assert re.search(RESUMED, r.stderr), r.stderr
    # The reset from the loss to the first step after the resume is timed like any other.
    assert re.search(r"reset 1 \(.*\): 2 -> 2 worker\(s\), training again \d+ ms after it", r.stderr), r.stderr
    assert "ended before training resumed" not in r.stderr, r.stderr
    assert "durable copy" in r.stderr and "written in" in r.stderr
    history, resumed = committed_history(entries(job.tmp / "samples"), events(ev_path))
    assert resumed["commit"] > 0 and resumed["steps_back"] >= 0
    assert_exactly_once(history)
    assert len(list(ckpt.glob("ckpt-*"))) == 2  # the newest two are kept


def test_hosts_reclaimed_seconds_apart_the_first_named_then_let_back_truthfully(job):
    """A spot pool takes one host, then, while the survivor waits for a second slot
    (--min-np 2), the other. The first is named blacklisted once the survivor has settled;
    losing the second lets it back with a line that does not claim they were lost at once,
    and the job resumes from the durable copy, every committed sample once."""
    ckpt, ev_path = job.tmp / "ckpt", job.tmp / "events.jsonl"
    job.start(["-np", "2", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt),
               "--checkpoint-interval", "0.3", "--events", str(ev_path)],
              sample_cmd(job, "--commit-every", "2", "--kill", "127.0.0.1:0@1:3", "--sleep", "0.03"))
    wait_for(lambda: any(e["kind"] == "host_blacklisted" for e in events(ev_path)), 90,
             "127.0.0.1 to be named blacklisted")
    # The other host is reclaimed: its worker, and its warm-start template if it has one.
    victims = [pid for pid in tagged_pids(job.tag) if env_of(pid).get("ELASTICRUN_HOSTNAME") == "localhost"]
    assert victims
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    r = job.finish(180)
    assert r.returncode == 0, r.output
    err = r.stderr
    assert "host 127.0.0.1 blacklisted permanently" in err, err
    assert ("host 127.0.0.1 is let back: since it failed, every other worker has been lost too, which is no one "
            "host's fault") in err, err
    assert "at once" not in err and "host localhost blacklisted" not in err, err
    assert err.index("blacklisted permanently") < err.index("is let back") < err.index("every worker is gone")
    assert "blacklisted hosts: none" in err, err
    assert re.search(RESUMED, err), err
    history, resumed = committed_history(entries(job.tmp / "samples"), events(ev_path))
    assert resumed["commit"] > 0
    assert_exactly_once(history)


def test_without_a_checkpoint_dir_losing_every_worker_fails_as_before(job):
    r = job.run(["-np", "2", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1"],
                sample_cmd(job, "--commit-every", "2", "--kill-all", "1:5"))
    assert r.returncode == 1, r.output
    assert "all workers failed" in r.stderr


# --- the job outlives its driver -----------------------------------------------------------------
def run_until_a_copy_then_kill_the_driver(job, ckpt: Path, extra: list[str], sig: int = signal.SIGKILL) -> None:
    job.start(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt),
               "--checkpoint-interval", "0.3", "--events", str(job.tmp / "events1.jsonl"), *extra],
              sample_cmd(job, "--commit-every", "2", "--sleep", "0.03"))
    wait_for(lambda: len(list(ckpt.glob("ckpt-*"))) >= 2 and progress(job) >= 1005, 90, "two durable copies")
    os.killpg(job.proc.pid, sig) if sig == signal.SIGKILL else os.kill(job.proc.pid, sig)
    job.proc.wait(60)
    assert_nothing_left(job.tag, within=15)  # workers notice the driver is gone


def rerun(job, ckpt: Path, *extra: str):
    return job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt),
                    "--checkpoint-interval", "0.3", "--events", str(job.tmp / "events2.jsonl"), *extra],
                   sample_cmd(job, "--commit-every", "2", "--sleep", "0.03"))


def history_across_runs(job, resumed_commit: int) -> list[dict]:
    log = entries(job.tmp / "samples")
    first = min(log, key=lambda e: e["t"])["job"]  # the first run's job id
    return [e for e in log if e["job"] != first or e["commit"] <= resumed_commit]


def test_the_same_command_again_resumes_after_the_driver_was_killed(job):
    ckpt = job.tmp / "ckpt"
    run_until_a_copy_then_kill_the_driver(job, ckpt, [])
    r = rerun(job, ckpt)
    assert r.returncode == 0, r.output
    assert "holds a durable copy of commit" in r.stderr and "resumed from checkpoint of" in r.stderr, r.stderr
    assert re.search(RESUMED, r.stderr), r.stderr
    [resumed] = [e for e in events(job.tmp / "events2.jsonl") if e["kind"] == "resumed"]
    assert_exactly_once(history_across_runs(job, resumed["commit"]))


def test_a_resume_whose_rank_0_dies_before_it_restores_restores_in_the_next_round(job):
    """Rank 0 loads the copy and the sync sends it to the others: killed before that, it left
    them with the script's initial state, which the driver took for the job's state. The job
    trained from step 0 without a word ("resumes from it" was its last say), and the copy rotation
    replaced the copy it had resumed from within two intervals."""
    ckpt = job.tmp / "ckpt"
    run_until_a_copy_then_kill_the_driver(job, ckpt, [])
    newest = json.loads((sorted(ckpt.glob("ckpt-*"))[-1] / "manifest.json").read_text())["commit"]
    marker = job.tmp / "die"
    marker.touch()
    r = job.run(["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-interval", "0.3", "--events", str(job.tmp / "events2.jsonl")],
                sample_cmd(job, "--commit-every", "2", "--sleep", "0.03", "--die-before-run", str(marker)))
    assert r.returncode == 0, r.output
    assert not marker.exists() and "(rank 0) exited with code -9" in r.stderr, r.stderr
    assert f"restored the durable copy of commit {newest} " in r.stderr, r.stderr  # in round 1
    [resumed] = [e for e in events(job.tmp / "events2.jsonl") if e["kind"] == "resumed"]
    assert resumed["commit"] == newest and resumed["round"] == 1, resumed
    assert_exactly_once(history_across_runs(job, newest))
    copies = [json.loads(m.read_text())["commit"] for m in ckpt.glob("ckpt-*/manifest.json")]
    assert copies and min(copies) >= newest, (copies, newest)


def test_a_commit_before_elastic_run_never_replaces_the_copy_the_job_resumes_from(job):
    """A script that commits its initial state before ``hvd.elastic.run`` (where rank 0 restores
    the durable copy) must not hand that initial state off as the newest durable copy: the
    restore would then load it, and the resumed job would start over from scratch."""
    ckpt = job.tmp / "ckpt"
    run_until_a_copy_then_kill_the_driver(job, ckpt, [])
    newest = json.loads((sorted(ckpt.glob("ckpt-*"))[-1] / "manifest.json").read_text())["commit"]
    r = job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-interval", "0.05", "--events", str(job.tmp / "events2.jsonl")],
                sample_cmd(job, "--commit-every", "2", "--sleep", "0.03", "--commit-before-run"))
    assert r.returncode == 0, r.output
    assert f"restored the durable copy of commit {newest} " in r.stderr, r.stderr
    [resumed] = [e for e in events(job.tmp / "events2.jsonl") if e["kind"] == "resumed"]
    assert resumed["commit"] == newest
    assert_exactly_once(history_across_runs(job, newest))


def test_a_corrupt_newest_copy_is_skipped_for_the_one_before(job):
    ckpt = job.tmp / "ckpt"
    run_until_a_copy_then_kill_the_driver(job, ckpt, [])
    newest = sorted(ckpt.glob("ckpt-*"))[-1]
    with open(newest / "data.bin", "r+b") as f:  # one flipped byte
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    older = json.loads((sorted(ckpt.glob("ckpt-*"))[-2] / "manifest.json").read_text())["commit"]
    r = rerun(job, ckpt)
    assert r.returncode == 0, r.output
    assert f"checkpoint {newest} is unusable (data.bin bytes" in r.stderr, r.stderr
    [resumed] = [e for e in events(job.tmp / "events2.jsonl") if e["kind"] == "resumed"]
    assert resumed["commit"] == older
    assert_exactly_once(history_across_runs(job, older))


def test_a_copy_of_another_model_is_refused_naming_the_first_key(job):
    ckpt = job.tmp / "ckpt"
    run_until_a_copy_then_kill_the_driver(job, ckpt, [])
    r = job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt)],
                sample_cmd(job, "--classes", "3"))
    assert r.returncode == 1, r.output
    assert "cannot resume: the durable copy in the checkpoint directory does not fit this state: " \
           "model.weight: the model has (3, 8) torch.float32, the durable copy (2, 8) torch.float32" in r.stderr, \
        r.stderr
    assert "--fresh" in r.stderr
    assert "resumed from checkpoint" not in r.stderr, r.stderr  # it never did: not said, then contradicted
    r = job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt), "--fresh"],
                sample_cmd(job, "--classes", "3", "--epochs", "1"))
    assert r.returncode == 0, r.output  # --fresh starts over


def test_a_copy_of_another_optimizer_is_refused(job):
    """An SGD(lr=0.1) copy resumed into an Adam(lr=1e-3) script: torch's load_state_dict
    merged the options, and Adam trained on with lr 0.1 and SGD's momentum, silently."""
    ckpt = job.tmp / "ckpt"
    run_until_a_copy_then_kill_the_driver(job, ckpt, [])
    r = job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt)],
                sample_cmd(job, "--adam"))
    assert r.returncode == 1, r.output
    assert "does not fit this state: optimizer.param_groups[0]: another optimizer's options (the durable copy " \
           "has dampening, momentum, nesterov; this one has " in r.stderr, r.stderr
    assert "resumed from checkpoint" not in r.stderr, r.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_to_the_driver_writes_a_last_copy_first(job, sig):
    """No periodic copy after the first (a long interval): the last copy, made at the signal,
    is what a rerun resumes from, a few steps back at most. SIGHUP (the terminal or SSH session
    that started it went away) is a stop like SIGTERM; it used to kill the driver at once."""
    ckpt = job.tmp / "ckpt"
    job.start(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt),
               "--checkpoint-interval", "600", "--events", str(job.tmp / "events1.jsonl")],
              sample_cmd(job, "--commit-every", "2", "--sleep", "0.03"))
    wait_for(lambda: len(list(ckpt.glob("ckpt-*"))) >= 1 and progress(job) >= 1003, 90, "training in epoch 1")
    first = json.loads((sorted(ckpt.glob("ckpt-*"))[-1] / "manifest.json").read_text())["commit"]
    os.kill(job.proc.pid, sig)
    out, err = job.proc.communicate(timeout=90)
    assert job.proc.returncode == 128 + sig, err
    name = signal.Signals(sig).name
    assert f"received {name}: writing a last durable copy before stopping" in err, err
    [end] = [e for e in events(job.tmp / "events1.jsonl") if e["kind"] == "job_end"]  # the log says how it ended
    assert (end["ok"], end["cause"], end["reason"]) == (False, "signalled", f"stopped by {name}"), end
    last = json.loads((sorted(ckpt.glob("ckpt-*"))[-1] / "manifest.json").read_text())
    assert last["commit"] > first
    assert_nothing_left(job.tag)
    r = rerun(job, ckpt)
    assert r.returncode == 0, r.output
    [resumed] = [e for e in events(job.tmp / "events2.jsonl") if e["kind"] == "resumed"]
    assert resumed["commit"] == last["commit"] and resumed["steps_back"] <= 4, resumed


def test_a_job_that_ends_while_its_last_copy_is_awaited_ends_as_it_ended(job):
    """SIGTERM near the end, with no commit left to copy: the job finishes while the driver
    waits for the last copy. That is the job's outcome (exit 0, the success said); it used to
    print "not written within 20 s" a second after the signal and exit 143."""
    ckpt = job.tmp / "ckpt"
    job.start(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--checkpoint-dir", str(ckpt),
               "--checkpoint-interval", "600"],
              sample_cmd(job, "--no-commit", "--sleep", "0.05"))
    # Twelve batches before the end (2 ranks, batches of 6): with no commit there is never a copy to
    # write, so the driver waits for one while the last batches train, however fast they go.
    last = (EPOCHS - 1) * 1000 + SAMPLES // 2 // 6 - 12
    wait_for(lambda: progress(job) >= last, 120, "the last batches")
    os.kill(job.proc.pid, signal.SIGTERM)
    out, err = job.proc.communicate(timeout=90)
    assert job.proc.returncode == 0, err
    assert "received SIGTERM: the job ended meanwhile" in err and "job succeeded" in err, err
    assert "not written within" not in err and "stopping 0 worker" not in err, err
    assert "no last durable copy: the job ended first" in err, err
    assert_nothing_left(job.tag)


def test_an_unwritable_checkpoint_dir_is_one_line(job, tmp_path):
    (tmp_path / "file").write_text("x")
    r = job.run(["-np", "1", "--checkpoint-dir", str(tmp_path / "file" / "ckpt")], [sys.executable, "-c", "pass"])
    assert r.returncode == 2, r.output
    assert r.stderr.strip().startswith("elasticrun: error: --checkpoint-dir ") and len(r.stderr.splitlines()) == 1


# --- a driver that is only stopped ----------------------------------------------------------------
@pytest.mark.parametrize("what", ["driver", "everything"])
def test_a_driver_stopped_longer_than_the_timeouts_loses_no_worker_and_blames_no_host(job, what):
    """Ctrl-Z (or SIGSTOP) of the driver for longer than the workers' driver timeout and the
    heartbeat timeout (5 s each): its workers, on its machine, see its process is still there
    and wait; once it runs again it holds none of their silence against them. Before, every
    worker exited ("the driver has not answered for 5 s") and the driver blacklisted both
    healthy hosts for it: the job failed. ``everything``: the whole job stopped and continued
    (a batch system's suspend and resume): nobody's silence while stopped counts."""
    job.start(["-np", "2", "--min-np", "1", "-H", "localhost:1,127.0.0.1:1"],
              sample_cmd(job, "--sleep", "0.15", "--commit-every", "2"))
    wait_for(lambda: progress(job) >= 2, 60, "the first steps")
    pids = [job.proc.pid] + (tagged_pids(job.tag) if what == "everything" else [])
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    before = progress(job)
    try:
        time.sleep(7.0)  # the scenario itself: longer than both 5 s timeouts
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    at_resume = progress(job) if what == "driver" else before + 1
    r = job.finish(timeout=120)
    assert r.returncode == 0, r.output
    assert "blacklisted permanently" not in r.stderr and "the job is gone or stopping" not in r.output, r.output
    assert "blacklisted hosts: none" in r.stderr and "0 reset(s)" in r.stderr, r.stderr
    lost = re.search(r"the driver did not run for ([\d.]+) s \(stopped", r.stderr)
    assert lost and 6.0 <= float(lost.group(1)) <= 8.0, r.stderr
    if what == "driver":
        assert "its process is still here (stopped" in r.output, r.output
    assert at_resume > 2, "the workers did not train on while the driver was stopped"
    assert time.monotonic() - stopped < 100
    assert_exactly_once(entries(job.tmp / "samples"))
