"""elasticrun without numpy (not one of its dependencies): every kind of sync still works."""

from __future__ import annotations

import json
import re
import sys

import pytest

from conftest import SCRIPTS

pytestmark = pytest.mark.timeout(120)


def test_object_syncs_work_without_numpy(job):
    r = job.run(["-np", "2", "-H", "localhost:2"], [sys.executable, str(SCRIPTS / "object_sync.py")],
                PYTHONPATH=str(SCRIPTS / "no_numpy"))
    assert r.returncode == 0, r.output
    lines = [json.loads(m) for m in re.findall(r"^\[\d\]<stdout>:(\{.*\})$", r.stdout, re.M)]
    assert sorted(x["rank"] for x in lines) == [0, 1], r.output
    for x in lines:
        assert x["notes"] == {"from": 0}  # ObjectState synced from rank 0
        assert x["gathered"] == [{"rank": 0}, {"rank": 1}]
        assert x["token"] == {"token": "from rank 0"}
