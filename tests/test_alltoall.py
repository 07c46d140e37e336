"""all_to_all_single (even and uneven splits, zero-size splits, multi-dim
tensors split on dim 0, strided and aliased tensors) and all_to_all (lists of
different sizes, outputs as views of one buffer, separate or strided): every
moving dtype × group shape, bit-exact against references each rank computes
itself, the block-datatype path past the MPI count limit, and torch's gloo."""
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


def split(i: int, j: int) -> int:
    """Rows group rank i sends to group rank j: 0, 1 or 2 (zero-size splits from 2 ranks)."""
    return (i + 2 * j + 1) % 3


def sent(i: int, n: int, row_shape, dtype) -> torch.Tensor:
    """Rank i's whole input for the uneven all_to_all_single: its splits for ranks 0..n-1, in order."""
    return data((sum(split(i, j) for j in range(n)), *row_shape), dtype, i)


def received(r: int, n: int, row_shape, dtype) -> torch.Tensor:
    """What rank r must receive: from each rank i, rows [offset of r in i's input, + split(i, r))."""
    parts = []
    for i in range(n):
        start = sum(split(i, j) for j in range(r))
        parts.append(sent(i, n, row_shape, dtype)[start:start + split(i, r)])
    return torch.cat(parts)


@pytest.fixture(scope="module")
def gloo(world):
    """torch's own gloo backend over the whole world, made once on every rank."""
    return dist.new_group(backend="gloo")


# -- all_to_all_single -----------------------------------------------------------

@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=IDS)
def test_all_to_all_single_even(world, groups, dtype):
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, r = g.size, g.rank
        inp = data((n * 2, 3), dtype, r)  # rows 2j, 2j+1 go to rank j
        out = torch.empty(n * 2, 3, dtype=dtype)
        dist.all_to_all_single(out, inp, group=g.pg)
        expected = torch.cat([data((n * 2, 3), dtype, i)[2 * r:2 * r + 2] for i in range(n)])
        check.same(out, expected, f"group {g.name}")
        check.same(inp, data((n * 2, 3), dtype, r), f"group {g.name}: input changed")
    check.done()


@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=IDS)
def test_all_to_all_single_uneven(world, groups, dtype):
    """Split sizes differ per pair, some are zero; 3-D tensors split on dim 0."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, r = g.size, g.rank
        inp = sent(r, n, (2, 3), dtype)
        expected = received(r, n, (2, 3), dtype)
        out = torch.empty_like(expected)
        dist.all_to_all_single(out, inp, output_split_sizes=[split(i, r) for i in range(n)],
                               input_split_sizes=[split(r, j) for j in range(n)], group=g.pg)
        check.same(out, expected, f"group {g.name}")
    check.done()


def test_all_to_all_single_forms(world, groups):
    """Strided input and output (written back), the same tensor as input and
    output, empty tensors, every split zero but one."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, r = g.size, g.rank
        dt = torch.int32
        # strided both sides
        inp = data((3, n * 2), dt, r).t()  # (2n, 3), strided
        obase = torch.zeros(n * 2, 6, dtype=dt)
        out = obase[:, 1::2]
        check.true(not inp.is_contiguous() and not out.is_contiguous(), "the strided tensors are contiguous")
        dist.all_to_all_single(out, inp, group=g.pg)
        strided_expected = torch.cat([data((3, n * 2), dt, i).t()[2 * r:2 * r + 2] for i in range(n)])
        # in place: one tensor is input and output
        both = data((n, 4), torch.float64, r)
        dist.all_to_all_single(both, both, group=g.pg)
        # empty, with and without splits
        empty_out = torch.empty(0, 3)
        dist.all_to_all_single(empty_out, torch.empty(0, 3), group=g.pg)
        dist.all_to_all_single(empty_out, torch.empty(0, 3), [0] * n, [0] * n, group=g.pg)
        # everything goes to the last rank
        last = n - 1
        one_in = data((2, 2), torch.float16, r)
        one_out = torch.zeros(2 * n if r == last else 0, 2, dtype=torch.float16)
        dist.all_to_all_single(one_out, one_in, [2 if r == last else 0] * n,
                               [2 if j == last else 0 for j in range(n)], group=g.pg)
        check.same(out, strided_expected, f"group {g.name}: strided")
        check.true(torch.all(obase[:, ::2] == 0), "all_to_all_single wrote outside the strided output")
        check.same(both, torch.stack([data((n, 4), torch.float64, i)[r] for i in range(n)]), "in place")
        check.true(empty_out.shape == (0, 3), "failed: empty_out.shape == (0, 3)")
        if r == last:
            check.same(one_out, torch.cat([data((2, 2), torch.float16, i) for i in range(n)]), "to the last rank")
        else:
            check.true(one_out.shape == (0, 2), "failed: one_out.shape == (0, 2)")
    check.done()


