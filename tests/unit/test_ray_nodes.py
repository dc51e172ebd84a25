"""Hosts from a Ray cluster (elasticrun/discovery/ray_nodes.py): the pure decisions, fed with
answers in the shapes Ray gives them (``ray.nodes()``, available resources per node, the
GCS's draining nodes). No Ray needed."""

from __future__ import annotations

import logging

from elasticrun.discovery.ray_nodes import (Held, RayDiscovery, RayNode, Requirement, host_list, nodes_from_ray,
                                          nowhere, slots_on)


def node(node_id: str = "a" * 56, free: dict | None = None, total: dict | None = None, **kw) -> RayNode:
    total = total if total is not None else {"CPU": 4.0}
    return RayNode(node_id=node_id, ip="10.0.0.1", alive=kw.pop("alive", True), total=total,
                   free=free if free is not None else dict(total), **kw)


def test_slots_come_from_free_resources_not_the_total():
    assert slots_on(node(free={"CPU": 1.0}, total={"CPU": 8.0}), {"CPU": 1.0}) == 1
    assert slots_on(node(free={"CPU": 0.0}, total={"CPU": 8.0}), {"CPU": 1.0}) == 0


def test_every_resource_a_worker_needs_must_fit():
    n = node(free={"CPU": 8.0, "GPU": 2.0, "trainer": 1.0}, total={"CPU": 8.0, "GPU": 2.0, "trainer": 1.0})
    assert slots_on(n, Requirement(2, 1).as_resources()) == 2
    assert slots_on(n, Requirement(2, 0.5).as_resources()) == 4
    assert slots_on(n, Requirement(1, 0, {"trainer": 1}).as_resources()) == 1
    assert slots_on(node(), Requirement(1, 1).as_resources()) == 0  # no GPU there
    assert slots_on(n, {"CPU": 0.1 * 3}) == 26  # 8 / 0.3, without float dust losing a slot


def test_what_the_jobs_settled_workers_hold_counts_as_usable_and_live_workers_keep_their_slots():
    full = node(free={"CPU": 0.0}, total={"CPU": 2.0})
    assert slots_on(full, {"CPU": 1.0}, Held(settled=2, live=2)) == 2
    # A worker just placed: Ray's view may not show its CPU taken yet, so it is not added...
    assert slots_on(node(free={"CPU": 1.0}, total={"CPU": 2.0}), {"CPU": 1.0}, Held(settled=0, live=1)) == 1
    # ...but a node never shows fewer slots than the job's workers there.
    assert slots_on(full, {"CPU": 1.0}, Held(settled=0, live=2)) == 2


def test_the_host_list_has_alive_nodes_with_room_by_id_and_draining_ones_marked():
    a, b, c, d = "a" * 56, "b" * 56, "c" * 56, "d" * 56
    listed = host_list([node(a), node(b, draining=True), node(c, alive=False), node(d, free={"CPU": 0.0})],
                       {"CPU": 2.0})
    assert listed.hosts == {a: 2, b: 2}
    assert listed.draining == {b}


def test_nodes_from_rays_own_answers():
    table = [
        {"NodeID": "h" * 56, "Alive": True, "State": "ALIVE", "NodeManagerAddress": "10.0.0.1",
         "Resources": {"CPU": 0.0, "node:__internal_head__": 1.0, "node:10.0.0.1": 1.0}},
        {"NodeID": "w" * 56, "Alive": True, "State": "ALIVE", "NodeManagerAddress": "10.0.0.1",
         "Resources": {"CPU": 4.0, "memory": 1e9}},
        {"NodeID": "x" * 56, "Alive": False, "State": "DEAD", "NodeManagerAddress": "10.0.0.2", "Resources": {}},
    ]
    nodes = nodes_from_ray(table, {"w" * 56: {"CPU": 3.0}}, {"w" * 56: 1_700_000_000_000})
    assert [(n.head, n.alive, n.draining) for n in nodes] == [(True, True, False), (False, True, True),
                                                             (False, False, False)]
    assert nodes[1].free == {"CPU": 3.0} and nodes[1].deadline_ms == 1_700_000_000_000
    assert host_list(nodes, {"CPU": 1.0}).hosts == {"w" * 56: 3}


def test_resources_no_node_has_are_named_once_not_waited_for_in_silence(caplog):
    """GPUs asked of a CPU-only cluster, or a custom resource no node defines: the wait only
    said "found no hosts yet"; the lacking resource is said once, and again only if it changes."""
    cpu_only = [node("a" * 56), node("b" * 56, total={"CPU": 2.0, "trainer": 1.0})]
    assert nowhere(cpu_only, Requirement(1, 1).as_resources()) == ["GPU 1"]
    assert nowhere(cpu_only, Requirement(1, 0, {"trainer": 2}).as_resources()) == ["trainer 2"]
    assert nowhere(cpu_only, Requirement(1, 0, {"trainer": 1}).as_resources()) == []  # busy is not lacking
    assert nowhere([node(alive=False, total={"CPU": 4.0, "GPU": 1.0})], {"GPU": 1.0}) == ["GPU 1"]
    answers = [cpu_only, cpu_only, cpu_only + [node("c" * 56, total={"CPU": 4.0, "GPU": 1.0})]]
    d = RayDiscovery(Requirement(1, 1), held=dict, ask=lambda: answers.pop(0))
    with caplog.at_level(logging.WARNING, logger="elasticrun"):
        assert not d.discover().hosts and not d.discover().hosts
        assert len(d.discover().hosts) == 1
    said = [r.getMessage() for r in caplog.records]
    assert said == ["Ray cluster auto: no node has GPU 1, which each worker needs (--ray-cpus-per-worker, "
                    "--ray-gpus-per-worker, --ray-resources): no worker can start until such a node joins"], said
