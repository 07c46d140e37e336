"""hpccomm.horovod (``import hpccomm.horovod as hvd``): every function, at 1-4 ranks.

Run by tests/run.sh under ``mpirun -n N python -m pytest --with-mpi -m mpi``.
Every expected value is computed by each rank for itself in closed form from
the ranks taking part; failed checks are collected (helpers.Problems) while
the communication goes on, and the verdict is gathered by conftest.  The
unmarked tests at the end run without MPI (import-time behaviour) or launch
their own mpirun job (hvd.init's communicator forms need a fresh process).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hpccomm
import hpccomm.horovod as hvd
from helpers import FakeCudaTensor, Problems, same_on_all_ranks

REPO = Path(__file__).resolve().parent.parent
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INTS = (torch.int32, torch.int64)
OPS = (hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product)


@pytest.fixture(scope="module")
def h(world):
    """Horovod initialised on the test session's hpccomm world (dynamic process sets)."""
    hvd.init(process_sets="dynamic")
    yield hvd
    hvd.shutdown()


def values(r: int, n: int = 4, dtype=torch.float32):
    """Rank r's input: r+1 + k (k = 0..n-1), exact in every dtype here."""
    return (torch.arange(n, dtype=torch.float64) + r + 1).to(dtype)


def reduce_reference(ranks, op, dtype, pre=1.0, post=1.0, n=4):
    """Horovod's result for ``values(r)`` over ``ranks``: scaled inputs, the
    reduction, then the scale (÷ size for Average); integers truncated after
    each scaling, as Horovod's double-precision scaling does."""
    def scale(t, f):
        return t * f if dtype.is_floating_point else torch.trunc(t * f)

    xs = [scale(values(r, n, torch.float64), pre) for r in ranks]
    if op in (hvd.Average, hvd.Sum):
        out = sum(xs)
    elif op == hvd.Min:
        out = torch.stack(xs).min(0).values
    elif op == hvd.Max:
        out = torch.stack(xs).max(0).values
    else:
        out = torch.stack(xs).prod(0)
    factor = post / len(ranks) if op == hvd.Average else post
    return scale(out, factor)


def close(actual, expected, dtype, terms=4):
    if not dtype.is_floating_point:
        return torch.equal(actual, expected.to(dtype))
    eps = {torch.float16: 2 ** -10, torch.bfloat16: 2 ** -7, torch.float32: 2 ** -23, torch.float64: 2 ** -52}[dtype]
    return torch.allclose(actual.double(), expected.double(), rtol=eps * 4 * terms, atol=0)


