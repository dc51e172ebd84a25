"""``elasticrun``: the command line (flag names follow ``horovodrun``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from elasticrun import __version__
from elasticrun.common.hosts import HostSpecError, parse_hostfile, parse_hosts_arg
from elasticrun.common.settings import JobSettings
from elasticrun.discovery.sources import FixedHosts, ScriptDiscovery

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


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
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


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="elasticrun", description=DESCRIPTION, epilog=EPILOG,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"elasticrun {__version__}")
    p.add_argument("-np", "--num-proc", dest="np", type=_positive_int, required=True,
                   help="number of processes to start with (the first round waits for this many slots)")
    p.add_argument("--min-np", "--min-num-proc", dest="min_np", type=_positive_int,
                   help="fewest processes to keep training with (default: -np)")
    p.add_argument("--max-np", "--max-num-proc", dest="max_np", type=_positive_int,
                   help="most processes to use (default: -np with a fixed host list, "
                        "all discovered slots with a discovery script)")
    hosts = p.add_mutually_exclusive_group(required=True)
    hosts.add_argument("--host-discovery-script", metavar="PATH",
                       help="executable printing the usable hosts, one `host[:slots]` per line")
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...", help="fixed host list, e.g. localhost:2,127.0.0.1:2")
    hosts.add_argument("--hostfile", metavar="FILE", help="file with one `host[:slots]` or `host slots=N` per line")
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
    p.add_argument("--log-level", default=None, type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="driver and worker log level (default INFO for the driver's job messages)")
    p.add_argument("--verbose", action="store_true", help="same as --log-level DEBUG")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the training command, e.g. python train.py")
    return p


def parse_settings(argv: list[str]) -> JobSettings:
    parser = build_parser()
    a = parser.parse_args(argv)
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
    fixed = None
    try:
        if a.hosts is not None:
            fixed = parse_hosts_arg(a.hosts, a.slots_per_host)
        elif a.hostfile is not None:
            try:
                with open(a.hostfile, encoding="utf-8") as f:
                    fixed = parse_hostfile(f.read(), a.slots_per_host, a.hostfile)
            except OSError as exc:
                parser.error(f"--hostfile {a.hostfile}: {exc.strerror}")
    except HostSpecError as exc:
        parser.error(str(exc))
    script = a.host_discovery_script
    if script is not None:
        if not os.path.isfile(script):
            parser.error(f"--host-discovery-script {script}: no such file")
        if not os.access(script, os.R_OK | os.X_OK):
            parser.error(f"--host-discovery-script {script}: not executable (try chmod +x {script})")
        script = os.path.abspath(script)
    if fixed is not None and sum(fixed.values()) < a.np:
        parser.error(f"-np {a.np} needs {a.np} slots but the host list has {sum(fixed.values())}")
    max_np = a.max_np if a.max_np is not None else (a.np if fixed is not None else None)
    level = "DEBUG" if a.verbose else (a.log_level or "INFO")
    # Workers stay quiet (WARNING) unless the user asked for a level: their lines interleave
    # with the training output on the console.
    worker_level = "DEBUG" if a.verbose else (a.log_level or "WARNING")
    return JobSettings(
        command=command, np=a.np, min_np=min_np, max_np=max_np, hosts=fixed, discovery_script=script,
        slots_per_host=a.slots_per_host, discovery_interval=a.discovery_interval,
        discovery_timeout=a.discovery_timeout, reset_limit=a.reset_limit,
        cooldown_range=tuple(a.blacklist_cooldown_range) if a.blacklist_cooldown_range else None,
        elastic_timeout=a.elastic_timeout, start_timeout=a.start_timeout, collective_timeout=a.collective_timeout,
        heartbeat_timeout=a.heartbeat_timeout,
        output_filename=a.output_filename, log_level=level, worker_log_level=worker_level)


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else argv)
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
