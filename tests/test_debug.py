"""Debug mode: mismatched collectives are caught before they run, on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hpccomm
from helpers import R

pytestmark = pytest.mark.mpi


@pytest.fixture
def debug_on(world):
    pg = dist.group.WORLD
    old, pg._g.debug = pg._g.debug, True
    yield pg
    pg._g.debug = old


@pytest.mark.mpi(min_size=2)
def test_mismatched_sizes_raise_on_every_rank(debug_on):
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(8 if rank == 0 else 4)
    with pytest.raises(hpccomm.HpccommError) as info:
        dist.all_reduce(t)
    msg = str(info.value)
    assert "all_reduce(float32[4], SUM)" in msg and "rank 0 called all_reduce(float32[8], SUM)" in msg, msg
    assert torch.all(t == 1)  # nothing ran
    t = torch.ones(3)
    dist.all_reduce(t)  # the group still works
    assert torch.all(t == size)


@pytest.mark.mpi(min_size=2)
def test_mismatched_op_and_root_raise(debug_on):
    rank = dist.get_rank()
    t = torch.ones(2)
    with pytest.raises(hpccomm.HpccommError, match=r"called all_reduce\(float32\[2\], (MAX|SUM)\)"):
        dist.all_reduce(t, op=R.MAX if rank == 1 else R.SUM)
    with pytest.raises(hpccomm.HpccommError, match=r"called broadcast\(float32\[2\], [01]\)"):
        dist.broadcast(t, src=1 if rank == 1 else 0)


def test_matching_calls_pass_in_debug_mode(debug_on):
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((5,), float(rank))
    dist.all_reduce(t)
    out = [torch.empty(r + 1) for r in range(size)]  # all_gather list sizes differ per rank: allowed
    dist.all_gather(out, torch.full((rank + 1,), float(rank)))
    assert torch.all(t == sum(range(size))) and all(torch.all(o == r) for r, o in enumerate(out))


def test_describe_is_plain():
    from hpccomm import _debug

    assert _debug.describe("all_reduce", ([torch.ones(3, dtype=torch.bfloat16)], R.AVG)) == "all_reduce(bfloat16[3], AVG)"
    assert _debug.describe("barrier", ()) == "barrier()"
