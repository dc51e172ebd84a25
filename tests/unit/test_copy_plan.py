"""Copy plans: a commit replays a cached plan, and must notice every way the live state can
change under it (re-registered parameters, ``p.data = ...``, dtype moves, deleted modules,
state_dict hooks, replaced or re-pointed optimizer state, new param groups)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

from elasticrun.worker.copier import MEMMOVE_MAX_BYTES, CopyPlan, device_room
from elasticrun.worker.torch_state import TorchState
from standalone_torch import make_model, rt, snapshot, train_step  # noqa: F401 (rt: autouse fixture)

pytestmark = pytest.mark.timeout(60)


# --------------------------------------------------------------------------- CopyPlan


def test_plan_copies_every_kind_of_tensor() -> None:
    big = MEMMOVE_MAX_BYTES // 4 + 10  # float32 elements: over the raw-copy limit
    sources = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.tensor(True),
               torch.randn(4, 6, dtype=torch.float16), torch.empty(0), torch.randn(big),
               torch.randn(6, 4).t(),  # non-contiguous
               torch.tensor(2.5)]  # 0-dim
    buffers = [torch.empty(s.shape, dtype=s.dtype) for s in sources]
    plan = CopyPlan(sources, buffers)
    assert len(plan._raw) == 5 and len(plan._torch) == 2  # the big and the non-contiguous one
    plan.run()
    assert all(torch.equal(b, s) for b, s in zip(buffers, sources))
    for s in sources:
        s.add_(1) if s.dtype != torch.bool else s.logical_not_()
    assert plan.current()
    plan.run()
    assert all(torch.equal(b, s) for b, s in zip(buffers, sources))


def test_plan_notices_repointed_sources_and_keeps_old_memory_alive() -> None:
    p = nn.Parameter(torch.randn(16))
    old = p.detach().clone()
    buf = torch.empty(16)
    plan = CopyPlan([p], [buf])
    assert plan.current([p])
    p.data = torch.zeros(16)  # the old storage is referenced only by the plan now
    assert not plan.current()
    assert not plan.current([nn.Parameter(torch.zeros(16))])  # another object
    plan.run()  # still safe: it reads the memory it kept alive
    assert torch.equal(buf, old)


GiB = 1 << 30


@pytest.mark.parametrize("reserved, peak, fits", [
    (0, 0, True),  # nothing trained yet: 30 GiB free, 10 needed, 8 kept free
    (20 * GiB, 8 * GiB, True),  # 12 GiB the steps never needed at once are free for the copy
    (20 * GiB, 20 * GiB, False),  # cached after a step, needed again at the next one's peak
    (20 * GiB, 19 * GiB, False),  # 31 GiB: less than 10 + 8 kept free beside 30 ... just short
])
def test_a_committed_copy_goes_on_the_gpu_only_if_it_fits_beside_the_steps_peak(reserved: int, peak: int,
                                                                                 fits: bool) -> None:
    """Cached blocks used to count as free: after the first step (activations freed to the
    cache) the optimizer's copy then took the room the next forward pass needed."""
    free = 30 * GiB if reserved == 0 else 8 * GiB
    assert device_room(free, 80 * GiB, reserved, peak, 10 * GiB) is fits


def test_plan_rejects_mismatched_lists() -> None:
    with pytest.raises(ValueError, match="2 sources for 1 buffers"):
        CopyPlan([torch.zeros(1), torch.zeros(1)], [torch.zeros(1)])


# --------------------------------------------------------------------------- model handler


def assert_committed(state: TorchState, model: nn.Module) -> None:
    """The commit holds exactly the live state_dict, and restore brings it back."""
    handler = state._handlers["model"]
    saved, live = handler._buffers, model.state_dict()
    assert set(saved) | set(handler._extra) == set(live)
    assert all(torch.equal(saved[k], live[k]) and saved[k].dtype == live[k].dtype for k in saved)
    assert all(handler._extra[k] == live[k] for k in handler._extra)
    committed = snapshot(model)
    with torch.no_grad():
        for t in model.state_dict(keep_vars=True).values():
            if isinstance(t, torch.Tensor):
                t.add_(3) if t.is_floating_point() else t.add_(1)
    state.restore()
    after = snapshot(model)
    assert list(after) == list(committed) and all(torch.equal(after[k], committed[k]) for k in after)


