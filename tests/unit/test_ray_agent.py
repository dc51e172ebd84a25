"""The worker agent of the Ray launcher (elasticrun/driver/launch/ray_agent.py), without Ray: it is a
plain class that Ray runs as an actor. It starts a worker through the detached watchdog,
hands it the keys sealed for this agent only, streams its output, reports its exit, signals
its group, and leaves nothing behind when it dies or the driver goes silent."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytest.importorskip("nacl", reason="PyNaCl is not installed: pip install 'ray==2.60.0' 'pynacl>=1.5'")

from elasticrun.driver.launch.ray_agent import WorkerAgent, seal, seal_start  # noqa: E402

pytestmark = pytest.mark.timeout(60)

KEYS = b'{"v": 1, "secret": "' + b"cd" * 32 + b'"}'

# Reads its keys from the pipe as a worker does, prints their hash and whether the environment
# holds them, then a child in its own group's tree, then waits or exits.
WORKER = textwrap.dedent("""
    import hashlib, os, subprocess, sys, time
    from elasticrun.common import secretpipe
    keys = secretpipe.receive()
    print("sha", hashlib.sha256(keys).hexdigest(), flush=True)
    print("env-has-keys", any(keys.decode() in v for v in os.environ.values()), flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    print("child", child.pid, flush=True)
    if sys.argv[1] == "exit":
        sys.exit(3)
    time.sleep(60)
""")


def _collect(agent: WorkerAgent, until, timeout: float = 20.0) -> tuple[list[tuple[str, str]], int | None]:
    lines: list[tuple[str, str]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = agent.poll(0.2)
        lines += [tuple(x) for x in reply["lines"]]
        if reply["exit"] is not None or until(lines):
            return lines, reply["exit"]
    pytest.fail(f"nothing conclusive within {timeout} s: {lines}")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b") ")[-1][:1] != b"Z"
    except OSError:
        return False


@pytest.fixture
def agents():
    """New agents in this process, closed at the end: an agent left open would end the whole
    test run (os._exit) once its silence limit passed without a poll."""
    made: list[WorkerAgent] = []

    def new(worker_id: str, silence_limit: float = 60) -> WorkerAgent:
        made.append(WorkerAgent("job", worker_id, silence_limit=silence_limit))
        return made[-1]
    yield new
    for agent in made:
        agent.close()


def test_a_closed_agent_leaves_its_process_alone(agents):
    agent = agents("w1", silence_limit=0.2)
    agent.close()
    watchdog = [t for t in threading.enumerate() if t.name == "elasticrun-agent-watchdog"]
    deadline = time.monotonic() + 5
    while any(t.is_alive() for t in watchdog) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(t.is_alive() for t in watchdog)  # it ended without os._exit: we are still here


def _start(agent: WorkerAgent, how: str, tmp_path) -> dict:
    hello = agent.hello()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path), "MARK": "x"}
    return agent.start([sys.executable, "-c", WORKER, how], env, str(tmp_path), 2.0,
                       seal(hello["public_key"], KEYS))


def test_the_worker_gets_its_keys_through_a_pipe_and_its_output_and_exit_come_back(agents, tmp_path):
    agent = agents("w1")
    started = _start(agent, "exit", tmp_path)
    assert "pgid" in started, started
    lines, code = _collect(agent, lambda lines: False)
    assert code == 3
    assert ("stdout", "sha " + hashlib.sha256(KEYS).hexdigest()) in lines
    assert ("stdout", "env-has-keys False") in lines
    assert ("stderr", "to stderr") in lines
    child = int(next(line for s, line in lines if line.startswith("child "))[6:])
    # the watchdog kills what the worker left in its group (SIGKILL before it reports the exit;
    # the kernel's teardown of the child may take a scheduling slice more on a busy host)
    assert _gone([child], within=5)


def test_the_environment_travels_sealed_with_the_keys(agents, tmp_path):
    """The driver's call carries no environment in the clear (Ray keeps a task's arguments in
    its tables, for anyone who can use the cluster): it is in the sealed box, and reaches the
    worker."""
    agent = agents("w1")
    hello = agent.hello()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path), "HF_TOKEN": "hf_not_in_the_clear"}
    sealed = seal_start(hello["public_key"], KEYS, env)
    assert b"hf_not_in_the_clear" not in sealed and KEYS not in sealed
    code = "import os, sys; print('token', os.environ.get('HF_TOKEN')); sys.exit(0)"
    assert "pgid" in agent.start([sys.executable, "-c", code], {}, str(tmp_path), 2.0, sealed)
    lines, status = _collect(agent, lambda lines: False)
    assert status == 0 and ("stdout", "token hf_not_in_the_clear") in lines, lines


def test_the_sealed_keys_open_only_with_this_agents_key(agents):
    a, b = agents("w1"), agents("w2")
    sealed = seal(a.hello()["public_key"], KEYS)
    assert KEYS not in sealed
    from nacl.exceptions import CryptoError
    from nacl.public import SealedBox

    with pytest.raises(CryptoError):
        SealedBox(b._key).decrypt(sealed)


def test_a_signal_reaches_the_whole_group(agents, tmp_path):
    agent = agents("w1")
    assert "pgid" in _start(agent, "wait", tmp_path)
    lines, _ = _collect(agent, lambda lines: any(x.startswith("child ") for _, x in lines))
    child = int(next(x for _, x in lines if x.startswith("child "))[6:])
    assert agent.signal(signal.SIGKILL)
    _, code = _collect(agent, lambda lines: False)
    assert code == -signal.SIGKILL
    assert _gone([child], within=5)


def test_a_missing_directory_or_command_is_reported_not_raised(agents, tmp_path):
    agent = agents("w1")
    hello = agent.hello()
    r = agent.start(["python3", "-c", "pass"], {"PATH": os.environ["PATH"]}, str(tmp_path / "nope"), 1.0,
                    seal(hello["public_key"], KEYS))
    assert r["error"] == "cwd" and "nope" in r["detail"]
    agent = agents("w2")
    hello = agent.hello()
    r = agent.start(["no-such-command-xyz"], {"PATH": os.environ["PATH"]}, str(tmp_path), 1.0, None)
    assert r["error"] == "not_found"


AGENT_PROCESS = textwrap.dedent("""
    import os, sys, time
    from elasticrun.driver.launch.ray_agent import WorkerAgent, seal
    agent = WorkerAgent("job", "w1", silence_limit=float(sys.argv[2]),
                        driver_process=sys.argv[4] if len(sys.argv) > 4 else None)
    hello = agent.hello()
    agent.start([sys.executable, "-c", sys.argv[1], "wait"],
                {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path)}, "/", 2.0,
                seal(hello["public_key"], b"k" * 40))
    # "poll": the driver keeps polling; "silent": it stops once the worker's child is up.
    while True:
        lines = agent.poll(0.2)["lines"]
        for stream, line in lines:
            print(line, flush=True)
        if sys.argv[3] == "silent" and any(line.startswith("child ") for _, line in lines):
            time.sleep(3600)
