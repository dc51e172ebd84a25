"""The table of docs/porting-from-horovod.md is true: every name it marks `yes` is on
``elasticrun.torch``, and every row says yes or why not."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import elasticrun.torch as hvd

pytestmark = pytest.mark.timeout(60)

DOC = Path(__file__).resolve().parents[2] / "docs" / "porting-from-horovod.md"


def rows() -> list[tuple[list[str], str]]:
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Every public name", 1)[1].split("\n## ", 1)[0]
    found = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 2 or not cells[0].startswith("`"):
            continue
        found.append((re.findall(r"`([^`]+)`", cells[0]), cells[1]))
    return found


def lookup(name: str) -> object:
    obj: object = hvd
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def test_the_table_lists_horovods_names() -> None:
    names = {n for ns, _ in rows() for n in ns}
    for must in ("allreduce", "grouped_reducescatter_async", "join", "SyncBatchNorm", "Adasum", "ProcessSet",
                 "start_timeline", "rocm_built", "elastic.run", "elastic.ElasticSampler", "mpi_lib_v2"):
        assert must in names, must
    assert len(names) >= 75


def test_every_yes_is_there_and_every_no_says_why() -> None:
    for names, verdict in rows():
        assert verdict == "yes" or verdict.startswith("no, because "), (names, verdict)
        if verdict == "yes":
            for name in names:
                assert lookup(name) is not None, name
        else:
            for name in names:
                assert not hasattr(hvd, name.split(".")[-1]) or "." in name, name


def test_op_constants_have_horovods_values() -> None:
    assert [hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, hvd.Product] == [0, 1, 2, 3, 4, 5]
