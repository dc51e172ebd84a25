"""Parsing of host lists: discovery-script output, ``-H`` and hostfiles (pure, no I/O).

Every parser reports problems with the offending text so a user can fix the source at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# A host is a DNS name or IPv4 address, optionally prefixed with ``user@`` (used by SSH).
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?$")


class HostSpecError(ValueError):
    """A host specification could not be parsed; the message names the text and the reason."""


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
            raise HostSpecError(f"{entry!r}: slots {slots_text!r} is not a whole number") from None
    if not _HOST_RE.match(host):
        raise HostSpecError(f"{entry!r}: {host!r} is not a valid host name")
    if slots < 1:
        raise HostSpecError(f"{entry!r}: a host needs at least 1 slot, got {slots}")
    return host, slots


@dataclass
class HostList:
    """Hosts in the order first listed, with slots; plus what was wrong with the input."""

    hosts: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def add(self, host: str, slots: int, where: str) -> None:
        # Duplicates are merged: the largest slot count wins (a host listed twice is more
        # likely a generated list than a request for two separate hosts of the same name).
        previous = self.hosts.get(host)
        if previous is not None and previous != slots:
            self.warnings.append(f"{where}: host {host!r} listed again with {slots} slots "
                                 f"(before: {previous}); using {max(previous, slots)}")
        self.hosts[host] = max(slots, previous or 0)


def parse_discovery_output(text: str, default_slots: int) -> HostList:
    """Parse a discovery script's stdout: one ``host`` or ``host:slots`` per line.

    Blank lines and ``#`` comments are ignored; an invalid line is reported (with its line
    number and text) and skipped, so one bad line never hides the good ones.
    """
    result = HostList()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            host, slots = parse_host_entry(line, default_slots)
        except HostSpecError as exc:
            result.errors.append(f"line {number}: {exc}")
            continue
        result.add(host, slots, f"line {number}")
    return result


def parse_hosts_arg(spec: str, default_slots: int) -> dict[str, int]:
    """Parse ``-H host1:2,host2`` strictly: any bad entry is an error (it is a CLI flag)."""
    result = HostList()
    for entry in spec.split(","):
        try:
            host, slots = parse_host_entry(entry, default_slots)
        except HostSpecError as exc:
            raise HostSpecError(f"-H {spec!r}: {exc}") from None
        result.add(host, slots, "-H")
    if not result.hosts:
        raise HostSpecError(f"-H {spec!r}: no hosts")
    return result.hosts


def parse_hostfile(text: str, default_slots: int, name: str = "hostfile") -> dict[str, int]:
    """Parse a hostfile strictly: lines ``host``, ``host:N`` or ``host slots=N`` (horovodrun's form)."""
    result = HostList()
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\S+)", line)
        entry = f"{match.group(1)}:{match.group(2)}" if match else line
        try:
            host, slots = parse_host_entry(entry, default_slots)
        except HostSpecError as exc:
            raise HostSpecError(f"{name} line {number}: {exc}") from None
        result.add(host, slots, f"{name} line {number}")
    if not result.hosts:
        raise HostSpecError(f"{name}: no hosts listed")
    return result.hosts