def raised(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the caller checks it
        return exc
    return None


# -- basics -----------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_rank_queries(h):
    p = Problems()
    n, r = dist.get_world_size(), dist.get_rank()
    p.expect(hvd.is_initialized() and hvd.size() == n and hvd.rank() == r, (hvd.size(), hvd.rank()))
    p.expect(hvd.local_rank() == hpccomm.local_rank() and hvd.local_size() == hpccomm.local_size(),
             (hvd.local_rank(), hvd.local_size()))
    p.expect(0 <= hvd.local_rank() < hvd.local_size() <= n, "local rank out of range")
    p.expect(hvd.cross_size() == 1 and hvd.cross_rank() == 0, (hvd.cross_size(), hvd.cross_rank()))  # one node
    p.expect(hvd.is_homogeneous() is True, "one node is homogeneous")
    p.expect(hvd.mpi_enabled() and hvd.mpi_built() and not hvd.gloo_enabled() and not hvd.gloo_built(), "flags")
    p.expect(hvd.cuda_built() == (torch.version.cuda is not None), "cuda_built")
    p.expect(hvd.nccl_built() == 0 or torch.version.cuda is not None, "nccl_built on a CPU build")
    p.expect(not hvd.ddl_built() and not hvd.ccl_built(), "ddl/ccl")
    p.expect(isinstance(hvd.mpi_threads_supported(), bool), "mpi_threads_supported")
    every = [None] * n
    dist.all_gather_object(every, (hvd.local_rank(), hvd.local_size()))
    p.expect(sorted(lr for lr, _ in every) == list(range(n)) and {ls for _, ls in every} == {n}, every)
    hvd.init()  # a second init does nothing
    p.expect(hvd.size() == n, "second init changed the size")
    p.verdict()


# -- allreduce ------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_allreduce_every_op_dtype_and_form(h):
    """allreduce / allreduce_ / allreduce_async / allreduce_async_ for every
    op and dtype, with and without scale factors."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    ranks = list(range(n))
    for dtype in FLOATS + INTS:
        for op in OPS:
            for pre, post in ((1.0, 1.0), (0.5, 3.0)):
                if op == hvd.Product and pre != 1.0 and not dtype.is_floating_point:
                    continue  # 0.5 * int truncates to 0 for the first rank: a product of zeros proves little
                expected = reduce_reference(ranks, op, dtype, pre, post)
                x = values(r, dtype=dtype)
                before = x.clone()
                got = hvd.allreduce(x, op=op, prescale_factor=pre, postscale_factor=post)
                p.expect(close(got, expected, dtype, n) and got.dtype == dtype, f"allreduce {dtype} {op}: {got}")
                p.expect(torch.equal(x, before), f"allreduce changed its input ({dtype}, {op})")
                y = values(r, dtype=dtype)
                same = hvd.allreduce_(y, op=op, prescale_factor=pre, postscale_factor=post)
                p.expect(same is y and close(y, expected, dtype, n), f"allreduce_ {dtype} {op}: {y}")
                h1 = hvd.allreduce_async(x, op=op, prescale_factor=pre, postscale_factor=post)
                z = values(r, dtype=dtype)
                h2 = hvd.allreduce_async_(z, op=op, prescale_factor=pre, postscale_factor=post)
                p.expect(isinstance(h1, int) and isinstance(h2, int) and h1 != h2, (h1, h2))
                out2 = hvd.synchronize(h2)
                p.expect(hvd.poll(h1) in (True, False), "poll")
                out1 = hvd.synchronize(h1)
                p.expect(close(out1, expected, dtype, n) and torch.equal(x, before), f"allreduce_async {dtype}")
                p.expect(out2 is z and close(z, expected, dtype, n), f"allreduce_async_ {dtype}")
                p.expect(same_on_all_ranks(got), f"allreduce {dtype} {op} differs between ranks")
    p.verdict()


@pytest.mark.mpi
def test_allreduce_integer_average_truncates_like_horovod(h):
    """Average of integers: the sum times 1/size in double precision,
    truncated toward zero (Horovod's scaling), so 1/size rounding shows."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    x = torch.tensor([r - 1, 7, -(r + 2)], dtype=torch.int64)
    got = hvd.allreduce(x)
    sums = [sum(v) for v in zip(*[[q - 1, 7, -(q + 2)] for q in range(n)])]
    expected = torch.tensor([int(s * (1.0 / n)) for s in sums], dtype=torch.int64)  # int() truncates toward zero
    p.expect(torch.equal(got, expected), f"{got} != {expected}")
    p.verdict()


@pytest.mark.mpi
def test_allreduce_defaults_average_and_the_deprecated_average_flag(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    p.expect(torch.equal(hvd.allreduce(values(r, dtype=torch.float64)),
                         reduce_reference(range(n), hvd.Average, torch.float64)), "default op is not Average")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        summed = hvd.allreduce(values(r, dtype=torch.float64), average=False)
    p.expect(torch.equal(summed, reduce_reference(range(n), hvd.Sum, torch.float64)), "average=False is Sum")
    p.expect(any(issubclass(w.category, DeprecationWarning) and "replaced with `op`" in str(w.message)
                 for w in caught), [str(w.message) for w in caught])
    strided = values(r, 8, torch.float64).view(4, 2)
    column = strided[:, 1]  # not contiguous: Horovod refused it; here the result lands in the view
    hvd.allreduce_(column, op=hvd.Sum)
    p.expect(torch.equal(column, reduce_reference(range(n), hvd.Sum, torch.float64, n=8).view(4, 2)[:, 1])
             and torch.equal(strided[:, 0], values(r, 8, torch.float64).view(4, 2)[:, 0]), strided)
    exc = raised(lambda: hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum))
    p.expect(isinstance(exc, ValueError) and "The op parameter supersedes average" in str(exc), exc)
    p.verdict()


@pytest.mark.mpi
def test_grouped_allreduce_all_forms(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    dtypes = (torch.float32, torch.float64, torch.int32, torch.float32)
    ins = [values(r, 3 + i, d) for i, d in enumerate(dtypes)]
    keep = [t.clone() for t in ins]
    expect = [reduce_reference(range(n), hvd.Sum, d, 2.0, 0.5, 3 + i) for i, d in enumerate(dtypes)]
    outs = hvd.grouped_allreduce(ins, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    p.expect(isinstance(outs, list) and all(close(o, e, d, n) for o, e, d in zip(outs, expect, dtypes)), outs)
    p.expect(all(torch.equal(a, b) for a, b in zip(ins, keep)), "grouped_allreduce changed its inputs")
    avg = [reduce_reference(range(n), hvd.Average, d, n=3 + i) for i, d in enumerate(dtypes)]
    res = hvd.grouped_allreduce_(ins)
    p.expect(isinstance(res, tuple) and all(a is b for a, b in zip(res, ins)), "grouped_allreduce_ returns the inputs")
    p.expect(all(close(o, e, d, n) for o, e, d in zip(ins, avg, dtypes)), ins)
    fresh = [values(r, 3 + i, d) for i, d in enumerate(dtypes)]
    h1 = hvd.grouped_allreduce_async(fresh, op=hvd.Max)
    h2 = hvd.grouped_allreduce_async_(fresh, op=hvd.Min)
    mins = hvd.synchronize(h2)
    maxs = hvd.synchronize(h1)
    p.expect(all(close(o, reduce_reference(range(n), hvd.Max, d, n=3 + i), d, n)
                 for i, (o, d) in enumerate(zip(maxs, dtypes))), maxs)
    p.expect(all(o is f and close(o, reduce_reference(range(n), hvd.Min, d, n=3 + i), d, n)
                 for i, (o, f, d) in enumerate(zip(mins, fresh, dtypes))), mins)
    p.verdict()


@pytest.mark.mpi
def test_allreduce_fp16_compression_and_autograd(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    x = values(r, dtype=torch.float32)
    got = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
    p.expect(got.dtype == torch.float32 and torch.equal(got, reduce_reference(range(n), hvd.Sum, torch.float32).float()),
             got)
    ints = hvd.allreduce(torch.ones(2, dtype=torch.int32), op=hvd.Sum, compression=hvd.Compression.fp16)
    p.expect(ints.dtype == torch.int32 and ints.tolist() == [n, n], ints)
    grouped = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum, compression=hvd.Compression.fp16)
    p.expect(all(g.dtype == torch.float32 for g in grouped) and torch.equal(grouped[1], 2 * grouped[0]), grouped)
    leaf = torch.full((3,), float(r + 1), requires_grad=True)
    (hvd.allreduce(leaf, op=hvd.Sum) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    p.expect(leaf.grad is not None and leaf.grad.tolist() == [float(n), 2.0 * n, 3.0 * n], leaf.grad)
    a = torch.ones(2, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    outs = hvd.grouped_allreduce([a, b])
    (outs[0].sum() + 2 * outs[1].sum()).backward()
    p.expect(a.grad.tolist() == [1.0, 1.0] and b.grad.tolist() == [2.0] * 3, (a.grad, b.grad))
    p.verdict()


# -- allgather -------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_allgather_different_first_dimensions(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    for dtype in FLOATS + INTS + (torch.uint8, torch.int8, torch.int16, torch.bool):
        mine = torch.full((r + 1, 2), r % 2 if dtype == torch.bool else r + 1).to(dtype)
        expected = torch.cat([torch.full((q + 1, 2), q % 2 if dtype == torch.bool else q + 1).to(dtype)
                              for q in range(n)])
        got = hvd.allgather(mine)
        p.expect(torch.equal(got, expected), f"allgather {dtype}: {got}")
        got2 = hvd.synchronize(hvd.allgather_async(mine))
        p.expect(torch.equal(got2, expected), f"allgather_async {dtype}")
    empty = hvd.allgather(torch.zeros((0 if r == 0 else 1, 3)))
    p.expect(empty.shape == (n - 1, 3), f"a rank with zero rows: {empty.shape}")
    xs, ys = hvd.grouped_allgather([torch.full((r + 1,), float(r)), torch.full((1, 2), r, dtype=torch.int64)])
    p.expect(torch.equal(xs, torch.cat([torch.full((q + 1,), float(q)) for q in range(n)])), xs)
    p.expect(torch.equal(ys, torch.arange(n).repeat_interleave(2).view(n, 2)), ys)
    xs2, ys2 = hvd.synchronize(hvd.grouped_allgather_async([torch.full((r + 1,), float(r)), torch.ones(1, 1)]))
    p.expect(torch.equal(xs2, xs) and ys2.shape == (n, 1), (xs2, ys2))
    leaf = torch.ones(r + 1, 2, requires_grad=True)
    weights = torch.arange(sum(q + 1 for q in range(n)) * 2, dtype=torch.float32).view(-1, 2)
    (hvd.allgather(leaf) * weights).sum().backward()
    offset = sum(q + 1 for q in range(r))
    p.expect(torch.equal(leaf.grad, weights[offset:offset + r + 1]), f"allgather gradient {leaf.grad}")
    p.verdict()


# -- broadcast ---------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_broadcast_every_root_and_form(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    for root in range(n):
        for dtype in (torch.float32, torch.float16, torch.int64, torch.bool, torch.uint8):
            mine = torch.full((2, 3), (r + 1) % 2 if dtype == torch.bool else r + 5).to(dtype)
            theirs = torch.full((2, 3), (root + 1) % 2 if dtype == torch.bool else root + 5).to(dtype)
            before = mine.clone()
            got = hvd.broadcast(mine, root_rank=root)
            p.expect(torch.equal(got, theirs) and torch.equal(mine, before), f"broadcast {root} {dtype}")
            got = hvd.synchronize(hvd.broadcast_async(mine, root))
            p.expect(torch.equal(got, theirs) and torch.equal(mine, before), f"broadcast_async {root} {dtype}")
            out = hvd.broadcast_(mine, root)
            p.expect(out is mine and torch.equal(mine, theirs), f"broadcast_ {root} {dtype}")
            other = before.clone()
            hvd.synchronize(hvd.broadcast_async_(other, root))
            p.expect(torch.equal(other, theirs), f"broadcast_async_ {root} {dtype}")
    leaf = torch.ones(2, requires_grad=True)
    hvd.broadcast(leaf, root_rank=n - 1).sum().backward()
    p.expect(leaf.grad.tolist() == ([1.0, 1.0] if r == n - 1 else [0.0, 0.0]), f"broadcast gradient {leaf.grad}")
    p.verdict()


# -- alltoall -------------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_alltoall_even_uneven_and_received_splits(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    # no splits: 2 rows per destination; row value = 100*sender + destination
    t = torch.tensor([[100 * r + d] for d in range(n) for _ in range(2)], dtype=torch.float32)
    got = hvd.alltoall(t)
    p.expect(isinstance(got, torch.Tensor), f"alltoall without splits returns a tensor, not {type(got)}")
    p.expect(torch.equal(got, torch.tensor([[100 * s + r] for s in range(n) for _ in range(2)], dtype=torch.float32)),
             got)
    # splits: sender s sends (s + d) % 3 rows to d, then 2 spare rows that are not sent
    splits = [(r + d) % 3 for d in range(n)]
    rows = [[100 * r + d] for d in range(n) for _ in range(splits[d])] + [[-1], [-1]]
    tensor = torch.tensor(rows, dtype=torch.int64)
    for form in ("list", "tensor", "async"):
        s = torch.tensor(splits, dtype=torch.int32) if form == "tensor" else splits
        if form == "async":
            out, received = hvd.synchronize(hvd.alltoall_async(tensor, splits=s))
        else:
            out, received = hvd.alltoall(tensor, splits=s)
        expect_recv = [(q + r) % 3 for q in range(n)]
        p.expect(received.dtype == torch.int32 and received.tolist() == expect_recv, f"{form}: {received}")
        p.expect(torch.equal(out, torch.tensor([[100 * q + r] for q in range(n) for _ in range(expect_recv[q])],
                                               dtype=torch.int64).view(-1, 1)), f"{form}: {out}")
    leaf = torch.ones(n, 2, requires_grad=True)
    (hvd.alltoall(leaf) * (r + 1)).sum().backward()
    p.expect(torch.equal(leaf.grad, torch.arange(1, n + 1, dtype=torch.float32)[:, None].expand(n, 2)),
             f"alltoall gradient {leaf.grad}")
    p.verdict()


# -- reducescatter ---------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_reducescatter_uneven_rows_ops_and_grouped(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    for rows in (2 * n, 2 * n + 1, n + n - 1):
        q, extra = divmod(rows, n)
        mine_rows = q + 1 if r < extra else q       # Horovod: the first rows % n ranks get one more
        start = sum(q + 1 if i < extra else q for i in range(r))
        for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.float16):
            full = [torch.arange(rows * 2, dtype=torch.float64).view(rows, 2) + k for k in range(n)]
            x = full[r].to(dtype)
            total = sum(full)
            for op in (hvd.Sum, hvd.Average):
                got = hvd.reducescatter(x, op=op, prescale_factor=1.0, postscale_factor=2.0)
                ref = total * (2.0 / n if op == hvd.Average else 2.0)
                ref = ref if dtype.is_floating_point else torch.trunc(ref)
                p.expect(got.shape == (mine_rows, 2) and close(got, ref[start:start + mine_rows], dtype, n),
                         f"reducescatter rows={rows} {dtype} {op}: {got}")
            got = hvd.synchronize(hvd.reducescatter_async(x, op=hvd.Sum))
            p.expect(close(got, total[start:start + mine_rows], dtype, n), f"reducescatter_async {dtype}")
    a = torch.ones(n + 1, 3) * (r + 1)
    b = torch.ones(2 * n, dtype=torch.float64)
    ga, gb = hvd.grouped_reducescatter([a, b], op=hvd.Sum)
    p.expect(ga.shape[0] == (2 if r == 0 else 1) and torch.all(ga == n * (n + 1) / 2).item(), ga)
    p.expect(gb.shape == (2,) and torch.all(gb == n).item(), gb)
    ha, hb = hvd.synchronize(hvd.grouped_reducescatter_async([a, b]))
    p.expect(torch.allclose(ha, torch.full_like(ha, (n + 1) / 2)) and torch.all(hb == 1).item(), (ha, hb))
    c16 = hvd.reducescatter(torch.ones(n, 2), op=hvd.Sum, compression=hvd.Compression.fp16)
    p.expect(c16.dtype == torch.float32 and torch.all(c16 == n).item(), c16)
    leaf = torch.ones(n, 2, requires_grad=True)
    hvd.reducescatter(leaf, op=hvd.Sum).sum().backward()
    p.expect(torch.all(leaf.grad == n).item(), f"reducescatter gradient (Horovod scales Sum by size): {leaf.grad}")
    exc = raised(lambda: hvd.reducescatter(torch.ones(n), op=hvd.Max))
    p.expect(isinstance(exc, ValueError) and "Reducescatter currently only supports AVERAGE and SUM" in str(exc), exc)
    p.verdict()


# -- objects and parameters --------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_objects(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    for root in range(n):
        got = hvd.broadcast_object({"from": r, "list": list(range(r + 1))}, root_rank=root)
        p.expect(got == {"from": root, "list": list(range(root + 1))}, got)
    p.expect(hvd.allgather_object(("rank", r) * (r + 1)) == [("rank", q) * (q + 1) for q in range(n)], "allgather_object")
    p.verdict()


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))


@pytest.mark.mpi
def test_broadcast_parameters_and_optimizer_state(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    root = n - 1
    ref = _model(100 + root)
    model = _model(100 + r)
    hvd.broadcast_parameters(model.state_dict(), root_rank=root)
    p.expect(all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values())),
             "state_dict broadcast")
    model = _model(100 + r)
    hvd.broadcast_parameters(list(model.named_parameters()), root_rank=root)
    p.expect(all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())), "named_parameters")
    model = _model(100 + r)
    hvd.broadcast_parameters(list(model.parameters()), root_rank=root)
    p.expect(all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())), "parameters")
    exc = raised(lambda: hvd.broadcast_parameters(model.parameters(), root_rank=0))
    p.expect(isinstance(exc, ValueError) and "invalid params of type: <class 'generator'>" in str(exc), exc)
    for make in (lambda ps: torch.optim.SGD(ps, lr=0.1 * (r + 1), momentum=0.5 + 0.1 * r),
                 lambda ps: torch.optim.Adam(ps, lr=0.01 * (r + 1), betas=(0.8 + 0.01 * r, 0.99))):
        model = _model(7)
        opt = make(model.parameters())
        if r != root:  # a rank-specific state, so the broadcast has something to overwrite
            model(torch.randn(5, 3)).sum().backward()
            opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=root)
        groups = hvd.allgather_object({k: v for k, v in opt.param_groups[0].items() if k != "params"})
        p.expect(all(g == groups[root] for g in groups), f"param_groups differ: {groups}")
        state = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
        p.expect(len(state) > 0 and all(same_on_all_ranks(t) for t in state), f"{type(opt).__name__} state differs")
    exc = raised(lambda: hvd.broadcast_optimizer_state(torch.optim.LBFGS(model.parameters()), root_rank=0))
    p.expect(isinstance(exc, ValueError) and str(exc) == "cannot broadcast torch.optim.LBFGS state", exc)
    p.verdict()