def _replace_param(m: nn.Module) -> None:
    m[0].weight = nn.Parameter(torch.full((8, 4), 7.0))


def _repoint_param(m: nn.Module) -> None:
    m[0].weight.data = torch.full((8, 4), 5.0)


def _repoint_non_contiguous(m: nn.Module) -> None:
    m[3].weight.data = torch.full((8, 2), 4.0).t()


def _replace_buffer(m: nn.Module) -> None:
    m[1].running_mean = torch.full((8,), 9.0)


def _new_buffer(m: nn.Module) -> None:
    m[1].register_buffer("extra", torch.arange(3.0))


def _new_submodule(m: nn.Module) -> None:
    m.add_module("head", nn.Linear(2, 2))


def _delete_submodule(m: nn.Module) -> None:
    del m[3]


def _delete_parameter(m: nn.Module) -> None:
    del m[3].bias


def _to_double(m: nn.Module) -> None:
    m.double()


def _state_dict_hook(m: nn.Module) -> None:
    def hook(module: nn.Module, state: dict[str, Any], prefix: str, local: Any) -> None:
        state[prefix + "marker"] = torch.tensor([42.0])
    m[0]._register_state_dict_hook(hook)


def _extra_state(m: nn.Module) -> None:
    class WithExtra(nn.Linear):
        def get_extra_state(self) -> Any:
            return {"calls": 1}

        def set_extra_state(self, state: Any) -> None:
            pass
    m.add_module("extra", WithExtra(2, 2))


MODEL_CHANGES: dict[str, Callable[[nn.Module], None]] = {
    "replace a parameter": _replace_param, "re-point a parameter": _repoint_param,
    "re-point to a non-contiguous tensor": _repoint_non_contiguous, "replace a buffer": _replace_buffer,
    "register a buffer": _new_buffer, "add a submodule": _new_submodule, "delete a submodule": _delete_submodule,
    "delete a parameter": _delete_parameter, "convert to float64": _to_double,
    "register a state_dict hook": _state_dict_hook, "add a module with extra state": _extra_state,
}


@pytest.mark.parametrize("change", list(MODEL_CHANGES))
def test_model_commit_follows_structural_changes(change: str) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_step(model, opt, 1)
    state = TorchState(model=model, epoch=0)
    state.commit()
    assert state._handlers["model"]._plan_is_current()
    MODEL_CHANGES[change](model)
    state.commit()
    assert_committed(state, model)
    state.commit()  # and the plan built after the change is right too
    assert_committed(state, model)


def test_model_commit_without_changes_does_not_walk_the_state_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = TorchState(model=model)
    walks = []
    original = nn.Module.state_dict
    monkeypatch.setattr(nn.Module, "state_dict", lambda self, *a, **k: walks.append(1) or original(self, *a, **k))
    for seed in range(3):
        train_step(model, opt, seed)  # in-place updates, BatchNorm statistics
        state.commit()
    assert walks == []
    monkeypatch.undo()
    assert_committed(state, model)


def test_unrelated_module_registration_costs_a_walk_not_a_rebuild() -> None:
    model = make_model()
    state = TorchState(model=model)
    handler = state._handlers["model"]
    plan = handler._plan
    nn.Linear(3, 3)  # registers parameters on another module: the generation moves
    assert not handler._plan_is_current()
    state.commit()
    assert handler._plan is plan and handler._plan_is_current()


# --------------------------------------------------------------------------- optimizer handler


