"""The elastic driver: one event loop around the pure Registry.

The loop owns the ZeroMQ ROUTER (requests, and notifications on each worker's heartbeat
connection) and is the only thread that touches the Registry, so no decision ever races
another. Other threads (discovery, process watchers, output pumps) only post events to a
queue and wake the loop through a pipe that the ZeroMQ poller watches alongside the socket.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import queue
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import zmq

from elasticrun.common.auth import CurveUnavailable, JobKeys, ZapAuthenticator, secure_server
from elasticrun.common.errors import JobFailed
from elasticrun.common.events import FIELDS, WORKER_KINDS, Cause, EventLog, Kind, Reason
from elasticrun.common.hosts import HostList
from elasticrun.common.limits import lift_open_files
from elasticrun.common.protocol import MAX_FRAME_BYTES, Codec, Message, ProtocolError, new_sender_id
from elasticrun.common.ratelimit import LimitedLog
from elasticrun.common.settings import JobSettings
from elasticrun.discovery.host_manager import HostManager
from elasticrun.discovery.sources import DiscoveryError
from elasticrun.discovery.streak import FailureStreak
from elasticrun.driver import registry as reg
from elasticrun.driver import request_types as requests
from elasticrun.driver import words
from elasticrun.driver.durable import checkpoints
from elasticrun.driver.durable.decisions import CopySchedule, FinalCopy, Progress, final_copy_verdict
from elasticrun.driver.durable.service import DurableService
from elasticrun.driver.environment import shared_environment, worker_environment
from elasticrun.driver.functions import Service
from elasticrun.driver.kvstore import KVStore
from elasticrun.driver.launching import Launcher
from elasticrun.driver.network import (DriverEndpoints, UnresolvedHost, driver_bind_address, io_threads, usable_cores,
                                      zmq_endpoint)
from elasticrun.driver.notifications import Notifications
from elasticrun.driver.output import OutputSink
from elasticrun.driver.resets import ResetTracker

log = logging.getLogger("elasticrun")


#: A gap this long between two turns of the loop (at most 0.5 s apart when it runs) is a stall.
_STALLED_S = 2.0
#: After a stall, silence is judged up to where it began for this long: the heartbeats sent
#: meanwhile reach the inbox (the ZeroMQ threads were stopped too) and are read first.
_STALL_GRACE_S = 3.0
#: How far behind its inbox the driver may fall before it says so (seconds).
_BEHIND_WARNING = 2.0


class Source(Protocol):
    def describe(self) -> str: ...
    def discover(self) -> HostList: ...
    def close(self) -> None: ...


def _when(wall: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))


#: How long a stop waits for the last durable copy (a scheduler's SIGTERM is followed by its
#: SIGKILL: Kubernetes' default grace is 30 s, Slurm's KillWait 30 s).
FINAL_COPY_LIMIT = 20.0
#: Seconds after a copy request within which every worker has reported its newest commit (a
#: few heartbeats): past it, "no newer commit" is known, not guessed.
COMMIT_NEWS = 1.5
#: What the stop needs beyond the copy and the workers' grace (the last output, the sockets).
STOP_MARGIN = 3.0


class _Interrupted(BaseException):
    """A stop signal (SIGINT, SIGTERM, SIGHUP). A BaseException, as KeyboardInterrupt is: no
    ``except Exception`` on its way (a request's handler, logging's ``emit``, a launcher's error
    report) may take it for an error, say it, and leave the job running after its one SIGTERM."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _Pending:
    """A request whose reply is deferred (a rendezvous, or a store read of a missing key)."""

    identity: bytes
    sender: str
    req: Any


def _receive(sock: zmq.Socket, keep: int = 2) -> tuple[list[bytes], int]:
    """One whole message from ``sock`` (zmq.Again when there is none): its first ``keep``
    frames and how many it had. The peer chooses the number of frames: the extra ones are
    read and dropped, never kept, and a wrong count is the caller's to report, not a crash."""
    parts = [sock.recv(zmq.NOBLOCK)]
    n = 1
    while sock.getsockopt(zmq.RCVMORE):
        part = sock.recv(zmq.NOBLOCK, copy=False)  # a message's frames arrive together
        n += 1
        if len(parts) < keep:
            parts.append(part.bytes)
    return parts, n


#: Descriptors the driver holds per worker: three connections (requests, heartbeats and
#: notifications, durable copies) and, for a local worker, its output pipes and key pipe.
FDS_PER_WORKER = 6

#: How long discovery waits for the lookups of new host names before it lists the others.
NAME_WAIT = 1.0


def _raise_open_file_limit(workers: int) -> None:
    """Lift the soft limit on open files to the hard one (:func:`~elasticrun.common.limits.lift_open_files`),
    whatever the job's size: a neighbour's idle connections take descriptors too. Says so once
    if even the hard limit is short of what ``workers`` need."""
    soft = lift_open_files()
    need = FDS_PER_WORKER * workers + 256
    if soft is not None and soft < need:
        log.warning("the open-file limit (%d) is short of the ~%d that %d workers need: raise it (`ulimit -n %d`) "
                    "before starting elasticrun", soft, need, workers, need)


