"""The registry decides in data and ``driver/words.py`` words it: every kind the registry emits
and every cause has words, and the registry itself writes no sentence."""

import ast
import re
from pathlib import Path

import pytest

from elasticrun.common.events import FIELDS, Cause, Kind, Reason
from elasticrun.driver import words
from elasticrun.driver.registry import Event

pytestmark = pytest.mark.timeout(30)

REGISTRY = Path(words.__file__).with_name("registry.py")


def _strings(tree: ast.AST) -> list[tuple[int, str]]:
    """The string literals of a module outside docstrings (f-strings' literal parts included)."""
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


def test_every_cause_has_words():
    assert set(words._REASONS) == set(Cause)


def test_every_kind_the_registry_emits_has_words():
    emitted = set(re.findall(r"Event\(\s*Kind\.(\w+)", REGISTRY.read_text()))
    assert emitted, "the scan found no event: it no longer matches how the registry writes them"
    assert {Kind[k] for k in emitted} <= set(words._EVENTS)
    assert set(words._EVENTS) <= set(FIELDS)


def test_the_registry_writes_no_sentence():
    """A literal with a space in the registry is a sentence in the wrong place: words.py writes them."""
    sentences = [(line, s) for line, s in _strings(ast.parse(REGISTRY.read_text())) if " " in s.strip()]
    assert not sentences, sentences


def test_reasons_nest_and_a_failure_without_a_reason_still_reads():
    failed = Reason(Cause.EXITED, {"code": 3, "detail": ""})
    member = Reason(Cause.MEMBER_FAILED, {"label": "b[0]", "why": failed})
    assert words.reason(member) == "b[0] exited with code 3"
    both = Reason(Cause.ALL_FAILED, {"failed": [("a[0]", Reason(Cause.SCRIPT_ERROR, {"error": "ValueError: x"})),
                                                ("b[0]", None)]})
    assert words.reason(both) == "all workers failed (a[0] failed: ValueError: x; b[0] failed)"


def test_the_event_log_gets_reasons_as_words():
    e = Event(Kind.WORKER_FAILED, {"host": "b", "label": "b[0]", "rank": 1,
                                   "why": Reason(Cause.SILENT, {"silent_s": 12.04, "limit": 10.0})})
    assert words.event(e) == ("b[0] (rank 1) sent no heartbeat for 12.0 s (--heartbeat-timeout 10 s); it is hung or "
                              "unreachable")
    assert words.plain(e.fields)["why"] == "sent no heartbeat for 12.0 s (--heartbeat-timeout 10 s); it is hung or unreachable"


def test_a_thousand_hosts_make_one_short_line():
    usable = [(f"h{i}", 4) for i in range(1024)]
    line = words.event(Event(Kind.WAITING_FOR_SLOTS, {"need": 4096, "ready": 3742, "usable": usable, "left_s": 12.0,
                                                      "flag": "--start-timeout"}))
    assert line == ("waiting for 4096 ready worker(s) (have 3742; usable hosts: h0:4, h1:4, h2:4, h3:4, h4:4, h5:4, "
                    "h6:4, h7:4 and 1016 more); giving up in 12 s (--start-timeout)")
    black = words.reason(Reason(Cause.ALL_BLACKLISTED, {"hosts": [f"h{i}" for i in range(9)]}))
    assert black == "every host is blacklisted after failures: h0, h1, h2, h3, h4, h5, h6, h7 and 1 more"


def test_hosts_held_out_or_going_say_why_each():
    """A SIGTERMed host's worker left and discovery still lists it: the lines said it "left
    discovery or were blacklisted" and the timeout named only the usable hosts, so a job failed
    with two healthy hosts listed and no word of why one was not used."""
    held = words.event(Event(Kind.REMOVAL_HELD, {"hosts": ["b", "c"], "why": {"b": "leaving", "c": "undiscovered"},
                                                 "min_np": 2}))
    assert held == ("host(s) b leaving (a worker there got SIGTERM: the host is kept out until discovery stops listing "
                    "it and lists it again); c no longer listed by discovery, but without them fewer than --min-np 2 "
                    "workers are ready: they keep training until enough are")
    timed_out = words.reason(Reason(Cause.TIMED_OUT, {"limit": 8.0, "flag": "--elastic-timeout", "need": 2,
                                                      "usable": [("a", 1)], "out": {"b": "leaving", "d": "blacklisted"}}))
    assert timed_out.startswith("timed out after 8 s (--elastic-timeout) waiting for 2 slots; usable hosts: a:1; "
                                "listed but not used: b leaving (a worker there got SIGTERM"), timed_out
    assert timed_out.endswith("; d blacklisted"), timed_out
    workers = words.reason(Reason(Cause.TIMED_OUT, {"limit": 8.0, "flag": "--elastic-timeout", "need": 2, "ready": 1,
                                                    "usable": [("a", 1), ("b", 1)], "out": {}}))
    assert workers.startswith("timed out after 8 s (--elastic-timeout) waiting for 2 ready worker(s) (had 1: the "
                              "others started did not ask for a place in time"), workers  # slots enough: not "2 slots"
    handover = words.event(Event(Kind.HANDOVER_PENDING, {"hosts": ["a"], "why": {"a": "draining"}}))
    assert handover.startswith("the workers holding the job's state are on host(s) a listed draining by discovery: ")


def test_a_second_membership_change_in_a_round_says_again_and_what():
    first = words.event(Event(Kind.HOSTS_UPDATED, {"added": False, "removed": True, "handover": False,
                                                    "from_size": 3, "to_size": 2, "again": False}))
    then = words.event(Event(Kind.HOSTS_UPDATED, {"added": True, "removed": True, "handover": False,
                                                   "from_size": 3, "to_size": 3, "again": True}))
    assert first == "membership changing from 3 to 2 worker(s)"
    assert then == "membership changing again, now from 3 to 3 worker(s) (hosts added and removed)"


def test_a_hosts_slots_are_counted_in_good_english():
    assert words.event(Event(Kind.HOST_ADDED, {"host": "a", "slots": 1})) == "host a added (1 slot)"
    assert words.event(Event(Kind.HOST_ADDED, {"host": "a", "slots": 4})) == "host a added (4 slots)"
    assert words.event(Event(Kind.HOST_RESIZED, {"host": "a", "slots": 1})) == "host a now has 1 slot"
