"""A horovodrun command line runs with `elasticrun` in its place: the controller flags, the
timeline, output timestamps and Horovod's engine tuning flags (accepted, named in one warning).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading

import pytest

from elasticrun.driver.cli import check
from conftest import assert_nothing_left
from elasticrun.driver.cli.command import parse_settings
from elasticrun.driver.environment import shared_environment
from elasticrun.driver.cli.parser import IGNORED_HOROVODRUN_FLAGS

pytestmark = pytest.mark.timeout(120)

HOST = ["-np", "1", "-H", "localhost:1"]


def _refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_settings(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err  # one line
    return err


def test_controller_flags_that_change_nothing():
    s = parse_settings(["--gloo", "--tcp", "--disable-cache", *HOST, "python", "train.py", "--gloo"])
    assert s.command == ["python", "train.py", "--gloo"] and s.ignored_horovodrun_flags == ()


@pytest.mark.parametrize("flag", [["--mpi"], ["--jsrun"], ["--mpi-args=--map-by ppr:6:node"],
                                  ["--binding-args", "--rankfile f"]])
def test_mpi_is_refused_with_what_to_do(flag, capsys):
    err = _refused([*flag, *HOST, "python", "train.py"], capsys)
    assert "elasticrun has no MPI" in err and "use --gloo" in err, err


def test_tuning_flags_take_their_values_and_are_listed_once():
    argv = ["--fusion-threshold-mb", "64", "--cycle-time-ms", "3.5", "--cache-capacity", "0", "--autotune",
            "--autotune-log-file", "tune.csv", "--hierarchical-allreduce", "--no-stall-check",
            "--stall-check-shutdown-time-seconds", "240", "--log-without-timestamp", "--num-nccl-streams", "2",
            *HOST, "python", "train.py", "--epochs", "3"]
    s = parse_settings(argv)
    assert s.command == ["python", "train.py", "--epochs", "3"]  # no value taken for the command
    assert s.ignored_horovodrun_flags == (
        "--fusion-threshold-mb", "--cycle-time-ms", "--cache-capacity", "--hierarchical-allreduce", "--autotune",
        "--autotune-log-file", "--num-nccl-streams", "--log-without-timestamp")
    # The stall check is not ignored: elasticrun's workers have one (worker/rounds.py stall_check)
    assert (s.stall_check, s.stall_warning_s, s.stall_shutdown_s) == (False, None, 240)


def test_the_stall_check_flags_are_taken_and_a_shutdown_below_the_warning_is_named():
    s = parse_settings(["--stall-check-warning-time-seconds", "30", "--stall-check-shutdown-time-seconds", "90",
                        *HOST, "python", "x.py"])
    assert (s.stall_check, s.stall_warning_s, s.stall_shutdown_s) == (None, 30, 90) and not s.startup_warnings
    s = parse_settings(["--stall-check-shutdown-time-seconds", "20", *HOST, "python", "x.py"])
    assert s.startup_warnings == (
        "--stall-check-shutdown-time-seconds 20 is below the stall warning time (60 s): no collective stops for a "
        "stall (as with horovodrun); raise it or lower --stall-check-warning-time-seconds",)
    s = parse_settings(["--stall-check-shutdown-time-seconds", "20", "--collective-timeout", "40", *HOST, "python",
                        "x.py"])
    assert s.startup_warnings == ()  # the warning comes at half the collective timeout: 20 s


def test_a_horovodrun_yaml_configs_stall_check_section(tmp_path):
    config = tmp_path / "horovod.yaml"
    config.write_text("stall_check:\n  enabled: false\n  warning_time_seconds: 30\n  shutdown_time_seconds: 90\n")
    s = parse_settings(["--config-file", str(config), *HOST, "python", "x.py"])
    assert (s.stall_check, s.stall_warning_s, s.stall_shutdown_s, s.ignored_horovodrun_flags) == (False, 30, 90, ())
    config.write_text("stall_check:\n  enabled: true\n")
    assert parse_settings(["--config-file", str(config), *HOST, "python", "x.py"]).stall_check is True


def test_every_ignored_flag_parses(tmp_path):
    for flag, kind in IGNORED_HOROVODRUN_FLAGS.items():
        value = [] if kind is None else ["2"]
        s = parse_settings([flag, *value, *HOST, "python", "x.py"])
        assert s.ignored_horovodrun_flags == (flag,) and s.command == ["python", "x.py"], flag


def test_a_bad_tuning_value_is_still_an_error(capsys):
    err = _refused(["--fusion-threshold-mb", "lots", *HOST, "python", "x.py"], capsys)
    assert "--fusion-threshold-mb" in err and "'lots' is not a whole number" in err, err


def test_aliases_of_our_own_flags(tmp_path):
    s = parse_settings(["--gloo-timeout-seconds", "7", *HOST, "python", "x.py"])
    assert s.collective_timeout == 7.0
    s = parse_settings(["--network-interfaces", "lo,lo", "--network-interface", "lo", *HOST, "python", "x.py"])
    assert s.network_interface == "lo" and s.driver_address == "127.0.0.1"
    assert check.wants_check(["-cb"]) and check.wants_check(["--check-build", "-H", "localhost"])
    assert not check.wants_check(["-np", "1", "python", "x.py", "-cb"])  # the script's own flag


def test_several_interfaces_reach_gloo(capsys):
    s = parse_settings(["--network-interface", "lo", "--network-interface", "lo,eth-x", *HOST, "python", "x.py"])
    assert s.network_interface == "lo,eth-x" and s.driver_address == "127.0.0.1"
    assert shared_environment(s, {}, remote=False)["GLOO_SOCKET_IFNAME"] == "lo,eth-x"
    err = _refused(["--network-interface", "eth-x,lo", *HOST, "python", "x.py"], capsys)
    assert "--network-interface eth-x:" in err, err  # the driver listens on the first


def test_timeline_flag_settings(tmp_path, capsys):
    s = parse_settings(["--timeline-filename", "tl.json", "--timeline-mark-cycles", *HOST, "python", "x.py"])
    assert s.timeline_filename.endswith("/tl.json") and s.timeline_filename.startswith("/")
    assert s.timeline_mark_cycles and s.ignored_horovodrun_flags == ()
    env = shared_environment(s, {}, remote=True)
    assert env["HOROVOD_TIMELINE"] == s.timeline_filename and env["HOROVOD_TIMELINE_MARK_CYCLES"] == "1"
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = _refused(["--timeline-filename", str(blocker / "tl.json"), *HOST, "python", "x.py"], capsys)
    assert err.startswith(f"elasticrun: error: --timeline-filename {blocker}/tl.json: "), err


def test_run_keywords():
    from elasticrun.driver.cli.command import settings_from_keywords

    s = settings_from_keywords({"np": 1, "hosts": "localhost:1", "prefix_output_with_timestamp": True,
                                "gloo_timeout_seconds": 9}, ["python", "x.py"])
    assert s.prefix_output_with_timestamp and s.collective_timeout == 9.0


TRAIN = """
import sys
import torch
import elasticrun.torch as hvd

