"""hpccomm's composed reductions (the reducing ops' ``composed`` plans,
hpccomm/_ops/reduce.py, over the ring of hpccomm/_ops/composed.py: a ring of
point-to-point messages and local arithmetic) against the CPU path, for every
dtype and ReduceOp, contiguous and strided, at 1-4 ranks.

The composition is device-agnostic: here it runs on CPU tensors over host MPI
(the GPU route runs the same plans on device tensors over CUDA-aware MPI;
tests/test_gpu_contracts.py runs it on the fake device).  Each result must
equal the CPU path's (the values are small integers: every sum is exact in
every dtype), be identical on every rank, and leave read-only inputs as they
were.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from helpers import REDUCE_DTYPES, Problems, hgroup, same_on_all_ranks
from hpccomm._ops import reduce as ops
from hpccomm._core.plan import run as run_plan

R = dist.ReduceOp


def redops(dtype) -> list:
    """What the CPU path takes for ``dtype`` (torch.distributed refuses complex PRODUCT itself)."""
    if dtype == torch.bool:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.BAND, R.BOR, R.BXOR]
    if dtype.is_complex:
        return [R.SUM, R.AVG, dist._make_nccl_premul_sum(2.0)]
    if dtype.is_floating_point:
        return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, dist._make_nccl_premul_sum(3.0)]
    return [R.SUM, R.PRODUCT, R.MIN, R.MAX, R.AVG, R.BAND, R.BOR, R.BXOR]


def values(n: int, dtype, rank: int, salt: int = 0) -> torch.Tensor:
    base = (torch.arange(n, dtype=torch.int64) * 5 + salt) % 4 + rank % 3 + 1
    if dtype == torch.bool:
        return (torch.arange(n) + salt + rank) % (rank + 2) == 0
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


def run(plan) -> None:
    run_plan(plan)


def composed(op, g, *args):
    """``op``'s composed plan (its declaration's ``composed``) of a call, as a
    route makes it: the op's checks first (once, whatever the route)."""
    return op.composed(g, op.check(g, *args), args)


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=[str(d)[6:] for d in REDUCE_DTYPES])
def test_composed_reductions_equal_the_cpu_path(world, dtype):
    rank, n = world
    g = hgroup(dist.group.WORLD)
    problems = Problems()
    for i, redop in enumerate(redops(dtype)):
        for size in (1, 7, 4 * n + 1):
            for strided in (False, True):
                name = f"{redop} size {size}{' strided' if strided else ''}"
                mine = values(size, dtype, rank, i)
                # all_reduce
                base = torch.zeros(2 * size, dtype=dtype)
                t = base[::2] if strided else base[:size]
                t.copy_(mine)
                ref = mine.clone()
                run(composed(ops.ALL_REDUCE, g, [t], redop))
                dist.all_reduce(ref, op=redop)
                problems.expect(torch.equal(t, ref), ("all_reduce", name, t, ref))
                problems.expect(same_on_all_ranks(torch.empty(t.shape, dtype=dtype).copy_(t)),
                                ("all_reduce differs between ranks", name))
                if strided:
                    problems.expect(not torch.any(base[1::2].to(torch.float64).abs() > 0), ("outside", name))
                # reduce to the last rank: the others' tensors as they were
                t = mine.clone()
                ref = mine.clone()
                run(composed(ops.REDUCE, g, [t], n - 1, redop))
                dist.reduce(ref, dst=n - 1, op=redop)
                problems.expect(torch.equal(t, ref if rank == n - 1 else mine), ("reduce", name, t, ref))
                # reduce_scatter_tensor: the input only read
                big = values(size * n, dtype, rank, i + 1)
                src = big.clone()
                out, ref = torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=dtype)
                run(composed(ops.REDUCE_SCATTER_TENSOR, g, out, src, redop))
                dist.reduce_scatter_tensor(ref, big.clone(), op=redop)
                problems.expect(torch.equal(out, ref), ("reduce_scatter_tensor", name, out, ref))
                problems.expect(torch.equal(src, big), ("reduce_scatter_tensor changed its input", name))
                # reduce_scatter (a list per rank)
                parts = [values(size, dtype, rank, i + r) for r in range(n)]
                out, ref = torch.zeros(size, dtype=dtype), torch.zeros(size, dtype=dtype)
                run(composed(ops.REDUCE_SCATTER, g, [out], [[p.clone() for p in parts]], redop))
                dist.reduce_scatter(ref, [p.clone() for p in parts], op=redop)
                problems.expect(torch.equal(out, ref), ("reduce_scatter", name, out, ref))
    problems.verdict()


@pytest.mark.mpi
def test_composed_plans_refuse_what_the_cpu_path_refuses(world):
    """The composed route refuses with the op's own checks (run once, whatever the route)."""
    import hpccomm

    g = hgroup(dist.group.WORLD)
    with pytest.raises(hpccomm.OpTypeError, match=r"ReduceOp\.BAND needs an integer or bool tensor"):
        composed(ops.ALL_REDUCE, g, [torch.ones(2)], R.BAND)
    with pytest.raises(hpccomm.OpValueError, match=r"input has 3 elements, expected output's 2 × group size"):
        composed(ops.REDUCE_SCATTER_TENSOR, g, torch.zeros(2), torch.zeros(3), R.SUM)
    with pytest.raises(hpccomm.OpValueError, match=r"dst 99 is not a rank of this group"):
        composed(ops.REDUCE, g, [torch.ones(2)], 99, R.SUM)
