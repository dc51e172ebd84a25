"""Test training script that injects a fault at a named phase and logs the committed history.

Like sample_train.py, trained sample indices are buffered in memory and appended to this
process's log (``--log-dir/samples-PID.jsonl``) only when a commit's save completes, together
with one ``commit`` record per save: the commit number (a state attribute, so it rolls back
with the state) and a checksum of the model and optimizer state. A restore sets the buffer
aside; it is logged after the next sync only if the state synced to already contains the
commit it was meant for (a peer completed that commit: see the ``abandon`` fault), followed by an
``{"adopted": N}`` record. So the union of all logs is the committed history, but for one
case: a commit that only ranks that then died completed is lost with them (no holder is
alive), the survivors roll back past it and commit the same number again in a later round;
what the dead logged under the lost one is not history (test_fault_phases.read_history drops
it). Every index of every epoch must appear once in that history, and every rank that logged
commit N must have logged the same checksum.

Faults (``--fault PHASE@WHO[@EPOCH:BATCH]``, repeatable; WHO is ``HOST:SLOT`` or ``rankN``;
each fires once, remembered by a marker file in --log-dir). All are SIGKILL of the worker
itself, at:

* ``launch``       right after import, before hvd.init() contacts the driver;
* ``startup``      inside hvd.init(): the first round is assigned, the process group is forming;
* ``sync``         inside state.sync(), right after its first broadcast was issued (round 0);
* ``merge``        inside commit's save: after the sampler's allgather was issued;
* ``commit``       inside commit: after the save completed, before the host-update check;
* ``allreduce``    inside backward, once the DistributedOptimizer issued a gradient allreduce;
* ``step``         right after an optimizer step (plain crash mid-epoch);
* ``rerendezvous`` while re-rendezvousing after a reset: its new round is being formed.

And one that is not a kill: ``abandon`` makes the chosen rank's commit give up its merge
allgather when the round is aborted, as if the data were still in flight at that moment,
although its peers completed the same allgather (combine with ``commit`` on another rank).

Before dying, a fault appends ``{"phase", "who", "t"}`` to ``--log-dir/faults.jsonl``. A
fault that fires also kills the workers of the same host armed with the same fault (same phase
and step): a host dies at once. Each
worker also appends ``{"round", "t"}`` of its first completed step in every round to
``--log-dir/steps-PID.jsonl`` (not transactional: for timing only).

Sizes: a dataset of 240 samples, batch 6 and a commit after every batch leave a remaining
count that divides evenly over 1, 2, 3 or 4 workers at every commit point: no sampler padding.
"""

import argparse
import json
import os
import signal
import threading
import time

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--samples", type=int, default=240)
p.add_argument("--batch-size", type=int, default=6)
p.add_argument("--sleep", type=float, default=0.01)
p.add_argument("--log-dir", required=True)
p.add_argument("--fault", action="append", default=[], help="PHASE@WHO[@EPOCH:BATCH]")
p.add_argument("--background-commit", action="store_true", help="TorchState(background_commit=True)")
args = p.parse_args()

HOST, SLOT = os.environ.get("ELASTICRUN_HOSTNAME", "?"), os.environ.get("ELASTICRUN_SLOT", "?")
ME = f"{HOST}:{SLOT}"
FAULTS: list[tuple[str, str, tuple[int, int] | None]] = []
for spec in args.fault:
    parts = spec.split("@")
    FAULTS.append((parts[0], parts[1], tuple(map(int, parts[2].split(":"))) if len(parts) > 2 else None))


def _rank() -> int | None:
    from elasticrun.worker import runtime

    return runtime.get().rank if runtime.is_initialized() else int(os.environ.get("ELASTICRUN_RANK", "-1"))


def armed(phase: str, at: tuple[int, int] | None = None) -> str | None:
    """The marker path if a fault of ``phase`` targets this worker now and has not fired yet."""
    for ph, who, when in FAULTS:
        if ph != phase or (when is not None and when != at):
            continue
        if who != ME and who != f"rank{_rank()}":
            continue
        marker = os.path.join(args.log_dir, f"fired-{ph}-{who.replace(':', '_')}")
        if not os.path.exists(marker):
            return marker
    return None


