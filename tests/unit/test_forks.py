"""Processes a worker forks (elasticrun/worker/forks.py), with real processes and signals.

Each case runs a small "worker" in a subprocess of its own session: it installs a SIGTERM
handler as the runtime does (one that records the worker's SIGTERM and does not die of it),
arms the module, forks children (a ``multiprocessing`` fork Process, or a real DataLoader's
workers), then signals them. What the children do is read from what the worker prints.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

pytestmark = pytest.mark.timeout(60)

PRELUDE = textwrap.dedent("""
    import multiprocessing as mp, os, signal, sys, time
    if __name__ != "__main__" and os.environ.get("SLOW_CHILD_IMPORT"):  # a child importing this again:
        open(f"importing-{os.getpid()}", "w").close()  # say so, then take a while (as torch's
        time.sleep(3)                                    # import does on a busy machine)
    import elasticrun.torch  # as a script does (spawn and forkserver children import it again)
    from elasticrun.worker import forks

    def handler(signum, frame):  # the worker's: note the SIGTERM, leave later (never die of it here)
        forks.worker_got_sigterm()
        os.write(1, b"worker: SIGTERM\\n")

    if __name__ == "__main__":  # (not in a spawned child importing this again)
        signal.signal(signal.SIGTERM, handler)
        forks.arm(handler)
    ctx = mp.get_context("fork")

    def say(text):
        print(text, flush=True)

    def beat(path):
        while True:  # a child at work: it shows it lives by renaming a file over another
            with open(path + ".tmp", "w") as f:  # (whole: a reader never sees it empty)
                f.write(str(time.monotonic()))
            os.replace(path + ".tmp", path)
            time.sleep(0.02)
""")


def run_worker(body: str, tmp_path, timeout: float = 40) -> str:
    script = tmp_path / "worker.py"
    script.write_text(PRELUDE + "\nif __name__ == '__main__':\n" + textwrap.indent(textwrap.dedent(body), "    "))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=timeout)
        ok = proc.returncode == 0
    except subprocess.TimeoutExpired:  # what it printed so far says why (a traceback, often)
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        ok, err = False, err + f"(timed out after {timeout} s)"
    if not ok:  # whatever a failed case forked and left, in its session's group, goes too (a
        try:    # passing case is left alone: one test checks its child ends by itself)
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()
    assert ok, out + err
    return out


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ")[-1][:1] == b"Z"
    except OSError:
        return True


def test_a_sigterm_sent_to_the_child_alone_ends_it_as_without_elasticrun(tmp_path):
    """Process.terminate(): the child dies of SIGTERM (exit code -15), runs none of the
    worker's handler (it would say the worker leaves), within the window it waits."""
    out = run_worker("""
        p = ctx.Process(target=beat, args=("beat",)); p.start()
        while not os.path.exists("beat"): time.sleep(0.01)
        t = time.monotonic(); p.terminate(); p.join(10)
        say(f"exitcode {p.exitcode} after {time.monotonic() - t:.2f}")
    """, tmp_path)
    assert "worker: SIGTERM" not in out, out
    code, _, seconds = out.split("exitcode ")[1].partition(" after ")
    assert int(code) == -signal.SIGTERM, out
    assert float(seconds) < 3, out


def test_a_sigterm_to_the_whole_group_leaves_the_child_working_until_the_worker_ends(tmp_path):
    """kill -- -PGID (a machine's shutdown, Slurm's preemption): the child goes on while the
    worker leaves, and dies with the worker (not a moment before, and not after)."""
    out = run_worker("""
        p = ctx.Process(target=beat, args=("beat",)); p.start()
        while not os.path.exists("beat"): time.sleep(0.01)
        os.killpg(os.getpgid(0), signal.SIGTERM)
        time.sleep(2.5)  # longer than the child's window
        with open("beat") as f:
            fresh = time.monotonic() - float(f.read())
        say(f"child alive {p.is_alive()} beat {fresh:.2f} s ago; pid {p.pid}")
        os._exit(0)  # the worker ends without stopping its child (as a leaving worker may)
    """, tmp_path)
    assert "worker: SIGTERM" in out, out
    alive, beat_ago, pid = out.split("child alive ")[1].split()[0], float(out.split(" beat ")[1].split()[0]), \
        int(out.rsplit("pid ", 1)[1])
    assert alive == "True" and beat_ago < 0.5, out
    deadline = time.monotonic() + 5
    while not gone(pid):
        assert time.monotonic() < deadline, f"the child {pid} outlived its worker"
        time.sleep(0.02)