hvd.init()
state = hvd.elastic.ObjectState(step=0)


@hvd.elastic.run
def train(state):
    while state.step < 4:
        hvd.allreduce(torch.ones(4), name="grad")
        state.step += 1
        state.commit()


train(state)
print(f"done rank={hvd.rank()}", flush=True)
"""


def test_a_horovodrun_command_line_runs_as_it_is(job):
    """horovodrun --gloo ... with tuning flags, a timeline and timestamped output."""
    script = job.tmp / "train.py"
    script.write_text(TRAIN)
    timeline = job.tmp / "timeline.json"
    r = job.run(["--gloo", "-np", "2", "-H", "localhost:2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "5",
                 "--timeline-filename", str(timeline), "--timeline-mark-cycles", "--prefix-output-with-timestamp"],
                [sys.executable, str(script)])
    assert r.returncode == 0, r.output
    warnings = [line for line in r.stderr.splitlines() if "ignoring" in line]
    assert len(warnings) == 1 and "--fusion-threshold-mb, --cycle-time-ms" in warnings[0], r.stderr
    stamp = r"[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    for rank in (0, 1):
        assert re.search(rf"^{stamp}\[{rank}\]<stdout>:done rank={rank}$", r.stdout, re.M), r.stdout
    events = json.loads(timeline.read_text())  # rank 0's alone, as Horovod's
    names = [e["name"] for e in events]
    assert [e["args"]["name"] for e in events if e["name"] == "process_name"][0].startswith("rank 0 ")
    assert sum("allreduce grad" in n for n in names) == 4, names
    assert names.count("commit") == 4, names  # --timeline-mark-cycles: one mark per commit
    assert sorted(p.name for p in job.tmp.iterdir() if p.name.startswith("timeline")) == ["timeline.json"]


STALLED = """
import time
import torch
import elasticrun.torch as hvd

