"""What the examples share: printing from rank 0 and a job-wide verdict."""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

import hpccomm


def start() -> tuple:
    """Start hpccomm from MPI alone (no MASTER_ADDR, no torchrun): ``(rank, size)``."""
    hpccomm.init_process_group()
    return dist.get_rank(), dist.get_world_size()


def say(*args, end="\n") -> None:
    """Print from rank 0 only."""
    if dist.get_rank() == 0:
        print(*args, end=end, flush=True)


def each(text: str) -> None:
    """Print from every rank, prefixed with the rank (lines may interleave)."""
    print(f"[rank {dist.get_rank()}] {text}", flush=True)


class Checks:
    """Checks made on each rank; :meth:`finish` agrees on the verdict over the
    world, so every rank exits with the same status."""

    def __init__(self) -> None:
        self.failed = []

    def expect(self, ok, what: str) -> None:
        if not ok:
            self.failed.append(what)
            each(f"WRONG: {what}")

    def finish(self, name: str) -> int:
        bad = torch.tensor([len(self.failed)], dtype=torch.int64)
        dist.all_reduce(bad)
        if bad.item() == 0:
            say(f"{name}: all checks passed on {dist.get_world_size()} rank(s)")
        else:
            say(f"{name}: {bad.item()} check(s) FAILED (see the WRONG lines above)")
        dist.destroy_process_group()
        return 0 if bad.item() == 0 else 1


def run(main) -> None:
    sys.exit(main())
