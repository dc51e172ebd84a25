"""A newcomer fetches the committed model from rank 0 while the survivors train.

Without this, a worker that joins a running job receives the whole state in the ``sync()``
of the reset that admits it, and every survivor waits for that broadcast: with a 1 GiB
model, half a second of the whole job's time per join on loopback, seconds over a network.

With it, the newcomer's first ``sync()``, before it asks the driver for its place:

1. asks for the committed model through the driver's store (``req/N`` under :data:`KEY`);
2. rank 0 (a :class:`Server` thread, started by its ``TorchState``) answers with the
   layout of its committed host-memory tensors and starts a :class:`~copier.Watch` on
   them: from then on each of its commits compares a tensor with its committed copy
   before overwriting it, and names it if it differs;
3. the newcomer says which of them it can place (same name, shape and dtype, contiguous
   host tensors), and a two-rank gloo group of their own carries them from rank 0's
   committed copies straight into the newcomer's live tensors, on rank 0's side from a
   thread: the survivors train on;
4. the newcomer commits what arrived and only then asks for its place.

In the sync of the reset that admits it, rank 0 names the tensors no commit has written
since the watch began: their committed bytes are the ones the newcomer read. If every
rank can do without them (the newcomer fetched under this very watch; every survivor
holds the newest commit, so its live tensors equal rank 0's), the sync skips them: the
survivors' stall then grows with what changed since the fetch (the trained parameters),
not with the model (frozen weights, embeddings nobody trains, large buffers). Otherwise
(another root, a second reset, a model of another shape) the sync sends everything, as
without a fetch. The survivors pay for it with commits that compare before they copy
while a fetch is under way (0.95-1.03x a plain commit: ``copier.WatchedPlan``).

What it does not do: catch a newcomer up on parameters that train. Those still travel in
the join's sync; taking them off the survivors' clock too needs the newcomer to replay the
optimizer steps since its fetch, exactly, which this module does not attempt. GPU tensors
are not fetched (NCCL carries them in the sync at device speed).

``ELASTICRUN_PREFETCH=0`` turns it off.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import threading
import time
import weakref
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import zmq

from elasticrun.common import env, settings
from elasticrun.common.events import Kind
from elasticrun.worker import collectives, issuing, rounds
from elasticrun.worker.client import Aborted, DriverClient, DriverTimeout, job_keys
from elasticrun.worker.store import DriverStore

if TYPE_CHECKING:
    from elasticrun.worker.state_handlers import ModelStateHandler

__all__ = ["KEY", "Server", "agree", "enabled", "fetch", "serve", "stop"]

log = logging.getLogger("elasticrun.worker")

#: The store's namespace for fetches. Outside every round's, so the driver forgets it at
#: each new round: a fetch that spans one fails (and the join sends everything).
KEY = "elasticrun/prefetch"
_REQUEST_WAIT_S = 1.0  # rank 0's wait for the next fetch request (then it looks again)
#: How long rank 0 leaves the driver alone after it forgot the namespace (a new round forms):
#: a reset takes milliseconds; a fetch asked meanwhile is answered this much later.
_AFTER_FORGET_S = 0.05
MAX_SESSIONS = 4  # fetches rank 0 serves at once; more are told to go without
LAYOUT_WAIT_S = 5.0  # a newcomer's wait for rank 0's answer (it arrives in milliseconds)
GO_WAIT_S = 10.0  # rank 0's wait for the newcomer's choice
#: A model whose host tensors are smaller is not fetched: the join's sync sends it in about a
#: millisecond, less than a fetch's own cost (a connection and a group: some 40 ms of the
#: newcomer's time).
FETCH_MIN_BYTES = 4 << 20
LAYOUT_MAX_CHARS = 600_000  # a layout this long (some 8,000 tensors) is not offered: frames are 1 MiB
_ID = re.compile(r"[A-Za-z0-9_.:@-]{1,80}")

Fetched = dict[str, tuple[int, frozenset[str]]]  # model attribute -> (watch epoch, names received)


def enabled() -> bool:
    return (env.CONTROL_ADDR in os.environ
            and os.environ.get(env.PREFETCH, "1").strip().lower() not in ("0", "false", "no", "off"))


def _timeout() -> float:
    try:
        return min(600.0, max(60.0, float(os.environ.get(env.COLLECTIVE_TIMEOUT, settings.DEFAULT_COLLECTIVE_TIMEOUT))))
    except ValueError:
        return 60.0


class _Conn:
    """A connection of its own to the driver's store (a thread's blocking waits must not
    hold the training thread's socket), closed with its context."""

    def __init__(self, name: str, abort: Callable[[], str | None]) -> None:
        self.ctx = zmq.Context()
        try:
            self.client = DriverClient(self.ctx, os.environ[env.CONTROL_ADDR], job_keys(), os.environ[env.JOB_ID], name)
        except BaseException:
            self.ctx.destroy(linger=0)
            raise
        self.store = DriverStore(self.client, _timeout(), abort)

    def read(self, key: str, seconds: float) -> Any:
        """The JSON value of ``key`` once it is set (at most ``seconds``)."""
        self.store.wait([key], timedelta(seconds=seconds))
        return json.loads(self.store.get(key).decode())

    def group(self, who: str, rank: int) -> Any:  # a ProcessGroupGloo (its stubs lack send/recv)
        return dist.ProcessGroupGloo(dist.PrefixStore(f"{KEY}/pg/{who}", self.store), rank, 2,
                                     timedelta(seconds=_timeout()))

    def close(self) -> None:
        self.client.close()
        self.ctx.term()


