"""``elasticrun.run(fn, ...)`` end to end: real driver in this process, real workers, real gloo.

The functions below are pickled by reference (this module); workers import it through the
caller's ``sys.path``, which ``run`` hands to them. Every job is tagged so that the test can
prove no process is left behind, and ``run`` must leave none of its threads running either.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import uuid
from pathlib import Path

import pytest

import elasticrun
from conftest import assert_nothing_left

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def tag(monkeypatch):
    """Tag the workers (they inherit this process's environment) and check what is left after."""
    value = uuid.uuid4().hex
    monkeypatch.setenv("ELASTICRUN_TEST_TAG", value)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    before = set(threading.enumerate())
    yield value
    assert_nothing_left(value)
    deadline = time.monotonic() + 3  # a released hung discovery call needs a moment to return
    while True:
        left = [t.name for t in threading.enumerate() if t not in before and t.name.startswith("elasticrun")]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not left, f"threads left behind by run(): {left}"


# --- functions the workers run ---------------------------------------------------------------
def sum_of_ranks(offset, blob=b"", *, scale=1):
    import torch

    import elasticrun.torch as hvd

    total = hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum).item()
    print(f"rank {hvd.rank()} of {hvd.size()} says hello", flush=True)
    # A large return value (over the 1 MiB frame limit) travels back in parts.
    echo = hashlib.sha256(blob).hexdigest().encode() * (40_000 * (hvd.rank() + 1))
    return {"rank": hvd.rank(), "size": hvd.size(), "total": total * scale + offset, "echo": echo}


def fails_on_rank_1():
    import torch

    import elasticrun.torch as hvd

    if hvd.rank() == 1:
        raise ValueError(f"boom on rank {hvd.rank()}")
    hvd.allreduce(torch.ones(1))  # its peer is gone: the round is aborted and this rank fails too
    return "unreachable"


def train_until_size(marker, want_size, die_on=None):
    """An elastic loop: commit every step; return once the job has ``want_size`` ranks."""
    import torch

    import elasticrun.torch as hvd
    from elasticrun.worker import runtime

    state = hvd.elastic.ObjectState(step=0)

    @hvd.elastic.run
    def train(state):
        while True:
            if hvd.rank() == 0:
                Path(marker).touch()  # the test's discovery callable grows the job after this
            if die_on is not None and runtime.get().hostname == die_on and state.step == 3:
                os._exit(3)
            hvd.allreduce(torch.ones(1))
            state.step += 1
            state.commit()
            if hvd.size() == want_size and state.step >= 5:
                return hvd.rank(), hvd.size(), state.step, runtime.get().round
            if state.step > 3000:
                raise RuntimeError(f"the job never reached {want_size} ranks")
            time.sleep(0.01)

    return train(state)


def sleepy_rank(seconds):
    import elasticrun.torch as hvd

    time.sleep(seconds)
    return hvd.rank()


# --- tests -----------------------------------------------------------------------------------
def test_returns_each_ranks_value_in_rank_order(tag, capsys):
    blob = os.urandom(3 << 20)  # the pickled function's arguments exceed one frame too
    values = elasticrun.run(sum_of_ranks, args=(10, blob), kwargs={"scale": 2}, np=2,
                            hosts="localhost:1,127.0.0.1:1")
    digest = hashlib.sha256(blob).hexdigest().encode()
    assert [(v["rank"], v["size"], v["total"]) for v in values] == [(0, 2, 12.0), (1, 2, 12.0)]
    assert values[0]["echo"] == digest * 40_000 and values[1]["echo"] == digest * 80_000
    out = capsys.readouterr()
    assert "[0]<stdout>:rank 0 of 2 says hello" in out.out
    assert "[1]<stdout>:rank 1 of 2 says hello" in out.out
    assert "job succeeded" in out.err

    # Twice in one process, and from a thread that is not the main thread (no signal handlers there).
    box = {}
    thread = threading.Thread(target=lambda: box.update(v=elasticrun.run(sum_of_ranks, args=(1,), np=2,
                                                                          hosts={"localhost": 2})))
    thread.start()
    thread.join(120)
    assert [v["total"] for v in box["v"]] == [2.0, 2.0]


