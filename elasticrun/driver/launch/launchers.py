"""The launcher the command line and ``elasticrun.run()`` give the driver.

The driver decides *which* worker runs *where* (the registry's ``Launch`` actions) and
*what* it gets (``environment.worker_environment``); a ``Launcher`` (``driver/launching.py``) only carries
that out and reports back. :class:`Launchers` is the one the command line and ``elasticrun.run()``
pass: child processes on this machine (``launcher.py``), SSH to other hosts (``ssh.py``).
Another kind (an agent per node that starts and watches processes, e.g. on Ray) plugs in
the same way: ``ElasticDriver(settings, source, launcher)``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Iterable

from elasticrun.common import warmstart
from elasticrun.common.settings import JobSettings
from elasticrun.driver.environment import shared_environment
from elasticrun.driver.launching import OnExit
from elasticrun.driver import network
from elasticrun.driver.launch.local import LocalLauncher, is_local_host
from elasticrun.driver.output import Output
from elasticrun.driver.launch.ssh import SSHLauncher, SSHOptions
from elasticrun.driver.launch.warm import LocalTemplate, template_argv

log = logging.getLogger("elasticrun")

class Launchers:
    """Routes each worker to the local or the SSH launcher, by host and ``--launcher``.

    ``auto``: hosts that are this machine launch locally, others (and any ``user@host``) over
    SSH; ``local``: never SSH (a host that is not this machine fails to launch); ``ssh``:
    always SSH, even for names of this machine. The SSH launcher (and paramiko) is set up
    only when a first worker needs it.

    Warm start (unless ``--no-warm-start``): when the command is ``python script.py`` or
    ``python -m module``, ``bind`` starts this machine's template at once (unless every host
    of a fixed list is another machine), so that it imports torch while the driver discovers
    hosts; the SSH launcher starts one on each other host at its first worker. ``stop_all``
    stops them after the workers.
    """

    def __init__(self, settings: JobSettings):
        self.settings = settings
        self.mode = settings.launcher
        self._on_exit: OnExit | None = None
        self._output: Output | None = None
        self._local: LocalLauncher | None = None
        self._ssh: SSHLauncher | None = None
        self.template: LocalTemplate | None = None

    def bind(self, on_exit: OnExit, output: Output) -> None:
        if self._on_exit is not None:
            raise RuntimeError("this Launchers is bound to a driver already: give each driver its own")
        self._on_exit, self._output = on_exit, output
        self.template = self._start_local_template()
        s = self.settings
        self._local = LocalLauncher(output, on_exit, self.template, ready_timeout=s.start_timeout / 2,
                                    grace=s.stop_grace)

    def guard(self, job_id: str) -> None:
        """Start this machine's reaper for job ``job_id`` now, before any worker (it stops the
        job's processes here if the driver is killed: a discovery script's too)."""
        if self._local is not None:
            self._local.start_reaper(job_id)

    def _start_local_template(self) -> LocalTemplate | None:
        """This machine's warm-start template, if its workers can use one."""
        s = self.settings
        cmd, why = warmstart.python_command(s.command)
        if not s.warm_start or self.mode == "ssh":
            return None
        if cmd is None:
            log.debug("warm start: not for this command (%s): every worker is a new process", why)
            return None
        if s.hosts is not None and all(self.is_remote(h) for h in s.hosts):
            return None  # no worker will run here
        env = shared_environment(s, os.environ, remote=False)
        python = warmstart.interpreter_path(cmd, env, os.getcwd())
        if python is None:
            return None  # the launch will say the command was not found
        argv = template_argv(python, f"elasticrun-{os.getpid()}", cmd, s.preload, s.stop_grace)
        try:
            return LocalTemplate(argv, env)
        except OSError as exc:
            log.debug("warm start: cannot start this machine's template (%s): every worker is a new process",
                      exc.strerror or exc)
            return None

    @property
    def local(self) -> LocalLauncher:
        if self._local is None:
            raise RuntimeError("Launchers.bind() must be called before launching")
        return self._local

    @property
    def ssh(self) -> SSHLauncher:
        if self._ssh is None:
            if self._on_exit is None or self._output is None:
                raise RuntimeError("Launchers.bind() must be called before launching")
            self._ssh = SSHLauncher(self._output, self._on_exit, SSHOptions.from_settings(self.settings))
        return self._ssh

    def prefetch(self, hosts: Iterable[str], timeout: float) -> dict[str, str | None]:
        """Resolve the names of ``hosts`` (and this machine's own, once) off the driver's loop,
        which then finds them resolved (``network.prefetch``); the hosts not to use yet: those
        whose lookup has not ended within ``timeout`` (None), and those whose name does not
        resolve (why). Such a name is looked up again later (``network.UNRESOLVED_RETRY``)."""
        network.own_addresses()
        by_name: dict[str, list[str]] = {}
        for h in hosts:
            by_name.setdefault(h.rpartition("@")[2], []).append(h)
        pending = network.prefetch(by_name, timeout)
        held: dict[str, str | None] = {h: None for name in pending for h in by_name[name]}
        for name, named in by_name.items():
            why = None if name in pending else network.unresolved(name)
            if why is not None:
                held.update((h, why) for h in named)
        return held

    def is_remote(self, host: str) -> bool:
        if self.mode == "ssh":
            return True
        if self.mode == "local":
            return False
        return "@" in host or not is_local_host(host)

    def launch(self, worker_id: str, command: list[str], env: dict[str, str], host: str | None = None,
               keys: bytes | None = None) -> None:
        """``keys``: the job's key blob; the worker gets it through a pipe, never its environment."""
        if host is not None and self.is_remote(host):
            self.ssh.launch(worker_id, command, env, host=host, keys=keys)
            return
        if host is not None and self.mode == "local" and not is_local_host(host):
            raise OSError(f"host {host} is not this machine, and --launcher local never uses SSH")
        self.local.launch(worker_id, command, env, keys=keys)

    def _of(self, worker_id: str) -> LocalLauncher | SSHLauncher | None:
        """The launcher that started the worker, until it has forgotten it (once ended)."""
        for launcher in (self._local, self._ssh):
            if launcher is not None and launcher.knows(worker_id):
                return launcher
        return None

    def signal(self, worker_id: str, sig: int) -> None:
        launcher = self._of(worker_id)
        if launcher is not None:
            launcher.signal(worker_id, sig)

    def pid(self, worker_id: str) -> int | None:
        """The worker's process (local) or process group (remote) id, once known."""
        launcher = self._of(worker_id)
        return launcher.pid(worker_id) if launcher is not None else None

    def stop_all(self, grace: float) -> None:
        """Stop local and remote workers at the same time (one grace period, not two), then
        this machine's template (remote templates end with their SSH connections)."""
        if self._ssh is None:
            if self._local is not None:
                self._local.stop_all(grace)
        else:
            t = None
            if self._local is not None:
                t = threading.Thread(target=self._local.stop_all, args=(grace,), name="elasticrun-stop-local",
                                     daemon=True)
                t.start()
            self._ssh.stop_all(grace)
            if t is not None:
                t.join(grace + 10)
        if self.template is not None:
            self.template.stop(grace + 5)

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self._local is not None:
            self._local.drain(timeout)
        if self._ssh is not None:
            self._ssh.drain(max(0.0, deadline - time.monotonic()))
