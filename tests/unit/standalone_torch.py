"""Shared by the unit tests of TorchState: a standalone (1-rank) runtime, a small model with
a BatchNorm, and a deterministic training step."""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch
from torch import nn

from elasticrun.worker import runtime


@pytest.fixture(autouse=True)
def rt(monkeypatch: pytest.MonkeyPatch) -> Iterator[runtime.Runtime]:
    """A 1-rank gloo world, whatever ELASTICRUN_* variables the test process inherited."""
    for name in list(os.environ):
        if name.startswith("ELASTICRUN_"):
            monkeypatch.delenv(name)
    runtime.shutdown()
    r = runtime.init()
    assert r.standalone and r.size == 1
    yield r
    runtime.shutdown()


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def forward_backward(model: nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(6, 4, generator=g), torch.randn(6, 2, generator=g)
    ((model(x) - y) ** 2).mean().backward()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    opt.zero_grad()
    forward_backward(model, seed)
    opt.step()


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Copies of the model's state_dict tensors."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
