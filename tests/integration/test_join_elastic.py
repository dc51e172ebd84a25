"""hvd.join() inside an elastic loop, with uneven data (a rank trains more steps than another).

A joined rank mirrors the others' gradient allreduces but applies none of their steps (as in
Horovod), so the ranks reach the end of join() with different step histories and replicas;
an elastic state then takes the last rank's replica on every rank (``join._sync_state``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import SCRIPTS, growing_discovery

pytestmark = pytest.mark.timeout(180)

SCRIPT = str(SCRIPTS / "join_uneven.py")

#: The start of the scripts written here: a model, its DistributedOptimizer, one batch.
PRELUDE = ("import hashlib, time, torch, torch.nn.functional as F\nimport elasticrun.torch as hvd\nhvd.init()\n"
           "torch.manual_seed(0)\ntorch.set_num_threads(1)\nmodel = torch.nn.Linear(8, 2)\n"
           "opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), "
           "named_parameters=model.named_parameters())\n"
           "x, y = torch.randn(6, 8), torch.zeros(6, dtype=torch.long)\n")


def _uneven_every_step(marker: Path, at_size: int) -> str:
    """Uneven data with a commit every step: each epoch rank k trains 4 + 6k batches, then
    calls join(). At batch 6 of epoch 0, in a round of ``at_size`` ranks, the last rank makes
    ``marker`` (discovery then lists other hosts) and waits for the driver's news of it (Horovod's
    ``state._host_messages``), while rank 0 sits in join(). Each entry into the loop prints
    whether the replicas are the same."""
    return (PRELUDE +
            "state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)\n"
            "def same():\n"
            "    d = hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()\n"
            "    return 'same' if len(set(hvd.allgather_object(d))) == 1 else 'DIFFERENT'\n"
            "@hvd.elastic.run\n"
            "def train(state):\n"
            "    print(f'entry rank={hvd.rank()} size={hvd.size()} replicas={same()}', flush=True)\n"
            "    while state.epoch < 2:\n"
            "        while state.batch < 4 + 6 * hvd.rank():\n"
            "            opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()\n"
            "            state.batch += 1\n"
            f"            if state.epoch == 0 and hvd.size() == {at_size} and hvd.rank() == {at_size - 1} "
            "and state.batch == 6:\n"
            f"                open({str(marker)!r}, 'w').close()\n"
            "                t = time.monotonic() + 60  # until the driver's news of the change is here\n"
            "                while state._host_messages.empty() and time.monotonic() < t:\n"
            "                    time.sleep(0.05)\n"
            "            state.commit()\n"
            "        hvd.join()\n"
            "        state.epoch += 1; state.batch = 0\n"
            "        state.commit()\n"
            "train(state)\n"
            "print('finished', hvd.rank(), hvd.size(), flush=True)\n")


def test_a_commit_after_join_takes_one_path_on_every_rank(job):
    """The host-update flags ride in the gradient allreduce, and only the rank that stepped
    recorded them: at the commit after join() it skipped the check's own collective that the
    joined rank ran, and gloo aborted a process ('Received data size doesn't match'), or the
    job hung for --collective-timeout."""
    r = job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--collective-timeout", "30"],
                [sys.executable, SCRIPT], timeout=120)
    assert r.returncode == 0, r.output
    assert "failed" not in r.stderr, r.stderr
    assert "end rank=0 size=2" in r.stdout and "end rank=1 size=2" in r.stdout, r.stdout


def test_a_sync_after_join_sends_the_roots_replica_to_every_rank(job):
    """After a failure the survivors restore their own commits, which a join() left different;
    the sync trusted that ranks holding the same commit hold the same tensors and sent nothing,
    and the job 'succeeded' with replicas apart for good."""
    r = job.run(["-np", "3", "--min-np", "2", "-H", "localhost:1,127.0.0.1:1,127.0.0.2:1",
                 "--collective-timeout", "30"], [sys.executable, SCRIPT, "kill"], timeout=150)
    assert r.returncode == 0, r.output
    assert "(rank 2)" in r.stderr and "round 1: 2 worker(s)" in r.stderr, r.stderr  # the failure happened
    entries = [line for line in r.stdout.splitlines() if "entry rank=" in line]
    assert any("size=2 epoch=2" in line for line in entries), r.stdout  # a restore after join() was synced
    assert all(line.endswith("replicas=same") for line in entries), r.stdout


def test_join_ends_on_the_last_ranks_replica_everywhere_and_durable_copies_go_on(job):
    """The ranks that stepped on committed while the others sat in join(): every rank's commit
    count and replica differed from then on, and a durable copy (each rank's shard of one
    commit) was never whole again in the round: the job ended "succeeded" with its newest copy
    from before the first join. A copy due while a rank sits in join() (every 0.2 s here) was
    started by the others and failed ("durable copy not written"): that rank saved none of
    their commits. The joined rank now says "busy" in the flags the commits agree copies in,
    whether they ride in the gradient allreduce or in the commit's own (the second commit of
    an even batch), and the copy waits for the first commit after the join."""
    ckpt = job.tmp / "ckpt"
    script = job.tmp / "join_copies.py"
    script.write_text(
        PRELUDE +
        "state = hvd.elastic.TorchState(model=model, optimizer=opt, epoch=0, batch=0)\n"
        "def digest():\n"
        "    return hashlib.sha256(b''.join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()\n"
        "@hvd.elastic.run\n"
        "def train(state):\n"
        "    while state.epoch < 3:\n"
        "        while state.batch < 3 + 3 * hvd.rank():\n"
        "            opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()\n"
        "            state.batch += 1; time.sleep(0.1)\n"
        "            state.commit()\n"
        "            if state.batch % 2 == 0:\n"
        "                state.commit()  # no gradient allreduce since the last: the check's own agrees\n"
        "        last = hvd.join()\n"
        "        same = len(set(hvd.allgather_object((digest(), state.batch, state.commit_seq)))) == 1\n"
        "        print(f'joined epoch={state.epoch} last={last} same={same} commit={state.commit_seq}', flush=True)\n"
        "        state.epoch += 1; state.batch = 0\n"
        "        state.commit()\n"
        "train(state)\n")
    r = job.run(["-np", "3", "-H", "localhost:2,127.0.0.1:1", "--checkpoint-dir", str(ckpt),
                 "--checkpoint-interval", "0.2", "--collective-timeout", "30"], [sys.executable, str(script)], timeout=120)
    assert r.returncode == 0, r.output
    joined = [line for line in r.stdout.splitlines() if "joined epoch=" in line]
    assert len(joined) == 9 and all("last=2 same=True" in line for line in joined), r.stdout
    last_join = max(int(line.rsplit("commit=", 1)[1]) for line in joined if "epoch=1" in line)
    copies = [json.loads(m.read_text())["commit"] for m in ckpt.glob("ckpt-*/manifest.json")]
    assert copies and max(copies) > last_join, (copies, last_join, r.output)  # written after the second join
    assert "durable copy not written" not in r.stderr, r.stderr


def test_a_rank_that_joins_before_its_first_step_of_the_round_steps_with_the_others_after(job):
    """Rank 0 has no batch in epoch 0 (an empty shard) and joins at once; rank 1 steps, and its
    first launch checks the buckets against the other ranks' (rank 0 takes part from join()).
    In epoch 1 rank 0 made that check alone while rank 1 reduced gradients: both waited out
    --collective-timeout."""
    script = job.tmp / "empty_shard.py"
    script.write_text(
        PRELUDE +
        "for epoch in range(2):\n"
        "    for _ in range((0 if hvd.rank() == 0 else 3) if epoch == 0 else 2):\n"
        "        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()\n"
        "    hvd.join()\n"
        "print('finished', hvd.rank(), flush=True)\n")
    r = job.run(["-np", "2", "-H", "localhost:1,127.0.0.1:1", "--collective-timeout", "20"],
                [sys.executable, str(script)], timeout=90)
    assert r.returncode == 0, r.output
    assert "finished 0" in r.stdout and "finished 1" in r.stdout
    assert r.seconds < 20, r.seconds  # not after a collective timeout


def test_a_rank_in_join_leaves_with_the_others_when_a_host_is_added(job):
    """Uneven data with a commit every step: rank 0 runs out first and sits in join() while
    rank 1 steps on; a host is added meanwhile. Rank 1's commit raises HostsUpdatedInterrupt
    and goes to the next round's rendezvous; rank 0 waited in join() for an operation that
    never came, until --collective-timeout, and then rolled back to its last commit."""
    grow, growing = growing_discovery(job.tmp)
    script = job.tmp / "join_grow.py"
    script.write_text(_uneven_every_step(grow, at_size=2))
    r = job.run([*growing, "--collective-timeout", "40"], [sys.executable, str(script)], timeout=120)
    assert r.returncode == 0, r.output
    assert "round 1: 3 worker(s)" in r.stderr, r.stderr
    assert "no operation from the other ranks" not in r.output and "restoring" not in r.output, r.output
    assert r.seconds < 40, r.seconds  # not after a collective timeout


def test_a_rank_in_join_when_a_host_is_removed_gets_the_others_replica(job):
    """Rank 0 runs out first and sits in join() while the others step on; 127.0.0.2 is then
    removed. The interrupt says "removals only" (skip_sync): the survivors keep their own
    state. Rank 0 applied none of the steps it sat out, so it went on with a replica of its
    own for the rest of the job, which said it succeeded."""
    marker = job.tmp / "shrink"
    discover = job.tmp / "discover.sh"
    discover.write_text(f"#!/bin/sh\nprintf 'localhost:1\\n127.0.0.1:1\\n'\n[ -f {marker} ] || echo 127.0.0.2:1\n")
    discover.chmod(0o755)
    script = job.tmp / "join_shrink.py"
    script.write_text(_uneven_every_step(marker, at_size=3))
    r = job.run(["-np", "3", "--min-np", "2", "--host-discovery-script", str(discover), "--discovery-interval", "1",
                 "--collective-timeout", "40"], [sys.executable, str(script)], timeout=120)
    assert r.returncode == 0, r.output
    assert "round 1: 2 worker(s)" in r.stderr, r.stderr
    entries = [line for line in r.stdout.splitlines() if "entry rank=" in line]
    assert any("size=2" in line for line in entries), r.stdout  # the removal happened in the first epoch
    assert all(line.endswith("replicas=same") for line in entries), r.stdout
    assert r.seconds < 40, r.seconds  # not after a collective timeout


def test_batches_a_rank_trained_before_join_stay_processed_when_its_host_is_removed(job):
    """Rank 2 trains a batch past its last commit, then joins; the others commit while it sits
    in join(), and its host is removed. Those commits merged only the stepping ranks' batches,
    though rank 2's last one was in their model: after the removal the survivors' sampler
    handed it out again (trained twice)."""
    marker = job.tmp / "shrink"
    discover = job.tmp / "discover.sh"
    discover.write_text(f"#!/bin/sh\nprintf 'localhost:1\\n127.0.0.1:1\\n'\n[ -f {marker} ] || echo 127.0.0.2:1\n")
    discover.chmod(0o755)
    script = job.tmp / "join_sampler.py"
    script.write_text(PRELUDE +
        "sampler = hvd.elastic.ElasticSampler(range(60), shuffle=False)\n"
        "state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, batch=0)\n"
        "@hvd.elastic.run\n"
        "def train(state):\n"
        "    print(f'entry rank={hvd.rank()} size={hvd.size()} processed={sorted(sampler.processed_indices)}', "
        "flush=True)\n"
        "    if hvd.size() < 3:\n"
        "        return\n"
        "    limit = 4 if hvd.rank() == 2 else 10\n"
        "    while state.batch < limit:\n"
        "        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()\n"
        "        sampler.record_batch(state.batch, 2)\n"
        "        state.batch += 1\n"
        f"        if hvd.rank() == 0 and state.batch == 7:\n"
        f"            open({str(marker)!r}, 'w').close()\n"
        "            t = time.monotonic() + 60  # until the driver's news of the change is here\n"
        "            while state._host_messages.empty() and time.monotonic() < t:\n"
        "                time.sleep(0.05)\n"
        "        if state.batch % 3 == 0:\n"
        "            state.commit()\n"
        "    if hvd.rank() == 2:\n"
        "        print(f'joins rank=2 trained={sorted(sampler.get_indices(0, 8))}', flush=True)\n"
        "    hvd.join()\n"
        "train(state)\n")
    r = job.run(["-np", "3", "--min-np", "2", "--host-discovery-script", str(discover), "--discovery-interval", "1",
                 "--collective-timeout", "40"], [sys.executable, str(script)], timeout=120)
    assert "round 1: 2 worker(s)" in r.stderr, r.output
    [joined] = [line for line in r.stdout.splitlines() if "joins rank=2 " in line]
    trained = set(eval(joined.split("trained=")[1]))  # rank 2's four batches: all in the model
    after = [line for line in r.stdout.splitlines() if "entry" in line and "size=2" in line]
    assert after, r.stdout
    for line in after:
        processed = set(eval(line.split("processed=")[1]))
        assert trained <= processed, (sorted(trained - processed), line)


@pytest.mark.parametrize("batch", [150, 3000])
def test_what_a_rank_recorded_before_join_reaches_the_others_commits_whole(job, batch):
    """A rank that never committed records thousands of indices, then joins: what it publishes
    (int64s at 150 a batch, sparse in 40,000; bits below its largest index at 3,000: worker/join_news.py)
    is merged by each of the others' commits while it sits in join(), and after the last one
    every rank holds every index recorded, once, and nothing else."""
    script = job.tmp / "join_news.py"
    script.write_text(PRELUDE +
        f"sampler = hvd.elastic.ElasticSampler(range(40_000), shuffle=True, seed=5)\n"
        "state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, batch=0)\n"
        "mine = []\n"
        "@hvd.elastic.run\n"
        "def train(state):\n"
        "    steps = 3 if hvd.rank() == 1 else 5\n"
        "    while state.batch < steps:\n"
        "        opt.zero_grad(); F.cross_entropy(model(x), y).backward(); opt.step()\n"
        f"        got = sampler.get_indices(state.batch, {batch})\n"
        "        mine.extend(got)\n"
        f"        sampler.record_batch(state.batch, {batch})\n"
        "        state.batch += 1\n"
        "        if hvd.rank() == 0 and state.batch > 3:\n"
        "            state.commit()  # (rank 1 sits in join(): its news merged here)\n"
        "            print(f'rank 0 committed {len(sampler.processed_indices)} beside a joined rank', flush=True)\n"
        "    hvd.join()\n"
        "    state.commit()\n"
        "train(state)\n"
        "everyone = hvd.allgather_object(sorted(mine))\n"
        "recorded = sorted(i for part in everyone for i in part)\n"
        "done = sampler.processed_indices\n"
        "print(f'rank={hvd.rank()} whole={sorted(done) == recorded} repeated={len(recorded) - len(set(recorded))} '\n"
        "      f'processed={len(done)}', flush=True)\n")
    # (without numpy, which elasticrun does not depend on: the wire forms are torch's and array's)
    r = job.run(["-np", "2", "-H", "localhost:2"], [sys.executable, str(script)], timeout=120,
                PYTHONPATH=str(SCRIPTS / "no_numpy"))
    assert r.returncode == 0, r.output
    # rank 0's 4 batches and rank 1's 3 (what it published as it joined), then its fifth
    assert f"rank 0 committed {7 * batch} beside a joined rank" in r.stdout, r.output
    assert f"rank 0 committed {8 * batch} beside a joined rank" in r.stdout, r.output
    for rank in (0, 1):
        assert f"rank={rank} whole=True repeated=0 processed={8 * batch}" in r.stdout, r.output