def _pid_file(who: str) -> str:
    return os.path.join(args.log_dir, f"pid-{who.replace(':', '_')}")


with open(_pid_file(ME), "w") as _f:
    _f.write(str(os.getpid()))


def _claim(marker: str) -> bool:
    """Create the fault's marker; False if it exists (two workers of a host may fire at once)."""
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def die(phase: str, marker: str, at: tuple[int, int] | None = None) -> None:
    """SIGKILL this worker, and with it every worker of this host armed with the same fault.

    A host dies at once: its workers do not each reach their own kill point. Killed one by
    one, the first death could abort a peer's step on the same host before it got there, and
    the driver could then send that peer away (its host blacklisted) with its fault unfired.
    """
    victims = [(ME, os.getpid())] if _claim(marker) else []  # else a peer claimed it: it records
    for ph, who, when in FAULTS:
        if ph == phase and when == at and who != ME and who.split(":")[0] == HOST and ":" in who:
            if os.path.exists(_pid_file(who)) and _claim(os.path.join(args.log_dir, f"fired-{ph}-{who.replace(':', '_')}")):
                with open(_pid_file(who)) as f:
                    victims.append((who, int(f.read())))
    with open(os.path.join(args.log_dir, "faults.jsonl"), "a") as f:
        for who, _ in victims:
            f.write(json.dumps({"phase": phase, "who": who, "rank": _rank() if who == ME else None,
                                "t": time.time()}) + "\n")
    for who, pid in victims:
        if who != ME:
            os.kill(pid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


if (m := armed("launch")) is not None:
    die("launch", m)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import elasticrun.torch as hvd  # noqa: E402
from elasticrun.worker import broadcast, issuing, runtime, waiting  # noqa: E402
from elasticrun.worker.state_handlers import SamplerStateHandler  # noqa: E402
from state_checksum import checksum as state_checksum  # noqa: E402 (this directory)

# --- fault hooks (inside this script only: the library is untouched) -------------------------
_form_group = runtime.Runtime._form_group


def form_group(self):
    phase = "startup" if self.rendezvous_count <= 1 else "rerendezvous"
    if (m := armed(phase)) is not None:
        die(phase, m)
    return _form_group(self)


runtime.Runtime._form_group = form_group

in_sync = threading.local()
_broadcast_async = broadcast.broadcast_async_


def broadcast_async(*a, **kw):
    handle = _broadcast_async(*a, **kw)
    if getattr(in_sync, "on", False) and (m := armed("sync")) is not None:
        die("sync", m)
    return handle


broadcast.broadcast_async_ = broadcast_async
_merge = SamplerStateHandler.merge
where = {"epoch": -1, "batch": -1}


def abandon(marker: str) -> None:
    """Make this rank's next waits give up the moment the round is aborted, as if their work
    had still been in flight then (the race a loaded machine makes possible)."""
    open(marker, "w").close()
    with open(os.path.join(args.log_dir, "faults.jsonl"), "a") as f:
        f.write(json.dumps({"phase": "abandon", "who": ME, "rank": _rank(), "t": time.time()}) + "\n")
    orig_wait = waiting.wait

    def wait_for_abort(round_, work, what):
        if what.endswith(".size"):  # the merge's first allgather (counts) completes normally
            return orig_wait(round_, work, what)
        deadline = time.monotonic() + 10
        while round_.abort_reason() is None and time.monotonic() < deadline:
            time.sleep(0.001)
        waiting.wait = orig_wait
        raise hvd.HorovodInternalError(f"{what} abandoned: round {round_.number} was aborted (simulated in-flight)")
    waiting.wait = wait_for_abort


def merge(self):
    if (m := armed("abandon", (where["epoch"], where["batch"]))) is not None:
        abandon(m)
    if (m := armed("merge", (where["epoch"], where["batch"]))) is not None:
        orig_issue = issuing.issue

        def issue_then_die(round_, start, what, *rest, **kw):
            work = orig_issue(round_, start, what, *rest, **kw)
            die("merge", m)
            return work
        issuing.issue = issue_then_die
    return _merge(self)


SamplerStateHandler.merge = merge

# --- training ---------------------------------------------------------------------------------
torch.manual_seed(0)
torch.set_num_threads(1)
hvd.init()
rt = runtime.get()

gen = torch.Generator().manual_seed(1234)
x = torch.randn(args.samples, 8, generator=gen)
y = (x @ torch.randn(8, generator=gen) > 0).long()
dataset = TensorDataset(x, y, torch.arange(args.samples))

model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                     named_parameters=model.named_parameters())


