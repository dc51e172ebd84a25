"""``elasticrun timeline EVENTS.jsonl -o OUT``: pictures and traces of a job's event log.

The event log (``--events``, see elasticrun/common/events.py) becomes:

* ``.json``: a Chrome-trace / Perfetto file (chrome://tracing, ui.perfetto.dev). The driver is
  one process with tracks for rounds, resets, the phases of each reset, and host/failure
  instants; every host is a process with one track per worker slot, holding that worker's
  rendezvous, group formation, restore, sync and training spans, and a track of its own for
  the host when it was named a straggler. Times are microseconds since the first event of
  the job.
* ``.svg`` (no dependency), ``.html`` (the SVG and the summary tables in one page) or
  ``.png`` (needs matplotlib): the world size over time with markers for hosts added,
  removed, blacklisted, named stragglers and failures, and one bar per reset split into its
  phases.

and a text summary (rounds; stragglers named, evicted or kept; resets with cause and cost) is
printed.

Phases of a reset, as in benchmarks/recovery.py but laid end to end on one clock so that they
add up to the reset's cost as the driver reported it (from its trigger: a round aborted or a
host update published, to the first completed collective of the new round):

    detect        trigger -> the first worker notices (collective fails / interrupt)
    decide        -> the driver forms the new round
    rendezvous    -> the last worker of the new round has its assignment
    group         -> the last worker has formed the process group
    restore+sync  -> the last worker has synced the state (restore itself usually overlaps
                     decide: it runs while the driver forms the round)
    first step    -> the first collective of the new round completes

A boundary that happened before the previous one (clocks of different hosts, or a worker that
noticed the failure before the driver did) gives a zero-length phase.
"""

from __future__ import annotations

import argparse
import os
import sys

from elasticrun.timeline.analysis import (  # noqa: F401  (the public API)
    MARKERS, PHASES, Analysis, Marker, Reset, Round, TimelineError, analyze, load_events, summary,
)
from elasticrun.timeline.render import (  # noqa: F401
    FORMATS, PHASE_COLORS, to_chrome_trace, to_html, to_svg, write, write_png,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="elasticrun timeline",
        description="Summarize a job's event log (elasticrun --events FILE) and draw it: .json is a Chrome-trace / "
                    "Perfetto file (chrome://tracing, ui.perfetto.dev); .svg, .html and .png (needs matplotlib) show "
                    "the world size over time and one bar per reset split into its phases.")
    p.add_argument("events", metavar="EVENTS.jsonl", help="the event log written by elasticrun --events")
    p.add_argument("-o", "--output", action="append", default=[], metavar="OUT",
                   help="output file; its extension picks the format (.json, .svg, .html, .png); may be repeated")
    p.add_argument("--title", default="elasticrun job timeline", help="title of the picture")
    p.add_argument("-q", "--quiet", action="store_true", help="do not print the summary")
    args = p.parse_args(argv)
    try:
        for out in args.output:  # check every extension before doing any work
            if os.path.splitext(out)[1].lower() not in FORMATS:
                raise TimelineError(f"{out}: unknown output format; the extension must be one of {', '.join(FORMATS)}")
        events = load_events(args.events)
        if not args.quiet:
            print(summary(analyze(events)))
        for out in args.output:
            write(events, out, args.title)
            if not args.quiet:
                print(f"wrote {out}")
    except TimelineError as exc:
        sys.stderr.write(f"elasticrun timeline: {exc}\n")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