class ElasticDriver:
    """Runs one elastic job to completion. ``run()`` returns the exit code."""

    def __init__(self, settings: JobSettings, source: Source, launcher: Launcher,
                 services: Sequence[Service] = ()):
        """``launcher`` starts the workers (``driver/compose.py`` picks it for the command line
        and ``elasticrun.run()``); the driver binds it to itself and never builds one.
        ``services`` handle request types of their own (e.g. elasticrun.run()'s function)."""
        self.settings = settings
        self.source = source
        self.job_id = uuid.uuid4().hex[:12]
        self._progress_seen = Progress()  # the furthest (steps, commit) the workers have reported
        try:  # per job: the HMAC secret, CURVE server and client key pairs (elasticrun/common/auth.py)
            self._keys = JobKeys.generate()
        except CurveUnavailable as exc:
            raise JobFailed(str(exc), 2) from None
        self._worker_keys = self._keys.worker.encode()  # what each worker gets, through a pipe
        self._events: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._stop_discovery = threading.Event()
        self._ids = (f"w{n}" for n in range(1, 1 << 62))
        self.registry = reg.Registry(
            reg.RegistryConfig(np=settings.np, min_np=settings.min_np, max_np=settings.max_np,
                               reset_limit=settings.reset_limit, elastic_timeout=settings.elastic_timeout,
                               start_timeout=settings.start_timeout,
                               heartbeat_timeout=settings.heartbeat_timeout,
                               evict_stragglers=settings.evict_stragglers, backend=settings.backend,
                               fixed_hosts=settings.hosts is not None),
            HostManager(cooldown_range=settings.cooldown_range), new_id=lambda: next(self._ids))
        # Problems that input can repeat without end (garbage frames, discovery output, failed
        # diagnostic writes): a few lines and counts (elasticrun/common/ratelimit.py), flushed
        # every loop and at the end.
        self._limited = LimitedLog(log)
        self._sink = OutputSink(self._rank_of, settings.output_filename,
                                timestamps=settings.prefix_output_with_timestamp, limited=self._limited)
        # It reports each worker's end through worker_exited() and its output to the sink.
        self._launcher = launcher
        self._launcher.bind(self.worker_exited, self._sink)
        tag = getattr(source, "tag", None)
        if tag is not None:  # a discovery script: its runs carry the job's id, for the reaper
            tag(self.job_id)
        self._pending_rdzv: dict[str, _Pending] = {}
        self._abort_said: tuple[Reason, str] | None = None  # the abort reason worded once, not per heartbeat
        self._notifications = Notifications()
        self._reported_problems: set[int] = set()  # hashes of discovery problems already said
        self._discovery_streak = FailureStreak()  # runs failed in a row: said again every 10 minutes
        self._last_problems: int | None = None  # the previous discovery run's problems, hashed
        self._summarized = False
        events_path = settings.events_file or (
            os.path.join(settings.output_filename, "events.jsonl") if settings.output_filename else None)
        if events_path and os.path.dirname(events_path):
            os.makedirs(os.path.dirname(events_path), exist_ok=True)
        self._journal = EventLog(events_path, self._limited,
                                 beneath=None if settings.events_file else settings.output_filename)
        self._resets = ResetTracker()
        self._last_hosts: tuple[dict[str, int], list[str]] | None = None
        self._started = time.monotonic()
        # Request types served by others (elasticrun.run(): driver/functions.py).
        self._services: dict[str, Service] = {t: svc for svc in services for t in svc.types}
        self._handlers = self._request_handlers()
        # What requests are read with and answered through: pure objects, so that a test can
        # serve frames (handle_frame) with no socket; run() points reply_to at the ROUTER.
        self._rx = Codec(self._keys.secret, self.job_id, new_sender_id("driver-rx"))
        self._notify_codec = Codec(self._keys.secret, self.job_id, new_sender_id("driver-pub"))
        # Where notifications go: each worker's heartbeat connection (worker id -> its ROUTER
        # identity), learnt from its heartbeats. One connection fewer per worker than a PUB
        # socket: a third less CURVE handshake work when thousands connect at once.
        self._listeners: dict[str, bytes] = {}
        self._unroutable_said: set[str] = set()  # hosts whose workers could not be given an address
        self._router: Any = None
        self._store = KVStore()
        self.reply_to: Callable[[list[bytes]], None] = lambda frames: None  # until run() binds its socket

    def worker_exited(self, worker_id: str, code: int, detail: str = "") -> None:
        """The launcher's report that a worker ended (from any thread); ``code`` as ``subprocess``
        gives it (-N: killed by signal N); ``detail``: why it never started, if it did not."""
        self._post("exit", (worker_id, code, detail))

    # --- plumbing --------------------------------------------------------------------------
    def _post(self, kind: str, payload: Any) -> None:
        self._events.put((kind, payload))
        self._wake()

    def _rank_of(self, worker_id: str) -> int:
        w = self.registry.workers.get(worker_id)
        return w.rank if w is not None else -1

    # --- main loop -------------------------------------------------------------------------
    def run(self) -> int:
        if self.settings.ignored_horovodrun_flags:
            log.warning("ignoring %s: Horovod's engine tuning flags have nothing to tune here (no tensor fusion "
                        "cycle, response cache, autotuner or stall check; see docs/porting-from-horovod.md)",
                        ", ".join(self.settings.ignored_horovodrun_flags))
        for line in self.settings.startup_warnings:
            log.warning("%s", line)
        # From the first moment: a signal during the first discovery (a script that hangs) stops
        # it, its process group included, instead of killing the driver and leaving it running.
        previous = self._catch_stop_signals()
        ctx: zmq.Context | None = None
        started = False  # past the first discovery: a stop or a failure from here on is the job's
        try:
            self._open_checkpoints()  # before anything starts: a directory in use or unusable is refused
            guard = getattr(self._launcher, "guard", None)
            if guard is not None and getattr(self.source, "tag", None) is not None:
                guard(self.job_id)  # the reaper, before the first discovery script runs (it may hang)
            first = self._first_discovery()
            started = True
            most = self.settings.max_np or self.settings.np
            _raise_open_file_limit(most)
            threads = io_threads(most, usable_cores())
            if threads > 1:
                log.info("up to %d workers: their connections' encryption runs on %d ZeroMQ I/O threads", most, threads)
            ctx = zmq.Context(io_threads=threads)
            # Only the job's workers get in: the socket is a CURVE server, and this ZAP handler
            # (bound before it) admits only the job's client key, so no frame of anyone else ever
            # reaches it. MAXMSGSIZE also bounds the handshake's frames.
            # (Served by the loop itself, see ZapAuthenticator.start_inline.)
            self._zap = ZapAuthenticator(ctx, [self._keys.worker.client_public])
            self._zap_sock = self._zap.start_inline()
            self._router = ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            # Hundreds of workers connect at once; the default accept queue (100) drops
            # connections that then retry only after a second.
            self._router.setsockopt(zmq.BACKLOG, 4096)
            secure_server(self._router, self._keys, MAX_FRAME_BYTES)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            # 127.0.0.1 (or --driver-address) now; for remote hosts, the address they route to, on demand.
            self._endpoints = DriverEndpoints(self._router, driver_bind_address(self.settings))
            self._control_addr = self._endpoints.local()
            self.reply_to = self._send_reply
            self._durable = self._start_durable(ctx)
            if self.settings.status_interval > 0:
                self._status_due = time.monotonic() + self.settings.status_interval
            self.registry.discovered(first.hosts, time.monotonic(), first.draining)
            self._execute(self.registry.decide(time.monotonic()))
            if self.settings.hosts is None:  # a discovery script or callable: poll it
                threading.Thread(target=self._discovery_loop, name="elasticrun-discovery", daemon=True).start()
            finished = self._loop()
            assert finished is not None  # without ``until``, the loop returns only a finished job
            return self._conclude(finished)
        except _Interrupted as exc:
            if not started:
                log.warning("received %s before any worker started: stopped", exc)
                return 128 + exc.signum
            self._stopping = True  # a second Ctrl-C must not interrupt the stop itself
            ended = self._final_copy(exc.signum)
            if ended is not None and ended.ok:  # it finished while the last copy was awaited
                log.warning("received %s: the job ended meanwhile", exc)
                return self._conclude(ended)
            # (A job that failed meanwhile, its workers told by the same signal, was stopped by
            # it: 128+N, as a scheduler that requeues on it expects.)
            log.warning("received %s: stopping %d worker(s) (any still running after %g s are killed)", exc,
                        len(self.registry.live()), self.settings.stop_grace)
            self._shutdown()
            why = Reason(Cause.SIGNALLED, {"signal": str(exc)})
            self._journal.write(Kind.JOB_END, round=self.registry.round, ok=False, reason=words.reason(why),
                                cause=why.cause)
            self._say_copy_kept()
            self._summarize()
            return 128 + exc.signum
        except BaseException:
            if started:  # (a first discovery or a checkpoint directory refused: its one line says it all)
                self._stopping = True
                self._shutdown()
                self._summarize()
            raise
        finally:
            self._restore_signals(previous)
            if not started:
                self._launcher.stop_all(0.0)  # nothing runs yet but, perhaps, a warm-start template
            self._stop_discovery.set()
            if self._durable is not None:
                self._durable.stop()
            self._close_checkpoints()
            if self._router is not None:
                self._router.close(0)
            zap = getattr(self, "_zap", None)
            if zap is not None:
                zap.stop()
            if ctx is not None:
                ctx.term()
            self.close()
            self._sink.close()

    def _catch_stop_signals(self) -> dict[signal.Signals, Any]:
        """Take SIGINT, SIGTERM and SIGHUP (what they were before, to put back at the end).

        Only in the main thread (elasticrun.run() may be called elsewhere). SIGHUP (the
        terminal or SSH session it was started from went away) stops the job as SIGTERM does,
        in order and with a last durable copy, instead of killing the driver. An ignored SIGINT
        or SIGHUP stays ignored: a process started in the background by a script, under nohup,
        or by a caller that chose to ignore it, is not stopped by one."""
        previous: dict[signal.Signals, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) is not signal.SIG_IGN or sig == signal.SIGTERM:
                    previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    @staticmethod
    def _restore_signals(previous: dict[signal.Signals, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    @property
    def keys(self) -> JobKeys:
        """The job's keys (what each worker gets through its pipe; never printed or passed on)."""
        return self._keys

    def flush_counts(self) -> None:
        """Say now the counts of repeated problems held back (dropped frames, ignored requests):
        the loop says them every second and at the end."""
        self._limited.flush(force=True)

    def close(self) -> None:
        """Release what the driver holds from its construction (run() does it at its end; a
        driver that never ran, as in a test, is closed with this). Idempotent."""
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_r = self._wake_w = -1

    _stopping = False
    _hurry = False  # a second signal while stopping: no final durable copy
    #: The loop is applying what one wake-up brought (requests, events, a decision): a signal
    #: then waits for the end of that step (milliseconds), so that the stop never begins from
    #: a registry, a store or a launch left half done.
    _in_step = False
    _pending_signal = 0

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._stopping or self._pending_signal:  # a second signal: the (bounded) stop goes on, in a hurry
            self._hurry = True
        elif self._in_step:
            self._pending_signal = signum
        else:
            self._stopping = True  # from here on a signal hurries the stop, never interrupts it
            raise _Interrupted(signum)
        self._wake()  # the loop looks at once, not at its next timeout

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full (the loop is already awake), or closed (the job is over)

    def _resolved(self, found: HostList) -> HostList:
        """``found`` without the hosts whose names are still being looked up, or do not
        resolve. The loop must never wait on DNS (a lookup can take the resolver's 5 s, as long
        as workers wait for the driver before they give the job up): names are looked up here,
        on the discovery thread, and a host is listed once its name resolves. A name that does
        not (a node listed before its DNS record exists) is said once and tried again later,
        instead of failing a worker there and blacklisting the host."""
        prefetch = getattr(self._launcher, "prefetch", None)
        if prefetch is None or not found.hosts:  # (Ray's hosts are nodes, not names)
            return found
        held = prefetch(found.hosts, NAME_WAIT)
        if not held or self.settings.hosts is not None:
            # (A fixed host list is listed once, before any worker runs: its launches may wait,
            # and a name that does not resolve fails there, saying so.)
            return found
        kept = dataclasses.replace(found, hosts={h: n for h, n in found.hosts.items() if h not in held},
                                   draining=found.draining - set(held), errors=list(found.errors),
                                   warnings=list(found.warnings))
        for host, why in held.items():
            if why is not None:
                kept.warn(f"{why}; {host} is not used until it resolves")
        return kept

    def _first_discovery(self) -> HostList:
        try:
            found = self._resolved(self.source.discover())
        except DiscoveryError as exc:
            what = "discovery script" if self.settings.discovery_script else self.source.describe()
            raise JobFailed(f"The {what} is misconfigured: its first run failed.\n{exc}", 2) from None
        self._report_discovery_problems(found)
        if not found.hosts:
            log.warning("%s found no hosts yet; waiting up to --elastic-timeout %g s",
                        self.source.describe(), self.settings.elastic_timeout)
        return found

    def _discovery_loop(self) -> None:
        while not self._stop_discovery.wait(self.settings.discovery_interval):
            try:
                self._post("discovered", self._resolved(self.source.discover()))
            except DiscoveryError as exc:
                self._post("discovery_failed", str(exc))
            except Exception as exc:  # a bug here must not end discovery without a word
                self._post("discovery_failed", f"{type(exc).__name__}: {exc}")

    def _warn_once(self, message: str, category: str, reason: str = "") -> None:
        """Discovery runs every second: say each distinct problem once, not every interval,
        and many of them as a few lines and a count (``self._limited``)."""
        key = hash(message)
        if key not in self._reported_problems:
            if len(self._reported_problems) < 10_000:
                self._reported_problems.add(key)
            self._limited.warn(category, message, reason or category)

    def _report_discovery_problems(self, found: HostList) -> None:
        problems = hash((tuple(found.errors), found.more_errors, tuple(found.warnings), found.more_warnings))
        if problems == self._last_problems:
            return  # the same output as last time: nothing new to say
        self._last_problems = problems
        where = self.source.describe()
        for p in found.errors:
            self._warn_once(f"{where}: skipped invalid line, {p}", "invalid discovery lines", f"skipped by {where}")
        self._limited.count("invalid discovery lines", found.more_errors, f"skipped by {where}")
        for p in found.warnings:
            self._warn_once(f"{where}: {p}", "discovery warnings", f"from {where}")
        self._limited.count("discovery warnings", found.more_warnings, f"from {where}")
        self._limited.flush()

    def _loop(self, until: Callable[[], bool] | None = None, stop_at: float | None = None) -> reg.Finish | None:
        """Serve until the job finishes (or, for the final durable copy, until ``until()`` is
        true, a second signal came, or ``stop_at`` passed: a promise printed on the console)."""
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        poller.register(self._zap_sock, zmq.POLLIN)
        # Events only update the registry; it decides once per drained batch, or when one of
        # its deadlines is due: with 1024 workers a round costs O(N), and heartbeats O(1) each.
        # A decision costs O(N): when messages trickle in (N workers asking for round 0 one by
        # one), deciding after each would cost O(N^2). So after a decision that took t, events
        # wait up to t before the next (deadlines never wait): at most half the loop's time goes
        # to deciding, and a decision covers more events the more there are. With a handful of
        # workers t is ~0.1 ms, so recovery loses nothing measurable.
        next_tick = time.monotonic()
        hold_until = next_tick
        # When the inbox was last found empty: every request that arrived before then has been
        # handled. Silence is judged up to then only (Registry.decide's heard_until).
        heard_until = next_tick
        last_turn = next_tick  # when the loop last finished a turn
        stalled: tuple[float, float] | None = None  # (silence judged up to, until when) after a stall

        def stall(began: float, lost: float, now: float) -> tuple[float, float]:
            # The driver did not run (stopped: Ctrl-Z, SIGSTOP, a suspended machine; or
            # starved): the workers' heartbeats of that time may still be on their way to its
            # inbox, and no worker is hung for the driver's own silence.
            log.warning("the driver did not run for %.1f s (stopped, as by Ctrl-Z or SIGSTOP, or starved): its "
                        "workers' silence meanwhile is not held against them", lost)
            return (min(began, stalled[0]) if stalled is not None else began), now + _STALL_GRACE_S

        while True:
            now = time.monotonic()
            if now - last_turn > _STALLED_S:  # stopped between two turns
                stalled = stall(last_turn, now - last_turn, now)
            store_deadline = self._store.next_deadline()
            due = min(next_tick, store_deadline) if store_deadline is not None else next_tick
            if self.registry.dirty:
                due = min(due, hold_until)
            if stop_at is not None:
                due = min(due, stop_at)
            wait = max(0.0, min(0.5, due - now))
            events = dict(poller.poll(int(wait * 1000) + 1))
            woke = time.monotonic()
            if woke - now - wait > _STALLED_S:  # stopped while it waited for messages
                stalled = stall(now, woke - now - wait, woke)
            done = False
            self._in_step = True  # a stop signal waits for the end of this step (see _on_signal)
            try:
                # Workers' messages first: what a worker sent before it died (its last heartbeat, its
                # failure report) is read before the death its launcher posts.
                polled = time.monotonic()
                if self._zap_sock in events:  # handshakes first: a worker connecting waits on them
                    self._zap.serve()
                if self._router not in events:
                    heard_until = polled
                else:
                    for _ in range(1000):  # drain what is there, then look at the other sources again
                        try:
                            parts, n = _receive(self._router)
                        except zmq.Again:
                            heard_until = polled
                            break
                        if n == 2:
                            self.handle_frame(*parts)
                        else:  # a DEALER sends one frame, which the ROUTER receives after the peer's identity
                            self._limited.warn("dropped control frames", f"dropped a message of {n} frames "
                                               f"(a request is 1 frame)", f"messages of {n} frames")
                    self._limited.flush()
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                while True:
                    try:
                        kind, payload = self._events.get_nowait()
                    except queue.Empty:
                        break
                    self._on_event(kind, payload)
                now = time.monotonic()
                if now - heard_until > _BEHIND_WARNING:
                    self._limited.warn("driver behind", f"the driver is {now - heard_until:.1f} "
                                       f"s behind its workers' messages (too few cores for this many workers?): it "
                                       f"judges no worker hung until it has read them", "behind")
                if stalled is not None and now >= stalled[1]:
                    stalled = None
                judged = heard_until if stalled is None else min(heard_until, stalled[0])
                if now >= next_tick or (self.registry.dirty and now >= hold_until):
                    self._execute(self.registry.decide(now, judged))
                    deadline = self.registry.next_deadline()
                    next_tick = min(deadline, now + 1.0) if deadline is not None else now + 1.0
                    took = time.monotonic() - now
                    hold_until = now + 2 * took  # = the decision's end + t
                self._send_store_replies(self._store.expire(now))
                self._ask_for_copy(now)
                if self._status_due is not None and now >= self._status_due:
                    self._status(now)
                done = self.registry.finished is not None or until is not None and (
                    until() or self._hurry or (stop_at is not None and time.monotonic() >= stop_at))
            finally:
                self._in_step = False
                last_turn = time.monotonic()
            signum, self._pending_signal = self._pending_signal, 0
            if done:  # a signal that came in the step that finished the job has nothing left to stop
                return self.registry.finished
            if signum:  # it came during the step: the stop begins from a whole one
                self._stopping = True
                raise _Interrupted(signum)

    def _on_event(self, kind: str, payload: Any) -> None:
        now = time.monotonic()
        if kind == "discovered":
            line = self._discovery_streak.succeeded(now)
            if line is not None:
                log.info("%s", line)
            self._report_discovery_problems(payload)
            listing = (dict(payload.hosts), sorted(payload.draining))
            if listing != self._last_hosts:
                self._last_hosts = listing
                self._journal.write(Kind.DISCOVERY, hosts=payload.hosts, draining=listing[1] or None)
            self.registry.discovered(payload.hosts, now, payload.draining)
        elif kind == "discovery_failed":
            self._warn_once(f"discovery failed, keeping the last known hosts: {payload}", "failed discovery runs")
            line = self._discovery_streak.failed(now, str(payload))
            if line is not None:
                log.warning("%s", line)
        elif kind == "durable_written":
            durable, seconds = payload
            m = durable.manifest
            self.registry.durable(m.commit)
            # The first copy is news; the routine ones after it are in the status line and the event log.
            self._copies_written += 1
            log.log(logging.INFO if self._copies_written == 1 else logging.DEBUG,
                    "durable copy %d of commit %d written in %.1f s (%.1f MB): %s", m.number, m.commit, seconds,
                    (m.data_bytes + m.meta_bytes) / 1e6, durable.path)
            self._journal.write(Kind.DURABLE_WRITTEN, round=self.registry.round, number=m.number, commit=m.commit,
                                bytes=m.data_bytes + m.meta_bytes, seconds=round(seconds, 3))
            if self._checkpoints is not None and self._checkpoints.moved():
                self._warn_once(f"--checkpoint-dir {self.settings.checkpoint_dir} was moved or deleted while the job "
                                f"runs: its copies go on into the directory it was, where a rerun of this command "
                                f"will not look", "checkpoint dir moved")
        elif kind == "durable_failed":
            began, line = payload
            self._failed_copies.append((began, str(line)))
            self._limited.warn("durable copies", str(line), "failed")
        elif kind == "exit":
            worker_id, code, *detail = payload  # detail: the driver's own word for a worker that never started
            self._journal.write(Kind.WORKER_EXITED, worker=worker_id, code=code, **self._where(worker_id))
            self._pending_rdzv.pop(worker_id, None)
            self._listeners.pop(worker_id, None)
            self.registry.exited(worker_id, code, now, *detail)

    # --- requests from workers -------------------------------------------------------------
    def handle_frame(self, identity: bytes, frame: bytes) -> None:
        """One request frame from peer ``identity``: authenticated, dispatched to its handler,
        answered through :attr:`reply_to`. Never raises: bad frames are counted and dropped."""
        # Anyone who reaches the port can send frames: refusals are counted, not each logged.
        try:
            msg = self._rx.decode(frame)
        except ProtocolError as exc:
            self._limited.warn("dropped control frames", f"dropped a control frame: {exc}", exc.reason)
            return
        except Exception as exc:  # decode() raises nothing else; if it ever does, the job goes on
            self._limited.warn("dropped control frames", f"dropped a control frame: {type(exc).__name__}: "
                               f"{str(exc)[:200]}", type(exc).__name__)
            return
        try:
            self._dispatch(identity, msg)
        except Exception as exc:  # one bad request must never take the job down
            self._limited.warn("ignored requests", f"ignored a {msg.type!r:.40} request from {msg.sender:.40} that "
                               f"could not be handled: {type(exc).__name__}: {str(exc)[:200]}", type(exc).__name__)

    def _dispatch(self, identity: bytes, msg: Message) -> None:
        handler = self._handlers.get(msg.type)
        if handler is None:  # answered, so that a peer never waits out its timeout for nothing
            self._reply(identity, msg, "error", {"error": f"this job does not serve {msg.type!r:.40} requests"})
            self._limited.warn("ignored requests", f"ignored a {msg.type!r:.40} message from {msg.sender:.40}",
                               "unknown type")
            return
        handler(identity, msg)

    def _request_handlers(self) -> dict[str, Callable[[bytes, Message], None]]:
        """Request type -> its handler: one small method each, reading a typed request
        (``driver/request_types.py``). Services (``elasticrun.run``'s function) add their types;
        they cannot take over the job's own."""
        handlers: dict[str, Callable[[bytes, Message], None]] = {t: self._on_service for t in self._services}
        handlers.update({
            "heartbeat": self._on_heartbeat, "rendezvous": self._on_rendezvous, "store": self._on_store,
            "events": self._on_events, "leaving": self._on_leaving, "failing": self._on_failing,
            "restored": self._on_restored, "restore_failed": self._on_restore_failed,
        })
        return handlers

    def _on_heartbeat(self, identity: bytes, msg: Message) -> None:
        hb = requests.Heartbeat.parse(msg.body)
        if hb.worker in self.registry.workers:  # only the job's own: the table stays bounded
            self._listeners[hb.worker] = identity
        self.registry.heartbeat(hb.worker, time.monotonic(), hb.pace, hb.steps, hb.bye, hb.waiting, hb.stalled,
                                hb.op, hb.until)
        self._progress(hb.steps, hb.commit)
        self._reply(identity, msg, "heartbeat_ack", {
            "round": self.registry.round, "aborted": self.registry.aborted,
            "reason": self._abort_words(), "updates": self._notifications.recent(),
            "durable": self._copies.last_id if self._copies is not None else 0})

    def _abort_words(self) -> str:
        """Why the current round was aborted, as workers hear it ("" when it was not)."""
        why = self.registry.abort_reason
        if why is None:
            return ""
        if self._abort_said is None or self._abort_said[0] is not why:
            self._abort_said = (why, words.reason(why))
        return self._abort_said[1]

    def _on_rendezvous(self, identity: bytes, msg: Message) -> None:
        req = requests.Rendezvous.parse(msg.body)
        self._pending_rdzv[req.worker] = _Pending(identity, msg.sender, msg.body.get("req"))
        self.registry.rendezvous(req.worker, time.monotonic(), error=req.error, restored=req.restored,
                                 has_state=req.has_state, gpus=req.gpus)

    def _on_store(self, identity: bytes, msg: Message) -> None:
        pending = _Pending(identity, msg.sender, msg.body.get("req"))
        self._send_store_replies(self._store.handle(pending, msg.body, time.monotonic()))

    def _on_events(self, identity: bytes, msg: Message) -> None:
        events = msg.body.get("events")
        self._on_worker_events(str(msg.sender), events if isinstance(events, list) else [])

    def _on_leaving(self, identity: bytes, msg: Message) -> None:  # the worker got SIGTERM: its host is going
        self._reply(identity, msg, "leaving_ack", {})
        req = requests.Report.parse(msg.body, "why", "SIGTERM", 100)
        self.registry.leaving(req.worker, req.text, time.monotonic())

    def _on_failing(self, identity: bytes, msg: Message) -> None:
        self._reply(identity, msg, "ack", {})
        req = requests.Report.parse(msg.body, "error", "", 500)
        self.registry.failing(req.worker, req.text, time.monotonic())

    def _on_restored(self, identity: bytes, msg: Message) -> None:  # rank 0 loaded the durable copy: resumed
        self._reply(identity, msg, "ack", {})
        self._say_resumed(self.registry.round)

    def _on_restore_failed(self, identity: bytes, msg: Message) -> None:  # the copy does not fit the script
        self._reply(identity, msg, "ack", {})
        req = requests.Report.parse(msg.body, "error", "", 1000)
        self.registry.restore_failed(req.worker, req.text)

    def _on_service(self, identity: bytes, msg: Message) -> None:  # e.g. elasticrun.run()'s function and results
        worker = self.registry.workers.get(str(msg.body.get("worker")))
        self._reply(identity, msg, *self._services[msg.type].handle(msg.type, msg.body, worker))

    def _reply(self, identity: bytes, msg: Message | _Pending, type_: str, body: dict[str, Any]) -> None:
        req = msg.body.get("req") if isinstance(msg, Message) else msg.req
        self.reply_to([identity, self._rx.encode(type_, dict(body, re=req), to=msg.sender)])

    def _send_reply(self, frames: list[bytes]) -> None:
        try:
            self._router.send_multipart(frames, zmq.NOBLOCK)
        except (zmq.Again, zmq.ZMQError):
            pass  # the worker is gone (ROUTER_MANDATORY makes that an error, not a silent drop)

    def _send_store_replies(self, replies: list[tuple[Any, str, dict]]) -> None:
        for pending, type_, body in replies:
            self._reply(pending.identity, pending, type_, body)

    def _publish(self, type_: str, body: dict[str, Any]) -> None:
        """One notification to every worker, on its heartbeat connection: encoded once, sent to
        each (the I/O threads encrypt per connection, as a PUB socket's would). A worker that
        is behind or has not sent its first heartbeat yet misses it here and gets it from its
        next heartbeat's reply, which carries the recent notifications and the round's state."""
        if self._router is None:
            return
        frame = self._notify_codec.encode(type_, body)
        for worker_id, identity in list(self._listeners.items()):
            try:
                self._router.send_multipart([identity, frame], zmq.NOBLOCK)
            except zmq.Again:
                pass  # its queue is full: its next heartbeat's reply carries the news
            except zmq.ZMQError:  # that connection is gone (ROUTER_MANDATORY): a new one will beat
                self._listeners.pop(worker_id, None)

    # --- carrying out the registry's decisions ----------------------------------------------
    def _execute(self, actions: list[reg.Action]) -> None:
        shared: dict[bool, dict[str, str]] = {}  # the environment every worker gets, local and remote
        if not any(isinstance(act, reg.Notify) for act in actions):
            # Workers waiting for their place first: the console and the event log can wait, they
            # cannot (on the recovery's path, the round's lines cost as long as the reply). An
            # assignment carries the newest notification's timestamp: a batch that notifies keeps
            # its order.
            for act in actions:
                if isinstance(act, reg.Assign):
                    self._assign(act)
            actions = [act for act in actions if not isinstance(act, reg.Assign)]
        for act in actions:
            if isinstance(act, reg.Event):
                message = words.event(act)
                log.log(logging.WARNING if act.level == "warning" else logging.INFO, "%s", message)
                self._journal.write(act.kind, **{"round": self.registry.round, "message": message,
                                                 **words.plain(act.fields)})
                if act.kind is Kind.ROUND_FORMED:
                    self._resets.round_formed(self.registry.round, int(act.fields.get("size", 0)))
                elif act.kind is Kind.HANDOVER_PENDING and self._copies is not None:
                    # Every worker holding the state is going, and none can take it over yet:
                    # a durable copy of the newest commit now, so that losing them all costs no
                    # training (rather than up to --checkpoint-interval of it).
                    if self._ask_for_copy(time.monotonic(), force=True) is not None:
                        log.warning("asking for a durable copy of the newest commit now: every worker holding the "
                                    "job's state is leaving")
            elif isinstance(act, reg.Launch):
                self._journal.write(Kind.WORKER_STARTED, worker=act.worker_id, host=act.info.host, slot=act.info.slot,
                                    rank=act.info.rank)
                self._launch(act, shared)
            elif isinstance(act, reg.Assign):
                self._assign(act)
            elif isinstance(act, reg.ForgetRounds):
                self._send_store_replies(self._store.keep_only(f"round{act.round}/"))
            elif isinstance(act, reg.Dismiss):
                pending = self._pending_rdzv.pop(act.worker_id, None)
                if pending is not None:
                    why = words.reason(act.why)
                    self._reply(pending.identity, pending, "dismiss", {"reason": why})
                    w = self.registry.workers.get(act.worker_id)
                    # A graceful exit, said once, without alarm (at the job's end, one per worker: DEBUG).
                    log.log(logging.DEBUG if self.registry.finished or act.why.cause is Cause.JOB_FINISHED
                            else logging.INFO, "%s exits 0: %s", w.label if w else act.worker_id, why)
            elif isinstance(act, reg.Kill):
                self._launcher.signal(act.worker_id, signal.SIGKILL)
            elif isinstance(act, reg.Notify):
                update = self._notifications.publish(act.added, act.removed, time.time())
                self._publish("hosts_updated", {"ts": update.ts, "added": act.added, "removed": act.removed})
                self._journal.write(Kind.NOTIFICATION_SENT, round=self.registry.round, ts=update.ts,
                                    added=act.added, removed=act.removed)
                what = " and ".join(w for w, on in (("added", act.added), ("removed", act.removed)) if on)
                self._resets.trigger("hosts", f"hosts {what}", time.time())
            elif isinstance(act, reg.AbortRound):
                why = words.reason(act.why)
                log.warning("round %d aborted: %s", act.round, why)
                self._publish("round_aborted", {"round": act.round, "reason": why})
                self._journal.write(Kind.ROUND_ABORTED, round=act.round, reason=why, cause=act.why.cause)
                self._resets.trigger("failure", why, time.time())
            elif isinstance(act, reg.Finish):
                self._journal.write(Kind.JOB_END, round=self.registry.round, ok=act.ok, reason=words.reason(act.why),
                                    cause=act.why.cause)

    def _assign(self, act: reg.Assign) -> None:
        pending = self._pending_rdzv.pop(act.worker_id, None)
        if pending is not None:
            self._reply(pending.identity, pending, "assignment", dict(
                act.info.as_dict(), round=act.round, notify_ts=self._notifications.last_ts,
                must_sync=act.must_sync, restore=act.restore, device_backend=act.device_backend))

    def _where(self, worker_id: str) -> dict[str, Any]:
        w = self.registry.workers.get(worker_id)
        return {"host": w.host, "slot": w.slot, "rank": w.rank} if w is not None else {}

    def _on_worker_events(self, sender: str, events: list[Any]) -> None:
        """Workers' events go to the journal (the kinds and fields of the schema only, values
        shortened); the first step after a reset closes it."""
        for e in events[:500]:
            if not isinstance(e, dict) or e.get("kind") not in WORKER_KINDS:
                continue
            kind = Kind(e["kind"])
            t = e.get("t")
            t = float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else time.time()
            fields = {k: (v[:300] if isinstance(v, str) else v) for k, v in e.items()
                      if k in FIELDS[kind] and isinstance(v, (str, int, float, bool))}
            self._journal.write(kind, source="worker", t=t, **fields)
            e = fields
            if kind == Kind.FIRST_STEP:
                done = self._resets.first_step(int(e.get("round", -1)), t)
                if done is not None:
                    log.info("%s", done.pop("line"))
                    self._journal.write(Kind.RESET, **done)

    def _launch(self, act: reg.Launch, shared: dict[bool, dict[str, str]]) -> None:
        """Start one worker; ``shared``: the environment all get, by remoteness, filled here once."""
        info, s = act.info, self.settings
        remote = self._launcher.is_remote(info.host)
        if remote not in shared:
            shared[remote] = shared_environment(s, os.environ, remote)
        control_addr = self._control_addr
        durable_addr = None
        # A launcher may name the machine a host's workers run on (Ray: its node's address).
        route = getattr(self._launcher, "network_address", None)
        try:
            where = route(info.host) if route is not None else info.host
            if remote:
                control_addr = self._endpoints.for_host(where)
            if self._durable is not None:
                durable_addr = self._durable.endpoint(zmq_endpoint(self._endpoints.address(where if remote else None)))
        except OSError as exc:
            fix = ("make the name resolve here (DNS or /etc/hosts), or list the host by its address"
                   if isinstance(exc, UnresolvedHost) else "set --driver-address or --network-interface")
            if info.host not in self._unroutable_said:  # once per host, not once per slot
                self._unroutable_said.add(info.host)
                log.error("%s: cannot tell which address of this machine its workers could reach (%s); %s",
                          info.host, exc.strerror or exc, fix)
            self._post("exit", (act.worker_id, 255, words.never_started("no address of this machine to give it")))
            return
        worker_env = worker_environment(s, info, job_id=self.job_id, worker_id=act.worker_id,
                                        control_addr=control_addr,
                                        base_env=os.environ, remote=remote, durable_addr=durable_addr,
                                        joining=act.joining, shared=shared[remote])
        try:
            # The keys go through a pipe (locally) or the SSH channel, never the environment.
            self._launcher.launch(act.worker_id, s.command, worker_env, host=info.host, keys=self._worker_keys)
        except OSError as exc:
            log.error("could not start %r on %s: %s", s.command[0], info.host, exc.strerror or exc)
            self._post("exit", (act.worker_id, 127, words.never_started(str(exc.strerror or exc))))

    # --- durable copies (--checkpoint-dir) -------------------------------------------------------
    _checkpoints: checkpoints.CheckpointDir | None = None
    _durable: DurableService | None = None
    _copies: CopySchedule | None = None
    _resume_from: checkpoints.Durable | None = None
    _lineage = ""
    _copies_written = 0
    _failed_copies: collections.deque[tuple[float, str]]  # (when the copy began, why it failed): the newest

    def _open_checkpoints(self) -> None:
        """Take the checkpoint directory for this job (trusted, locked) and find the copy to
        resume from. A directory that is not the user's, or in use by another job, is exit 2;
        copies that exist but none of them usable stop the job before anything starts."""
        directory = self.settings.checkpoint_dir
        if directory is None:
            return
        self._failed_copies = collections.deque(maxlen=8)
        try:
            cdir = checkpoints.CheckpointDir.open(directory)
        except checkpoints.CheckpointError as exc:
            raise JobFailed(checkpoints.refused(directory, exc), 2) from None
        self._checkpoints = cdir
        try:
            cdir.lock(self.job_id)
            cdir.key()
        except checkpoints.DirectoryInUse as exc:
            raise JobFailed(f"--checkpoint-dir {exc}: one directory serves one job; wait for that job to end, or "
                            f"use another directory", 2) from None
        except checkpoints.UntrustedDirectory as exc:
            raise JobFailed(f"--checkpoint-dir {directory}: {exc}; remove it if it is not yours, or use another "
                            f"directory", 2) from None
        except checkpoints.CheckpointError as exc:
            raise JobFailed(f"--checkpoint-dir {directory}: {exc}", 2) from None
        cdir.clean_stale()
        self._lineage = uuid.uuid4().hex[:16]
        if self.settings.fresh:
            kept = cdir.numbers()
            if kept:
                log.info("--fresh: starting from the script's own state; the %d copies already in %s are kept "
                         "(remove them when you no longer need them)", len(kept), directory)
            return
        scan = cdir.scan()
        if scan.blocked is not None:
            name, why = scan.blocked
            raise JobFailed(f"cannot resume: {os.path.join(directory, name)} cannot be read now ({why}); nothing "
                            f"was started, moved or deleted. Make it readable (permissions, the disk), or run the "
                            f"elasticrun that wrote it; --fresh starts over from the script's own state instead "
                            f"(the copies stay).")
        if scan.newest is None and scan.unusable:
            lines = "\n".join(f"  {name}: {why}" for name, why in scan.unusable)
            raise JobFailed(f"cannot resume: no durable copy in {directory} is usable:\n{lines}\nNothing was "
                            f"started and nothing was deleted. To start over from the script's own state, run the "
                            f"same command with --fresh (these copies stay where they are); or point "
                            f"--checkpoint-dir elsewhere.")
        for name, why in scan.unusable:
            aside = cdir.move_aside(name)
            log.warning("checkpoint %s is unusable (%s); moved aside to %s, trying an older one",
                        os.path.join(directory, name), why, aside)
        found = scan.newest
        if found is not None:
            self._resume_from = found
            self._lineage = found.manifest.lineage
            self.registry.durable(found.manifest.commit)
            log.info("%s holds a durable copy of commit %d (%s): the job resumes from it (--fresh starts over)",
                     directory, found.manifest.commit, _when(found.manifest.saved_at))

    def _close_checkpoints(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()  # releases the lock

    def _start_durable(self, ctx: zmq.Context) -> DurableService | None:
        """Serve the durable copies of the directory opened by :meth:`_open_checkpoints`."""
        if self._checkpoints is None:
            return None
        service = DurableService(ctx, self._keys, self.job_id, self._checkpoints, lineage=self._lineage,
                                 on_written=lambda d, seconds: self._post("durable_written", (d, seconds)),
                                 on_failed=lambda began, line: self._post("durable_failed", (began, line)),
                                 newest=self._resume_from,
                                 stale_after=max(60.0, 2 * self.settings.checkpoint_interval))
        service.endpoint(zmq_endpoint(self._endpoints.address()))
        service.start()
        self._copies = CopySchedule(self.settings.checkpoint_interval)
        return service

    def _ask_for_copy(self, now: float, force: bool = False) -> int | None:
        """Every --checkpoint-interval while a round trains, ask the workers for a durable copy:
        at their next commit they agree to hand it off (see worker/durable.py). While every
        holder of the state is leaving with nobody to hand it to, one after another."""
        c = self._copies
        training = self.registry.round >= 0 and not self.registry.aborted
        request = c.ask(now, training, force, urgent=self.registry.handover_pending) if c is not None else None
        if request is not None:
            self._publish("durable_request", {"id": request})
        return request

    def _progress(self, steps: int | None, commit: int | None) -> None:
        """Workers report their steps and commits: how far a resume from disk goes back."""
        if steps is None or commit is None:
            return
        if self._progress_seen.report(steps, commit, time.monotonic(), time.time(), self._checkpoints is not None):
            self._save_progress()

    def _save_progress(self) -> None:
        """The furthest progress heard, on disk (at most every PROGRESS_EVERY s while training,
        and once more as the driver stops, so that a resume's "N steps back" counts the last
        seconds too)."""
        if self._checkpoints is None or not self._progress_seen.steps:
            return
        p = self._progress_seen
        try:
            self._checkpoints.save_progress(p.steps, p.commit, p.at)
        except OSError as exc:  # a diagnostic: it only shortens "N steps back" after a resume
            self._limited.warn("diagnostic writes", f"cannot write {self._checkpoints.path}/progress.json: "
                               f"{exc.strerror or exc}; training goes on", "progress file")

    def _say_resumed(self, round_: int) -> None:
        durable = self._durable.newest if self._durable is not None else None
        if durable is None or self._checkpoints is None:
            return
        m = durable.manifest
        steps, _, at = self._checkpoints.load_progress()
        latest, latest_at = max((self._progress_seen.steps, self._progress_seen.at), (steps, at))
        back = max(0, latest - m.steps)
        # Steps lost also as time: a step count alone says nothing of what was redone.
        # A lower bound: the driver hears of steps with heartbeats, and writes them down at most
        # every PROGRESS_EVERY s; what the workers trained after that is redone uncounted.
        lost = f" (at least {latest_at - m.saved_at:.1f} s of training)" if back and latest_at > m.saved_at else ""
        # (0: no later step was heard of, and any trained after it are redone: no count to give)
        behind = f"at least {back} steps back" if back else "no later step known to the driver"
        log.warning("resumed from checkpoint of %s, %s%s (commit %d, %s)", _when(m.saved_at), behind,
                    lost, m.commit, durable.path)
        self._journal.write(Kind.RESUMED, round=round_, checkpoint=durable.path, commit=m.commit,
                            saved_at=m.saved_at, steps_back=back)

    def _copy_held(self) -> str:
        """What the directory holds now, for the lines of a stop."""
        durable = self._durable.newest if self._durable is not None else None
        if durable is None:
            return f"{self.settings.checkpoint_dir} holds no durable copy of this job"
        m = durable.manifest
        newest = self._progress_seen.commit
        behind = f"; the workers had reached commit {newest}" if newest > m.commit else ""
        if self._checkpoints is not None and self._checkpoints.moved():
            return (f"the newest durable copy (commit {m.commit}, {_when(m.saved_at)}) is in the directory that was "
                    f"{self.settings.checkpoint_dir}, which was moved or deleted while the job ran: a rerun of this "
                    f"command will not find it{behind}")
        return f"the newest durable copy is {durable.path} (commit {m.commit}, {_when(m.saved_at)}){behind}"

    def _final_copy(self, signum: int) -> reg.Finish | None:
        """Stopped by a signal: a last durable copy of the newest commit first, so that a
        resumed job redoes nothing. Bounded by FINAL_COPY_LIMIT whatever happens (no commit
        comes, the disk is full, the service is broken), and skipped by a second signal.
        Returns how the job ended if it ended meanwhile (every worker finished, or failed):
        that is then the job's outcome, said as such."""
        name = signal.Signals(signum).name
        if self._durable is None or self.registry.round < 0 or not self.registry.live():
            return None
        service = self._durable
        before = service.newest
        base = before.manifest.commit if before is not None else 0
        if not service.is_alive():
            log.warning("received %s: no last durable copy (the durable-copy service has stopped)", name)
            return None
        asked = time.monotonic()
        request = self._ask_for_copy(asked, force=True)
        if request is None:
            log.warning("received %s: no last durable copy (the round is being re-formed)", name)
            return None
        ends = FINAL_COPY_LIMIT + self.settings.stop_grace + STOP_MARGIN
        log.warning("received %s: writing a last durable copy before stopping (at most %.0f s; again to skip); "
                    "the job ends within %.0f s", name, FINAL_COPY_LIMIT, ends)
        why: list[str] = []

        def fresh() -> bool:
            # A copy begun before the signal that lands meanwhile is of an older commit: the
            # promise is the newest commit's (a resume then redoes nothing committed).
            return service.newest is not before and service.newest_began >= asked

        def settled() -> bool:
            # A copy begun after the request (so of the newest commit) that failed says why.
            failed = [line for began, line in self._failed_copies if began >= asked]
            landed = service.newest
            verdict = final_copy_verdict(FinalCopy(
                written=fresh(),
                failure=failed[-1] if failed else None,
                service_alive=service.is_alive(), workers_alive=bool(self.registry.live()),
                waited=time.monotonic() - asked, newest_commit=self._progress_seen.commit,
                base_commit=landed.manifest.commit if landed is not None else base),
                COMMIT_NEWS)
            if verdict:
                why.append(verdict)
            return verdict is not None

        ended = self._loop(until=settled, stop_at=asked + FINAL_COPY_LIMIT)
        if ended is None and not self.registry.live():
            # The last exits were recorded but not yet decided on (decisions are batched): how
            # the job ended is the registry's to say, now.
            self._execute(self.registry.decide(time.monotonic()))
            ended = self.registry.finished
        if fresh():
            return ended
        if ended is not None:
            why[:] = ["the job ended first"]
        if not why:
            why.append("a second signal skipped it" if self._hurry
                       else f"it was not written within {FINAL_COPY_LIMIT:.0f} s")
        log.warning("no last durable copy: %s", why[0])
        return ended

    def _say_copy_kept(self) -> None:
        if self._durable is not None:
            log.warning("stopped: %s", self._copy_held())

    # --- the status line ---------------------------------------------------------------------
    _status_due: float | None = None  # when the next status line is due (None: --status-interval 0)
    _status_last: tuple[float, int] | None = None  # (when, steps) at the last status line

    def _status(self, now: float) -> None:
        """Every --status-interval while a round trains (or resets: then since when): one line
        saying the job is alive and how it goes, so that a quiet job is not a silent one."""
        self._status_due = now + self.settings.status_interval
        r = self.registry
        if r.round < 0 or r.finished is not None or r.aborted:
            return  # no round trains: the waits say what they wait for, every 30 s
        members = r.final_round()
        if not any(w.state is reg.WorkerState.RUNNING for w in members):
            return  # (every member gone: a line with their count would contradict "every worker is gone")
        hosts = len({w.host for w in members})
        steps = self._progress_seen.steps
        pace = ""
        if self._status_last is not None and now > self._status_last[0] and steps >= self._status_last[1]:
            pace = f", {(steps - self._status_last[1]) / (now - self._status_last[0]):.1f} steps/s"
        self._status_last = (now, steps)
        commit_at = self._progress_seen.commit_at
        commit = (f", last commit {now - commit_at:.0f} s ago" if commit_at is not None
                  else ", no commit yet")
        durable = self._durable.newest if self._durable is not None else None
        copy = "" if self._durable is None else (
            f", durable copy {time.time() - durable.manifest.saved_at:.0f} s old" if durable is not None
            else ", no durable copy yet")
        coming = ", ".join(f"+{n} {what}" for n, what in ((r.starting(), "starting"), (r.joining(), "joining")) if n)
        coming = f" ({coming})" if coming else ""
        since = self._resets.open_since()
        if since is not None:  # the round formed and has not trained yet (a sync, reset callbacks)
            self._status_last = None  # (its pace starts again with training)
            log.info("status: round %d, %d worker(s) on %d host(s)%s, resetting for %.0f s (not training yet), at "
                     "step %d, %d reset(s)%s%s", r.round, len(members), hosts, coming, max(0.0, time.time() - since),
                     steps, r.reset_count, commit, copy)
            return
        log.info("status: round %d, %d worker(s) on %d host(s)%s, step %d%s, %d reset(s)%s%s%s%s", r.round,
                 len(members), hosts, coming, steps, pace, r.reset_count, commit, copy,
                 words.kept(r.kept, r.config.min_np), words.held_out(r.held_out(), r.kept))

    # --- the end -----------------------------------------------------------------------------
    def _conclude(self, finished: reg.Finish) -> int:
        if finished.ok:
            # Stragglers (dismissed workers still exiting) get the grace period, then are stopped.
            self._wait_for_exits(self.settings.stop_grace)
        elif self.registry.plain:
            # The others were stopped as the first failure ended the job: one that failed on its
            # own at the same moment is named with it (the registry updates the job's reason).
            self._wait_for_exits(min(1.0, self.settings.stop_grace))
            finished = self.registry.finished or finished
        self._shutdown()
        elapsed = time.monotonic() - self._started
        self._summarize()
        self._journal.close()
        why = words.reason(finished.why)
        if finished.ok:
            if finished.complete:
                log.info("job succeeded in %.1f s: %s", elapsed, why)
            else:
                log.warning("job ended in %.1f s: %s", elapsed, why)
            return 0
        raise JobFailed(f"The job failed after {elapsed:.1f} s: {why}.")

    def _summarize(self) -> None:
        """The exit summary, once, however the job ends (success, failure or signal); counts
        of suppressed log lines come first, so none is lost."""
        if not self._summarized:
            self._summarized = True
            self._limited.flush(force=True)
            r = self.registry
            if r.plain:  # no rounds, resets or blacklisting: processes, as horovodrun runs them
                failed = sum(1 for w in r.workers.values() if w.state is reg.WorkerState.FAILED)
                log.info("summary: %d process(es) that never called hvd.init(), %d failed", len(r.workers), failed)
            else:
                blocked = r.hosts.blocked()
                # A reset still open when a job that did not succeed ended (it timed out waiting
                # for workers, or was stopped) counts, and so does its time: it was all recovery.
                ended_ok = r.finished is not None and r.finished.ok
                log.info("summary: %s", self._resets.summary(
                    blocked, [h for h in r.hosts.blacklisted() if h not in blocked],
                    end=None if ended_ok else time.time()))

    def _wait_for_exits(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.registry.live() and time.monotonic() < deadline:
            try:
                kind, payload = self._events.get(timeout=0.05)
            except queue.Empty:
                continue
            if kind == "exit":
                # After the end, decisions are only replies and log lines: still carry them out.
                worker_id, code, *detail = payload
                self.registry.exited(worker_id, code, time.monotonic(), *detail)
                self._execute(self.registry.decide(time.monotonic()))

    def _shutdown(self) -> None:
        self._save_progress()
        self._stop_discovery.set()
        self.source.close()
        try:  # workers take a SIGTERM for a reclaim warning unless told it is the job ending
            self._publish("stopping", {})
            time.sleep(0.05)
        except (AttributeError, zmq.ZMQError):
            pass  # the sockets never opened
        self._launcher.stop_all(self.settings.stop_grace)
        self._launcher.drain(2.0)