def _io_thread_count() -> int:
    """ZeroMQ I/O threads alive in this process now (their names, from /proc: Linux)."""
    count = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                count += f.read().startswith("ZMQbg/IO")
        except OSError:
            pass  # the thread ended
    return count


def test_a_driver_with_several_io_threads_serves_its_workers(tag, monkeypatch):
    # What a big job on a big machine gets (elasticrun.driver.network.io_threads): forced here,
    # where two cores give every job one I/O thread.
    from elasticrun.driver import driver as drv

    asked = []
    monkeypatch.setattr(drv, "io_threads", lambda workers, cores: asked.append(workers) or 3)
    baseline = _io_thread_count()
    most = [0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.005):
            most[0] = max(most[0], _io_thread_count() - baseline)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        values = elasticrun.run(sum_of_ranks, args=(0,), np=2, hosts="localhost:1,127.0.0.1:1")
    finally:
        stop.set()
        watcher.join()
    assert [(v["rank"], v["total"]) for v in values] == [(0, 1.0), (1, 1.0)]
    assert asked == [2]  # sized for the job's most workers
    assert most[0] >= 3, f"the driver's context ran {most[0]} I/O thread(s), not 3"


def test_failing_function_raises_with_the_failing_ranks_traceback(tag):
    with pytest.raises(elasticrun.RunError) as info:
        elasticrun.run(fails_on_rank_1, np=2, hosts="localhost:1,127.0.0.1:1")
    exc = info.value
    assert exc.rank == 1 and exc.host == "127.0.0.1"
    assert "all workers failed" in exc.reason
    assert 'raise ValueError(f"boom on rank {hvd.rank()}")' in exc.remote_traceback
    assert "in fails_on_rank_1" in exc.remote_traceback
    assert "ValueError: boom on rank 1" in str(exc) and "Traceback" in str(exc)
    assert isinstance(exc.__cause__, ValueError) and str(exc.__cause__) == "boom on rank 1"
    assert exc.exit_code == 1


def test_discovery_callable_grows_the_job_and_run_returns_the_final_round(tag, tmp_path):
    marker = tmp_path / "training"
    calls = []

    def discover():
        calls.append(time.monotonic())
        hosts = {"localhost": 1, "127.0.0.1": 1}
        if marker.exists():
            hosts["127.0.0.2"] = 1
        return hosts

    values = elasticrun.run(train_until_size, args=(str(marker), 3), np=2, min_np=1, max_np=3,
                            discovery=discover, discovery_interval=0.2)
    assert [v[:2] for v in values] == [(0, 3), (1, 3), (2, 3)]
    assert len({v[2] for v in values}) == 1 and len({v[3] for v in values}) == 1  # one step, one round
    assert values[0][3] >= 1  # the final round is a later one
    assert len(calls) > 3


def test_worker_failure_with_min_np_returns_the_survivors_values(tag, tmp_path):
    values = elasticrun.run(train_until_size, args=(str(tmp_path / "m"), 2, "127.0.0.2"), np=3, min_np=2,
                            hosts="localhost:1,127.0.0.1:1,127.0.0.2:1")
    assert [v[:2] for v in values] == [(0, 2), (1, 2)]
    assert values[0][3] == 1  # round 1: the dead worker's round-0 place does not count


def test_hung_discovery_callable_is_survived(tag, capsys):
    release = threading.Event()
    calls = []

    def discover():
        calls.append(1)
        if len(calls) == 2:
            release.wait(60)  # hangs far longer than discovery_timeout
        return {"localhost": 2}

    try:
        values = elasticrun.run(sleepy_rank, args=(4.0,), np=2, discovery=discover, discovery_interval=0.2,
                                discovery_timeout=0.5)
    finally:
        release.set()
    assert values == [0, 1]
    err = capsys.readouterr().err
    assert "did not return within 0.5 s" in err
    assert len(calls) == 2  # no new call started while one hung


