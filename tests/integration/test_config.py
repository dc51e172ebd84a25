"""Options from a TOML config file and ELASTICRUN_* variables (flags > env > file > defaults),
and ``elasticrun --check`` on healthy and broken hosts."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from elasticrun.common import env as protocol_env
from elasticrun.common.settings import DEFAULT_COLLECTIVE_TIMEOUT
from elasticrun.driver.cli import config
from elasticrun.driver.cli.command import parse_settings
from sshd import ssh_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.timeout(120)


def elasticrun(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "elasticrun", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def clean_env(**extra: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICRUN_")}
    return dict(base, **extra)


@pytest.fixture
def no_elasticrun_env(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("ELASTICRUN_", "HOROVOD_")):
            monkeypatch.delenv(name)
    return monkeypatch


def write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


# --- precedence --------------------------------------------------------------------------------
def test_precedence_file_env_flag(tmp_path, no_elasticrun_env):
    cfg = write(tmp_path / "job.toml", """
num-proc = 2
min_np = 1
hosts = "localhost:2"
ssh-port = 1001
start-timeout = 7
discovery-interval = 3
blacklist-cooldown-range = [1, 10]
no-forward-env = true
""")
    s = parse_settings(["--config-file", cfg, "python", "x.py"])
    assert (s.np, s.min_np, s.hosts, s.ssh_port, s.start_timeout, s.discovery_interval) == \
        (2, 1, {"localhost": 2}, 1001, 7.0, 3.0)
    assert s.cooldown_range == (1.0, 10.0) and s.forward_env is False
    assert s.elastic_timeout == 600.0  # untouched: the default

    no_elasticrun_env.setenv("ELASTICRUN_SSH_PORT", "2002")
    no_elasticrun_env.setenv("ELASTICRUN_START_TIMEOUT", "8")
    s = parse_settings(["--config-file", cfg, "python", "x.py"])
    assert (s.ssh_port, s.start_timeout, s.discovery_interval) == (2002, 8.0, 3.0)  # env > file

    s = parse_settings(["--config-file", cfg, "-p", "3003", "python", "x.py"])
    assert (s.ssh_port, s.start_timeout) == (3003, 8.0)  # flag > env > file

    # The config file itself can come from the environment.
    no_elasticrun_env.setenv("ELASTICRUN_CONFIG_FILE", cfg)
    assert parse_settings(["python", "x.py"]).hosts == {"localhost": 2}


def test_flag_replaces_the_files_host_choice(tmp_path, no_elasticrun_env):
    cfg = write(tmp_path / "job.toml", 'np = 1\nhosts = "localhost:1"\n')
    hostfile = write(tmp_path / "hosts", "127.0.0.1 slots=3\n")
    s = parse_settings(["--config-file", cfg, "--hostfile", hostfile, "python", "x.py"])
    assert s.hosts == {"127.0.0.1": 3}


def test_env_lists_add_up(tmp_path, no_elasticrun_env):
    no_elasticrun_env.setenv("B", "from-shell")
    cfg = write(tmp_path / "job.toml", 'np = 1\nhosts = "localhost"\nenv = ["A=1", "B=file"]\n')
    s = parse_settings(["--config-file", cfg, "-x", "B", "-x", "C=3", "python", "x.py"])
    assert s.extra_env == {"A": "1", "B": "from-shell", "C": "3"}


def test_env_names_never_collide_with_the_worker_protocol():
    protocol = {v for k, v in vars(protocol_env).items() if k.isupper() and isinstance(v, str)}
    assert protocol and not (set(config.ENV_VARS) & protocol)
    # Nor Horovod's names with what the driver sets for workers (a job started from a worker).
    from elasticrun.driver.environment import shared_environment, worker_environment
    from elasticrun.driver.cli.command import parse_settings as parse
    from elasticrun.driver.assignment import SlotInfo

    s = parse(["-np", "1", "--timeline-filename", "/tmp/x.json", "python", "x.py"])
    info = SlotInfo(host="h", slot=0, rank=0, size=1, local_rank=0, local_size=1, cross_rank=0, cross_size=1)
    given = set(worker_environment(s, info, job_id="j", worker_id="w", control_addr="a",
                                   base_env={}, remote=True)) | set(shared_environment(s, {}, remote=True))
    assert "HOROVOD_RANK" in given and not (set(config.HOROVOD_ENV_VARS) & given)


def test_horovods_variables_under_ours_and_the_flags(tmp_path, no_elasticrun_env):
    no_elasticrun_env.setenv("HOROVOD_START_TIMEOUT", "77")
    no_elasticrun_env.setenv("HOROVOD_ELASTIC_TIMEOUT", "88")
    no_elasticrun_env.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "99")
    s = parse_settings(["-np", "1", "python", "x.py"])
    assert (s.start_timeout, s.elastic_timeout, s.collective_timeout) == (77, 88, 99)
    no_elasticrun_env.setenv("ELASTICRUN_START_TIMEOUT", "11")
    s = parse_settings(["-np", "1", "--elastic-timeout", "12", "python", "x.py"])
    assert (s.start_timeout, s.elastic_timeout, s.collective_timeout) == (11, 12, 99)
    no_elasticrun_env.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "soon")
    with pytest.raises(SystemExit):
        parse_settings(["-np", "1", "python", "x.py"])


def test_protocol_variables_in_the_environment_are_not_read(tmp_path, no_elasticrun_env):
    # A shell that inherited a worker's environment (or a user who set these) changes nothing.
    no_elasticrun_env.setenv(protocol_env.LOG_LEVEL, "DEBUG")
    no_elasticrun_env.setenv(protocol_env.COLLECTIVE_TIMEOUT, "1")
    no_elasticrun_env.setenv(protocol_env.RANK, "3")
    s = parse_settings(["-np", "1", "-H", "localhost", "python", "x.py"])
    assert (s.log_level, s.worker_log_level, s.collective_timeout) == ("INFO", "WARNING", DEFAULT_COLLECTIVE_TIMEOUT)


def test_evict_stragglers_from_file_env_flag_and_keyword(tmp_path, no_elasticrun_env):
    """Issue 16: --evict-stragglers, ``evict-stragglers = true``, ELASTICRUN_EVICT_STRAGGLERS and
    ``elasticrun.run(evict_stragglers=True)`` mean one thing."""
    from elasticrun.driver.cli.command import settings_from_keywords

    base = ["-np", "1", "-H", "localhost"]
    assert parse_settings([*base, "python", "x.py"]).evict_stragglers is False
    assert parse_settings([*base, "--evict-stragglers", "python", "x.py"]).evict_stragglers is True
    cfg = write(tmp_path / "job.toml", "evict-stragglers = true\n")
    assert parse_settings(["--config-file", cfg, *base, "python", "x.py"]).evict_stragglers is True
    for text, value in (("1", True), ("TRUE", True), ("on", True), ("0", False), ("no", False)):
        no_elasticrun_env.setenv("ELASTICRUN_EVICT_STRAGGLERS", text)
        assert parse_settings(["--config-file", cfg, *base, "python", "x.py"]).evict_stragglers is value, text
    no_elasticrun_env.delenv("ELASTICRUN_EVICT_STRAGGLERS")
    kw = settings_from_keywords({"np": 1, "hosts": "localhost", "evict_stragglers": True}, ["python", "x.py"])
    assert kw == parse_settings([*base, "--evict-stragglers", "python", "x.py"])


def test_a_bad_true_false_variable_is_one_line():
    r = elasticrun("-np", "1", "-H", "localhost", "true", env=clean_env(ELASTICRUN_EVICT_STRAGGLERS="maybe"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r
    assert "ELASTICRUN_EVICT_STRAGGLERS='maybe': must be 1 or 0 (true/false, yes/no, on/off)" in lines[0], r


# --- errors: exit 2, one line ------------------------------------------------------------------
@pytest.mark.parametrize("toml,expected", [
    ("min-np = 1\nbogus-option = 3\n", "unknown key 'bogus-option'"),
    ('min-np = "2"\n', "key 'min-np' must be a whole number, not a string ('2')"),
    ("ssh-port = 0\n", "key 'ssh-port': '0' must be a port number from 1 to 65535"),
    ('blacklist-cooldown-range = [1]\n', "key 'blacklist-cooldown-range' must be a list of 2 numbers"),
    ('launcher = "telnet"\n', "key 'launcher' must be one of 'auto', 'local', 'ssh'"),
    ('verbose = "yes"\n', "key 'verbose' must be true or false"),
    ('hosts = "localhost"\nhostfile = "h"\n', "keys 'hosts' and 'hostfile' cannot be used together"),
    ("np = [\n", "not valid TOML"),
])
def test_bad_config_file(tmp_path, toml, expected):
    cfg = write(tmp_path / "bad.toml", toml)
    r = elasticrun("--config-file", cfg, "-np", "1", "-H", "localhost", "python", "x.py", env=clean_env())
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and cfg in lines[0], r.stderr


def test_missing_config_file_and_bad_env(tmp_path):
    r = elasticrun("--config-file", str(tmp_path / "nope.toml"), "-np", "1", "-H", "localhost", "true",
                   env=clean_env())
    assert r.returncode == 2 and "nope.toml: No such file or directory" in r.stderr, r
    r = elasticrun("-np", "1", "-H", "localhost", "true", env=clean_env(ELASTICRUN_SSH_PORT="many"))
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "ELASTICRUN_SSH_PORT='many'" in lines[0], r


def test_a_tiny_job_from_a_config_file(tmp_path):
    cfg = write(tmp_path / "job.toml", 'np = 2\nhosts = "localhost:2"\nstart-timeout = 60\n')
    cmd = [sys.executable, "-c", "import elasticrun.torch as hvd; hvd.init(); print('rank', hvd.rank(), hvd.size())"]
    r = elasticrun("--config-file", cfg, *cmd, env=clean_env(), timeout=100)
    assert r.returncode == 0, r
    assert "rank 0 2" in r.stdout and "rank 1 2" in r.stdout, r.stdout


# --- --check -----------------------------------------------------------------------------------
def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_check_healthy_localhost():
    r = elasticrun("--check", "-H", "localhost:2", env=clean_env())
    assert r.returncode == 0, r
    assert "OK    torch " in r.stdout and "OK    gloo: available" in r.stdout and "pyzmq" in r.stdout
    assert "paramiko" in r.stdout and "cloudpickle" in r.stdout
    assert "OK    localhost: this machine: python" in r.stdout and "all checks passed" in r.stdout, r.stdout


def test_check_broken_hosts():
    port = closed_port()
    r = elasticrun("--check", "--launcher", "ssh", "-p", str(port), "--start-timeout", "10",
                   "-H", "no-such-host.invalid,127.0.0.9", env=clean_env())
    assert r.returncode == 1, r
    assert "FAIL  no-such-host.invalid: SSH: cannot resolve host name 'no-such-host.invalid'" in r.stdout, r.stdout
    assert f"FAIL  127.0.0.9: SSH: cannot connect to " in r.stdout and f"127.0.0.9:{port}: Connection refused" \
        in r.stdout, r.stdout
    assert "some checks FAILED" in r.stdout


def test_check_uses_the_config_file_and_discovery(tmp_path):
    script = tmp_path / "discover.sh"
    script.write_text("#!/bin/sh\necho localhost:2\necho 'not a host!'\n")
    script.chmod(0o755)
    cfg = write(tmp_path / "c.toml", f'host-discovery-script = "{script}"\n')
    r = elasticrun("--check", "--config-file", cfg, env=clean_env())
    assert r.returncode == 1, r
    assert "OK    discovery:" in r.stdout and "lists localhost:2" in r.stdout, r.stdout
    assert "FAIL  discovery:" in r.stdout and "line 2" in r.stdout and "OK    localhost:" in r.stdout, r.stdout


def test_check_over_ssh(ssh_server):  # noqa: F811
    r = elasticrun("--check", *ssh_server.ssh_args(), "--remote-python", sys.executable,
                   "-H", "127.0.0.2,127.0.0.5", env=clean_env())
    assert r.returncode == 1, r
    assert "OK    127.0.0.2: SSH to " in r.stdout and "torch 2." in r.stdout, r.stdout
    assert "FAIL  127.0.0.5: SSH: refusing to connect" in r.stdout and "not in" in r.stdout, r.stdout
    r = elasticrun("--check", *ssh_server.ssh_args(), "--remote-python", "no-such-python3", "-H", "127.0.0.3",
                   env=clean_env())
    assert r.returncode == 1 and "'no-such-python3' is not on the remote login PATH" in r.stdout, r.stdout
