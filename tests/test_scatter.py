"""broadcast and scatter (src and group_src, a non-zero root): every moving
dtype × group shape, bit-exact against references each rank computes
itself, the tensor forms (0-dim, empty, strided, views of one buffer), the
chunked paths past the MPI count limit, and torch's gloo on the same inputs."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from helpers import MOVE_DTYPES, same_on_all_ranks, work_done
from move_checks import GLOO_DTYPES, Checks, all_bytes, assert_same, count_limit, data

pytestmark = pytest.mark.mpi

IDS = [str(d)[6:] for d in MOVE_DTYPES]


@pytest.fixture(scope="module")
def gloo(world):
    """torch's own gloo backend over the whole world, made once on every rank."""
    return dist.new_group(backend="gloo")


def where(form, g, root):
    return {"src": g.ranks[root]} if form == "src" else {"group_src": root}


# -- broadcast -----------------------------------------------------------------

@pytest.mark.parametrize("form", ["src", "group_src"])
@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=IDS)
def test_broadcast(world, groups, dtype, form):
    check = Checks()
    for g in groups:
        t = None
        if g.member:
            root = g.size - 1  # not group rank 0 once the group has two ranks
            t = data((4, 3), dtype, g.rank)  # every rank starts with its own data
            ptr = t.data_ptr()
            dist.broadcast(t, group=g.pg, **where(form, g, root))
            check.same(t, data((4, 3), dtype, root), f"group {g.name}")
            check.true(t.data_ptr() == ptr, "failed: t.data_ptr() == ptr")
        check.true(same_on_all_ranks(None if t is None else all_bytes([t]), g.ranks), f"group {g.name}: ranks disagree")
    check.done()


def test_broadcast_forms(world, groups):
    """0-dim, empty and strided tensors (on the root and elsewhere): results land in the user's tensor."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        root = g.size - 1
        scalar = data((), torch.complex128, g.rank)
        dist.broadcast(scalar, group=g.pg, group_src=root)
        empty = torch.empty(0, 5, dtype=torch.int16)
        dist.broadcast(empty, group=g.pg, group_src=root)
        base = torch.zeros(6, 4, dtype=torch.bfloat16)
        view = base[::2, 1:3]  # strided
        view.copy_(data((3, 2), torch.bfloat16, g.rank))
        check.true(not view.is_contiguous(), "failed: not view.is_contiguous()")
        dist.broadcast(view, group=g.pg, group_src=root)
        tbase = data((5, 3), torch.int64, g.rank)
        dist.broadcast(tbase.t(), group=g.pg, group_src=root)  # transposed
        check.same(scalar, data((), torch.complex128, root), f"group {g.name}: 0-dim")
        check.true(empty.shape == (0, 5), "failed: empty.shape == (0, 5)")
        check.same(base[::2, 1:3], data((3, 2), torch.bfloat16, root), f"group {g.name}: strided")
        untouched = base.clone()
        untouched[::2, 1:3] = 0
        check.true(torch.all(untouched == 0), "broadcast wrote outside the strided view")
        check.same(tbase, data((5, 3), torch.int64, root), f"group {g.name}: transposed")
    check.done()


# -- scatter -------------------------------------------------------------------

@pytest.mark.parametrize("form", ["src", "group_src"])
@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=IDS)
def test_scatter(world, groups, dtype, form):
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        root = g.size - 1
        pieces = [data((3, 2), dtype, root, k) for k in range(g.size)] if g.rank == root else None
        out = data((3, 2), dtype, g.rank, 99)  # overwritten
        dist.scatter(out, pieces, group=g.pg, **where(form, g, root))
        check.same(out, data((3, 2), dtype, root, g.rank), f"group {g.name}")
        if pieces is not None:
            for k in range(g.size):
                check.same(pieces[k], data((3, 2), dtype, root, k), f"group {g.name}: scatter_list[{k}] changed")
    check.done()


def test_scatter_forms(world, groups):
    """scatter_list as views of one buffer, strided tensors on both sides, the
    root's output inside its own scatter_list, 0-dim and empty tensors."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, root = g.size, g.size - 1
        me_root = g.rank == root
        dt = torch.float32
        # views of one buffer
        flat = torch.cat([data((2, 2), dt, root, k).reshape(-1) for k in range(n)])
        out1 = torch.zeros(2, 2, dtype=dt)
        dist.scatter(out1, [p.view(2, 2) for p in flat.chunk(n)] if me_root else None, group=g.pg, group_src=root)
        # strided scatter_list and output
        src = torch.stack([data((3, 2), dt, root, 10 + k) for k in range(n)]).transpose(1, 2)  # (n, 2, 3) strided
        obase = torch.zeros(2, 6, dtype=dt)
        out2 = obase[:, ::2]
        check.true(not out2.is_contiguous() and not src[0].is_contiguous(), "the strided tensors are contiguous")
        dist.scatter(out2, list(src.unbind(0)) if me_root else None, group=g.pg, group_src=root)
        # the root's output is its own scatter_list slot
        own = torch.stack([data((4,), dt, root, 20 + k) for k in range(n)]) if me_root else torch.zeros(n, 4)
        dist.scatter(own[g.rank], list(own.unbind(0)) if me_root else None, group=g.pg, group_src=root)
        # 0-dim and empty
        scalar = torch.zeros((), dtype=torch.int64)
        dist.scatter(scalar, [data((), torch.int64, root, k) for k in range(n)] if me_root else None,
                     group=g.pg, group_src=root)
        empty = torch.empty(0, 3)
        dist.scatter(empty, [torch.empty(0, 3) for _ in range(n)] if me_root else None, group=g.pg, group_src=root)
        me = g.rank
        check.same(out1, data((2, 2), dt, root, me), f"group {g.name}: from one buffer")
        check.same(out2, data((3, 2), dt, root, 10 + me).t(), f"group {g.name}: strided")
        check.true(torch.all(obase[:, 1::2] == 0), "scatter wrote outside the strided output")
        check.same(own[g.rank], data((4,), dt, root, 20 + me), f"group {g.name}: own slot")
        check.same(scalar, data((), torch.int64, root, me), f"group {g.name}: 0-dim")
        check.true(empty.shape == (0, 3), "failed: empty.shape == (0, 3)")
    check.done()


