"""``elasticrun``: the command line (flag names follow ``horovodrun``)."""

from __future__ import annotations

import argparse
import logging
import os
import re
import socket
import sys

from elasticrun import __version__
from elasticrun.common.hosts import MAX_SLOTS_PER_HOST, HostSpecError, parse_hostfile, parse_hosts_arg
from elasticrun.common.paths import check_writable_dir, check_writable_file
from elasticrun.common.settings import JobSettings
from elasticrun.discovery.sources import FixedHosts, ScriptDiscovery, discovery_command
from elasticrun.driver import check, config

DESCRIPTION = """\
Run COMMAND as an elastic, fault-tolerant data-parallel job.

Hosts come from a discovery script (run every --discovery-interval; it prints one `host` or
`host:slots` per line) or from a fixed list (-H / --hostfile, elastic for failures only).
Workers that fail are restarted nowhere: their host is blacklisted and the survivors carry
on from their last commit, in the same processes, once at least --min-np slots are usable.
"""

EPILOG = """\
exit status: 0 when the job succeeds; 1 when it fails (the reason is printed); 2 for bad
arguments or a misconfigured discovery script; 128+N when stopped by signal N.

example:
  elasticrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover_hosts.sh python train.py
"""


def _log_level(value: str) -> str:
    """A level name, upper-cased; horovodrun's TRACE and FATAL map to logging's names."""
    value = value.upper()
    return {"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(value, value)


#: Counts above this (-np 99999999999999999999) are typos, refused rather than waited for.
MAX_COUNT = 1_000_000
#: A hostfile is a list of hosts: more than this is not one (--hostfile /dev/zero).
MAX_HOSTFILE_BYTES = 1 << 20


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    if value > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} must be at most {MAX_COUNT:,}")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must not be negative")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be more than 0 seconds")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line a user can act on, exit 2
        self.exit(2, f"elasticrun: error: {message} (see elasticrun --help)\n")


class _RaisingParser(_Parser):
    """For ``elasticrun.run()``: the same checks and messages, raised as ValueError."""

    def error(self, message: str) -> None:
        raise ValueError(message)


def build_parser(parser_class: type[argparse.ArgumentParser] = _Parser,
                 host_source_required: bool = True) -> argparse.ArgumentParser:
    p = parser_class(prog="elasticrun", description=DESCRIPTION, epilog=EPILOG,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"elasticrun {__version__}")
    p.add_argument("--check", action="store_true",
                   help="check this installation (torch, gloo/NCCL, pyzmq, paramiko, cloudpickle) and that "
                        "each host of -H/--hostfile/--host-discovery-script is reachable (SSH, python, torch); "
                        "no training command needed; exit 0 when all is well, 1 otherwise")
    p.add_argument("--config-file", metavar="FILE",
                   help="TOML file of options (keys are long option names, e.g. min-np = 2); "
                        "flags override ELASTICRUN_* environment variables, which override the file "
                        "(see docs/configuration.md)")
    p.add_argument("-np", "--num-proc", dest="np", type=_positive_int, required=True,
                   help="number of processes to start with (the first round waits for this many slots)")
    p.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_positive_int,
                   help="fewest processes to keep training with (default: -np)")
    p.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_positive_int,
                   help="most processes to use (default: -np with a fixed host list, "
                        "all discovered slots with a discovery script)")
    hosts = p.add_mutually_exclusive_group(required=host_source_required)
    hosts.add_argument("--host-discovery-script", metavar="PATH",
                       help="executable printing the usable hosts, one `host[:slots]` per line (or, as "
                            "with horovodrun, a command line run by /bin/sh: \"python discover.py --zone a\")")
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="fixed host list, e.g. localhost:2,127.0.0.1:2")
    hosts.add_argument("--hostfile", "-hostfile", metavar="FILE", help="file with one `host[:slots]` or `host slots=N` per line")
    p.add_argument("--slots-per-host", "--slots", dest="slots_per_host", type=_positive_int, default=1,
                   help="slots for hosts listed without a count (default 1)")
    p.add_argument("--discovery-interval", type=_seconds, default=1.0, metavar="SECONDS",
                   help="how often to run the discovery script (default 1)")
    p.add_argument("--discovery-timeout", type=_seconds, default=10.0, metavar="SECONDS",
                   help="a discovery run taking longer is killed and counts as failed (default 10)")
    p.add_argument("--reset-limit", type=_non_negative_int, metavar="N",
                   help="fail the job instead of doing reset number N+1 (default: unlimited)")
    p.add_argument("--blacklist-cooldown-range", type=_seconds, nargs=2, metavar=("LOW", "HIGH"),
                   help="let blacklisted hosts back after a cooldown that doubles on every failure, "
                        "between LOW and HIGH seconds (default: blacklisting is permanent)")
    p.add_argument("--elastic-timeout", type=_seconds, default=600.0, metavar="SECONDS",
                   help="after a reset, how long to wait for --min-np slots before failing (default 600)")
    p.add_argument("--start-timeout", type=_seconds, default=30.0, metavar="SECONDS",
                   help="how long to wait for the first -np slots, and for a started worker to "
                        "contact the driver (default 30)")
    p.add_argument("--collective-timeout", type=_seconds, default=60.0, metavar="SECONDS",
                   help="a collective taking longer raises HorovodInternalError in the worker (default 60)")
    p.add_argument("--heartbeat-timeout", type=_seconds, default=5.0, metavar="SECONDS",
                   help="a worker that sends no heartbeat for this long (hung, stopped, off the network) "
                        "is killed and its host handled as failed (default 5)")
    p.add_argument("--output-filename", metavar="DIR",
                   help="also append each rank's output to DIR/rank.N/stdout and stderr")
    p.add_argument("--events", metavar="FILE", dest="events_file",
                   help="append the job's event log (JSON lines: discovery, failures, rounds, each "
                        "worker's reset phases) to FILE (default: DIR/events.jsonl with --output-filename)")
    p.add_argument("--log-level", default=None, type=_log_level,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="driver and worker log level (default INFO for the driver's job messages; "
                        "horovodrun's TRACE and FATAL mean DEBUG and CRITICAL)")
    p.add_argument("--verbose", action="store_true", help="same as --log-level DEBUG")
    _add_remote_arguments(p)
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command, e.g. python train.py")
    return p


