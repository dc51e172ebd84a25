"""hvd.nccl_built() reads torch's NCCL version as Horovod's does (CPU here: torch's answer is
stood in for)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import elasticrun.torch as hvd


@pytest.mark.parametrize("version, code", [((2, 27, 3), 22703), ((2, 27, 3, "a0"), 22703), ((2, 8, 4), 2804)])
def test_a_version_with_or_without_a_suffix_gives_its_code(monkeypatch, version, code) -> None:
    import torch.cuda.nccl

    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: version)
    assert hvd.nccl_built() == code


def test_no_nccl_is_0(monkeypatch) -> None:
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    assert hvd.nccl_built() == 0
