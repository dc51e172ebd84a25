"""The event log has one schema (elasticrun/common/events.py): every kind is declared with its
fields, every emitter names kinds through it, and recorded logs follow it."""

import json
import re
from pathlib import Path

import pytest

from elasticrun.common.events import FIELDS, WORKER_KINDS, Kind

pytestmark = pytest.mark.timeout(30)

REPO = Path(__file__).resolve().parents[2]
BASE = {"t", "kind", "source"}


def test_every_kind_declares_its_fields():
    assert set(FIELDS) == set(Kind)
    assert WORKER_KINDS <= set(Kind)


def test_no_emitter_spells_a_kind_as_a_string():
    pattern = re.compile(r"""(?:\.emit|journal\.write|\bEvent)\(\s*["']""")
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in (REPO / "elasticrun").rglob("*.py")
                 for n, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not offenders, offenders


@pytest.mark.parametrize("log", sorted((REPO / "tests" / "data").glob("events_*.jsonl")), ids=lambda p: p.name)
def test_recorded_logs_follow_the_schema(log):
    for line in log.read_text().splitlines():
        e = json.loads(line)
        kind = Kind(e["kind"])
        assert (e["source"] == "worker") == (kind in WORKER_KINDS), e
        assert set(e) - BASE <= set(FIELDS[kind]), (kind, sorted(set(e) - BASE - set(FIELDS[kind])))
