"""Which address of this machine workers reach the driver on (elasticrun/driver/network.py)."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from elasticrun.driver import network

pytestmark = pytest.mark.timeout(60)


def test_route_source_address_for_loopback_hosts():
    for host in ("127.0.0.2", "someone@127.0.0.3", "localhost"):
        assert network.route_source_address(host).startswith("127.")


def test_route_source_address_unknown_name():
    """An unresolvable name is its own error: the driver's advice is DNS, not its flags."""
    with pytest.raises(network.UnresolvedHost, match="cannot resolve host name 'no-such-host.invalid'"):
        network.route_source_address("no-such-host.invalid")


def test_interface_address():
    assert network.interface_address("lo") == "127.0.0.1"
    with pytest.raises(OSError, match="no network interface 'nosuch0' .*lo"):
        network.interface_address("nosuch0")


class _FakeSocket:
    def __init__(self):
        self.binds: list[str] = []
        self.options: dict = {}

    def bind_to_random_port(self, base: str) -> int:
        self.binds.append(base)
        return 40000 + len(self.binds)

    def setsockopt(self, opt, value):
        self.options[opt] = value


def test_driver_endpoints_bind_the_routed_address_once_per_address():
    router = _FakeSocket()
    routes = {"a": "10.0.0.5", "b": "10.0.0.5", "c": "192.168.1.2"}
    ep = network.DriverEndpoints(router, None, route=routes.__getitem__)
    assert ep.local() == "tcp://127.0.0.1:40001"
    assert ep.for_host("a") == "tcp://10.0.0.5:40002"
    assert ep.for_host("b") == ep.for_host("a")
    assert ep.for_host("c") == "tcp://192.168.1.2:40003"
    assert router.binds == ["tcp://127.0.0.1", "tcp://10.0.0.5", "tcp://192.168.1.2"]


def test_driver_endpoints_forced_address_for_everyone():
    router = _FakeSocket()
    ep = network.DriverEndpoints(router, "10.1.2.3", route=lambda h: pytest.fail("must not route"))
    assert ep.local() == ep.for_host("anything")
    assert router.binds == ["tcp://10.1.2.3"]


def test_driver_endpoints_ipv6():
    import zmq

    router = _FakeSocket()
    ep = network.DriverEndpoints(router, "::1")
    assert ep.local().startswith("tcp://[::1]:")
    assert router.options[zmq.IPV6] == 1


def test_check_bindable():
    network.check_bindable("127.0.0.1")
    with pytest.raises(OSError):
        network.check_bindable("203.0.113.7")
    socket.inet_aton(network.interface_address("lo"))


def test_zmq_endpoint():
    assert network.zmq_endpoint("10.0.0.1") == "tcp://10.0.0.1"
    assert network.zmq_endpoint("fe80::1") == "tcp://[fe80::1]"


def test_driver_bind_address_from_the_flags():
    from elasticrun.common.settings import JobSettings

    def settings(**kw) -> JobSettings:
        return JobSettings(command=["true"], np=1, min_np=1, max_np=1, **kw)

    assert network.driver_bind_address(settings()) is None  # per host, routed
    assert network.driver_bind_address(settings(driver_address="10.1.2.3")) == "10.1.2.3"
    assert network.driver_bind_address(settings(network_interface="lo")) == "127.0.0.1"


def test_the_driver_spreads_connections_over_io_threads_only_for_big_jobs_on_big_machines():
    # a job of a few workers: one I/O thread, whatever the machine (nothing to spread)
    assert network.io_threads(2, 64) == 1
    assert network.io_threads(1024, 64) == 1
    assert network.io_threads(1025, 64) == 2
    assert network.io_threads(4096, 16) == 4  # the 4,096 workers on a 16-core machine
    assert network.io_threads(4096, 2) == 1  # two cores: the driver's loop needs the other
    assert network.io_threads(4096, 5) == 2  # at most half the cores
    assert network.io_threads(100_000, 256) == network.MAX_IO_THREADS
    assert network.io_threads(0, 16) == 1 and network.io_threads(4096, 1) == 1


