"""``hvd.SyncBatchNorm``: batch normalization whose training statistics span every rank's batch.

In training mode with more than one rank, each forward gathers every rank's per-channel
(count, mean, sum of squared deviations) in one allgather, combines them exactly (Chan's
parallel variance: no cancellation from sums of squares), normalizes with the global mean
and variance, and updates the running statistics with them (the unbiased variance), as
``torch.nn.SyncBatchNorm`` and Horovod's do. Backward runs one allreduce of the per-channel
sums of ``dy`` and ``dy * x_hat``, so the input gradient is the one of the global
normalization; weight and bias get this rank's own sums (the DistributedOptimizer averages
them like every other gradient). Ranks may have different batch sizes (a rank in
``join()`` contributes none). Evaluation mode, or a world of one, is plain batch norm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from elasticrun.worker import collectives, rounds
from elasticrun.worker.collectives import Sum

__all__ = ["SyncBatchNorm"]


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, eps: float,
                momentum: float) -> torch.Tensor:
        c = x.shape[1]
        dims = [d for d in range(x.dim()) if d != 1]
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        count = x.numel() // c
        mean = xf.mean(dims) if count else xf.new_zeros(c)
        m2 = ((xf - mean.view(1, c, *[1] * (x.dim() - 2))) ** 2).sum(dims) if count else xf.new_zeros(c)
        stats = torch.cat([mean.new_full((1,), float(count)), mean, m2]).view(1, 2 * c + 1)
        # every rank's statistics have this shape: gather them as they are (no row counts to exchange)
        gathered = torch.cat(collectives.allgather_same(stats.double(), "sync_batch_norm.stats"))
        counts, means, m2s = gathered[:, 0], gathered[:, 1:c + 1], gathered[:, c + 1:]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"SyncBatchNorm needs more than one value per channel over all ranks, got {int(total)}")
        g_mean = (counts[:, None] * means).sum(0) / total
        g_m2 = (m2s + counts[:, None] * (means - g_mean) ** 2).sum(0)
        g_var = g_m2 / total
        if running_mean is not None and running_var is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(g_mean.to(running_mean.dtype), alpha=momentum)
                unbiased = g_m2 / (total - 1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        shape = (1, c) + (1,) * (x.dim() - 2)
        invstd = torch.rsqrt(g_var + eps).to(xf.dtype)
        xhat = (xf - g_mean.to(xf.dtype).view(shape)) * invstd.view(shape)
        y = xhat
        if weight is not None:
            y = y * weight.view(shape).to(xf.dtype)
        if bias is not None:
            y = y + bias.view(shape).to(xf.dtype)
        ctx.save_for_backward(xhat, invstd, weight)
        ctx.total = float(total)
        ctx.has_bias = bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        xhat, invstd, weight = ctx.saved_tensors
        c = xhat.shape[1]
        dims = [d for d in range(xhat.dim()) if d != 1]
        shape = (1, c) + (1,) * (xhat.dim() - 2)
        dyf = dy.to(xhat.dtype)
        sum_dy = dyf.sum(dims)
        sum_dy_xhat = (dyf * xhat).sum(dims)
        sums = collectives.allreduce_(torch.cat([sum_dy, sum_dy_xhat]).double(), op=Sum,
                                      name="sync_batch_norm.grad", trusted=True)
        g_sum_dy, g_sum_dy_xhat = sums[:c].to(xhat.dtype), sums[c:].to(xhat.dtype)
        w = weight.view(shape).to(xhat.dtype) if weight is not None else 1.0
        dx = (dyf - (g_sum_dy.view(shape) + xhat * g_sum_dy_xhat.view(shape)) / ctx.total) * invstd.view(shape) * w
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        grad_bias = sum_dy.to(weight.dtype if weight is not None else dy.dtype) \
            if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx.to(dy.dtype), grad_weight, grad_bias, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Batch normalization over the union of every rank's batch (see the module doc).

    ``SyncBatchNorm(num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True)``,
    for inputs of 2 or more dimensions (N, C, ...).
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or rounds.current().size == 1:
            return super().forward(input)
        momentum = self.momentum
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if momentum is None:  # a cumulative moving average
                momentum = 1.0 / float(self.num_batches_tracked)
        running = self.track_running_stats
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, self.running_mean if running else None,
                                      self.running_var if running else None, self.eps,
                                      0.0 if momentum is None else momentum)