def test_first_discovery_failure_raises(tag):
    def broken():
        raise OSError("cluster API unreachable")

    with pytest.raises(elasticrun.RunError, match="cluster API unreachable") as info:
        elasticrun.run(sleepy_rank, args=(0,), np=1, discovery=broken)
    assert info.value.exit_code == 2 and "misconfigured" in str(info.value)


def test_an_ignored_sighup_stays_ignored(tag):
    """Under nohup (SIGHUP ignored) a hang-up does not stop the job; otherwise it stops it as
    SIGTERM does (tests/integration/test_durable.py)."""
    import signal

    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    sent = threading.Event()
    timer = threading.Timer(1.0, lambda: (os.kill(os.getpid(), signal.SIGHUP), sent.set()))
    timer.start()
    try:
        assert elasticrun.run(sleepy_rank, args=(3,), np=2, hosts="localhost:2") == [0, 1]
        assert sent.is_set()  # it came while the job ran, and the job went on
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        timer.cancel()
        signal.signal(signal.SIGHUP, before)


@pytest.mark.parametrize("kwargs, argv", [
    (dict(np=0, hosts="localhost:1"), ["-np", "0", "-H", "localhost:1"]),
    (dict(np=2, min_np=3, hosts="localhost:2"), ["-np", "2", "--min-np", "3", "-H", "localhost:2"]),
    (dict(np=2, max_np=1, hosts="localhost:2"), ["-np", "2", "--max-np", "1", "-H", "localhost:2"]),
    (dict(np=3, hosts="localhost:1,127.0.0.1:1"), ["-np", "3", "-H", "localhost:1,127.0.0.1:1"]),
    (dict(np=1, hosts="bad host!"), ["-np", "1", "-H", "bad host!"]),
    (dict(np=1, discovery_script="/no/such/script"), ["-np", "1", "--host-discovery-script", "/no/such/script"]),
    (dict(np=1, hosts="localhost", discovery_script="/x"),
     ["-np", "1", "-H", "localhost", "--host-discovery-script", "/x"]),
    (dict(np=1, hosts="localhost", elastic_timeout=-1), ["-np", "1", "-H", "localhost", "--elastic-timeout", "-1"]),
    (dict(np=1, hosts="localhost", blacklist_cooldown_range=(5, 1)),
     ["-np", "1", "-H", "localhost", "--blacklist-cooldown-range", "5", "1"]),
    (dict(np=1, hosts="localhost", env=["1BAD=x"]), ["-np", "1", "-H", "localhost", "-x", "1BAD=x"]),
    (dict(np=1, hosts="localhost", launcher="rsh"), ["-np", "1", "-H", "localhost", "--launcher", "rsh"]),
])
def test_bad_arguments_raise_the_command_lines_message(kwargs, argv, capsys):
    from elasticrun.driver.cli.command import parse_settings

    with pytest.raises(SystemExit):
        parse_settings(argv + ["python", "train.py"])
    cli = capsys.readouterr().err.strip()
    with pytest.raises(ValueError) as info:
        elasticrun.run(sleepy_rank, args=(0,), **kwargs)
    reason = cli.removeprefix("elasticrun: error: ").removesuffix(" (see elasticrun --help)")
    if reason.startswith("argument "):  # argparse names the flag; run() names the keyword
        reason = reason.split(": ", 1)[1]
    if "not allowed with argument" in reason:
        reason = "cannot be used together"
    if reason.startswith("invalid choice"):
        reason = "must be one of 'auto', 'local', 'ssh'"
    assert reason in str(info.value), (cli, str(info.value))


def homogeneous_asked_by_rank_0_alone():
    import elasticrun.torch as hvd

    return hvd.is_homogeneous() if hvd.rank() == 0 else None  # the other ranks never ask


