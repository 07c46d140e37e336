"""Collective communication in a group (the tutorial's ``all_reduce`` in
``dist.new_group``).

    mpirun -n 4 python -m hpccomm.examples.allreduce_group

``dist.new_group(ranks)`` is called by every rank (torch's rule) and returns
a group that its members use like the world.  Here the even ranks sum a
tensor holding their rank + 1 among themselves, then every rank does the
same over the whole world.  Each rank checks the sum in closed form.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._common import Checks, each, run, say, start


def main() -> int:
    rank, size = start()
    checks = Checks()
    evens = list(range(0, size, 2))
    group = dist.new_group(evens)  # every rank calls new_group, members or not
    if rank in evens:
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
        want = float(sum(r + 1 for r in evens))
        each(f"sum over the even ranks {evens}: {t[0].item()}")
        checks.expect(torch.all(t == want), f"group sum {t.tolist()}, expected {want}")
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    want = size * (size + 1) / 2
    say(f"sum over the world of rank + 1: {t[0].item()} (expected {want})")
    checks.expect(torch.all(t == want), f"world sum {t.tolist()}, expected {want}")
    return checks.finish("allreduce_group")


if __name__ == "__main__":
    run(main)
