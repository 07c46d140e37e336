"""all_reduce, reduce, reduce_scatter(_tensor) and their coalesced forms:
every reducing dtype × ReduceOp × group shape, against a reference each rank
computes itself (integers exact, floats within helpers.tolerance)."""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import hpccomm
from helpers import hgroup, R, REDUCE_DTYPES, FLOAT8, assert_close, fill, nonblocking_async, same_on_all_ranks

pytestmark = pytest.mark.mpi

OPS = {
    "SUM": R.SUM, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX, "AVG": R.AVG,
    "BAND": R.BAND, "BOR": R.BOR, "BXOR": R.BXOR, "PREMUL_SUM": "premul",
}


def kind(dtype):
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    if dtype.is_floating_point:
        return "float"
    return "int"


def supported(dtype, opname) -> bool:
    k = kind(dtype)
    if opname in ("BAND", "BOR", "BXOR"):
        return k in ("int", "bool")
    if opname in ("MIN", "MAX"):
        return k != "complex"
    if opname == "AVG":
        return k != "bool"
    if opname == "PREMUL_SUM":
        return k in ("float", "complex")
    return True


def make_op(opname, factor=0.5):
    return dist._make_nccl_premul_sum(factor) if opname == "PREMUL_SUM" else OPS[opname]


def reference(values, dtype, opname, factor=0.5):
    """Reduce the per-rank tensors ``values`` as torch's backends define it."""
    if dtype == torch.bool:
        stack = torch.stack([v.to(torch.uint8) for v in values])
        fn = {"SUM": lambda s: s.amax(0), "MAX": lambda s: s.amax(0), "PRODUCT": lambda s: s.amin(0),
              "MIN": lambda s: s.amin(0)}.get(opname)
        if fn is None:
            fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[opname]
            return functools.reduce(fn, list(stack)).bool()
        return fn(stack).bool()
    if kind(dtype) == "int":
        wide = [v.to(torch.int64) for v in values]
        if opname in ("BAND", "BOR", "BXOR"):
            fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[opname]
            out = functools.reduce(fn, wide)
        elif opname == "AVG":
            out = torch.div(sum(wide), len(wide), rounding_mode="trunc")
        elif opname == "SUM":
            out = sum(wide)
        elif opname == "PRODUCT":
            out = functools.reduce(torch.mul, wide)
        else:
            out = torch.stack(wide).amin(0) if opname == "MIN" else torch.stack(wide).amax(0)
        return out.to(dtype)  # wraps like the dtype's own arithmetic
    wide = torch.stack([v.to(torch.complex128 if dtype.is_complex else torch.float64) for v in values])
    if opname == "SUM":
        return wide.sum(0)
    if opname == "AVG":
        return wide.sum(0) / len(values)
    if opname == "PREMUL_SUM":
        return (wide * factor).sum(0)
    if opname == "PRODUCT":
        return wide.prod(0)
    return wide.amin(0) if opname == "MIN" else wide.amax(0)


def inputs_for(group, shape, dtype, salt=0):
    return [fill(shape, dtype, r, salt) for r in range(group.size)]


CASES = [(d, o) for d in REDUCE_DTYPES for o in OPS if supported(d, o)]
# torch's all_reduce itself refuses PRODUCT on complex tensors before the backend sees them.
ALL_REDUCE_CASES = [(d, o) for d, o in CASES if not (d.is_complex and o == "PRODUCT")]


@pytest.mark.parametrize("async_op", [False, "posted"], ids=["blocking", "posted"])
@pytest.mark.parametrize("dtype,opname", ALL_REDUCE_CASES, ids=[f"{str(d)[6:]}-{o}" for d, o in ALL_REDUCE_CASES])
def test_all_reduce_matrix(world, groups, dtype, opname, async_op):
    """Blocking, and posted: async_op=True in the nonblocking MPI form
    (HPCCOMM_ASYNC_NONBLOCKING) where the dtype has one (hpccomm._ops.op_path).
    async_op=True on the comm thread runs the same op code as blocking, in
    another thread: tests/test_async.py covers that path."""
    for g in groups:
        t = None
        if g.member:
            values = inputs_for(g, (3, 5), dtype)
            t = values[g.rank].clone()
            with nonblocking_async(async_op == "posted"):  # posted: HPCCOMM_ASYNC_NONBLOCKING's form
                work = dist.all_reduce(t, op=make_op(opname), group=g.pg, async_op=bool(async_op))
            if async_op:
                work.wait()
            assert_close(t, reference(values, dtype, opname), dtype, g.size)
        assert same_on_all_ranks(t, g.ranks), f"group {g.name}: ranks disagree"


