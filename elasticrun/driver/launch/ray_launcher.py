"""Workers on a Ray cluster (``--ray-address``): Ray's nodes are the hosts, Ray starts the workers.

The driver is the same as everywhere else (registry, rounds, heartbeats, event log,
in-process recovery); only its host source and its launcher change:

* discovery (``elasticrun/discovery/ray_nodes.py``): Ray's alive nodes, by node id, with slots
  from their free resources; nodes Ray drains are listed ``draining``;
* :class:`RayLauncher`: one :class:`~elasticrun.driver.launch.ray_agent.WorkerAgent` actor per worker,
  pinned to its node (``NodeAffinitySchedulingStrategy(node_id, soft=False)``) and holding the
  worker's resources; the agent starts the worker as a child process tree of its own (through
  the same watchdog as SSH launches) and streams its output and exit back.

How the job's keys reach a worker: the agent makes a key pair when it is created and sends
its public key; the driver seals the key blob and the worker's environment to it
(``ray_agent.seal_start``) and passes only the sealed bytes through Ray. Neither the actor's
arguments (``ray list actors``, the dashboard, the GCS's tables) nor Ray's logs ever hold the
keys or the environment (cloud credentials, tokens); the worker reads the keys from a pipe.

Nothing is left behind: the actors belong to the driver's Ray job (never ``detached``), so
Ray destroys them when the driver exits or dies; each agent also stops its worker and exits
when the driver has not polled it for a while; and each worker's watchdog stops the worker's
process group when its agent is gone. ``ray`` is imported only here and only when
``--ray-address`` is used (``pip install 'ray==2.60.0' 'pynacl>=1.5'``).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from elasticrun.common import env as envvars
from elasticrun.common.errors import JobFailed
from elasticrun.common.settings import JobSettings
from elasticrun.discovery.ray_nodes import SETTLE_SECONDS, Held, RayDiscovery, Requirement
from elasticrun.driver.output import Output
from elasticrun.driver.launch.ray_agent import WorkerAgent, seal_start

log = logging.getLogger("elasticrun")

#: How long one poll of an agent waits for output (the driver's heartbeat to it, too).
POLL_SECONDS = 1.0
#: A poll that has not come back after this long means the agent (or its node) is gone.
POLL_TIMEOUT = 30.0
#: How long to wait before polling again an agent Ray calls temporarily unavailable.
UNAVAILABLE_PAUSE = 0.5


def requirement(settings: JobSettings) -> Requirement:
    return Requirement(settings.ray_cpus_per_worker, settings.ray_gpus_per_worker, dict(settings.ray_resources))


def agent_silence_limit(settings: JobSettings) -> float:
    """How long an agent waits for the driver's next poll before it stops its worker."""
    return max(10.0, 2 * settings.driver_timeout)


def held_on_nodes(agents: list[tuple[str, float | None]], now: float, settle: float = SETTLE_SECONDS) -> dict[str, Held]:
    """What the job's live workers hold per node, from (node, when its agent answered or None)."""
    live: dict[str, int] = {}
    settled: dict[str, int] = {}
    for node, started in agents:
        live[node] = live.get(node, 0) + 1
        if started is not None and now - started >= settle:
            settled[node] = settled.get(node, 0) + 1
    return {node: Held(settled.get(node, 0), n) for node, n in live.items()}


class PrivateLog(logging.FileHandler):
    """A log file in a directory others can write (``/tmp``): a new file of this user's alone
    (0600), made on the first record, under a name nobody can guess. The name used to be
    ``elasticrun-ray-PID.log``: anyone on the machine could plant a link or a file of theirs
    there first, and the driver appended Ray's log to whatever it pointed at. ``O_EXCL`` and
    ``O_NOFOLLOW`` refuse both; a record that finds the name taken is dropped, not redirected."""

    def __init__(self, directory: str, prefix: str) -> None:
        name = f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}.log"
        super().__init__(os.path.join(directory, name), delay=True)
        self._made = False

    def _open(self) -> Any:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW
        # The first open makes the file; a later one (after close()) reopens the same file, ours.
        try:
            fd = os.open(self.baseFilename, flags | (0 if self._made else os.O_CREAT | os.O_EXCL), 0o600)
        except OSError:
            return None  # (the name taken, a full disk: the record is dropped, see handleError)
        self._made = True
        return os.fdopen(fd, "a", encoding=self.encoding or "utf-8", errors=self.errors)

    def handleError(self, record: logging.LogRecord) -> None:
        """Ray's chatter is not worth a traceback on the console: a file that cannot be made
        or written (a full disk, the name taken) loses it quietly; the job's own lines are
        never in it."""


def ray_log_path() -> str | None:
    """Where this process's Ray log goes (None: not set up)."""
    return next((h.baseFilename for h in logging.getLogger("ray").handlers if isinstance(h, PrivateLog)), None)