hvd.init()
if hvd.rank() == 1:
    time.sleep(6)  # busy alone: rank 0's allreduce stalls (and this rank hears of its end when it is back)
hvd.allreduce(torch.ones(1), name="metric")
print(f"done rank={hvd.rank()}", flush=True)
"""


def test_the_stall_check_flags_warn_then_end_a_stalled_collective(job):
    """horovodrun's --stall-check-*-time-seconds: rank 0 says it waits after 1 s, gives up after
    2 s (not after --collective-timeout's 30 minutes), and the job ends with that reason."""
    script = job.tmp / "stalled.py"
    script.write_text(STALLED)
    r = job.run(["-np", "2", "-H", "localhost:2", "--stall-check-warning-time-seconds", "1",
                 "--stall-check-shutdown-time-seconds", "2"], [sys.executable, str(script)])
    assert r.returncode != 0 and "done rank" not in r.stdout, r.output
    assert "ignoring" not in r.stderr, r.stderr  # taken, not named among Horovod's tuning flags
    assert re.search(r"rank 0: allreduce metric .*has waited 1 s for the other ranks: .*waiting up to "
                     r"--stall-check-shutdown-time-seconds 2 s", r.stderr), r.stderr
    assert re.search(r"The job failed after [\d.]+ s: .*allreduce metric .*waited 2 s for the other ranks, the stall "
                     r"check's shutdown time", r.stderr), r.stderr


BUSY_ALONE = """
import os
import time
import torch
import elasticrun.torch as hvd

hvd.init()
hvd.allreduce(torch.ones(1), name="warmup")
if hvd.rank() == 1:  # evaluating alone, until the test has seen the driver's line (at most 60 s)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["RELEASE"]) and time.monotonic() < deadline:
        time.sleep(0.05)
hvd.allreduce(torch.ones(1), name="metric")
print(f"done rank={hvd.rank()}", flush=True)
"""


def test_the_driver_names_the_rank_a_stalled_collective_waits_for(job):
    """A waiting rank cannot tell which peer holds it; the driver can (each heartbeat says
    whether its worker is in a collective): past the stall warning it names the rank in none.
    Before, the only line was rank 0's "one of them is busy outside collectives ... or stuck"."""
    script, release = job.tmp / "busy.py", job.tmp / "release"
    script.write_text(BUSY_ALONE)
    proc = job.start(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--stall-check-warning-time-seconds", "1"],
                     [sys.executable, str(script)], RELEASE=str(release))
    assert proc.stderr is not None
    seen: list[str] = []
    named = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if "which is in none" in line:
                named.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    assert named.wait(60), "".join(seen)
    release.touch()
    out, _ = proc.communicate(timeout=60)
    reader.join(10)
    err = "".join(seen)
    assert proc.returncode == 0 and "done rank=0" in out and "done rank=1" in out, err
    assert re.search(r"round 0: 1 rank\(s\) have waited \d+ s in a collective for rank 1 \(127\.0\.0\.1\[0\]\), "
                     r"which is in none: busy alone .* or stuck; the round waits", err), err
    assert err.count("which is in none") == 1, err  # said once (again only after 5 minutes)
    assert_nothing_left(job.tag)


LOGGING = """
import logging
import elasticrun.torch as hvd

hvd.init()
logging.basicConfig(level=logging.INFO, format="mine %(name)s %(levelname)s %(message)s")
logging.getLogger("train").info("epoch 1 of rank %d", hvd.rank())
logging.getLogger("somelibrary").debug("a library's debug line")
"""


@pytest.mark.parametrize("flags", [[], ["--verbose"]], ids=["default", "verbose"])
def test_the_scripts_logging_configured_after_init_is_its_own(job, flags):
    """hvd.init() configures elasticrun's loggers only: a basicConfig() after it takes effect
    (a handler on the root logger made it a no-op, and the script's INFO lines vanished), and
    --verbose shows elasticrun's DEBUG lines, not every library's."""
    script = job.tmp / "logs.py"
    script.write_text(LOGGING)
    r = job.run([*flags, "-np", "1", "-H", "localhost:1"], [sys.executable, str(script)])
    assert r.returncode == 0, r.output
    assert "[0]<stderr>:mine train INFO epoch 1 of rank 0" in r.stderr, r.stderr
    assert "a library's debug line" not in r.stderr, r.stderr


def test_horovod_timeline_variable_with_a_file_per_rank(job):
    """HOROVOD_TIMELINE set by the user, as for Horovod; {rank} in it: every rank's own file."""
    script = job.tmp / "train.py"
    script.write_text(TRAIN)
    r = job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "-x", f"HOROVOD_TIMELINE={job.tmp}/tl-{{rank}}.json"],
                [sys.executable, str(script)])
    assert r.returncode == 0, r.output
    for rank in (0, 1):
        events = json.loads((job.tmp / f"tl-{rank}.json").read_text())
        assert sum("allreduce grad" in e["name"] for e in events) == 4
        assert not any(e["name"] == "commit" for e in events)  # no marks unless asked


