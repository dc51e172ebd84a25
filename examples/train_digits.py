"""Elastic training of a small MLP on scikit-learn's bundled digits (8x8 images, 1797 samples).

Written exactly like a Horovod elastic PyTorch script: only the import line differs
(``import elasticrun.torch as hvd`` instead of ``import horovod.torch as hvd``).

Run it elastically (hosts come and go as ``discover_hosts.sh`` says; see examples/README.md):

    elasticrun -np 2 --min-np 1 --max-np 3 \\
        --host-discovery-script examples/discover_hosts.sh --discovery-interval 0.5 \\
        python examples/train_digits.py --sleep-per-batch 0.1

or as a plain one-process job, without the launcher:

    python examples/train_digits.py

A fixed 20% of the data (stratified, seeded) is held out; at the end rank 0 prints
``test accuracy: 0.9xx``. ``--sleep-per-batch`` slows training down so that hosts have
time to change while it runs.
"""

import argparse
import sys
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import elasticrun.torch as hvd

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--epochs", type=int, default=12, help="epochs to train")
parser.add_argument("--batch-size", type=int, default=32, help="batch size per worker")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate of one worker (scaled by the world size)")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--hidden", type=int, default=128, help="width of the two hidden layers")
parser.add_argument("--commit-every", type=int, default=5, help="commit the elastic state every N batches")
parser.add_argument("--sleep-per-batch", type=float, default=0.0,
                    help="seconds to sleep after each batch (makes the demo long enough for hosts to change)")
parser.add_argument("--seed", type=int, default=42, help="seed of the data split, the model and the shuffling")
args = parser.parse_args()

# Horovod: initialize (standalone, without elasticrun, this is a one-process job).
hvd.init()
torch.set_num_threads(1)  # several workers share this machine's cores
torch.manual_seed(args.seed)


def log(text: str, end: str = "\n") -> None:
    if hvd.rank() == 0:
        print(text, end=end, flush=True)


# ----------------------------------------------------------------------------- data

digits_x, digits_y = load_digits(return_X_y=True)
x_train, x_test, y_train, y_test = train_test_split(
    digits_x, digits_y, test_size=0.2, random_state=args.seed, stratify=digits_y)


def to_dataset(x, y) -> TensorDataset:
    return TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y, dtype=torch.long))


train_dataset = to_dataset(x_train, y_train)
test_dataset = to_dataset(x_test, y_test)

# Horovod: the elastic sampler shards the data over the ranks *that exist now* and remembers
# which samples were processed this epoch, so a resize continues the epoch instead of
# restarting it.
train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)

# ----------------------------------------------------------------------------- model

model = torch.nn.Sequential(
    torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
    torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
    torch.nn.Linear(args.hidden, 10),
)

# Horovod: scale the learning rate by the number of workers (the global batch grows with it).
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

# Horovod: average gradients over the workers at every step.
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def evaluate(dataset: TensorDataset) -> tuple[float, float]:
    """(mean loss, accuracy) of the model on a whole dataset (called on rank 0 only)."""
    model.eval()
    with torch.no_grad():
        x, y = dataset.tensors
        out = model(x)
        loss = F.cross_entropy(out, y).item()
        accuracy = (out.argmax(dim=1) == y).float().mean().item()
    model.train()
    return loss, accuracy


# ----------------------------------------------------------------------------- progress

BAR_WIDTH = 30
INTERACTIVE = sys.stdout.isatty()  # a terminal: redraw one line; a pipe (elasticrun): print lines


def show_progress(epoch: int, fraction: float, loss: float) -> None:
    filled = int(round(BAR_WIDTH * min(fraction, 1.0)))
    bar = "#" * filled + "." * (BAR_WIDTH - filled)
    line = (f"epoch {epoch + 1:>2}/{args.epochs} [{bar}] {100 * min(fraction, 1.0):3.0f}%  "
            f"world size {hvd.size()}  loss {loss:.4f}")
    if INTERACTIVE:
        log("\r" + line, end="")
    else:
        log(line)


# ----------------------------------------------------------------------------- elastic loop


def on_state_reset() -> None:
    """Horovod: called after every reset (a host was added or removed, or a worker failed)."""
    for group in optimizer.param_groups:
        group["lr"] = args.lr * hvd.size()
    if INTERACTIVE:
        log("")
    log(f"reset: world size is now {hvd.size()}, learning rate {args.lr * hvd.size():.3g}")


def end_epoch(state) -> None:
    """Finish an epoch: new shuffle, empty processed set, then commit (see ElasticSampler)."""
    state.epoch += 1
    state.batch = 0
    state.sampler.set_epoch(state.epoch)
    state.commit()


epoch_clock = {"epoch": None, "start": 0.0}  # wall time of the epoch, for the summary line


@hvd.elastic.run
def train(state) -> None:
    # Called again, in the same process, after every reset: the loops resume at
    # state.epoch / state.batch, and the sampler yields only what is left of the epoch,
    # partitioned over the current world.
    while state.epoch < args.epochs:
        if epoch_clock["epoch"] != state.epoch:  # not when resuming an epoch after a reset
            epoch_clock.update(epoch=state.epoch, start=time.monotonic())
        sampler = state.sampler
        total = len(train_dataset)
        done_before = total - len(sampler.remaining_indices)  # trained this epoch, all ranks
        samples_per_step = args.batch_size * hvd.size()
        batch_offset = state.batch
        shown = -1  # quarter of the epoch shown last (pipe mode)
        running_loss = None

        for idx, (data, target) in enumerate(train_loader):
            # idx counts batches of *this pass* over the loader: the sampler's batch numbers.
            # state.batch counts the batches of the whole epoch (used for the commit cadence).
            state.batch = batch_offset + idx + 1

            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()

            # Horovod: record which samples this batch processed.
            state.sampler.record_batch(idx, args.batch_size)

            running_loss = loss.item() if running_loss is None else 0.9 * running_loss + 0.1 * loss.item()
            fraction = (done_before + (idx + 1) * samples_per_step) / total
            if INTERACTIVE or int(4 * min(fraction, 1.0)) > shown:
                shown = int(4 * min(fraction, 1.0))
                show_progress(state.epoch, fraction, running_loss)

            if args.sleep_per_batch > 0:
                time.sleep(args.sleep_per_batch)

            # Horovod: save the state and check (collectively) whether hosts changed.
            if state.batch % args.commit_every == 0:
                state.commit()

        if hvd.rank() == 0:
            if INTERACTIVE:
                log("")
            train_loss, _ = evaluate(train_dataset)
            _, test_accuracy = evaluate(test_dataset)
            log(f"epoch {state.epoch + 1:>2}/{args.epochs} done: world size {hvd.size()}, "
                f"train loss {train_loss:.4f}, test accuracy {test_accuracy:.3f}, "
                f"{time.monotonic() - epoch_clock['start']:.2f} s")
        end_epoch(state)


# Horovod: everything in the state is committed together and restored together after a
# failure; epoch and batch are plain counters kept alongside.
state = hvd.elastic.TorchState(model=model, optimizer=optimizer, sampler=train_sampler, epoch=0, batch=0)
state.register_reset_callbacks([on_state_reset])

started = time.monotonic()
train(state)

if hvd.rank() == 0:
    _, accuracy = evaluate(test_dataset)
    print(f"trained {args.epochs} epochs in {time.monotonic() - started:.1f} s", flush=True)
    print(f"test accuracy: {accuracy:.3f}", flush=True)