#: How long a --ray-address of the form HOST:PORT has to accept a TCP connection before Ray is
#: asked to join it: Ray itself retries an address where nothing answers for many minutes.
PROBE_SECONDS = 5.0


def _probe(address: str) -> None:
    """Raise ConnectionError (one line) when ``address`` is HOST:PORT and nothing accepts a
    TCP connection there within PROBE_SECONDS. Other forms ("auto", "local", ...) are Ray's
    to resolve."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not host or not port.isdigit():
        return
    host = host.strip("[]")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_SECONDS).close()
    except OSError as exc:
        why = ("nothing answered within %g s" % PROBE_SECONDS if isinstance(exc, socket.timeout)
               else exc.strerror or str(exc))
        raise ConnectionError(f"--ray-address {address}: cannot join a Ray cluster there: {why} (is the head "
                              f"node up? `ray start --head` prints its address)") from None


def _private_log() -> None:
    """Ray's own logs (node deaths with a raylet's state dump, autoscaler chatter) go to a
    file: elasticrun's console says what happened to the job in its own words, once."""
    ray_log = logging.getLogger("ray")
    if not any(isinstance(h, PrivateLog) for h in ray_log.handlers):
        handler = PrivateLog(tempfile.gettempdir(), "elasticrun-ray")
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
        ray_log.addHandler(handler)
    log.debug("Ray's logs go to %s", ray_log_path())


def connect(address: str) -> bool:
    """Join the Ray cluster at ``address`` as a driver (its own Ray job, whose actors Ray
    destroys when this process ends); True if this call connected (then ``ray.shutdown``
    is ours to call). Raises ConnectionError with one line when there is no cluster there.
    Either way, until :func:`disconnected`, the messages Ray's driver prints for the cluster
    go to Ray's log file, not to the console."""
    import ray

    if ray.is_initialized():  # elasticrun.run() from a program that is already a Ray driver
        _private_log()  # (its own handlers on the "ray" logger still get Ray's records)
        _quiet_driver_messages(True)
        return False
    _private_log()
    logging.getLogger("ray").propagate = False
    _probe(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, configure_logging=False,
                 namespace="elasticrun")
    except ConnectionError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConnectionError(f"--ray-address {address}: cannot join a Ray cluster there: {first}") from None
    _quiet_driver_messages(True)
    return True


def disconnected(connected: bool) -> None:
    """The job is over: leave the cluster if :func:`connect` joined it, and give Ray back its
    console either way."""
    try:
        if connected:
            import ray

            ray.shutdown()
    finally:
        _quiet_driver_messages(False)


_ray_print: Any = None  # Ray's print_to_stdstream while _quiet_driver_messages has it replaced


def _quiet_driver_messages(quiet: bool) -> None:
    """Route the messages Ray's driver thread prints for the cluster (a raylet's "Raylet is
    terminated ... Last 20 lines of the Raylet logs", "marked dead because the detector has
    missed too many heartbeats") into Ray's log file with its other lines. That thread writes
    to stderr through ``ray._private.worker.print_to_stdstream``, past the ``ray`` logger and
    ``log_to_driver=False``: 43 such lines reached the console for one lost node. Only while
    this session's own connection lasts (``quiet=False`` puts Ray's function back)."""
    try:
        from ray._private import worker as ray_worker
    except ImportError:  # another Ray layout: its lines reach the console, as before
        return
    global _ray_print
    if not quiet:
        if _ray_print is not None:
            ray_worker.print_to_stdstream = _ray_print
            _ray_print = None
        return
    if _ray_print is not None or not callable(getattr(ray_worker, "print_to_stdstream", None)):
        return
    _ray_print = ray_worker.print_to_stdstream
    ray_log = logging.getLogger("ray")

    def to_log(data: Any, ignore_prefix: bool = False) -> None:
        # To the file only: Ray's own handler on its logger writes to stderr.
        files = [h for h in ray_log.handlers if isinstance(h, PrivateLog)]
        who = data.get("pid", "ray") if isinstance(data, dict) else "ray"
        for line in data.get("lines", []) if isinstance(data, dict) else [data]:
            record = ray_log.makeRecord("ray", logging.WARNING, __file__, 0, "(%s) %s", (who, line), None)
            for handler in files:
                handler.handle(record)

    ray_worker.print_to_stdstream = to_log


@dataclass
class _Agent:
    worker_id: str
    node: str
    handle: Any
    launched_at: float
    started_at: float | None = None  # when the agent answered: its resources are Ray's to count
    pgid: int | None = None
    cancel: int | None = None  # a signal asked for before the worker started
    killed: bool = False  # the actor was killed on purpose
    finished: threading.Event = field(default_factory=threading.Event)
    reported: bool = False  # on_exit was called (once: on its agent's "dying" or at its end)
    thread: threading.Thread | None = None


