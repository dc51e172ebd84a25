"""The worker's connections to the driver (no torch here).

* :class:`DriverClient`: request/reply over a DEALER socket (rendezvous, store operations).
  Every wait is bounded and can be cut short by an abort check, so a worker never blocks on
  a driver or a round that is gone.
* :class:`ControlChannel`: a daemon thread that sends heartbeats and receives, on the same
  connection, their replies and the driver's notifications. The heartbeat replies repeat the
  latest notifications, so an update the driver sent before it knew this connection (it learns
  it from the first heartbeat) or dropped (a full queue) still arrives within one interval;
  and a driver that stops answering is noticed, so workers never outlive a dead driver.
  One connection for both, not a SUB socket besides: each connection costs the driver a CURVE
  handshake, which is what a driver of thousands spends its first seconds on.

Every socket is a CURVE client of the job (``elasticrun.common.auth``) with the keys the
launcher handed over through a pipe (:func:`job_keys`), and refuses frames over the protocol's
size limit.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

import zmq

from elasticrun.common import secretpipe
from elasticrun.common.auth import WorkerKeys, secure_client
from elasticrun.common.protocol import MAX_FRAME_BYTES, Codec, Message, ProtocolError, new_sender_id
from elasticrun.common.ratelimit import LimitedLog

log = logging.getLogger("elasticrun.worker")

_keys: WorkerKeys | None = None
_keys_lock = threading.Lock()


def job_keys() -> WorkerKeys:
    """This worker's keys: read from the launcher's pipe on first use, then kept in memory.

    The pipe can be read once per process; the runtime and ``elasticrun.worker.entry`` both
    come here. Raises ``secretpipe.SecretUnavailable`` or ``auth.BadKeys`` with the reason.
    """
    global _keys
    with _keys_lock:
        if _keys is None:
            _keys = WorkerKeys.decode(secretpipe.receive())
        return _keys


def loaded_keys() -> WorkerKeys | None:
    """The keys :func:`job_keys` read, if it has (None in a process that is in no job)."""
    return _keys


class DriverTimeout(RuntimeError):
    """The driver did not answer in time."""


class Aborted(RuntimeError):
    """A wait was abandoned because the round it belonged to was aborted."""


def _socket(ctx: zmq.Context, kind: int, addr: str, keys: WorkerKeys) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, keys, MAX_FRAME_BYTES)
    sock.connect(addr)
    return sock


class DriverClient:
    """Thread-safe request/reply with the driver over one DEALER socket."""

    def __init__(self, ctx: zmq.Context, addr: str, keys: WorkerKeys, job_id: str, name: str):
        self._codec = Codec(keys.secret, job_id, new_sender_id(name))
        self._sock = _socket(ctx, zmq.DEALER, addr, keys)
        self._lock = threading.Lock()
        self._req = itertools.count(1)
        self._dropped = LimitedLog(log)  # refused frames: a few lines and counts, not one line each

    def request(self, type_: str, body: dict[str, Any], timeout: float, what: str,
                abort: Callable[[], str | None] | None = None) -> Message:
        """Send a request and wait for its reply (at most ``timeout`` s, or until ``abort`` says why)."""
        with self._lock:
            req = next(self._req)
            deadline = time.monotonic() + timeout
            # A DEALER blocks on send while it has no connection (the driver is gone or not
            # up yet): bound that wait like every other.
            self._sock.setsockopt(zmq.SNDTIMEO, max(1, int(timeout * 1000)))
            try:
                self._sock.send(self._codec.encode(type_, dict(body, req=req)))
            except zmq.Again:
                raise DriverTimeout(f"could not send {what} to the driver within {timeout:g} s") from None
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DriverTimeout(f"the driver did not answer {what} within {timeout:g} s")
                # Short polls only bound how fast an abort is seen; a reply wakes us at once.
                if self._sock.poll(int(min(remaining, 0.05) * 1000) + 1):
                    try:
                        msg = self._codec.decode(self._sock.recv())
                    except ProtocolError as exc:
                        self._dropped.warn("dropped control frames", f"dropped a control frame: {exc}", exc.reason)
                        continue
                    finally:
                        self._dropped.flush()
                    if msg.body.get("re") == req:
                        return msg
                    continue  # a late reply to an earlier, abandoned request
                if abort is not None:
                    reason = abort()
                    if reason:
                        raise Aborted(reason)

    def close(self) -> None:
        with self._lock:
            self._sock.close(0)
        self._dropped.flush(force=True)


#: A gap this long between two turns of the control loop (which turns at least every 0.1 s)
#: means this process did not run, and says nothing of the driver.
_STALLED_S = 1.0


class ControlChannel(threading.Thread):
    """Sends heartbeats and receives their replies and the driver's notifications, on a daemon thread.

    ``on_message`` gets every authenticated notification and heartbeat reply;
    ``on_driver_lost`` is called once if the driver stays silent for ``driver_timeout``.
    """

    def __init__(self, ctx: zmq.Context, control_addr: str, keys: WorkerKeys, job_id: str,
                 heartbeat_body: Callable[[], dict[str, Any]], on_message: Callable[[Message], None],
                 on_driver_lost: Callable[[float], None], interval: float, driver_timeout: float,
                 take_events: Callable[[], list[dict[str, Any]]] = list,
                 driver_stopped: Callable[[], bool] = lambda: False):
        super().__init__(name="elasticrun-control", daemon=True)
        self._hb = _socket(ctx, zmq.DEALER, control_addr, keys)
        self._hb_codec = Codec(keys.secret, job_id, new_sender_id("hb"))
        self._heartbeat_body = heartbeat_body
        self._on_message = on_message
        self._on_driver_lost = on_driver_lost
        self._take_events = take_events
        self._interval = interval
        self._driver_timeout = driver_timeout
        self._driver_stopped = driver_stopped
        self._stopping = threading.Event()
        self._bye: str | None = None
        self._dropped = LimitedLog(log)
        # Messages to send at once (post): a pipe wakes the loop, even from a signal handler.
        self._outbox: collections.deque[tuple[str, dict[str, Any]]] = collections.deque(maxlen=64)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)

    def stop(self, bye: str | None = None) -> None:
        """End the loop; its last heartbeat says ``bye`` ("exit": the script ended, the process
        is ending; "shutdown": hvd.shutdown(), the process goes on without the job), so that
        the driver does not take the silence that follows for a hang."""
        self._bye = bye
        self._stopping.set()

    def post(self, type_: str, body: dict[str, Any]) -> None:
        """Send a message to the driver from this thread, now (safe in a signal handler:
        only a deque append and a non-blocking write)."""
        self._outbox.append((type_, body))
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full (the loop is awake) or closed (the worker is stopping)

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._hb, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        last_answer = last_turn = time.monotonic()
        next_beat = 0.0
        waiting = False  # said that a silent driver is stopped, and waited for
        try:
            while not self._stopping.is_set():
                now = time.monotonic()
                if now - last_turn > _STALLED_S:
                    # This thread did not run (the whole job was stopped, as a batch system's
                    # suspend does, or this process starved): not the driver's silence.
                    last_answer += now - last_turn
                last_turn = now
                if now >= next_beat:
                    try:  # never block here: this thread must notice a silent driver
                        self._hb.send(self._hb_codec.encode("heartbeat", self._heartbeat_body()), zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                    next_beat = now + self._interval
                if now - last_answer > self._driver_timeout:
                    if not self._driver_stopped():
                        self._on_driver_lost(now - last_answer)
                        return
                    if not waiting:
                        waiting = True
                        log.warning("the driver has not answered for %.0f s, but its process is still here (stopped: "
                                    "SIGSTOP or Ctrl-Z? `kill -CONT` it): waiting for it", now - last_answer)
                    # Seen stopped just now: once it runs again it has the whole timeout to answer
                    # (its backlog first); still stopped then, it is looked at again.
                    last_answer = now
                self._ship_events()
                events = dict(poller.poll(int(max(0.0, min(next_beat - now, 0.1)) * 1000) + 1))
                if self._wake_r in events:
                    os.read(self._wake_r, 4096)
                while self._outbox:
                    type_, body = self._outbox.popleft()
                    try:
                        self._hb.send(self._hb_codec.encode(type_, body), zmq.NOBLOCK)
                    except zmq.Again:
                        self._outbox.appendleft((type_, body))
                        break
                if self._hb in events:
                    for _ in range(100):  # what is there (a burst of notifications), then the clock again
                        try:
                            frame = self._hb.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            msg = self._hb_codec.decode(frame)
                        except ProtocolError as exc:
                            self._dropped.warn("dropped control frames", f"dropped a control frame: {exc}",
                                               exc.reason)
                            continue
                        last_answer = time.monotonic()  # a notification, too, is a driver alive
                        if waiting:
                            log.warning("the driver answers again")
                            waiting = False
                        self._on_message(msg)
                self._dropped.flush()
        finally:
            self._dropped.flush(force=True)
            # What the worker did last (its final step count, the events of a clean exit): given
            # a moment to leave (LINGER), so that the driver can say how far a rank got.
            self._hb.setsockopt(zmq.LINGER, 200)
            body = self._heartbeat_body()
            if self._bye is not None:
                body["bye"] = self._bye
            try:
                self._hb.send(self._hb_codec.encode("heartbeat", body), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._ship_events()
            self._hb.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _ship_events(self) -> None:
        """Send queued events to the driver's event log (best effort, never blocking)."""
        while True:
            batch = self._take_events()
            if not batch:
                return
            try:
                self._hb.send(self._hb_codec.encode("events", {"events": batch}), zmq.NOBLOCK)
            except zmq.Again:
                return
