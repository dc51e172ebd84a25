"""The Ray side of one worker: an actor on the worker's node that starts it and watches over it.

The Ray launcher (``ray_launcher.py``) makes one :class:`WorkerAgent` actor per worker,
pinned to the worker's node and holding the worker's share of its resources (so Ray's
accounting, and the GPUs it hands out, are the worker's). The actor runs this class in a Ray
worker process on that node; it imports neither torch nor ray at module level.

What the agent does, in order:

1. At creation it makes a key pair for this launch only (X25519, libsodium's sealed boxes
   through PyNaCl). :meth:`hello` returns the public key.
2. :meth:`start` receives the job's key blob **sealed to that public key** (only this process
   can open it: the sealed bytes may sit in Ray's task table or logs, the keys never do), the
   worker's command and environment. It starts the worker the way the SSH launcher does on a
   remote host: through ``remote_bootstrap.py``, which puts the worker in its own process
   group, hands it the keys through a pipe (``ELASTICRUN_SECRET_FD``, never its environment)
   and stays behind as its watchdog. The request goes over the bootstrap's stdin, a pipe
   between two processes of this node.
3. The bootstrap is *detached* (a double fork, its own session): it is neither a child nor in
   the process group of this actor, so when Ray kills the actor (the job's driver died, the
   actor was killed) it does not kill the watchdog with it. The watchdog then sees its stdin
   reach EOF and stops the worker's whole group: SIGTERM, SIGKILL after the grace period.
4. :meth:`poll` hands the driver the worker's output lines and, at the end, its exit status;
   before that, once, ``dying`` with the status, as soon as the watchdog's death notice fires
   (``common/deathnotice.py``: the kernel says so before it has torn the worker down).
   The driver calls it continuously; each call is its heartbeat. A watchdog thread here
   stops the worker and ends this process when no call came for ``silence_limit`` seconds
   (the driver is gone but Ray has not noticed, or a network partition).
5. :meth:`signal` sends a signal to the worker's process group.

Exit statuses are as ``subprocess`` gives them (-N: signal N), from the watchdog's report; 255
when the watchdog vanished without one.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any, Mapping

from elasticrun.common import liveness
from elasticrun.common.lines import lines

#: The watchdog that starts one worker (the file the SSH launcher sends to remote hosts).
BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "remote_bootstrap.py")
#: Runs its arguments as a detached process: fork, and the parent exits at once, so the
#: grandchild is adopted by init (or the nearest subreaper), not by this actor.
DETACH = "import os,sys\nif os.fork(): os._exit(0)\nos.execv(sys.executable, [sys.executable] + sys.argv[1:])"
#: Lines kept for the driver between two polls; beyond this the oldest are dropped (counted).
MAX_BUFFERED_LINES = 20_000
#: ... and characters kept (a line is up to 64 KiB: ``common/lines.py``).
MAX_BUFFERED_CHARS = 16 << 20
#: Lines handed over per poll, and characters (a Ray reply stays small).
LINES_PER_POLL = 2_000
CHARS_PER_POLL = 2 << 20
#: Variables Ray sets for the actor that must win over the forwarded environment.
RAY_OWNED = ("CUDA_VISIBLE_DEVICES",)


def seal_start(public_key: bytes, keys: bytes | None, env: Mapping[str, str]) -> bytes:
    """What :meth:`WorkerAgent.start` needs that must not sit in Ray's tables in the clear, the
    job's keys and the worker's environment (``AWS_*``, ``HF_TOKEN``, ...: elasticrun forwards the
    whole environment by default), in one box sealed to the agent's key."""
    envelope = {"envelope": 1, "keys": keys.decode("ascii") if keys is not None else None, "env": dict(env)}
    return seal(public_key, json.dumps(envelope).encode())


def seal(public_key: bytes, blob: bytes) -> bytes:
    """``blob`` encrypted for the holder of ``public_key``'s private key (a sealed box)."""
    from nacl.public import PublicKey, SealedBox

    return SealedBox(PublicKey(public_key)).encrypt(blob)


