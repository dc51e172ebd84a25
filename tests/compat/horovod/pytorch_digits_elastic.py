"""Horovod's elastic PyTorch MNIST example, in spirit: hvd.elastic.run around the training
loop, TorchState holding the model, the optimizer and an ElasticSampler, commits every few
batches, the learning rate rescaled in a reset callback. scikit-learn's 8x8 digits stand in
for MNIST. Written against horovod.torch; tests/compat runs it with only the import line
changed."""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data
from sklearn.datasets import load_digits

import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch elastic digits example")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--momentum", type=float, default=0.9)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--batches-per-commit", type=int, default=4)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--result", default=None)

args = parser.parse_args()
hvd.init()
torch.manual_seed(args.seed)
torch.set_num_threads(1)

digits = load_digits()
images = torch.tensor(digits.images, dtype=torch.float32).reshape(-1, 64) / 16.0
labels = torch.tensor(digits.target, dtype=torch.int64)
split = int(len(labels) * 0.8)
train_dataset = torch.utils.data.TensorDataset(images[:split], labels[:split])
test_dataset = torch.utils.data.TensorDataset(images[split:], labels[split:])

train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=True, seed=args.seed)
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)

model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
lr_scaler = hvd.size() if not args.use_adasum else 1
optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)


def test():
    model.eval()
    with torch.no_grad():
        x, y = test_dataset.tensors
        shard = slice(hvd.rank(), None, hvd.size())
        correct = model(x[shard]).argmax(1).eq(y[shard]).float().sum()
        counts = hvd.allreduce(torch.stack([correct, torch.tensor(float(len(y[shard])))]), op=hvd.Sum)
    return (counts[0] / counts[1]).item()


@hvd.elastic.run
def train(state):
    # When a reset happens, the loop resumes where the last commit left it.
    for state.epoch in range(state.epoch, args.epochs + 1):
        model.train()
        batch_offset = state.batch
        for batch_idx, (data, target) in enumerate(train_loader):
            state.batch = batch_offset + batch_idx + 1
            optimizer.zero_grad()
            loss = F.cross_entropy(model(data), target)
            loss.backward()
            optimizer.step()
            state.train_sampler.record_batch(batch_idx, args.batch_size)
            if state.batch % args.batches_per_commit == 0:
                state.commit()
        state.batch = 0
        state.train_sampler.set_epoch(state.epoch + 1)
        accuracy = test()
        if hvd.rank() == 0:
            print(f"epoch {state.epoch}: accuracy {accuracy:.3f} on {hvd.size()} workers")
        state.commit()
    return accuracy


def on_state_reset():
    # Adjust the learning rate to the new number of workers.
    for param_group in optimizer.param_groups:
        param_group["lr"] = args.lr * (hvd.size() if not args.use_adasum else 1)


state = hvd.elastic.TorchState(model, optimizer, train_sampler=train_sampler, epoch=1, batch=0)
state.register_reset_callbacks([on_state_reset])
accuracy = train(state)
if hvd.rank() == 0 and args.result:
    with open(args.result, "w") as f:
        json.dump({"accuracy": accuracy, "size": hvd.size(), "epoch": state.epoch}, f)
