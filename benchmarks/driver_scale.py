"""Driver scale: the real ElasticDriver with 256 and 1024 simulated workers, against a bare server.

    flock /tmp/elasticrun-heavy.lock python benchmarks/driver_scale.py [--workers 256 1024]
        [--slots 4] [--steady 3] [--timeout 60] [--budget 280] [--modes bare driver]
        [--heartbeat-timeout 5] [--backlog N] [--driver-io-threads K] [--profile DIR] [--sim-procs K]

For every size N (hosts h0..h{N/4-1} with 4 slots each) two jobs run one after the other, each
with its server in a separate process (the other core) and all N simulated workers in this one
(or, past what one process may open, 4 descriptors per worker, or with --sim-procs K, in K
processes that this one coordinates: ``ShardedSim``):

  bare    the floor: a minimal ZeroMQ server with the same sockets, socket options (CURVE
          servers behind the same ZAP handler, elasticrun.common.auth) and
          authenticated frames (HMAC + JSON, elasticrun.common.protocol) that answers
          heartbeats at once, answers the N rendezvous requests as soon as it holds all N (a
          barrier), and sends one ``hosts_updated`` frame to every worker's heartbeat
          connection (as the driver notifies);
  driver  the real ``ElasticDriver`` (registry, host manager, event loop, discovery thread,
          CLI defaults), given a launcher (``elasticrun.driver.launching.Launcher``) that asks
          this process to start simulated workers instead of spawning processes.

A simulated worker speaks the real protocol with the job's keys (handed over by the launcher,
as a real worker gets them through its pipe) and its worker id, over the same two CURVE
client sockets as a real one (``DriverClient``'s DEALER for rendezvous, ``ControlChannel``'s
DEALER for heartbeats every ELASTICRUN_HEARTBEAT_INTERVAL s, their replies and the driver's
notifications), one Codec per socket. All 2N sockets are served by one thread through epoll
on their ZMQ_FDs (zmq_poll over 3072 sockets costs ~8 ms per call here; epoll is O(ready)).
Like a real worker after HostsUpdatedInterrupt, a worker that learns of a host update (from
the notification or a heartbeat reply, whichever comes first) asks for the next round at once.
Exits (dismissed, killed by the driver, end of job) are reported to the server's launcher.

Measured per job:
  (1) round 0: first launch -> every worker holds its round-0 assignment;
  (2) graceful removal: discovery drops the last host; the driver's ``hosts_updated`` carries
      the wall-clock time it was published, so publish -> the last worker knowing of it is
      exact (same clock; frames on the heartbeat connection are stamped as they leave their
      socket, before this one thread decodes them); then publish -> every survivor holds its round-1 assignment (the
      removed host's workers are dismissed);
  (3) the server process's CPU time (time.process_time: all its threads, ZeroMQ's I/O thread
      included) per phase and over --steady seconds of heartbeats only, and its RSS.
Also the longest gap between heartbeat replies any worker saw: a real worker exits when it
exceeds its patience with the driver (5 s, longer past 2,000 workers:
environment.driver_timeout). Ratios are driver / bare. Targets (issue 6): a 1024-worker round
in <= 2 s, a notification at all 1024 in <= 100 ms.

What-ifs (not the defaults): --heartbeat-timeout sets the driver's (the CLI default is 5 s);
--backlog sets ZMQ_BACKLOG on the server process's sockets (ZeroMQ's default accept queue is
100; longer bursts of connections overflow it and the kernel drops SYNs, which TCP retries
after 1 s); --driver-io-threads K gives the server's ZeroMQ context K I/O threads instead of
what the driver picks (one up to 1,024 workers or on 2 cores). --profile DIR records the driver
process with ``py-spy record --format raw`` (collapsed stacks, DIR/driver-N.txt); a profiled
run's timings are perturbed.

The table splits the server's CPU by thread (Linux /proc): ZeroMQ's I/O threads, which run
every CURVE handshake and encryption, the Python threads (one GIL), and the busiest single
thread, which no number of cores can make faster: round 0's floor on a machine with cores to
spare.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import logging
import multiprocessing as mp
import multiprocessing.connection  # noqa: F401 - mp.connection.wait
import os
import queue
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import zmq  # noqa: E402

from _threads import spent, thread_cpu  # noqa: E402

from elasticrun.common import auth  # noqa: E402
from elasticrun.common import env as E  # noqa: E402
from elasticrun.common.protocol import MAX_FRAME_BYTES, Codec, ProtocolError, new_sender_id  # noqa: E402

ENV_KEYS = (E.WORKER_ID, E.JOB_ID, E.CONTROL_ADDR, E.HEARTBEAT_INTERVAL,
            E.DRIVER_TIMEOUT, E.HOSTNAME, E.SLOT)


class BenchError(RuntimeError):
    """The benchmark could not complete (a timeout, a dead server, a protocol error)."""


# ==============================================================================================
# The server process: the real driver, or the bare baseline
# ==============================================================================================
def _rss_kib() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


#: The driver's decisions so far (driver mode): how many, and the CPU of its loop's thread in them.
_DECISIONS = {"n": 0, "cpu": 0.0}


def _stats() -> dict:
    return {"cpu": time.process_time(), "wall": time.time(), "rss_kib": _rss_kib(),
            "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "threads": threading.active_count(),
            "thread_cpu": thread_cpu(), "decisions": _DECISIONS["n"], "decision_cpu": _DECISIONS["cpu"]}


def _thread_split(before: dict, after: dict) -> dict:
    """Between two stats: the busiest thread's CPU and name, ZeroMQ's I/O threads' CPU and
    count, and the Python threads' CPU together (one GIL: their sum is a floor of its own)."""
    by_thread = spent(before.get("thread_cpu", {}), after.get("thread_cpu", {})).values()
    io = [cpu for name, cpu in by_thread if name.startswith("ZMQbg/IO")]
    name, most = max(by_thread, key=lambda v: v[1], default=("-", 0.0))
    python = sum(cpu for name, cpu in by_thread if not name.startswith("ZMQbg/"))
    return {"busiest_round0": most, "busiest_name": name, "io_round0": sum(io), "io_threads": len(io),
            "python_round0": python}


