"""``elasticrun --check``: is this installation usable, and can each host run workers?

Like ``horovodrun --check-build``, plus the host checks: for every host of ``-H``,
``--hostfile`` or one run of ``--host-discovery-script``, a host of this machine must have a
Python that imports torch and elasticrun; another host must accept the SSH connection
(``elasticrun/driver/launch/ssh.py``: same port, user, keys and known_hosts rules as a job), run
``--remote-python`` in the remote working directory and import torch and elasticrun there.
One line per check; exit status 0 when everything is OK, 1 otherwise (2 for bad arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from typing import Callable

from elasticrun.common import warmstart
from elasticrun.common.hosts import HostSpecError, parse_hostfile, parse_hosts_arg
from elasticrun.discovery.sources import DiscoveryError, ScriptDiscovery, discovery_command
from elasticrun.common.version import VERSION
from elasticrun.driver.cli import config
from elasticrun.driver.launch.local import is_local_host
from elasticrun.driver.cli.parser import build_parser, read_hostfile
from elasticrun.driver.launch.ssh import HostConnections, LaunchError, SSHOptions

# Run by the (local or remote) Python: argv[1] is the working directory to import from.
#: The probes' first line: ``-c`` puts the current directory first on sys.path, where a
#: neighbour's ``json.py`` in a shared directory would run as you (see warmstart.OWN_MAIN).
_NO_CWD = warmstart.NO_CWD + "\n"
_PROBE = _NO_CWD + r'''
import json, os, sys
r = {"python": sys.version.split()[0]}
try:
    os.chdir(sys.argv[1])
    sys.path.insert(0, os.getcwd())
except OSError as e:
    r["cwd_error"] = "%s: %s" % (sys.argv[1], e.strerror)
for m in ("torch", "elasticrun"):
    try:
        mod = __import__(m)
        r[m] = getattr(mod, "__version__", None)
        if r[m] is None:  # not the package: a directory of that name in the working directory
            where = getattr(mod, "__file__", None) or list(getattr(mod, "__path__", []) or ["?"])[0]
            r[m + "_error"] = "it imports %s from %s, which is not the package (a directory named %s in the " \
                "working directory?)" % (m, where, m)
    except Exception as e:
        r[m + "_error"] = "%s: %s" % (type(e).__name__, e)
try:
    import torch, torch.distributed as dist
    r["nccl"] = dist.is_available() and dist.is_nccl_available()
    r["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
except Exception:
    pass
print("ELASTICRUN-CHECK " + json.dumps(r))
'''


def wants_check(argv: list[str]) -> bool:
    """True if the command line asks for --check (not counting the training command's args)."""
    if not {"--check", "-cb", "--check-build"} & set(argv):
        return False
    probe = build_parser()
    for action in probe._actions:
        action.required = False
    for group in probe._mutually_exclusive_groups:
        group.required = False
    options, _ = config.split_command(probe, argv)
    return bool(probe.parse_args(options).check)


# --- this installation -----------------------------------------------------------------------
# Run by this machine's Python in a process of its own: the driver never imports torch.
_TORCH_PROBE = _NO_CWD + r'''
import json
r = {}
try:
    import torch
    import torch.distributed as dist
    r["torch"] = torch.__version__
    r["distributed"] = dist.is_available()
    if r["distributed"]:
        r["gloo"] = dist.is_gloo_available()
        r["nccl"] = dist.is_nccl_available()
    r["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
except Exception as e:
    r["error"] = "%s: %s" % (type(e).__name__, e)
print("ELASTICRUN-CHECK " + json.dumps(r))
'''


def backend_line(backend: str, nccl: bool, gpus: int, where: str = "here") -> tuple[bool, str]:
    """What carries CUDA tensors on a machine with ``gpus`` GPUs (``nccl``: NCCL in its torch),
    under ``--backend``: a failure only when nccl is asked for and cannot run there."""
    can = nccl and gpus > 0
    if backend == "gloo":
        return True, "CUDA tensors: gloo (--backend gloo)"
    if can:
        return True, (f"CUDA tensors: NCCL {where} ({gpus} GPU(s): up to {gpus} worker(s) per host; more fall back "
                      f"to gloo)" if backend == "auto" else f"CUDA tensors: NCCL {where} (--backend nccl, {gpus} GPU(s))")
    why = "no NCCL in this torch" if not nccl else "no GPU"
    if backend == "nccl":
        return False, f"--backend nccl: NCCL cannot run {where} ({why})"
    return True, f"CUDA tensors: gloo {where} ({why}; --backend auto)"


def _installation(timeout: float = 120.0, backend: str = "auto") -> list[tuple[bool, str]]:
    lines: list[tuple[bool, str]] = [(True, f"elasticrun {VERSION}, python {sys.version.split()[0]} "
                                            f"({sys.executable})")]
    try:
        proc = subprocess.run([sys.executable, "-c", _TORCH_PROBE], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
        r = _parse_probe(proc.stdout) or {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-300:]}"}
    except subprocess.TimeoutExpired:
        r = {"error": f"`import torch` did not finish within {timeout:g} s"}
    if "error" in r:
        lines.append((False, f"torch: cannot import ({r['error']})"))
    else:
        lines.append((True, f"torch {r['torch']}"))
        if not r["distributed"]:
            lines.append((False, "torch.distributed: not available in this torch build"))
        else:
            lines.append((r["gloo"], "gloo: available" if r["gloo"] else "gloo: not available (elasticrun's "
                                                                         "collectives need it)"))
            lines.append((True, f"nccl: {'available' if r['nccl'] else 'not available'} ({r['gpus']} CUDA "
                                f"device(s); not required)"))
            lines.append(backend_line(backend, bool(r["nccl"]), int(r["gpus"])))
    try:
        import zmq

        curve = zmq.has("curve")
        lines.append((curve, f"pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}, CURVE "
                             + ("available: the driver admits only the job's CURVE key, and every control "
                                "message is also authenticated with HMAC-SHA256)" if curve else
                                "NOT available: the driver cannot keep unauthenticated peers off its sockets "
                                "and refuses to run; reinstall the pyzmq wheel, which bundles it)")))
    except Exception as exc:  # noqa: BLE001
        lines.append((False, f"pyzmq: cannot import ({type(exc).__name__}: {exc})"))
    for name in ("paramiko", "cloudpickle"):
        try:
            module = __import__(name)
            lines.append((True, f"{name} {getattr(module, '__version__', '?')}"))
        except Exception as exc:  # noqa: BLE001
            lines.append((False, f"{name}: cannot import ({type(exc).__name__}: {exc})"))
    return lines


# --- hosts -----------------------------------------------------------------------------------
def _verdict(result: dict, python: str, where: str, backend: str = "auto") -> tuple[bool, str]:
    if "cwd_error" in result:
        return False, f"{where}: no working directory {result['cwd_error']} (see --remote-cwd)"
    for m in ("torch", "elasticrun"):
        if m + "_error" in result:
            return False, f"{where}: {python} (python {result['python']}) cannot import {m}: {result[m + '_error']}"
    ok, devices = backend_line(backend, bool(result.get("nccl")), int(result.get("gpus") or 0), "there")
    return ok, (f"{where}: python {result['python']}, torch {result['torch']}, elasticrun {result['elasticrun']}; "
                f"{devices}")


def _parse_probe(out: str) -> dict | None:
    for line in out.splitlines():
        if line.startswith("ELASTICRUN-CHECK "):
            try:
                return json.loads(line[len("ELASTICRUN-CHECK "):])
            except ValueError:
                return None
    return None


def _check_local(timeout: float, backend: str = "auto") -> tuple[bool, str]:
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE, os.getcwd()], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False, f"this machine: {sys.executable} did not answer within {timeout:g} s"
    result = _parse_probe(proc.stdout)
    if result is None:
        return False, f"this machine: {sys.executable} failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
    return _verdict(result, sys.executable, "this machine", backend)