def _add_remote_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("other machines (SSH)", "Hosts that are not this machine run their workers over "
                             "SSH; the remote side needs the same Python environment and a `python3`.")
    g.add_argument("--launcher", choices=["auto", "local", "ssh"], default="auto",
                   help="auto (default): SSH for hosts that are not this machine and for user@host names, "
                        "child processes otherwise; local: never SSH; ssh: always SSH, even to this machine")
    g.add_argument("-p", "--ssh-port", type=_positive_int, default=22, metavar="PORT", help="SSH port (default 22)")
    g.add_argument("-i", "--ssh-identity-file", metavar="FILE",
                   help="private key to log in with (tried first; then the SSH agent and ~/.ssh keys)")
    g.add_argument("--ssh-user", metavar="USER", help="remote user for hosts without user@ (default: yours)")
    g.add_argument("--ssh-known-hosts", metavar="FILE",
                   help="known_hosts file with the hosts' keys (default ~/.ssh/known_hosts); "
                        "a host whose key is missing or different is refused")
    g.add_argument("--ssh-accept-unknown-hosts", action="store_true",
                   help="connect to hosts whose key is not in known_hosts without checking it (a changed key "
                        "is still refused). RISK: whoever answers for a host name (DNS spoofing, a "
                        "man in the middle) receives the job's secret and the workers' environment (with "
                        "any credentials in it) and can send the driver forged worker messages; use it "
                        "only on a network you trust")
    g.add_argument("--remote-cwd", metavar="DIR",
                   help="working directory of remote workers (default: the directory elasticrun runs in)")
    g.add_argument("--remote-python", default="python3", metavar="PATH",
                   help="Python 3 on the remote hosts that runs elasticrun's small launcher and watchdog "
                        "(default python3, looked up on the remote login PATH)")
    g.add_argument("-x", "--env", dest="env", action="append", default=[], metavar="NAME[=VALUE]",
                   help="give every worker NAME (its value here) or NAME=VALUE; repeatable")
    g.add_argument("--no-forward-env", dest="forward_env", action="store_false",
                   help="remote workers get only their remote login environment plus the -x variables, "
                        "instead of this environment (as horovodrun forwards it)")
    where = g.add_mutually_exclusive_group()
    where.add_argument("--driver-address", metavar="ADDR",
                       help="address of this machine that workers connect to (default: for each host, the "
                            "address this machine uses to reach it; 127.0.0.1 for local workers)")
    where.add_argument("--network-interface", metavar="NIC",
                       help="use the IPv4 address of interface NIC as --driver-address; also sets "
                            "GLOO_SOCKET_IFNAME=NIC for the workers unless it is set")


def _remote_settings(parser: argparse.ArgumentParser, a: argparse.Namespace) -> dict:
    from elasticrun.driver import ssh

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
            address = ssh.interface_address(a.network_interface)
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
            ssh.check_bindable(address)
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
    kind = _RaisingParser if api else _Parser
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


def read_hostfile(parser: argparse.ArgumentParser, path: str) -> str:
    """The text of a hostfile, read with a limit (``--hostfile /dev/zero`` is one line, not a hang)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(MAX_HOSTFILE_BYTES + 1)
    except OSError as exc:
        parser.error(f"--hostfile {path}: {exc.strerror}")
    if len(text) > MAX_HOSTFILE_BYTES:
        parser.error(f"--hostfile {path}: more than 1 MiB, not a list of hosts")
    return text


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

    if settings.discovery_script:
        source = ScriptDiscovery(settings.discovery_script, settings.slots_per_host, settings.discovery_timeout)
    else:
        assert settings.hosts is not None
        source = FixedHosts(settings.hosts)
    try:
        return ElasticDriver(settings, source).run()
    except JobFailed as exc:
        sys.stderr.write(f"elasticrun: {exc}\n")
        return exc.exit_code
