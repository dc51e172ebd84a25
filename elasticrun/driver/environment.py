"""What environment a worker starts with (pure: the driver only passes it to its launcher).

A worker on this machine inherits the driver's whole environment, as any child process would.
A remote worker gets the driver's environment minus what describes the driver's own shell or
session (as horovodrun forwards it), or, with ``--no-forward-env``, nothing of it: it then
keeps its remote login environment, which the bootstrap lays under this one. On top come the
``-x`` variables and the job's own ``ELASTICRUN_*`` variables (``elasticrun.common.env``),
which nothing can override.

The job's keys are never part of it: they reach the worker through an inherited pipe
(``elasticrun.common.secretpipe``), whose number the launcher adds.
"""

from __future__ import annotations

import os
from typing import Mapping

from elasticrun.common import env, liveness
from elasticrun.common.settings import JobSettings
from elasticrun.driver.assignment import SlotInfo

# Variables of the driver's environment that describe the driver's own shell or session and
# must not be imposed on a remote worker (horovodrun skips the first ones too).
_NOT_FORWARDED = frozenset({
    "OLDPWD", "PWD", "SHLVL", "_", "HOSTNAME", "SSH_CLIENT", "SSH_CONNECTION", "SSH_TTY", "SSH_AUTH_SOCK",
    "SSH_AGENT_PID", "DISPLAY", "XAUTHORITY", "TMUX", "TMUX_PANE", "STY", "WINDOWID", "TERMCAP",
})
_NOT_FORWARDED_PREFIXES = ("BASH_FUNC_",)


def forwarded_environment(environ: Mapping[str, str], forward: bool) -> dict[str, str]:
    """The part of the driver's environment a remote worker gets (before -x and the job's own).

    ``forward=False`` (``--no-forward-env``): nothing; the worker keeps the remote login
    environment plus what ``-x`` names.
    """
    if not forward:
        return {}
    return {k: v for k, v in environ.items()
            if k not in _NOT_FORWARDED and not k.startswith(_NOT_FORWARDED_PREFIXES)}


def horovod_environment(info: SlotInfo) -> dict[str, str]:
    """The placement under ``HOROVOD_*`` names (as horovodrun's Gloo launcher sets them) and
    torch.distributed's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``."""
    place = {"RANK": info.rank, "SIZE": info.size, "LOCAL_RANK": info.local_rank, "LOCAL_SIZE": info.local_size,
             "CROSS_RANK": info.cross_rank, "CROSS_SIZE": info.cross_size, "HOSTNAME": info.host}
    out = {f"HOROVOD_{k}": str(v) for k, v in place.items()}
    out.update(RANK=str(info.rank), WORLD_SIZE=str(info.size), LOCAL_RANK=str(info.local_rank),
               LOCAL_WORLD_SIZE=str(info.local_size))
    return out


def shared_environment(settings: JobSettings, base_env: Mapping[str, str], remote: bool) -> dict[str, str]:
    """What every worker of a host gets before its own ``ELASTICRUN_*`` variables: also the
    environment of the host's warm-start template (``worker/template.py``), which must start
    like its workers would (the remote bootstrap lays the remote login environment under it)."""
    s = settings
    shared = forwarded_environment(base_env, s.forward_env) if remote else dict(base_env)
    # As horovodrun sets them (its gloo_run and config_parser), unless this environment does:
    # the interface for gloo and for NCCL (which carries CUDA tensors here), NCCL kept on TCP by
    # --tcp, and what Horovod's own code and users' scripts read of the job.
    # (Not HOROVOD_GLOO_TIMEOUT_SECONDS: the driver reads it, and a job started from a worker
    # must not inherit this one's settings through it.)
    defaults = {"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_LOG_LEVEL": s.worker_log_level}
    if s.network_interface:
        defaults.update(GLOO_SOCKET_IFNAME=s.network_interface, NCCL_SOCKET_IFNAME=s.network_interface)
    if s.tcp_only:
        defaults["NCCL_IB_DISABLE"] = "1"
    if s.elastic:
        defaults["HOROVOD_ELASTIC"] = "1"
    for name, value in defaults.items():
        if name not in base_env:
            shared.setdefault(name, value)
    if s.timeline_filename:  # read by the worker's hvd.init(), as Horovod's workers read it
        shared["HOROVOD_TIMELINE"] = s.timeline_filename
        shared["HOROVOD_TIMELINE_MARK_CYCLES"] = "1" if s.timeline_mark_cycles else "0"
    # The stall check's flags, as horovodrun passes them: over the variables this environment has.
    if s.stall_check is False:
        shared["HOROVOD_STALL_CHECK_DISABLE"] = "1"
    elif s.stall_check:
        shared.pop("HOROVOD_STALL_CHECK_DISABLE", None)
    if s.stall_warning_s is not None:
        shared["HOROVOD_STALL_CHECK_TIME_SECONDS"] = str(s.stall_warning_s)
    if s.stall_shutdown_s is not None:
        shared["HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"] = str(s.stall_shutdown_s)
    shared.update(s.extra_env)
    shared["PYTHONUNBUFFERED"] = "1"
    return shared


_identity: dict[int, str | None] = {}  # this process (the driver) by its pid: forks are others


