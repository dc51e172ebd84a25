"""``elasticrun`` (the console script) and ``python -m elasticrun``: run a job, ``--check``,
or ``elasticrun timeline EVENTS.jsonl`` (the event log's pictures; not the driver's business)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "timeline":
        from elasticrun import timeline

        return timeline.main(argv[1:])
    from elasticrun.driver.cli.command import main as run_job

    return run_job(argv)


if __name__ == "__main__":
    sys.exit(main())
