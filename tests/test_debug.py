"""Debug mode: mismatched collectives are caught before they run, on every rank."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import helpers
import hpccomm
from helpers import hgroup, R

pytestmark = pytest.mark.mpi


@pytest.fixture
def debug_on(world):
    pg = dist.group.WORLD
    old, hgroup(pg).debug = hgroup(pg).debug, True
    yield pg
    hgroup(pg).debug = old


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
    with pytest.raises(hpccomm.HpccommError, match=r"called broadcast\(float32\[2\], root [01]\)"):
        dist.broadcast(t, src=1 if rank == 1 else 0)


@pytest.mark.mpi(min_size=2)
def test_mismatched_async_op_raises_on_every_rank(debug_on):
    """With HPCCOMM_ASYNC_NONBLOCKING, async_op must match across ranks
    (outside debug mode an async all_reduce is then a nonblocking MPI call,
    which a blocking one never matches): debug mode compares it and raises on
    every rank, naming both sides.  (Off, it is not compared: DDP's Join mixes
    them.)"""
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    with pytest.raises(hpccomm.HpccommError) as info, helpers.nonblocking_async():
        work = dist.all_reduce(t, async_op=rank == 0)
        if work is not None:
            work.wait()
    msg = str(info.value)
    assert "async_op differs across ranks" in msg and "rank(s) 0 passed async_op=True" in msg, msg
    assert "Pass the same async_op on every rank" in msg, msg
    assert torch.all(t == 1)  # nothing ran
    dist.all_reduce(t, async_op=True).wait()  # matching flags: the group still works
    assert torch.all(t == size)


def test_matching_calls_pass_in_debug_mode(debug_on):
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((5,), float(rank))
    dist.all_reduce(t)
    out = [torch.empty(r + 1) for r in range(size)]  # all_gather list sizes differ per rank: allowed
    dist.all_gather(out, torch.full((rank + 1,), float(rank)))
    assert torch.all(t == sum(range(size))) and all(torch.all(o == r) for r, o in enumerate(out))


@pytest.mark.one_size
def test_describe_is_plain():
    """A call in messages, from its signature (declared with its op): plain, with no pairs where none may differ."""
    from hpccomm._ops import p2p, reduce

    g = helpers.fake_group()
    sig = reduce.ALL_REDUCE.check(g, [torch.ones(3, dtype=torch.bfloat16)], R.AVG).signature
    assert (sig.describe(), sig.pairs) == ("all_reduce(bfloat16[3], AVG)", None)
    sig = p2p.BARRIER.check(g).signature
    assert (sig.describe(), sig.pairs) == ("barrier()", None)


# -- issue 14: op numbers alike on every rank; every size mismatch named ------------------------------

@pytest.mark.mpi(min_size=3)
def test_point_to_point_between_some_ranks_keeps_collective_numbers(debug_on):
    """Point-to-point ops are numbered apart from collectives: ranks 0 and 1
    exchanging messages that rank 2 never sees leave the next collective
    with the same number on every rank (debug mode compares the numbers)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    if rank in (0, 1):
        for _ in range(3):
            if rank == 0:
                dist.send(torch.ones(2), dst=1)
            else:
                dist.recv(torch.zeros(2), src=0)
    t = torch.ones(2)
    dist.all_reduce(t)  # raised "rank 2 called all_reduce (op #N) but rank 0 ... (op #N+3)" before
    assert torch.all(t == size)
    numbers = helpers.verdict_comm().allgather(hgroup(debug_on).seq)
    assert len(set(numbers)) == 1, numbers


def test_ops_issued_by_callbacks_are_numbered_alike(debug_on):
    """Ops issued from a future's callback (on the comm thread, as DDP hooks
    do) while the caller issues more: each collective is numbered by the
    thread that runs it, in the order it runs, which is the same on every
    rank, so debug mode's comparison passes and the counts agree."""
    size = dist.get_world_size()
    results = []
    for _ in range(20):
        a = torch.ones(4)
        fut = dist.all_reduce(a, async_op=True).get_future()
        chained = fut.then(lambda f: results.append(dist.all_reduce(torch.ones(1), async_op=True)))
        b = torch.ones(3)
        dist.all_reduce(b, async_op=True).wait()
        chained.wait()
        assert torch.all(a == size) and torch.all(b == size)
    for w in results:
        w.wait()
    numbers = helpers.verdict_comm().allgather(hgroup(debug_on).seq)
    assert len(set(numbers)) == 1, numbers


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["gather", "scatter", "all_gather", "all_to_all_single"])
def test_size_mismatches_are_named(debug_on, case):
    """Sizes that do not fit together across ranks are named on every rank
    before anything moves (without debug mode they truncate or hang)."""
    rank, size = dist.get_rank(), dist.get_world_size()
    odd = rank == 1
    with pytest.raises(hpccomm.HpccommError) as info:
        if case == "gather":
            x = torch.ones(3 if odd else 2)
            dist.gather(x, [torch.empty(2) for _ in range(size)] if rank == 0 else None, dst=0)
        elif case == "scatter":
            out = torch.empty(3 if odd else 2)
            dist.scatter(out, [torch.ones(2) for _ in range(size)] if rank == 0 else None, src=0)
        elif case == "all_gather":  # rank 1 sends 3 elements (its own list agrees); the others expect 2 from it
            dist.all_gather([torch.empty(3 if odd and k == 1 else 2) for k in range(size)],
                            torch.ones(3 if odd else 2))
        else:  # rank 1 sends 2 rows to every rank, which each expect 1 from it
            rows = 2 if odd else 1
            dist.all_to_all_single(torch.empty(size), torch.ones(rows * size), [1] * size, [rows] * size)
    msg = str(info.value)
    if case in ("gather", "scatter"):
        assert f"called {case}(float32[3], root 0)" in msg and f"called {case}(float32[2], root 0)" in msg, msg
    elif case == "all_gather":  # rank 1's list expects 3 elements from rank 1, the others' 2
        lists = {r: ", ".join(f"float32[{3 if r == 1 and k == 1 else 2}]" for k in range(size)) for r in (0, 1)}
        assert f"called all_gather([{lists[1]}])" in msg and f"called all_gather([{lists[0]}])" in msg, msg
    else:
        assert "rank 1 sends 2 elements to rank 0, which expects 1 from it" in msg, msg
    t = torch.ones(1)
    dist.all_reduce(t)  # the group still works
    assert t.item() == size


@pytest.mark.mpi(min_size=2)
def test_a_refusal_on_one_rank_is_raised_on_every_rank(debug_on):
    """Rank 1's own checks refuse the op (its tensor list does not fit its
    input); in debug mode the refusal joins the comparison, so every rank
    raises it instead of the others waiting in MPI."""
    rank, size = dist.get_rank(), dist.get_world_size()
    with pytest.raises(hpccomm.HpccommError) as info:
        dist.all_gather([torch.empty(2) for _ in range(size)], torch.ones(3 if rank == 1 else 2))
    msg = str(info.value)
    if rank == 1:
        assert isinstance(info.value, hpccomm.OpValueError) and "this rank's slot" in msg, msg
    else:
        assert "rank 1 refused this op (OpValueError: hpccomm all_gather" in msg, msg
    t = torch.ones(1)
    dist.all_reduce(t)  # every rank numbered the refused op alike: the group still works
    assert t.item() == size
