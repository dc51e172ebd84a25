"""gloo's rendezvous through DriverStore: real gloo groups, the driver's real KVStore behind an
in-process stand-in for the control channel. While a group forms, every rank reads the others'
addresses from snapshots: a few round trips per rank instead of 2N."""

import threading
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from elasticrun.driver.kvstore import KVStore
from elasticrun.worker.store import DriverStore

pytestmark = pytest.mark.timeout(120)


class Channel:
    """Requests go to one KVStore; a blocked read waits for the reply a later write releases."""

    def __init__(self):
        self.kv = KVStore()
        self.lock = threading.Lock()
        self.replies: dict[int, tuple[str, dict]] = {}
        self.ready = threading.Condition(self.lock)
        self.next = 0

    def request(self, type_, body, timeout, what, abort=None):
        assert type_ == "store"
        with self.lock:
            self.next += 1
            token = self.next
            for tok, kind, reply in self.kv.handle(token, body, now=0.0):
                self.replies[tok] = (kind, reply)
            self.ready.notify_all()
            if not self.ready.wait_for(lambda: token in self.replies, timeout=timeout):
                raise TimeoutError(what)
            kind, reply = self.replies.pop(token)
        return SimpleNamespace(type=kind, body=reply)


def form(n: int, snapshots: bool) -> list[int]:
    channel, trips, errors = Channel(), [0] * n, []

    def rank(r: int) -> None:
        try:
            store = DriverStore(channel, timeout=30, abort=lambda: None)
            prefixed = dist.PrefixStore("round3", store)
            if snapshots:
                with store.forming():
                    pg = dist.ProcessGroupGloo(prefixed, r, n, timedelta(seconds=30))
            else:
                pg = dist.ProcessGroupGloo(prefixed, r, n, timedelta(seconds=30))
            trips[r] = store.round_trips
            t = torch.tensor([float(r)])
            pg.allreduce([t]).wait()
            assert t.item() == sum(range(n))
            assert store.get("round3/0/0")  # after forming, reads go to the driver again
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return trips


@pytest.mark.parametrize("n", [2, 8])
def test_a_group_forms_over_snapshots_in_a_few_round_trips(n):
    plain = form(n, snapshots=False)
    assert min(plain) >= 2 * n  # a wait and a get per rank, and the set
    fast = form(n, snapshots=True)
    assert max(fast) < min(plain), (fast, plain)
    assert sum(fast) <= n * (3 + n // 2), fast


def test_writes_while_forming_are_never_served_stale():
    channel = Channel()
    store = DriverStore(channel, timeout=5, abort=lambda: None)
    other = DriverStore(channel, timeout=5, abort=lambda: None)
    store.set("r/count", "1")
    with store.forming():
        assert store.get("r/count") == b"1"
        assert store.add("r/count", 1) == 2  # a counter: our own write drops the cached value
        assert store.get("r/count") == b"2"
        other.set("r/new", "x")  # a key we have not read yet comes with the next snapshot
        store.wait(["r/new"])
        assert store.get("r/new") == b"x"
