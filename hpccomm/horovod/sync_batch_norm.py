"""``hvd.SyncBatchNorm``: batch norm whose statistics are taken over every rank's batch.

Horovod's own SyncBatchNorm raised on CPU tensors ("SyncBatchNorm expected
input tensor to be on GPU"), and so does torch's ``nn.SyncBatchNorm``: both
call kernels (``torch.batch_norm_stats`` and friends) that torch builds for
CUDA only.  This one computes the same forward and backward with ordinary
tensor operations, so it runs on CPU and GPU tensors alike:

- forward (training): each rank's per-channel count, mean and biased
  variance are allgathered and combined (Chan's parallel formula) into the
  global mean and variance; the running statistics take the unbiased global
  variance, as torch's BatchNorm does;
- backward: the per-channel sums of dy and dy*(x-mean) are summed across
  ranks; the input gradient is torch's batch-norm gradient with those global
  sums; weight and bias gradients stay local (DistributedOptimizer averages them).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from . import basics
from .ops.allgather import allgather
from .ops.allreduce import allreduce
from .ops.checks import Sum


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the global batch (every rank's samples), for any input
    of at least 2 dimensions ``(N, C, ...)``; CPU and GPU tensors.

    In eval mode (or with ``track_running_stats=True`` not training) it
    normalises with the running statistics, without communication; at world
    size 1 it is plain batch norm. Every rank must call forward (and backward)
    the same number of times, in the same order relative to other ops.

    :param num_features: channels ``C``.
    :param eps: added to the variance. Default: 1e-5.
    :param momentum: running-statistics update factor, or None for a cumulative average. Default: 0.1.
    :param affine: learnable weight and bias. Default: True.
    :param track_running_stats: keep running statistics. Default: True.
    :raises ValueError: (from forward) an input of fewer than 2 dimensions.

    Example::

        model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), hvd.SyncBatchNorm(8), torch.nn.ReLU())
    """

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError("expected at least 2D input (got {}D input)".format(input.dim()))

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)
        if not self.training and self.track_running_stats:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0,
                                self.eps)
        if basics.size() == 1:
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, True, factor,
                                self.eps)
        running = self.track_running_stats and self.training
        return _SyncBatchNormFn.apply(input, self.weight, self.bias, self.running_mean if running else None,
                                      self.running_var if running else None, self.eps, factor)


def _per_channel(x: torch.Tensor) -> torch.Tensor:
    """``x`` as (C, everything else)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum):
        work = torch.float64 if input.dtype == torch.float64 else torch.float32
        x = _per_channel(input.to(work))
        count = x.shape[1]
        if count > 0:
            mean, var = x.mean(dim=1), x.var(dim=1, unbiased=False)
        else:  # an empty batch on this rank: it adds nothing to the statistics
            mean = var = torch.zeros(x.shape[0], dtype=work, device=x.device)
        stats = torch.cat([torch.tensor([float(count)], dtype=work), mean, var])[None]
        everyone = allgather(stats, name="sync_batch_norm.stats")
        counts, means, vars_ = everyone[:, 0], everyone[:, 1:1 + mean.numel()], everyone[:, 1 + mean.numel():]
        total = counts.sum()
        if total <= 1:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {list(input.shape)} "
                             f"on this rank and {int(total)} value(s) per channel over all ranks")
        gmean = (counts[:, None] * means).sum(dim=0) / total
        gvar = (counts[:, None] * (vars_ + (means - gmean) ** 2)).sum(dim=0) / total
        invstd = torch.rsqrt(gvar + eps)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(gmean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_((gvar * total / (total - 1)).to(running_var.dtype), alpha=momentum)
        shape = [1, -1] + [1] * (input.dim() - 2)
        xhat = (input.to(work) - gmean.view(shape)) * invstd.view(shape)
        out = xhat
        if weight is not None:
            out = out * weight.to(work).view(shape) + bias.to(work).view(shape)
        ctx.save_for_backward(xhat, weight, invstd, total)
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        xhat, weight, invstd, total = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[0:3]
        work = xhat.dtype
        dy = grad_output.to(work)
        shape = [1, -1] + [1] * (dy.dim() - 2)
        sum_dy = _per_channel(dy).sum(dim=1)
        sum_dy_xhat = _per_channel(dy * xhat).sum(dim=1)
        grad_weight = sum_dy_xhat.to(weight.dtype) if weight is not None and need_weight else None
        grad_bias = sum_dy.to(weight.dtype) if weight is not None and need_bias else None
        grad_input = None
        if need_input:
            both = allreduce(torch.cat([sum_dy, sum_dy_xhat]), op=Sum, name="sync_batch_norm.grad_sums")
            g_dy, g_dy_xhat = both[:sum_dy.numel()], both[sum_dy.numel():]
            scale = invstd if weight is None else invstd * weight.to(work)
            grad_input = (dy - (g_dy / total).view(shape) - xhat * (g_dy_xhat / total).view(shape)) * scale.view(shape)
            grad_input = grad_input.to(grad_output.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None
