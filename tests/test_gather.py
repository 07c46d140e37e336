"""all_gather (list form: equal and different sizes, outputs that are views of
one buffer or separate tensors, in place), all_gather_into_tensor and
all_gather_single (concatenated, stacked, in place), the coalesced forms, and
gather (dst and group_dst): every moving dtype × group shape, bit-exact
against references each rank computes itself, and against torch's gloo."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import hpccomm

from helpers import MOVE_DTYPES, same_on_all_ranks, work_done
from move_checks import GLOO_DTYPES, Checks, all_bytes, assert_same, count_limit, data

pytestmark = pytest.mark.mpi

IDS = [str(d)[6:] for d in MOVE_DTYPES]


def rows(k: int) -> int:
    """Rows rank k contributes to the uneven gathers: 1, 2, 0, 1, ... (an empty one from 3 ranks)."""
    return (k + 1) % 3


@pytest.fixture(scope="module")
def gloo(world):
    """torch's own gloo backend over the whole world, made once on every rank."""
    return dist.new_group(backend="gloo")


def allgather_buffers(op, *args, pg):
    """``(send address or "IN_PLACE", receive address, counts per rank)`` of the one
    MPI_Allgather(v) that hpccomm.explain says ``op`` (``"all_gather"`` or
    ``"all_gather_into_tensor"``, torch's backend arguments) makes on group ``pg``, with nothing
    before or after it."""
    e = hpccomm.explain(op, *args, group=pg)
    assert e.call in ("Allgather", "Allgatherv") and not e.before and not e.after, e
    send, (recv, count) = e.buffers
    counts = list(count[0]) if isinstance(count, tuple) else [count] * dist.get_world_size(pg)
    return (send if send == "IN_PLACE" else send[0]), recv, counts


# -- all_gather, list form ---------------------------------------------------

@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=IDS)
def test_all_gather_equal(world, groups, dtype):
    check = Checks()
    for g in groups:
        result = None
        if g.member:
            inp = data((2, 3), dtype, g.rank)
            outs = [torch.empty(2, 3, dtype=dtype) for _ in range(g.size)]  # separate tensors
            dist.all_gather(outs, inp, group=g.pg)
            for k in range(g.size):
                check.same(outs[k], data((2, 3), dtype, k), f"group {g.name}: slot {k}")
            check.same(inp, data((2, 3), dtype, g.rank), f"group {g.name}: input")
            result = all_bytes(outs)
        check.true(same_on_all_ranks(result, g.ranks), f"group {g.name}: ranks disagree")
    check.done()


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=IDS)
def test_all_gather_uneven(world, groups, dtype):
    """Different sizes per rank (Allgatherv), zero rows included, into
    separate tensors and into views of one flat buffer."""
    check = Checks()
    for g in groups:
        results = None
        if g.member:
            inp = data((rows(g.rank), 3), dtype, g.rank)
            expected = [data((rows(k), 3), dtype, k) for k in range(g.size)]
            separate = [torch.empty(rows(k), 3, dtype=dtype) for k in range(g.size)]
            dist.all_gather(separate, inp, group=g.pg)
            counts = [rows(k) * 3 for k in range(g.size)]
            flat = torch.empty(sum(counts), dtype=dtype)
            views = [p.view(rows(k), 3) for k, p in enumerate(flat.split(counts))]
            dist.all_gather(views, inp, group=g.pg)
            for k in range(g.size):
                check.same(separate[k], expected[k], f"group {g.name}: separate slot {k}")
                check.same(views[k], expected[k], f"group {g.name}: view slot {k}")
            check.same(flat, torch.cat([e.reshape(-1) for e in expected]), f"group {g.name}: flat buffer")
            results = all_bytes(separate + [flat])
        check.true(same_on_all_ranks(results, g.ranks), f"group {g.name}: ranks disagree")
    check.done()