# -- all_to_all, list form ------------------------------------------------------

@pytest.mark.parametrize("layout", ["separate", "one-buffer", "strided"])
@pytest.mark.parametrize("dtype", MOVE_DTYPES, ids=IDS)
def test_all_to_all(world, groups, dtype, layout):
    """Different sizes per pair (zero included); outputs separate, views of one buffer, or strided."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, r = g.size, g.rank
        ins = [data((split(r, j), 2), dtype, r, j) for j in range(n)]
        if layout == "separate":
            outs = [torch.empty(split(i, r), 2, dtype=dtype) for i in range(n)]
        elif layout == "one-buffer":
            counts = [split(i, r) * 2 for i in range(n)]
            flat = torch.empty(sum(counts), dtype=dtype)
            outs = [p.view(-1, 2) for p in flat.split(counts)]
        else:
            outs = [torch.empty(2, split(i, r), dtype=dtype).t() for i in range(n)]
        dist.all_to_all(outs, ins, group=g.pg)
        for i in range(n):
            check.same(outs[i], data((split(i, r), 2), dtype, i, r), f"group {g.name}: from rank {i}")
        if layout == "one-buffer":
            check.same(flat, torch.cat([data((split(i, r), 2), dtype, i, r).reshape(-1) for i in range(n)]),
                       f"group {g.name}: the buffer under the views")
        for j in range(n):
            check.same(ins[j], data((split(r, j), 2), dtype, r, j), f"group {g.name}: input {j} changed")
    check.done()


def test_all_to_all_forms(world, groups):
    """0-dim tensors, strided inputs, inputs that are views of one buffer."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, r = g.size, g.rank
        outs = [torch.zeros((), dtype=torch.int64) for _ in range(n)]
        dist.all_to_all(outs, [data((), torch.int64, r, j) for j in range(n)], group=g.pg)
        sbase = data((3, 2 * n), torch.uint8, r)
        strided_in = [sbase[:, 2 * j:2 * j + 2] for j in range(n)]
        souts = [torch.empty(3, 2, dtype=torch.uint8) for _ in range(n)]
        dist.all_to_all(souts, strided_in, group=g.pg)
        fbase = data((n * 3,), torch.bfloat16, r)
        fouts = [torch.empty(3, dtype=torch.bfloat16) for _ in range(n)]
        dist.all_to_all(fouts, list(fbase.chunk(n)), group=g.pg)
        same = data((n, 2), torch.complex64, r)
        both = list(same.unbind(0))  # the same tensors are input and output
        dist.all_to_all(both, both, group=g.pg)
        for i in range(n):
            check.same(outs[i], data((), torch.int64, i, r), f"group {g.name}: 0-dim from {i}")
            check.same(souts[i], data((3, 2 * n), torch.uint8, i)[:, 2 * r:2 * r + 2], f"strided from {i}")
            check.same(fouts[i], data((n * 3,), torch.bfloat16, i)[3 * r:3 * r + 3], f"one buffer from {i}")
            check.same(same[i], data((n, 2), torch.complex64, i)[r], f"in place from {i}")
    check.done()


