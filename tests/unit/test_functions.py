"""FunctionService: the function of an elasticrun.run() job out in parts, results back in parts."""

import base64

import pytest

from elasticrun.driver.functions import MAX_PARTS, PART_BYTES, FunctionService
from elasticrun.driver.registry import WorkerRecord, WorkerState

pytestmark = pytest.mark.timeout(30)


def worker(wid="w1", rank=0):
    return WorkerRecord(wid, "a", 0, WorkerState.RUNNING, 0.0, round=2, rank=rank)


def test_the_function_goes_out_in_parts_and_the_path_with_the_first():
    payload = bytes(range(256)) * (PART_BYTES // 256 * 2 + 3)  # a bit over 2 parts
    svc = FunctionService(payload, ["/src"])
    got, paths = b"", []
    for part in range(3):
        kind, body = svc.handle("function", {"part": part}, None)
        assert kind == "function" and body["parts"] == 3
        got += base64.b64decode(body["data"])
        paths.append(body["sys_path"])
    assert got == payload and paths == [["/src"], [], []]
    assert "no part 3 of 3" in svc.handle("function", {"part": 3}, None)[1]["error"]


def test_results_come_back_in_parts_and_a_value_is_complete_only_with_all():
    svc = FunctionService(b"f", [])
    w = worker()
    body = {"worker": "w1", "kind": "value", "parts": 2, "round": 2, "rank": 0}
    assert svc.handle("result", dict(body, part=1, data=base64.b64encode(b"lo").decode()), w) == ("ack", {})
    assert svc.result("w1").blob is None
    svc.handle("result", dict(body, part=0, data=base64.b64encode(b"hel").decode()), w)
    assert svc.result("w1").blob == b"hello" and svc.errors() == []


def test_errors_are_listed_with_where_they_came_from():
    svc = FunctionService(b"f", [])
    svc.handle("result", {"worker": "w2", "kind": "error", "part": 0, "parts": 1, "data": "",
                          "error": "ValueError: x", "traceback": "Traceback ...", "round": 2, "rank": 1},
               worker("w2", rank=1))
    [e] = svc.errors()
    assert (e.worker, e.rank, e.host, e.error, e.blob) == ("w2", 1, "a", "ValueError: x", b"")


@pytest.mark.parametrize("body", [
    {"kind": "value", "part": 0, "parts": MAX_PARTS + 1, "data": ""},   # more than a worker may make us keep
    {"kind": "pickle", "part": 0, "parts": 1, "data": ""},
    {"kind": "value", "part": 2, "parts": 1, "data": ""},
])
def test_malformed_results_are_refused(body):
    with pytest.raises(ValueError):
        FunctionService(b"f", []).handle("result", dict(body, worker="w1"), worker())


def test_a_result_from_a_stranger_is_refused():
    with pytest.raises(ValueError, match="unknown worker"):
        FunctionService(b"f", []).handle("result", {"worker": "x", "kind": "value", "part": 0, "parts": 1,
                                                    "data": ""}, None)
