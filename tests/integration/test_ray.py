"""Issue 17 on a real multi-node Ray cluster (ray.cluster_utils.Cluster: a head and one raylet
per "node", all on this machine, dashboard off, small object stores): the same driver with
Ray's nodes as hosts and workers started through Ray.

A job starts on two nodes; a node added mid-run joins; a node that dies mid-run fails over
with the survivors recovering in place; a node Ray drains is removed gracefully, without a
rollback; the driver killed with SIGKILL leaves no actor and no process behind; the job's
keys are neither in the actors' arguments, nor Ray's logs, nor any worker's environment.
Exactly-once is proven from the committed sample logs throughout, as in test_durable.py.

Skipped, saying so, when ray (the `elasticrun[ray]` extra) is not installed.
"""

from __future__ import annotations

import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import SCRIPTS, assert_nothing_left, env_of, tagged_pids
from test_durable import assert_exactly_once, entries, events, progress, sample_cmd, wait_for

ray = pytest.importorskip("ray", reason="ray is not installed: pip install 'ray==2.60.0' 'pynacl>=1.5' to run the Ray tests")
pytest.importorskip("nacl", reason="PyNaCl is not installed: pip install 'ray==2.60.0' 'pynacl>=1.5' to run the Ray tests")

from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(240)

STORE = 80 * 1024 ** 2  # each node's object store: elasticrun puts nothing big there


# --- the cluster ------------------------------------------------------------------------------
class RayTestCluster:
    """A head (no CPUs: nothing runs there) plus worker nodes of 1 CPU each, all on this machine
    (one IP address: Ray's own choice; a GCS bound to 127.0.0.1 is not reachable by a driver
    whose node address Ray takes to be the machine's)."""

    def __init__(self) -> None:
        # The GCS declares a node that stopped answering dead after 5 missed health checks of
        # 1 s (Ray's default is 3 x 5 s): a killed node is dead within seconds, as the tests need.
        self.cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=0, include_dashboard=False, object_store_memory=STORE,
            _system_config={"health_check_period_ms": 1000, "health_check_failure_threshold": 5}))
        self.address = self.cluster.address
        ray.init(address=self.address, logging_level="ERROR", log_to_driver=False)
        self.nodes: list = []

    def add(self, cpus: int = 1, **resources: float):
        node = self.cluster.add_node(num_cpus=cpus, object_store_memory=STORE,
                                     resources=resources or None)
        self.cluster.wait_for_nodes()
        self.nodes.append(node)
        return node

    def kill(self, node, tag: str) -> None:
        """The node dies: its Ray processes and everything running there go at once."""
        victims = [pid for pid in tagged_pids(tag) if env_of(pid).get("ELASTICRUN_HOSTNAME") == node.node_id]
        for actor in live_agents():
            if actor["node_id"] == node.node_id and actor.get("pid"):
                victims.append(actor["pid"])
        self.remove(node)
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def remove(self, node, graceful: bool = False) -> None:
        """The node goes: at once (graceful=False: its raylet is killed, the GCS declares it dead
        after its health checks fail), or by unregistering first (between tests: quick)."""
        self.cluster.remove_node(node, allow_graceful=graceful)
        self.nodes.remove(node)

    def drain(self, node, seconds: int = 120) -> None:
        """What the autoscaler or a spot preemption notice does: ask the GCS to drain the node."""
        r = subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "drain-node", "--address", self.address,
                            "--node-id", node.node_id, "--reason", "DRAIN_NODE_REASON_PREEMPTION",
                            "--reason-message", "spot instance reclaimed", "--deadline-remaining-seconds",
                            str(seconds)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr

    def reset(self) -> None:
        for node in list(self.nodes):
            self.remove(node, graceful=True)

    def shutdown(self) -> None:
        ray.shutdown()
        self.cluster.shutdown()


def agents() -> list[dict]:
    """Every WorkerAgent actor the GCS knows of (any job, any state), from its actor table (the
    state API needs the dashboard, which these clusters run without)."""
    from ray._private import state

    found = []
    for info in state.actors().values():
        if info["ActorClassName"] == "WorkerAgent":
            found.append({"state": info["State"], "node_id": info["Address"]["NodeID"], "pid": info["Pid"],
                          "job_id": info["JobID"], "info": info})
    return found


def task_events() -> list[str]:
    """What the GCS recorded of every task (their specs and states), as text."""
    from ray._private import state

    try:
        return [str(e) for e in state.state._get_all_task_events()]
    except RuntimeError:  # task events kept by a dashboard head that is not running
        return []


def live_agents() -> list[dict]:
    return [a for a in agents() if a["state"] != "DEAD"]


