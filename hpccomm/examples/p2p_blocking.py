"""Blocking point-to-point (the tutorial's first program): a relay.

    mpirun -n 4 python -m hpccomm.examples.p2p_blocking

Rank 0 starts a tensor at 0 and sends it to rank 1 with ``dist.send``; each
rank ``dist.recv``'s it from the rank before, checks it holds its own rank,
adds 1 and sends it on.  The last rank checks the end value (size - 1).
``send`` returns once the tensor may be reused; ``recv`` once it has
arrived.  At 1 rank there is no one to send to: rank 0 just checks its own.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ._common import Checks, each, run, start


def main() -> int:
    rank, size = start()
    checks = Checks()
    tensor = torch.zeros(4)
    if rank > 0:
        dist.recv(tensor, src=rank - 1)
        each(f"received {tensor.tolist()} from rank {rank - 1}")
    checks.expect(torch.equal(tensor, torch.full((4,), float(rank))),
                  f"rank {rank} holds {tensor.tolist()}, expected {[float(rank)] * 4}")
    if rank < size - 1:
        dist.send(tensor + 1, dst=rank + 1)
    else:
        each(f"end of the relay: {tensor.tolist()} (expected {[float(size - 1)] * 4})")
    return checks.finish("p2p_blocking")


if __name__ == "__main__":
    run(main)