def _check_ssh(host: str, a: argparse.Namespace, timeout: float) -> tuple[bool, str]:
    opts = SSHOptions(port=a.ssh_port, user=a.ssh_user,
                      identity_file=os.path.abspath(a.ssh_identity_file) if a.ssh_identity_file else None,
                      known_hosts=os.path.abspath(a.ssh_known_hosts) if a.ssh_known_hosts else None,
                      accept_unknown_hosts=a.ssh_accept_unknown_hosts, connect_timeout=timeout,
                      remote_cwd=a.remote_cwd, python=a.remote_python)
    conn = HostConnections(host, opts)
    deadline = time.monotonic() + timeout
    try:
        try:
            chan = conn.open_session(deadline)
        except LaunchError as exc:
            return False, f"SSH: {exc}"
        cwd = opts.remote_cwd or os.getcwd()
        command = " ".join(["exec", shlex.quote(opts.python), "-c", shlex.quote(_PROBE), shlex.quote(cwd)])
        chan.settimeout(max(0.5, deadline - time.monotonic()))
        try:
            chan.exec_command(command)
            chan.shutdown_write()
            out = chan.makefile("r").read().decode(errors="replace")
            err = chan.makefile_stderr("r").read().decode(errors="replace")
            status = chan.recv_exit_status()
        except OSError as exc:  # socket.timeout included
            return False, f"SSH to {conn.target} OK, but {opts.python} did not answer within {timeout:g} s ({exc})"
        finally:
            chan.close()
        result = _parse_probe(out)
        if result is None:
            if status == 127:
                return False, (f"SSH to {conn.target} OK, but {opts.python!r} is not on the remote login PATH "
                               f"(see --remote-python)")
            return False, f"SSH to {conn.target} OK, but {opts.python} failed (exit {status}): {err.strip()[-300:]}"
        return _verdict(result, opts.python, f"SSH to {conn.target} OK", a.backend)
    finally:
        conn.close()


def _check_host(host: str, a: argparse.Namespace, timeout: float) -> tuple[bool, str]:
    local = is_local_host(host)
    if a.launcher == "ssh" or (a.launcher == "auto" and ("@" in host or not local)):
        return _check_ssh(host, a, timeout)
    if not local:
        return False, "not this machine, and --launcher local never uses SSH"
    return _check_local(timeout, a.backend)