@pytest.mark.parametrize("dtype,opname", CASES, ids=[f"{str(d)[6:]}-{o}" for d, o in CASES])
def test_reduce_matrix(world, groups, dtype, opname):
    for g in groups:
        if not g.member:
            continue
        root = g.size - 1
        values = inputs_for(g, (7,), dtype, salt=1)
        t = values[g.rank].clone()
        before = t.clone()
        dist.reduce(t, dst=g.ranks[root], op=make_op(opname), group=g.pg)
        if g.rank == root:
            assert_close(t, reference(values, dtype, opname), dtype, g.size)
        else:
            assert torch.equal(t, before), "reduce changed a non-root rank's tensor"


@pytest.mark.parametrize("async_op", [False, "posted"], ids=["blocking", "posted"])
@pytest.mark.parametrize("dtype,opname", CASES, ids=[f"{str(d)[6:]}-{o}" for d, o in CASES])
def test_reduce_scatter_tensor_matrix(world, groups, dtype, opname, async_op):
    for g in groups:
        if not g.member:
            continue
        n = 4
        values = inputs_for(g, (g.size * n,), dtype, salt=2)
        inp = values[g.rank].clone()
        out = torch.empty(n, dtype=dtype)
        with nonblocking_async(async_op == "posted"):
            work = dist.reduce_scatter_tensor(out, inp, op=make_op(opname), group=g.pg, async_op=bool(async_op))
        if async_op:
            work.wait()
        expected = reference(values, dtype, opname)[g.rank * n:(g.rank + 1) * n]
        assert_close(out, expected, dtype, g.size)
        assert torch.equal(inp, values[g.rank]), "reduce_scatter_tensor changed its input"


LIST_CASES = [(d, o) for d in (torch.float32, torch.bfloat16, torch.int64, torch.bool)
              for o in ("SUM", "MAX", "AVG") if supported(d, o)]


@pytest.mark.parametrize("dtype,opname", LIST_CASES, ids=[f"{str(d)[6:]}-{o}" for d, o in LIST_CASES])
def test_reduce_scatter_list(world, groups, dtype, opname):
    for g in groups:
        if not g.member:
            continue
        values = inputs_for(g, (g.size, 2, 3), dtype, salt=3)
        ins = list(values[g.rank].clone().unbind(0))
        out = torch.empty(2, 3, dtype=dtype)
        dist.reduce_scatter(out, ins, op=make_op(opname), group=g.pg)
        assert_close(out, reference(values, dtype, opname)[g.rank], dtype, g.size)


def test_all_reduce_coalesced(world, groups):
    for g in groups:
        if not g.member:
            continue
        a = [fill((4,), torch.float32, r) for r in range(g.size)]
        b = [fill((2, 3), torch.float32, r, 1) for r in range(g.size)]
        c = [fill((5,), torch.float32, r, 2) for r in range(g.size)]
        ts = [a[g.rank].clone(), b[g.rank].clone().t(), c[g.rank].clone()]  # one non-contiguous
        dist.all_reduce_coalesced(ts, op=R.MAX, group=g.pg)
        assert_close(ts[0], reference(a, torch.float32, "MAX"), torch.float32)
        assert_close(ts[1], reference(b, torch.float32, "MAX").t(), torch.float32)
        assert_close(ts[2], reference(c, torch.float32, "MAX"), torch.float32)
        big = [fill((70000,), torch.int64, r) for r in range(g.size)]  # above the flattening size
        ts = [big[g.rank].clone(), big[g.rank].clone()]
        dist.all_reduce_coalesced(ts, group=g.pg)
        assert_close(ts[0], reference(big, torch.int64, "SUM"), torch.int64)
        assert_close(ts[1], reference(big, torch.int64, "SUM"), torch.int64)


def test_tensor_forms(world):
    """0-dim, empty and non-contiguous tensors: results land in the user's tensor."""
    n, r = dist.get_world_size(), dist.get_rank()
    scalar = torch.tensor(float(r + 1))
    dist.all_reduce(scalar)
    assert scalar.item() == n * (n + 1) / 2 and scalar.dim() == 0
    empty = torch.empty(0, 3)
    dist.all_reduce(empty)
    assert empty.shape == (0, 3)
    base = torch.full((4, 6), float(r + 1))
    view = base[:, ::2]  # non-contiguous
    assert not view.is_contiguous()
    dist.all_reduce(view)
    assert torch.all(base[:, ::2] == n * (n + 1) / 2) and torch.all(base[:, 1::2] == r + 1)
    t = torch.full((6, 4), float(r)).t()
    out = torch.empty(4 * n, 6).t()[:, :4]  # non-contiguous output
    src = torch.arange(4 * n * 6, dtype=torch.float32).reshape(4 * n, 6).t().contiguous()
    dist.reduce_scatter_tensor(t, src)
    assert torch.equal(t, src.reshape(-1)[r * 24:(r + 1) * 24].reshape(4, 6).t() * n) or t.numel() == 24


