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


def hgroup(pg):
    """The hpccomm internals (a ``hpccomm._core.group.Group``) behind torch group
    ``pg``, on either adapter (torch 2.13's ProcessGroup, or torch >= 2.14's
    Backend inside torch's ProcessGroup)."""
    from hpccomm import _compat as compat

    g = compat.group_of(pg)
    assert g is not None, f"{pg!r} is not an hpccomm group"
    return g


def work_done(w, pg=None) -> bool:
    """Whether async Work ``w`` of group ``pg`` (default the world) completed
    successfully, asked as its adapter allows: hpccomm's ProcessGroup adapter
    hands its own Work to Python (is_completed, is_success); torch >= 2.14's
    Backend trampoline forwards only wait() and get_future() (tests/test_routes.py)."""
    import hpccomm

    if isinstance(pg if pg is not None else dist.group.WORLD, hpccomm.ProcessGroupHpccomm):
        return w.is_completed() and w.is_success()
    return w.get_future().done()


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
    tail (non-consecutive when size > 3), the even ranks, a singleton, and on
    torch >= 2.14 the world again as hpccomm's c10d Backend inside torch's
    ProcessGroup (the other groups use hpccomm's ProcessGroup adapter)."""
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
    from hpccomm import _compat as compat

    if compat.py_backend():  # torch >= 2.14: every op also through torch's c10d Backend trampoline
        with setting("HPCCOMM_ADAPTER", "backend"):
            out.append(TestGroup("backend", shapes["world"], dist.new_group(shapes["world"])))
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


def realign_group_counter() -> None:
    """torch >= 2.15 names groups from a per-process counter that a group
    made by a subset of ranks (``use_local_synchronization=True``) advances on
    its members only; a group of a backend that rendezvouses by name (gloo)
    made afterwards with a default name would then get different names on
    different ranks and hang.  Tests that make such groups realign the
    counter afterwards (every rank calls; raw MPI), as a program would by
    having every rank take part in group creation."""
    from torch.distributed import distributed_c10d as c10d

    top = max(verdict_comm().allgather(c10d._world.group_count))
    c10d._world.group_count = top


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


class NoComm:
    """A communicator that fails any call: where no communication may happen
    (a plan names its MPI calls, ``comm.Allreduce``, without making them)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)

        def used(*args, **kwargs):
            raise AssertionError(f"used the communicator ({name}) where no communication may happen")

        used.__name__ = name
        return used


class FakeComm(NoComm):
    """A communicator's rank, size and duplicates, and nothing else (:class:`NoComm`)."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._size

    def Dup(self):
        return FakeComm(self._rank, self._size)


def fake_group(rank: int = 1, size: int = 4, store=None, timeout=None, done: int = 6):
    """A real :class:`hpccomm._core.group.Group` (so ``where()`` and the op
    counters are the real ones) without MPI: its communicators are
    :class:`FakeComm`.  ``done``: collectives and p2p ops already run (the op
    being checked is ``done + 1``), numbered as the op path numbers them."""
    import types

    from hpccomm._core import group as _group
    from hpccomm._core import state

    g = _group.Group(FakeComm(rank, size), range(size), name="fake", store=store, timeout=timeout,
                     owns_comm=False, tag_ub=32767)
    for _ in range(done):
        state.start(g, "done")
        state.finished(g)
        record = types.SimpleNamespace(kind="p2p", deadline=None, io=None)  # (io: not in the flight record)
        state.start(g, "done", record)
        state.end(record.token)
    return g


import contextlib  # noqa: E402


@contextlib.contextmanager
def setting(name: str, value: str):
    """Run with ``HPCCOMM_*`` variable ``name`` set to ``value``, loaded as
    init loads settings (hpccomm reads them once, at init); restored after."""
    from hpccomm import config

    old = os.environ.get(name)
    os.environ[name] = value
    config.load()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old
        config.load()


@contextlib.contextmanager
def nonblocking_async(on: bool = True):
    """``HPCCOMM_ASYNC_NONBLOCKING`` on every hpccomm group made so far, for the
    duration (every rank must enter it together: it decides the MPI form of
    async collectives, which must match across ranks)."""
    from hpccomm._core import state

    old = [(g, g.nonblocking) for g in list(state.groups) if hasattr(g, "nonblocking")]
    for g, _ in old:
        g.nonblocking = on
    try:
        yield
    finally:
        for g, value in old:
            g.nonblocking = value
