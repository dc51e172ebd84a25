"""Which address of this machine workers reach the driver on, and listening there.

The driver cannot listen on every interface (that would expose its sockets to networks no
worker is on) nor guess one address for all hosts (a machine with several networks reaches
each host through a different one). So local workers get 127.0.0.1, and each remote host the
address the kernel would use to reach it, bound the first time a host needs it; or one
address for everyone, named with ``--driver-address`` or ``--network-interface``.
"""

from __future__ import annotations

import collections
import errno
import functools
import ipaddress
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from elasticrun.common.settings import JobSettings


class UnresolvedHost(OSError):
    """A host name that does not resolve here (DNS or /etc/hosts: no flag of the driver helps)."""


# --- host names, resolved off the driver's loop ----------------------------------------------
#: A name that did not resolve is looked up again (by :func:`prefetch`) after this long.
UNRESOLVED_RETRY = 30.0
#: How many names :func:`prefetch` looks up at once.
LOOKUPS_AT_ONCE = 8

_Infos = tuple[tuple[int, Any], ...]  # (family, sockaddr) of each answer, port 9 (discard), UDP
_names: dict[str, tuple[float, "_Infos | UnresolvedHost"]] = {}  # name -> (when looked up, answer)
_names_lock = threading.Lock()


def _look_up(name: str) -> "_Infos | UnresolvedHost":
    try:
        infos = socket.getaddrinfo(name, 9, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        return UnresolvedHost(f"cannot resolve host name {name!r}: {exc.strerror}")
    except UnicodeError:  # a part of the name the resolver refuses (empty, over 63 characters)
        return UnresolvedHost(f"cannot resolve host name {name!r}: not a valid name")
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # IPv4 first
    return tuple((i[0], i[4]) for i in infos)


#: Names kept at most (a discovery script may list new names at every run, without end).
MAX_NAMES = 65_536


def _keep(name: str, answer: "_Infos | UnresolvedHost") -> None:
    """(Under _names_lock.)"""
    _names.pop(name, None)
    while len(_names) >= MAX_NAMES:
        _names.pop(next(iter(_names)))  # the longest kept
    _names[name] = (time.monotonic(), answer)


def resolve(name: str) -> _Infos:
    """The addresses of host name ``name`` (UnresolvedHost if it has none). Kept once looked
    up: the driver's loop asks for every launch, and a lookup can take the resolver's whole
    timeout (5 s by default, as long as workers wait for an answer from the driver before they
    give the job up), so the loop must find the answer here, looked up by :func:`prefetch`
    from the discovery thread. A name never looked up is looked up now."""
    with _names_lock:
        known = _names.get(name)
    if known is None:
        answer = _look_up(name)
        with _names_lock:
            _keep(name, answer)
        known = (0.0, answer)
    if isinstance(known[1], UnresolvedHost):
        raise UnresolvedHost(str(known[1]))
    return known[1]


def unresolved(name: str) -> str | None:
    """Why ``name`` did not resolve when last looked up (None: it did, or was never looked up)."""
    with _names_lock:
        known = _names.get(name)
    return str(known[1]) if known is not None and isinstance(known[1], UnresolvedHost) else None


def prefetch(names: Iterable[str], timeout: float) -> set[str]:
    """Look up the names not known yet (and those that did not resolve UNRESOLVED_RETRY ago),
    LOOKUPS_AT_ONCE at a time on threads of their own, waiting at most ``timeout`` seconds;
    the names still never answered. A lookup that outlasts the wait goes on and is kept."""
    wanted = list(dict.fromkeys(names))
    now = time.monotonic()
    with _names_lock:
        for n in wanted:
            known = _names.get(n)
            stale = known is not None and isinstance(known[1], UnresolvedHost) and now - known[0] >= UNRESOLVED_RETRY
            if (known is None or stale) and n not in _pending:
                _pending.add(n)
                _queue.append(n)
        while len(_threads) < min(LOOKUPS_AT_ONCE, len(_queue)):
            t = threading.Thread(target=_look_up_queued, name="elasticrun-lookup", daemon=True)
            _threads.append(t)
            t.start()
        deadline = now + timeout
        while True:
            waiting = {n for n in wanted if n not in _names}
            left = deadline - time.monotonic()
            if not waiting or left <= 0:
                return waiting
            _names_changed.wait(left)


_pending: set[str] = set()  # queued or being looked up
_queue: collections.deque[str] = collections.deque()
_threads: list[threading.Thread] = []
_names_changed = threading.Condition(_names_lock)


def _look_up_queued() -> None:
    """One of the lookup threads: takes names until none is left, then ends."""
    me = threading.current_thread()
    while True:
        with _names_lock:
            if not _queue:
                _threads.remove(me)
                return
            name = _queue.popleft()
        answer = _look_up(name)
        with _names_lock:
            _keep(name, answer)
            _pending.discard(name)
            _names_changed.notify_all()


@functools.lru_cache(maxsize=1)
def own_addresses() -> frozenset[str]:
    """This machine's addresses by its names (asked once: getfqdn() may wait on DNS)."""
    own: set[str] = set()
    for candidate in (socket.gethostname(), socket.getfqdn()):
        try:
            own |= {str(sockaddr[0]) for _, sockaddr in resolve(candidate)}
        except OSError:
            pass
    return frozenset(own)


def route_source_address(host: str) -> str:
    """The address of this machine that the kernel uses to reach ``host`` (no packet is sent)."""
    name = host.rpartition("@")[2]  # user@name: the name
    last: OSError | None = None
    for family, sockaddr in resolve(name):
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(sockaddr)
                return s.getsockname()[0]
            except OSError as exc:
                last = exc
    raise OSError(f"no route from this machine to {name}" + (f": {last.strerror or last}" if last else ""))


def interface_address(nic: str) -> str:
    """The IPv4 address of network interface ``nic``; OSError naming the problem otherwise."""
    import fcntl
    import struct

    names = [n for _, n in socket.if_nameindex()]
    if nic not in names:
        raise OSError(errno.ENODEV, f"no network interface {nic!r} (this machine has: {', '.join(names)})")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", nic.encode()[:15]))  # SIOCGIFADDR
        except OSError:
            raise OSError(errno.EADDRNOTAVAIL, f"network interface {nic!r} has no IPv4 address") from None
    return socket.inet_ntoa(packed[20:24])


# Workers one ZeroMQ I/O thread serves in round 0 within about 2 s: measured, each worker costs the
# driver's I/O thread ~1.9 ms of CPU there (its CURVE handshakes, three then and two since
# notifications share the heartbeat connection, and the first messages; 2,048 workers,
# benchmarks/driver_scale.py), more than the driver's own loop spends on it.
WORKERS_PER_IO_THREAD = 1024
MAX_IO_THREADS = 8


def io_threads(workers: int, cores: int) -> int:
    """How many I/O threads the driver's ZeroMQ context gets for a job of up to ``workers``.

    ZeroMQ runs every connection's CURVE handshake and encryption on an I/O thread, one by
    default: past a thousand workers that one thread is the driver's bottleneck in round 0
    (the handshakes of every worker at once). Accepted connections go to the least loaded
    I/O thread, so more threads spread them over more cores. At most half the usable cores
    (:func:`usable_cores`: the driver's loop, its ZAP handler and the machine's other work
    need the rest), and one for jobs of up to ``WORKERS_PER_IO_THREAD``: a small job gains
    nothing from more.
    """
    wanted = -(-max(1, workers) // WORKERS_PER_IO_THREAD)  # ceil
    return max(1, min(wanted, cores // 2, MAX_IO_THREADS))


def quota_cores(cpu_max: str | None, cfs_quota: str | None = None, cfs_period: str | None = None) -> int | None:
    """The cores a cgroup's CPU quota allows, rounded up; None when it sets none.

    ``cpu_max``: cgroup v2's ``cpu.max`` ("200000 100000", or "max 100000" for no limit);
    else v1's ``cpu.cfs_quota_us`` (-1: no limit) and ``cpu.cfs_period_us``. A container
    limited to 2 CPUs on a 64-core node sees all 64 in its affinity: the quota says 2.
    """
    try:
        if cpu_max is not None:
            quota, _, period = cpu_max.strip().partition(" ")
            if quota == "max":
                return None
            q, p = int(quota), int(period or 100000)
        elif cfs_quota is not None and cfs_period is not None:
            q, p = int(cfs_quota.strip()), int(cfs_period.strip())
        else:
            return None
    except ValueError:
        return None
    if q <= 0 or p <= 0:
        return None
    return max(1, -(-q // p))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def usable_cores() -> int:
    """The cores this process may run on: its affinity, and no more than its container's CPU
    quota allows (cgroup v2, else v1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = quota_cores(_read("/sys/fs/cgroup/cpu.max"), _read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
                        _read("/sys/fs/cgroup/cpu/cpu.cfs_period_us"))
    return min(cores, quota) if quota else cores


def check_bindable(address: str) -> None:
    """Raise OSError if this machine cannot listen on ``address``."""
    ip = ipaddress.ip_address(address)
    family = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((address, 0))


def zmq_endpoint(address: str) -> str:
    """``tcp://ADDRESS`` as ZeroMQ spells it (IPv6 addresses in brackets), without the port."""
    return f"tcp://[{address}]" if ipaddress.ip_address(address).version == 6 else f"tcp://{address}"


def driver_bind_address(settings: "JobSettings") -> str | None:
    """The address forced by --driver-address / --network-interface, if any."""
    if settings.driver_address:
        return settings.driver_address
    nic = settings.network_interface
    return interface_address(nic.split(",")[0]) if nic else None


class DriverEndpoints:
    """Where remote workers reach the driver: the address each host routes to, bound on demand.

    With ``--driver-address`` (or ``--network-interface``) every worker gets that one address.
    Otherwise the driver listens on 127.0.0.1 for local workers and, the first time a host
    needs it, also on the address of this machine that the kernel would use to reach that host
    (so no interface that nobody needs is exposed, and each host gets one it can route back to).
    """

    def __init__(self, router: Any, forced: str | None = None, route: Callable[[str], str] = route_source_address):
        self._router = router
        self._forced = forced
        self._route = route
        self._bound: dict[str, str] = {}

    def bind(self, address: str) -> str:
        """The control endpoint on ``address`` (requests, heartbeats and notifications), bound once."""
        if address not in self._bound:
            import zmq

            base = zmq_endpoint(address)
            if ipaddress.ip_address(address).version == 6:
                self._router.setsockopt(zmq.IPV6, 1)
            self._bound[address] = f"{base}:{self._router.bind_to_random_port(base)}"
        return self._bound[address]

    def address(self, host: str | None = None) -> str:
        """The address of ours that workers on ``host`` (None: this machine) connect to;
        OSError when none reaches it."""
        return self._forced or ("127.0.0.1" if host is None else self._route(host))

    def local(self) -> str:
        """The endpoint of workers on this machine."""
        return self.bind(self.address())

    def for_host(self, host: str) -> str:
        """The endpoint of workers on ``host``; OSError when no address of ours reaches it."""
        return self.bind(self.address(host))
