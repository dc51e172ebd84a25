"""Where a rank makes tensors on its own behalf for a device collective (a joined rank's
mirror, a newcomer's optimizer state): the GPU its NCCL groups are bound to."""

from __future__ import annotations

import torch

from elasticrun.worker import devices


def test_a_bound_gpu_wins_over_the_threads_current_device(monkeypatch) -> None:
    """The group may be formed on autograd's thread (set_device there only): the main thread's
    current device stayed 0, and a joined rank bound to GPU 1 mirrored on GPU 0."""
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(devices, "bound", None)
    assert devices.kind_device("cuda") == torch.device("cuda", 0)  # nothing formed yet: torch's current
    monkeypatch.setattr(devices, "bound", torch.device("cuda", 1))
    assert devices.kind_device("cuda") == torch.device("cuda", 1)
    assert devices.kind_device("cpu") == torch.device("cpu")