@pytest.mark.parametrize("uneven", [False, True], ids=["equal", "uneven"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=lambda d: str(d)[6:])
def test_all_gather_zero_copy(world, groups, dtype, uneven):
    """Outputs that are consecutive views of one buffer are received in place:
    MPI writes into that buffer, no staging copy."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        shape = (lambda k: (k % 2 + 1, 2)) if uneven else (lambda k: (2, 2))
        counts = [shape(k)[0] * 2 for k in range(g.size)]
        flat = torch.zeros(sum(counts), dtype=dtype)
        views = [p.view(shape(k)) for k, p in enumerate(flat.split(counts))]
        inp = data(shape(g.rank), dtype, g.rank)
        recorded = [allgather_buffers("all_gather", [views], [inp], pg=g.pg)]
        dist.all_gather(views, inp, group=g.pg)
        check.true(len(recorded) == 1 and recorded[0][1] == flat.data_ptr(),
                   f"group {g.name}: MPI received into {recorded}, not the output buffer at {flat.data_ptr()}")
        check.true(recorded[0][2] == counts, "failed: recorded[0][2] == counts")
        check.same(flat, torch.cat([data(shape(k), dtype, k).reshape(-1) for k in range(g.size)]),
                   f"group {g.name}: flat buffer")
    check.done()


@pytest.mark.mpi(min_size=2)
def test_all_gather_zero_copy_empty_slot(world, groups):
    """Views of one buffer where a rank's slot is empty are still received in place."""
    check = Checks()
    for g in groups:
        if not g.member or g.size < 2:
            continue
        counts = [0 if k == 0 else 2 * k for k in range(g.size)]
        flat = torch.zeros(sum(counts))
        outs, inp = list(flat.split(counts)), data((counts[g.rank],), torch.float32, g.rank)
        recorded = [allgather_buffers("all_gather", [outs], [inp], pg=g.pg)]
        dist.all_gather(outs, inp, group=g.pg)
        check.same(flat, torch.cat([data((counts[k],), torch.float32, k) for k in range(g.size)]), "flat buffer")
        check.true(recorded[0][1] == flat.data_ptr(), f"group {g.name}: staged, not received in place")
    check.done()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8, torch.bool, *MOVE_DTYPES[-2:]],
                         ids=lambda d: str(d)[6:])
def test_all_gather_in_place(world, groups, dtype):
    """The input is this rank's own slot of the output buffer (MPI_IN_PLACE)."""
    check = Checks()
    for g in groups:
        result = None
        if g.member:
            flat = torch.empty(g.size * 6, dtype=dtype)
            views = [p.view(2, 3) for p in flat.chunk(g.size)]
            views[g.rank].copy_(data((2, 3), dtype, g.rank))
            recorded = [allgather_buffers("all_gather", [views], [views[g.rank]], pg=g.pg)]
            dist.all_gather(views, views[g.rank], group=g.pg)
            check.true(recorded[0][0] == "IN_PLACE" and recorded[0][1] == flat.data_ptr(),
                       f"group {g.name}: not sent from this rank's own slot of the output buffer (MPI_IN_PLACE)")
            check.same(flat.view(g.size, 2, 3), torch.stack([data((2, 3), dtype, k) for k in range(g.size)]),
                       f"group {g.name}: in place")
            result = all_bytes([flat])
        check.true(same_on_all_ranks(result, g.ranks), f"group {g.name}: ranks disagree")
    check.done()


