"""``elasticrun``: the command line (flag names follow ``horovodrun``).

The flags themselves are ``parser.py``'s; here they are checked together and turned into
``JobSettings`` (``parse_settings``, also used by ``elasticrun.run()``), and ``main`` runs the
job, ``--check`` or ``elasticrun timeline``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys

from elasticrun.common.hosts import MAX_SLOTS_PER_HOST, HostSpecError, parse_hostfile, parse_hosts_arg
from elasticrun.common.paths import check_writable_dir, check_writable_file
from elasticrun.common.settings import JobSettings
from elasticrun.discovery.sources import FixedHosts, ScriptDiscovery, discovery_command
from elasticrun.driver import check, config, network
from elasticrun.driver.parser import ExitingParser, RaisingParser, build_parser, read_hostfile


def _remote_settings(parser: argparse.ArgumentParser, a: argparse.Namespace) -> dict:
    extra_env: dict[str, str] = {}
    for item in a.env:
        name, eq, value = item.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            parser.error(f"-x {item}: {name!r} is not a valid environment variable name")
        if not eq:
            if name not in os.environ:
                parser.error(f"-x {name}: {name} is not set here (use -x {name}=VALUE to set it)")
            value = os.environ[name]
        extra_env[name] = value
    identity = a.ssh_identity_file
    if identity is not None:
        if not os.access(identity, os.R_OK):
            parser.error(f"-i {identity}: no such readable file")
        identity = os.path.abspath(identity)
    known = a.ssh_known_hosts
    if known is not None:
        if not os.access(known, os.R_OK):
            parser.error(f"--ssh-known-hosts {known}: no such readable file")
        known = os.path.abspath(known)
    address = a.driver_address
    if a.network_interface is not None:
        try:
            address = network.interface_address(a.network_interface)
        except OSError as exc:
            parser.error(f"--network-interface {a.network_interface}: {exc.strerror or exc}")
    elif address is not None:
        try:
            infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
            address = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0][4][0]
        except socket.gaierror as exc:
            parser.error(f"--driver-address {a.driver_address}: {exc.strerror}")
    if address is not None:
        try:
            network.check_bindable(address)
        except OSError as exc:
            flag = f"--network-interface {a.network_interface}" if a.network_interface else f"--driver-address {address}"
            parser.error(f"{flag}: cannot listen on {address} here ({exc.strerror or exc})")
    return dict(
        extra_env=extra_env, launcher=a.launcher, ssh_port=a.ssh_port, ssh_user=a.ssh_user,
        ssh_identity_file=identity, ssh_known_hosts=known, ssh_accept_unknown_hosts=a.ssh_accept_unknown_hosts,
        remote_cwd=a.remote_cwd, remote_python=a.remote_python, forward_env=a.forward_env,
        driver_address=address, network_interface=a.network_interface)


def parse_settings(argv: list[str], *, api: bool = False, callable_discovery: bool = False) -> JobSettings:
    """Validate ``argv`` into JobSettings; errors exit 2 (``api=True``: raise ValueError).

    With no host source, the job runs on ``localhost:NP`` as horovodrun's does.
    ``callable_discovery``: hosts come from ``elasticrun.run(discovery=callable)`` instead.
    """
    kind = RaisingParser if api else ExitingParser
    parser = build_parser(kind, False)
    a = config.parse_args(parser, argv, probe_parser=build_parser(kind, False))
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        parser.error("missing the training command, e.g. `elasticrun -np 2 -H localhost:2 python train.py`")
    min_np = a.min_np if a.min_np is not None else a.np
    if min_np > a.np:
        parser.error(f"--min-np {min_np} is more than -np {a.np}")
    if a.max_np is not None and a.max_np < a.np:
        parser.error(f"--max-np {a.max_np} is less than -np {a.np}")
    if a.blacklist_cooldown_range and a.blacklist_cooldown_range[0] > a.blacklist_cooldown_range[1]:
        low, high = a.blacklist_cooldown_range
        parser.error(f"--blacklist-cooldown-range {low:g} {high:g}: LOW is more than HIGH")
    if a.slots_per_host > MAX_SLOTS_PER_HOST:
        parser.error(f"--slots-per-host {a.slots_per_host}: a host has at most {MAX_SLOTS_PER_HOST} slots")
    fixed = None
    try:
        if a.hosts is not None:
            fixed = parse_hosts_arg(a.hosts, a.slots_per_host)
        elif a.hostfile is not None:
            fixed = parse_hostfile(read_hostfile(parser, a.hostfile), a.slots_per_host, a.hostfile)
    except HostSpecError as exc:
        parser.error(str(exc))
    script = a.host_discovery_script
    if script is not None:
        try:
            argv = discovery_command(script)
        except ValueError as exc:
            parser.error(f"--host-discovery-script {exc}")
        script = argv[0] if len(argv) == 1 else script  # a file: by its absolute path
    if fixed is None and script is None and not callable_discovery:
        fixed = {"localhost": a.np}  # horovodrun -np N python train.py: N processes here
    if fixed is not None and sum(fixed.values()) < a.np:
        parser.error(f"-np {a.np} needs {a.np} slots but the host list has {sum(fixed.values())}")
    # As with horovodrun: an elastic job (--min-np, --max-np or a discovery script) uses every
    # usable slot up to --max-np (unbounded by default), and -np is what it starts with and
    # waits for; otherwise the job is -np processes, fault tolerant but never larger.
    elastic = a.min_np is not None or a.max_np is not None or script is not None or callable_discovery
    max_np = a.max_np if elastic else a.np
    level = "DEBUG" if a.verbose else (a.log_level or "INFO")
    # Workers stay quiet (WARNING) unless the user asked for a level: their lines interleave
    # with the training output on the console.
    worker_level = "DEBUG" if a.verbose else (a.log_level or "WARNING")
    _check_output_paths(parser, a)
    return JobSettings(
        command=command, np=a.np, min_np=min_np, max_np=max_np, hosts=fixed, discovery_script=script,
        slots_per_host=a.slots_per_host, discovery_interval=a.discovery_interval,
        discovery_timeout=a.discovery_timeout, reset_limit=a.reset_limit,
        cooldown_range=tuple(a.blacklist_cooldown_range) if a.blacklist_cooldown_range else None,
        elastic_timeout=a.elastic_timeout, start_timeout=a.start_timeout, collective_timeout=a.collective_timeout,
        heartbeat_timeout=a.heartbeat_timeout,
        output_filename=a.output_filename, events_file=a.events_file, log_level=level,
        worker_log_level=worker_level,
        **_remote_settings(parser, a))


def _check_output_paths(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Every path the job will write, checked before anything starts (creating missing
    directories as the job would): one line naming the flag, not a traceback mid-job."""
    try:
        if a.output_filename is not None:
            check_writable_dir(a.output_filename, "--output-filename")
            if a.events_file is None:  # the job's event log goes there too
                check_writable_file(os.path.join(a.output_filename, "events.jsonl"), "--output-filename")
        if a.events_file is not None:
            check_writable_file(a.events_file, "--events")
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "timeline":
        from elasticrun import timeline

        return timeline.main(argv[1:])
    if check.wants_check(argv):
        return check.main(argv)
    settings = parse_settings(argv)
    logging.basicConfig(level=settings.log_level, format="[elasticrun] %(message)s", stream=sys.stderr)
    from elasticrun.driver.driver import ElasticDriver, JobFailed
    from elasticrun.driver.launchers import Launchers

    if settings.discovery_script:
        source = ScriptDiscovery(settings.discovery_script, settings.slots_per_host, settings.discovery_timeout)
    else:
        assert settings.hosts is not None
        source = FixedHosts(settings.hosts)
    try:
        return ElasticDriver(settings, source, Launchers(settings)).run()
    except JobFailed as exc:
        sys.stderr.write(f"elasticrun: {exc}\n")
        return exc.exit_code