# -- DistributedOptimizer --------------------------------------------------------------------------------------

class Linear2(torch.nn.Module):
    """Two parameters whose gradients are chosen by the caller: loss = w·a + b·c."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))
        self.b = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))

    def forward(self, a, c):
        return (self.w * a).sum() + (self.b * c).sum()


def grads_of(r):
    return torch.tensor([1.0, 2.0, 3.0]) * (r + 1), torch.tensor([r + 0.5, -1.0], dtype=torch.float64)


@pytest.mark.mpi
def test_distributed_optimizer_averages_in_closed_form(h):
    """One SGD step (lr 1) moves each parameter by minus the averaged gradient;
    variants: Sum, predivide, fp16, groups (int and list), process set."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    mean_a = sum(grads_of(q)[0] for q in range(n)) / n
    mean_c = sum(grads_of(q)[1] for q in range(n)) / n
    variants = [dict(), dict(op=hvd.Sum), dict(gradient_predivide_factor=2.0),
                dict(compression=hvd.Compression.fp16), dict(groups=1), dict(groups=2), dict(groups="list")]
    for kw in variants:
        model = Linear2()
        if kw.get("groups") == "list":
            kw = dict(groups=[[model.w, model.b]])
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                       named_parameters=model.named_parameters(), **kw)
        p.expect(isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD", type(opt))
        a, c = grads_of(r)
        model(a, c).backward()
        opt.step()
        scale = n if kw.get("op") == hvd.Sum else 1
        p.expect(torch.allclose(model.w.detach(), -mean_a * scale, rtol=1e-3 if "compression" in kw else 1e-6),
                 f"{kw}: w {model.w.detach()} vs {-mean_a * scale}")
        p.expect(torch.allclose(model.b.detach(), -mean_c * scale, rtol=1e-3 if "compression" in kw else 1e-12),
                 f"{kw}: b {model.b.detach()}")
        p.expect(model.b.dtype == torch.float64, "the float64 parameter changed dtype")
    p.verdict()


@pytest.mark.mpi
def test_distributed_optimizer_accumulation_synchronize_and_errors(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    mean_a = sum(grads_of(q)[0] for q in range(n)) / n
    model = Linear2()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=2)
    a, c = grads_of(r)
    model(a, c).backward()
    model(a, c).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # what synchronize() is for
    with opt.skip_synchronize():
        opt.step()
    p.expect(torch.allclose(model.w.detach(), -2 * mean_a), f"two accumulated passes: {model.w.detach()}")
    opt.zero_grad()
    model(a, c).backward()
    model(a, c).backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    p.expect(any("optimizer.step() called without optimizer.skip_synchronize()" in str(w.message) for w in caught),
             [str(w.message) for w in caught])
    # zero_grad between backward and step (hooks exist only at size > 1, as in Horovod: at size 1 it just zeroes)
    model = Linear2()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters())
    model(a, c).backward()
    exc = raised(opt.zero_grad)
    if n > 1:
        p.expect(isinstance(exc, AssertionError) and "optimizer.zero_grad() was called after loss.backward()"
                 in str(exc), exc)
        opt.synchronize()
    else:
        p.expect(exc is None and model.w.grad is None, f"size 1: zero_grad {exc!r}")
    # more backward passes than backward_passes_per_step (hooks exist only at size > 1, as in Horovod)
    model = Linear2()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters())
    model(a, c).backward()
    exc = raised(lambda: model(a, c).backward())
    p.expect(n == 1 or (isinstance(exc, AssertionError) and "Gradients were computed more than "
                        "backward_passes_per_step times" in str(exc)), exc)
    opt.synchronize()
    # a parameter without a gradient on some ranks is reduced as zeros
    model = Linear2()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters())
    ((model.w * a).sum() + ((model.b * grads_of(r)[1]).sum() if r % 2 == 0 else 0)).backward()
    opt.step()
    evens = [q for q in range(n) if q % 2 == 0]
    p.expect(torch.allclose(model.b.detach(), -sum(grads_of(q)[1] for q in evens) / n), f"b {model.b.detach()}")
    # state_dict round trip resets the reduction state
    opt.load_state_dict(opt.state_dict())
    for bad, text, kind in (
            (dict(backward_passes_per_step=0), "backward_passes_per_step must be > 0", ValueError),
            (dict(op=hvd.Sum, gradient_predivide_factor=2.0), "gradient_predivide_factor not supported with op != "
             "Average", ValueError),
            (dict(op=hvd.Adasum), "op=hvd.Adasum is not supported", NotImplementedError),
            (dict(named_parameters=[("w", model.w)]), "one or more model parameters were not named", ValueError),
            (dict(named_parameters=[("x", model.w), ("x", model.b)]), "must be unique. Found duplicates: x",
             ValueError),
            (dict(named_parameters=[model.w, model.b]), "named_parameters should be a sequence of tuples",
             ValueError),
            (dict(groups=[[model.w, model.w]]), "A parameter can only appear once in groups.", ValueError),
            (dict(groups=[["w"]]), "groups must consist of torch.Tensor.", ValueError),
            (dict(groups=0), "groups should be a non-negative integer or a list of list of torch.Tensor.",
             ValueError)):
        exc = raised(lambda: hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), **bad))
        p.expect(isinstance(exc, kind) and text in str(exc), f"{bad}: {exc!r}")
    p.verdict()


