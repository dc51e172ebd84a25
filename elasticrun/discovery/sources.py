"""Where hosts come from: a user's discovery script, or a fixed list (``-H`` / ``--hostfile``)."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass

from elasticrun.common.hosts import HostList, parse_discovery_output


class DiscoveryError(RuntimeError):
    """The discovery script failed (non-zero exit, timeout, could not start)."""


@dataclass
class ScriptDiscovery:
    """Runs the user's script; its stdout lists ``host[:slots]`` per line.

    The script runs in its own process group so that a timeout kills it *and* anything it
    started (``kubectl``, ``ssh``...), and a hung script can never hang the driver.
    """

    path: str
    default_slots: int
    timeout: float
    _running: subprocess.Popen | None = None
    _closed: bool = False

    def describe(self) -> str:
        return f"discovery script {self.path}"

    def close(self) -> None:
        """Kill a run in flight (the job is ending) and refuse new ones."""
        self._closed = True
        proc = self._running
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def discover(self) -> HostList:
        if self._closed:
            raise DiscoveryError("discovery is closed: the job is ending")
        try:
            proc = subprocess.Popen([self.path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    stdin=subprocess.DEVNULL, start_new_session=True, text=True)
        except OSError as exc:
            raise DiscoveryError(f"{self.path} could not be started: {exc.strerror}") from None
        self._running = proc
        if self._closed:  # close() ran between the check and the start
            self.close()
        try:
            out, err = proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise DiscoveryError(f"{self.path} did not finish within {self.timeout:g} s "
                                 f"(--discovery-timeout); it was killed") from None
        finally:
            if proc.poll() is None:
                _kill_group(proc)
            self._running = None
        if proc.returncode != 0:
            tail = err.strip()[-2000:] or "(no stderr)"
            raise DiscoveryError(f"{self.path} exited with code {proc.returncode}; its stderr:\n{tail}")
        return parse_discovery_output(out, self.default_slots)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.communicate()


@dataclass
class FixedHosts:
    """A host list given on the command line: elastic for failures, never grows."""

    hosts: dict[str, int]

    def describe(self) -> str:
        return "host list " + ",".join(f"{h}:{s}" for h, s in self.hosts.items())

    def close(self) -> None:
        pass

    def discover(self) -> HostList:
        return HostList(hosts=dict(self.hosts))
