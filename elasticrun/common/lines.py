"""A child's output, line by line, in pieces of bounded size.

A worker's output is read a line at a time, and a line can be any length: a script that
writes a progress bar with ``\\r`` and never a newline, or dumps a tensor on one line, hands
its reader hundreds of megabytes before the first newline. ``readline()`` without a limit
holds all of it, then decodes and prefixes a copy of it: a 200 MiB line once took the driver
to 1.4 GB. Here a line longer than :data:`LINE_LIMIT` bytes comes out in pieces of at most
that many (each its own console line; nothing is dropped), cut between characters.

Readers whose stream also carries a launcher's reports (a random mark, then JSON, on a line
of its own) pass the mark as ``hold``: a piece that ends inside a mark, or in what could be
the start of one, keeps that part back for the next, so a report is never cut in two.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from typing import Any

__all__ = ["LINE_LIMIT", "lines"]

#: The longest piece of a line handed on at once, in bytes (a console line, a log line).
LINE_LIMIT = 64 * 1024
_REPORT_MAX = 8192  # a launcher's report line is far shorter (a few fields of JSON)


def lines(f: Any, limit: int = LINE_LIMIT, hold: str | None = None) -> Iterator[str]:
    """The lines of binary stream ``f`` (UTF-8, undecodable bytes replaced), without their
    ``\\r``/``\\n`` ends, until EOF; a line over ``limit`` bytes in pieces (see above)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    pending = ""  # a piece's end kept back: a mark may start there
    cut = False  # the last piece ended inside a line
    while True:
        raw = f.readline(limit)
        if not raw:
            rest = pending + decoder.decode(b"", final=True)
            if rest:
                yield rest.rstrip("\r\n")
            return
        ended = raw.endswith(b"\n")
        text = pending + decoder.decode(raw, final=ended)
        pending = ""
        if ended:
            text = text.rstrip("\r\n")
            if text or not cut:  # (the newline of a line already handed on in pieces adds nothing)
                yield text
            cut = False
            continue
        cut = True
        keep = _held(text, hold) if hold else 0
        if 0 < keep <= max(2 * limit, _REPORT_MAX):  # (longer: no report; a worker does not know the mark)
            text, pending = text[:len(text) - keep], text[len(text) - keep:]
        if text:
            yield text


def _held(text: str, mark: str) -> int:
    """How many characters at the end of ``text`` to keep back: from a mark in it on, or a
    suffix that is the start of the mark."""
    at = text.rfind(mark)
    if at >= 0:
        return len(text) - at
    for n in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-n:]):
            return n
    return 0
