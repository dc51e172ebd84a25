"""Hosts from a Ray cluster: its alive nodes, with as many slots as their free resources fit.

A host is a Ray node, named by its node id (hex): several nodes may share an IP address (a
test cluster on one machine, pods of one VM), and the launcher pins each worker to its node by
that id. The decisions are pure functions of what Ray reports (``tests/unit/test_ray_nodes.py``
feeds them answers in Ray's own shapes); :class:`RayDiscovery` is the thin
shell that asks Ray every ``--discovery-interval``, and imports ``ray`` only when it runs.

Slots come from a node's **free** resources, not its total: other jobs on the cluster keep
what they hold. The job's own workers hold resources too (each is a Ray actor that reserves
``--ray-cpus-per-worker`` etc.), and those count as usable by the job, or a node would lose a
slot every time one of its workers started. Two delays of Ray's make that count subtle:

* a worker's resources are taken when Ray places its actor, and Ray's view of a node's free
  resources follows a moment later. A worker counts as holding resources (``Held.settled``)
  only once it has been running for :data:`SETTLE_SECONDS`, by when Ray's view shows them
  taken; before that, the free resources may or may not include its share, and counting it
  could make a slot out of nothing, which the registry would then try to fill (and the new
  worker would wait for resources that never come);
* not counting it may hide a slot for that moment instead. That one is harmless as long as a
  node never shows fewer slots than the job has workers there (``Held.live``): a slot the job
  uses never disappears, so nothing is reset, and a free slot shows up at the next run.

Nodes that Ray is draining (the autoscaler's scale-down, a spot preemption notice given
through Ray's drain API, ``ray drain-node``) are listed as ``draining``: their workers leave at
their next commit, without a rollback, and nothing new starts there. A node that dies is no
longer listed; its workers' actors die with it, which the launcher reports as failed exits.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from elasticrun.common.hosts import MAX_HOSTS, MAX_SLOTS_PER_HOST, HostList
from elasticrun.discovery.sources import DiscoveryError

log = logging.getLogger("elasticrun")

#: How long a worker must have been running before Ray's view of free resources surely shows
#: what it holds (Ray reports a node's resources every 100 ms by default).
SETTLE_SECONDS = 1.0
#: Ray keeps resource amounts to 4 decimal places; 0.1 + 0.2 must fit 0.3.
_EPSILON = 1e-6


@dataclass(frozen=True)
class Requirement:
    """What each worker needs of a node (``--ray-cpus-per-worker``, ``--ray-gpus-per-worker``,
    ``--ray-resources``), in Ray's resource names."""

    cpus: float = 1.0
    gpus: float = 0.0
    resources: Mapping[str, float] = field(default_factory=dict)

    def as_resources(self) -> dict[str, float]:
        """Ray's names (``CPU``, ``GPU``, custom ones) -> amounts, the zero ones left out."""
        need = {"CPU": self.cpus, "GPU": self.gpus, **self.resources}
        return {k: float(v) for k, v in need.items() if v > 0}

    def describe(self) -> str:
        return ", ".join(f"{k} {_amount(v)}" for k, v in self.as_resources().items()) or "nothing"


@dataclass(frozen=True)
class Held:
    """The job's own workers on a node: ``live`` (starting or running) and ``settled`` (running
    long enough that Ray's view of free resources shows what they hold)."""

    settled: int = 0
    live: int = 0


@dataclass(frozen=True)
class RayNode:
    """One node, as Ray reports it."""

    node_id: str
    ip: str
    alive: bool
    total: Mapping[str, float]
    free: Mapping[str, float]
    draining: bool = False
    deadline_ms: int = 0  # when a draining node goes (ms since the epoch; 0: not said)
    head: bool = False

    @property
    def short(self) -> str:
        return self.node_id[:12]


def _amount(value: float) -> str:
    return f"{value:g}"


# --- decisions (pure) --------------------------------------------------------------------------
def slots_on(node: RayNode, need: Mapping[str, float], held: Held = Held()) -> int:
    """How many workers ``node`` has room for: its free resources plus what the job's settled
    workers hold there, divided by each worker's ``need``; never fewer than the job's live
    workers there, never more than MAX_SLOTS_PER_HOST. A ``need`` of nothing fits nowhere
    (the command line refuses it)."""
    if not need:
        return 0
    fit = min(math.floor((node.free.get(name, 0.0) + held.settled * amount) / amount + _EPSILON)
              for name, amount in need.items())
    return max(0, min(MAX_SLOTS_PER_HOST, max(held.live, fit)))


def host_list(nodes: list[RayNode], need: Mapping[str, float], held: Mapping[str, Held] | None = None) -> HostList:
    """The hosts discovery reports: every alive node with at least one slot (or workers of the
    job), by node id; nodes Ray is draining are listed ``draining``."""
    held = held or {}
    result = HostList()
    for node in nodes:
        if not node.alive:
            continue
        slots = slots_on(node, need, held.get(node.node_id, Held()))
        if slots < 1:
            continue
        result.add(node.node_id, slots, f"node {node.node_id}")
        if node.draining:
            result.draining.add(node.node_id)
    return result