def opt_snapshot(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy(opt.state_dict())


def assert_opt_committed(state: TorchState, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    committed = opt_snapshot(opt)
    train_step(model, opt, 99)
    for group in opt.param_groups:
        group["lr"] = 0.5
    state.restore()
    now = opt_snapshot(opt)
    assert now["param_groups"] == committed["param_groups"]
    assert now["state"].keys() == committed["state"].keys()
    for i, entry in committed["state"].items():
        assert now["state"][i].keys() == entry.keys(), i
        for k, v in entry.items():
            w = now["state"][i][k]
            assert (torch.equal(v, w) and v.dtype == w.dtype) if isinstance(v, torch.Tensor) else v == w, (i, k)


def _first_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return opt.state[opt.param_groups[0]["params"][0]]


def _replace_state_tensor(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    _first_state(opt)["exp_avg"] = torch.full_like(_first_state(opt)["exp_avg"], 3.0)


def _repoint_state_tensor(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    st = _first_state(opt)
    st["exp_avg"].data = torch.full_like(st["exp_avg"], 2.0)


def _last_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return list(opt.state.values())[-1]


def _new_plain_entry(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    _last_state(opt)["added"] = 1  # last: no tensor moves in the flattened entries


def _replace_state_dict(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    p = list(opt.state)[-1]
    opt.state[p] = {**opt.state[p], "note": "second"}  # same keys and tensors, another dict


def _reorder_parameters(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    params = opt.param_groups[0]["params"]
    params[0], params[1] = params[1], params[0]


def _add_param_group(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    extra = nn.Parameter(torch.ones(3))
    opt.add_param_group({"params": [extra], "lr": 0.2})
    extra.grad = torch.ones(3)
    opt.step()


def _parameter_gains_state(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    frozen = model[3].bias
    frozen.grad = torch.ones_like(frozen)  # had no gradient, hence no state, until now
    opt.step()


def _load_state_dict(opt: torch.optim.Optimizer, model: nn.Module) -> None:
    sd = opt.state_dict()
    for entry in sd["state"].values():
        entry["exp_avg"] = entry["exp_avg"] + 1
    opt.load_state_dict(sd)


OPT_CHANGES: dict[str, Callable[[torch.optim.Optimizer, nn.Module], None]] = {
    "replace a state tensor": _replace_state_tensor, "re-point a state tensor": _repoint_state_tensor,
    "new non-tensor entry": _new_plain_entry, "replace a state dict": _replace_state_dict, "add a param group": _add_param_group,
    "reorder parameters": _reorder_parameters,
    "a parameter gains state": _parameter_gains_state, "load_state_dict": _load_state_dict,
}


@pytest.mark.parametrize("change", list(OPT_CHANGES))
def test_optimizer_commit_follows_state_changes(change: str) -> None:
    model = make_model()
    model[3].bias.requires_grad_(False)  # no gradient, so no Adam state, for now
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, 1)
    model[3].bias.requires_grad_(True)
    _last_state(opt)["note"] = "first"
    state = TorchState(model=model, optimizer=opt)
    state.commit()
    handler = state._handlers["optimizer"]
    assert handler._plan_is_current(handler._params())
    OPT_CHANGES[change](opt, model)
    state.commit()
    assert_opt_committed(state, model, opt)
    state.commit()
    assert handler._plan_is_current(handler._params())
    assert_opt_committed(state, model, opt)


def test_non_tensor_optimizer_state_is_copied_by_every_commit() -> None:
    model = make_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    train_step(model, opt, 1)
    state = TorchState(model=model, optimizer=opt)
    _first_state(opt)["note"] = ["a"]
    state.commit()
    state.commit()  # the fast path
    handler = state._handlers["optimizer"]
    assert handler._plan_is_current(handler._params())
    _first_state(opt)["note"].append("b")  # in place: the same keys, the same tensors
    state.commit()
    _first_state(opt)["note"].append("c")
    state.restore()
    assert _first_state(opt)["note"] == ["a", "b"]