def ray_processes() -> list[str]:
    """Processes of this machine running an elasticrun agent (Ray names them ray::WorkerAgent)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if "WorkerAgent" in cmd:
                found.append(f"{entry}: {cmd[:120]}")
    return found


def assert_no_agents_left(within: float = 30.0) -> None:
    deadline = time.monotonic() + within
    while live_agents() or ray_processes():
        assert time.monotonic() < deadline, f"left behind: actors {live_agents()}, processes {ray_processes()}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster():
    c = RayTestCluster()
    try:
        yield c
    finally:
        c.shutdown()
    leftovers = subprocess.run(["pgrep", "-f", "raylet|gcs_server"], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"Ray processes left after the cluster's shutdown: {leftovers}"


@pytest.fixture
def nodes(cluster):
    """Two worker nodes of 1 CPU; whatever a test adds or leaves is removed afterwards."""
    made = [cluster.add(), cluster.add()]
    try:
        yield made
    finally:
        assert_no_agents_left()
        cluster.reset()


def ray_args(cluster, *extra: str) -> list[str]:
    return ["--ray-address", cluster.address, "--discovery-interval", "0.2", "--heartbeat-timeout", "3",
            "--events", "EVENTS", *extra]


def run(job, cluster, args: list[str], command: list[str], **kw):
    args = [str(job.tmp / "events.jsonl") if a == "EVENTS" else a for a in args]
    return job.start(args, command, **kw)


# --- the tests --------------------------------------------------------------------------------------
def test_a_job_on_two_nodes_then_a_third_added_mid_run_joins(job, cluster, nodes):
    run(job, cluster, ray_args(cluster, "-np", "2", "--min-np", "1", "--max-np", "3"),
        sample_cmd(job, "--await-size=1:8:3", "--commit-every", "2"))
    wait_for(lambda: progress(job) >= 1001, 120, "training in epoch 1")
    third = cluster.add()
    r = job.finish(timeout=180)
    assert r.returncode == 0, r.output
    log = entries(job.tmp / "samples")
    assert {e["size"] for e in log} == {2, 3}
    assert_exactly_once(log)
    ev = events(job.tmp / "events.jsonl")
    started = [e["host"] for e in ev if e["kind"] == "worker_started"]
    assert sorted(started) == sorted([nodes[0].node_id, nodes[1].node_id, third.node_id]), started
    assert f"host {third.node_id} added (1 slot)" in r.stderr, r.stderr
    assert "aborted" not in r.stderr  # growing is no failure


def test_a_node_that_dies_mid_run_fails_over_and_the_survivor_recovers_in_place(job, cluster, nodes):
    # Rank 0 holds at epoch 2, batch 10 until the world is down to 1: a slow removal of the node
    # cannot let training end first.
    run(job, cluster, ray_args(cluster, "-np", "2", "--min-np", "1"),
        sample_cmd(job, "--commit-every", "2", "--sleep", "0.05", "--await-size=2:10:1"))
    wait_for(lambda: progress(job) >= 1005, 120, "training in epoch 1")
    cluster.kill(nodes[1], job.tag)
    r = job.finish(timeout=180)
    assert r.returncode == 0, r.output
    log = entries(job.tmp / "samples")
    assert {e["size"] for e in log} == {2, 1}, r.stderr
    assert_exactly_once(log)
    assert "round 0 aborted" in r.stderr, r.stderr
    # Ray's own logs (a raylet's state dump when its node dies) go to a file, not the console.
    foreign = [line for line in r.stderr.splitlines() if not re.match(r"\[(elasticrun|\d+)\]", line)]
    assert not foreign, "\n".join(foreign[:30])
    ev = events(job.tmp / "events.jsonl")
    # In place: the survivor is the process that started, no worker was started again.
    assert len([e for e in ev if e["kind"] == "worker_started"]) == 2
    assert any(e["kind"] == "host_blacklisted" and e["host"] == nodes[1].node_id for e in ev)


def test_a_node_ray_drains_leaves_at_the_next_step_without_a_rollback(job, cluster, nodes):
    # Rank 0 holds at epoch 2, batch 10 (checking for host updates) until the drained node has left,
    # so training cannot run out before the drain is heard however slowly the machine runs it.
    run(job, cluster, ray_args(cluster, "-np", "2", "--min-np", "1"),
        sample_cmd(job, "--commit-every", "1000", "--sleep", "0.05", "--await-size=2:10:1"))
    wait_for(lambda: progress(job) >= 1003, 120, "training in epoch 1")
    cluster.drain(nodes[1])
    wait_for(lambda: any(e["kind"] == "round_formed" and e.get("size") == 1 for e in events(job.tmp / "events.jsonl")),
             60, "the round without the drained node")
    cluster.remove(nodes[1])  # the node goes, as its notice said
    r = job.finish(timeout=180)
    assert r.returncode == 0, r.output
    assert f"host {nodes[1].node_id} is about to go (discovery lists it draining)" in r.stderr, r.stderr
    assert "aborted" not in r.stderr and "exited with code" not in r.stderr, r.stderr  # no rollback, no failure
    log = entries(job.tmp / "samples")
    assert {e["size"] for e in log} == {2, 1}, r.stderr
    assert_exactly_once(log)


def test_the_driver_killed_leaves_no_actor_and_no_process_behind(job, cluster, nodes):
    run(job, cluster, ray_args(cluster, "-np", "2"), sample_cmd(job, "--commit-every", "2", "--sleep", "0.05"))
    wait_for(lambda: progress(job) >= 3, 120, "training")
    assert len(live_agents()) == 2
    os.kill(job.proc.pid, signal.SIGKILL)
    job.proc.wait(30)
    started = time.monotonic()
    assert_no_agents_left(within=30)
    assert_nothing_left(job.tag, within=30)
    print(f"everything gone {time.monotonic() - started:.1f} s after the driver's SIGKILL")


def test_the_keys_are_in_no_actor_argument_log_or_environment(job, cluster, nodes, tmp_path):
    out = tmp_path / "probe"
    out.mkdir()
    token = "tok-" + os.urandom(8).hex()  # a credential in the user's environment, forwarded to every worker
    run(job, cluster, ray_args(cluster, "-np", "2"), [sys.executable, str(SCRIPTS / "key_probe.py"), str(out)],
        PROBE_TOKEN=token)
    wait_for(lambda: len(list(out.glob("*.json"))) == 2, 120, "both workers to report")
    infos = [json.loads(p.read_text()) for p in out.glob("*.json")]
    keys = infos[0]
    assert all(Path(f"/proc/{i['pid']}/environ").read_bytes().count(token.encode()) == 1 for i in infos)  # it got there
    secrets = [keys["secret"], keys["client_secret"], keys["client_public"], keys["server_public"]]
    assert token not in json.dumps([agents(), task_events()], default=str), "the environment in Ray's tables"
    assert {i["host"] for i in infos} == {nodes[0].node_id, nodes[1].node_id}
    seen = json.dumps([agents(), task_events()], default=str)
    assert "WorkerAgent" in seen
    for info in infos:
        for pid in (info["pid"], info["child"]):  # the worker and what it started
            environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
            assert not [s for s in secrets if s in environ], f"keys in the environment of {pid}"
        assert not info["fd_var_left"]
    for actor in live_agents():  # the agents' own environment
        environ = Path(f"/proc/{actor['pid']}/environ").read_bytes().decode(errors="replace")
        assert not [s for s in secrets if s in environ]
    assert not [s for s in secrets if s in seen], "keys in Ray's actor or task tables"
    logs = Path(ray._private.worker.global_worker.node.get_session_dir_path()) / "logs"
    for path in logs.rglob("*"):
        if path.is_file():
            text = path.read_bytes().decode(errors="replace")
            assert not [s for s in secrets if s in text], f"keys in Ray's log {path}"
    (out / "stop").touch()
    r = job.finish()
    assert r.returncode == 0, r.output


def test_check_reports_each_node_and_counts_only_free_resources(job, cluster, nodes):
    """Another Ray job holds the only CPU of one node: that node has no slot."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=1)
    class Hog:
        def ready(self) -> bool:
            return True

    hog = Hog.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[1].node_id, soft=False)).remote()
    ray.get(hog.ready.remote(), timeout=60)
    try:
        wait_for(lambda: ray._private.state.available_resources_per_node().get(nodes[1].node_id, {}).get("CPU", 0) == 0,
                 10, "Ray to see the CPU taken")
        r = subprocess.run([sys.executable, "-m", "elasticrun", "--check", "--ray-address", cluster.address],
                           capture_output=True, text=True, timeout=120, env=job.env())
    finally:
        ray.kill(hog)
    assert f"node {nodes[0].node_id} ({nodes[0].node_ip_address}): free CPU 1/1 -> 1 slot(s)" in r.stdout, r.stdout
    assert f"node {nodes[1].node_id} ({nodes[1].node_ip_address}): free CPU 0/1 -> 0 slot(s)" in r.stdout, r.stdout
    assert "1 slot(s) free on 1 node(s)" in r.stdout, r.stdout
    assert ", dead ->" not in r.stdout, r.stdout  # nodes removed by earlier tests are counted, not listed


def test_elasticrun_run_with_a_ray_address(job, cluster, nodes):
    code = ("import os, elasticrun\n"
            "def fn():\n"
            "    import elasticrun.torch as hvd\n"
            "    return hvd.rank(), hvd.size(), os.environ['ELASTICRUN_HOSTNAME']\n"
            f"print(sorted(elasticrun.run(fn, np=2, ray_address={cluster.address!r})))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, env=job.env(),
                       cwd=job.tmp)
    assert r.returncode == 0, r.stderr
    ranks = eval(r.stdout.strip().splitlines()[-1])
    assert [x[:2] for x in ranks] == [(0, 2), (1, 2)]
    assert {x[2] for x in ranks} == {nodes[0].node_id, nodes[1].node_id}