def _server_main(mode: str, hosts: dict, np_: int, min_np: int, out_conn, in_conn, log_path: str,
                 options: dict) -> None:
    """Entry point of the server process (spawned). Talks to the simulator over two pipes."""
    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(asctime)s.%(msecs)03d %(threadName)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    if options.get("backlog"):
        # What-if only (--backlog): every socket of this process listens with a longer accept
        # queue than ZeroMQ's default of 100, without touching the driver's code.
        backlog = int(options["backlog"])

        class _Context(zmq.Context):
            def __init__(self, *a, **k):
                super().__init__(*a, **k)
                self.setsockopt(zmq.BACKLOG, backlog)  # a default for the sockets it creates

        zmq.Context = _Context  # type: ignore[misc]
    if options.get("io_threads"):
        # What-if only (--driver-io-threads): the server's ZeroMQ context gets this many I/O
        # threads, whatever the driver would choose (elasticrun.driver.network.io_threads).
        forced = int(options["io_threads"])
        base = zmq.Context

        class _IOContext(base):  # type: ignore[misc, valid-type]
            def __init__(self, io_threads: int = 1, **k):
                super().__init__(io_threads=forced, **k)

        zmq.Context = _IOContext  # type: ignore[misc]
    # Both modes import the same modules, so that their memory is comparable.
    from elasticrun.common.settings import JobSettings
    from elasticrun.driver import driver as drv

    lock = threading.Lock()

    def send(msg) -> None:
        with lock:
            out_conn.send(msg)

    try:
        send(("hello", os.getpid(), _stats()))
        if mode == "driver":
            rc = _run_driver(drv, JobSettings, hosts, np_, min_np, send, in_conn, options)
        else:
            rc = _run_bare(hosts, send, in_conn)
        send(("final", rc, _stats()))
    except BaseException as exc:  # noqa: BLE001 - reported to the simulator, which fails loudly
        detail = str(exc) if type(exc).__name__ == "JobFailed" else traceback.format_exc()
        try:
            send(("error", f"{type(exc).__name__}: {detail}"))
        except OSError:
            pass
        os._exit(1)


class _SimSource:
    """Discovery whose answer the simulator changes (the driver polls it every interval)."""

    def __init__(self, hosts: dict):
        self.hosts = dict(hosts)

    def describe(self) -> str:
        return "simulated discovery"

    def discover(self):
        from elasticrun.common.hosts import HostList

        return HostList(hosts=dict(self.hosts))

    def close(self) -> None:
        pass


class _SimLauncher:
    """A ``Launcher`` (elasticrun.driver.launching) forwarding to the simulator instead of
    starting processes. Exits come back from the simulator through the driver's ``on_exit``."""

    def __init__(self, send):
        self._send = send
        self.stopped = threading.Event()
        self.on_exit = None

    def bind(self, on_exit, output) -> None:
        self.on_exit = on_exit  # simulated workers have no output

    def is_remote(self, host: str) -> bool:
        return False

    def launch(self, worker_id: str, command: list, env: dict, host: str, keys: bytes | None = None) -> None:
        self._send(("launch", worker_id, {k: env[k] for k in ENV_KEYS if k in env}, time.time(), keys))

    def signal(self, worker_id: str, sig: int) -> None:
        self._send(("signal", worker_id, int(sig)))

    def stop_all(self, grace: float) -> None:
        self._send(("stop_all",))
        self.stopped.wait(grace)

    def drain(self, timeout: float) -> None:
        pass


def _run_driver(drv, JobSettings, hosts: dict, np_: int, min_np: int, send, in_conn, options: dict) -> int:
    # Defaults of the CLI everywhere (heartbeats every 0.5 s, declared hung after 5 s, discovery
    # every 1 s) unless --heartbeat-timeout says otherwise; discovery_script only has to be set
    # for the driver to start its discovery thread.
    settings = JobSettings(command=["<simulated>"], np=np_, min_np=min_np, max_np=None,
                           discovery_script="<simulated>", heartbeat_timeout=options["heartbeat_timeout"])
    source = _SimSource(hosts)
    launcher = _SimLauncher(send)
    driver = drv.ElasticDriver(settings, source, launcher)  # no processes, no SSH
    decide = driver.registry.decide

    def timed_decide(*args, **kwargs):  # counted for the report (a thread_time call is ~1 us)
        t = time.thread_time()
        try:
            return decide(*args, **kwargs)
        finally:
            _DECISIONS["n"] += 1
            _DECISIONS["cpu"] += time.thread_time() - t

    driver.registry.decide = timed_decide

    def control() -> None:
        while True:
            try:
                msg = in_conn.recv()
            except (EOFError, OSError):
                os._exit(3)  # the simulator is gone: nothing left to measure or clean up
            kind = msg[0]
            if kind == "exit":
                launcher.on_exit(msg[1], msg[2])
            elif kind == "hosts":
                source.hosts = dict(msg[1])
            elif kind == "stats":
                send(("stats", msg[1], _stats()))
            elif kind == "stopped":
                launcher.stopped.set()

    threading.Thread(target=control, name="bench-control", daemon=True).start()
    return driver.run()