@pytest.mark.mpi
def test_distributed_optimizer_sparse_gradients(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    for sparse_as_dense in (False, True):
        emb = torch.nn.Embedding(4, 2, sparse=True)
        torch.nn.init.zeros_(emb.weight)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                       named_parameters=emb.named_parameters(), sparse_as_dense=sparse_as_dense)
        emb(torch.tensor([r % 4])).sum().backward()
        opt.step()
        expected = torch.zeros(4, 2)
        for q in range(n):
            expected[q % 4] -= 1.0 / n
        p.expect(torch.allclose(emb.weight.detach(), expected), f"sparse_as_dense={sparse_as_dense}: {emb.weight}")
    p.verdict()


#: Horovod's warning (horovod/torch/optimizer.py, _DistributedOptimizer.step)
HOROVOD_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize(). This can "
    "cause training slowdown. You may want to consider using optimizer.skip_synchronize() context if you use "
    "optimizer.synchronize() in your code.")


def warned(call) -> list:
    """``(category, message)`` of every warning ``call()`` issued."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        call()
    return [(w.category, str(w.message)) for w in caught]


@pytest.mark.mpi
def test_step_after_synchronize_warns_as_horovod(h):
    """``synchronize()`` then ``step()`` outside ``skip_synchronize()``: one
    UserWarning with Horovod's words, and the gradients are reduced again (as
    in Horovod: an Average stays the average, a Sum is summed twice). No
    warning inside ``skip_synchronize()``, for a step without ``synchronize()``,
    or after ``load_state_dict`` (Horovod's clears the flag)."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    a, c = grads_of(r)
    sum_a = sum(grads_of(q)[0] for q in range(n))
    for op, reduced_twice in ((hvd.Average, sum_a / n), (hvd.Sum, n * sum_a)):
        model = Linear2()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), op=op,
                                       named_parameters=model.named_parameters())
        model(a, c).backward()
        opt.synchronize()
        got = warned(opt.step)
        p.expect(got == [(UserWarning, HOROVOD_STEP_AFTER_SYNCHRONIZE)], f"op {op}: synchronize, step: {got}")
        p.expect(torch.allclose(model.w.detach(), -reduced_twice), f"op {op}: w {model.w.detach()}")
        opt.zero_grad()
        model(a, c).backward()
        got = warned(opt.step)
        p.expect(got == [], f"op {op}: a step without synchronize warned: {got}")
        opt.zero_grad()
        model(a, c).backward()
        opt.synchronize()
        with opt.skip_synchronize():
            got = warned(opt.step)
        p.expect(got == [], f"op {op}: a step inside skip_synchronize warned: {got}")
        opt.zero_grad()
        model(a, c).backward()
        opt.synchronize()
        opt.load_state_dict(opt.state_dict())
        got = warned(opt.step)
        p.expect(got == [], f"op {op}: a step after synchronize and load_state_dict warned: {got}")
    p.verdict()


@pytest.mark.mpi
def test_parameter_names_as_horovod(h):
    """``optimizer._parameter_names`` is Horovod's ``{parameter: name}``,
    sorted by name; without ``named_parameters`` the names are
    ``allreduce.noname.<group>.<index>``: unique, and the same on every rank.
    They name the optimizer's sparse reductions, as in Horovod."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD([{"params": model[0].parameters()},
                                                    {"params": model[1].parameters(), "lr": 0.5}], lr=0.1))
    names = opt._parameter_names
    expected = [(model[0].weight, "allreduce.noname.0.0"), (model[0].bias, "allreduce.noname.0.1"),
                (model[1].weight, "allreduce.noname.1.0"), (model[1].bias, "allreduce.noname.1.1")]
    p.expect(isinstance(names, dict) and [(id(k), v) for k, v in names.items()] == [(id(k), v) for k, v in expected],
             f"without named_parameters: {list(names.values())}")
    everyone = hvd.allgather_object(list(names.values()))
    p.expect(len(everyone) == n and all(e == everyone[0] for e in everyone) and len(set(everyone[0])) == 4, everyone)
    named = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=reversed(list(model.named_parameters())))
    p.expect([(id(k), v) for k, v in named._parameter_names.items()] ==
             [(id(q), k) for k, q in sorted(model.named_parameters(), key=lambda kq: kq[0])],
             f"with named_parameters: {list(named._parameter_names.values())}")
    # the sparse gradient of an unnamed optimizer is reduced under its generated name
    emb = torch.nn.Embedding(4, 2, sparse=True)
    sparse_opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0))
    p.expect(list(sparse_opt._parameter_names.values()) == ["allreduce.noname.0.0"], sparse_opt._parameter_names)
    emb(torch.tensor([r % 4])).sum().backward()
    got = outcome(lambda: hvd.allgather_async(torch.tensor([r]), name="allreduce.noname.0.0.indices"))
    # hooks (so reductions during backward) exist at size > 1 only, as in Horovod; at size 1 step() reduces
    p.expect(isinstance(got, ValueError) and "Tensor name 'allgather.allreduce.noname.0.0.indices' is held" in str(got)
             if n > 1 else equal(got, [torch.arange(n)]), f"an allgather named like the reduction in flight: {got!r}")
    sparse_opt.step()
    p.expect(torch.equal(hvd.allgather(torch.tensor([r]), name="allreduce.noname.0.0.indices"), torch.arange(n)),
             "the name after step")
    # load_state_dict in the middle of a step forgets its reductions (as Horovod does) and frees their names
    sparse_opt.zero_grad()
    emb(torch.tensor([r % 4])).sum().backward()
    sparse_opt.load_state_dict(sparse_opt.state_dict())
    sparse_opt.zero_grad()
    emb(torch.tensor([r % 4])).sum().backward()
    before = emb.weight.detach().clone()
    exc = raised(sparse_opt.step)
    moved = torch.zeros(4, 2)
    for q in range(n):
        moved[q % 4] -= 1.0 / n
    p.expect(exc is None and torch.allclose(emb.weight.detach() - before, moved), f"the step after load_state_dict: "
             f"{exc!r}, moved {emb.weight.detach() - before}")
    p.verdict()


@pytest.mark.mpi
def test_a_process_set_duplicating_the_global_set_is_refused(h):
    exc = raised(lambda: hvd.add_process_set(list(range(hvd.size()))))
    assert isinstance(exc, ValueError) and "Attempted to add a duplicate process set" in str(exc), exc


@pytest.mark.mpi(min_size=2)
def test_process_sets(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    evens = hvd.add_process_set(hvd.ProcessSet(range(0, n, 2)))
    last = hvd.add_process_set([n - 1])
    p.expect(evens.size() == len(range(0, n, 2)) and evens.included() == (r % 2 == 0), str(evens))
    p.expect(hvd.global_process_set.size() == n and hvd.global_process_set.rank() == r, "global set")
    if evens.included():
        members = list(range(0, n, 2))
        p.expect(evens.rank() == members.index(r), evens.rank())
        got = hvd.allreduce(values(r), op=hvd.Sum, process_set=evens)
        p.expect(torch.equal(got, reduce_reference(members, hvd.Sum, torch.float32)), got)
        b = hvd.broadcast(torch.tensor([float(r)]), root_rank=members[-1], process_set=evens)
        p.expect(b.item() == members[-1], b)
        g = hvd.allgather(torch.tensor([r]), process_set=evens)
        p.expect(g.tolist() == members, g)
        model = Linear2()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), process_set=evens,
                                       named_parameters=model.named_parameters())
        model(*grads_of(r)).backward()
        opt.step()
        p.expect(torch.allclose(model.w.detach(), -sum(grads_of(q)[0] for q in members) / len(members)), model.w)
        exc = raised(lambda: hvd.broadcast(torch.ones(1), root_rank=1, process_set=evens))
        p.expect(n == 1 or (isinstance(exc, ValueError) and "invalid root rank 1 for the provided process set" in
                            str(exc)), exc)
    else:
        exc = raised(lambda: hvd.allreduce(torch.ones(1), process_set=evens))
        p.expect(isinstance(exc, ValueError) and f"rank {r} is not a member of the provided process set" in str(exc),
                 exc)
        exc = raised(evens.rank)
        p.expect(isinstance(exc, ValueError) and "Process is not part of provided process set." in str(exc), exc)
    if last.included():
        p.expect(hvd.allreduce(torch.ones(2), process_set=last).tolist() == [1.0, 1.0], "singleton set")
    exc = raised(lambda: hvd.add_process_set(list(range(0, n, 2))))
    p.expect(isinstance(exc, ValueError) and "Attempted to add a duplicate process set" in str(exc), exc)
    p.expect(hvd.remove_process_set(evens) is True and evens.process_set_id is None, "remove")
    p.expect(hvd.remove_process_set(evens) is False and hvd.remove_process_set(hvd.global_process_set) is False, "again")
    exc = raised(lambda: hvd.allreduce(torch.ones(1), process_set=evens))
    p.expect(isinstance(exc, ValueError) and "has not been registered" in str(exc), exc)
    p.expect(hvd.remove_process_set(last), "remove last")
    p.verdict()


# -- barrier, join, handles -------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_barrier_poll_and_synchronize(h):
    p = Problems()
    hvd.barrier()
    handle = hvd.allreduce_async(torch.ones(3))
    hvd.synchronize(handle)
    exc = raised(lambda: hvd.poll(handle))
    p.expect(isinstance(exc, ValueError) and f"Handle {handle} was not created or has been cleared." == str(exc), exc)
    p.expect(hvd.synchronize(handle) is None, "synchronize of a cleared handle returns None")
    fresh = hvd.allreduce_async(torch.ones(3))
    result = hvd.synchronize(fresh)
    p.expect(result.tolist() == [1.0, 1.0, 1.0], result)
    p.verdict()


@pytest.mark.mpi
def test_join_with_allreduce_and_optimizer(h):
    """Rank q does q+1 training steps, then joins: the ranks still training
    see zeros from the joined ones (an Average still divides by the full
    size); join returns the last rank to join, on every rank."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    model = Linear2()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), named_parameters=model.named_parameters())
    sums = []
    for step in range(r + 1):
        sums.append(hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum).item())
        opt.zero_grad()
        model(*grads_of(r)).backward()
        opt.step()
    last = hvd.join()
    p.expect(last == n - 1, f"join returned {last}")
    p.expect(sums == [float(sum(q + 1 for q in range(k, n))) for k in range(r + 1)], f"sums with joined ranks: {sums}")
    # step k averages the gradients of the ranks still training (q >= k) over all n ranks;
    # a rank that joined stops stepping (as in Horovod: its weights stay where it left them)
    expected_w = -sum(sum(grads_of(q)[0] for q in range(k, n)) / n for k in range(r + 1))
    p.expect(torch.allclose(model.w.detach(), expected_w), f"w {model.w.detach()} vs {expected_w}")
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    p.expect(same_on_all_ranks(model.w.detach()), "weights differ after the broadcast from the last rank")
    # ops other than allreduce and barrier are refused while a rank has joined
    if r == 0:
        p.expect(hvd.join() == (n - 1 if n > 1 else 0), "second join")
    else:
        hvd.barrier()
        exc = raised(lambda: hvd.broadcast(torch.ones(1), root_rank=1))
        p.expect(isinstance(exc, hvd.HorovodInternalError) and "broadcast is not supported while ranks have joined "
                 "(rank(s) [0] called hvd.join())" in str(exc), exc)
        hvd.join()
    p.verdict()