def test_all_gather_tensor_forms(world, groups):
    """0-dim, empty and non-contiguous inputs and outputs: results land in the user's tensors."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n = g.size
        # 0-dim
        outs = [torch.full((), -1.0) for _ in range(n)]
        dist.all_gather(outs, data((), torch.float32, g.rank), group=g.pg)
        for k in range(n):
            check.same(outs[k], data((), torch.float32, k), f"group {g.name}: 0-dim slot {k}")
        # empty
        outs = [torch.empty(0, 3, dtype=torch.int32) for _ in range(n)]
        dist.all_gather(outs, torch.empty(0, 3, dtype=torch.int32), group=g.pg)
        check.true(all(o.shape == (0, 3) for o in outs), "failed: all(o.shape == (0, 3) for o in outs)")
        # non-contiguous input and outputs
        inp = data((3, 2), torch.int64, g.rank).t()
        base = torch.zeros(n, 2, 6, dtype=torch.int64)
        outs = [base[k, :, ::2] for k in range(n)]
        check.true(not inp.is_contiguous() and not outs[0].is_contiguous(), "the strided tensors are contiguous")
        dist.all_gather(outs, inp, group=g.pg)
        for k in range(n):
            check.same(outs[k], data((3, 2), torch.int64, k).t(), f"group {g.name}: strided slot {k}")
        check.true(torch.all(base[:, :, 1::2] == 0), "all_gather wrote between the strided outputs' elements")
        check.same(inp, data((3, 2), torch.int64, g.rank).t(), "input")
        # the input lies in the output buffer, in another rank's slot (staged, not in place)
        flat = torch.zeros(n * 2, dtype=torch.int64)
        views = list(flat.chunk(n))
        other = (g.rank + 1) % n
        views[other].copy_(data((2,), torch.int64, g.rank))
        dist.all_gather(views, views[other], group=g.pg)
        expected = torch.cat([data((2,), torch.int64, k) for k in range(n)])
        check.same(flat, expected, f"group {g.name}: input in another rank's slot")
    check.done()


# -- all_gather_into_tensor / all_gather_single --------------------------------

@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=IDS)
def test_all_gather_into_tensor(world, groups, dtype):
    check = Checks()
    for g in groups:
        result = None
        if g.member:
            n = g.size
            inp = data((2, 3), dtype, g.rank)
            stacked = torch.stack([data((2, 3), dtype, k) for k in range(n)])
            concat = torch.empty(n * 6, dtype=dtype)
            dist.all_gather_into_tensor(concat, inp, group=g.pg)  # (i) concatenated, 1-D
            stack = torch.empty(n, 2, 3, dtype=dtype)
            dist.all_gather_into_tensor(stack, inp, group=g.pg)  # (ii) stacked
            rows_out = torch.empty(n * 2, 3, dtype=dtype)
            dist.all_gather_single(rows_out, inp, group=g.pg)  # torch 2.13's name, cat along dim 0
            check.same(concat, stacked.reshape(-1), f"group {g.name}: concatenated")
            check.same(stack, stacked, f"group {g.name}: stacked")
            check.same(rows_out, stacked.reshape(n * 2, 3), f"group {g.name}: all_gather_single")
            check.same(inp, data((2, 3), dtype, g.rank), f"group {g.name}: input")
            result = all_bytes([concat, stack, rows_out])
        check.true(same_on_all_ranks(result, g.ranks), f"group {g.name}: ranks disagree")
    check.done()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8, *MOVE_DTYPES[-1:]],
                         ids=lambda d: str(d)[6:])
def test_all_gather_into_tensor_in_place(world, groups, dtype):
    """FSDP's form: the input is this rank's shard of the output, 1-D and stacked."""
    check = Checks()
    for g in groups:
        result = None
        if g.member:
            n, r = g.size, g.rank
            expected = torch.stack([data((5,), dtype, k) for k in range(n)])
            flat = torch.empty(n * 5, dtype=dtype)
            flat[r * 5:(r + 1) * 5].copy_(data((5,), dtype, r))
            ptr = flat.data_ptr()
            send, recv, _ = allgather_buffers("all_gather_into_tensor", flat, flat[r * 5:(r + 1) * 5], pg=g.pg)
            dist.all_gather_into_tensor(flat, flat[r * 5:(r + 1) * 5], group=g.pg)
            check.true(recv == ptr and send == "IN_PLACE", "not received in place (MPI_IN_PLACE: this rank's slot)")
            stack = torch.empty(n, 5, dtype=dtype)
            stack[r].copy_(data((5,), dtype, r))
            dist.all_gather_single(stack, stack[r], group=g.pg)
            check.true(flat.data_ptr() == ptr, "failed: flat.data_ptr() == ptr")
            check.same(flat, expected.reshape(-1), f"group {g.name}: 1-D in place")
            check.same(stack, expected, f"group {g.name}: stacked in place")
            result = all_bytes([flat, stack])
        check.true(same_on_all_ranks(result, g.ranks), f"group {g.name}: ranks disagree")
    check.done()


def test_all_gather_into_tensor_forms(world, groups):
    """Non-contiguous input and output (written back), 0-dim input, empty tensors."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n = g.size
        inp = data((2, 2), torch.float64, g.rank).t()
        base = torch.zeros(n * 4, 2, dtype=torch.float64)
        out = base[:, 0]
        check.true(not inp.is_contiguous() and not out.is_contiguous(), "the strided tensors are contiguous")
        dist.all_gather_into_tensor(out, inp, group=g.pg)
        check.same(base[:, 0], torch.cat([data((2, 2), torch.float64, k).t().reshape(-1) for k in range(n)]),
                   f"group {g.name}: strided output")
        check.true(torch.all(base[:, 1] == 0), "wrote outside the strided output")
        sbase = torch.zeros(n, 3, 2, dtype=torch.int16)
        stack = sbase[:, :, 1]  # stacked and strided
        dist.all_gather_into_tensor(stack, data((3,), torch.int16, g.rank), group=g.pg)
        check.same(stack, torch.stack([data((3,), torch.int16, k) for k in range(n)]), "strided stacked output")
        check.true(torch.all(sbase[:, :, 0] == 0), "failed: torch.all(sbase[:, :, 0] == 0)")
        out = torch.empty(n, dtype=torch.int32)
        dist.all_gather_into_tensor(out, data((), torch.int32, g.rank), group=g.pg)
        check.same(out, torch.stack([data((), torch.int32, k) for k in range(n)]), "0-dim input")
        out = torch.empty(0, 4)
        dist.all_gather_into_tensor(out, torch.empty(0, 4), group=g.pg)
        check.true(out.shape == (0, 4), "failed: out.shape == (0, 4)")
    check.done()