def _run_bare(hosts: dict, send, in_conn) -> int:
    """The floor: the same sockets and frames, no registry, no decisions beyond a barrier."""
    keys, job_id = auth.JobKeys.generate(), "bare" + os.urandom(4).hex()
    secret, blob = keys.secret, keys.worker.encode()
    ctx = zmq.Context()
    zap = auth.ZapAuthenticator(ctx, [keys.worker.client_public])
    zap_sock = zap.start_inline()  # answered by this loop, as the driver's loop answers it
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    auth.secure_server(router, keys, MAX_FRAME_BYTES)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    control_addr = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    rx = Codec(secret, job_id, new_sender_id("driver-rx"))
    pub_codec = Codec(secret, job_id, new_sender_id("driver-pub"))
    listeners: dict[str, bytes] = {}  # worker -> its heartbeat connection, as the driver keeps them
    place: dict[str, tuple[str, int]] = {}
    n = itertools.count(1)
    for host, slots in hosts.items():
        for slot in range(slots):
            wid = f"w{next(n)}"
            place[wid] = (host, slot)
            send(("launch", wid, {E.WORKER_ID: wid, E.JOB_ID: job_id,
                                  E.CONTROL_ADDR: control_addr,
                                  E.HEARTBEAT_INTERVAL: "0.5", E.DRIVER_TIMEOUT: "5.0", E.HOSTNAME: host,
                                  E.SLOT: str(slot)}, time.time(), blob))
    live = set(place)
    current_hosts = dict(hosts)
    pending: dict[str, tuple[bytes, str, object]] = {}
    round_, last_ts, updates = -1, 0.0, []
    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(in_conn.fileno(), zmq.POLLIN)
    poller.register(zap_sock, zmq.POLLIN)

    def reply(identity: bytes, to: str, req, type_: str, body: dict) -> None:
        try:
            router.send_multipart([identity, rx.encode(type_, dict(body, re=req), to=to)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    try:
        while live or round_ < 0:
            events = dict(poller.poll(500))
            if zap_sock in events:
                zap.serve()
            while in_conn.poll():
                msg = in_conn.recv()
                if msg[0] == "exit":
                    live.discard(msg[1])
                    pending.pop(msg[1], None)
                    listeners.pop(msg[1], None)
                elif msg[0] == "hosts":
                    current_hosts = dict(msg[1])
                    last_ts = max(time.time(), last_ts + 1e-6)
                    updates.append([last_ts, False, True])
                    frame = pub_codec.encode("hosts_updated", {"ts": last_ts, "added": False, "removed": True})
                    for identity in listeners.values():
                        try:
                            router.send_multipart([identity, frame], zmq.NOBLOCK)
                        except zmq.ZMQError:
                            pass
                elif msg[0] == "stats":
                    send(("stats", msg[1], _stats()))
            if router not in events:
                continue
            for _ in range(1000):
                try:
                    identity, frame = router.recv_multipart(zmq.NOBLOCK)
                    m = rx.decode(frame)
                except zmq.Again:
                    break
                except (ValueError, ProtocolError):
                    continue
                if m.type == "heartbeat":
                    listeners[str(m.body.get("worker"))] = identity
                    reply(identity, m.sender, m.body.get("req"), "heartbeat_ack",
                          {"round": round_, "aborted": False, "reason": "", "updates": updates[-16:]})
                elif m.type == "rendezvous":
                    pending[str(m.body.get("worker"))] = (identity, m.sender, m.body.get("req"))
                    if len(pending) >= len(live) and live <= set(pending):  # the barrier
                        round_ += 1
                        members = sorted((w for w in pending if place[w][0] in current_hosts),
                                         key=lambda w: int(w[1:]))
                        for rank, w in enumerate(members):
                            host, slot = place[w]
                            identity_, to, req = pending[w]
                            reply(identity_, to, req, "assignment", {
                                "host": host, "slot": slot, "rank": rank, "size": len(members),
                                "local_rank": slot, "local_size": 4, "cross_rank": 0, "cross_size": 1,
                                "round": round_, "notify_ts": last_ts, "new_members": round_ == 0})
                        for w in pending:
                            if place[w][0] not in current_hosts:
                                identity_, to, req = pending[w]
                                reply(identity_, to, req, "dismiss", {"reason": "host removed"})
                        pending.clear()
        return 0
    finally:
        router.close(0)
        zap.stop()
        ctx.term()


# ==============================================================================================
# The simulated workers: one thread, epoll over every socket's ZMQ_FD
# ==============================================================================================
REQ, HB = 0, 1  # a worker's sockets: requests; heartbeats, their replies and notifications
NOTE = 2  # how an update was learnt: a notification frame (HB: a heartbeat reply)
PIPE = ("pipe", -1)  # epoll entry of the pipe from the server process


class SimWorker:
    __slots__ = ("wid", "host", "slot", "socks", "codecs", "fds", "req_ids", "pending", "round", "rank",
                 "launch_ts", "rdzv_sent", "assigned", "handled_ts", "known", "interval", "last_ack",
                 "max_gap", "alive", "exit_code", "dismissed", "aborts")

    def __init__(self, wid: str, host: str, slot: int, launch_ts: float, interval: float):
        self.wid, self.host, self.slot = wid, host, slot
        self.socks: list = []
        self.codecs: list[Codec] = []
        self.fds: list[int] = []
        self.req_ids = itertools.count(1)
        self.pending: int | None = None
        self.round, self.rank = -1, -1
        self.launch_ts = launch_ts
        self.rdzv_sent: dict[int, float] = {}  # after_round -> wall time sent
        self.assigned: dict[int, float] = {}  # round -> wall time the assignment arrived
        self.handled_ts = 0.0
        self.known: dict[float, tuple[float, int]] = {}  # update ts -> (wall time learned, socket kind)
        self.interval = interval
        self.last_ack = time.monotonic()
        self.max_gap = 0.0
        self.alive = True
        self.exit_code: int | None = None
        self.dismissed: float | None = None
        self.aborts: list[str] = []


def _server_news(sim, msg) -> bool:
    """What the server says about itself (its start, stats, end, failure), kept on ``sim``: a
    :class:`Sim` or a :class:`ShardedSim`. False for any other message."""
    kind = msg[0]
    if kind == "stats":
        sim.stats[msg[1]] = msg[2]
    elif kind == "hello":
        sim.hello = (msg[1], msg[2])
    elif kind == "final":
        sim.final = (msg[1], msg[2])
    elif kind == "error":
        raise BenchError(f"the server failed: {msg[1]}")
    else:
        return False
    return True


class Sim:
    """N simulated workers in one thread. As a shard of a :class:`ShardedSim` (``shard``), its
    pipes lead to the coordinator, which forwards the server's messages to it and its exits to
    the server, and it reports what the measurements read (``obs`` messages)."""

    def __init__(self, conn_in, conn_out, max_workers: int, shard: bool = False):
        self.shard = shard
        self.closing = False
        self.ctx = zmq.Context()
        self.ctx.set(zmq.MAX_SOCKETS, 2 * max_workers + 64)
        self.conn_in, self.conn_out = conn_in, conn_out
        self.ep = select.epoll()
        self.pipe_fd = conn_in.fileno()
        self.ep.register(self.pipe_fd, select.EPOLLIN)
        self.by_fd: dict[int, tuple[SimWorker, int]] = {}
        self.workers: dict[str, SimWorker] = {}
        self.beats: list = []
        self.beat_seq = itertools.count()
        self.recheck: set = set()
        self.next_sweep = time.monotonic() + 2.0
        self.sweep_found = 0
        self.hello = None
        self.stats: dict[str, dict] = {}
        self.final = None
        self.launch_walls: list[float] = []
        self.kills: list[tuple[str, int]] = []
        self.protocol_errors: list[str] = []
        self.update_ts: list[float] = []  # distinct host-update timestamps, in the order first seen
        self.frames = 0

    # --- plumbing -------------------------------------------------------------------------
    def observe(self, *obs) -> None:
        """What the coordinator's measurements read (only as a shard)."""
        if self.shard:
            self.to_server(("obs", *obs))

    def to_server(self, msg) -> None:
        try:
            self.conn_out.send(msg)
        except OSError as exc:
            raise BenchError(f"the server process is gone ({exc})") from None

    def step(self, timeout: float) -> None:
        now = time.monotonic()
        while self.beats and self.beats[0][0] <= now:
            _, _, w = heapq.heappop(self.beats)
            if w.alive:
                self.send(w, HB, "heartbeat", {"worker": w.wid, "round": w.round})
                heapq.heappush(self.beats, (now + w.interval, next(self.beat_seq), w))
        if self.beats:
            timeout = min(timeout, max(0.0, self.beats[0][0] - now))
        ready = [self.by_fd.get(fd) if fd != self.pipe_fd else PIPE for fd, _ in self.ep.poll(timeout)]
        # Notifications first, each stamped as it is taken off its socket and decoded after the
        # batch: the time a worker hears of an update is then not inflated by this one thread
        # decoding the frames of the 1023 other workers first (real workers decode in parallel).
        stamped = []
        for entry in ready:
            if entry is not None and entry[1] == HB:
                w = entry[0]
                while True:
                    try:
                        stamped.append((w, w.socks[HB].recv(zmq.NOBLOCK), time.time()))
                    except zmq.Again:
                        break
        for entry in ready:
            if entry is PIPE:
                self.read_pipe()
            elif entry is not None and entry[1] != HB:
                self.drain(*entry)
        for w, frame, t in stamped:
            if w.alive:
                self.handle(w, HB, frame, t)
        # After a send, libzmq may have consumed the FD's edge while taking in new messages:
        # look at ZMQ_EVENTS of every socket that was sent on (the standard edge-trigger rule).
        while self.recheck:
            batch, self.recheck = self.recheck, set()
            for w, kind in batch:
                if w.alive and w.socks[kind].getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    self.drain(w, kind)
        if time.monotonic() >= self.next_sweep:  # safety net; counts what the rule above missed
            self.next_sweep = time.monotonic() + 2.0
            for w in list(self.workers.values()):
                for kind in (REQ, HB):
                    if w.alive and w.socks[kind].getsockopt(zmq.EVENTS) & zmq.POLLIN:
                        self.sweep_found += 1
                        self.drain(w, kind)

    def until(self, pred, timeout: float, what: str, progress=lambda: "") -> float:
        deadline = min(time.monotonic() + timeout, BUDGET_END)
        while not pred():
            if self.final is not None and not pred():
                raise BenchError(f"the server finished (rc={self.final[0]}) before {what}")
            left = deadline - time.monotonic()
            if left <= 0:
                why = "--timeout" if deadline < BUDGET_END else "--budget"
                raise BenchError(f"timed out ({why}) waiting for {what}; {progress()}")
            self.step(min(left, 0.05))
        return time.time()

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self.step(min(left, 0.05))

    def ask_stats(self, tag: str) -> dict:
        self.to_server(("stats", tag))
        self.until(lambda: tag in self.stats, 30, f"the server's stats ({tag})")
        return self.stats[tag]

    # --- the server's messages ------------------------------------------------------------
    def read_pipe(self) -> None:
        while True:
            try:
                if not self.conn_in.poll():
                    return
                msg = self.conn_in.recv()
            except (EOFError, OSError):
                raise BenchError("the server process died (its pipe closed); see its log below") from None
            kind = msg[0]
            if kind == "launch":
                self.launch(msg[1], msg[2], msg[3], msg[4])
            elif kind == "signal":
                w = self.workers.get(msg[1])
                if w is not None and w.alive and msg[2] in (signal.SIGKILL, signal.SIGTERM):
                    self.kills.append((msg[1], msg[2]))
                    self.exit(w, -msg[2])
            elif kind == "stop_all":
                for w in self.workers.values():
                    if w.alive:
                        self.exit(w, -signal.SIGTERM)
                self.to_server(("stopped",))
            elif _server_news(self, msg):
                pass
            elif kind == "exit_worker":  # (shard) the coordinator ends one
                w = self.workers.get(msg[1])
                if w is not None and w.alive:
                    self.exit(w, msg[2])
            elif kind == "report":  # (shard) what only this process knows, at the end
                now = time.monotonic()
                gaps = {w.wid: max(w.max_gap, now - w.last_ack if w.alive else 0.0) for w in self.workers.values()}
                self.to_server(("report", time.process_time(), gaps, self.protocol_errors[:10],
                                len(self.protocol_errors), self.sweep_found))
            elif kind == "close":
                self.closing = True
                return

    def launch(self, wid: str, env: dict, launch_wall: float, blob: bytes) -> None:
        self.launch_walls.append(launch_wall)
        if wid in self.workers:
            raise BenchError(f"{wid} launched twice")
        w = SimWorker(wid, env[E.HOSTNAME], int(env[E.SLOT]), time.time(), float(env[E.HEARTBEAT_INTERVAL]))
        keys, job_id = auth.WorkerKeys.decode(blob), env[E.JOB_ID]
        secret = keys.secret
        for kind, name in enumerate(("worker", "hb")):
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            auth.secure_client(sock, keys, MAX_FRAME_BYTES)  # as a real worker's: CURVE, frame limit
            sock.connect(env[E.CONTROL_ADDR])
            fd = sock.getsockopt(zmq.FD)
            w.socks.append(sock)
            w.codecs.append(Codec(secret, job_id, new_sender_id(name)))
            w.fds.append(fd)
            self.by_fd[fd] = (w, kind)
            self.ep.register(fd, select.EPOLLIN)
        self.workers[wid] = w
        # As Runtime: the control thread's first heartbeat at once, then the first rendezvous.
        self.send(w, HB, "heartbeat", {"worker": wid, "round": w.round})
        heapq.heappush(self.beats, (time.monotonic() + w.interval, next(self.beat_seq), w))
        self.rendezvous(w)

    # --- one worker -----------------------------------------------------------------------
    def send(self, w: SimWorker, kind: int, type_: str, body: dict) -> None:
        try:
            w.socks[kind].send(w.codecs[kind].encode(type_, body), zmq.NOBLOCK)
        except zmq.Again:
            raise BenchError(f"{w.wid}: could not send {type_} (no connection to the server)") from None
        self.recheck.add((w, kind))

    def rendezvous(self, w: SimWorker) -> None:
        w.pending = next(w.req_ids)
        w.rdzv_sent[w.round] = time.time()
        self.observe("rdzv", w.wid, w.round, w.rdzv_sent[w.round])
        self.send(w, REQ, "rendezvous", {"worker": w.wid, "after_round": w.round, "req": w.pending})

    def learn(self, w: SimWorker, ts: float, kind: int, received: float) -> None:
        if ts in w.known:
            return
        w.known[ts] = (received, kind)
        self.observe("learned", w.wid, ts, received, kind)
        if ts not in self.update_ts:
            self.update_ts.append(ts)
        # As after HostsUpdatedInterrupt: ask for the next round (unless a request is in flight;
        # its answer is then checked against what is known).
        if ts > w.handled_ts and w.pending is None and w.round >= 0:
            self.rendezvous(w)

    def drain(self, w: SimWorker, kind: int) -> None:
        sock = w.socks[kind]
        while w.alive:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(w, kind, frame, time.time())

    def handle(self, w: SimWorker, kind: int, frame: bytes, received: float) -> None:
        self.frames += 1
        try:
            msg = w.codecs[kind].decode(frame)
        except ProtocolError as exc:
            self.protocol_errors.append(f"{w.wid}: {exc}")
            return
        body = msg.body
        if kind == REQ:
            if body.get("re") != w.pending:
                return
            w.pending = None
            if msg.type == "assignment":
                w.round, w.rank = int(body["round"]), int(body["rank"])
                w.assigned[w.round] = received
                self.observe("assigned", w.wid, w.round, received)
                w.handled_ts = max(w.handled_ts, float(body.get("notify_ts", 0.0)))
                if any(ts > w.handled_ts for ts in w.known):
                    self.rendezvous(w)
            elif msg.type == "dismiss":
                w.dismissed = time.time()
                self.observe("dismissed", w.wid, w.dismissed)
                self.exit(w, 0)
        elif msg.type == "heartbeat_ack":
            now = time.monotonic()
            w.max_gap = max(w.max_gap, now - w.last_ack)
            w.last_ack = now
            for ts, _added, _removed in body.get("updates", []):
                self.learn(w, float(ts), HB, received)
            if body.get("aborted"):
                w.aborts.append(str(body.get("reason")))
                self.observe("abort", w.wid)
        elif msg.type == "hosts_updated":
            self.learn(w, float(body["ts"]), NOTE, received)
        elif msg.type == "round_aborted":
            w.aborts.append(str(body.get("reason")))
            self.observe("abort", w.wid)

    def exit(self, w: SimWorker, code: int) -> None:
        """The simulated process ends: its sockets close, then the server hears of its exit."""
        self.close_worker(w)
        w.exit_code = code
        self.to_server(("exit", w.wid, code))

    def close_worker(self, w: SimWorker) -> None:
        if not w.alive:
            return
        w.alive = False
        for fd, sock in zip(w.fds, w.socks):
            self.by_fd.pop(fd, None)
            try:
                self.ep.unregister(fd)
            except (OSError, ValueError):
                pass
            sock.close(0)

    def close(self) -> None:
        for w in self.workers.values():
            self.close_worker(w)
        self.ep.close()
        self.ctx.destroy(linger=0)  # every socket, even one a failed run left open: never a hang
        self.conn_in.close()
        self.conn_out.close()


class _Sender:
    """Sends on a pipe from a thread of its own: the coordinator must never block on a full
    pipe (a shard blocked on its own full pipe back would never read: a deadlock)."""

    def __init__(self, conn, name: str):
        self.conn, self.name = conn, name
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, name=f"send-{name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (msg := self.queue.get()) is not None:
            try:
                self.conn.send(msg)
            except OSError as exc:
                self.error = f"{self.name} is gone ({exc})"
                return

    def send(self, msg) -> None:
        if self.error:
            raise BenchError(self.error)
        self.queue.put(msg)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(10)


def _shard_main(conn_in, conn_out, max_workers: int) -> None:
    """Entry point of a simulator shard (spawned): its workers until the coordinator says close."""
    sim = Sim(conn_in, conn_out, max_workers, shard=True)
    try:
        sim.to_server(("ready", time.process_time()))
        while not sim.closing:
            sim.step(0.05)
    except BenchError as exc:
        try:
            sim.to_server(("shard_error", str(exc)))
        except BenchError:
            pass
    finally:
        sim.close()


class ShardedSim:
    """The simulated workers spread over ``shards`` processes (each a :class:`Sim`), for more
    workers than one process may open descriptors for (6 per worker: 3 sockets, each a mailbox
    and a connection) and so that on a many-core machine the simulator is not one core.

    This process stands between the server and the shards: launches go to the shards in turn,
    signals to the worker's shard, exits and ``stopped`` back to the server; the shards report
    each worker's rendezvous, assignments, updates learned and dismissals, which this process
    keeps in :class:`SimWorker` records without sockets, so that ``run_job`` reads ``workers``,
    ``update_ts``, ``kills`` and ``launch_walls`` exactly as of a single :class:`Sim`.
    """

    def __init__(self, conn_in, conn_out, max_workers: int, shards: int):
        self.conn_in, self.conn_out = conn_in, conn_out
        self.workers: dict[str, SimWorker] = {}
        self.owner: dict[str, int] = {}
        self.update_ts: list[float] = []
        self.kills: list[tuple[str, int]] = []
        self.launch_walls: list[float] = []
        self.protocol_errors: list[str] = []
        self.sweep_found = 0
        self.stats: dict[str, dict] = {}
        self.hello = None
        self.final = None
        self.cpu0: list[float | None] = [None] * shards
        self.reports: dict[int, tuple] = {}
        self.stopped = 0
        self.next_shard = 0
        ctx = mp.get_context("spawn")
        self.procs, self.to_shard, self.from_shard, self.senders = [], [], [], []
        per = -(-max_workers // shards)
        for i in range(shards):
            down_r, down_w = ctx.Pipe(duplex=False)
            up_r, up_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_shard_main, name=f"bench-sim-{i}", daemon=True, args=(down_r, up_w, per))
            proc.start()
            down_r.close()
            up_w.close()
            self.procs.append(proc)
            self.to_shard.append(down_w)
            self.from_shard.append(up_r)
            self.senders.append(_Sender(down_w, f"simulator shard {i}"))
        self.server = _Sender(conn_out, "the server process")
        self.conns = [conn_in, *self.from_shard]
        self.until(lambda: None not in self.cpu0, 60, "the simulator's shards to start")

    def to_server(self, msg) -> None:
        self.server.send(msg)

    def _to(self, i: int, msg) -> None:
        self.senders[i].send(msg)

    def step(self, timeout: float) -> None:
        for conn in mp.connection.wait(self.conns, timeout):
            while True:
                try:
                    if not conn.poll():
                        break
                    msg = conn.recv()
                except (EOFError, OSError):
                    who = "the server process" if conn is self.conn_in else "a simulator shard"
                    raise BenchError(f"{who} died (its pipe closed)") from None
                if conn is self.conn_in:
                    self._from_server(msg)
                else:
                    self._from_shard(self.from_shard.index(conn), msg)

    def _from_server(self, msg) -> None:
        kind = msg[0]
        if kind == "launch":
            wid, env, launch_wall = msg[1], msg[2], msg[3]
            i, self.next_shard = self.next_shard, (self.next_shard + 1) % len(self.procs)
            self.owner[wid] = i
            self.launch_walls.append(launch_wall)
            self.workers[wid] = SimWorker(wid, env[E.HOSTNAME], int(env[E.SLOT]), time.time(),
                                          float(env[E.HEARTBEAT_INTERVAL]))
            self._to(i, msg)
        elif kind == "signal":
            w = self.workers.get(msg[1])
            if w is not None and w.alive and msg[2] in (signal.SIGKILL, signal.SIGTERM):
                self.kills.append((msg[1], msg[2]))
                self._to(self.owner[msg[1]], msg)
        elif kind == "stop_all":
            self.stopped = 0
            for i in range(len(self.procs)):
                self._to(i, msg)
        else:
            _server_news(self, msg)

    def _from_shard(self, i: int, msg) -> None:
        kind = msg[0]
        if kind == "obs":
            what, w = msg[1], self.workers[msg[2]]
            if what == "rdzv":
                w.rdzv_sent[msg[3]] = msg[4]
            elif what == "assigned":
                w.assigned[msg[3]] = msg[4]
            elif what == "learned":
                w.known[msg[3]] = (msg[4], msg[5])
                if msg[3] not in self.update_ts:
                    self.update_ts.append(msg[3])
            elif what == "dismissed":
                w.dismissed = msg[3]
            elif what == "abort":
                w.aborts.append("abort")
        elif kind == "exit":
            w = self.workers[msg[1]]
            w.alive, w.exit_code = False, msg[2]
            self.to_server(msg)
        elif kind == "stopped":
            self.stopped += 1
            if self.stopped == len(self.procs):
                self.to_server(msg)
        elif kind == "ready":
            self.cpu0[i] = msg[1]
        elif kind == "report":
            self.reports[i] = msg[1:]
        elif kind == "shard_error":
            raise BenchError(f"simulator shard {i}: {msg[1]}")

    until = Sim.until
    run_for = Sim.run_for
    ask_stats = Sim.ask_stats

    def exit(self, w: SimWorker, code: int) -> None:
        self._to(self.owner[w.wid], ("exit_worker", w.wid, code))
        w.alive = False  # as the shard will say; no second exit is asked for

    def collect(self) -> float:
        """Each worker's longest heartbeat-reply gap and the shards' protocol errors into the
        records; the shards' CPU since they started (seconds)."""
        self.reports.clear()
        for i in range(len(self.procs)):
            self._to(i, ("report",))
        self.until(lambda: len(self.reports) == len(self.procs), 30, "the shards' reports")
        cpu = 0.0
        for i, (cpu_now, gaps, errors, n_errors, sweep) in self.reports.items():
            cpu += cpu_now - (self.cpu0[i] or 0.0)
            for wid, gap in gaps.items():
                self.workers[wid].max_gap = gap
            self.protocol_errors += errors + [""] * (n_errors - len(errors))
            self.sweep_found += sweep
        return cpu

    def close(self) -> None:
        for sender in self.senders:
            sender.queue.put(("close",))
            sender.close()
        self.server.close()
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        for conn in (self.conn_in, self.conn_out, *self.to_shard, *self.from_shard):
            conn.close()


# ==============================================================================================
# One job: a server process, N simulated workers, the three measurements
# ==============================================================================================
BUDGET_END = float("inf")


#: Descriptors one simulated worker holds: 2 ZeroMQ sockets, each a mailbox and a connection.
FDS_PER_WORKER = 4


def sim_processes(n: int, asked: int | None) -> int:
    """How many processes simulate ``n`` workers: as asked (--sim-procs), and at least as many
    as the open-file limit needs (a process may hold its hard limit of descriptors)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    per = max(1, (hard - 512) // FDS_PER_WORKER) if hard != resource.RLIM_INFINITY else n
    return max(asked or 1, -(-n // per))


def run_job(mode: str, n_hosts: int, slots: int, args, tmp: str) -> dict:
    n = n_hosts * slots
    hosts = {f"h{i}": slots for i in range(n_hosts)}
    log_path = os.path.join(tmp, f"{mode}-{n}.log")
    mpctx = mp.get_context("spawn")
    to_sim_r, to_sim_w = mpctx.Pipe(duplex=False)
    to_srv_r, to_srv_w = mpctx.Pipe(duplex=False)
    options = {"backlog": args.backlog, "heartbeat_timeout": args.heartbeat_timeout,
               "io_threads": args.driver_io_threads}
    proc = mpctx.Process(target=_server_main, name=f"bench-{mode}", daemon=True,
                         args=(mode, hosts, n, n - slots, to_sim_w, to_srv_r, log_path, options))
    proc.start()
    to_sim_w.close()
    to_srv_r.close()
    shards = sim_processes(n, args.sim_procs)
    sim = Sim(to_sim_r, to_srv_w, n) if shards == 1 else ShardedSim(to_sim_r, to_srv_w, n, shards)
    profiler = None
    res: dict = {"mode": mode, "n": n, "sim_procs": shards}
    try:
        sim.until(lambda: sim.hello is not None, 60, "the server process to start")
        pid, hello = sim.hello
        if args.profile and mode == "driver":
            os.makedirs(args.profile, exist_ok=True)
            out = os.path.join(args.profile, f"driver-{n}.txt")
            profiler = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
                                         "--nonblocking", "--output", out],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            res["profile"] = out
        ws = sim.workers
        sim_cpu0 = time.process_time()

        # (1) round 0
        def launched_and_assigned(r: int):
            return lambda: len(ws) == n and all(r in w.assigned for w in ws.values())

        def progress(r: int):
            return lambda: (f"{len(ws)}/{n} launched, {sum(r in w.assigned for w in ws.values())} hold a round-{r} "
                            f"assignment, {sum(not w.alive for w in ws.values())} exited, {len(sim.kills)} killed "
                            f"by the server")

        sim.until(launched_and_assigned(0), args.timeout, "every worker's round-0 assignment", progress(0))
        first_launch = min(sim.launch_walls)
        res["round0"] = max(w.assigned[0] for w in ws.values()) - first_launch
        res["round0_after_last_request"] = max(w.assigned[0] for w in ws.values()) - max(
            w.rdzv_sent[-1] for w in ws.values())
        res["launch_spread"] = max(sim.launch_walls) - first_launch
        st_r0 = sim.ask_stats("round0")
        res["cpu_round0"] = st_r0["cpu"] - hello["cpu"]
        res.update(_thread_split(hello, st_r0))
        if mode == "driver" and "decisions" in st_r0:
            res["decisions_round0"] = st_r0["decisions"] - hello.get("decisions", 0)
            res["decision_cpu_round0"] = st_r0["decision_cpu"] - hello.get("decision_cpu", 0.0)
        res["rss_round0_mib"] = st_r0["rss_kib"] / 1024

        # (3) steady state: heartbeats only
        sim.run_for(0.5)
        st_a = sim.ask_stats("steady-a")
        sim.run_for(args.steady)
        st_b = sim.ask_stats("steady-b")
        res["cpu_steady"] = (st_b["cpu"] - st_a["cpu"]) / (st_b["wall"] - st_a["wall"])

        # (2) graceful removal of the last host
        removed = f"h{n_hosts - 1}"
        alive_before = [w for w in ws.values() if w.alive]
        known_before = len(sim.update_ts)
        sim.to_server(("hosts", {h: s for h, s in hosts.items() if h != removed}))
        sim.until(lambda: len(sim.update_ts) > known_before and all(
            sim.update_ts[known_before] in w.known or not w.alive for w in alive_before),
            args.timeout, "every worker to hear of the host update",
            lambda: f"{len(sim.update_ts) - known_before} update(s) seen so far")
        ts = sim.update_ts[known_before]
        heard = [w.known[ts] for w in alive_before if ts in w.known]
        delays = sorted(t - ts for t, _ in heard)
        res["notify_last"] = delays[-1]
        res["notify_median"] = statistics.median(delays)
        res["notify_via_heartbeat"] = sum(1 for _, kind in heard if kind == HB)
        res["notify_first"] = delays[0]
        res["notify_count"] = len(delays)
        survivors = [w for w in alive_before if w.host != removed]
        gone = [w for w in alive_before if w.host == removed]
        r1 = 1
        sim.until(lambda: all(r1 in w.assigned for w in survivors) and all(w.dismissed for w in gone),
                  args.timeout, "every survivor's round-1 assignment",
                  lambda: (f"{sum(r1 in w.assigned for w in survivors)}/{len(survivors)} survivors hold round 1, "
                           f"{sum(bool(w.dismissed) for w in gone)}/{len(gone)} removed workers dismissed, "
                           f"{len(sim.kills)} killed by the server"))
        res["round1"] = max(w.assigned[r1] for w in survivors) - ts
        res["round1_after_last_request"] = max(w.assigned[r1] for w in survivors) - max(
            w.rdzv_sent[0] for w in alive_before)
        st_r1 = sim.ask_stats("round1")
        res["cpu_round1"] = st_r1["cpu"] - st_b["cpu"]
        res["rss_round1_mib"] = st_r1["rss_kib"] / 1024
        if isinstance(sim, ShardedSim):
            res["sim_cpu"] = sim.collect() + time.process_time() - sim_cpu0
            res["max_ack_gap"] = max(w.max_gap for w in ws.values())
        else:
            now = time.monotonic()
            res["max_ack_gap"] = max(max(w.max_gap, now - w.last_ack if w.alive else 0.0) for w in ws.values())
            res["sim_cpu"] = time.process_time() - sim_cpu0
        res["rss_start_mib"] = hello["rss_kib"] / 1024
        res["peak_rss_mib"] = st_r1["maxrss_kib"] / 1024

        # the end: every worker exits 0; the job must conclude by itself
        for w in ws.values():
            if w.alive:
                sim.exit(w, 0)
        sim.until(lambda: sim.final is not None, args.timeout, "the server to conclude the job")
        proc.join(10)
        res["rc"] = sim.final[0]
        res["kills"] = len(sim.kills)
        res["aborts"] = sum(len(w.aborts) for w in ws.values())
        res["protocol_errors"] = len(sim.protocol_errors)
        res["sweep_found"] = sim.sweep_found
        res["updates"] = len(sim.update_ts)
        if sim.kills or res["aborts"] or sim.protocol_errors or res["rc"] != 0 or res["updates"] != 1:
            res["warning"] = (f"{len(sim.kills)} worker(s) killed by the server, {res['aborts']} abort notice(s), "
                              f"{len(sim.protocol_errors)} protocol error(s) {sim.protocol_errors[:3]}, "
                              f"{res['updates']} host update(s), rc={res['rc']}")
        return res
    except BenchError as exc:
        res["error"] = str(exc)
        res["kills"] = len(sim.kills)
        if sim.launch_walls:
            res["failed_after"] = time.time() - min(sim.launch_walls)
        _print_log_tail(log_path, 8)
        return res
    except BaseException:
        _print_log_tail(log_path)
        raise
    finally:
        if proc.is_alive():
            try:  # nothing of ours is left to stop: let its launcher's stop_all return at once
                (sim.to_server if isinstance(sim, ShardedSim) else sim.conn_out.send)(("stopped",))
            except (OSError, BenchError):
                pass
            proc.terminate()  # the driver stops on SIGTERM like on Ctrl-C
            proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        if profiler is not None:
            try:
                profiler.wait(30)
            except subprocess.TimeoutExpired:
                profiler.terminate()
                profiler.wait(5)
        sim.close()


def _print_log_tail(path: str, lines: int = 25) -> None:
    try:
        with open(path) as f:
            text = f.readlines()
    except OSError:
        return
    hung = sum("sent no heartbeat" in line for line in text)
    if text:
        print(f"--- last lines of the server's log ({path}) ---", file=sys.stderr)
        sys.stderr.writelines(line[:400] + ("...\n" if len(line) > 400 else "") for line in text[-lines:])
        if hung:
            print(f"--- ({hung} worker(s) declared hung by --heartbeat-timeout in this log) ---", file=sys.stderr)


# ==============================================================================================
# The table
# ==============================================================================================
ROWS = [
    # key, label, unit, scale, target (in the unit shown), applies only at N
    ("round0", "round 0: first launch -> all assigned", "s", 1, 2.0, 1024),
    ("round0_after_last_request", "  of which: last request -> all assigned", "s", 1, None, None),
    ("notify_last", "hosts_updated: publish -> last worker", "ms", 1e3, 100.0, 1024),
    ("notify_median", "hosts_updated: publish -> median worker", "ms", 1e3, None, None),
    ("round1", "round 1 (host removed): publish -> all assigned", "s", 1, 2.0, 1024),
    ("round1_after_last_request", "  of which: last request -> all assigned", "s", 1, None, None),
    ("cpu_round0", "server CPU, launch + round 0", "s", 1, None, None),
    ("io_round0", "  of which: ZeroMQ's I/O threads", "s", 1, None, None),
    ("python_round0", "  of which: Python threads (the loop, which answers ZAP; discovery, ...: one GIL)", "s", 1,
     None, None),
    # a thread cannot go faster than its own CPU: round 0's floor on a machine with cores to spare
    ("busiest_round0", "  busiest single thread", "s", 1, None, None),
    ("decision_cpu_round0", "  the registry's decisions in round 0 (driver's loop CPU)", "s", 1, None, None),
    ("decisions_round0", "  how many decisions in round 0", "", 1, None, None),
    ("cpu_steady", "server CPU, steady (heartbeats only)", "% core", 100, None, None),
    # from the end of the steady window: the driver's includes up to 1 s waiting for its discovery poll
    ("cpu_round1", "server CPU, host removal + round 1", "s", 1, None, None),
    ("rss_start_mib", "server RSS at start (modules imported)", "MiB", 1, None, None),
    ("rss_round0_mib", "server RSS after round 0", "MiB", 1, None, None),
    ("rss_round1_mib", "server RSS after round 1", "MiB", 1, None, None),
    ("peak_rss_mib", "server peak RSS", "MiB", 1, None, None),
    ("max_ack_gap", "longest heartbeat-reply gap at a worker", "s", 1, None, None),
    ("sim_cpu", "simulator CPU (its processes), whole job", "s", 1, None, None),
]


def print_table(n: int, bare: dict, drv: dict, args) -> list[str]:
    from elasticrun.common.settings import DEFAULT_DRIVER_TIMEOUT, DEFAULT_HEARTBEAT_INTERVAL
    from elasticrun.driver.environment import driver_timeout, heartbeat_interval

    every = heartbeat_interval(DEFAULT_HEARTBEAT_INTERVAL, n, args.heartbeat_timeout, DEFAULT_DRIVER_TIMEOUT)
    notes = [f"heartbeats every {every:g} s, --heartbeat-timeout {args.heartbeat_timeout:g} s"]
    procs = max(bare.get("sim_procs", 1), drv.get("sim_procs", 1))
    if procs > 1:
        notes.append(f"workers simulated in {procs} processes")
    if args.backlog:
        notes.append(f"what-if: ZMQ_BACKLOG {args.backlog} on the server's sockets")
    io = drv.get("io_threads") or bare.get("io_threads")
    if io:
        notes.append(f"{io} ZeroMQ I/O thread(s) in the server" + (" (what-if)" if args.driver_io_threads else ""))
    out = [f"N = {n} workers ({n // args.slots} hosts x {args.slots} slots), " + ", ".join(notes), "",
           "| metric | bare ZeroMQ | driver | ratio | target |", "| --- | ---: | ---: | ---: | --- |"]
    for key, label, unit, scale, target, only_n in ROWS:
        b, d = bare.get(key), drv.get(key)
        if b is None and d is None:
            continue
        fmt = ((lambda v: f"{v:.1f}") if unit in ("ms", "% core", "MiB") else (lambda v: f"{v:.0f}") if not unit
               else (lambda v: f"{v:.3f}"))
        cell = lambda v, res: f"{fmt(v * scale)} {unit}".rstrip() if v is not None else "failed" if res.get("error") else "-"
        ratio = f"{d / b:.1f}x" if b and d is not None else "-"
        tgt = ""
        ran = d is not None or drv.get("error")
        if target is not None and (only_n is None or only_n == n) and ran:
            met = d is not None and d * scale <= target
            tgt = f"<= {target:g} {unit}: " + ("met" if met else "MISSED" if d is not None else "not reached")
        if key == "max_ack_gap" and d is not None:
            patience = driver_timeout(DEFAULT_DRIVER_TIMEOUT, n)
            tgt = (f"< {patience:g} s (a worker's patience with the driver): "
                   + ("ok" if d < patience else "EXCEEDED, real workers would exit"))
        out.append(f"| {label} | {cell(b, bare)} | {cell(d, drv)} | {ratio} | {tgt} |")
    for res in (bare, drv):
        if res.get("error"):
            after = f" {res['failed_after']:.1f} s after the first launch" if "failed_after" in res else ""
            killed = f" ({res['kills']} simulated worker(s) killed by the server)" if res.get("kills") else ""
            error = res["error"] if len(res["error"]) < 400 else res["error"][:400] + "..."
            out.append(f"\n{res['mode']} FAILED{after}{killed}: {error}")
        if res.get("warning"):
            out.append(f"\nWARNING ({res['mode']}): {res['warning']}")
        if res.get("busiest_name"):
            out.append(f"\nnote ({res['mode']}): the busiest thread in round 0 was {res['busiest_name']!r} "
                       f"(python: the server's threads; ZMQbg/IO/k: ZeroMQ's I/O threads)")
        if res.get("notify_via_heartbeat"):
            out.append(f"\nnote ({res['mode']}): {res['notify_via_heartbeat']} worker(s) heard of the update "
                       f"from a heartbeat reply before the notification frame")
    return out


def main() -> int:
    global BUDGET_END
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--steady", type=float, default=3.0, help="seconds of heartbeats-only load to measure")
    p.add_argument("--timeout", type=float, default=60.0, help="limit for each phase, in seconds")
    p.add_argument("--budget", type=float, default=280.0, help="limit for the whole run, in seconds")
    p.add_argument("--modes", nargs="+", default=["bare", "driver"], choices=["bare", "driver"])
    p.add_argument("--profile", metavar="DIR", help="record the driver process with py-spy into DIR")
    p.add_argument("--sim-procs", type=int, default=None, metavar="K",
                   help="simulate the workers in K processes (default: one, or as many as the open-file "
                        "limit needs: about 3,200 workers per process under a hard limit of 20,000)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="the driver's --heartbeat-timeout (default 5, the CLI's default)")
    p.add_argument("--backlog", type=int, default=None,
                   help="what-if: set ZMQ_BACKLOG on the server's sockets (ZeroMQ's default is 100)")
    p.add_argument("--driver-io-threads", type=int, default=None, metavar="K",
                   help="what-if: give the server's ZeroMQ context K I/O threads (the driver picks its own "
                        "from the job's size and the cores: elasticrun.driver.network.io_threads)")
    args = p.parse_args()
    if args.profile and not shutil.which("py-spy"):
        p.error("--profile needs py-spy on PATH")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Per socket a mailbox fd and a TCP fd on each side; the server's side is one process, the
    # simulator's may be several (--sim-procs, sim_processes). Every process of the run inherits it.
    need = 4 * max(args.workers) * 3 + 256
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    BUDGET_END = time.monotonic() + args.budget
    tmp = tempfile.mkdtemp(prefix="driver-scale-")
    failed = False
    try:
        for n in args.workers:
            if n % args.slots:
                p.error(f"--workers {n} is not a multiple of --slots {args.slots}")
            results = {m: {"mode": m, "n": n} for m in ("bare", "driver")}  # "-" where not run (--modes)
            for mode in args.modes:
                t0 = time.monotonic()
                results[mode] = res = run_job(mode, n // args.slots, args.slots, args, tmp)
                failed |= bool(res.get("error"))
                print(f"N={n} {mode}: {'FAILED' if res.get('error') else 'done'} in {time.monotonic() - t0:.1f} s"
                      + (f"; profile in {res['profile']}" if res.get("profile") else ""), file=sys.stderr, flush=True)
            table = print_table(n, results["bare"], results["driver"], args)
            print("\n".join(table) + "\n", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