def test_usable_cores_is_what_this_process_may_run_on():
    assert 1 <= network.usable_cores() <= (os.cpu_count() or 1)


def test_a_containers_cpu_quota_caps_the_cores():
    assert network.quota_cores("200000 100000") == 2  # cgroup v2: 2 CPUs
    assert network.quota_cores("150000 100000") == 2  # 1.5 CPUs: rounded up
    assert network.quota_cores("50000 100000") == 1
    assert network.quota_cores("max 100000") is None  # no limit
    assert network.quota_cores("max") is None
    assert network.quota_cores(None, "400000", "100000") == 4  # cgroup v1
    assert network.quota_cores(None, "-1", "100000") is None  # v1: no limit
    assert network.quota_cores(None, None, None) is None  # no cgroup files
    assert network.quota_cores("garbage") is None and network.quota_cores("0 100000") is None


class TestNames:
    """Host names are looked up off the driver's loop (network.prefetch, from the discovery
    thread) and kept: a lookup can take the resolver's 5 s, as long as workers wait for the
    driver, and one slow name on the loop made every worker give the job up."""

    @pytest.fixture(autouse=True)
    def fresh(self, monkeypatch):
        monkeypatch.setattr(network, "_names", {})
        monkeypatch.setattr(network, "_pending", set())
        self.calls: list[str] = []
        self.release = threading.Event()
        real = socket.getaddrinfo

        def lookup(name, *args, **kwargs):
            self.calls.append(name)
            if name.startswith("slow"):
                assert self.release.wait(10)
            if name.endswith(".invalid"):
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return real("127.0.0.1", *args, **kwargs)

        monkeypatch.setattr(network.socket, "getaddrinfo", lookup)
        yield
        self.release.set()

    def test_a_slow_name_is_held_back_and_the_others_are_kept_for_the_loop(self):
        started = time.monotonic()
        assert network.prefetch(["fast-a", "slow-b", "fast-c"], 0.3) == {"slow-b"}
        assert 0.25 < time.monotonic() - started < 5
        calls = len(self.calls)
        assert network.route_source_address("fast-a").startswith("127.")  # from what was kept
        assert len(self.calls) == calls
        self.release.set()  # its lookup ends: it is kept too
        assert network.prefetch(["slow-b"], 5) == set()
        assert network.resolve("slow-b") and self.calls.count("slow-b") == 1

    def test_a_name_that_does_not_resolve_is_said_and_looked_up_again_later(self, monkeypatch):
        assert network.prefetch(["gone.invalid"], 5) == set()
        assert network.unresolved("gone.invalid") == "cannot resolve host name 'gone.invalid': Name or service not known"
        with pytest.raises(network.UnresolvedHost):
            network.resolve("gone.invalid")
        network.prefetch(["gone.invalid"], 5)
        assert self.calls.count("gone.invalid") == 1  # not again before UNRESOLVED_RETRY
        monkeypatch.setattr(network, "UNRESOLVED_RETRY", 0.0)
        # Looked up again in the background: the answer so far stands meanwhile (never a wait).
        network.prefetch(["gone.invalid"], 5)
        deadline = time.monotonic() + 5
        while self.calls.count("gone.invalid") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.calls.count("gone.invalid") == 2
        assert network.unresolved("fast-a") is None

    def test_a_name_the_resolver_refuses_is_unresolved_not_an_exception(self, monkeypatch):
        monkeypatch.setattr(network.socket, "getaddrinfo", lambda *a, **k: (_ for _ in ()).throw(UnicodeError("label")))
        assert network.prefetch(["a..b"], 5) == set()
        assert "not a valid name" in (network.unresolved("a..b") or "")

    def test_the_names_kept_are_bounded(self, monkeypatch):
        monkeypatch.setattr(network, "MAX_NAMES", 10)
        network.prefetch([f"fast-{i}" for i in range(25)], 5)
        assert len(network._names) == 10 and "fast-24" in network._names
