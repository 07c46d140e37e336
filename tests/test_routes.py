"""How hpccomm plugs into torch, on every torch of the supported range.

Two adapters over one op path (docs/design.md, "Torch versions"): the
ProcessGroup adapter (torch 2.13's only way; on torch >= 2.14 the default
for a plain ``"hpccomm"`` backend string, with hpccomm's c10d Backend
registered inside it for every device) and the c10d Backend adapter (torch
>= 2.14: per-device backend strings, ``HPCCOMM_ADAPTER=backend``).  The op
tests run on both where both exist (tests/helpers.py adds a Backend-adapter
group to the test groups); this file checks what differs between them, and
what torch's own machinery reaches on each: coalesced ``batch_isend_irecv``,
``dist.split_group``, ``dist.monitored_barrier``, ``dist.gather_single``,
the Work torch hands back, and a receive from any source.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import hpccomm
from helpers import Problems, fill, hgroup, setting

pytestmark = pytest.mark.mpi

PY_BACKEND = hpccomm._compat.py_backend()  # torch >= 2.14: a Python c10d Backend is possible
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def backend_pg(world):
    """On torch >= 2.14, an hpccomm group over every rank made as a c10d
    Backend (HPCCOMM_ADAPTER=backend); None on torch 2.13."""
    if not PY_BACKEND:
        return None
    with setting("HPCCOMM_ADAPTER", "backend"):
        return dist.new_group(list(range(dist.get_world_size())))


@pytest.mark.one_size
def test_world_is_the_process_group_adapter(world):
    """A plain "hpccomm" default group is hpccomm's ProcessGroup on every
    torch; on torch >= 2.14 hpccomm's Backend is registered in it for the CPU
    and CUDA devices, over the same MPI group."""
    pg = dist.group.WORLD
    assert dist.get_backend() == "hpccomm"
    assert isinstance(pg, hpccomm.ProcessGroupHpccomm), type(pg)
    if PY_BACKEND:
        cpu, cuda = pg._get_backend(CPU), pg._get_backend(torch.device("cuda"))
        assert isinstance(cpu, hpccomm.BackendHpccomm) and cpu is cuda, (cpu, cuda)
        assert cpu._g is hgroup(pg), "the registered Backend runs on another group"
        assert cpu.supports_coalescing and cpu.supports_splitting


@pytest.mark.one_size
def test_backend_adapter_group(world, backend_pg):
    """torch >= 2.14: a Backend-adapter group is torch's own ProcessGroup
    around hpccomm's Backend, named hpccomm, and its ops are hpccomm's
    (every op × dtype × ReduceOp runs on it in the op tests).  torch 2.13:
    asking for it is refused, naming the variable."""
    r, n = world
    if not PY_BACKEND:
        with setting("HPCCOMM_ADAPTER", "backend"):
            with pytest.raises(hpccomm.ConfigError, match=r"^HPCCOMM_ADAPTER=backend needs torch >= 2\.14 "):
                dist.new_group(list(range(n)))
        return
    assert type(backend_pg) is dist.ProcessGroup, type(backend_pg)
    assert dist.get_backend(backend_pg) == "hpccomm"
    backend = backend_pg._get_backend(CPU)
    assert isinstance(backend, hpccomm.BackendHpccomm), type(backend)
    assert hpccomm.mpi_comm(backend_pg).Get_size() == n
    t = fill((5,), torch.int64, r)
    dist.all_reduce(t, group=backend_pg)
    assert torch.equal(t, sum(fill((5,), torch.int64, k) for k in range(n)))


@pytest.mark.parametrize("adapter", ["process_group", "backend"])
def test_batch_isend_irecv_ring(world, backend_pg, adapter):
    """batch_isend_irecv around the ring: torch >= 2.14 coalesces it through
    hpccomm's Backend (one Work for the batch) on either adapter."""
    r, n = world
    pg = dist.group.WORLD if adapter == "process_group" else backend_pg
    if pg is None:  # torch 2.13 has one adapter: the ring runs on it once
        assert not PY_BACKEND
        pg = dist.group.WORLD
    got = torch.zeros(6, dtype=torch.float64)
    ops = [dist.P2POp(dist.irecv, got, (r - 1) % n, pg), dist.P2POp(dist.isend, fill((6,), torch.float64, r),
                                                                     (r + 1) % n, pg)]
    works = dist.batch_isend_irecv(ops)
    assert len(works) == (1 if PY_BACKEND else 2), works
    for w in works:
        assert w.wait(timedelta(seconds=60))
    assert torch.equal(got, fill((6,), torch.float64, (r - 1) % n))


