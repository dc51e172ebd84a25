"""The SSH launcher's pure parts and its command line flags, without sshd.

The command line a remote shell runs is checked for quoting and for what it must never hold
(the environment, the keys, the user's command), and the payload sent over the channel for
its encoding. The bootstrap that payload carries is tested in ``test_remote_bootstrap.py``.
"""

from __future__ import annotations

import json
import shlex

import pytest

from elasticrun.driver.cli import command as cli

from elasticrun.driver.launch import ssh

pytestmark = pytest.mark.timeout(60)

SECRET = "5ec7e7" * 10
KEYS = b'{"v": 1, "secret": "' + SECRET.encode() + b'"}'  # the bootstrap only passes the blob on
MARK = "@@elasticrun:test@@ "


# --- command construction and quoting ------------------------------------------------------------
@pytest.mark.parametrize("python", ["python3", "/opt/my python/bin/python3", "py'thon", "$(touch /tmp/x)"])
def test_remote_command_quotes_every_word(python):
    line = ssh.remote_command(python, "job1", "w7")
    words = shlex.split(line)
    assert words == ["exec", python, "-c", ssh.LOADER, "elasticrun-worker", "job1", "w7"]


def test_remote_command_holds_no_environment_secret_or_user_command():
    env = {"TOKEN": "hunter2"}
    payload = ssh.launch_payload(["python", "train.py", "--lr", "0.1"], env, "/work", 5.0, MARK, KEYS)
    line = ssh.remote_command("python3", "job1", "w1")
    for word in (SECRET, "hunter2", "train.py", "TOKEN", "/work"):
        assert word not in line
        assert word.encode() in payload
    assert len(line) < 200  # no "argument list too long", whatever the environment
    request = json.loads(payload.split(b"\n")[1])
    assert request["keys"] == KEYS.decode() and SECRET not in json.dumps(request["env"])


def test_payload_is_ascii_json_lines_and_keeps_odd_values_exact():
    odd = {"NEWLINES": "a\nb\r\nc", "QUOTES": "it's \"q\" `x` $(y)", "UNICODE": "héllo ✓",
           "SURROGATE": "bad\udcff byte", "EMPTY": ""}
    payload = ssh.launch_payload(["cmd"], odd, "/tmp", 1.0, MARK)
    payload.decode("ascii")  # the remote locale cannot garble it
    lines = payload.split(b"\n")
    assert len(lines) == 3 and lines[2] == b""  # exactly two lines, newline-terminated
    assert json.loads(lines[0]) == ssh.bootstrap_source()
    assert json.loads(lines[1])["env"] == odd


def test_split_user():
    assert ssh.split_user("alice@node1", "bob") == ("alice", "node1")
    assert ssh.split_user("node1", "bob") == ("bob", "node1")
    assert ssh.split_user("node1")[0]  # the current user


@pytest.mark.parametrize("status,code", [(0, 0), (3, 3), (127, 127), (128, 128), (137, -9), (143, -15),
                                         (255, 255)])
def test_decode_exit_status(status, code):
    assert ssh.decode_exit_status(status) == code


# --- command line flags ------------------------------------------------------------------------------
BASE = ["-np", "1", "-H", "localhost", "python", "train.py"]


def test_cli_ssh_defaults():
    s = cli.parse_settings(BASE)
    assert (s.launcher, s.ssh_port, s.ssh_user, s.ssh_identity_file, s.ssh_accept_unknown_hosts) == \
        ("auto", 22, None, None, False)
    assert s.forward_env and s.remote_python == "python3" and s.driver_address is None and s.extra_env == {}


def test_cli_ssh_flags(tmp_path, monkeypatch):
    key = tmp_path / "id"
    key.write_text("x")
    key.chmod(0o600)  # a private key of yours: ssh refuses one others can read
    monkeypatch.setenv("FROM_HERE", "v1")
    s = cli.parse_settings(["--launcher", "ssh", "-p", "2222", "-i", str(key), "--ssh-user", "bob",
                            "--ssh-accept-unknown-hosts", "--remote-cwd", "/data", "-x", "FROM_HERE",
                            "--env", "SET=a=b", "--no-forward-env", "--network-interface", "lo", *BASE])
    assert (s.launcher, s.ssh_port, s.ssh_identity_file, s.ssh_user) == ("ssh", 2222, str(key), "bob")
    assert s.ssh_accept_unknown_hosts and s.remote_cwd == "/data" and not s.forward_env
    assert s.extra_env == {"FROM_HERE": "v1", "SET": "a=b"}
    assert s.driver_address == "127.0.0.1" and s.network_interface == "lo"
    assert s.command == ["python", "train.py"]


@pytest.mark.parametrize("args,expected", [
    (["-x", "NOT_SET_ANYWHERE_42"], "-x NOT_SET_ANYWHERE_42: NOT_SET_ANYWHERE_42 is not set here"),
    (["-x", "1BAD=x"], "not a valid environment variable name"),
    (["-i", "/nonexistent/key"], "-i /nonexistent/key: no such readable file"),
    (["--network-interface", "nosuch0"], "no network interface 'nosuch0'"),
    (["--driver-address", "203.0.113.7"], "cannot listen on 203.0.113.7"),
    (["--launcher", "rsh"], "invalid choice"),
])
def test_cli_ssh_errors(args, expected, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_settings([*args, *BASE])
    assert exc.value.code == 2
    assert expected in capsys.readouterr().err