""")


def _agent_process(silence: float, mode: str, driver: str | None = None) -> tuple[subprocess.Popen, int, int]:
    """An agent in a process of its own (as Ray runs it); (process, worker pid, worker's child)."""
    keyed = WORKER.replace("keys = secretpipe.receive()", "keys = secretpipe.receive()\nprint('worker', os.getpid(), flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", AGENT_PROCESS, keyed, str(silence), mode, *([driver] if driver else [])],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    worker = child = 0
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("worker "):
            worker = int(line.split()[1])
        if line.startswith("child "):
            child = int(line.split()[1])
            break
    assert worker and child
    return proc, worker, child


def _gone(pids: list[int], within: float) -> bool:
    deadline = time.monotonic() + within
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except OSError:
                    pass
            return False
        time.sleep(0.05)
    return True


def test_the_agent_killed_with_sigkill_leaves_nothing_behind():
    """Ray kills an actor's process (and its own process group) when the driver's job ends:
    the worker's watchdog is detached from both, sees its stdin close and stops the group."""
    proc, worker, child = _agent_process(silence=60, mode="poll")
    os.killpg(proc.pid, signal.SIGKILL)  # the agent and everything in its own group
    proc.wait()
    assert _gone([worker, child], within=10), "the worker outlived its agent"


def test_an_agent_that_hears_nothing_from_the_driver_stops_its_worker_and_exits():
    proc, worker, child = _agent_process(silence=1.0, mode="silent")
    try:
        assert proc.wait(timeout=20) == 1
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert _gone([worker, child], within=10)


def test_an_agent_waits_for_a_driver_on_its_machine_that_is_only_stopped():
    """Ctrl-Z on the driver (a Ray cluster on one machine, or the head node's agents) for
    longer than the silence limit: the agents stopped every worker, and the job was lost with
    every node blacklisted. A stopped driver is not gone: its agents wait, as local workers do,
    and one that runs again but stays silent is gone as before."""
    from elasticrun.common import liveness

    driver = subprocess.Popen(["sleep", "60"])
    proc = None
    try:
        os.kill(driver.pid, signal.SIGSTOP)
        proc, worker, child = _agent_process(silence=1.0, mode="silent", driver=liveness.identity(driver.pid))
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)  # silent three times the limit, but the driver is only stopped
        assert _alive(worker) and _alive(child)
        os.kill(driver.pid, signal.SIGCONT)  # it runs again, and is still silent: gone
        assert proc.wait(timeout=20) == 1
        assert _gone([worker, child], within=10)
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        driver.kill()
        driver.wait()


