"""What the driver needs from whatever starts its workers, and the launcher it uses by default.

The driver decides *which* worker runs *where* (the registry's ``Launch`` actions) and
*what* it gets (``environment.worker_environment``); a :class:`Launcher` only carries that out
and reports back. :class:`Launchers` is the one the command line and ``elasticrun.run()``
pass: child processes on this machine (``launcher.py``), SSH to other hosts (``ssh.py``).
Another kind (an agent per node that starts and watches processes, e.g. on Ray) plugs in
the same way: ``ElasticDriver(settings, source, launcher)``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable, Protocol, runtime_checkable

from elasticrun.common import warmstart
from elasticrun.common.settings import JobSettings
from elasticrun.driver.environment import shared_environment
from elasticrun.driver.launcher import LocalLauncher, is_local_host
from elasticrun.driver.output import Output
from elasticrun.driver.ssh import SSHLauncher, SSHOptions
from elasticrun.driver.warm import LocalTemplate, template_argv

log = logging.getLogger("elasticrun")

#: What ``--launcher`` accepts (see :class:`Launchers`).
LAUNCHER_MODES = ("auto", "local", "ssh")

#: ``on_exit(worker_id, code)``: a worker ended; ``code`` as ``subprocess`` gives it (-N: signal N).
OnExit = Callable[[str, int], None]


@runtime_checkable
class Launcher(Protocol):
    """Starts, signals and stops the job's worker processes, wherever they run.

    Every method may be called from the driver's loop and must not block it: ``launch`` and
    ``signal`` return at once (slow work, such as connecting to a host, happens on the
    launcher's own threads); ``stop_all`` and ``drain`` are bounded by their arguments.
    """

    def bind(self, on_exit: OnExit, output: Output) -> None:
        """Called once by the driver, before any launch: where to report exits and output.

        ``on_exit`` and ``output.write`` may be called from any thread.
        """

    def is_remote(self, host: str) -> bool:
        """Whether workers for ``host`` run on another machine: the driver then gives them its
        forwarded environment and the address of this machine that ``host`` reaches."""

    # Optional: ``network_address(host) -> str``, the name or address of the machine that
    # ``host``'s workers run on, for the driver to pick the address of its own that they reach
    # (default: ``host`` itself; the Ray launcher's hosts are node ids, it gives the node's IP).

    def launch(self, worker_id: str, command: list[str], env: dict[str, str], host: str,
               keys: bytes | None = None) -> None:
        """Start ``command`` with exactly ``env`` on ``host``.

        ``keys``: the job's key blob, for the worker to read from the pipe named by
        ``ELASTICRUN_SECRET_FD``; it must never be put in an environment or on a command line.
        Raises OSError when the worker cannot be started at all (then no ``on_exit`` follows);
        otherwise it ends in exactly one ``on_exit(worker_id, code)``, however it ends (a failed
        remote start is a worker exiting with a code, logged with the host and the cause).
        The worker and everything it starts are one unit for ``signal`` and ``stop_all``.
        """

    def signal(self, worker_id: str, sig: int) -> None:
        """Send ``sig`` to the worker and everything it started; nothing if it is gone."""

    def stop_all(self, grace: float) -> None:
        """Stop every worker: SIGTERM, SIGKILL what is left after ``grace`` seconds."""

    def drain(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for the output of ended workers to be written."""


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
        self.mode = getattr(settings, "launcher", "auto")
        self._on_exit: OnExit | None = None
        self._output: Output | None = None
        self._local: LocalLauncher | None = None
        self._ssh: SSHLauncher | None = None
        self._where: dict[str, LocalLauncher | SSHLauncher] = {}
        self.template: LocalTemplate | None = None

    def bind(self, on_exit: OnExit, output: Output) -> None:
        if self._on_exit is not None:
            raise RuntimeError("this Launchers is bound to a driver already: give each driver its own")
        self._on_exit, self._output = on_exit, output
        self.template = self._start_local_template()
        s = self.settings
        self._local = LocalLauncher(output, on_exit, self.template, ready_timeout=s.start_timeout / 2,
                                    grace=s.stop_grace)

    def _start_local_template(self) -> LocalTemplate | None:
        """This machine's warm-start template, if its workers can use one."""
        s = self.settings
        cmd, why = warmstart.python_command(s.command)
        if not getattr(s, "warm_start", True) or self.mode == "ssh":
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
        argv = template_argv(python, f"elasticrun-{os.getpid()}", cmd, getattr(s, "preload", ()), s.stop_grace)
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
            self._where[worker_id] = self.ssh
            self.ssh.launch(worker_id, command, env, host=host, keys=keys)
            return
        if host is not None and self.mode == "local" and not is_local_host(host):
            raise OSError(f"host {host} is not this machine, and --launcher local never uses SSH")
        self._where[worker_id] = self.local
        self.local.launch(worker_id, command, env, keys=keys)

    def signal(self, worker_id: str, sig: int) -> None:
        launcher = self._where.get(worker_id)
        if launcher is not None:
            launcher.signal(worker_id, sig)

    def pid(self, worker_id: str) -> int | None:
        """The worker's process (local) or process group (remote) id, once known."""
        launcher = self._where.get(worker_id)
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
