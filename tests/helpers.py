"""Shared test helpers: world set-up, group shapes, inputs and references.

References are computed by each rank for itself in closed form from the
ranks of the group, never by asking another rank.  Cross-rank checks (that
every rank holds the same result) use raw mpi4py on COMM_WORLD, independent
of hpccomm.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

_verdict = None

FLOAT8 = [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]
#: dtypes every op moves.
MOVE_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
               torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
               torch.uint16, torch.uint32, torch.uint64, *FLOAT8]
#: dtypes that reduce (float8 only moves).
REDUCE_DTYPES = [d for d in MOVE_DTYPES if d not in FLOAT8]
R = dist.ReduceOp


def world_rank_size():
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


def verdict_comm():
    global _verdict
    if _verdict is None:
        from mpi4py import MPI

        _verdict = MPI.COMM_WORLD.Dup()
    return _verdict


def init_world():
    import hpccomm

    if not dist.is_initialized():
        hpccomm.init_process_group()
    return dist.get_rank(), dist.get_world_size()


@dataclass
class TestGroup:
    """A group shape: ``pg`` is None on ranks outside it; ``ranks`` are global ranks."""

    name: str
    ranks: list
    pg: Optional[object]

    @property
    def member(self) -> bool:
        return self.pg is not None

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank())


def make_groups() -> list:
    """Group shapes to run every op over: the world, the world's reverse-order
    tail (non-consecutive when size > 3), the even ranks, and a singleton."""
    n = dist.get_world_size()
    me = dist.get_rank()
    shapes = {
        "world": list(range(n)),
        "odd-and-last": sorted({r for r in range(n) if r % 2 == 1} | {n - 1}),
        "even": [r for r in range(n) if r % 2 == 0],
        "last-alone": [n - 1],
    }
    out = [TestGroup("world", shapes["world"], dist.group.WORLD)]
    for name in ("odd-and-last", "even", "last-alone"):
        ranks = shapes[name]
        pg = dist.new_group(ranks)  # every rank takes part, as torch requires
        out.append(TestGroup(name, ranks, pg if me in ranks else None))
    return out


def group_ids(groups):
    return [g.name for g in groups]


def fill(shape, dtype, value_of_rank: int, salt: int = 0) -> torch.Tensor:
    """A deterministic tensor of ``dtype`` for a rank: small integers that every
    dtype holds exactly (so sums of a few ranks stay exact)."""
    numel = 1
    for s in shape:
        numel *= s
    base = (torch.arange(numel, dtype=torch.int64) + salt) % 5 + value_of_rank + 1
    if dtype == torch.bool:  # a pattern that differs between ranks
        return ((torch.arange(numel) + salt + value_of_rank) % (value_of_rank + 2) == 0).reshape(shape)
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype).reshape(shape)
    return base.to(dtype).reshape(shape)


def same_on_all_ranks(t: torch.Tensor, ranks=None) -> bool:
    """Whether every rank in ``ranks`` (default all) holds bit-identical ``t``.
    Collective over COMM_WORLD: every rank calls it (non-members pass None)."""
    data = None if t is None else t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    everything = verdict_comm().allgather(data)
    if ranks is not None:
        everything = [everything[r] for r in ranks]
    everything = [d for d in everything if d is not None]
    return all(d == everything[0] for d in everything)


def tolerance(dtype: torch.dtype, n_terms: int = 1):
    """(rtol, atol) for comparing a reduction of ``n_terms`` values in ``dtype``
    with a float64 reference: one rounding per term, in that dtype."""
    if dtype in (torch.float16,):
        eps = 2.0 ** -10
    elif dtype == torch.bfloat16:
        eps = 2.0 ** -7
    elif dtype in (torch.float32, torch.complex64):
        eps = 2.0 ** -23
    elif dtype in (torch.float64, torch.complex128):
        eps = 2.0 ** -52
    else:
        return 0.0, 0.0
    return eps * max(n_terms, 1) * 2, 0.0


def assert_close(actual, expected, dtype, n_terms=1):
    rtol, atol = tolerance(dtype, n_terms)
    if rtol == 0 and atol == 0:
        assert torch.equal(actual, expected.to(actual.dtype)), f"{actual} != {expected}"
    else:
        torch.testing.assert_close(actual.to(torch.complex128 if dtype.is_complex else torch.float64),
                                   expected.to(torch.complex128 if dtype.is_complex else torch.float64),
                                   rtol=rtol, atol=atol)


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


class Problems(list):
    """Failed checks, collected while communication goes on and asserted at
    the end (``verdict``): a rank that stopped at its first failed assert
    would leave the other ranks blocked in the next collective."""

    def expect(self, ok, what) -> None:
        if not ok:
            self.append(str(what))

    def verdict(self) -> None:
        assert not self, "; ".join(self)


def raised_by(call):
    """The exception ``call()`` raised, or None."""
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - checked by the caller
        return exc
    return None


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor claiming to live on cuda:0 (device, is_cuda and is_cpu all say
    so), as mpi4py's tests use a fake GPU array to reach GPU code paths without a
    GPU: host memory underneath."""

    @property
    def device(self):
        return torch.device("cuda", 0)

    @property
    def is_cuda(self):
        return True

    @property
    def is_cpu(self):
        return False
