"""The discovery recipes that read notices (examples/discovery/) print what elasticrun expects.

Each recipe runs for real, as elasticrun runs it, against stand-ins for what it talks to:

- a fake metadata server (a ``http.server`` on 127.0.0.1, in this process) that answers like
  EC2's IMDSv2 (session token handshake, 401 without a token, 404 pages when there is no
  notice, the JSON of ``spot/instance-action`` and ``events/recommendations/rebalance``) and
  like Compute Engine's (403 without ``Metadata-Flavor: Google``, ``TRUE``/``FALSE`` for
  ``instance/preempted``, the values of ``instance/maintenance-event``); one per host, under
  ``/HOST/``;
- tools on the PATH (tests/data/discovery/fakebin) that print recorded output of the real
  format: ``aws``, ``gcloud``, ``kubectl -o json``, ``scontrol show node``, and an ``ssh``
  that runs the remote command locally with the host's fake metadata server.

The output is checked with elasticrun's own parser, and no process a recipe started may be
left running when it returns.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from elasticrun.common.hosts import parse_discovery_output

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "examples" / "discovery"
DATA = REPO / "tests" / "data" / "discovery"

# What IMDS answers for a path it has nothing at (the same page for every missing item).
IMDS_404 = """<?xml version="1.0" encoding="iso-8859-1"?>
<!DOCTYPE html PUBLIC "-//W3C//DTD XHTML 1.0 Transitional//EN"
\t"http://www.w3.org/TR/xhtml1/DTD/xhtml1-transitional.dtd">
<html xmlns="http://www.w3.org/1999/xhtml" xml:lang="en" lang="en">
 <head>
  <title>404 - Not Found</title>
 </head>
 <body>
  <h1>404 - Not Found</h1>
 </body>
</html>
"""


@dataclass
class Instance:
    """What one fake host's metadata server holds."""

    action: dict | None = None  # EC2 spot/instance-action
    rebalance: dict | None = None  # EC2 events/recommendations/rebalance
    token_status: int = 200  # answer to the IMDSv2 token PUT
    preempted: str = "FALSE"  # GCE instance/preempted
    maintenance: str = "NONE"  # GCE instance/maintenance-event
    hang: bool = False  # accept the connection, never answer (until the test ends)
    tokens: set = field(default_factory=set)