def backward_fault(param):
    # model[0] is the last layer backward reaches: model[2]'s gradients are in flight by now.
    if (m := armed("allreduce", (where["epoch"], where["batch"]))) is not None:
        die("allreduce", m)


model[0].weight.register_post_accumulate_grad_hook(backward_fault)

sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=7)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

log_path = os.path.join(args.log_dir, f"samples-{os.getpid()}.jsonl")
steps_path = os.path.join(args.log_dir, f"steps-{os.getpid()}.jsonl")
pending: list[str] = []
discarded: list[tuple[int, list[str]]] = []  # (the commit they were meant for, sample lines)


def checksum() -> str:
    return state_checksum(model, optimizer)


class LoggedState(hvd.elastic.TorchState):
    """Appends the buffered samples and a commit record when a save completes."""

    def save(self):
        super().save()
        if not self.__dict__.get("_constructed"):
            return
        record = {"commit": self.commits, "rank": hvd.rank(), "size": hvd.size(), "round": rt.round,
                  "checksum": checksum()}
        with open(log_path, "a") as f:
            f.write("".join(pending) + json.dumps(record) + "\n")
        pending.clear()

    def restore(self):
        super().restore()
        # Kept aside, not dropped: if a peer completed the commit these samples were merged
        # into (and the sync adopts it), they are committed history after all.
        discarded.append((self.commits + 1, list(pending)))
        pending.clear()

    def sync(self):
        in_sync.on = True
        try:
            super().sync()
        finally:
            in_sync.on = False
        adopted = [(commit, lines) for commit, lines in discarded if commit <= self.commits]
        if adopted:  # each batch of lines followed by the commit that holds it (no checksum: not a save)
            with open(log_path, "a") as f:
                f.write("".join("".join(lines) + json.dumps({"adopted": commit}) + "\n" for commit, lines in adopted))
        discarded.clear()

    def check_host_updates(self):
        if (m := armed("commit", (where["epoch"], where["batch"]))) is not None:
            die("commit", m)
        super().check_host_updates()


state = LoggedState(model=model, optimizer=optimizer, sampler=sampler, epoch=0, batch=0, commits=0,
                    background_commit=args.background_commit)
stepped_round = -1


@hvd.elastic.run
def train(state):
    global stepped_round
    while state.epoch < args.epochs:
        offset = state.batch
        for idx, (xb, yb, ib) in enumerate(loader):
            state.batch = offset + idx + 1
            where.update(epoch=state.epoch, batch=state.batch)
            optimizer.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            optimizer.step()
            if stepped_round != rt.round:
                stepped_round = rt.round
                with open(steps_path, "a") as f:
                    f.write(json.dumps({"round": rt.round, "rank": hvd.rank(), "t": time.time()}) + "\n")
            state.sampler.record_batch(idx, args.batch_size)
            pending.append(json.dumps({"epoch": state.epoch, "indices": ib.tolist(), "size": hvd.size()}) + "\n")
            if (m := armed("step", (state.epoch, state.batch))) is not None:
                die("step", m, (state.epoch, state.batch))
            time.sleep(args.sleep)
            state.commits += 1
            state.commit()
        state.epoch += 1
        state.batch = 0
        state.sampler.set_epoch(state.epoch)
        state.commits += 1
        state.commit()


train(state)
if hvd.rank() == 0:
    with open(os.path.join(args.log_dir, "result.json"), "w") as f:
        json.dump({"size": hvd.size(), "round": rt.round, "commits": state.commits}, f)