def test_is_homogeneous_is_no_collective(tag):
    """As Horovod's: a value each worker holds, so one rank may ask alone (a collective here
    failed the job, or waited for ranks that never came)."""
    assert elasticrun.run(homogeneous_asked_by_rank_0_alone, np=3, hosts="localhost:2,127.0.0.1:1") == [
        False, None, None]
    assert elasticrun.run(homogeneous_asked_by_rank_0_alone, np=2, hosts="localhost:1,127.0.0.1:1") == [True, None]


def test_without_a_host_source_it_runs_here(tag):
    """As horovod.run: no hosts= (nor hostfile=, discovery...) means localhost:np."""
    assert elasticrun.run(sleepy_rank, args=(0,), np=2) == [0, 1]


def env_and_rank(name):
    import os

    import elasticrun.torch as hvd

    return hvd.rank(), os.environ.get(name), os.environ["HOROVOD_RANK"], os.environ["WORLD_SIZE"]


def test_horovod_run_keywords(tag):
    """horovod.run's names for the options, its np default, and the ones that change nothing."""
    import sys

    values = elasticrun.run(env_and_rank, args=("GREETING",), num_proc=2, min_num_proc=1, max_num_proc=2, slots=2,
                            hosts="localhost", cooldown_range=(1, 10), reset_limit=3, use_gloo=True,
                            disable_cache=True, verbose=0, executable=sys.executable, env={"GREETING": "hi"},
                            network_interfaces="lo", start_timeout=60, elastic_timeout=60)
    assert values == [(0, "hi", "0", "2"), (1, "hi", "1", "2")]
    assert elasticrun.run(sleepy_rank, args=(0,)) == [0]  # np=1, as horovod.run


def test_horovod_run_keywords_that_need_mpi_are_refused():
    with pytest.raises(ValueError, match="no MPI"):
        elasticrun.run(sleepy_rank, np=1, use_mpi=True)
    with pytest.raises(ValueError, match="no MPI"):
        elasticrun.run(sleepy_rank, np=1, mpi_args="--bind-to none")
    with pytest.raises(ValueError, match="disagree"):
        elasticrun.run(sleepy_rank, np=1, num_proc=2)


def test_api_only_argument_errors():
    with pytest.raises(ValueError, match="discovery= cannot be combined with hosts="):
        elasticrun.run(sleepy_rank, np=1, hosts="localhost", discovery=lambda: {"localhost": 1})
    with pytest.raises(TypeError, match="unexpected keyword argument 'min_procs'"):
        elasticrun.run(sleepy_rank, np=1, hosts="localhost", min_procs=1)
    with pytest.raises(TypeError, match="fn must be callable"):
        elasticrun.run("train.py", np=1, hosts="localhost")
    with pytest.raises(ValueError, match="verbose= must be true or false"):
        elasticrun.run(sleepy_rank, np=1, hosts="localhost", verbose="yes")
    with pytest.raises(TypeError, match="cannot be pickled"):
        elasticrun.run(sleepy_rank, args=(threading.Lock(),), np=1, hosts="localhost")