def test_zero_copy_all_reduce(world):
    """A contiguous tensor is reduced in its own storage: MPI wrote there."""
    n = dist.get_world_size()
    t = torch.ones(1000)
    ptr = t.data_ptr()
    alias = t[10:20]  # a view of the same storage sees the result
    dist.all_reduce(t)
    assert t.data_ptr() == ptr and torch.all(alias == n)


def test_half_precision_accuracy(world):
    """float16/bfloat16 sums are at least as accurate as summing in that dtype."""
    n, r = dist.get_world_size(), dist.get_rank()
    for dtype in (torch.float16, torch.bfloat16):
        gen = torch.Generator().manual_seed(1234)
        values = [torch.randn(4096, generator=gen).to(dtype) for _ in range(n)]
        t = values[r].clone()
        dist.all_reduce(t)
        exact = torch.stack([v.double() for v in values]).sum(0)
        in_dtype = functools.reduce(lambda a, b: a + b, values)  # sequential sum in the dtype
        err = (t.double() - exact).abs().mean()
        err_dtype = (in_dtype.double() - exact).abs().mean()
        assert err <= err_dtype * 1.5 + 1e-12, (dtype, err, err_dtype)
        assert same_on_all_ranks(t)


def test_premul_sum_tensor_factor(world):
    n, r = dist.get_world_size(), dist.get_rank()
    t = torch.full((3,), float(r + 1), dtype=torch.float64)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(torch.tensor([0.25], dtype=torch.float64)))
    assert torch.allclose(t, torch.full((3,), 0.25 * n * (n + 1) / 2, dtype=torch.float64))


