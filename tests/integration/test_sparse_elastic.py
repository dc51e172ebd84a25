"""An Embedding(sparse=True) in an elastic job that grows: the survivors have taken it out of
their gradient buckets (it is reduced as sparse), the newcomer's fresh optimizer had not, and
every rank raised CollectiveMismatch at the first step after the join."""

from __future__ import annotations

import sys

import pytest

from conftest import growing_discovery

pytestmark = pytest.mark.timeout(180)


def test_a_newcomer_reduces_the_survivors_sparse_parameters_as_sparse(job):
    grow, growing = growing_discovery(job.tmp)
    script = job.tmp / "sparse_grow.py"
    script.write_text(
        "import time, torch\nimport elasticrun.torch as hvd\nhvd.init()\ntorch.manual_seed(0)\n"
        "emb, lin = torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1)\n"
        "model = torch.nn.ModuleDict({'emb': emb, 'lin': lin})\n"
        "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "
        "named_parameters=model.named_parameters())\n"
        "state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)\n"
        "@hvd.elastic.run\n"
        "def train(state):\n"
        "    while state.step < 30 or hvd.size() < 3:\n"
        "        opt.zero_grad()\n"
        "        lin(emb(torch.tensor([1, 2, 3]))).sum().backward()\n"
        "        opt.step()\n"
        "        state.step += 1\n"
        f"        if state.step == 5 and hvd.rank() == 0: open({str(grow)!r}, 'w').close()\n"
        "        time.sleep(0.05)\n"
        "        state.commit()\n"
        "train(state)\n"
        "sums = hvd.allgather_object(emb.weight.detach().numpy().tobytes())\n"
        "print('end', hvd.rank(), hvd.size(), 'replicas', 'same' if len(set(sums)) == 1 else 'DIFFERENT', flush=True)\n")
    r = job.run([*growing, "--collective-timeout", "30"], [sys.executable, str(script)], timeout=150)
    assert r.returncode == 0, r.output
    assert "round 1: 3 worker(s)" in r.stderr, r.stderr
    assert sorted(line.split("]<stdout>:")[-1] for line in r.stdout.splitlines() if "end " in line) == [
        "end 0 3 replicas same", "end 1 3 replicas same", "end 2 3 replicas same"], r.stdout
