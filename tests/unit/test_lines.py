"""elasticrun.common.lines: a child's output in lines of bounded size, nothing lost, reports whole."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.common.lines import LINE_LIMIT, lines

pytestmark = pytest.mark.timeout(120)

MARK = "@@elasticrun:0123456789abcdef@@ "
text_lines = st.lists(st.text(st.characters(blacklist_characters="\r\n", blacklist_categories=("Cs",)), max_size=60),
                      max_size=12)


def _read(data: bytes, limit: int, hold: str | None = None) -> list[str]:
    return list(lines(io.BufferedReader(io.BytesIO(data)), limit, hold))  # type: ignore[arg-type]


def test_lines_come_out_without_their_ends():
    assert _read(b"a\nbb\r\n\nlast", 100) == ["a", "bb", "", "last"]
    assert _read(b"", 100) == []


@given(text_lines, st.integers(4, 40), st.booleans())
@settings(max_examples=400, deadline=None)
def test_nothing_is_lost_and_no_piece_is_over_the_limit(parts, limit, final_newline):
    data = "\n".join(parts).encode() + (b"\n" if final_newline and parts else b"")
    out = _read(data, limit)
    assert "".join(out) == "".join(parts)
    assert all(len(p.encode()) <= limit + 3 for p in out)  # (+ a character cut at the last piece's end)
    if all(len(p.encode()) <= limit for p in parts):  # no line cut: the same lines
        assert out == (parts[:-1] if parts and parts[-1] == "" and not final_newline else parts)


def test_a_long_line_comes_out_in_pieces_cut_between_characters():
    line = "é" * 100  # two bytes each: a limit of 7 would cut one in two
    out = _read(line.encode() + b"\nnext\n", 7)
    assert "".join(out[:-1]) == line and out[-1] == "next"
    assert all(p and set(p) == {"é"} and len(p.encode()) <= 8 for p in out[:-1])


def test_undecodable_bytes_are_replaced_not_raised():
    assert _read(b"ok\xff\xfe\n", 100) == ["ok\ufffd\ufffd"]


@given(st.text(st.characters(blacklist_characters="\r\n@", blacklist_categories=("Cs",)), max_size=300),
       st.integers(8, 64), st.dictionaries(st.sampled_from(["pid", "exit", "dying"]), st.integers(-9, 99999),
                                           min_size=1))
@settings(max_examples=400, deadline=None)
def test_a_report_after_unended_output_is_never_cut_in_two(before, limit, report):
    data = (before + MARK + json.dumps(report) + "\nafter\n").encode()
    out = _read(data, limit, hold=MARK)
    reports = [p for p in out if MARK in p]
    assert len(reports) == 1, out
    assert json.loads(reports[0].partition(MARK)[2]) == report
    assert "".join(out).replace(reports[0].partition(MARK)[2], "").replace(MARK, "") == before + "after"


def test_a_200_mib_line_is_read_in_bounded_memory():
    """The driver once held (and copied) a whole line: 1.4 GB for a 200 MiB one."""
    size = 200 << 20
    proc = subprocess.Popen([sys.executable, "-c", f"import sys; sys.stdout.buffer.write(b'x' * {size})"],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    tracemalloc.start()
    try:
        total = pieces = 0
        for piece in lines(proc.stdout):
            total += len(piece)
            pieces += 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        proc.wait(30)
    assert total == size and pieces == size // LINE_LIMIT
    assert peak < 8 * LINE_LIMIT, peak


def test_the_ends_of_the_stream_pass_through_os_pipes_too():
    r, w = os.pipe()
    os.write(w, b"one\ntwo")
    os.close(w)
    with os.fdopen(r, "rb") as f:
        assert list(lines(f)) == ["one", "two"]
