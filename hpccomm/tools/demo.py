"""A short demonstration: ``mpirun -n 4 python -m hpccomm demo``.

Initialises hpccomm from MPI alone, runs a few collectives with their
expected results, then trains a small model with DistributedDataParallel on
synthetic data and checks that every rank ends with identical weights.
"""
from __future__ import annotations

import sys
import time
import warnings

import torch
import torch.distributed as dist

import hpccomm


def say(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def collectives() -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    say(f"all_reduce(SUM) of rank+1 over {size} ranks: {t.tolist()}  (expected {size * (size + 1) / 2})")
    x = torch.tensor([rank], dtype=torch.int64)
    out = torch.empty(size, dtype=torch.int64)
    dist.all_gather_into_tensor(out, x)
    say(f"all_gather_into_tensor of ranks: {out.tolist()}")
    b = torch.full((3,), 0.5 * (rank + 1), dtype=torch.bfloat16)
    dist.all_reduce(b, op=dist.ReduceOp.AVG)
    say(f"all_reduce(AVG) in bfloat16: {b.tolist()}")
    objs = [None] * size
    dist.all_gather_object(objs, {"rank": rank, "host": hpccomm.node_index()})
    say(f"all_gather_object: {objs}")


def train(steps: int = 30, batch: int = 64) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts them)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    true_w = torch.randn(32, 1, generator=torch.Generator().manual_seed(42))
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data shard
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randn(batch, 32, generator=gen)
        y = x @ true_w + 0.01 * torch.randn(batch, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        if step % 5 == 0 or step == 1:
            rate = step * batch * size / (time.perf_counter() - t0)
            say(f"step {step:3d}/{steps}  loss {mean_loss.item():.4f}  {rate:,.0f} samples/s")
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    first = flat.clone()
    dist.broadcast(first, src=0)
    same = torch.tensor([int(torch.equal(flat, first))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    say("all ranks hold identical weights" if same.item() else "WEIGHTS DIFFER BETWEEN RANKS")
    if not same.item():
        raise SystemExit(1)


def add_arguments(parser) -> None:
    """No options: the demonstration is the same every time."""


def run(args=None) -> int:
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use", category=FutureWarning)
    hpccomm.init_process_group()
    say(f"hpccomm {hpccomm.__version__}: {dist.get_world_size()} ranks, backend {dist.get_backend()}")
    collectives()
    train()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(run())
