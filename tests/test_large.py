"""A message of more than 2**31 elements, for real (MPI-3 counts are C ints).

2**31 + 16 int8 elements: about 2 GiB per rank, 3.4 GB peak per rank with
MPI's buffers (13.5 GB at 4 ranks, measured); about 30 s at 4 ranks on 2 cores.
The split code paths of every op are also tested with a lowered limit in the
op families' own test files.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.mpi

N = 2**31 + 16


def test_all_reduce_and_broadcast_past_int_count(world):
    rank, size = world
    t = torch.ones(N, dtype=torch.int8)
    dist.all_reduce(t)
    # the first and last element of each piece MPI saw, and the ends
    probes = [0, 2**31 - 2, 2**31 - 1, 2**31, N - 1]
    got = [int(t[i]) for i in probes]
    t[-3:] = 7 if rank == 0 else -1
    t[:3] = 5 if rank == 0 else -1
    dist.broadcast(t, src=0)
    tail, head = t[-3:].tolist(), t[:3].tolist()
    middle = int(t[2**31 - 1])
    del t
    assert got == [size] * len(probes)
    assert tail == [7, 7, 7] and head == [5, 5, 5] and middle == size
