"""Warm worker start, the pure parts: which commands a template runs, the start-up variables,
the wire format (and the remote bootstrap's copy of it), the template's command line, the
options that turn it off or preload modules, and when the driver starts a template at all."""

from __future__ import annotations

import json
import os
import struct
import sys

import pytest

from elasticrun.common import env as envvars
from elasticrun.common import warmstart
from elasticrun.common.settings import JobSettings
from elasticrun.common.warmstart import PythonCommand, own_module_command, python_command
from elasticrun.driver.cli import command as cli
from elasticrun.driver.cli import config
from elasticrun.driver.launch import remote_bootstrap as rb
from elasticrun.driver.assignment import SlotInfo
from elasticrun.driver.environment import shared_environment, worker_environment
from elasticrun.driver.launch.launchers import Launchers
from elasticrun.driver.cli.parser import ExitingParser, build_parser
from elasticrun.driver.launch.warm import parse_ready, template_argv

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("command,expected", [
    (["python", "train.py"], PythonCommand("python", "script", "train.py", ())),
    (["/venv/bin/python3", "t.py", "--lr", "0.1", "-u"], PythonCommand("/venv/bin/python3", "script", "t.py",
                                                                       ("--lr", "0.1", "-u"))),
    (["python3.11", "-u", "t.py"], PythonCommand("python3.11", "script", "t.py", (), True)),
    (["python", "-m", "pkg.mod", "x"], PythonCommand("python", "module", "pkg.mod", ("x",))),
    (["python", "-mpkg", "-m"], PythonCommand("python", "module", "pkg", ("-m",))),
    (["python", "-u", "-m", "elasticrun.worker.entry"], PythonCommand("python", "module", "elasticrun.worker.entry",
                                                                      (), True)),
    (["python", "--", "-odd.py", "a"], PythonCommand("python", "script", "-odd.py", ("a",))),
    (own_module_command("python3", "elasticrun.worker.entry", "x"),
     PythonCommand("python3", "module", "elasticrun.worker.entry", ("x",), safe=True)),
])
def test_python_commands_a_template_runs(command, expected):
    assert python_command(command) == (expected, "")


@pytest.mark.parametrize("command,why", [
    ([], "no command"),
    (["torchrun", "--nproc-per-node", "2", "train.py"], "'torchrun' is not a Python interpreter"),
    (["bash", "-c", "python train.py"], "'bash' is not a Python interpreter"),
    (["python2", "t.py"], "not a Python interpreter"),
    (["pypy3", "t.py"], "not a Python interpreter"),
    (["python", "-X", "importtime", "t.py"], "the interpreter option '-X'"),
    (["python", "-c", "print(1)"], "'-c'"),
    (["python", "-O", "t.py"], "'-O'"),
    (["python", "-"], "'-'"),
    (["python"], "no script or module"),
    (["python", "-m"], "is not a module name"),
    (["python", "-m", "not a module"], "is not a module name"),
])
def test_other_commands_start_fresh(command, why):
    cmd, reason = python_command(command)
    assert cmd is None and why in reason


def test_sys_argv_before_the_script_runs():
    assert python_command(["python", "t.py", "a"])[0].argv == ["t.py", "a"]
    assert python_command(["python", "-m", "m", "a"])[0].argv == ["-m", "a"]  # runpy puts the file first


def test_start_up_variables():
    base = {"PATH": "/bin", "PYTHONPATH": "/a", "OMP_NUM_THREADS": "1", "ELASTICRUN_RANK": "0"}
    assert warmstart.startup_differences(base, dict(base, ELASTICRUN_RANK="3", CUDA_VISIBLE_DEVICES="1",
                                                    PYTHONUNBUFFERED="1", TZ="UTC", NCCL_DEBUG="INFO")) == []
    worker = dict(base, PYTHONPATH="/b", LD_PRELOAD="x.so", LC_ALL="C", HOME="/elsewhere")
    del worker["OMP_NUM_THREADS"]
    assert warmstart.startup_differences(base, worker) == ["HOME", "LC_ALL", "LD_PRELOAD", "OMP_NUM_THREADS",
                                                           "PYTHONPATH"]
    for name in ("PYTHONHASHSEED", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MALLOC_ARENA_MAX", "LANG",
                 "TORCH_CPP_LOG_LEVEL", "GLIBC_TUNABLES", "KMP_AFFINITY"):
        assert warmstart.is_startup_variable(name), name
    for name in ("PYTHONUNBUFFERED", "PATH", "CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME",
                 "TZ", "ELASTICRUN_RANK"):
        assert not warmstart.is_startup_variable(name), name