def _exit_with_persistent_loader(tmp_path, sigterm_first: bool) -> subprocess.CompletedProcess:
    """A worker whose DataLoader keeps its workers (persistent_workers) ends: multiprocessing's
    exit handler sends them SIGTERM and joins them. ``sigterm_first``: the worker got its own
    SIGTERM just before (a graceful leave that ended at once)."""
    script = tmp_path / "worker.py"
    script.write_text(PRELUDE + textwrap.dedent(f"""
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        if __name__ == "__main__":
            loader = DataLoader(TensorDataset(torch.arange(100)), batch_size=4, num_workers=2,
                                persistent_workers=True)
            it = iter(loader)
            next(it)
            if {sigterm_first}:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
            say("exiting")
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"the worker did not end within 30 s of its script: {out}{err}") from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.mark.parametrize("sigterm_first", [False, True], ids=["exit", "leave"])
def test_children_the_worker_ends_at_its_exit_end_at_once_and_quietly(tmp_path, sigterm_first):
    """multiprocessing ends a worker's DataLoader workers at its exit with SIGTERM. Taken for
    the group's SIGTERM (within a second of the worker's own), they went on serving until the
    worker died, which waited for them: a leaving worker hung until --sigterm-grace. Otherwise
    they died of it a second later, and torch printed ``DataLoader worker (pid N) is killed by
    signal: Terminated`` on the worker's stderr at every such exit."""
    done = _exit_with_persistent_loader(tmp_path, sigterm_first)
    assert done.returncode == 0 and "exiting" in done.stdout, done.stdout + done.stderr
    assert ("worker: SIGTERM" in done.stdout) is sigterm_first
    assert "killed by signal" not in done.stderr and "Traceback" not in done.stderr, done.stderr


@pytest.mark.parametrize("context", ["fork", "spawn", "forkserver"])
def test_a_real_dataloader_serves_every_batch_through_a_sigterm_to_the_group(tmp_path, context):
    """The case that failed: a DataLoader's workers (torch sets its own C SIGTERM handler in
    them) keep serving after the group's SIGTERM, to the last batch. With spawn and forkserver
    they are new interpreters that import the script again; a forkserver's are its children
    (torch ends them if it dies), so it must live on too."""
    out = run_worker("""
        import torch
        from torch.utils.data import DataLoader, TensorDataset
        data = TensorDataset(torch.arange(400))
        loader = DataLoader(data, batch_size=4, num_workers=2, multiprocessing_context="CONTEXT")
        seen = []
        for i, (batch,) in enumerate(loader):
            seen += batch.tolist()
            if i == 5:
                os.killpg(os.getpgid(0), signal.SIGTERM)
            time.sleep(0.02)
        say(f"served {len(seen)} distinct {len(set(seen))}")
    """.replace("CONTEXT", context), tmp_path, timeout=50)
    assert "worker: SIGTERM" in out, out
    assert "served 400 distinct 400" in out, out


def test_a_spawned_dataloader_worker_still_importing_the_script_outlives_a_sigterm_to_the_group(tmp_path):
    """A spawn child imports the script again, torch with it: seconds in which it had only
    SIGTERM's default. It gets the handling first thing now, before the script."""
    out = run_worker("""
        import glob, torch
        from torch.utils.data import DataLoader, TensorDataset
        os.environ["SLOW_CHILD_IMPORT"] = "1"
        loader = DataLoader(TensorDataset(torch.arange(40)), batch_size=4, num_workers=2,
                            multiprocessing_context="spawn")
        it = iter(loader)
        deadline = time.monotonic() + 30
        while len(glob.glob("importing-*")) < 2:
            assert time.monotonic() < deadline, "the loader's workers never started"
            time.sleep(0.01)
        os.killpg(os.getpgid(0), signal.SIGTERM)  # both still importing the script
        seen = [int(v) for (batch,) in it for v in batch]
        say(f"served {len(seen)} distinct {len(set(seen))}")
    """, tmp_path, timeout=50)
    assert "worker: SIGTERM" in out, out
    assert "served 40 distinct 40" in out, out


def test_a_childs_own_handler_is_its_own_and_a_forked_child_is_no_worker(tmp_path):
    """A handler the script sets in the child stays; the child knows it is not the worker."""
    out = run_worker("""
        def child(path):
            say(f"child: forked {forks.in_forked_child()}")
            signal.signal(signal.SIGTERM, lambda s, f: (say("child: own handler"), os._exit(7)))
            beat(path)
        p = ctx.Process(target=child, args=("beat",)); p.start()
        while not os.path.exists("beat"): time.sleep(0.01)
        p.terminate(); p.join(10)
        say(f"worker: forked {forks.in_forked_child()}; child exitcode {p.exitcode}")
    """, tmp_path)
    assert "child: forked True" in out and "worker: forked False" in out, out
    assert "child: own handler" in out and "child exitcode 7" in out, out


def test_hvd_init_in_a_process_a_worker_started_joins_nothing_and_says_why_collectives_cannot_run():
    """A DataLoader's spawn/forkserver worker imports the script again, hvd.init() at its top
    included: it inherits the worker's environment but not its keys. It used to fail for want
    of them (and the DataLoader with it); it now answers with the worker's place."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN_", "HOROVOD_"))}
    env.update({"ELASTICRUN_WORKER_MARK": f"{os.getpid()}:3", "ELASTICRUN_CONTROL_ADDR": "tcp://127.0.0.1:9",
                "ELASTICRUN_RANK": "3", "ELASTICRUN_SIZE": "4", "ELASTICRUN_LOCAL_RANK": "1",
                "ELASTICRUN_LOCAL_SIZE": "2", "ELASTICRUN_JOB_ID": "job"})
    code = textwrap.dedent("""
        import torch, elasticrun.torch as hvd
        hvd.init()
        print("place", hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), flush=True)
        try:
            hvd.allreduce(torch.ones(1))
        except RuntimeError as exc:
            print("refused:", exc, flush=True)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "place 3 4 1 2" in r.stdout, r.stdout + r.stderr
    assert f"is not a worker of the job: worker pid {os.getpid()} started it" in r.stdout, r.stdout


