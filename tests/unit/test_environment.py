"""What environment a worker starts with (elasticrun/driver/environment.py, pure)."""

from __future__ import annotations

import dataclasses

import pytest

from elasticrun.common import env, liveness
from elasticrun.common.auth import JobKeys
from elasticrun.common.settings import JobSettings
from elasticrun.driver.assignment import SlotInfo
from elasticrun.driver.environment import (
    driver_timeout,
    forwarded_environment,
    heartbeat_interval,
    shared_environment,
    worker_environment,
)

INFO = SlotInfo(host="node2", slot=1, rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2)
DRIVER_ENV = {"PATH": "/bin", "HOME": "/root", "PWD": "/here", "OLDPWD": "/", "SHLVL": "2", "_": "/usr/bin/x",
              "BASH_FUNC_module%%": "() { :; }", "SSH_AUTH_SOCK": "/tmp/agent", "LD_LIBRARY_PATH": "/lib",
              "ELASTICRUN_TEST_TAG": "t"}
SETTINGS = JobSettings(command=["python", "train.py"], np=4, min_np=2, max_np=8, collective_timeout=42.0,
                       worker_log_level="INFO")


def _env(settings: JobSettings = SETTINGS, base: dict[str, str] = DRIVER_ENV, remote: bool = False) -> dict[str, str]:
    return worker_environment(settings, INFO, job_id="job1", worker_id="w7", control_addr="tcp://10.0.0.1:5000",
                              base_env=base, remote=remote)


def _job_part(settings: JobSettings = SETTINGS, remote: bool = False) -> dict[str, str]:
    """What every worker gets from the job itself, whatever else it inherits (also the driver's
    process, to tell a stopped driver from a gone one where the worker runs on the driver's
    machine, whichever launcher started it: common/liveness.py)."""
    mine = {env.DRIVER_PROCESS: liveness.identity()}
    return {**mine,
        env.HOSTNAME: "node2", env.RANK: "3", env.SIZE: "4", env.LOCAL_RANK: "1", env.LOCAL_SIZE: "2",
        env.CROSS_RANK: "1", env.CROSS_SIZE: "2", env.SLOT: "1", env.WORKER_ID: "w7", env.JOB_ID: "job1",
        env.CONTROL_ADDR: "tcp://10.0.0.1:5000",
        env.COLLECTIVE_TIMEOUT: "42.0", env.RENDEZVOUS_TIMEOUT: str(settings.elastic_wait_limit),
        env.HEARTBEAT_INTERVAL: "0.5", env.DRIVER_TIMEOUT: "5.0", env.LOG_LEVEL: "INFO", env.SIGTERM_GRACE: "20.0", env.BACKEND: settings.backend,
        env.PREFETCH: "1",
        "PYTHONUNBUFFERED": "1",
        "HOROVOD_HOSTNAME": "node2", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2",
        "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
        # as horovodrun sets them (this job is elastic: --min-np 2 of -np 4)
        "HOROVOD_ELASTIC": "1", "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_LOG_LEVEL": settings.worker_log_level,
    }


def test_forwarded_environment_drops_session_variables():
    assert forwarded_environment(DRIVER_ENV, True) == {
        "PATH": "/bin", "HOME": "/root", "LD_LIBRARY_PATH": "/lib", "ELASTICRUN_TEST_TAG": "t"}
    assert forwarded_environment(DRIVER_ENV, False) == {}


def test_a_local_worker_inherits_the_whole_driver_environment():
    assert _env() == {**DRIVER_ENV, **_job_part()}


def test_a_remote_worker_gets_the_forwarded_part():
    assert _env(remote=True) == {**forwarded_environment(DRIVER_ENV, True), **_job_part(remote=True)}


def test_no_forward_env_gives_a_remote_worker_only_the_x_variables_and_the_jobs_own():
    s = dataclasses.replace(SETTINGS, forward_env=False, extra_env={"GREETING": "hi", "PATH": "/opt/bin"})
    assert _env(s, remote=True) == {"GREETING": "hi", "PATH": "/opt/bin", **_job_part(s, remote=True)}
    # A local worker is a child process: it inherits everything whatever the flag says.
    assert _env(s) == {**DRIVER_ENV, "GREETING": "hi", "PATH": "/opt/bin", **_job_part(s)}


@pytest.mark.parametrize("remote", [False, True])
def test_x_variables_override_the_driver_environment_and_never_the_jobs_own(remote):
    s = dataclasses.replace(SETTINGS, extra_env={"HOME": "/data", "NEW": "1", env.RANK: "99", env.JOB_ID: "x"})
    worker = _env(s, remote=remote)
    assert worker["HOME"] == "/data" and worker["NEW"] == "1"
    assert worker[env.RANK] == "3" and worker[env.JOB_ID] == "job1"


@pytest.mark.parametrize("remote", [False, True])
def test_a_shared_part_computed_once_gives_every_worker_what_its_own_would(remote):
    """The driver reads its environment once per batch of launches (``shared``), not per worker."""
    s = dataclasses.replace(SETTINGS, extra_env={"HOME": "/data", env.RANK: "99"}, network_interface="eth1")
    shared = shared_environment(s, DRIVER_ENV, remote)
    before = dict(shared)
    got = worker_environment(s, INFO, job_id="job1", worker_id="w7", control_addr="tcp://10.0.0.1:5000",
                             base_env={}, remote=remote, shared=shared)
    assert got == _env(s, remote=remote)
    assert shared == before  # each worker's part goes into its own copy