def test_help_names_the_horovodrun_flags():
    r = subprocess.run([sys.executable, "-m", "elasticrun", "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0 and "horovodrun command lines" in r.stdout and "--timeline-filename" in r.stdout
    assert "--fusion-threshold-mb" in r.stdout and "--mpi" in r.stdout


def test_a_horovodrun_yaml_config_file(tmp_path, capsys):
    config = tmp_path / "horovod.yaml"
    config.write_text("controller: gloo\nparams:\n  fusion_threshold_mb: 32\ntimeline:\n  filename: "
                      f"{tmp_path}/tl.json\n  mark_cycles: true\nlibrary_options:\n  gloo_timeout_seconds: 45\n"
                      "logging:\n  level: warning\n")
    s = parse_settings(["--config-file", str(config), *HOST, "python", "x.py"])
    assert s.timeline_filename == f"{tmp_path}/tl.json" and s.timeline_mark_cycles
    assert s.collective_timeout == 45.0 and s.log_level == "WARNING"
    assert s.ignored_horovodrun_flags == ("--fusion-threshold-mb",)
    s = parse_settings(["--config-file", str(config), "--gloo-timeout-seconds", "9", *HOST, "python", "x.py"])
    assert s.collective_timeout == 9.0  # flags win, as with horovodrun
    config.write_text("controller: mpi\n")
    assert "--mpi: elasticrun has no MPI" in _refused(["--config-file", str(config), *HOST, "python", "x.py"], capsys)
    config.write_text("params:\n  fusion_threshold_mb: -1\n")
    err = _refused(["--config-file", str(config), *HOST, "python", "x.py"], capsys)
    assert "key 'fusion-threshold-mb'" in err and "must be between 0 and 1,000,000" in err, err