def test_children_whose_pids_share_a_slot_each_find_the_sigterm_the_worker_sent_them(monkeypatch):
    """The worker notes each SIGTERM it sends a child in a slot chosen by the child's pid. Two
    children 255 pids apart shared one: the second note overwrote the first, and the first
    child, not finding its own, took the old path (waited up to a second, or for the worker to
    die when the worker had its own SIGTERM too)."""
    import mmap

    from elasticrun.worker import forks

    monkeypatch.setattr(forks, "_mark", mmap.mmap(-1, forks._SIZE))
    monkeypatch.setattr(forks, "_worker_pid", os.getpid())
    first, pids = 4000, [4000 + forks._SLOTS * i for i in range(forks._PROBE)]
    for pid in pids:  # within a second of each other: every note must stay readable
        forks._note_sent(pid)
    got = time.monotonic_ns()
    for pid in pids:
        monkeypatch.setattr(forks.os, "getpid", lambda pid=pid: pid)
        assert forks._sent_by_worker(got), f"child {pid} finds no note of its SIGTERM"
    monkeypatch.setattr(forks.os, "getpid", lambda: first + 1)  # a child the worker never signalled
    assert not forks._sent_by_worker(got)
    monkeypatch.setattr(forks.os, "getpid", lambda: first)  # its note, long before: not it
    assert not forks._sent_by_worker(got + 2 * forks._LATE_NS)


#: A child's one long C call: Python runs its signal handlers only after it returns.
BUSY = """
    def busy(path, n):
        open(path, "w").close()
        while True:
            t = time.monotonic()
            sum(range(n))  # one C call, no handler runs inside it
            with open(path + ".took.tmp", "w") as f:
                f.write(str(time.monotonic() - t))
            os.replace(path + ".took.tmp", path + ".took")

    def calibrated(seconds):  # an n for which sum(range(n)) takes about that long here
        sum(range(2_000_000))
        t = time.monotonic(); sum(range(20_000_000))
        return int(20_000_000 * seconds / max(1e-3, time.monotonic() - t))
"""


def test_a_group_sigterm_reaching_a_child_in_a_long_c_call_still_leaves_it_working(tmp_path):
    """Its handler ran once the call returned, over a second after the worker's: it took the
    signal for its own and died, and the worker's next batch failed (a rollback and a
    blacklisted host instead of a graceful leave)."""
    out = run_worker(BUSY + """
    p = ctx.Process(target=busy, args=("busy", calibrated(2.5))); p.start()
    while not os.path.exists("busy"): time.sleep(0.01)
    time.sleep(0.1)  # inside its first long call
    os.killpg(os.getpgid(0), signal.SIGTERM)
    deadline = time.monotonic() + 20
    while not os.path.exists("busy.took") and time.monotonic() < deadline: time.sleep(0.02)
    time.sleep(0.5)  # its handler has run by now
    say(f"child alive {p.is_alive()} took {open('busy.took').read()}; pid {p.pid}")
    os._exit(0)
    """, tmp_path)
    assert "worker: SIGTERM" in out, out
    took = float(out.split(" took ")[1].split(";")[0])
    assert took > 1.6, f"the child's C call took {took:.2f} s: not long enough to test this"
    assert "child alive True" in out, out
    pid = int(out.rsplit("pid ", 1)[1])
    deadline = time.monotonic() + 5
    while not gone(pid):
        assert time.monotonic() < deadline, f"the child {pid} outlived its worker"
        time.sleep(0.02)


def test_a_child_the_worker_terminates_in_a_long_c_call_ends_when_the_call_returns(tmp_path):
    """It waited a second more for the worker's mark: its handler ran over a second after the
    worker noted sending it SIGTERM."""
    out = run_worker(BUSY + """
    n = calibrated(2.0)
    t = time.monotonic(); sum(range(n)); say(f"one call {time.monotonic() - t:.2f}")
    p = ctx.Process(target=busy, args=("busy", n)); p.start()
    while not os.path.exists("busy"): time.sleep(0.01)
    time.sleep(0.3)  # inside its first long call
    t = time.monotonic(); p.terminate(); p.join(20)
    say(f"exitcode {p.exitcode} after {time.monotonic() - t:.2f}")
    """, tmp_path)
    call = float(out.split("one call ")[1].split()[0])
    code, _, seconds = out.split("exitcode ")[1].partition(" after ")
    assert int(code) == -signal.SIGTERM, out
    # the rest of its call (call - 0.3 s), not that and a second's wait
    assert float(seconds) < call + 0.35, out