def test_functional_and_async(world, groups):
    """funcol.all_to_all_single (the C++ path DTensor takes), and async_op=True
    Works whose futures hold the outputs."""
    check = Checks()
    for g in groups:
        if not g.member:
            continue
        n, r = g.size, g.rank
        even = funcol.wait_tensor(funcol.all_to_all_single(data((2 * n, 3), torch.float32, r), None, None, g.pg))
        uneven = funcol.wait_tensor(funcol.all_to_all_single(
            sent(r, n, (2,), torch.int8), [split(i, r) for i in range(n)], [split(r, j) for j in range(n)], g.pg))
        out = torch.empty(n, 2, dtype=torch.float64)
        w1 = dist.all_to_all_single(out, data((n, 2), torch.float64, r, 1), group=g.pg, async_op=True)
        outs = [torch.empty(split(i, r), dtype=torch.int32) for i in range(n)]
        w2 = dist.all_to_all(outs, [data((split(r, j),), torch.int32, r, j) for j in range(n)], group=g.pg,
                             async_op=True)
        for w in (w1, w2):
            check.true(w.wait() and work_done(w, g.pg), f"group {g.name}: Work not complete")
        check.true(w1.get_future().value()[0] is out, "failed: w1.get_future().value()[0] is out")
        check.same(even, torch.cat([data((2 * n, 3), torch.float32, i)[2 * r:2 * r + 2] for i in range(n)]),
                   f"group {g.name}: funcol even")
        check.same(uneven, received(r, n, (2,), torch.int8), f"group {g.name}: funcol uneven")
        check.same(out, torch.stack([data((n, 2), torch.float64, i, 1)[r] for i in range(n)]), "async single")
        for i in range(n):
            check.same(outs[i], data((split(i, r),), torch.int32, i, r), f"async list from {i}")
    check.done()


# -- against torch's gloo backend ----------------------------------------------

@pytest.mark.parametrize("dtype", GLOO_DTYPES, ids=lambda d: str(d)[6:])
def test_matches_gloo(world, gloo, dtype):
    """hpccomm and gloo give identical bytes for the same inputs, even and uneven splits."""
    n, r = dist.get_world_size(), dist.get_rank()
    results = {}
    for name, pg in (("hpccomm", dist.group.WORLD), ("gloo", gloo)):
        even = torch.empty(n * 2, 3, dtype=dtype)
        dist.all_to_all_single(even, data((n * 2, 3), dtype, r), group=pg)
        uneven = torch.empty_like(received(r, n, (3,), dtype))
        dist.all_to_all_single(uneven, sent(r, n, (3,), dtype), [split(i, r) for i in range(n)],
                               [split(r, j) for j in range(n)], group=pg)
        results[name] = [even, uneven]
    for i, (a, b) in enumerate(zip(results["hpccomm"], results["gloo"])):
        assert_same(a, b, f"result {i}: hpccomm vs gloo")
    assert_same(results["hpccomm"][1], received(r, n, (3,), dtype), "uneven")  # and both are right


# -- past the MPI count limit --------------------------------------------------

def counts_sent(log):
    """The (send counts, receive counts) each Alltoallv call was given."""
    return [(args[0][1][0], args[1][1][0]) for name, args, _ in log.calls if name == "Alltoallv"]


def test_split_past_count_limit(world):
    """With the count limit lowered to 7, counts and offsets past it are sent
    in blocks of their greatest common divisor (a contiguous datatype)."""
    n, r = dist.get_world_size(), dist.get_rank()
    dt = torch.int64
    with count_limit(7) as log:
        even = torch.empty(n * 2, 4, dtype=dt)  # 8 elements to each rank: blocks of 8
        dist.all_to_all_single(even, data((n * 2, 4), dt, r))
        even_counts = counts_sent(log)
        log.clear()
        row = (8,)  # uneven rows of 8: blocks of 8 (or of 16 when every count is even)
        uneven = torch.empty_like(received(r, n, row, dt))
        dist.all_to_all_single(uneven, sent(r, n, row, dt), [split(i, r) for i in range(n)],
                               [split(r, j) for j in range(n)])
        log.clear()
        outs = [torch.empty(split(i, r), 8, dtype=dt) for i in range(n)]
        dist.all_to_all(outs, [data((split(r, j), 8), dt, r, j) for j in range(n)])
        list_calls = log.names()
    assert_same(even, torch.cat([data((n * 2, 4), dt, i)[2 * r:2 * r + 2] for i in range(n)]), "even")
    assert_same(uneven, received(r, n, row, dt), "uneven")
    for i in range(n):
        assert_same(outs[i], data((split(i, r), 8), dt, i, r), f"list from {i}")
    assert even_counts == [([1] * n, [1] * n)], even_counts
    assert list_calls == ["Alltoallv"]