def test_functional_and_async(world, groups):
    """funcol.broadcast (the C++ path DTensor takes; src is a group rank) and
    async_op=True Works whose futures hold the outputs."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, r, root = g.size, g.rank, g.size - 1
        mine = data((3, 2), torch.float32, r)
        got = funcol.wait_tensor(funcol.broadcast(mine, root, g.pg))
        b = data((4,), torch.int64, r, 1)
        w1 = dist.broadcast(b, group=g.pg, group_src=root, async_op=True)
        s = torch.empty(2, dtype=torch.bfloat16)
        w2 = dist.scatter(s, [data((2,), torch.bfloat16, root, k) for k in range(n)] if r == root else None,
                          group=g.pg, group_src=root, async_op=True)
        for w in (w1, w2):
            check.true(w.wait() and work_done(w, g.pg), f"group {g.name}: Work not complete")
        futures = (w1.get_future().value()[0], w2.get_future().value()[0])
        check.true(futures[0] is b and futures[1] is s, "the Works' futures do not hold the outputs")
        check.same(got, data((3, 2), torch.float32, root), f"group {g.name}: funcol.broadcast")
        check.same(mine, data((3, 2), torch.float32, r), "funcol.broadcast changed its input")
        check.same(b, data((4,), torch.int64, root, 1), "async broadcast")
        check.same(s, data((2,), torch.bfloat16, root, r), "async scatter")
    check.done()


# -- against torch's gloo backend ----------------------------------------------

@pytest.mark.parametrize("dtype", GLOO_DTYPES, ids=lambda d: str(d)[6:])
def test_matches_gloo(world, gloo, dtype):
    """hpccomm and gloo give identical bytes for the same inputs."""
    n, r = dist.get_world_size(), dist.get_rank()
    root = n - 1
    results = {}
    for name, pg in (("hpccomm", dist.group.WORLD), ("gloo", gloo)):
        b = data((5, 2), dtype, r)
        dist.broadcast(b, src=root, group=pg)
        s = torch.empty(3, dtype=dtype)
        dist.scatter(s, [data((3,), dtype, r, k) for k in range(n)] if r == root else None, src=root, group=pg)
        results[name] = [b, s]
    for i, (a, b) in enumerate(zip(results["hpccomm"], results["gloo"])):
        assert_same(a, b, f"result {i}: hpccomm vs gloo")
    assert_same(results["hpccomm"][1], data((3,), dtype, root, r), "scatter")  # and both are right


# -- past the MPI count limit --------------------------------------------------

def test_split_past_count_limit(world):
    """With the count limit lowered to 7, broadcast goes in chunks of 7 and
    scatter by chunked point-to-point messages from the root."""
    n, r = dist.get_world_size(), dist.get_rank()
    root = n - 1
    dt = torch.float64
    with count_limit(7) as log:
        b = data((20,), dt, r)
        dist.broadcast(b, src=root)
        bcast_calls = log.names()
        log.clear()
        strided = data((5, 4), dt, r).t()  # 20 elements, staged and written back
        dist.broadcast(strided, src=root)
        log.clear()
        s = torch.empty(9, dtype=dt)
        dist.scatter(s, [data((9,), dt, root, k) for k in range(n)] if r == root else None, src=root)
        scatter_calls = log.names()
        log.clear()
        small = torch.empty(3, dtype=dt)  # 3 per rank: one Scatter unless 3n > 7
        dist.scatter(small, [data((3,), dt, root, 10 + k) for k in range(n)] if r == root else None, src=root)
        small_calls = log.names()
    assert_same(b, data((20,), dt, root), "broadcast")
    assert_same(strided, data((5, 4), dt, root).t(), "strided broadcast")
    assert_same(s, data((9,), dt, root, r), "scatter")
    assert_same(small, data((3,), dt, root, 10 + r), "small scatter")
    assert bcast_calls == ["Bcast"] * 3, bcast_calls
    if r == root:
        assert scatter_calls == ["Isend"] * (2 * (n - 1)), scatter_calls
    else:
        assert scatter_calls == ["Recv", "Recv"], scatter_calls
    if 3 * n <= 7:
        assert small_calls == ["Scatter"], small_calls
    else:
        assert small_calls == (["Isend"] * (n - 1) if r == root else ["Recv"]), small_calls
