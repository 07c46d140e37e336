"""What the framework examples (train_lightning, train_accelerate,
train_transformers) share: a small regression problem, the weights one process
reaches by training on the whole world's batches (each rank's own reference),
and the checks every example makes on every rank.

Each example trains one epoch of ``STEPS`` steps, ``BATCH`` samples per rank
per step, with plain SGD.  The frameworks hand rank ``r`` of ``size`` either
every ``size``-th sample of an order (torch's ``DistributedSampler``:
Lightning, which shuffles a training set with seed 0) or every ``size``-th
batch (Accelerate, and the transformers Trainer through it, here unshuffled);
either way step ``s`` of the world covers positions ``s * size * BATCH`` up to
``(s + 1) * size * BATCH`` of that order, and DDP's averaged gradient is the
gradient of the mean loss over them.  One process taking those global
batches in turn lands on the same weights, to float32 rounding: that is the
reference.  A rank that trained alone, on all the data (a
framework that silently ran without a process group), lands elsewhere.
"""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from ._common import Checks, say

FEATURES, BATCH, STEPS, LR = 8, 4, 3, 0.1
#: How far (max |difference| over the weights) a rank's trained weights may be from the reference:
#: float32 sums taken in another order, a few steps of SGD.
TOLERANCE = 1e-5


def regression_data(size: int):
    """``(x, y)``: ``size * BATCH * STEPS`` samples, the same on every rank (a seed, not a broadcast)."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(size * BATCH * STEPS, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen)
    return x, x @ w + 0.1 * torch.randn(len(x), 1, generator=gen)


def mlp() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank and in the reference
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))


def global_batches(tensors, size: int, order=None):
    """The world's batches, in turn: ``size * BATCH`` consecutive samples per
    step, in ``order`` (sample indices; default: as they are)."""
    if order is not None:
        tensors = [t[list(order)] for t in tensors]
    n = size * BATCH
    for s in range(STEPS):
        yield [t[s * n:(s + 1) * n] for t in tensors]


def reference_mlp(size: int, order=None) -> nn.Module:
    """The MLP trained by one process on the world's batches (:func:`global_batches`):
    what every rank must hold."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in global_batches(regression_data(size), size, order):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def verify(name: str, framework: str, model: nn.Module, reference: nn.Module, ddp, world_size_seen: int,
           extra=()) -> int:
    """The checks of a framework example, on every rank; returns the exit status
    (the same on every rank) and ends the process group.

    ``model``: the trained module (unwrapped); ``reference``: :func:`reference_mlp`
    or the example's own; ``ddp``: the DistributedDataParallel the framework made;
    ``world_size_seen``: the world size the framework reports; ``extra``:
    ``(ok, what)`` pairs of the example's own checks.
    """
    checks = Checks()
    size = dist.get_world_size()
    checks.expect(dist.get_backend() == "hpccomm", f"the default process group's backend is "
                                                   f"{dist.get_backend()!r}, not 'hpccomm'")
    checks.expect(isinstance(ddp, nn.parallel.DistributedDataParallel),
                  f"{framework} did not wrap the model in DistributedDataParallel ({type(ddp).__name__})")
    group_backend = dist.get_backend(getattr(ddp, "process_group", None))
    checks.expect(group_backend == "hpccomm", f"DDP reduces gradients over a {group_backend!r} group")
    checks.expect(world_size_seen == size, f"{framework} sees {world_size_seen} process(es), the job has {size}")
    for ok, what in extra:
        checks.expect(ok, what)
    trained, expected = dict(model.named_parameters()), dict(reference.named_parameters())
    checks.expect(trained.keys() == expected.keys(), "the trained and the reference model differ in parameters")
    diff = max(((trained[k] - expected[k]).abs().max().item() for k in trained.keys() & expected.keys()),
               default=float("inf"))
    checks.expect(diff <= TOLERANCE, f"the weights are {diff:.3g} from the one-process reference on the world's "
                                     f"batches (tolerance {TOLERANCE})")
    digests = [None] * size
    dist.all_gather_object(digests, digest(model))
    checks.expect(len(set(digests)) == 1, f"weights differ between ranks: {[d[:16] for d in digests]}")
    say(f"{name}: {framework} on {size} rank(s), backend {group_backend}; weights within {diff:.1g} of the "
        f"one-process reference, identical on every rank (sha256 {digests[0][:16]})")
    return checks.finish(name)