def test_split_group(world):
    """dist.split_group: torch 2.15 reaches hpccomm's Backend.split (one
    MPI_Comm_split over the parent); each rank's group reduces over its
    part.  torch 2.13 and 2.14 refuse a parent with no bound device (a
    CPU-only job) themselves, before any backend is asked."""
    import inspect

    from torch.distributed import distributed_c10d as c10d

    r, n = world
    evens, odds = [k for k in range(n) if k % 2 == 0], [k for k in range(n) if k % 2 == 1]
    parts = [p for p in (evens, odds) if p]
    torch_refuses = "not safe to split" in inspect.getsource(c10d.split_group)  # 2.13, 2.14
    if not PY_BACKEND or torch_refuses:
        with pytest.raises(RuntimeError, match="No device associated with the default pg"):
            dist.split_group(split_ranks=parts)
        return
    sub = dist.split_group(split_ranks=parts)
    mine = evens if r % 2 == 0 else odds
    assert dist.get_process_group_ranks(sub) == mine
    assert isinstance(sub._get_backend(CPU), hpccomm.BackendHpccomm)
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t, group=sub)
    assert t.item() == sum(k + 1 for k in mine)


def test_monitored_barrier_through_torch(world):
    """dist.monitored_barrier: torch >= 2.14 hands it to the Backend
    (hpccomm's store-based barrier); torch 2.13 refuses every backend but
    gloo by name, and hpccomm.monitored_barrier is the way there."""
    if PY_BACKEND:
        dist.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)
    else:
        with pytest.raises(ValueError, match="monitored_barrier is only implemented for GLOO backend"):
            dist.monitored_barrier(timeout=timedelta(seconds=30))
    dist.group.WORLD.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)  # the group's own method
    hpccomm.monitored_barrier(timeout=timedelta(seconds=30), wait_all_ranks=True)


def test_gather_single(world, backend_pg):
    """torch >= 2.14's dist.gather_single on the ProcessGroup adapter: every
    rank's input, in rank order, received in place on each root.  torch
    2.13 has no dist.gather_single: hpccomm's method is called as torch
    >= 2.14 calls it.  On the Backend adapter torch refuses it on every rank
    (its C++ gather_single has no Python override; gloo refuses it too)."""
    r, n = world
    p = Problems()
    for root in range(n):
        out = torch.full((n, 3), -1, dtype=torch.int32) if r == root else None
        mine = fill((3,), torch.int32, r, salt=root)
        if PY_BACKEND:
            dist.gather_single(mine, out, dst=root)
        else:
            opts = dist.GatherOptions()
            opts.rootRank = root
            dist.group.WORLD.gather_single(out if r == root else torch.empty(0, dtype=torch.int32), mine,
                                           opts).wait()
        if r == root:
            want = torch.stack([fill((3,), torch.int32, k, salt=root) for k in range(n)])
            p.expect(torch.equal(out, want), f"root {root}: {out} != {want}")
    if backend_pg is not None:
        out = torch.zeros(n * 2)
        with pytest.raises(RuntimeError, match="does not support gather_single"):
            dist.gather_single(torch.ones(2), out if r == 0 else None, dst=0, group=backend_pg)
    p.verdict()


def test_work_state_on_each_adapter(world, backend_pg):
    """The Work of an async op: the ProcessGroup adapter hands hpccomm's own
    Work to Python (is_completed, is_success, exception answer); torch >=
    2.14's Backend trampoline wraps it and forwards only wait() and
    get_future(), so there the future is what says it is done."""
    r, n = world
    t = torch.ones(3)
    w = dist.all_reduce(t, async_op=True)
    assert w.wait() and w.is_completed() and w.is_success() and w.exception() is None
    assert w.get_future().done() and torch.equal(t, torch.full((3,), float(n)))
    if backend_pg is not None:
        u = torch.ones(3)
        w = dist.all_reduce(u, group=backend_pg, async_op=True)
        assert w.wait() and w.get_future().done() and torch.equal(u, torch.full((3,), float(n)))
        assert not w.is_completed(), "torch now forwards is_completed(): update docs/design.md"


@pytest.mark.mpi(min_size=2)
def test_recv_any_source_on_each_adapter(world, backend_pg):
    """dist.recv from any source returns the sender on the ProcessGroup
    adapter.  On the Backend adapter the message arrives, but torch asks the
    wrapped Work for its source, which torch >= 2.14's trampoline does not
    forward: torch raises (documented; the ProcessGroup adapter is the way)."""
    r, n = world
    groups = [dist.group.WORLD] + ([backend_pg] if backend_pg is not None else [])
    for pg in groups:
        if r == 0:
            got = torch.zeros(4, dtype=torch.int64)
            if pg is dist.group.WORLD:
                assert dist.recv(got, group=pg) == n - 1
            else:
                with pytest.raises(RuntimeError, match=r"sourceRank\(\) may only be called"):
                    dist.recv(got, group=pg)
            assert torch.equal(got, fill((4,), torch.int64, n - 1))
        elif r == n - 1:
            dist.send(fill((4,), torch.int64, r), dst=0, group=pg)
        dist.barrier()
