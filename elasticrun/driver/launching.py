"""What the driver's loop needs from whatever starts its workers: the :class:`Launcher` protocol.

The loop is handed a launcher and never builds one (``driver/compose.py`` does, for the command
line and ``elasticrun.run()``): so the loop reaches nothing of launching, SSH or Ray, and a
new way to start workers plugs in without touching it. Implementations: ``launch/launchers.py``
(this machine and SSH), ``launch/ray_launcher.py`` (Ray), the simulator of
``benchmarks/driver_scale.py``.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from elasticrun.driver.output import Output


class OnExit(Protocol):
    """``on_exit(worker_id, code)``: a worker ended; ``code`` as ``subprocess`` gives it (-N:
    signal N). ``detail``: ``words.never_started(...)`` when no worker process ever ran (a
    remote start that failed), which the console says instead of an exit code."""

    def __call__(self, worker_id: str, code: int, detail: str = "") -> None: ...


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