def test_avg_integer_truncates_like_nccl(world):
    n, r = dist.get_world_size(), dist.get_rank()
    t = torch.tensor([r - n // 2, 7 * r - 5], dtype=torch.int32)
    dist.all_reduce(t, op=R.AVG)
    s0 = sum(k - n // 2 for k in range(n))
    s1 = sum(7 * k - 5 for k in range(n))
    expected = torch.div(torch.tensor([s0, s1]), n, rounding_mode="trunc").to(torch.int32)
    assert torch.equal(t, expected)


def test_float8_reduce_refused(world):
    for dtype in FLOAT8:
        t = torch.zeros(2).to(dtype)
        before = t.clone()
        with pytest.raises(hpccomm.OpTypeError, match=r"all_reduce .*rank \d+/\d+.*can be moved but not reduced"):
            dist.all_reduce(t)
        assert torch.equal(t.view(torch.uint8), before.view(torch.uint8))


@pytest.mark.parametrize("op", ["all_reduce", "reduce", "reduce_scatter_tensor"])
def test_split_past_count_limit(world, op):
    """Messages above the MPI count limit are split; the limit is lowered to
    exercise the same code a 2**31-element tensor takes."""
    pg = dist.group.WORLD
    n, r = dist.get_world_size(), dist.get_rank()
    old, hgroup(pg).max_count = hgroup(pg).max_count, 7
    hgroup(pg).checked.clear()  # (a checked call's plan is bound to the limit of its first call: Op.bind)
    try:
        if op == "all_reduce":
            t = fill((50,), torch.int64, r)
            dist.all_reduce(t)
            assert torch.equal(t, sum(fill((50,), torch.int64, k) for k in range(n)))
        elif op == "reduce":
            t = fill((50,), torch.bfloat16, r)
            dist.reduce(t, dst=0)
            if r == 0:
                assert torch.equal(t, sum(fill((50,), torch.float64, k) for k in range(n)).bfloat16())
        else:
            inp = fill((n * 20,), torch.float32, r)
            out = torch.empty(20)
            dist.reduce_scatter_tensor(out, inp)
            assert torch.equal(out, sum(fill((n * 20,), torch.float32, k) for k in range(n))[r * 20:(r + 1) * 20])
    finally:
        hgroup(pg).max_count = old
        hgroup(pg).checked.clear()


@pytest.mark.parametrize("dtype,opname", [(torch.float32, "SUM"), (torch.bfloat16, "SUM"), (torch.int32, "AVG"),
                                          (torch.float64, "MAX")])
def test_all_reduce_in_pieces_past_the_piece_size(world, monkeypatch, dtype, opname):
    """all_reduce past _ALLREDUCE_PIECE_BYTES goes in pieces (bounding MPI's
    scratch memory); the piece size is lowered to 24 bytes to exercise it,
    with a remainder piece."""
    from hpccomm._ops import reduce as reduce_ops

    monkeypatch.setattr(reduce_ops, "_ALLREDUCE_PIECE_BYTES", 24)
    n, r = dist.get_world_size(), dist.get_rank()
    t = fill((5, 7), dtype, r)
    dist.all_reduce(t, op=OPS[opname])
    assert_close(t, reference([fill((5, 7), dtype, k) for k in range(n)], dtype, opname), dtype, n)


def test_dense_plans_in_place_and_history_free(world, groups):
    """Blocking all_reduce, broadcast, all_gather_into_tensor and reduce_scatter_tensor of dense
    contiguous CPU tensors run one MPI call on the tensors' own memory (hpccomm.explain: no step
    before or after it, the buffers at the tensors' addresses, MPI_IN_PLACE where the op is in
    place), planned alike on every call (the plan of a call depends on its arguments, not on what ran
    before), on every group shape; every result against each rank's
    own reference and the same on every member; the op number advancing by one per op; and what
    cannot run on the user's memory (strided tensors, AVG's division, all_gather's input in another
    rank's slot, reduce_scatter's output inside its input) planned with its copies and steps, with
    the same results; an async_op=True call queued on the comm thread (the posted form is opt-in); a
    refused pair raising its message with the tensor untouched."""
    def plan(op, *args, pg, **kw):
        return hpccomm.explain(op, *args, group=pg, **kw)

    def on_memory(e, call, *tensors, in_place=False):
        """``e`` is one ``call`` on ``tensors``' own memory, nothing before or after it."""
        addresses = [b[0] for b in e.buffers if b != "IN_PLACE"]
        assert (e.where, e.call, e.before, e.after) == ("here", call, False, False), e
        assert addresses == [t.data_ptr() for t in tensors], (e, [t.data_ptr() for t in tensors])
        assert (e.buffers[0] == "IN_PLACE") == in_place, e

    for tg in groups:
        if tg.pg is None:  # not a member: only the world-wide comparison below
            for _ in range(3):
                assert same_on_all_ranks(None, tg.ranks)
            continue
        pg, m, me = tg.pg, len(tg.ranks), tg.rank
        hg = hgroup(pg)
        n = 3
        tri = m * (m + 1) / 2
        for k in range(3):
            seq = hg.seq
            s = torch.full((5,), float(me + 1 + k), dtype=torch.float64)
            on_memory(plan("all_reduce", [s], R.SUM, pg=pg), "Allreduce", s, in_place=True)
            dist.all_reduce(s, group=pg)
            x = torch.full((3,), 3 * me + k, dtype=torch.int32)
            on_memory(plan("all_reduce", [x], R.MAX, pg=pg), "Allreduce", x, in_place=True)
            dist.all_reduce(x, op=R.MAX, group=pg)
            root = k % m
            b = torch.full((4,), me + 10 * k, dtype=torch.int64)
            on_memory(plan("broadcast", [b], root, pg=pg), "Bcast", b)
            dist.broadcast(b, src=tg.ranks[root], group=pg)
            g_in = torch.full((n,), float(me + k), dtype=torch.float64)
            g_out = torch.full((n * m,), -1.0, dtype=torch.float64)
            on_memory(plan("all_gather_into_tensor", g_out, g_in, pg=pg), "Allgather", g_in, g_out)
            dist.all_gather_into_tensor(g_out, g_in, group=pg)
            own = torch.full((n * m,), -1.0, dtype=torch.float64)  # in place: the input is this rank's slot
            own[me * n:(me + 1) * n] = me + k
            on_memory(plan("all_gather_into_tensor", own, own[me * n:(me + 1) * n], pg=pg), "Allgather", own,
                      in_place=True)
            dist.all_gather_into_tensor(own, own[me * n:(me + 1) * n], group=pg)
            rs_in = torch.arange(n * m, dtype=torch.float64) + me + k
            rs_out = torch.empty(n, dtype=torch.float64)
            on_memory(plan("reduce_scatter_tensor", rs_out, rs_in, R.SUM, pg=pg), "Reduce_scatter_block", rs_in,
                      rs_out)
            dist.reduce_scatter_tensor(rs_out, rs_in, group=pg)
            assert hg.seq == seq + 6, (tg.name, k, seq, hg.seq)
            assert torch.equal(s, torch.full((5,), tri + m * k, dtype=torch.float64)), (tg.name, k, s)
            assert torch.equal(x, torch.full((3,), 3 * (m - 1) + k, dtype=torch.int32)), (tg.name, k, x)
            assert torch.equal(b, torch.full((4,), root + 10 * k, dtype=torch.int64)), (tg.name, k, b)
            gathered = (torch.arange(m, dtype=torch.float64) + k).repeat_interleave(n)
            assert torch.equal(g_out, gathered) and torch.equal(own, gathered), (tg.name, k, g_out, own)
            mine = torch.arange(n * m, dtype=torch.float64)[me * n:(me + 1) * n] * m + (tri - m) + m * k
            assert torch.equal(rs_out, mine), (tg.name, k, rs_out, mine)
            assert same_on_all_ranks(torch.cat([s, x.double(), b.double(), g_out, own]), tg.ranks)
        # what cannot run on the user's memory: planned with its copies and steps, the same results
        strided = torch.full((8,), float(me + 1), dtype=torch.float64)[::2]
        e = plan("all_reduce", [strided], R.SUM, pg=pg)
        assert (e.call, e.before, e.after) == ("Allreduce", True, True), e  # copied in, written back
        dist.all_reduce(strided, group=pg)
        assert torch.equal(strided, torch.full((4,), tri, dtype=torch.float64))
        avg = torch.full((2,), float(2 * me), dtype=torch.float64)
        e = plan("all_reduce", [avg], R.AVG, pg=pg)
        assert (e.call, e.before, e.after, e.buffers[0]) == ("Allreduce", False, True, "IN_PLACE"), e  # divided after
        dist.all_reduce(avg, op=R.AVG, group=pg)
        assert torch.equal(avg, torch.full((2,), float(m - 1), dtype=torch.float64))
        asy = torch.full((2,), float(me + 1), dtype=torch.float64)
        e = plan("all_reduce", [asy], R.SUM, pg=pg, async_op=True)
        assert (e.where, e.call) == ("queued", "Allreduce"), e  # the comm thread (the posted form is opt-in)
        dist.all_reduce(asy, group=pg, async_op=True).wait()
        assert torch.equal(asy, torch.full((2,), tri, dtype=torch.float64))
        other = (me + 1) % m  # all_gather's input in another rank's slot: MPI must read a copy
        out2 = torch.arange(n * m, dtype=torch.float64) + 100 * me
        sent = out2[other * n:(other + 1) * n].clone()
        e = plan("all_gather_into_tensor", out2, out2[other * n:(other + 1) * n], pg=pg)
        assert e.before == (m > 1) and (e.buffers[0] == "IN_PLACE") == (m == 1), e  # (one rank: its own slot)
        dist.all_gather_into_tensor(out2, out2[other * n:(other + 1) * n], group=pg)
        slots = [torch.arange(n, dtype=torch.float64) + ((r + 1) % m) * n + 100 * r for r in range(m)]
        assert torch.equal(out2, torch.cat(slots)) and torch.equal(slots[me], sent)
        rs = torch.arange(n * m, dtype=torch.float64) + me  # the output inside the input: staged
        e = plan("reduce_scatter_tensor", rs[me * n:(me + 1) * n], rs, R.SUM, pg=pg)
        assert (e.call, e.before) == ("Reduce_scatter_block", True), e
        dist.reduce_scatter_tensor(rs[me * n:(me + 1) * n], rs, group=pg)
        assert torch.equal(rs[me * n:(me + 1) * n], torch.arange(n * m, dtype=torch.float64)[me * n:(me + 1) * n]
                           * m + (tri - m))
        kept = torch.full((2,), 1.5)
        with pytest.raises(hpccomm.OpTypeError, match=r"ReduceOp\.BAND needs an integer or bool tensor"):
            plan("all_reduce", [kept], R.BAND, pg=pg)
        with pytest.raises(hpccomm.OpTypeError, match=r"ReduceOp\.BAND needs an integer or bool tensor"):
            dist.all_reduce(kept, op=R.BAND, group=pg)
        assert torch.equal(kept, torch.full((2,), 1.5))  # refused before any communication, untouched