def _driver_process() -> str | None:
    pid = os.getpid()
    if pid not in _identity:
        _identity.clear()
        _identity[pid] = liveness.identity(pid)
    return _identity[pid]


#: About how many heartbeats a second the driver answers at most (each costs it ~0.1 ms of one
#: core: HMAC, JSON, a reply): past this many workers their interval grows with the job.
HEARTBEATS_PER_SECOND = 2000


def heartbeat_interval(base: float, workers: int, heartbeat_timeout: float | None, driver_timeout: float) -> float:
    """A worker's heartbeat interval in a job of ``workers``: ``base`` (0.5 s) up to 1,000
    workers, then longer so that the driver hears about HEARTBEATS_PER_SECOND of them (4,096
    workers at 0.5 s sent 8,192 a second, which took 0.9 of a core and made the driver fall
    seconds behind its inbox). Never past a quarter of either timeout that silence trips, so
    that a few late or lost heartbeats never look like a hang or a lost driver."""
    interval = max(base, workers / HEARTBEATS_PER_SECOND)
    for limit in (heartbeat_timeout, driver_timeout):
        if limit:
            interval = min(interval, max(base, limit / 4))
    return interval


#: Workers per second of a worker's patience with a silent driver, past its 5 s default.
WORKERS_PER_PATIENCE_SECOND = 200


def driver_timeout(base: float, workers: int) -> float:
    """How long a worker of a job of ``workers`` waits for a silent driver before it exits:
    ``base`` (5 s) up to 1,000 workers, then 5 ms per worker. A driver forming a round of
    thousands answers heartbeats late while every worker connects: each connection's CURVE
    handshake costs its I/O thread ~0.8 ms (benchmarks/curve_connect.py), two per worker, so
    a worker's first answer can wait behind everyone's (longest gaps measured: 3.4 s at 2,048
    workers on 16 cores; 5.3 s at 2,048 and 12.0 s at 4,096 on 2 cores shared with the
    simulator, 2.6-2.9 ms per worker).
    Workers that gave up on a driver that is only busy would end the job they wait for."""
    return max(base, workers / WORKERS_PER_PATIENCE_SECOND)


def worker_environment(settings: JobSettings, info: SlotInfo, *, job_id: str, worker_id: str,
                       control_addr: str, base_env: Mapping[str, str],
                       remote: bool, durable_addr: str | None = None, joining: bool = False,
                       shared: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of worker ``worker_id``, started for ``info`` (its place in the round).

    ``base_env`` is the driver's environment (``os.environ``); ``remote``: the worker runs on
    another machine; ``control_addr``: the driver's endpoint that machine reaches (requests,
    heartbeats and notifications); ``durable_addr``: the durable-copy socket, with
    ``--checkpoint-dir``. ``--network-interface`` also sets ``GLOO_SOCKET_IFNAME`` unless the
    driver's environment has it. ``joining``: the job's rounds have begun, so the worker asks
    for its place when it first needs one (``env.JOINING``), not at ``hvd.init()``.
    ``shared``: ``shared_environment(settings, base_env, remote)``, when the caller has it
    (a round of 4,096 launches reads the driver's environment once, not once per worker).
    """
    s = settings
    worker_env = dict(shared) if shared is not None else shared_environment(s, base_env, remote)
    worker_env.update({
        env.HOSTNAME: info.host, env.RANK: str(info.rank), env.SIZE: str(info.size),
        env.LOCAL_RANK: str(info.local_rank), env.LOCAL_SIZE: str(info.local_size),
        env.CROSS_RANK: str(info.cross_rank), env.CROSS_SIZE: str(info.cross_size),
        env.SLOT: str(info.slot), env.WORKER_ID: worker_id, env.JOB_ID: job_id,
        env.CONTROL_ADDR: control_addr,
        env.COLLECTIVE_TIMEOUT: str(s.collective_timeout), env.RENDEZVOUS_TIMEOUT: str(s.elastic_wait_limit),
        env.HEARTBEAT_INTERVAL: str(heartbeat_interval(s.heartbeat_interval, info.size, s.heartbeat_timeout,
                                                       s.driver_timeout)),
        env.DRIVER_TIMEOUT: str(driver_timeout(s.driver_timeout, info.size)),
        env.LOG_LEVEL: s.worker_log_level, env.SIGTERM_GRACE: str(s.sigterm_grace), env.BACKEND: s.backend, "PYTHONUNBUFFERED": "1",
        env.PREFETCH: "1" if s.prefetch else "0",
    })
    me = _driver_process()
    if me is not None:  # a worker on this machine waits for a driver that is only stopped
        # (Given to every worker: where one runs is not always known here, a Ray node or an
        # SSH "host" may be this machine; elsewhere the boot id in it differs, and it means nothing.)
        worker_env[env.DRIVER_PROCESS] = me
    # Horovod's names and torch.distributed's, for scripts and libraries that read them; the
    # worker updates them (and sets MASTER_ADDR/MASTER_PORT) whenever it enters a new round.
    worker_env.update(horovod_environment(info))
    if durable_addr is not None:  # --checkpoint-dir: where this worker sends its shards
        worker_env[env.DURABLE_ADDR] = durable_addr
    if joining:
        worker_env[env.JOINING] = "1"
    return worker_env
