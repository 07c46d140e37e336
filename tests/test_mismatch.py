"""A collective called differently on different ranks is named on every rank
(the first-call check, hpccomm._core.signatures): on by default, outside debug
mode.  Each case runs on a fresh group (its signatures are new there) and
checks every rank's message, computed on each rank from what every rank
called (the sizes are 4 + rank)."""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import hpccomm
from helpers import R, hgroup, verdict_comm

pytestmark = [pytest.mark.mpi(min_size=2), pytest.mark.usefixtures("world")]

HINT = ("Nothing was sent. The ranks of a group must call the same collectives in the same order with matching "
        "sizes, dtypes, ReduceOps and roots")
SENTINEL = -7.0


def fresh():
    """A group of every rank, new: none of its signatures agreed on yet."""
    return dist.new_group(list(range(dist.get_world_size())))


def each_rank(describe) -> str:
    """``rank 0 called X (op #1); rank 1 called Y (op #1); ...`` with ``describe(rank)`` as X."""
    return "; ".join(f"rank {r} called {describe(r)} (op #1)" for r in range(dist.get_world_size()))


def expect(message: str, op: str, what: str, pg) -> None:
    """``message`` is this rank's, as it must read: checked on every rank, the verdict gathered."""
    rank, size = dist.get_rank(), dist.get_world_size()
    head = f"hpccomm {op} (op #1 on group '{hgroup(pg).name}', rank {rank}/{size}): "
    want = f"{head}the ranks called this collective differently: {what}. {HINT}"
    ok = verdict_comm().allgather(message == want)
    assert all(ok), (ok, message, want)


def run(call):
    with pytest.raises(hpccomm.HpccommError) as info:
        call()
    return str(info.value)


def test_all_reduce_of_different_sizes_is_named_on_every_rank():
    pg, rank, size = fresh(), dist.get_rank(), dist.get_world_size()
    t = torch.full((4 + rank,), SENTINEL)
    message = run(lambda: dist.all_reduce(t, group=pg))
    expect(message, "all_reduce", each_rank(lambda r: f"all_reduce(float32[{4 + r}], SUM)"), pg)
    assert torch.all(t == SENTINEL)  # nothing ran
    t = torch.ones(3)
    dist.all_reduce(t, group=pg)  # the group still works
    assert torch.all(t == size)


def test_broadcast_of_different_sizes_is_named_on_every_rank():
    # Without the check, MPI returns a silently wrong tensor on every rank.
    pg, rank = fresh(), dist.get_rank()
    t = torch.full((4 + rank,), SENTINEL)
    message = run(lambda: dist.broadcast(t, src=0, group=pg))
    expect(message, "broadcast", each_rank(lambda r: f"broadcast(float32[{4 + r}], root 0)"), pg)
    assert torch.all(t == SENTINEL)
    t = torch.full((2,), float(rank))
    dist.broadcast(t, src=0, group=pg)
    assert torch.all(t == 0)


def test_all_gather_of_different_sizes_is_named_on_every_rank():
    pg, rank, size = fresh(), dist.get_rank(), dist.get_world_size()
    outs = [torch.full((4 + rank,), SENTINEL) for _ in range(size)]  # each expects its own size from all
    message = run(lambda: dist.all_gather(outs, torch.ones(4 + rank), group=pg))
    lists = lambda r: ", ".join([f"float32[{4 + r}]"] * size)  # noqa: E731 - each rank's list: its own size
    expect(message, "all_gather", each_rank(lambda r: f"all_gather([{lists(r)}])") + ": rank 0 sends 4 elements to "
           "rank 1, which expects 5 from it", pg)
    assert all(torch.all(o == SENTINEL) for o in outs)
    outs = [torch.empty(r + 1) for r in range(size)]  # sizes that differ but fit: allowed
    dist.all_gather(outs, torch.full((rank + 1,), float(rank)), group=pg)
    assert all(torch.all(o == r) for r, o in enumerate(outs))


def test_reduce_scatter_of_different_sizes_is_named_on_every_rank():
    pg, rank, size = fresh(), dist.get_rank(), dist.get_world_size()
    out = torch.full((4 + rank,), SENTINEL)
    message = run(lambda: dist.reduce_scatter(out, [torch.ones(4 + rank) for _ in range(size)], group=pg))
    expect(message, "reduce_scatter", each_rank(lambda r: f"reduce_scatter(float32[{4 + r}], SUM)"), pg)
    assert torch.all(out == SENTINEL)


@pytest.mark.mpi(min_size=3)
def test_ranks_that_agree_are_listed_together():
    pg, rank = fresh(), dist.get_rank()
    last = dist.get_world_size() - 1
    t = torch.ones(8 if rank == last else 4)
    message = run(lambda: dist.all_reduce(t, op=R.MAX, group=pg))
    agree = ", ".join(map(str, range(last)))
    expect(message, "all_reduce", f"rank{'s' if last > 1 else ''} {agree} called all_reduce(float32[4], MAX) "
                                  f"(op #1); rank {last} called all_reduce(float32[8], MAX) (op #1)", pg)


def test_a_different_reduce_op_or_root_is_named():
    pg, rank = fresh(), dist.get_rank()
    t = torch.ones(2)
    message = run(lambda: dist.all_reduce(t, op=R.MAX if rank == 1 else R.SUM, group=pg))
    assert re.search(r"rank 1 called all_reduce\(float32\[2\], MAX\) \(op #1\)", message), message
    message = run(lambda: dist.broadcast(t, src=1 if rank == 1 else 0, group=pg))
    assert "rank 1 called broadcast(float32[2], root 1) (op #2)" in message, message


@pytest.mark.mpi
def test_only_the_first_call_of_a_signature_is_compared():
    """hpccomm.explain says whether a call would be compared: a new
    signature is, and once the ranks agreed on it, it is not (a training loop
    pays on its first step only)."""
    pg = fresh()
    t = torch.ones(6)
    assert hpccomm.explain("all_reduce", [t], R.SUM, group=pg).compared
    dist.all_reduce(t, group=pg)
    assert not hpccomm.explain("all_reduce", [t], R.SUM, group=pg).compared
    assert hpccomm.explain("all_reduce", [torch.ones(7)], R.SUM, group=pg).compared  # another size
    assert hpccomm.explain("all_to_all_single", torch.empty(0), torch.empty(0), [], [], group=pg).compared
    dist.all_to_all_single(torch.empty(0), torch.empty(0), group=pg)  # its first call of a dtype is compared
    assert not hpccomm.explain("all_to_all_single", torch.empty(0), torch.empty(0), [], [], group=pg).compared
    assert torch.all(t == dist.get_world_size())