def test_network_interface_sets_gloo_socket_ifname_unless_the_driver_has_it():
    s = dataclasses.replace(SETTINGS, network_interface="eth1", driver_address="10.0.0.1")
    assert _env(s)["GLOO_SOCKET_IFNAME"] == "eth1"
    assert _env(s, remote=True)["GLOO_SOCKET_IFNAME"] == "eth1"
    assert _env(dataclasses.replace(s, forward_env=False), remote=True)["GLOO_SOCKET_IFNAME"] == "eth1"
    mine = {**DRIVER_ENV, "GLOO_SOCKET_IFNAME": "ib0"}
    assert _env(s, base=mine)["GLOO_SOCKET_IFNAME"] == "ib0"
    assert _env(s, base=mine, remote=True)["GLOO_SOCKET_IFNAME"] == "ib0"
    assert _env(dataclasses.replace(s, extra_env={"GLOO_SOCKET_IFNAME": "eth9"}))["GLOO_SOCKET_IFNAME"] == "eth9"
    assert "GLOO_SOCKET_IFNAME" not in _env()  # without --network-interface: only what the driver has


def test_horovodruns_variables_are_set_as_it_sets_them_unless_the_driver_has_them():
    base = dataclasses.replace(SETTINGS, network_interface="eth1", tcp_only=True, collective_timeout=45.0,
                               worker_log_level="ERROR")
    env = _env(base)
    assert env["NCCL_SOCKET_IFNAME"] == "eth1" and env["NCCL_IB_DISABLE"] == "1"
    assert env["HOROVOD_CONTROLLER"] == env["HOROVOD_CPU_OPERATIONS"] == "gloo"
    assert "HOROVOD_GLOO_TIMEOUT_SECONDS" not in env and env["HOROVOD_LOG_LEVEL"] == "ERROR"
    assert env["HOROVOD_ELASTIC"] == "1"
    static = dataclasses.replace(base, hosts={"a": 2}, np=2, min_np=2, max_np=2)
    assert "HOROVOD_ELASTIC" not in _env(static)
    mine = {**DRIVER_ENV, "NCCL_SOCKET_IFNAME": "ib0", "NCCL_IB_DISABLE": "0"}
    assert _env(base, base=mine)["NCCL_SOCKET_IFNAME"] == "ib0" and _env(base, base=mine)["NCCL_IB_DISABLE"] == "0"
    assert "NCCL_IB_DISABLE" not in _env(dataclasses.replace(base, tcp_only=False))


@pytest.mark.parametrize("remote", [False, True])
def test_the_stall_check_flags_reach_the_workers_as_horovods_variables_over_the_drivers(remote):
    mine = {**DRIVER_ENV, "HOROVOD_STALL_CHECK_TIME_SECONDS": "30", "HOROVOD_STALL_CHECK_DISABLE": "1"}
    unset = _env(SETTINGS, base=mine, remote=remote)  # no flag: the driver's own variables go through
    assert unset["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "30" and unset["HOROVOD_STALL_CHECK_DISABLE"] == "1"
    assert "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" not in unset
    flags = dataclasses.replace(SETTINGS, stall_check=True, stall_warning_s=10, stall_shutdown_s=20)
    given = _env(flags, base=mine, remote=remote)
    assert given["HOROVOD_STALL_CHECK_TIME_SECONDS"] == "10" and given["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] == "20"
    assert "HOROVOD_STALL_CHECK_DISABLE" not in given  # --stall-check turns a disabled check back on
    off = _env(dataclasses.replace(SETTINGS, stall_check=False), remote=remote)
    assert off["HOROVOD_STALL_CHECK_DISABLE"] == "1"


def test_the_environment_holds_no_key_material():
    """The keys travel through a pipe: the environment is built without them, local or remote."""
    keys = JobKeys.generate()
    secrets = [keys.secret.hex(), keys.worker.encode().decode(), keys.worker.client_secret.decode(),
               keys.server_secret.decode()]
    for remote in (False, True):
        worker = _env(remote=remote)
        assert env.SECRET_FD not in worker
        text = "\n".join(f"{k}={v}" for k, v in worker.items())
        assert not any(s in text for s in secrets)


def test_heartbeats_slow_down_past_a_thousand_workers_but_stay_well_inside_the_timeouts():
    assert heartbeat_interval(0.5, 8, 5.0, 5.0) == 0.5
    assert heartbeat_interval(0.5, 1000, 5.0, 5.0) == 0.5
    assert heartbeat_interval(0.5, 2000, 5.0, 5.0) == 1.0  # the driver hears 2,000 a second
    assert heartbeat_interval(0.5, 4096, 5.0, 5.0) == 1.25  # a quarter of the 5 s timeouts
    assert heartbeat_interval(0.5, 4096, 60.0, 60.0) == 2.048
    assert heartbeat_interval(0.5, 4096, None, 8.0) == 2.0  # --heartbeat-timeout off: the worker's own bounds it
    assert heartbeat_interval(0.5, 4096, 1.0, 1.0) == 0.5  # never below the base


def test_the_launch_environment_carries_the_interval_for_the_jobs_size():
    def interval(size: int) -> tuple[float, float]:
        info = dataclasses.replace(INFO, size=size)
        environ = worker_environment(SETTINGS, info, job_id="j", worker_id="w", control_addr="tcp://x:1",
                                     base_env={}, remote=False)
        return float(environ[env.HEARTBEAT_INTERVAL]), float(environ[env.DRIVER_TIMEOUT])

    assert interval(4) == (0.5, 5.0) and interval(4096) == (1.25, 20.48)


def test_workers_wait_longer_for_a_driver_busy_with_thousands():
    assert driver_timeout(5.0, 2) == 5.0
    assert driver_timeout(5.0, 1000) == 5.0
    assert driver_timeout(5.0, 2048) == 10.24
    assert driver_timeout(5.0, 4096) == 20.48
    assert driver_timeout(30.0, 4096) == 30.0