class MetadataServer:
    """EC2 IMDSv2 and GCE metadata, one fake instance per first path segment."""

    def __init__(self):
        self.instances: dict[str, Instance] = {}
        self.requests: list[tuple[str, str, str, dict]] = []  # host, method, path, headers
        self.release = threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_PUT(self):
                self._answer("PUT")

            def do_GET(self):
                self._answer("GET")

            def _send(self, status, body, content_type="text/plain", headers=()):
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers:
                    self.send_header(name, value)
                self.end_headers()
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (the hanging instance)

            def _answer(self, method):
                _, host, path = self.path.split("/", 2)
                path = "/" + path
                server.requests.append((host, method, path, dict(self.headers)))
                inst = server.instances.get(host)
                if inst is None:
                    return self._send(404, IMDS_404, "text/html")
                if inst.hang:
                    server.release.wait(60)
                    return self._send(503, "released at the end of the test")
                if path.startswith("/latest/"):
                    return self._ec2(inst, method, path)
                if path.startswith("/computeMetadata/"):
                    return self._gce(inst, method, path)
                return self._send(404, IMDS_404, "text/html")

            def _ec2(self, inst, method, path):
                if path == "/latest/api/token":
                    if method != "PUT":
                        return self._send(405, "")
                    ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "")
                    if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                        return self._send(400, "")
                    if inst.token_status != 200:
                        return self._send(inst.token_status, "")
                    token = secrets.token_urlsafe(40)
                    inst.tokens.add(token)
                    return self._send(200, token, headers=[("X-aws-ec2-metadata-token-ttl-seconds", ttl)])
                if self.headers.get("X-aws-ec2-metadata-token") not in inst.tokens:
                    return self._send(401, "")  # the instance requires IMDSv2
                if path == "/latest/meta-data/spot/instance-action" and inst.action:
                    return self._send(200, json.dumps(inst.action))
                if path == "/latest/meta-data/events/recommendations/rebalance" and inst.rebalance:
                    return self._send(200, json.dumps(inst.rebalance))
                return self._send(404, IMDS_404, "text/html")

            def _gce(self, inst, method, path):
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, "<!DOCTYPE html>\n<html lang=en>\n  <title>Error 403 (Forbidden)!!1</title>\n"
                                           "  <p>Your client does not have permission to get URL <code>%s</code> from this "
                                           "server. Missing Metadata-Flavor:Google header.\n" % path, "text/html")
                values = {"/computeMetadata/v1/instance/preempted": inst.preempted,
                          "/computeMetadata/v1/instance/maintenance-event": inst.maintenance}
                if path not in values:
                    return self._send(404, "Not Found", "text/html")
                return self._send(200, values[path], "application/text",
                                  headers=[("Metadata-Flavor", "Google"), ("Server", "Metadata Server for VM")])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def metadata():
    server = MetadataServer()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def env(tmp_path, metadata):
    """The environment a recipe gets from elasticrun, with the fake tools first on the PATH."""
    log = tmp_path / "log"
    log.mkdir()
    e = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICRUN_")}
    e.update(PATH=f"{DATA / 'fakebin'}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{e.get('PATH', '')}",
             FAKE_LOG=str(log), FAKE_METADATA=metadata.url,
             # the metadata service must be asked directly, never through a proxy
             http_proxy="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    return e


def _session_processes(sid: int) -> list[str]:
    """Live (non-zombie) processes of session `sid`: what a recipe left behind."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append(text[:80])
    return found


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def listing(self):
        """stdout as elasticrun reads it: (hosts with slots, draining hosts); it must be clean."""
        parsed = parse_discovery_output(self.stdout, 1)
        assert not parsed.errors and not parsed.warnings, (parsed.errors, parsed.warnings, self.stdout)
        return parsed.hosts, parsed.draining


def run(script: str, *args: str, env: dict, timeout: float = 30) -> Run:
    """Run a recipe as elasticrun does (own session, stdin /dev/null); fail if it leaves a
    process running (and kill whatever it left)."""
    start = time.monotonic()
    proc = subprocess.Popen([str(RECIPES / script), *args], env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} did not finish within {timeout} s\n{out}\n{err}")
    finally:
        deadline = time.monotonic() + 3
        while (left := _session_processes(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        for line in left:
            try:
                os.kill(int(line.split()[0]), signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, f"{script} left processes running: {left}"
    return Run(proc.returncode, out, err, time.monotonic() - start)


def log(env: dict, tool: str) -> list[str]:
    path = Path(env["FAKE_LOG"]) / f"{tool}.log"
    return path.read_text().splitlines() if path.exists() else []


# --- EC2: aws_spot_notice.sh on the instance, aws_spot.sh on the driver ---------------------

def imds(env: dict, name: str) -> dict:
    """The environment of aws_spot_notice.sh run on instance `name` itself."""
    return dict(env, IMDS_URL=f"{env['FAKE_METADATA']}/{name}")


def test_aws_notice_nothing_scheduled(metadata, env):
    metadata.instances["i-a"] = Instance()
    r = run("aws_spot_notice.sh", env=imds(env, "i-a"))
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    # the IMDSv2 handshake: a token first, then both notices asked with it
    calls = [(m, p) for h, m, p, _ in metadata.requests]
    assert calls == [("PUT", "/latest/api/token"), ("GET", "/latest/meta-data/spot/instance-action"),
                     ("GET", "/latest/meta-data/events/recommendations/rebalance")]
    assert 1 <= int(metadata.requests[0][3]["X-aws-ec2-metadata-token-ttl-seconds"]) <= 21600
    assert metadata.requests[1][3]["X-aws-ec2-metadata-token"] in metadata.instances["i-a"].tokens


@pytest.mark.parametrize("action", ["terminate", "stop", "hibernate"])
def test_aws_notice_interruption(metadata, env, action):
    metadata.instances["i-a"] = Instance(action={"action": action, "time": "2026-11-23T14:05:00Z"})
    r = run("aws_spot_notice.sh", env=imds(env, "i-a"))
    assert r.returncode == 0 and r.stderr == ""
    assert r.stdout == f"draining  # spot interruption notice: {action} at 2026-11-23T14:05:00Z\n"
    hosts, draining = Run(0, "i-a " + r.stdout, "", 0).listing
    assert draining == {"i-a"}


def test_aws_notice_rebalance_recommendation_unless_ignored(metadata, env):
    metadata.instances["i-a"] = Instance(rebalance={"noticeTime": "2026-11-23T13:41:27Z"})
    r = run("aws_spot_notice.sh", env=imds(env, "i-a"))
    assert (r.returncode, r.stdout) == (0, "draining  # rebalance recommendation since 2026-11-23T13:41:27Z\n")
    r = run("aws_spot_notice.sh", env=dict(imds(env, "i-a"), REBALANCE="ignore"))
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "")
    r = run("aws_spot_notice.sh", env=dict(imds(env, "i-a"), REBALANCE="maybe"))
    assert r.returncode == 1 and r.stderr == "aws_spot_notice.sh: REBALANCE must be drain or ignore, not 'maybe'\n"


def test_aws_notice_cannot_tell(metadata, env):
    # the token refused (e.g. the metadata service is turned off for tokens), no service at all
    metadata.instances["i-a"] = Instance(token_status=403)
    r = run("aws_spot_notice.sh", env=imds(env, "i-a"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines()[-1] == \
        f"aws_spot_notice.sh: this instance: the metadata service at {env['FAKE_METADATA']}/i-a refused a session token (HTTP 403)"
    r = run("aws_spot_notice.sh", env=dict(env, IMDS_URL="http://127.0.0.1:9"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines()[-1].startswith("aws_spot_notice.sh: this instance: no answer from the metadata service")


def test_aws_notice_waits_a_bounded_time(metadata, env):
    metadata.instances["i-a"] = Instance(hang=True)
    r = run("aws_spot_notice.sh", env=dict(imds(env, "i-a"), METADATA_TIMEOUT="1"))
    assert r.returncode == 1 and r.stdout == "" and r.seconds < 5, r
    assert "no answer from the metadata service" in r.stderr


def test_aws_spot_lists_instances_and_marks_those_with_notices(metadata, env):
    metadata.instances.update({
        "10.1.0.11": Instance(),
        "10.1.0.12": Instance(action={"action": "terminate", "time": "2026-11-23T14:05:00Z"}),
        "10.1.0.13": Instance(rebalance={"noticeTime": "2026-11-23T13:41:27Z"}),
        # 10.1.0.14: SSH refused
    })
    e = dict(env, TAG="Name=trainer", SLOTS="8", FAKE_SSH_DOWN="10.1.0.14",
             ELASTICRUN_SSH_PORT="2222", ELASTICRUN_SSH_USER="train")
    r = run("aws_spot.sh", env=e)
    assert r.returncode == 0, r
    hosts, draining = r.listing
    assert hosts == {"10.1.0.11": 8, "10.1.0.12": 8, "10.1.0.13": 8, "10.1.0.14": 8}
    assert draining == {"10.1.0.12", "10.1.0.13"}
    assert r.stdout.splitlines() == [
        "10.1.0.11:8",
        "10.1.0.12:8 draining  # spot interruption notice: terminate at 2026-11-23T14:05:00Z",
        "10.1.0.13:8 draining  # rebalance recommendation since 2026-11-23T13:41:27Z",
        "10.1.0.14:8",
    ]
    assert "ssh: connect to host 10.1.0.14 port 22: Connection refused" in r.stderr
    assert "aws_spot.sh: 10.1.0.14: spot notices unknown (see above); listed as usable" in r.stderr
    # the listing asked EC2 for the tagged running spot instances
    (aws_call,) = log(e, "aws")
    assert "Name=tag:Name,Values=trainer" in aws_call and "Name=instance-lifecycle,Values=spot" in aws_call
    # one SSH call per instance, non-interactive, with elasticrun's SSH settings
    calls = log(e, "ssh")
    assert len(calls) == 4
    assert all("-o BatchMode=yes" in c and "-p 2222" in c and "-l train" in c and c.endswith("bash -s") for c in calls)
    # REBALANCE=ignore reaches the script on the hosts (the fake ssh passes on no environment)
    r = run("aws_spot.sh", env=dict(e, REBALANCE="ignore"))
    assert r.returncode == 0 and r.listing[1] == {"10.1.0.12"}


def test_aws_spot_notices_are_bounded_and_optional(metadata, env):
    metadata.instances.update({ip: Instance() for ip in ("10.1.0.11", "10.1.0.12", "10.1.0.13")})
    metadata.instances["10.1.0.13"].action = {"action": "stop", "time": "2026-11-23T14:05:00Z"}
    metadata.instances["10.1.0.12"].hang = True  # its metadata service never answers
    e = dict(env, TAG="Name=trainer", FAKE_SSH_HANG="10.1.0.14", NOTICE_TIMEOUT="2", METADATA_TIMEOUT="1")
    r = run("aws_spot.sh", env=e)
    assert r.returncode == 0 and r.seconds < 8, r
    assert r.listing == ({"10.1.0.11": 1, "10.1.0.12": 1, "10.1.0.13": 1, "10.1.0.14": 1}, {"10.1.0.13"})
    assert "aws_spot_notice.sh: 10.1.0.14: no answer over SSH within 2s (NOTICE_TIMEOUT)" in r.stderr
    assert "aws_spot_notice.sh: 10.1.0.12: no answer from the metadata service" in r.stderr
    # NOTICES=0: the listing alone, no SSH at all
    before = len(log(e, "ssh"))
    r = run("aws_spot.sh", env=dict(e, NOTICES="0"))
    assert r.returncode == 0 and r.listing == ({"10.1.0.11": 1, "10.1.0.12": 1, "10.1.0.13": 1, "10.1.0.14": 1}, set())
    assert len(log(e, "ssh")) == before


def test_aws_spot_without_ssh_fails_clearly(env):
    r = run("aws_spot.sh", env=dict(env, TAG="Name=trainer", SSH="no-such-ssh"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == ('aws_spot.sh: ssh not found ("no-such-ssh" is not on PATH; set SSH to its path, '
                        'or NOTICES=0 to list instances without their spot notices)\n')


# --- Compute Engine: gce_notice.sh, gce.sh ---------------------------------------------------

def gce(env: dict, name: str) -> dict:
    return dict(env, METADATA_URL=f"{env['FAKE_METADATA']}/{name}")


@pytest.mark.parametrize("preempted, maintenance, expected", [
    ("FALSE", "NONE", ""),
    ("FALSE", "MIGRATE_ON_HOST_MAINTENANCE", ""),  # a live migration keeps the VM
    ("TRUE", "NONE", "draining  # preempted: the VM stops within about 30 s\n"),
    ("FALSE", "TERMINATE_ON_HOST_MAINTENANCE",
     "draining  # maintenance-event TERMINATE_ON_HOST_MAINTENANCE: the VM will be stopped for host maintenance\n"),
])
def test_gce_notice(metadata, env, preempted, maintenance, expected):
    metadata.instances["vm-a"] = Instance(preempted=preempted, maintenance=maintenance)
    r = run("gce_notice.sh", env=gce(env, "vm-a"))
    assert (r.returncode, r.stdout, r.stderr) == (0, expected, "")
    assert all(headers.get("Metadata-Flavor") == "Google" for _, _, _, headers in metadata.requests)


def test_gce_notice_maintenance_can_be_ignored_and_odd_answers_fail(metadata, env):
    metadata.instances["vm-a"] = Instance(maintenance="TERMINATE_ON_HOST_MAINTENANCE")
    r = run("gce_notice.sh", env=dict(gce(env, "vm-a"), MAINTENANCE="ignore"))
    assert (r.returncode, r.stdout) == (0, "")
    metadata.instances["vm-a"] = Instance(preempted="maybe")
    r = run("gce_notice.sh", env=gce(env, "vm-a"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"gce_notice.sh: this VM: unexpected answer from {env['FAKE_METADATA']}/vm-a"
                        "/computeMetadata/v1/instance/preempted: HTTP 200 maybe\n")
    r = run("gce_notice.sh", env=gce(env, "no-such-vm"))
    assert r.returncode == 1 and "HTTP 404" in r.stderr


def test_gce_lists_vms_and_marks_those_with_notices(metadata, env):
    metadata.instances.update({
        "10.2.0.21": Instance(),
        "10.2.0.22": Instance(preempted="TRUE"),
        "10.2.0.23": Instance(maintenance="TERMINATE_ON_HOST_MAINTENANCE"),
    })
    e = dict(env, LABEL="role=trainer", SLOTS="4", ZONES="us-central1-a,us-central1-b")
    r = run("gce.sh", env=e)
    assert r.returncode == 0 and r.stderr == "", r
    assert r.listing == ({"10.2.0.21": 4, "10.2.0.22": 4, "10.2.0.23": 4}, {"10.2.0.22", "10.2.0.23"})
    (call,) = log(e, "gcloud")
    assert "--filter=labels.role=trainer AND status=RUNNING" in call and "--zones=us-central1-a,us-central1-b" in call
    r = run("gce.sh", env=dict(e, MAINTENANCE="ignore"))
    assert r.listing[1] == {"10.2.0.22"}
    r = run("gce.sh", env=dict(e, LABEL="Role"))
    assert r.returncode == 1 and r.stderr.startswith("gce.sh: set LABEL to KEY=VALUE")


# --- Kubernetes: kubernetes.sh ---------------------------------------------------------------

def test_kubernetes_marks_pods_on_leaving_nodes_and_deleted_pods(env):
    e = dict(env, SELECTOR="app=trainer", NAMESPACE="ml", SLOTS="1")
    r = run("kubernetes.sh", env=e)
    assert r.returncode == 0 and r.stderr == "", r
    hosts, draining = r.listing
    # trainer-4 is Pending, trainer-8 Succeeded: not listed
    assert hosts == {ip: 1 for ip in ("10.0.1.5", "10.0.2.6", "10.0.3.7", "10.0.1.8", "10.0.4.9", "10.0.5.10", "10.0.6.11")}
    assert draining == {
        "10.0.2.6",   # its node is cordoned
        "10.0.3.7",   # the cluster autoscaler is removing its node
        "10.0.1.8",   # the pod is being deleted
        "10.0.5.10",  # aws-node-termination-handler saw a spot interruption notice for its node
        "10.0.6.11",  # its node is unreachable
    }  # 10.0.1.5 (a PreferNoSchedule soft taint) and 10.0.4.9 (the GPU taint) stay
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines() if " " in line)
    assert lines["10.0.2.6:1"] == "draining  # node ip-10-0-2-20.ec2.internal cordoned, taint node.kubernetes.io/unschedulable:NoSchedule"
    assert lines["10.0.1.8:1"] == "draining  # pod trainer-3 deleted at 2026-11-23T14:02:11Z"
    assert log(e, "kubectl") == ["get pods -l app=trainer --request-timeout=5s -o json -n ml",
                                 "get nodes --request-timeout=5s -o json"]


def test_kubernetes_names_taints_and_node_selector(env):
    e = dict(env, SELECTOR="app=trainer", HOST_FIELD="name", SLOTS="2",
             DRAIN_TAINTS="ToBeDeletedByClusterAutoscaler", NODE_SELECTOR="eks.amazonaws.com/nodegroup=gpu")
    r = run("kubernetes.sh", env=e)
    assert r.returncode == 0, r
    hosts, draining = r.listing
    assert set(hosts) == {f"trainer-{i}" for i in (0, 1, 2, 3, 5, 6, 7)} and set(hosts.values()) == {2}
    # only the listed taint counts now; cordoned nodes and deleted pods always do
    assert draining == {"trainer-1", "trainer-2", "trainer-3", "trainer-6"}
    assert log(e, "kubectl")[1] == "get nodes --request-timeout=5s -o json -l eks.amazonaws.com/nodegroup=gpu"


def test_kubernetes_without_node_access(env):
    e = dict(env, SELECTOR="app=trainer", FAKE_NODES_FORBIDDEN="1")
    r = run("kubernetes.sh", env=e)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        'Error from server (Forbidden): nodes is forbidden: User "system:serviceaccount:ml:trainer" cannot list '
        'resource "nodes" in API group "" at the cluster scope',
        "kubernetes.sh: kubectl get nodes failed (see above); it needs list on nodes (a ClusterRole), or set "
        "NOTICES=0 to skip node notices"]
    r = run("kubernetes.sh", env=dict(e, NOTICES="0"))
    assert r.returncode == 0 and r.listing[1] == {"10.0.1.8"}  # the deleted pod still is
    r = run("kubernetes.sh", env=dict(e, NOTICES="0", PYTHON="no-such-python"))
    assert r.returncode == 1
    assert r.stderr == "kubernetes.sh: no-such-python not found (it reads kubectl's JSON; set PYTHON to a Python 3)\n"


# --- Slurm: slurm.sh -------------------------------------------------------------------------

def test_slurm_marks_draining_nodes(env):
    e = dict(env, SLURM_JOB_NODELIST="gpu-node[01-06]", SLURM_NTASKS_PER_NODE="8(x6)")
    r = run("slurm.sh", env=e)
    assert r.returncode == 0 and r.stderr == "", r
    hosts, draining = r.listing
    assert hosts == {f"gpu-node0{i}": 8 for i in range(1, 7)}
    assert draining == {"gpu-node02", "gpu-node03", "gpu-node05"}
    assert r.stdout.splitlines()[1:3] == [
        "gpu-node02:8 draining  # MIXED+DRAIN: ECC errors on GPU 3 [root@2026-11-23T13:55:12]",
        "gpu-node03:8 draining  # ALLOCATED+DRAIN: maintenance: replace PSU, State=DOWN after [admin@2026-11-23T13:58:40]",
    ]
    assert log(e, "scontrol") == ["show hostnames gpu-node[01-06]", "show node gpu-node[01-06]"]


def test_slurm_exclude_file_notices_off_and_controller_down(env, tmp_path):
    (tmp_path / "exclude").write_text("gpu-node02\n")
    e = dict(env, SLURM_JOB_NODELIST="gpu-node[01-06]", EXCLUDE_FILE=str(tmp_path / "exclude"))
    r = run("slurm.sh", env=e)
    assert r.returncode == 0 and r.listing == ({f"gpu-node0{i}": 1 for i in (1, 3, 4, 5, 6)}, {"gpu-node03", "gpu-node05"})
    r = run("slurm.sh", env=dict(e, FAKE_SLURMCTLD_DOWN="1"))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "slurm_load_node error: Unable to contact slurm controller (connect failure)",
        "slurm.sh: 'scontrol show node gpu-node[01-06]' failed (see above); NOTICES=0 skips the drain check"]
    r = run("slurm.sh", env=dict(e, FAKE_SLURMCTLD_DOWN="1", NOTICES="0"))
    assert r.returncode == 0 and r.listing == ({f"gpu-node0{i}": 1 for i in (1, 3, 4, 5, 6)}, set())


@pytest.mark.parametrize("state, leaving", [
    ("IDLE", False), ("MIXED", False), ("ALLOCATED+COMPLETING", False), ("IDLE+DRAIN", True),
    ("MIXED+DRAIN", True), ("DRAINING", True), ("DRAINED", True), ("DOWN*+DRAIN", True),
    ("ALLOCATED+DRAIN+REBOOT_REQUESTED", True), ("MIXED+FAIL", True), ("IDLE+POWERED_DOWN", False),
])
def test_slurm_states(env, tmp_path, state, leaving):
    """Every spelling of a drain: scontrol's BASE+FLAGS and sinfo-style long names."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text(
        "#!/bin/sh\n"
        'if [ "$2" = hostnames ]; then echo n1; exit; fi\n'
        f"echo 'NodeName=n1 Arch=x86_64 CoresPerSocket=4 CPUAlloc=4 CPUEfctv=8 CPUTot=8 CPULoad=3.9 "
        f"State={state} ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A Partitions=debug'\n")
    (fake / "scontrol").chmod(0o755)
    r = run("slurm.sh", env=dict(env, SLURM_JOB_NODELIST="n1", SCONTROL=str(fake / "scontrol")))
    assert r.returncode == 0 and r.listing == ({"n1": 1}, {"n1"} if leaving else set())


def test_recorded_outputs_are_what_the_tools_print():
    """Guard the recordings against edits that would make the tests pass for the wrong reason."""
    for name in ("kubectl_get_pods.json", "kubectl_get_nodes.json"):
        listing = json.loads((DATA / name).read_text())
        assert listing["kind"] == "List" and listing["apiVersion"] == "v1"
        assert {item["kind"] for item in listing["items"]} == {"Pod" if "pods" in name else "Node"}
    records = (DATA / "scontrol_show_node.txt").read_text().split("\n\n")
    assert all(re.match(r"NodeName=\S+ Arch=", r) and re.search(r"^   State=\S+ ", r, re.M) for r in records if r.strip())
