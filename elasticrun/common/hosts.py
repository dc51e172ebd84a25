"""Parsing of host lists: discovery-script output, ``-H`` and hostfiles (pure, no I/O).

Every parser reports problems with the offending text so a user can fix the source at once,
and bounds what it keeps: absurd slot counts are refused, and only the first problems of a
long list are kept in full (the rest are counted).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# A host is a DNS name or IPv4 address, optionally prefixed with ``user@`` (used by SSH).
#: More slots than this on one host is a typo or garbage, not a machine (the biggest have a
#: few hundred cores); refusing it keeps one line of input from asking for millions of workers.
MAX_SLOTS_PER_HOST = 1024
#: At most this many hosts from one discovery run, -H or hostfile.
MAX_HOSTS = 10_000
#: Problems of one parse kept in full; more are only counted (HostList.more_errors, more_warnings).
MAX_KEPT_PROBLEMS = 20

_HOST_RE = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


class HostSpecError(ValueError):
    """A host specification could not be parsed; the message names the text and the reason."""


def shown(text: str) -> str:
    """repr() of a piece of input, cut short: a message about a 1 MB line must stay short."""
    r = repr(text)
    return r if len(r) <= 80 else r[:77] + "..."


def parse_host_entry(text: str, default_slots: int) -> tuple[str, int]:
    """Parse ``host`` or ``host:slots``; raise HostSpecError naming what is wrong."""
    entry = text.strip()
    if not entry:
        raise HostSpecError("empty host entry")
    host, sep, slots_text = entry.rpartition(":")
    if not sep:
        host, slots = entry, default_slots
    else:
        try:
            slots = int(slots_text)
        except ValueError:
            raise HostSpecError(f"{shown(entry)}: slots {shown(slots_text)} is not a whole number") from None
    user, _, name = host.rpartition("@")
    if len(name) > 253 or len(user) > 64:  # DNS's limit, and far more than any login name
        raise HostSpecError(f"{shown(entry)}: host name too long (at most 253 characters, user 64)")
    # (Each dot-separated part 1-63 characters, as DNS has it: a name with an empty or longer
    # part is refused by the resolver itself, with an exception no caller expects.)
    if not _HOST_RE.match(host) or any(not 0 < len(part) <= 63 for part in name.split(".")):
        entry_named = f"{shown(entry)}: " if host != entry else ""  # only if it says more (its slots)
        raise HostSpecError(f"{entry_named}{shown(host)} is not a valid host name")
    if slots < 1:
        raise HostSpecError(f"{shown(entry)}: a host needs at least 1 slot, got {slots}")
    if slots > MAX_SLOTS_PER_HOST:
        raise HostSpecError(f"{shown(entry)}: a host has at most {MAX_SLOTS_PER_HOST} slots")
    return host, slots


@dataclass
class HostList:
    """Hosts in the order first listed, with slots; plus what was wrong with the input."""

    hosts: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # the first MAX_KEPT_PROBLEMS
    warnings: list[str] = field(default_factory=list)
    more_errors: int = 0  # not kept, only counted
    more_warnings: int = 0
    # Hosts listed with the word ``draining``: still up, but about to go (a spot reclaim
    # notice, a cordoned node): their workers leave gracefully and none is started there.
    draining: set[str] = field(default_factory=set)

    def error(self, message: str) -> None:
        if len(self.errors) < MAX_KEPT_PROBLEMS:
            self.errors.append(message)
        else:
            self.more_errors += 1

    def warn(self, message: str) -> None:
        if len(self.warnings) < MAX_KEPT_PROBLEMS:
            self.warnings.append(message)
        else:
            self.more_warnings += 1

    def add(self, host: str, slots: int, where: str) -> None:
        # Duplicates are merged: the largest slot count wins (a host listed twice is more
        # likely a generated list than a request for two separate hosts of the same name).
        previous = self.hosts.get(host)
        if previous is not None and previous != slots:
            self.warn(f"{where}: host {host!r} listed again with {slots} slots "
                      f"(before: {previous}); using {max(previous, slots)}")
        self.hosts[host] = max(slots, previous or 0)


def _lines(text: str) -> list[str]:
    """The text's lines, without the byte-order mark an editor on Windows puts at the start
    of a file saved as UTF-8 (its first host was "not a valid host name" for an invisible
    character)."""
    return text.removeprefix("\ufeff").splitlines()


#: The word after a host that says it is about to go away (see HostList.draining).
DRAINING = "draining"


def parse_discovery_output(text: str, default_slots: int) -> HostList:
    """Parse a discovery script's stdout: one ``host``, ``host:slots`` or ``host[:slots] draining``
    per line.

    Blank lines and ``#`` comments are ignored; an invalid line is reported (with its line
    number and text) and skipped, so one bad line never hides the good ones. The caller
    bounds the text (ScriptDiscovery reads at most 1 MiB) and the number of hosts.
    """
    result = HostList()
    for number, raw in enumerate(_lines(text), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        entry, *rest = line.split(None, 1)
        word = rest[0].strip() if rest else ""
        if word and word != DRAINING:
            result.error(f"line {number}: {shown(line)}: expected `host[:slots]` or `host[:slots] {DRAINING}`")
            continue
        try:
            host, slots = parse_host_entry(entry, default_slots)
        except HostSpecError as exc:
            result.error(f"line {number}: {exc}")
            continue
        result.add(host, slots, f"line {number}")
        if word:
            result.draining.add(host)
    return result


def parse_hosts_arg(spec: str, default_slots: int) -> dict[str, int]:
    """Parse ``-H host1:2,host2`` strictly: any bad entry is an error (it is a CLI flag), and
    so is a host listed twice (a typo: which of its slot counts was meant?)."""
    hosts: dict[str, int] = {}
    for entry in spec.split(","):
        try:
            host, slots = parse_host_entry(entry, default_slots)
        except HostSpecError as exc:  # -H with one entry: the message names it already
            named = entry == spec and str(exc).startswith(shown(entry.strip()))
            raise HostSpecError(f"-H {exc}" if named else f"-H {shown(spec)}: {exc}") from None
        if host in hosts:
            raise HostSpecError(f"-H {shown(spec)}: host {shown(host)} is listed twice")
        hosts[host] = slots
    if not hosts:
        raise HostSpecError(f"-H {shown(spec)}: no hosts")
    if len(hosts) > MAX_HOSTS:
        raise HostSpecError(f"-H: {len(hosts):,} hosts, more than the {MAX_HOSTS:,} allowed")
    return hosts


def parse_hostfile(text: str, default_slots: int, name: str = "hostfile") -> dict[str, int]:
    """Parse a hostfile strictly: lines ``host``, ``host:N`` or ``host slots=N`` (horovodrun's
    form); a bad line or a host listed twice is an error."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(_lines(text), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\S+)", line)
        entry = f"{match.group(1)}:{match.group(2)}" if match else line
        try:
            host, slots = parse_host_entry(entry, default_slots)
        except HostSpecError as exc:
            raise HostSpecError(f"{name} line {number}: {exc}") from None
        if host in hosts:
            raise HostSpecError(f"{name} line {number}: host {shown(host)} is listed twice "
                                f"(first on line {first_line[host]})")
        hosts[host], first_line[host] = slots, number
    if not hosts:
        raise HostSpecError(f"{name}: no hosts listed")
    if len(hosts) > MAX_HOSTS:
        raise HostSpecError(f"{name}: {len(hosts):,} hosts, more than the {MAX_HOSTS:,} allowed")
    return hosts