class RayLauncher:
    """Starts each worker through a :class:`WorkerAgent` actor on its node (the ``Launcher``
    protocol of ``launchers.py``). Hosts are Ray node ids."""

    def __init__(self, settings: JobSettings, discovery: RayDiscovery | None = None):
        import ray

        self._ray = ray
        self.settings = settings
        self.need = requirement(settings)
        self.discovery = discovery
        self._on_exit: Callable[[str, int], None] | None = None
        self._sink: Output | None = None
        self._agents: dict[str, _Agent] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._remote = ray.remote(WorkerAgent)

    def bind(self, on_exit: Callable[[str, int], None], output: Output) -> None:
        if self._on_exit is not None:
            raise RuntimeError("this RayLauncher is bound to a driver already: give each driver its own")
        self._on_exit, self._sink = on_exit, output

    def is_remote(self, host: str) -> bool:
        return True  # every worker runs in a Ray node's environment: it gets the forwarded one

    def network_address(self, host: str) -> str:
        """The address of ``host``'s node: the driver listens where that address routes from."""
        ip = self.discovery.ip_of(host) if self.discovery is not None else None
        if not ip:
            raise OSError(f"Ray node {host} is not (or no longer) in the cluster")
        return ip

    def held(self) -> dict[str, Held]:
        """What the job's live workers hold on each node (for discovery's slot counts)."""
        with self._lock:
            agents = [(a.node, a.started_at) for a in self._agents.values() if not a.finished.is_set()]
        return held_on_nodes(agents, time.monotonic())

    # --- launching --------------------------------------------------------------------------
    def launch(self, worker_id: str, command: list[str], env: dict[str, str], host: str,
               keys: bytes | None = None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._on_exit is None:
            raise RuntimeError("RayLauncher.bind() must be called before launching")
        need = self.need
        try:
            handle = self._remote.options(
                num_cpus=need.cpus, num_gpus=need.gpus, resources=dict(need.resources) or None,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=host, soft=False),
                max_restarts=0, max_task_retries=0, max_concurrency=4,
            ).remote(env.get("ELASTICRUN_JOB_ID", "-"), worker_id, agent_silence_limit(self.settings),
                     env.get(envvars.DRIVER_PROCESS))
        except Exception as exc:  # a bad node id, Ray shutting down
            raise OSError(f"Ray could not create the worker's actor: {type(exc).__name__}: {exc}") from None
        a = _Agent(worker_id, host, handle, time.monotonic())
        with self._lock:
            self._agents[worker_id] = a
        a.thread = threading.Thread(target=self._run, args=(a, command, env, keys), name=f"elasticrun-ray-{worker_id}",
                                    daemon=True)
        a.thread.start()

    def _run(self, a: _Agent, command: list[str], env: dict[str, str], keys: bytes | None) -> None:
        code = 255
        try:
            code = self._start_and_watch(a, command, env, keys)
        except Exception as exc:
            code = self._lost(a, exc)
        finally:
            a.finished.set()
            try:  # the driver hears of the exit first: recovery does not wait for Ray's bookkeeping
                self._report_exit(a, code)
            finally:
                self._kill_actor(a)
                with self._lock:  # its output is out (this thread copied it): forget it
                    self._agents.pop(a.worker_id, None)

    def _report_exit(self, a: _Agent, code: int) -> None:
        """``on_exit`` exactly once per worker: when its agent says it is dying, or at its end."""
        with self._lock:
            if a.reported:
                return
            a.reported = True
        assert self._on_exit is not None
        self._on_exit(a.worker_id, code)

    def _start_and_watch(self, a: _Agent, command: list[str], env: dict[str, str], keys: bytes | None) -> int:
        ray = self._ray
        timeout = self.settings.start_timeout
        try:
            hello = ray.get(a.handle.hello.remote(), timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            if a.killed or self._stopping:
                return -(a.cancel or signal.SIGTERM)
            log.error("%s: Ray did not start worker %s's actor there within --start-timeout %g s (it needs %s; "
                      "is the node full, or gone?)", a.node, a.worker_id, timeout, self.need.describe())
            return 255
        a.started_at = time.monotonic()
        if a.killed or self._stopping:
            return -(a.cancel or signal.SIGTERM)
        # The environment travels sealed with the keys: an actor's arguments are visible to anyone
        # who can use the cluster (``ray list tasks``, the dashboard, the GCS's tables).
        sealed: bytes | None = seal_start(hello["public_key"], keys, env)
        cwd = self.settings.remote_cwd or os.getcwd()
        started = ray.get(a.handle.start.remote(list(command), {}, cwd, self.settings.stop_grace, sealed,
                                                timeout), timeout=timeout + 10)
        sealed = None
        if "error" in started:
            kind, detail = started["error"], started.get("detail", "")
            if kind == "cwd":
                log.error("%s: could not start worker %s: %s (workers start in the driver's directory unless "
                          "--remote-cwd is given)", a.node, a.worker_id, detail)
                return 126
            log.error("%s: could not start worker %s: %s", a.node, a.worker_id, detail)
            return 127 if kind == "not_found" else 126
        a.pgid = int(started["pgid"])
        if a.cancel is not None:
            a.handle.signal.remote(a.cancel)
        assert self._sink is not None
        unavailable = getattr(ray.exceptions, "ActorUnavailableError", None) or ray.exceptions.GetTimeoutError
        answered = time.monotonic()
        while True:
            ref = a.handle.poll.remote(POLL_SECONDS)
            try:
                reply = ray.get(ref, timeout=POLL_TIMEOUT)
            except ray.exceptions.GetTimeoutError:
                raise ConnectionError(f"its agent did not answer for {POLL_TIMEOUT:g} s") from None
            except unavailable:
                # "temporarily unavailable" (a network blip, its node's raylet restarting): Ray
                # says it may answer again, so a node is not lost, and blacklisted, for one.
                if time.monotonic() - answered >= POLL_TIMEOUT or a.killed or self._stopping:
                    raise
                time.sleep(UNAVAILABLE_PAUSE)
                continue
            answered = time.monotonic()
            for stream, line in reply["lines"]:
                self._sink.write(a.worker_id, stream, line)
            if reply.get("dropped"):
                self._sink.write(a.worker_id, "stderr", f"[elasticrun: {reply['dropped']} lines of output dropped]")
            if reply.get("dying") is not None:  # before the kernel has torn it down: recovery starts now
                self._report_exit(a, int(reply["dying"]))
            if reply["exit"] is not None:
                return int(reply["exit"])

    def _lost(self, a: _Agent, exc: BaseException) -> int:
        """The agent died or became unreachable: its node died, or it was killed."""
        if a.killed or self._stopping:
            return -(a.cancel or signal.SIGKILL)
        why = str(exc).strip().splitlines()
        cause = next((line for line in why if "node" in line.lower() or "died" in line.lower()), why[0] if why else "")
        log.error("%s: lost worker %s: its Ray actor is gone (%s: %s); counting it as failed", a.node, a.worker_id,
                  type(exc).__name__, cause[:300])
        return 255

    def _kill_actor(self, a: _Agent) -> None:
        try:
            self._ray.kill(a.handle, no_restart=True)
        except Exception:  # already dead, or Ray is shutting down
            pass

    # --- stopping ---------------------------------------------------------------------------
    def signal(self, worker_id: str, sig: int) -> None:
        a = self._agents.get(worker_id)
        if a is None or a.finished.is_set():
            return
        if a.pgid is None:
            a.cancel = sig
            if sig == signal.SIGKILL or a.started_at is None:
                a.killed = True  # not started yet: the actor goes, and its launch ends
                self._kill_actor(a)
            return
        try:
            a.handle.signal.remote(int(sig))
        except Exception:
            pass

    def pid(self, worker_id: str) -> int | None:
        a = self._agents.get(worker_id)
        return a.pgid if a else None

    def stop_all(self, grace: float) -> None:
        """SIGTERM every worker, SIGKILL after ``grace``; then the actors themselves go."""
        self._stopping = True
        with self._lock:
            live = [a for a in self._agents.values() if not a.finished.is_set()]
        for a in live:
            self.signal(a.worker_id, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for a in live:
            a.finished.wait(max(0.0, deadline - time.monotonic()))
        left = [a for a in live if not a.finished.is_set()]
        for a in left:
            self.signal(a.worker_id, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        for a in left:
            a.finished.wait(max(0.0, deadline - time.monotonic()))
        for a in left:  # still no exit: the actor goes (its watchdog stops what is left)
            a.killed = True
            self._kill_actor(a)

    def drain(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._lock:
            threads = [a.thread for a in self._agents.values() if a.thread is not None]
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))


class RaySession:
    """``--ray-address``: join the cluster, make the discovery source and the launcher, and
    leave the cluster when the job is over (as a context manager). Raises ``JobFailed``
    (exit 2) with one line when the cluster cannot be joined."""

    def __init__(self, settings: JobSettings):
        self.settings = settings
        self._connected = False

    def __enter__(self) -> "RaySession":

        assert self.settings.ray_address is not None
        try:
            self._connected = connect(self.settings.ray_address)
        except ConnectionError as exc:
            raise JobFailed(str(exc), 2) from None
        self.discovery = RayDiscovery(requirement(self.settings), held=lambda: self.launcher.held(),
                                      address=self.settings.ray_address)
        self.launcher = RayLauncher(self.settings, self.discovery)
        return self

    def __exit__(self, *exc: object) -> None:
        disconnected(self._connected)