class WorkerAgent:
    """Starts and watches one worker on this node (see the module docstring)."""

    def __init__(self, job_id: str, worker_id: str, silence_limit: float, driver_process: str | None = None):
        from nacl.public import PrivateKey

        self.job_id, self.worker_id = job_id, worker_id
        self._key = PrivateKey.generate()
        self._silence_limit = silence_limit
        # The driver's process (common/liveness.py): on its machine, a driver that is only
        # stopped (Ctrl-Z, SIGSTOP, a debugger) is waited for, as its local workers wait.
        self._driver_process = driver_process
        self._last_contact = time.monotonic()
        self._cv = threading.Condition()
        self._lines: deque[tuple[str, str]] = deque()
        self._dropped = 0
        self._chars = 0  # in self._lines
        self._exit: int | None = None
        self._dying: int | None = None  # the watchdog's death notice fired: the worker's status
        self._dying_told = False  # a poll has handed it to the driver
        self._done = False  # the watchdog's output has ended: nothing more will come
        self._open_streams = 2
        self._stdin: Any = None
        self._pgid: int | None = None
        self._started = threading.Event()
        self._report: dict[str, Any] = {}
        self._mark = f"@@elasticrun:{secrets.token_hex(8)}@@ "
        self._closed = threading.Event()
        threading.Thread(target=self._watch_driver, name="elasticrun-agent-watchdog", daemon=True).start()

    def __repr__(self) -> str:  # how Ray's tools name this actor
        return f"WorkerAgent({self.job_id} {self.worker_id})"

    # --- called by the driver ---------------------------------------------------------------
    def hello(self) -> dict[str, Any]:
        """This launch's public key and where the agent runs."""
        self._contact()
        return {"public_key": bytes(self._key.public_key), "pid": os.getpid(),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def start(self, command: list[str], env: dict[str, str], cwd: str, grace: float,
              sealed_keys: bytes | None, timeout: float = 30.0) -> dict[str, Any]:
        """Start the worker; ``{"pgid": N}``, or ``{"error": kind, "detail": why}``."""
        from nacl.public import SealedBox

        self._contact()
        opened = SealedBox(self._key).decrypt(sealed_keys).decode("ascii") if sealed_keys else None
        keys, sealed_env = opened, {}
        if opened is not None and opened.startswith('{"envelope"'):  # seal_start's box: the keys and the environment
            box = json.loads(opened)
            keys, sealed_env = box["keys"], box["env"]
        opened = None
        merged = dict(os.environ)
        merged.update(env)
        merged.update(sealed_env)
        for name in RAY_OWNED:  # the GPUs Ray gave this actor are the worker's
            if name in os.environ:
                merged[name] = os.environ[name]
        merged.pop("ELASTICRUN_SECRET_FD", None)
        request = json.dumps({"mark": self._mark, "command": list(command), "env": merged, "cwd": cwd,
                              "grace": grace, "keys": keys, "notice": True})
        keys = None
        try:
            # The watchdog runs in this actor's environment; the worker's travels in the request
            # (so the watchdog is no process of the worker's for tools that look at environments).
            proc = subprocess.Popen([sys.executable, "-c", DETACH, BOOTSTRAP], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ),
                                    cwd="/", start_new_session=True)
        except OSError as exc:
            return {"error": "exec", "detail": f"cannot start {sys.executable}: {exc.strerror or exc}"}
        try:  # the intermediate only forks and exits; the detached watchdog keeps the pipes
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            for pipe in (proc.stdin, proc.stdout, proc.stderr):
                if pipe is not None:
                    pipe.close()
            return {"error": "exec", "detail": f"{sys.executable} did not start the watchdog within {timeout:g} s "
                                              f"(is the node out of memory or processes?)"}
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self._stdin = proc.stdin
        threading.Thread(target=self._read_stdout, args=(proc.stdout,), name="elasticrun-agent-stdout",
                         daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(proc.stderr,), name="elasticrun-agent-stderr",
                         daemon=True).start()
        try:
            proc.stdin.write(request.encode("ascii") + b"\n")
            proc.stdin.flush()
        except OSError as exc:
            return {"error": "exec", "detail": f"the watchdog did not take the request: {exc}"}
        finally:
            request = ""
        if not self._started.wait(timeout):
            self.stop()
            return {"error": "exec", "detail": f"the watchdog did not start the worker within {timeout:g} s"}
        if "pgid" in self._report:
            self._pgid = int(self._report["pgid"])
            return {"pgid": self._pgid, "watchdog": self._report.get("watchdog")}
        return {"error": str(self._report.get("error", "exec")),
                "detail": str(self._report.get("detail", "the watchdog ended without starting the worker"))}

    def poll(self, wait: float = 1.0) -> dict[str, Any]:
        """Output since the last poll and, once the worker has ended, its exit status (the
        driver's heartbeat too). Waits up to ``wait`` seconds for something to say."""
        self._contact()
        with self._cv:
            self._cv.wait_for(lambda: self._lines or self._done or (self._dying is not None and not self._dying_told),
                              timeout=max(0.0, wait))
            lines: list[tuple[str, str]] = []
            size = 0
            while self._lines and len(lines) < LINES_PER_POLL and (
                    not lines or size + len(self._lines[0][1]) <= CHARS_PER_POLL):
                lines.append(self._lines.popleft())
                size += len(lines[-1][1])
            self._chars -= size
            dropped, self._dropped = self._dropped, 0
            done = self._done and not self._lines
            dying = self._dying if not self._dying_told else None
            self._dying_told = self._dying_told or dying is not None
        self._contact()
        reply = {"lines": lines, "dropped": dropped, "exit": (self._exit if self._exit is not None else 255)
                 if done else None}
        if dying is not None:  # once: the worker is dying (its status); its exit and last output follow
            reply["dying"] = dying
        return reply

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the worker's process group; False if it is gone."""
        self._contact()
        if self._pgid is None:
            return False
        try:
            os.killpg(self._pgid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def stop(self) -> None:
        """Let the watchdog stop the worker: SIGTERM to its group, SIGKILL after the grace."""
        stdin, self._stdin = self._stdin, None
        if stdin is not None:
            try:
                stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop the worker and this agent's watch on the driver, and leave the process running:
        for an agent that does not own its process (an embedding, a test). In its actor, a
        silent driver ends the whole process instead, as it should."""
        self._closed.set()
        self.stop()

    # --- inside ------------------------------------------------------------------------------
    def _contact(self) -> None:
        self._last_contact = time.monotonic()

    def _watch_driver(self) -> None:
        while not self._closed.wait(0.5):
            silent = time.monotonic() - self._last_contact
            if silent < self._silence_limit:
                continue
            if self._driver_process is not None and liveness.state(self._driver_process) == "stopped":
                continue  # not gone: its polls come back when it is continued
            sys.stderr.write(f"elasticrun agent {self.worker_id}: no word from the driver for {silent:.0f} s; "
                             f"stopping the worker and this actor\n")
            self.stop()  # the watchdog stops the worker's group
            with self._cv:
                self._cv.wait_for(lambda: self._done, timeout=30.0)
            sys.stderr.flush()
            os._exit(1)

    def _add(self, stream: str, line: str) -> None:
        with self._cv:
            while self._lines and (len(self._lines) >= MAX_BUFFERED_LINES
                                   or self._chars + len(line) > MAX_BUFFERED_CHARS):
                self._chars -= len(self._lines.popleft()[1])
                self._dropped += 1
            self._lines.append((stream, line))
            self._chars += len(line)
            self._cv.notify_all()

    def _read_stdout(self, f: Any) -> None:
        try:
            for line in lines(f, hold=self._mark):
                if self._mark not in line:
                    self._add("stdout", line)
                    continue
                before, _, rest = line.partition(self._mark)
                if before:
                    self._add("stdout", before)
                try:
                    report = json.loads(rest)
                except ValueError:
                    continue
                if "exit" in report:
                    self._exit = int(report["exit"])
                elif "dying" in report:
                    with self._cv:
                        self._dying = int(report["dying"])
                        self._cv.notify_all()
                else:
                    self._report = report
                    self._started.set()
        finally:
            f.close()
            self._started.set()
            self._stream_ended()

    def _read_stderr(self, f: Any) -> None:
        try:
            for line in lines(f):
                self._add("stderr", line)
        finally:
            f.close()
            self._stream_ended()

    def _stream_ended(self) -> None:
        with self._cv:
            self._open_streams -= 1
            if self._open_streams == 0:  # both pipes closed: the watchdog and the worker's group are gone
                self._done = True
            self._cv.notify_all()
