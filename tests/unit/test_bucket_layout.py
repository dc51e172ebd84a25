"""The gradient buckets' layout (worker/optimizer.assign_buckets) is DDP's, checked against
torch's own assignment function, which DDP uses when it rebuilds its buckets after the first
backward pass."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticrun.worker.optimizer import _FIRST_BUCKET_BYTES, assign_buckets

pytestmark = pytest.mark.timeout(60)

DDP_ASSIGN = getattr(dist, "_compute_bucket_assignment_by_size", None)
DTYPES = [torch.float32, torch.float16, torch.float64]


def ddp_layout(tensors: list[torch.Tensor], cap: int, first_cap: int) -> list[list[int]]:
    assert DDP_ASSIGN is not None
    indices, _ = DDP_ASSIGN(tensors, [first_cap, cap])
    return sorted((list(b) for b in indices), key=lambda b: b[0])


def ours(tensors: list[torch.Tensor], cap: int, first_cap: int) -> list[list[int]]:
    return assign_buckets([(t.dtype, t.numel() * t.element_size()) for t in tensors], cap, first_cap)


def mlp_grads_in_ready_order() -> list[torch.Tensor]:
    """throughput.py's MLP: a 10-way head after three 1024-wide layers, last layer first."""
    layers, width = [], 64
    for _ in range(4):
        layers.append(torch.nn.Linear(width, 1024))
        width = 1024
    layers.append(torch.nn.Linear(width, 10))
    return list(reversed([p.detach() for layer in layers for p in layer.parameters()]))


def test_a_small_head_shares_the_first_bucket_with_the_large_weight_after_it() -> None:
    grads = mlp_grads_in_ready_order()
    layout = ours(grads, 25 << 20, _FIRST_BUCKET_BYTES)
    assert layout == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]  # ~4.2 MB early in backward, then the rest
    first = sum(grads[i].numel() * 4 for i in layout[0])
    assert first > 4 << 20


@pytest.mark.skipif(DDP_ASSIGN is None, reason="this torch has no _compute_bucket_assignment_by_size")
def test_the_mlp_layout_is_ddps() -> None:
    grads = mlp_grads_in_ready_order()
    assert ours(grads, 25 << 20, _FIRST_BUCKET_BYTES) == ddp_layout(grads, 25 << 20, _FIRST_BUCKET_BYTES)


@pytest.mark.skipif(DDP_ASSIGN is None, reason="this torch has no _compute_bucket_assignment_by_size")
@settings(max_examples=150, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 3000), st.sampled_from(range(len(DTYPES)))), min_size=1, max_size=25),
       cap=st.integers(1, 20000), first=st.integers(1, 20000))
def test_any_layout_is_ddps(shapes: list[tuple[int, int]], cap: int, first: int) -> None:
    first = min(first, cap)  # a cap below 1 MB also caps the first bucket here (DDP keeps 1 MB)
    tensors = [torch.empty(n, dtype=DTYPES[d]) for n, d in shapes]
    assert ours(tensors, cap, first) == ddp_layout(tensors, cap, first)


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.tuples(st.sampled_from("ab"), st.integers(1, 100)), max_size=30),
       cap=st.integers(1, 300), first=st.integers(1, 300))
def test_every_tensor_once_one_key_per_bucket_and_full_buckets(sizes: list[tuple[str, int]], cap: int,
                                                                 first: int) -> None:
    layout = assign_buckets(sizes, cap, first)
    assert sorted(i for b in layout for i in b) == list(range(len(sizes)))
    seen: set[str] = set()
    for b in layout:
        key = sizes[b[0]][0]
        assert all(sizes[i][0] == key for i in b) and b == sorted(b)
        limit = cap if key in seen else min(cap, first)
        seen.add(key)
        held = sum(sizes[i][1] for i in b)
        later = [i for i in range(b[-1] + 1, len(sizes)) if sizes[i][0] == key]
        if later:  # a bucket closed before its key's last tensor holds its cap, and not without its last member
            assert held >= limit > held - sizes[b[-1]][1]