ARMS = textwrap.dedent("""
    import os, sys, time
    from elasticrun.common import deathnotice
    print("armed", deathnotice.arm_from_environment(), flush=True)
    time.sleep(60)
""")


def test_a_killed_worker_is_said_dying_once_by_its_exit_at_the_latest(agents, tmp_path):
    from elasticrun.driver.launch import remote_bootstrap as rb

    if rb.notice_libc() is None:
        pytest.skip("needs Linux and glibc >= 2.30")
    agent = agents("w1")
    agent.hello()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join(sys.path)}
    assert "pgid" in agent.start([sys.executable, "-c", ARMS], env, str(tmp_path), 2.0, None)
    lines, _ = _collect(agent, lambda lines: ("stdout", "armed True") in lines)
    assert agent.signal(signal.SIGKILL)
    replies = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (not replies or replies[-1]["exit"] is None):
        replies.append(agent.poll(0.5))
    assert replies[-1]["exit"] == -signal.SIGKILL
    said = [(i, r["dying"]) for i, r in enumerate(replies) if "dying" in r]
    assert [code for _, code in said] == [-signal.SIGKILL]  # once, with the exit's reply at the latest


def test_output_waiting_for_the_driver_is_bounded_in_characters_and_each_poll_too(agents):
    """Lines are up to 64 KiB now (common/lines.py): 20,000 of them would be 1.3 GB held here and
    2,000 per reply 128 MB. The oldest go first, counted; nothing is dropped unsaid."""
    from elasticrun.driver.launch import ray_agent

    agent = agents("w1")
    line = "y" * (64 << 10)
    n = ray_agent.MAX_BUFFERED_CHARS // len(line) * 2
    for i in range(n):
        agent._add("stdout", f"{i:08d}" + line[8:])
    got: list[str] = []
    dropped = 0
    while True:
        reply = agent.poll(0)
        if not reply["lines"]:
            break
        assert sum(len(x[1]) for x in reply["lines"]) <= ray_agent.CHARS_PER_POLL
        got += [x[1] for x in reply["lines"]]
        dropped += reply["dropped"]
    assert len(got) * len(line) <= ray_agent.MAX_BUFFERED_CHARS
    assert dropped + len(got) == n and [int(x[:8]) for x in got] == list(range(dropped, n))  # the newest kept