@pytest.fixture
def sigint():
    """Python's own SIGINT handler for the test, whatever this process started with (a run
    started in the background by a shell has SIGINT ignored)."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield signal
    signal.signal(signal.SIGINT, before)


def test_ctrl_c_stops_the_job_and_restores_the_handler(tag, sigint):
    assert threading.current_thread() is threading.main_thread()
    timer = threading.Timer(4.0, os.kill, (os.getpid(), sigint.SIGINT))
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            elasticrun.run(sleepy_rank, args=(60,), np=2, hosts="localhost:2")
    finally:
        timer.cancel()
    assert time.monotonic() - started < 30
    assert sigint.getsignal(sigint.SIGINT) is sigint.default_int_handler


def test_an_ignored_sigint_stays_ignored(tag, sigint):
    """A caller that ignores SIGINT (or a script's background job) is not stopped by one."""
    sigint.signal(sigint.SIGINT, sigint.SIG_IGN)
    sent = threading.Event()
    timer = threading.Timer(1.0, lambda: (os.kill(os.getpid(), sigint.SIGINT), sent.set()))
    timer.start()
    try:
        assert elasticrun.run(sleepy_rank, args=(3,), np=2, hosts="localhost:2") == [0, 1]
    finally:
        timer.cancel()
    assert sent.is_set()  # it came while the job ran, and the job went on
    assert sigint.getsignal(sigint.SIGINT) is sigint.SIG_IGN


@pytest.mark.parametrize("kwargs, argv", [
    (dict(np=2, hosts={"localhost": 2, "127.0.0.1": 1}), ["-np", "2", "-H", "localhost:2,127.0.0.1:1"]),
    (dict(np=2, hosts=["localhost:1", "127.0.0.1"], slots=1, min_np=1, reset_limit=0),
     ["-np", "2", "-H", "localhost:1,127.0.0.1", "--slots", "1", "--min-np", "1", "--reset-limit", "0"]),
    (dict(np=1, hosts="localhost", env={"A": "1", "B": "x=y"}, forward_env=False, verbose=True,
          blacklist_cooldown_range=[1, 2.5], events="ev.jsonl", launcher="local"),
     ["-np", "1", "-H", "localhost", "-x", "A=1", "-x", "B=x=y", "--no-forward-env", "--verbose",
      "--blacklist-cooldown-range", "1", "2.5", "--events", "ev.jsonl", "--launcher", "local"]),
    (dict(np=1, hosts="localhost", no_forward_env=True, elastic_timeout=5, heartbeat_timeout=1.5),
     ["-np", "1", "-H", "localhost", "--no-forward-env", "--elastic-timeout", "5", "--heartbeat-timeout", "1.5"]),
])
def test_keywords_mean_what_the_flags_mean(kwargs, argv):
    from elasticrun.driver.cli.command import parse_settings, settings_from_keywords

    assert settings_from_keywords(kwargs, ["cmd"]) == parse_settings(argv + ["cmd"])


def test_function_the_workers_cannot_import_fails_with_their_traceback(tag, tmp_path, monkeypatch):
    """A function pickled by reference to a module only this process can import."""
    import importlib
    import sys

    (tmp_path / "only_here.py").write_text("def work():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("only_here")
    sys.path.remove(str(tmp_path))  # the workers are told the caller's sys.path: it is not there
    try:
        with pytest.raises(elasticrun.RunError) as info:
            elasticrun.run(module.work, np=2, hosts="localhost:2", start_timeout=20)
    finally:
        del sys.modules["only_here"]
    # (A job that cannot change size fails at its first process's failure, as horovodrun's.)
    assert re.search(r"rank \d \(localhost\[\d\]\) exited with code 1", info.value.reason), info.value.reason
    assert "ModuleNotFoundError: No module named 'only_here'" in str(info.value)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_durable_copy_keywords_mean_what_the_flags_mean(tmp_path):
    from elasticrun.driver.cli.command import parse_settings, settings_from_keywords

    ckpt = str(tmp_path / "ckpt")
    kw = settings_from_keywords(dict(np=1, hosts="localhost", checkpoint_dir=ckpt, checkpoint_interval=5,
                                     fresh=True, sigterm_grace=3), ["cmd"])
    cli = parse_settings(["-np", "1", "-H", "localhost", "--checkpoint-dir", ckpt, "--checkpoint-interval", "5",
                          "--fresh", "--sigterm-grace", "3", "cmd"])
    assert kw == cli and kw.checkpoint_dir == ckpt and kw.fresh and kw.checkpoint_interval == 5.0


@pytest.mark.parametrize("nics", [["lo", "lo"], "lo", ("lo",)])
def test_horovod_nics_keywords_mean_the_network_interfaces_flag(nics):
    from elasticrun.api import _horovod_keywords
    from elasticrun.driver.cli.command import parse_settings, settings_from_keywords

    options, _ = _horovod_keywords({"np": 1, "hosts": "localhost", "nics": nics})
    flags = parse_settings(["-np", "1", "-H", "localhost", "--network-interfaces", "lo", "cmd"])
    assert settings_from_keywords(options, ["cmd"]) == flags and flags.network_interface == "lo"