# --- rank 0 ------------------------------------------------------------------------------------

def _models(state: Any) -> dict[str, ModelStateHandler]:
    from elasticrun.worker.state_handlers import ModelStateHandler
    return {k: h for k, h in sorted(state._handlers.items()) if isinstance(h, ModelStateHandler)}


class Server(threading.Thread):
    """Rank 0's side: answers fetch requests while this worker is rank 0 of its round."""

    def __init__(self, state: Any) -> None:
        super().__init__(name="elasticrun-prefetch", daemon=True)
        self.state: Callable[[], Any] = weakref.ref(state)
        self._halt = threading.Event()
        self._sessions: list[threading.Thread] = []

    def stop(self) -> None:
        self._halt.set()

    def _stopping(self) -> str | None:
        return "stopping" if self._halt.is_set() else None

    def run(self) -> None:
        conn: _Conn | None = None
        following = 1  # the next request number
        round_ = -1
        try:
            while not self._halt.is_set():
                r = rounds.installed()
                if r is None or r.rank != 0 or self.state() is None:
                    self._halt.wait(0.5)
                    continue
                if r.number != round_:  # a new round: the driver forgot the namespace, requests count from 1
                    round_, following = r.number, 1
                if conn is None:
                    conn = _Conn("prefetch", self._stopping)
                key = f"{KEY}/req/{following}"
                asked = time.monotonic()
                try:
                    conn.store.wait([key], timedelta(seconds=_REQUEST_WAIT_S))
                    raw = conn.store.get(key)
                except (RuntimeError, DriverTimeout, Aborted):  # none yet, or the namespace was forgotten
                    if time.monotonic() - asked < _REQUEST_WAIT_S / 2:
                        # Forgotten: a new round is forming. Its reset is on the job's critical
                        # path (this rank and the driver answer its requests): ask again after it.
                        self._halt.wait(_AFTER_FORGET_S)
                    try:
                        if conn.store.add(f"{KEY}/bell", 0) < following - 1:
                            following = 1  # forgotten (a new round): requests count from 1 again
                    except (RuntimeError, DriverTimeout, Aborted):
                        self._halt.wait(0.1)
                    continue
                following += 1
                try:
                    who = json.loads(raw.decode())
                except ValueError:
                    continue
                if isinstance(who, str) and _ID.fullmatch(who):
                    self._start_session(conn, who)
        except Exception as exc:  # never take training down: newcomers then join with a full sync
            log.warning("rank 0 stopped serving newcomers' fetches of the committed model: %s", exc)
        finally:
            if conn is not None:
                conn.close()

    def _start_session(self, conn: _Conn, who: str) -> None:
        self._sessions = [s for s in self._sessions if s.is_alive()]
        if len(self._sessions) >= MAX_SESSIONS:
            try:
                conn.store.set(f"{KEY}/layout/{who}", json.dumps({"busy": True}))
            except (RuntimeError, DriverTimeout, Aborted):
                pass
            return
        s = threading.Thread(target=self._session, args=(who,), name="elasticrun-prefetch-send", daemon=True)
        self._sessions.append(s)
        s.start()

    def _session(self, who: str) -> None:
        state = self.state()
        if state is None:
            return
        conn: _Conn | None = None
        try:
            conn = _Conn("prefetch-send", self._stopping)
            epoch = random.getrandbits(62) + 1
            layout: dict[str, Any] = {}
            sources: list[torch.Tensor] = []
            for attr, h in _models(state).items():
                e, tensors = h.watch(epoch)
                layout[attr] = {"epoch": e, "tensors": [[n, list(t.shape), str(t.dtype)] for n, t in tensors]}
                sources.extend(t for _, t in tensors)
            del state
            answer = json.dumps({"models": layout})
            if len(answer) > LAYOUT_MAX_CHARS:  # past what one store value carries: say no at once
                answer = json.dumps({"models": {}})
            conn.store.set(f"{KEY}/layout/{who}", answer)
            take = conn.read(f"{KEY}/go/{who}", GO_WAIT_S)
            if not (isinstance(take, list) and take and all(type(i) is int for i in take)
                    and take == sorted(set(take)) and 0 <= take[0] and take[-1] < len(sources)):
                return  # nothing wanted (or not a list of offered tensors)
            start = time.monotonic()
            pg = conn.group(who, 0)
            nbytes = 0
            for tag, i in enumerate(take):
                t = sources[i]
                pg.send([t], 1, tag).wait()
                nbytes += t.numel() * t.element_size()
            del pg
            log.info("rank 0: sent %.1f MB of the committed model to newcomer %s in %.2f s, beside training",
                     nbytes / 1e6, who, time.monotonic() - start)
        except Exception as exc:
            log.info("rank 0: newcomer %s did not fetch the committed model (%s); it joins with a full sync",
                     who, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        finally:
            if conn is not None:
                conn.close()


_server: Server | None = None
_server_lock = threading.Lock()


def serve(state: Any) -> None:
    """Start answering newcomers' fetches from this process, for ``state`` (idempotent; the
    thread serves only while this worker is rank 0)."""
    global _server
    if not enabled():
        return
    with _server_lock:
        if _server is not None and _server.is_alive() and _server.state() is state:
            return
        if _server is not None:
            _server.stop()
        _server = Server(state)
        _server.start()


#: How long shutdown waits for sends under way to a newcomer.
SEND_SETTLE_S = 5.0


def stop() -> None:
    """Stop serving (at shutdown), and wait (at most :data:`SEND_SETTLE_S`) for the sends under
    way: a send's thread waits inside gloo with the GIL given up, and one that came back while
    the interpreter finalizes would end the process with "terminate called without an active
    exception" (exit -6), even a worker that was leaving cleanly. A send to a live newcomer
    ends in about the time the model takes to cross the network; to a dead one, at once."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.stop()
            _server.join(timeout=2.0)
            deadline = time.monotonic() + SEND_SETTLE_S
            for session in list(_server._sessions):
                session.join(max(0.0, deadline - time.monotonic()))
            _server = None


# --- the newcomer ------------------------------------------------------------------------------

def fetch(state: Any, worker_id: str, emit: Callable[..., None]) -> Fetched | None:
    """The newcomer's side, before it asks for its place: receive rank 0's committed host
    tensors into the live model, commit them, and say what arrived under which watch
    (``emit``: the runtime's event recorder). None if nothing was fetched (the join's sync
    then sends everything)."""
    models = _models(state)
    if not enabled() or not models or not _ID.fullmatch(worker_id):
        return None
    here = sum(t.numel() * t.element_size() for h in models.values() for t in h.value.state_dict().values()
               if isinstance(t, torch.Tensor) and t.device.type == "cpu")
    if here < FETCH_MIN_BYTES:
        return None
    start = time.monotonic()
    conn: _Conn | None = None
    try:
        conn = _Conn("prefetch-fetch", lambda: None)
        n = conn.store.add(f"{KEY}/bell", 1)
        conn.store.set(f"{KEY}/req/{n}", json.dumps(worker_id))
        answer = conn.read(f"{KEY}/layout/{worker_id}", LAYOUT_WAIT_S)
        offered = answer.get("models") if isinstance(answer, dict) else None
        take: list[int] = []
        targets: list[torch.Tensor] = []
        received: dict[str, tuple[int, list[str]]] = {}
        index = 0
        for attr, offer in (offered or {}).items():
            h = models.get(attr)
            live = h.value.state_dict(keep_vars=True) if h is not None else {}
            for name, shape, dtype in offer["tensors"]:
                t = live.get(name)
                if (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.is_contiguous()
                        and list(t.shape) == list(shape) and str(t.dtype) == dtype and t.numel() > 0):
                    take.append(index)
                    targets.append(t.detach())
                    received.setdefault(attr, (int(offer["epoch"]), []))[1].append(name)
                index += 1
        conn.store.set(f"{KEY}/go/{worker_id}", json.dumps(take))
        if not take:
            return None
        pg = conn.group(worker_id, 1)
        with torch.no_grad():
            for tag, t in enumerate(targets):
                pg.recv([t], 0, tag).wait()
        del pg
        for attr in received:
            models[attr].save()  # what arrived is committed here now: the join copies only what changed
        nbytes = sum(t.numel() * t.element_size() for t in targets)
        emit(Kind.STATE_FETCHED, ms=round((time.monotonic() - start) * 1000, 2), bytes=nbytes)
        log.info("fetched %.1f MB of the committed model from rank 0 in %.2f s, before asking for a place",
                 nbytes / 1e6, time.monotonic() - start)
        return {attr: (epoch, frozenset(names)) for attr, (epoch, names) in received.items()}
    except Exception as exc:  # a fetch only saves the survivors time: whatever fails, the sync sends it all
        log.info("no fetch of the committed model before joining (%s): the join's sync sends it all",
                 str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return None
    finally:
        if conn is not None:
            conn.close()


# --- the join's sync ---------------------------------------------------------------------------

def agree(state: Any, root: int, fetched: Fetched | None, holds_newest: bool) -> dict[str, frozenset[str]]:
    """Collective, in the sync of a reset where some rank fetched: which tensors of which
    model the sync may skip ({} for none). ``holds_newest``: this rank's live state is the
    newest commit (it held it before the sync)."""
    models = _models(state)
    r = rounds.current()
    offer: dict[str, tuple[int, list[str]]] = {}
    if r.rank == root:
        for attr, h in models.items():
            watch = h.end_watch()
            if watch is not None:
                offer[attr] = (watch.epoch, watch.unchanged(watch.names))
    else:
        for h in models.values():
            h.end_watch()
    offer = _offer_from(_broadcast_json(offer if r.rank == root else None, root))
    if r.rank == root:
        ok = True
    elif fetched is None:
        ok = holds_newest
    else:  # fetched under the root's own watch (a root that served nobody offers nothing)
        ok = bool(offer) and all(attr in fetched and fetched[attr][0] == epoch and set(names) <= fetched[attr][1]
                                 for attr, (epoch, names) in offer.items())
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    collectives.allreduce_inplace(flag, dist.ReduceOp.MIN, "state.prefetch_agreed")
    keep = {attr: frozenset(names) for attr, (_, names) in offer.items() if names} if int(flag.item()) else {}
    live = {attr: h.value.state_dict() for attr, h in models.items()}
    kept = sum(_nbytes(live[a][n]) for a, names in keep.items() for n in names if a in live and n in live[a])
    state.__dict__["_skipped_bytes"] = kept  # for the sync's event
    if fetched is not None:
        fetched_bytes = sum(_nbytes(live[a][n]) for a, (_, names) in fetched.items() for n in names
                            if a in live and n in live[a])
        if int(flag.item()):
            log.info("joining: %.1f of the %.1f MB fetched before are unchanged: the sync sends only the rest",
                     kept / 1e6, fetched_bytes / 1e6)
        else:
            log.info("joining: the fetch does not hold (another rank serves the sync, or a rank lacks the newest "
                     "commit): the sync sends everything")
    return keep


def _broadcast_json(obj: Any, root: int) -> Any:
    """``obj`` from ``root`` to every rank as JSON (never a pickle: this travels over gloo)."""
    payload = json.dumps(obj).encode() if rounds.current().rank == root else b""
    length = torch.tensor([len(payload)], dtype=torch.int64)
    collectives.broadcast_(length, root, "state.prefetch.size", trusted=True)
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
            else torch.empty(int(length.item()), dtype=torch.uint8))
    collectives.broadcast_(data, root, "state.prefetch", trusted=True)
    return json.loads(issuing.tensor_bytes(data).decode()) if int(length.item()) else None


def _offer_from(raw: Any) -> dict[str, tuple[int, list[str]]]:
    """The root's offer, checked: {model attribute: (watch epoch, names of unchanged tensors)};
    anything else is no offer (the sync then sends everything)."""
    if not isinstance(raw, dict):
        return {}
    offer = {}
    for attr, value in raw.items():
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], int)
                and isinstance(value[1], list) and all(isinstance(n, str) for n in value[1])):
            return {}
        offer[str(attr)] = (value[0], value[1])
    return offer


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
