"""torch.distributed.rpc (with distributed autograd) in a real elastic job, across a reset:
re-initialised from elasticrun's environment in a reset callback (scripts/rpc_train.py)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import SCRIPTS

pytestmark = pytest.mark.timeout(240)


def test_rpc_and_distributed_autograd_across_a_reset(job) -> None:
    log = job.tmp / "rpc.jsonl"
    result = job.run(["-np", "3", "--min-np", "2", "-H", "localhost:1,127.0.0.2:1,127.0.0.3:1"],
                     [sys.executable, str(SCRIPTS / "rpc_train.py"), "--log", str(log), "--steps", "6",
                      "--die-at", "3", "--die-rank", "2"], timeout=200)
    assert result.returncode == 0, result.output[-4000:]
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert all(x["ok"] for x in lines), lines
    before = [x for x in lines if x["size"] == 3]
    after = [x for x in lines if x["size"] == 2]
    assert sorted({x["step"] for x in before}) == [0, 1, 2]
    assert sorted({x["step"] for x in after}) == [3, 4, 5] and len(after) == 6
    assert all(x["start_rank"] != 2 for x in after)
    # A new round, a new MASTER_PORT agreed by everyone in it.
    assert len({x["master"] for x in before}) == 1 and len({x["master"] for x in after}) == 1
    assert {x["master"] for x in before} != {x["master"] for x in after}