def nowhere(nodes: list[RayNode], need: Mapping[str, float]) -> list[str]:
    """The resources a worker needs that no alive node has as much of in all (``GPU 1`` on a
    cluster without GPUs, a custom resource no node defines), each as ``NAME AMOUNT``: no slot
    can appear until a node that has them joins."""
    alive = [n for n in nodes if n.alive]
    return [f"{name} {_amount(amount)}" for name, amount in need.items()
            if not any(n.total.get(name, 0.0) >= amount for n in alive)]


def nodes_from_ray(table: list[Mapping[str, Any]], free: Mapping[str, Mapping[str, float]],
                   draining: Mapping[str, int]) -> list[RayNode]:
    """Ray's answers as :class:`RayNode` s: ``table`` is ``ray.nodes()``, ``free`` Ray's
    available resources per node id, ``draining`` its draining nodes (id -> deadline in ms,
    0 for none). A node Ray lists without available resources has none free."""
    nodes = []
    for entry in table:
        node_id = str(entry.get("NodeID", ""))
        if not node_id:
            continue
        total = {str(k): float(v) for k, v in (entry.get("Resources") or {}).items()}
        nodes.append(RayNode(
            node_id=node_id, ip=str(entry.get("NodeManagerAddress", "")),
            alive=bool(entry.get("Alive")) and str(entry.get("State", "ALIVE")) == "ALIVE",
            total=total, free={str(k): float(v) for k, v in (free.get(node_id) or {}).items()},
            draining=node_id in draining, deadline_ms=int(draining.get(node_id) or 0),
            head=bool(entry.get("IsHeadNode")) or "node:__internal_head__" in total))
    return nodes


def describe_node(node: RayNode, need: Mapping[str, float]) -> str:
    """One line for ``--check``: id, address, free resources of interest and slots."""
    names = list(need) + [n for n in ("CPU", "GPU") if n not in need]
    free = ", ".join(f"{n} {_amount(node.free.get(n, 0.0))}/{_amount(node.total.get(n, 0.0))}"
                     for n in names if n in node.total or n in need)
    where = f"node {node.node_id} ({node.ip}{', head' if node.head else ''})"
    state = ""
    if not node.alive:
        state = ", dead"
    elif node.draining:
        left = f" within {max(0.0, node.deadline_ms / 1000 - time.time()):.0f} s" if node.deadline_ms else ""
        state = f", draining (going away{left})"
    return f"{where}: free {free or 'nothing'}{state} -> {slots_on(node, need)} slot(s)"


def ray_missing() -> list[str]:
    """What of the ``elasticrun[ray]`` extra is not installed. A directory named ``ray`` on the
    path (Ray's own temporary directory, /tmp/ray, when run from /tmp) is no installation."""
    import importlib.util

    missing = []
    for name in ("ray", "nacl"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or spec.origin is None:  # absent, or a namespace package (a bare directory)
            missing.append(name)
    return missing


# --- the shell: asking Ray ---------------------------------------------------------------------
def ask_ray() -> list[RayNode]:
    """The cluster's nodes now (``ray.init`` must have been called)."""
    import ray
    from ray._private import state

    table = ray.nodes()
    free = state.available_resources_per_node()
    try:
        draining = state.state.get_draining_nodes()
    except Exception:  # an older GCS without drain status: nothing is draining
        draining = {}
    return nodes_from_ray(table, free, draining)


class RayDiscovery:
    """The discovery source of ``--ray-address``: Ray's alive nodes, slots from free resources.

    ``held()`` tells what the job's own workers hold on each node (the launcher's count);
    ``ask`` returns the nodes (:func:`ask_ray`, or recorded data in tests).
    """

    def __init__(self, need: Requirement, held: Callable[[], Mapping[str, Held]],
                 ask: Callable[[], list[RayNode]] = ask_ray, address: str = "auto"):
        self.need = need.as_resources()
        self.held = held
        self.ask = ask
        self.address = address
        self.nodes: dict[str, RayNode] = {}  # the last answer, by node id
        self._closed = False
        self._lacking_said: list[str] = []  # what nowhere() said last (said again only when it changes)

    def describe(self) -> str:
        return f"Ray cluster {self.address}"

    def close(self) -> None:
        self._closed = True

    def discover(self) -> HostList:
        if self._closed:
            raise DiscoveryError("discovery is closed: the job is ending")
        held = self.held()  # before asking: a worker counted here is older than Ray's answer
        try:
            nodes = self.ask()
        except Exception as exc:  # the GCS is unreachable, or Ray is shutting down
            raise DiscoveryError(f"could not ask the Ray cluster for its nodes: {type(exc).__name__}: "
                                 f"{str(exc)[:300]}") from None
        if len(nodes) > MAX_HOSTS:
            raise DiscoveryError(f"the Ray cluster has {len(nodes):,} nodes, more than the {MAX_HOSTS:,} allowed")
        self.nodes = {n.node_id: n for n in nodes}
        lacking = nowhere(nodes, self.need) if nodes else []
        if lacking != self._lacking_said:
            self._lacking_said = lacking
            if lacking:  # otherwise the wait only said "found no hosts", with no reason
                log.warning("%s: no node has %s, which each worker needs (--ray-cpus-per-worker, "
                            "--ray-gpus-per-worker, --ray-resources): no worker can start until such a node joins",
                            self.describe(), " or ".join(lacking))
        return host_list(nodes, self.need, held)

    def ip_of(self, node_id: str) -> str | None:
        node = self.nodes.get(node_id)
        return node.ip if node is not None else None
