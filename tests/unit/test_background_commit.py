"""``TorchState(background_commit=True)``: the copy of parameters and optimizer state runs on
a thread, and everything that could change them first waits for it.

The background copy is held at a gate (an Event) so that each test can do the conflicting
operation while the copy is provably still pending."""

from __future__ import annotations

import copy
import threading
from typing import Any, Iterator

import pytest
import torch
from torch import nn

from elasticrun.worker.copier import CopyPlan
from elasticrun.worker.torch_state import TorchState
from standalone_torch import forward_backward, make_model, rt, train_step  # noqa: F401 (rt: autouse fixture)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Background copies start only once the gate is set."""
    opened = threading.Event()
    original = CopyPlan.run_released

    def held(self: CopyPlan) -> None:
        assert opened.wait(30), "the test never opened the gate"
        original(self)

    monkeypatch.setattr(CopyPlan, "run_released", held)
    yield opened
    opened.set()


def full_snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": copy.deepcopy(opt.state_dict())}


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["opt"]["param_groups"] == b["opt"]["param_groups"]
    for i, entry in a["opt"]["state"].items():
        for k, v in entry.items():
            assert torch.equal(v, b["opt"]["state"][i][k]), (i, k)


def make_state(background: bool = True) -> tuple[nn.Module, torch.optim.Optimizer, TorchState]:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    train_step(model, opt, 0)
    return model, opt, TorchState(model, opt, background_commit=background, epoch=0)


def test_the_copy_runs_on_another_thread_and_restore_waits_for_it(gate: threading.Event,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, state = make_state()  # construction saved synchronously
    train_step(model, opt, 1)
    state.commit()
    committed = full_snapshot(model, opt)
    assert state._pending is not None and not state._pending.done()  # held at the gate
    waiting = threading.Event()
    original = TorchState.wait_for_commit
    monkeypatch.setattr(TorchState, "wait_for_commit", lambda self: waiting.set() or original(self))
    opener = threading.Thread(target=lambda: waiting.wait(30) and gate.set())
    opener.start()
    # Without the wait, restore would load the construction-time copy still in the buffers.
    state.restore()
    opener.join(30)
    assert state._pending is None
    assert_same(full_snapshot(model, opt), committed)


def test_optimizer_step_waits_for_the_copy(gate: threading.Event) -> None:
    model, opt, state = make_state()
    entered = threading.Event()
    opt.register_step_pre_hook(lambda *_: entered.set())  # runs before the state's own hook
    train_step(model, opt, 1)
    state.commit()
    committed = full_snapshot(model, opt)
    opener = threading.Thread(target=lambda: entered.wait(30) and gate.set())
    opener.start()
    train_step(model, opt, 2)  # blocks in the state's hook until the copy is done
    opener.join(30)
    assert state._pending is None or state._pending.done()
    state.restore()
    assert_same(full_snapshot(model, opt), committed)


def test_buffers_and_unguarded_parameters_are_copied_at_once(gate: threading.Event) -> None:
    model = make_model()
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1, momentum=0.9)  # updates model[0] only
    forward_backward(model, 0)
    opt.step()
    state = TorchState(model, opt, background_commit=True)
    state.commit()
    committed = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    forward_backward(model, 1)  # BatchNorm running statistics move
    with torch.no_grad():
        model[3].weight.mul_(2)  # another optimizer, not in the state, would do this
    assert not torch.equal(model[1].running_mean, committed["1.running_mean"])
    gate.set()
    state.restore()
    after = model.state_dict()
    for k in committed:
        assert torch.equal(after[k], committed[k]), k


def test_commits_back_to_back_and_sync_wait(gate: threading.Event) -> None:
    model, opt, state = make_state()
    gate.set()
    for seed in range(1, 4):
        train_step(model, opt, seed)
        state.commit()
    committed = full_snapshot(model, opt)
    state.sync()  # a world of one: waits, then commits the live state
    train_step(model, opt, 9)
    state.restore()
    assert_same(full_snapshot(model, opt), committed)


def test_matches_a_synchronous_commit() -> None:
    states = []
    for background in (False, True):
        model, opt, state = make_state(background)
        for seed in range(1, 4):
            train_step(model, opt, seed)
            state.commit()
        train_step(model, opt, 7)
        state.restore()
        states.append(full_snapshot(model, opt))
    assert_same(states[0], states[1])


def test_a_failed_copy_surfaces_at_the_next_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, state = make_state()

    def broken(self: CopyPlan) -> None:
        raise MemoryError("no room for the copy")

    monkeypatch.setattr(CopyPlan, "run_released", broken)
    state.commit()
    with pytest.raises(MemoryError, match="no room"):
        train_step(model, opt, 1)
    monkeypatch.undo()
    train_step(model, opt, 2)  # reported once; the next commit starts clean
    state.commit()
    state.wait_for_commit()


def test_a_copy_that_never_finishes_is_reported(gate: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt, state = make_state()
    monkeypatch.setattr(TorchState, "COMMIT_WAIT_TIMEOUT", 0.05)
    state.commit()
    with pytest.raises(RuntimeError, match=r"background copy of commit 1 did not finish within 0 s"):
        state.wait_for_commit()
    gate.set()
    state.wait_for_commit()