def test_unbuffered():
    cmd = python_command(["python", "t.py"])[0]
    assert not warmstart.unbuffered(cmd, {}) and not warmstart.unbuffered(cmd, {"PYTHONUNBUFFERED": ""})
    assert warmstart.unbuffered(cmd, {"PYTHONUNBUFFERED": "1"})
    assert warmstart.unbuffered(python_command(["python", "-u", "t.py"])[0], {})


def test_the_template_environment_is_a_workers_without_its_own_variables():
    settings = JobSettings(command=["python", "t.py"], np=1, min_np=1, max_np=1, extra_env={"X": "1"},
                           network_interface="eth9")
    base = {"PATH": "/bin", "ELASTICRUN_TEST_TAG": "t", "PWD": "/here"}
    info = SlotInfo(host="h", slot=0, rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
    for remote in (False, True):
        worker = worker_environment(settings, info, job_id="j", worker_id="w1", control_addr="tcp://a:1",
                                    base_env=base, remote=remote)
        shared = shared_environment(settings, base, remote)
        assert warmstart.template_environment(worker) == shared
        assert shared["X"] == "1" and shared["GLOO_SOCKET_IFNAME"] == "eth9" and shared["ELASTICRUN_TEST_TAG"] == "t"
        assert ("PWD" in shared) is (not remote)
    assert envvars.SECRET_FD not in warmstart.template_environment({envvars.SECRET_FD: "7", "A": "b"})


def test_requests_round_trip_and_the_bootstrap_encodes_them_alike():
    env = {"A": "b", "BAD": "\udcff", "UNI": "\u00e9"}
    data = warmstart.encode_request(["python", "t.py"], env, "/w", 5, True)
    assert data == rb.encode_request(["python", "t.py"], env, "/w", 5.0, True)
    with_notice = warmstart.encode_request(["python", "t.py"], env, "/w", 5, True, notice=True)
    assert with_notice == rb.encode_request(["python", "t.py"], env, "/w", 5.0, True, True)
    assert warmstart.decode_request(with_notice[4:], 5)["notice"] is True
    data[4:].decode("ascii")
    n = warmstart.request_length(data[:4])
    assert n == len(data) - 4
    req = warmstart.decode_request(data[4:], 4)
    assert req["command"] == ["python", "t.py"] and req["env"] == env and req["cwd"] == "/w" and req["keys"]
    assert warmstart.decode_request(warmstart.encode_request(["p"], {}, "/", 1, False)[4:], 3)["keys"] is False


@pytest.mark.parametrize("body,fds,why", [
    (b"not json", 3, "not a request"),
    (b'{"v": 2}', 3, "not a version 1 request"),
    (b'{"v": 1, "command": [], "env": {}, "cwd": "/", "grace": 1}', 3, "list of strings"),
    (b'{"v": 1, "command": ["p"], "env": {"A": 1}, "cwd": "/", "grace": 1}', 3, "strings to strings"),
    (b'{"v": 1, "command": ["p"], "env": {}, "cwd": 1, "grace": 1}', 3, "cwd must be a string"),
    (b'{"v": 1, "command": ["p"], "env": {}, "cwd": "/", "grace": 1, "keys": true}', 3, "needs 4"),
    (b'{"v": 1, "command": ["p"], "env": {}, "cwd": "/", "grace": 1}', 5, "needs 3"),
])
def test_bad_requests(body, fds, why):
    with pytest.raises(warmstart.WireError, match=why):
        warmstart.decode_request(body, fds)


def test_request_length_limit():
    with pytest.raises(warmstart.WireError, match="limit"):
        warmstart.request_length(struct.pack(">I", warmstart.MAX_REQUEST_BYTES + 1))


def test_replies():
    assert warmstart.decode_reply(warmstart.reply(pid=12)) == {"pid": 12}
    assert warmstart.decode_reply(warmstart.reply(exit=-9)) == {"exit": -9}
    with pytest.raises(warmstart.WireError):
        warmstart.decode_reply(b"[1]")


def test_template_command_line_and_ready_line():
    cmd = python_command(["python", "train.py", "--x"])[0]
    assert template_argv("/v/bin/python", "elasticrun-123", cmd, ("transformers", "datasets"), 5.0) == [
        "/v/bin/python", "-c", warmstart.OWN_MAIN, "elasticrun.worker.template", "--name", "elasticrun-123",
        "--grace", "5", "--script", "train.py", "--preload", "transformers,datasets", "--room", " " * warmstart.ARGV_ROOM]
    mod = python_command(["python", "-m", "mypackage.train"])[0]
    assert template_argv("python", "n", mod, (), 2.5)[-4:-2] == ["--module", "mypackage.train"]
    own = python_command(own_module_command("python", "elasticrun.worker.entry"))[0]
    assert template_argv("python", "n", own, (), 2.5)[-5:-2] == ["--module", "elasticrun.worker.entry", "--own-module"]
    assert parse_ready(warmstart.READY_PREFIX + '{"socket": "/tmp/x/template.sock", "pid": 3}')["pid"] == 3
    assert parse_ready("something else") is None
    assert parse_ready(warmstart.READY_PREFIX + '{"pid": 3}') is None


# --- options -----------------------------------------------------------------------------------
def _settings(argv: list[str], environ: dict[str, str] | None = None, monkeypatch=None) -> JobSettings:
    for name, value in (environ or {}).items():
        monkeypatch.setenv(name, value)
    return cli.parse_settings(argv)


def test_warm_start_is_on_by_default_and_off_by_flag_variable_or_file(monkeypatch, tmp_path):
    monkeypatch.delenv("ELASTICRUN_WARM_START", raising=False)
    assert cli.parse_settings(["-np", "1", "python", "t.py"]).warm_start is True
    assert cli.parse_settings(["-np", "1", "--no-warm-start", "python", "t.py"]).warm_start is False
    for text, warm in (("1", True), ("true", True), ("yes", True), ("0", False), ("off", False), ("No", False)):
        monkeypatch.setenv("ELASTICRUN_WARM_START", text)
        assert cli.parse_settings(["-np", "1", "python", "t.py"]).warm_start is warm, text
    monkeypatch.setenv("ELASTICRUN_WARM_START", "1")  # the flag is above the variable
    assert cli.parse_settings(["-np", "1", "--no-warm-start", "python", "t.py"]).warm_start is False
    monkeypatch.delenv("ELASTICRUN_WARM_START")
    toml = tmp_path / "c.toml"
    toml.write_text("no-warm-start = true\npreload = ['transformers', 'datasets']\n")
    s = cli.parse_settings(["-np", "1", "--config-file", str(toml), "python", "t.py"])
    assert s.warm_start is False and s.preload == ("transformers", "datasets")
    toml.write_text("warm-start = false\npreload = 'a.b'\n")
    s = cli.parse_settings(["-np", "1", "--config-file", str(toml), "python", "t.py"])
    assert s.warm_start is False and s.preload == ("a.b",)


def test_a_bad_flag_variable_is_one_line(monkeypatch, capsys):
    monkeypatch.setenv("ELASTICRUN_WARM_START", "maybe")
    with pytest.raises(SystemExit) as exc:
        cli.parse_settings(["-np", "1", "python", "t.py"])
    assert exc.value.code == 2
    assert "ELASTICRUN_WARM_START='maybe': must be 1 or 0" in capsys.readouterr().err


def test_preload_names(capsys):
    assert cli.parse_settings(["-np", "1", "--preload", "transformers, a.b", "python", "t.py"]).preload == (
        "transformers", "a.b")
    assert cli.parse_settings(["-np", "1", "--preload", "a", "--preload", "b,c", "--preload", "a", "python",
                               "t.py"]).preload == ("a", "b", "c")  # repeatable
    with pytest.raises(SystemExit):
        cli.parse_settings(["-np", "1", "--preload", "not-a-module", "python", "t.py"])
    assert "'not-a-module' is not a module name" in capsys.readouterr().err


def test_run_keywords():
    s = cli.settings_from_keywords({"np": 1, "warm_start": False, "preload": ["x", "y.z"]}, ["python", "t.py"])
    assert s.warm_start is False and s.preload == ("x", "y.z")
    assert cli.settings_from_keywords({"np": 1, "no_warm_start": True}, ["python", "t.py"]).warm_start is False


def test_the_variable_is_in_the_config_table():
    assert config.ENV_VARS["ELASTICRUN_WARM_START"] == "warm_start"
    actions = {a.dest for a in build_parser(ExitingParser)._actions}
    assert {"warm_start", "preload"} <= actions


# --- when the driver starts this machine's template ------------------------------------------------
class _Sink:
    def write(self, worker_id: str, stream: str, line: str) -> None:
        pass


@pytest.mark.parametrize("kw", [
    dict(command=["bash", "-c", "true"]),  # not Python
    dict(command=["python", "t.py"], warm_start=False),
    dict(command=["python", "t.py"], launcher="ssh"),
    dict(command=["python", "t.py"], hosts={"no-such-host.invalid": 1}),  # every host is another machine
    dict(command=["/nonexistent/python3", "t.py"]),  # no such interpreter: the launch says so
])
def test_no_template_when_none_would_serve(kw):
    s = JobSettings(np=1, min_np=1, max_np=1, **kw)
    launchers = Launchers(s)
    launchers.bind(lambda *_: None, _Sink())
    assert launchers.template is None
    launchers.stop_all(1)


# --- what /proc shows of a forked worker ----------------------------------------------------------
def test_the_environment_area_lists_the_workers_environment():
    original = b"A=1\0B=2\0C=3\0" + warmstart.ROOM_VAR.encode() + b"=" + b"." * 40 + b"\0"
    block = warmstart.environ_area(original, {"A": "1", "B": "2", "C": "4", "D": "5"})
    assert len(block) == len(original)
    assert block.startswith(b"A=1\0B=2\0")  # unchanged leading entries stay where they were
    assert sorted(x for x in block.split(b"\0") if x) == [b"A=1", b"B=2", b"C=4", b"D=5"]
    assert warmstart.ROOM_VAR.encode() not in block
    assert warmstart.environ_area(original, {"A": "1", "X": "y" * 100}) is None  # does not fit
    assert warmstart.environ_area(b"A=1\0", {}) == b"\0" * 4


def test_the_argument_area_holds_the_workers_command_line():
    assert warmstart.argv_area(20, ["python", "t.py", "-x"]) == b"python\0t.py\0-x\0" + b"\0" * 5
    assert warmstart.argv_area(5, ["python", "t.py"]) is None
    assert "." * warmstart.ROOM_BYTES == warmstart.with_room({"A": "1"})[warmstart.ROOM_VAR]
    assert list(warmstart.with_room({warmstart.ROOM_VAR: "x", "A": "1"})) == ["A", warmstart.ROOM_VAR]


def test_own_module_command_runs_a_module_as_python_m_without_the_current_directory(tmp_path):
    """elasticrun's own processes (the template, elasticrun.run's workers) start this way: a
    ``json.py`` where the job starts must not be imported, and the module sees the argv ``-m`` gives."""
    (tmp_path / "json.py").write_text("raise SystemExit('the planted json.py ran')\n")
    pkg = tmp_path / "lib"
    pkg.mkdir()
    (pkg / "shown.py").write_text("import json, sys\nprint(json.dumps([sys.argv[1:], __name__, '' in sys.path]))\n")
    env = dict(os.environ, PYTHONPATH=str(pkg))
    import subprocess
    for python_args in ([], ["-u"]):
        command = own_module_command(sys.executable, "shown", "a", "-m")
        command[1:1] = python_args
        out = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout) == [["a", "-m"], "__main__", False]