def _fixed_hosts(parser: argparse.ArgumentParser, a: argparse.Namespace) -> dict[str, int] | None:
    """-H / --hostfile, parsed strictly like a job's (bad ones exit 2 before any check runs)."""
    try:
        if a.hosts is not None:
            return parse_hosts_arg(a.hosts, a.slots_per_host)
        if a.hostfile is not None:
            return parse_hostfile(read_hostfile(a.hostfile), a.slots_per_host, a.hostfile)
    except (HostSpecError, ValueError) as exc:
        parser.error(str(exc))
    return None


def _discovered(a: argparse.Namespace, say: Callable[[str], None]) -> dict[str, int]:
    script = a.host_discovery_script
    try:
        found = ScriptDiscovery(script, a.slots_per_host, a.discovery_timeout).discover()
    except DiscoveryError as exc:
        say(f"FAIL  discovery: {exc}".replace("\n", "\n      "))
        return {}
    for problem in found.errors:
        say(f"FAIL  discovery: {script} {problem} (skipped)")
    if found.more_errors:
        say(f"FAIL  discovery: {script} printed {found.more_errors:,} more invalid lines (skipped)")
    for warning in found.warnings:
        say(f"WARN  discovery: {script} {warning}")
    if found.more_warnings:
        say(f"WARN  discovery: {script} and {found.more_warnings:,} more warnings")
    if not found.hosts:
        say(f"FAIL  discovery: {script} printed no valid hosts")
    else:
        say(f"OK    discovery: {script} lists " + ",".join(f"{h}:{s}" for h, s in found.hosts.items()))
    return found.hosts


def _ray_cluster(a: argparse.Namespace, say: Callable[[str], None]) -> None:
    """--check --ray-address: join the cluster and report each node (id, IP, free resources,
    slots for one worker's needs). Nothing is started there."""
    from elasticrun.discovery.ray_nodes import ray_missing

    if ray_missing():
        say(f"FAIL  {' and '.join(ray_missing())}: not installed (pip install 'ray==2.60.0' 'pynacl>=1.5')")
        return
    from elasticrun.discovery.ray_nodes import Requirement, ask_ray, describe_node, host_list
    from elasticrun.driver.launch.ray_launcher import connect, disconnected

    try:
        connected = connect(a.ray_address)
    except ConnectionError as exc:
        say(f"FAIL  {exc}")
        return
    import ray

    try:
        need = Requirement(a.ray_cpus_per_worker, a.ray_gpus_per_worker, dict(a.ray_resources))
        say(f"OK    ray {ray.__version__}: joined the cluster at {a.ray_address}; each worker needs "
            f"{need.describe()}")
        nodes = ask_ray()
        hosts = host_list(nodes, need.as_resources())
        for node in nodes:
            if node.alive:  # Ray keeps dead nodes in its table for a while: counted, not listed
                say(f"{'OK  ' if node.node_id in hosts.hosts else 'INFO'}  {describe_node(node, need.as_resources())}")
        dead = sum(1 for node in nodes if not node.alive)
        if dead:
            say(f"INFO  {dead} dead node(s) in Ray's table, not listed")
        total = sum(hosts.hosts.values())
        say(f"{'OK  ' if total else 'FAIL'}  {total} slot(s) free on {len(hosts.hosts)} node(s)"
            + ("" if total else ": no node has the resources one worker needs"))
    finally:
        disconnected(connected)


def main(argv: list[str]) -> int:
    parser = build_parser()
    a = config.parse_args(parser, argv, probe_parser=build_parser())
    hosts = _fixed_hosts(parser, a)
    if a.host_discovery_script is not None:
        try:
            discovery_command(a.host_discovery_script)
        except ValueError as exc:
            parser.error(f"--host-discovery-script {exc}")
    ok = True

    def say(line: str) -> None:
        nonlocal ok
        if line.startswith("FAIL"):
            ok = False
        print(line, flush=True)

    print("installation:", flush=True)
    for good, text in _installation(backend=a.backend):
        say(f"{'OK  ' if good else 'FAIL'}  {text}")
    if a.host_discovery_script is not None:
        hosts = _discovered(a, say)
    if getattr(a, "ray_address", None) is not None:
        print("ray cluster:", flush=True)
        _ray_cluster(a, say)
    elif hosts is None:
        print("hosts: none given (-H, --hostfile or --host-discovery-script)", flush=True)
    else:
        print("hosts:", flush=True)
        timeout = a.start_timeout
        results: dict[str, tuple[bool, str]] = {}

        def run(host: str) -> None:
            try:
                results[host] = _check_host(host, a, timeout)
            except Exception as exc:  # noqa: BLE001 - report, never crash the check
                results[host] = (False, f"{type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=run, args=(h,), daemon=True) for h in hosts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout + 10)
        for host in hosts:
            good, text = results.get(host, (False, f"no answer within {timeout:g} s (--start-timeout)"))
            say(f"{'OK  ' if good else 'FAIL'}  {host}: {text}")
    print("all checks passed" if ok else "some checks FAILED", flush=True)
    return 0 if ok else 1
