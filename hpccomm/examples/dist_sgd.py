"""Distributed synchronous SGD with gradients averaged by hand (the
tutorial's ``average_gradients`` program), on synthetic data.

    mpirun -n 4 python -m hpccomm.examples.dist_sgd

One dataset, made identically on every rank from a seed, is partitioned
between the ranks (rank r takes samples r, r + size, ...).  Each step, each
rank computes the gradient of its own mini-batch, then ``all_reduce`` sums
the gradients and each rank divides by the number of ranks: every rank
takes the same step and the weights stay identical.  The program checks
that, and that the weights equal those of one process doing gradient
descent on the union of the ranks' mini-batches (to float32 rounding), and
that the loss went down.
"""
from __future__ import annotations

import argparse
import hashlib

import torch
import torch.distributed as dist
from torch import nn

from ._common import Checks, run, say, start

FEATURES, SAMPLES_PER_RANK = 16, 256


def dataset(size: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES_PER_RANK * size, FEATURES, generator=gen)
    w = torch.randn(FEATURES, 1, generator=gen)
    return x, x @ w + 0.1 * torch.randn(len(x), 1, generator=gen)


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 1))


def average_gradients(model: nn.Module) -> None:
    size = float(dist.get_world_size())
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        p.grad /= size


def batches(x, y, rank: int, size: int, batch: int, epochs: int):
    """Rank ``rank``'s mini-batches: its partition, in order, ``epochs`` times."""
    xs, ys = x[rank::size], y[rank::size]
    for _ in range(epochs):
        for i in range(0, len(xs), batch):
            yield xs[i:i + batch], ys[i:i + batch]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args(argv)
    rank, size = start()
    checks = Checks()
    x, y = dataset(size)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    for step, (xb, yb) in enumerate(batches(x, y, rank, size, args.batch_size, args.epochs)):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        average_gradients(model)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / size)
        if step % 8 == 0:
            say(f"step {step:3d}  loss {losses[-1]:.4f}")
    say(f"step {step:3d}  loss {losses[-1]:.4f}")

    # the same training in one process: the union of every rank's mini-batch, step by step
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=args.lr)
    streams = [batches(x, y, r, size, args.batch_size, args.epochs) for r in range(size)]
    for parts in zip(*streams):
        ref_opt.zero_grad()
        # mean of the ranks' mini-batch means (equal batch sizes: the mean over the union)
        sum(nn.functional.mse_loss(ref(xb), yb) for xb, yb in parts).div(size).backward()
        ref_opt.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        checks.expect(torch.allclose(p, q, rtol=1e-5, atol=1e-6),
                      f"{name}: differs from the one-process run by {(p - q).abs().max().item():.3g}")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    digests = [None] * size
    dist.all_gather_object(digests, hashlib.sha256(flat.numpy().tobytes()).hexdigest())
    checks.expect(len(set(digests)) == 1, f"weights differ between ranks: {digests}")
    checks.expect(losses[-1] < 0.5 * losses[0], f"loss did not fall: {losses[0]:.4f} -> {losses[-1]:.4f}")
    say(f"loss {losses[0]:.4f} -> {losses[-1]:.4f}; weights identical on all {size} rank(s) "
        f"(sha256 {digests[0][:12]}) and equal to the one-process run")
    return checks.finish("dist_sgd")


if __name__ == "__main__":
    run(main)