@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_coalesced` will be deprecated:FutureWarning")
def test_all_gather_coalesced(world, groups):
    """all_gather_into_tensor inside _coalescing_manager reaches the group's
    all_gather_single_coalesced; the list form all_gather_coalesced too."""
    check = Checks()
    specs = [((3,), torch.float32), ((2, 2), torch.int64), ((0,), torch.float16), ((4,), torch.bfloat16)]
    for g in groups:
        if not g.member:
            continue
        n = g.size
        for async_ops in (False, True):
            ins = [data(s, d, g.rank, i) for i, (s, d) in enumerate(specs)]
            outs = [torch.empty((n * s[0], *s[1:]), dtype=d) for s, d in specs]
            with dist._coalescing_manager(group=g.pg, async_ops=async_ops) as cm:
                for o, i in zip(outs, ins):
                    dist.all_gather_into_tensor(o, i, group=g.pg)
            if async_ops:
                cm.wait()
            for j, (s, d) in enumerate(specs):
                check.same(outs[j], torch.cat([data(s, d, k, j) for k in range(n)]),
                           f"group {g.name}: coalesced tensor {j} (async_ops={async_ops})")
        # torch's layout (as gloo reads it): out_lists[rank][i] receives that rank's input i
        out_lists = [[torch.empty(3), torch.empty(2, 2), torch.empty(0)] for _ in range(n)]
        ins = [data((3,), torch.float32, g.rank), data((2, 2), torch.float32, g.rank, 1),
               torch.empty(0)]  # torch wants one dtype
        dist.all_gather_coalesced(out_lists, ins, group=g.pg)
        for k in range(n):
            check.same(out_lists[k][0], data((3,), torch.float32, k), f"all_gather_coalesced from {k}, input 0")
            check.same(out_lists[k][1], data((2, 2), torch.float32, k, 1), f"all_gather_coalesced from {k}, input 1")
            check.true(out_lists[k][2].numel() == 0, "all_gather_coalesced: the empty input")
    check.done()


def test_all_gather_single_coalesced_method(world):
    """The process group's method, as C++ callers (FSDP2's functional collectives) reach it."""
    pg = dist.group.WORLD
    n, r = dist.get_world_size(), dist.get_rank()
    ins = [data((3,), torch.float32, r), data((2,), torch.bool, r, 1)]
    outs = [torch.empty(n * 3), torch.empty(n * 2, dtype=torch.bool)]
    for method in (pg.all_gather_single_coalesced, pg.allgather_into_tensor_coalesced):
        work = method(outs, ins)
        assert work.wait()
        value = work.get_future().value()
        assert len(value) == 2 and value[0] is outs[0] and value[1] is outs[1]
        assert_same(outs[0], torch.cat([data((3,), torch.float32, k) for k in range(n)]), "float32")
        assert_same(outs[1], torch.cat([data((2,), torch.bool, k, 1) for k in range(n)]), "bool")
        outs = [torch.empty_like(o) for o in outs]


def test_functional_collectives(world, groups):
    """The C++ path DTensor and FSDP2 take (torch.ops._c10d_functional) reaches hpccomm too."""
    check = Checks()
    for g in groups:
        result = None
        if g.member:
            n, r = g.size, g.rank
            a = funcol.wait_tensor(funcol.all_gather_single(data((2, 3), torch.float32, r), 0, g.pg))
            b = funcol.wait_tensor(funcol.all_gather_single(data((2, 3), torch.bfloat16, r, 1), 1, g.pg))
            cs = [funcol.wait_tensor(t) for t in funcol.all_gather_single_coalesced(
                [data((3,), torch.int64, r, 2), data((1, 2), torch.float16, r, 3)], g.pg)]
            check.same(a, torch.cat([data((2, 3), torch.float32, k) for k in range(n)]), f"group {g.name}: dim 0")
            check.same(b, torch.cat([data((2, 3), torch.bfloat16, k, 1) for k in range(n)], 1), "gather_dim 1")
            check.same(cs[0], torch.cat([data((3,), torch.int64, k, 2) for k in range(n)]), "coalesced 0")
            check.same(cs[1], torch.cat([data((1, 2), torch.float16, k, 3) for k in range(n)]), "coalesced 1")
            result = all_bytes([a, b, *cs])
        check.true(same_on_all_ranks(result, g.ranks), f"group {g.name}: ranks disagree")
    check.done()


def test_async_op(world, groups):
    """async_op=True returns a Work that completes, whose future holds the outputs."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, r, root = g.size, g.rank, g.size - 1
        outs = [torch.empty(2) for _ in range(n)]
        w1 = dist.all_gather(outs, data((2,), torch.float32, r), group=g.pg, async_op=True)
        into = torch.empty(n * 2, dtype=torch.int16)
        w2 = dist.all_gather_into_tensor(into, data((2,), torch.int16, r, 1), group=g.pg, async_op=True)
        gathered = [torch.empty(2, dtype=torch.uint8) for _ in range(n)] if r == root else None
        w3 = dist.gather(data((2,), torch.uint8, r, 2), gathered, group=g.pg, group_dst=root, async_op=True)
        for w in (w1, w2, w3):
            check.true(w.wait() and work_done(w, g.pg), f"group {g.name}: Work not complete")
        check.true(w1.get_future().value()[0][0] is outs[0], "failed: w1.get_future().value()[0][0] is outs[0]")
        check.true(w2.get_future().value()[0] is into, "failed: w2.get_future().value()[0] is into")
        for k in range(n):
            check.same(outs[k], data((2,), torch.float32, k), "all_gather")
            check.same(into[2 * k:2 * k + 2], data((2,), torch.int16, k, 1), "all_gather_into_tensor")
            if r == root:
                check.same(gathered[k], data((2,), torch.uint8, k, 2), "gather")
    check.done()


# -- gather -------------------------------------------------------------------

@pytest.mark.parametrize("form", ["dst", "group_dst"])
@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=IDS)
def test_gather(world, groups, dtype, form):
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        root = g.size - 1  # not group rank 0 once the group has two ranks
        inp = data((3, 2), dtype, g.rank)
        outs = [torch.empty(3, 2, dtype=dtype) for _ in range(g.size)] if g.rank == root else None
        where = {"dst": g.ranks[root]} if form == "dst" else {"group_dst": root}
        dist.gather(inp, outs, group=g.pg, **where)
        if g.rank == root:
            for k in range(g.size):
                check.same(outs[k], data((3, 2), dtype, k), f"group {g.name}: slot {k}")
        else:
            check.true(outs is None, "failed: outs is None")
        check.same(inp, data((3, 2), dtype, g.rank), f"group {g.name}: input")
    check.done()


def test_gather_forms(world, groups):
    """gather_list as views of one buffer, strided tensors both sides, the root's
    input inside its own gather_list, 0-dim and empty tensors."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, root = g.size, g.size - 1
        me_root = g.rank == root
        dt = torch.int32
        # gather_list: views of one buffer
        flat = torch.zeros(n * 4, dtype=dt)
        dist.gather(data((2, 2), dt, g.rank), [p.view(2, 2) for p in flat.chunk(n)] if me_root else None,
                    group=g.pg, group_dst=root)
        # strided input and gather_list
        base = torch.zeros(n, 3, 4, dtype=dt)
        inp = data((2, 3), dt, g.rank).t()
        dist.gather(inp, [base[k, :, ::2] for k in range(n)] if me_root else None, group=g.pg, group_dst=root)
        # the root's input is its own gather_list slot
        own = torch.zeros(n, 3, dtype=dt)
        own[g.rank].copy_(data((3,), dt, g.rank, 1))
        dist.gather(own[g.rank], list(own.unbind(0)) if me_root else None, group=g.pg, group_dst=root)
        # 0-dim and empty
        scalars = [torch.zeros((), dtype=torch.float64) for _ in range(n)] if me_root else None
        dist.gather(data((), torch.float64, g.rank), scalars, group=g.pg, group_dst=root)
        empties = [torch.empty(0, 2) for _ in range(n)] if me_root else None
        dist.gather(torch.empty(0, 2), empties, group=g.pg, group_dst=root)
        if me_root:
            check.same(flat, torch.cat([data((4,), dt, k) for k in range(n)]), f"group {g.name}: flat gather_list")
            for k in range(n):
                check.same(base[k, :, ::2], data((2, 3), dt, k).t(), f"group {g.name}: strided slot {k}")
                check.same(own[k], data((3,), dt, k, 1), f"group {g.name}: own-slot gather {k}")
                check.same(scalars[k], data((), torch.float64, k), f"group {g.name}: 0-dim {k}")
                check.true(empties[k].shape == (0, 2), "failed: empties[k].shape == (0, 2)")
            check.true(torch.all(base[:, :, 1::2] == 0), "gather wrote between the strided outputs' elements")
    check.done()


# -- against torch's gloo backend ----------------------------------------------

@pytest.mark.parametrize("dtype", GLOO_DTYPES, ids=lambda d: str(d)[6:])
def test_matches_gloo(world, gloo, dtype):
    """hpccomm and gloo give identical bytes for the same inputs."""
    n, r = dist.get_world_size(), dist.get_rank()
    results = {}
    for name, pg in (("hpccomm", dist.group.WORLD), ("gloo", gloo)):
        inp = data((4, 3), dtype, r)
        outs = [torch.empty(4, 3, dtype=dtype) for _ in range(n)]
        dist.all_gather(outs, inp, group=pg)
        into = torch.empty(n * 4, 3, dtype=dtype)
        dist.all_gather_into_tensor(into, inp, group=pg)
        res = [*outs, into]
        if not dtype.is_complex:  # gloo cannot gather complex tensors
            root = n - 1
            gathered = [torch.empty(4, 3, dtype=dtype) for _ in range(n)] if r == root else None
            dist.gather(inp, gathered, dst=root, group=pg)
            res += gathered or []
        results[name] = res
    assert len(results["hpccomm"]) == len(results["gloo"])
    for i, (a, b) in enumerate(zip(results["hpccomm"], results["gloo"])):
        assert_same(a, b, f"result {i}: hpccomm vs gloo")
    assert_same(results["hpccomm"][0], data((4, 3), dtype, 0), "slot 0")  # and both are right


# -- past the MPI count limit --------------------------------------------------

def test_split_past_count_limit(world):
    """With the count limit lowered to 7, larger messages take the chunked
    paths: allgather by chunked broadcasts from every rank, gather by chunked
    sends to the root."""
    n, r = dist.get_world_size(), dist.get_rank()
    dt = torch.int64
    with count_limit(7) as log:
        # equal sizes, 10 elements each: every rank broadcasts 7 + 3
        outs = [torch.empty(10, dtype=dt) for _ in range(n)]
        dist.all_gather(outs, data((10,), dt, r))
        equal_calls = log.names()
        log.clear()
        # uneven: 8 + 3k elements, but none for rank 1
        size = [0 if k == 1 else 8 + 3 * k for k in range(n)]
        flat = torch.empty(sum(size), dtype=dt)
        views = list(flat.split(size))
        dist.all_gather(views, data((size[r],), dt, r))
        uneven_calls = log.names()
        log.clear()
        # each part fits but the total does not (from 2 ranks): 4 and 7 elements
        small = [4 + 3 * (k % 2) for k in range(n)]
        sep = [torch.empty(s, dtype=dt) for s in small]
        dist.all_gather(sep, data((small[r],), dt, r))
        small_calls = log.names()
        log.clear()
        # all_gather_into_tensor, 5 per rank, then in place
        into = torch.empty(n * 5, dtype=dt)
        dist.all_gather_into_tensor(into, data((5,), dt, r, 1))
        inplace = torch.zeros(n, 9, dtype=dt)
        inplace[r].copy_(data((9,), dt, r, 2))
        dist.all_gather_into_tensor(inplace, inplace[r])
        into_calls = log.names()
        log.clear()
        # gather, 9 elements per rank to the last rank
        root = n - 1
        gathered = [torch.empty(9, dtype=dt) for _ in range(n)] if r == root else None
        dist.gather(data((9,), dt, r, 3), gathered, dst=root)
        gather_calls = log.names()
    for k in range(n):
        assert_same(outs[k], data((10,), dt, k), f"equal slot {k}")
        assert_same(views[k], data((size[k],), dt, k), f"uneven slot {k}")
        assert_same(sep[k], data((small[k],), dt, k), f"small slot {k}")
        assert_same(into[k * 5:(k + 1) * 5], data((5,), dt, k, 1), f"into slot {k}")
        assert_same(inplace[k], data((9,), dt, k, 2), f"in-place slot {k}")
        if r == root:
            assert_same(gathered[k], data((9,), dt, k, 3), f"gather slot {k}")
    assert equal_calls == ["Bcast"] * (2 * n), equal_calls
    assert uneven_calls == ["Bcast"] * sum(len(range(0, s, 7)) or 1 for s in size), uneven_calls
    assert small_calls == (["Bcast"] * n if sum(small) > 7 else ["Allgather"]), small_calls
    assert into_calls == (["Bcast"] * (n + 2 * n) if n > 1 else ["Allgather", "Bcast", "Bcast"]), into_calls
    if r == root:
        assert gather_calls == ["Recv"] * (2 * (n - 1)), gather_calls
    else:
        assert gather_calls == ["Send", "Send"], gather_calls