# -- names in flight (Horovod's rule: no two ops of one name in flight on a process set) -----------------------

#: Horovod's DUPLICATE_NAME_ERROR (horovod/common/common.h), its two sentences with one space between them
HOROVOD_DUPLICATE_NAME = ("Requested to allreduce, allgather, or broadcast a tensor with the same name as another "
                          "tensor that is currently being processed. If you want to request another tensor, use a "
                          "different tensor name.")


def named_families(n: int, r: int) -> dict:
    """Every form of every op that takes a name, by Horovod's op family (the
    prefix of its tensor names): ``family -> (make inputs, expected results,
    {form: call(inputs, name)})``. A call returns a handle (``*_async``) or the
    result; ``results`` below turns either into a list of tensors."""
    s = float(n * (n + 1) // 2)  # the sum over the ranks of r + 1

    def one():
        return [torch.full((2,), r + 1.0)]

    def two():
        return [torch.full((2,), r + 1.0), torch.full((3,), 2.0 * (r + 1))]

    sum_ = hvd.Sum
    return {
        "allreduce": (one, [torch.full((2,), s)], {
            "allreduce_async": lambda t, name: hvd.allreduce_async(t[0], name=name, op=sum_),
            "allreduce_async_": lambda t, name: hvd.allreduce_async_(t[0], name=name, op=sum_),
            "allreduce": lambda t, name: hvd.allreduce(t[0], name=name, op=sum_),
            "allreduce_": lambda t, name: hvd.allreduce_(t[0], name=name, op=sum_)}),
        "grouped_allreduce": (two, [torch.full((2,), s), torch.full((3,), 2 * s)], {
            "grouped_allreduce_async": lambda t, name: hvd.grouped_allreduce_async(t, name=name, op=sum_),
            "grouped_allreduce_async_": lambda t, name: hvd.grouped_allreduce_async_(t, name=name, op=sum_),
            "grouped_allreduce": lambda t, name: hvd.grouped_allreduce(t, name=name, op=sum_),
            "grouped_allreduce_": lambda t, name: hvd.grouped_allreduce_(t, name=name, op=sum_)}),
        "allgather": (lambda: [torch.tensor([r])], [torch.arange(n)], {
            "allgather_async": lambda t, name: hvd.allgather_async(t[0], name=name),
            "allgather": lambda t, name: hvd.allgather(t[0], name=name)}),
        "grouped_allgather": (
            lambda: [torch.tensor([r]), torch.full((r + 1, 2), r)],
            [torch.arange(n), torch.cat([torch.full((q + 1, 2), q) for q in range(n)])], {
                "grouped_allgather_async": lambda t, name: hvd.grouped_allgather_async(t, name=name),
                "grouped_allgather": lambda t, name: hvd.grouped_allgather(t, name=name)}),
        "broadcast": (lambda: [torch.tensor([r + 1.0])], [torch.tensor([1.0])], {
            "broadcast_async": lambda t, name: hvd.broadcast_async(t[0], 0, name=name),
            "broadcast_async_": lambda t, name: hvd.broadcast_async_(t[0], 0, name=name),
            "broadcast": lambda t, name: hvd.broadcast(t[0], 0, name=name),
            "broadcast_": lambda t, name: hvd.broadcast_(t[0], 0, name=name)}),
        "alltoall": (  # one row to each rank: rank r receives 10 q + r from rank q
            lambda: [torch.arange(n) + 10 * r],
            [torch.arange(n) * 10 + r, torch.ones(n, dtype=torch.int32)], {
                "alltoall_async": lambda t, name: hvd.alltoall_async(t[0], splits=[1] * n, name=name),
                "alltoall": lambda t, name: hvd.alltoall(t[0], splits=[1] * n, name=name)}),
        "reducescatter": (lambda: [torch.full((n, 2), r + 1.0)], [torch.full((1, 2), s)], {
            "reducescatter_async": lambda t, name: hvd.reducescatter_async(t[0], name=name, op=sum_),
            "reducescatter": lambda t, name: hvd.reducescatter(t[0], name=name, op=sum_)}),
        "grouped_reducescatter": (
            lambda: [torch.full((n,), r + 1.0), torch.ones(n, 2)], [torch.full((1,), s), torch.full((1, 2), float(n))], {
                "grouped_reducescatter_async": lambda t, name: hvd.grouped_reducescatter_async(t, name=name, op=sum_),
                "grouped_reducescatter": lambda t, name: hvd.grouped_reducescatter(t, name=name, op=sum_)}),
    }


def outcome(call):
    """``call()``'s result as a list of tensors (a handle is synchronized
    first), or the exception it raised (then ``equal`` is False)."""
    try:
        out = call()
        out = hvd.synchronize(out) if isinstance(out, int) else out
    except Exception as exc:  # noqa: BLE001 - the caller checks it
        return exc
    return [out] if isinstance(out, torch.Tensor) else list(out)


def equal(got, expected: list) -> bool:
    return isinstance(got, list) and len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


def sparse_one_hot(n: int, r: int) -> torch.Tensor:
    """A sparse (n,) tensor with 1 at index r: the sparse sum over the ranks is ones(n)."""
    return torch.sparse_coo_tensor(torch.tensor([[r]]), torch.tensor([1.0]), (n,), check_invariants=True)


@pytest.mark.mpi
def test_a_name_in_flight_is_refused_on_the_calling_rank(h):
    """Horovod's rule, for every op and each of its forms: while an async op
    with a name is in flight (started, not synchronized) on a process set, a
    second op of that family with that name raises ValueError on the calling
    rank with Horovod's words, the op, the name, the rank and the holder,
    before anything is sent (the op in flight still pairs across ranks), with
    its tensors untouched; once the first is synchronized, the name is free."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    for family, (make, expected, forms) in named_families(n, r).items():
        tensor_name = f"{family}.x" + ("_1of2" if family.startswith("grouped_") else "")
        for holder in [f for f in forms if "async" in f]:
            for form, call in forms.items():
                tag = f"{holder}(name='x') in flight, then {form}(name='x')"
                handle = forms[holder](make(), "x")
                mine = make()
                before = [t.clone() for t in mine]
                exc = raised(lambda: call(mine, "x"))
                p.expect(isinstance(exc, ValueError) and all(text in str(exc) for text in (
                    f"hpccomm.horovod {family} 'x' (op #", f"on process set 0, rank {r}/{n}): ", HOROVOD_DUPLICATE_NAME,
                    f"Tensor name {tensor_name!r} is held by handle {handle}, which has not been synchronized")),
                    f"{tag}: {exc!r}")
                p.expect(equal(mine, before), f"{tag}: the refused call changed its tensors")
                p.expect(equal(outcome(lambda: handle), expected), f"{tag}: the op in flight")
                p.expect(equal(outcome(lambda: call(mine, "x")), expected), f"{tag}: the name is not free after synchronize")
    p.verdict()


@pytest.mark.mpi
def test_names_are_horovods_per_op_family_and_group_size(h):
    """Horovod names each tensor ``<op>.<name>`` (grouped ops ``<op>.<name>_<i>of<k>``),
    so one name may be in flight in different op families, in grouped ops of
    different lengths, and any number of times without a name; an op that fails
    frees its name at once."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    families = named_families(n, r)
    # the same name in flight in every family at once
    started = [(family, forms[f"{family}_async"](make(), "x"), expected)
               for family, (make, expected, forms) in families.items()]
    for family, handle, expected in started:
        p.expect(equal(outcome(lambda: handle), expected), f"{family}_async(name='x') beside the other families")
    # grouped ops of different lengths: Horovod's names carry the length
    make, expected, forms = families["grouped_allreduce"]
    h2 = hvd.grouped_allreduce_async(make(), name="g", op=hvd.Sum)
    h3 = hvd.grouped_allreduce_async(make() + [torch.full((1,), r + 1.0)], name="g", op=hvd.Sum)
    exc = raised(lambda: hvd.grouped_allreduce_async(make(), name="g", op=hvd.Sum))
    p.expect(isinstance(exc, ValueError) and "Tensor name 'grouped_allreduce.g_1of2' is held by handle "
             f"{h2}," in str(exc), exc)
    p.expect(equal(outcome(lambda: h2), expected), "grouped_allreduce of 2 named 'g'")
    p.expect(equal(outcome(lambda: h3), expected + [torch.full((1,), n * (n + 1) / 2)]), "grouped_allreduce of 3 named 'g'")
    # no name, or an empty one (Horovod's "no name"): never refused
    handles = [hvd.allreduce_async(torch.full((2,), r + 1.0), op=hvd.Sum, name=name) for name in (None, None, "", "")]
    p.expect(all(equal(outcome(lambda: k), families["allreduce"][1]) for k in handles), "unnamed allreduces in flight")
    # an op that fails frees its name: refused input on the last rank (the others raise HorovodInternalError)
    bad = torch.ones(2, dtype=torch.bool if r == n - 1 else torch.float32)
    exc = raised(lambda: hvd.allreduce_async(bad, name="x"))
    p.expect(isinstance(exc, (ValueError, hvd.HorovodInternalError)) and "is not supported" in str(exc), exc)
    p.expect(equal(outcome(lambda: hvd.allreduce_async(torch.full((2,), r + 1.0), name="x", op=hvd.Sum)),
                   families["allreduce"][1]), "the name of a failed op is not free")
    p.verdict()


@pytest.mark.mpi
def test_sparse_allreduce_names_its_two_allgathers_as_horovod(h):
    """sparse_allreduce_async(t, name) holds ``allgather.<name>.indices`` and
    ``allgather.<name>.values`` until its result is read; a clash on either is
    refused before either allgather starts."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    finish = hvd.sparse_allreduce_async(sparse_one_hot(n, r), "s", hvd.Sum)
    for part in ("indices", "values"):
        exc = raised(lambda: hvd.allgather_async(torch.tensor([r]), name=f"s.{part}"))
        p.expect(isinstance(exc, ValueError) and HOROVOD_DUPLICATE_NAME in str(exc)
                 and f"hpccomm.horovod allgather 's.{part}' (op #" in str(exc)
                 and f"Tensor name 'allgather.s.{part}' is held by handle " in str(exc), f"{part}: {exc!r}")
    p.expect(torch.equal(finish().to_dense(), torch.ones(n)), "sparse_allreduce_async result")
    p.expect(torch.equal(hvd.allgather(torch.tensor([r]), name="s.indices"), torch.arange(n)), "name free again")
    for part in ("indices", "values"):
        held = hvd.allgather_async(torch.tensor([r]), name=f"s.{part}")
        exc = raised(lambda: hvd.sparse_allreduce_async(sparse_one_hot(n, r), "s", hvd.Sum))
        p.expect(isinstance(exc, ValueError) and HOROVOD_DUPLICATE_NAME in str(exc)
                 and f"hpccomm.horovod sparse_allreduce 's' (op #" in str(exc)
                 and f"Tensor name 'allgather.s.{part}' is held by handle {held}," in str(exc), f"{part}: {exc!r}")
        p.expect(torch.equal(hvd.synchronize(held), torch.arange(n)), f"the allgather holding s.{part}")
        p.expect(torch.equal(hvd.sparse_allreduce_async(sparse_one_hot(n, r), "s", hvd.Sum)().to_dense(),
                             torch.ones(n)), f"sparse_allreduce_async after s.{part} was freed")
    p.verdict()


@pytest.mark.mpi
def test_a_name_refused_on_one_rank_only(h):
    """What docs/horovod.md says happens when only one rank holds the name
    (its program differs from the others'): that rank raises and sends
    nothing; the others' op waits for that rank's next op on the process set,
    which pairs with it. Here rank 0 keeps 'x' in flight while the others
    free it; rank 0 retries after synchronizing, and every rank gets the sum
    of the retried op."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    total = [torch.full((2,), n * (n + 1) / 2)]
    first = hvd.allreduce_async(torch.full((2,), r + 1.0), name="x", op=hvd.Sum)
    if r != 0:
        p.expect(equal(outcome(lambda: first), total), "first op")
    second = torch.full((2,), 10.0 * (r + 1))
    retried = outcome(lambda: hvd.allreduce_async(second, name="x", op=hvd.Sum))
    if r == 0:
        p.expect(isinstance(retried, ValueError) and HOROVOD_DUPLICATE_NAME in str(retried), retried)
        p.expect(equal(outcome(lambda: first), total), "first op on rank 0")
        if isinstance(retried, ValueError):  # refused, as it should be: now the name is free
            retried = outcome(lambda: hvd.allreduce_async(second, name="x", op=hvd.Sum))
    p.expect(equal(retried, [t * 10 for t in total]), f"the op paired with rank 0's retry: {retried!r}")
    p.expect(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="x").item() == n, "the next op")
    p.verdict()


@pytest.mark.mpi(min_size=2)
def test_names_are_per_process_set(h):
    """As in Horovod (a tensor queue per process set), a name in flight on one
    process set does not hold it on another."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    head = hvd.add_process_set(range(n - 1))
    try:
        on_world = hvd.allreduce_async(torch.full((2,), r + 1.0), name="x", op=hvd.Sum)
        if head.included():
            got = outcome(lambda: hvd.allreduce(torch.full((2,), r + 1.0), name="x", op=hvd.Sum, process_set=head))
            p.expect(equal(got, [torch.full((2,), (n - 1) * n / 2)]), f"on the set {head.ranks}: {got!r}")
        exc = raised(lambda: hvd.allreduce(torch.ones(1), name="x"))
        p.expect(isinstance(exc, ValueError) and f"on process set 0, rank {r}/{n}): {HOROVOD_DUPLICATE_NAME}"
                 in str(exc), f"on the global set: {exc!r}")
        p.expect(equal(outcome(lambda: on_world), [torch.full((2,), n * (n + 1) / 2)]), "on the global set")
    finally:
        hvd.remove_process_set(head)
    p.verdict()


# -- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_local_errors_are_raised_before_any_communication(h):
    """Bad input on every rank: every rank raises the local error, and the
    next op works (nobody is left waiting)."""
    p = Problems()
    n = hvd.size()
    cases = [
        (lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool)), ValueError,
         "tensor type torch.BoolTensor (torch.bool) is not supported"),
        (lambda: hvd.allreduce(torch.ones(2), op=hvd.Adasum), NotImplementedError, "op=hvd.Adasum is not supported"),
        (lambda: hvd.allreduce(torch.ones(2), op=17), ValueError, "op=17 is not one of hvd.Average, hvd.Sum"),
        (lambda: hvd.allreduce(torch.ones(2), prescale_factor="x"), TypeError, "prescale_factor must be a number"),
        (lambda: hvd.allreduce(torch.ones(2).to_sparse()), ValueError, "sparse tensors are not supported"),
        (lambda: hvd.grouped_allreduce([]), ValueError, "the list of tensors is empty"),
        (lambda: hvd.allgather(torch.tensor(1.0)), ValueError, "cannot allgather a 0-dimensional tensor"),
        (lambda: hvd.broadcast(torch.ones(1), root_rank=n), ValueError, f"invalid root rank {n} for the provided"),
        *([(lambda: hvd.alltoall(torch.ones(2 * n + 1)), ValueError,  # every length divides evenly by 1 rank
            f"splits not provided, but first dimension of tensor ({2 * n + 1}) is not an even multiple of the "
            f"number of workers ({n})")] if n > 1 else []),
        (lambda: hvd.alltoall(torch.ones(1), splits=[2] + [0] * (n - 1)), ValueError,
         "Sum of splits entries (2) is greater than the first dimension of tensor (1)"),
        (lambda: hvd.alltoall(torch.ones(n), splits=torch.ones(1, n, dtype=torch.int32)), ValueError,
         "alltoall expects a 1D splits tensor"),
        (lambda: hvd.allreduce([1.0, 2.0]), TypeError, "expected a torch.Tensor, got list"),
        (lambda: hvd.grouped_allreduce([torch.ones(1), torch.ones(1).as_subclass(FakeCudaTensor)]), ValueError,
         "tensors in the list must be on the same device"),
        (lambda: hvd.add_process_set([n]), ValueError, f"rank(s) [{n}] are outside the world of size {n}"),
        (lambda: hvd.add_process_set(hvd.ProcessSet(__import__("mpi4py.MPI").MPI.COMM_SELF)), NotImplementedError,
         "Dynamically adding process sets defined by an MPI communicator is not implemented"),
        (lambda: hvd.alltoall(torch.ones(2), splits=[1] * (n + 1)), ValueError, f"must be {n} non-negative integers"),
        (lambda: hvd.alltoall(torch.ones(n), splits=torch.ones(n, dtype=torch.int64)), ValueError,
         "alltoall expects splits to contain 32-bit integer elements"),
        (lambda: hvd.reducescatter(torch.tensor(2.0)), ValueError, "cannot reducescatter a 0-dimensional tensor"),
        (lambda: hvd.allreduce(torch.ones(1), process_set="all"), ValueError, "process_set must be an hvd.ProcessSet"),
    ]
    for call, kind, text in cases:
        exc = raised(call)
        p.expect(isinstance(exc, kind) and text in str(exc), f"expected {kind.__name__} with {text!r}, got {exc!r}")
        p.expect(hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n, "the next op after an error")
    p.verdict()


@pytest.mark.mpi(min_size=2)
def test_mismatches_across_ranks_are_named_on_every_rank(h):
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    cases = [
        (lambda: hvd.allreduce(torch.ones(r + 1)), "mismatched shapes across ranks: rank 0 called allreduce(float32[1]"),
        (lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.float64)),
         "mismatched dtypes across ranks"),
        (lambda: hvd.allreduce(torch.ones(2), op=hvd.Sum if r == 0 else hvd.Max),
         "mismatched op across ranks: rank 0 called allreduce(float32[2], op=Sum"),
        (lambda: hvd.allreduce(torch.ones(2), name=f"loss{r}"), "different names across ranks"),
        (lambda: hvd.allreduce(torch.ones(2), prescale_factor=1.0 + r), "mismatched prescale_factor"),
        (lambda: hvd.broadcast(torch.ones(2), root_rank=r), "mismatched root_rank across ranks"),
        (lambda: hvd.allgather(torch.ones(2, r + 1)), "mismatched shapes across ranks: rank 0 called allgather(float32[*, 1])"),
        (lambda: hvd.allreduce(torch.ones(2)) if r == 0 else hvd.broadcast(torch.ones(2), root_rank=0),
         "different ops across ranks: rank 0 called allreduce("),
        (lambda: hvd.grouped_allreduce([torch.ones(1)] * (1 if r == 0 else 2)), "different numbers of tensors"),
        (lambda: hvd.allreduce(torch.ones(2) if r == 0 else torch.ones(2, 1)), "mismatched numbers of dimensions"),
        (lambda: hvd.allreduce(torch.ones(2) if r == 0 else torch.ones(2).as_subclass(FakeCudaTensor)),
         "mismatched devices across ranks: rank 0 called allreduce(float32[2], op=Average, prescale_factor=1.0, "
         "postscale_factor=1.0) but rank 1 called allreduce(float32[2] on cuda"),
    ]
    for call, text in cases:
        exc = raised(call)
        p.expect(isinstance(exc, hvd.HorovodInternalError) and text in str(exc)
                 and "hpccomm.horovod matches ops by their order" in str(exc), f"{text!r}: {exc!r}")
        p.expect(hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == n, "the next op after a mismatch")
    # bad input on one rank only: that rank raises its own error, the others name it
    exc = raised(lambda: hvd.allreduce(torch.ones(2, dtype=torch.bool if r == n - 1 else torch.float32)))
    if r == n - 1:
        p.expect(isinstance(exc, ValueError) and "is not supported" in str(exc), exc)
    else:
        p.expect(isinstance(exc, hvd.HorovodInternalError) and f"the input of rank(s) [{n - 1}] was refused" in str(exc)
                 and "tensor type torch.BoolTensor" in str(exc), exc)
    # a model that differs between ranks
    model = torch.nn.Linear(2, 1 + r)
    exc = raised(lambda: hvd.broadcast_parameters(model.state_dict(), root_rank=0))
    p.expect(isinstance(exc, hvd.HorovodInternalError) and "mismatched shapes across ranks" in str(exc), exc)
    p.verdict()


# -- SyncBatchNorm ------------------------------------------------------------------------------------------------

@pytest.mark.mpi
def test_sync_batch_norm_matches_batch_norm_on_the_global_batch(h):
    """Forward, input/weight/bias gradients and running statistics equal plain
    BatchNorm over every rank's samples together (computed here on each rank)."""
    p = Problems()
    n, r = hvd.size(), hvd.rank()
    for shape in ((3 + 0, 4), (2, 4, 5), (2, 4, 3, 3)):
        batches = []
        for q in range(n):
            g = torch.Generator().manual_seed(10 + q)
            batches.append(torch.randn((shape[0] + q, *shape[1:]), generator=g, dtype=torch.float64) * (q + 1) + q)
        dy = [torch.randn(b.shape, generator=torch.Generator().manual_seed(50 + q), dtype=torch.float64)
              for q, b in enumerate(batches)]
        ref = torch.nn.BatchNorm1d(4) if len(shape) < 4 else torch.nn.BatchNorm2d(4)
        ref = ref.double()
        torch.nn.init.uniform_(ref.weight, generator=torch.Generator().manual_seed(3))
        sync = hvd.SyncBatchNorm(4).double()
        sync.load_state_dict(ref.state_dict())
        x_all = torch.cat(batches).requires_grad_()
        (ref(x_all) * torch.cat(dy)).sum().backward()
        x = batches[r].clone().requires_grad_()
        out = sync(x)
        (out * dy[r]).sum().backward()
        start = sum(b.shape[0] for b in batches[:r])
        mine = slice(start, start + batches[r].shape[0])
        expected_out = torch.nn.functional.batch_norm(x_all.detach(), None, None, ref.weight.detach(),
                                                      ref.bias.detach(), True)[mine]
        p.expect(torch.allclose(out.detach(), expected_out, atol=1e-10), f"{shape}: forward")
        p.expect(torch.allclose(x.grad, x_all.grad[mine], atol=1e-10), f"{shape}: input gradient")
        wg = hvd.allreduce(sync.weight.grad, op=hvd.Sum)
        bg = hvd.allreduce(sync.bias.grad, op=hvd.Sum)
        p.expect(torch.allclose(wg, ref.weight.grad, atol=1e-10) and torch.allclose(bg, ref.bias.grad, atol=1e-10),
                 f"{shape}: weight/bias gradients summed over ranks")
        p.expect(torch.allclose(sync.running_mean, ref.running_mean) and torch.allclose(sync.running_var, ref.running_var),
                 f"{shape}: running statistics")
        sync.eval()
        p.expect(torch.allclose(sync(x.detach()), torch.nn.functional.batch_norm(
            x.detach(), sync.running_mean, sync.running_var, sync.weight, sync.bias, False)), f"{shape}: eval")
    # ranks with empty batches take part; fewer than 2 values per channel overall is refused on every rank
    bn = hvd.SyncBatchNorm(3)
    exc = raised(lambda: bn(torch.ones(1 if r == 0 else 0, 3)))
    p.expect(isinstance(exc, ValueError) and "Expected more than 1 value per channel when training" in str(exc)
             and (n == 1 or "1 value(s) per channel over all ranks" in str(exc)), exc)  # size 1: torch's own check
    y = bn(torch.ones(2 if r == 0 else 0, 3) * torch.tensor([1.0, 2.0, 3.0]))
    p.expect(y.shape == ((2 if r == 0 else 0), 3) and not torch.isnan(bn.running_mean).any(), (y, bn.running_mean))
    exc = raised(lambda: hvd.SyncBatchNorm(3)(torch.ones(3)))
    p.expect(isinstance(exc, ValueError) and "expected at least 2D input (got 1D input)" in str(exc), exc)
    p.verdict()


# -- without MPI ---------------------------------------------------------------------------------------------------

def test_elastic_is_refused_with_a_reason():
    for call in (lambda: __import__("hpccomm.horovod.elastic"), lambda: hvd.elastic):
        with pytest.raises(ImportError, match="Horovod's elastic mode .* is not supported by hpccomm.horovod"):
            call()
    with pytest.raises(AttributeError, match="has no attribute 'nonesuch'"):
        hvd.nonesuch  # noqa: B018


def test_before_init_and_timeline():
    if hvd.is_initialized():
        pytest.fail("hvd is initialised in a plain (non-MPI) test run")
    for call in (hvd.size, hvd.rank, hvd.local_rank, hvd.local_size, hvd.cross_rank, hvd.cross_size,
                 hvd.mpi_threads_supported, lambda: hvd.allreduce(torch.ones(1))):
        with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use hvd.init\(\).$"):
            call()
    with pytest.raises(NotImplementedError, match="HPCCOMM_TRACE=trace.json"):
        hvd.start_timeline("t.json")
    with pytest.raises(NotImplementedError, match="HPCCOMM_TRACE=trace.json"):
        hvd.stop_timeline()
    with pytest.raises(ValueError, match="ProcessSet should be initialized with a list of process ranks"):
        hvd.ProcessSet([0, "1"])
    p = hvd.ProcessSet([2, 0])
    assert p.ranks == [0, 2] and p.size() is None and p.rank() is None
    assert not hvd.mpi_enabled() and not hvd.gloo_enabled()
    from hpccomm.horovod import optimizer as hvd_optimizer

    with pytest.raises(RuntimeError, match=r"reduce gradients of DistributedOptimizer \(99, 99\), which this rank "
                                           "does not have"):
        hvd_optimizer.feed_round(("optimizer", None, (("key", (99, 99)),), ()), torch.device("cpu"))
    with pytest.raises(ValueError, match="HOROVOD_FUSION_THRESHOLD='x' is not a byte count"):
        os.environ["HOROVOD_FUSION_THRESHOLD"] = "x"
        try:
            from hpccomm.horovod import optimizer

            optimizer.fusion_bytes()
        finally:
            del os.environ["HOROVOD_FUSION_THRESHOLD"]


INIT_SCRIPT = REPO / "tests" / "horovod_examples" / "init_forms.py"


def test_init_forms_in_a_fresh_job():
    """hvd.init with an mpi4py communicator, with a list of ranks, with process
    sets made from communicators, shutdown and init again, and dist.* calls
    mixed in (a 3-rank job of tests/horovod_examples/init_forms.py)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "HPCCOMM_", "HOROVOD_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               PYTHONUNBUFFERED="1", TORCH_CPP_LOG_LEVEL="ERROR",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = ["timeout", "--kill-after=10", "150", "mpirun", "-n", "3", "--oversubscribe", "--output", "tag",
           sys.executable, str(INIT_SCRIPT)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=170)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    log = f"exit {proc.returncode}\n{out[-5000:]}\n{err[-5000:]}"
    assert proc.returncode == 0, log
    for rank in range(3):
        assert re.search(rf"^\[\d+,{rank}\]<stdout>: init_forms: all checks passed$", out, re.M), log


#: hpccomm.horovod's modules, bottom layer first: a module imports only from layers below its own
#: (module level and inside functions alike). "" is the package's __init__ (the public names).
HOROVOD_LAYERS = (
    ("basics", "compression", "elastic"),
    ("process_sets",),
    ("ops", "ops.checks"),
    ("ops.handles",),
    ("ops.negotiation",),
    ("ops.allreduce", "ops.barrier"),
    ("ops.allgather",),
    ("ops.broadcast", "ops.alltoall", "ops.reducescatter"),
    ("optimizer", "sync_batch_norm"),
    ("ops.join", "functions"),
    ("lifecycle",),
    ("",),
)
#: hpccomm's private modules that hpccomm.horovod may import: the one the optimizer has always used
#: (no new ones: hpccomm.horovod is a user of hpccomm's public API, and the core is renamed under it)
HOROVOD_PRIVATE_KEPT = {"optimizer": ("hpccomm._compat",)}


def _imported(module: str, source: str):
    """Every name ``module`` (under hpccomm.horovod; "" the package) imports,
    made absolute, also inside functions: ``hpccomm.horovod.ops.checks.Sum``."""
    import ast

    package = ["hpccomm", "horovod", *(module.split(".") if module else [])]
    if module not in ("", "ops"):
        package = package[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            stem = node.module or ""
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                stem = ".".join(base + ([node.module] if node.module else []))
            yield from (f"{stem}.{a.name}" for a in node.names)


def horovod_import_problems(sources: dict) -> list:
    """Imports in ``sources`` (module name under hpccomm.horovod -> source)
    that do not point down HOROVOD_LAYERS, or reach hpccomm's private modules."""
    layer = {m: i for i, names in enumerate(HOROVOD_LAYERS) for m in names}
    problems = [f"hpccomm.horovod.{m} is in no layer of HOROVOD_LAYERS" for m in sources if m not in layer]
    for module, source in sources.items():
        for target in _imported(module, source):
            if target.startswith("hpccomm.horovod.") or target == "hpccomm.horovod":
                inner = target[len("hpccomm.horovod."):]
                while inner not in layer:  # `from .ops.allreduce import allreduce`: the module
                    inner = inner.rpartition(".")[0]
                if inner != module and layer[inner] >= layer.get(module, -1):
                    problems.append(f"hpccomm.horovod.{module} imports hpccomm.horovod.{inner or '(package)'}, "
                                    "which is not below it in HOROVOD_LAYERS")
            elif target.startswith("hpccomm.") and any(part.startswith("_") for part in target.split(".")) \
                    and not any(target == kept or target.startswith(kept + ".")
                                for kept in HOROVOD_PRIVATE_KEPT.get(module, ())):
                problems.append(f"hpccomm.horovod.{module} imports {target}, a private hpccomm module")
    return problems


def test_horovod_imports_point_one_way():
    """hpccomm.horovod's imports point down HOROVOD_LAYERS (no circle, also
    through imports inside functions), and reach the rest of hpccomm through
    its public API only; the check fires on planted bad imports."""
    root = REPO / "hpccomm" / "horovod"
    sources = {}
    for path in sorted(root.rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        sources[name.removesuffix("__init__").rstrip(".")] = path.read_text()
    assert {"ops.handles", "ops.allreduce", "ops.join", "lifecycle", ""} <= set(sources), sorted(sources)
    assert horovod_import_problems(sources) == []
    planted = {
        "basics": "def f():\n    from . import process_sets\n",
        "ops.allreduce": "from .allgather import allgather\n",
        "ops.handles": "from .handles import reset\nfrom ..optimizer import teardown\n",
        "process_sets": "import hpccomm._start.bootstrap\n",
        "ops.checks": "from hpccomm._core.state import watched\n",
        "nonesuch": "x = 1\n",
    }
    found = horovod_import_problems(planted)
    for module, what in (("basics", "process_sets"), ("ops.allreduce", "ops.allgather"), ("ops.handles", "optimizer"),
                         ("process_sets", "hpccomm._start.bootstrap"), ("ops.checks", "hpccomm._core.state"),
                         ("nonesuch", "in no layer")):
        assert any(f"hpccomm.horovod.{module} " in f and what in f for f in found), (module, what, found)
    assert not any("ops.handles imports hpccomm.horovod.ops.handles" in f for f in found), found
