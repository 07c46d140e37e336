"""CUDA tensors through every available GPU transport, compared with CPU.

Run on a machine with GPUs (one GPU per rank, or ranks sharing GPUs for the
MPI and staged transports)::

    timeout 600 mpirun -n 2 python -m pytest --with-mpi -m cuda -rs -q tests/test_cuda.py

Each op runs on CUDA tensors through each transport this machine has
(``mpi``: CUDA-aware MPI, ``nccl``: torch's or CuPy's NCCL, ``staged``: always
there when there is a GPU) and through hpccomm's CPU path on the same values;
the results must agree (and match closed forms).  Where torch sees no GPU the
whole file is skipped, with the reason shown by ``-rs``; a transport this
machine lacks is skipped with the probe's reason, decided alike on every rank.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

if not torch.cuda.is_available():
    _why = ("no GPU: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); "
            "the GPU routes are covered here by tests/test_gpu_contracts.py (fake device and NCCL) and "
            "tests/test_gpu_unit.py")
    print(f"tests/test_cuda.py skipped: {_why}")
    pytest.skip(_why, allow_module_level=True)

import helpers  # noqa: E402
import hpccomm  # noqa: E402
from hpccomm._gpu import findings, select  # noqa: E402
from helpers import hgroup, Problems, assert_close, verdict_comm  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.mpi]
R = dist.ReduceOp
TRANSPORTS = ["mpi", "composed", "nccl", "staged", "auto"]


def _device():
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture(params=TRANSPORTS)
def transport(request, world, groups):
    """Run one test with its transport forced on every test group
    (hpccomm.gpu.set_transport), and check afterwards, asking hpccomm, that
    its ops ran on that transport; skip (on every rank alike) where this
    machine lacks it."""
    name = request.param
    caps = findings.capabilities()
    try:
        select.route_table([select.Facts.of(name, None, caps)])
        mine = None
    except select.NoTransport as exc:
        mine = str(exc)
    if mine is None and name == "nccl" and hpccomm.local_size() > torch.cuda.device_count():
        mine = (f"{hpccomm.local_size()} ranks share {torch.cuda.device_count()} GPU(s) on a node; NCCL needs "
                "one GPU per rank")
    everyone = verdict_comm().allgather(mine)
    missing = [m for m in everyone if m]
    if missing:
        pytest.skip(f"transport {name} not available: {missing[0]}")
    pgs = [g.pg for g in groups if g.member]
    try:
        for pg in pgs:
            hpccomm.gpu.set_transport(name, group=pg)
        yield name
        torch.cuda.synchronize()
        ran, allowed = set(), set()
        for pg in pgs:
            ran |= {route.split(" ")[0] for route in hpccomm.gpu.taken(pg).values()}
            for table in hpccomm.gpu.routes(pg).values():  # (what NCCL cannot take goes to the fallback)
                allowed |= {table} if isinstance(table, str) else \
                    {table["reduction"], table["movement"], table["p2p"], table["fallback"], table["reduce_scatter"]}
        if name in ("mpi", "staged"):
            allowed = {name}
        assert ran and ran <= allowed, f"transport {name}: the ops ran on {ran or 'no transport'}, not {allowed}"
    finally:
        for pg in pgs:
            hpccomm.gpu.set_transport(None, group=pg)


def _both(make):
    """The same values on the GPU and on the CPU."""
    cpu = make()
    return cpu.to(_device()), cpu


def _check(problems, what, gpu, cpu, dtype=None, n_terms=1):
    try:
        assert_close(gpu.cpu(), cpu, dtype or cpu.dtype, n_terms)
    except AssertionError as exc:
        problems.append(f"{what}: {exc}")


REDUCE_CASES = [(torch.float32, R.SUM), (torch.float32, R.MAX), (torch.float64, R.AVG),
                (torch.bfloat16, R.SUM), (torch.float16, R.AVG), (torch.int64, R.SUM), (torch.int32, R.MIN)]


@pytest.mark.parametrize("dtype,op", REDUCE_CASES, ids=[f"{str(d)[6:]}-{o}" for d, o in REDUCE_CASES])
def test_all_reduce(transport, groups, dtype, op):
    problems = Problems()
    for g in groups:
        if not g.member:
            continue
        gpu, cpu = _both(lambda: (torch.arange(1000) % 7 + g.rank + 1).to(dtype))
        dist.all_reduce(gpu, op=op, group=g.pg)
        dist.all_reduce(cpu, op=op, group=g.pg)
        torch.cuda.synchronize()
        _check(problems, f"{g.name} all_reduce {dtype} {op}", gpu, cpu, n_terms=g.size)
        if dtype == torch.float32 and op == R.SUM:
            ref = (torch.arange(1000) % 7).float() * g.size + g.size * (g.size + 1) / 2
            _check(problems, f"{g.name} closed form", gpu, ref)
    problems.verdict()


def test_all_reduce_async_and_stream_order(transport, groups):
    """An async op on a tensor written by a kernel just before, read by a
    kernel just after wait(): the stream order the transports promise."""
    problems = Problems()
    g = groups[0]
    n = g.size
    x = torch.empty(1 << 20, device=_device())
    for i in range(3):
        x.fill_(float(g.rank + i))  # a kernel on the current stream, not yet done
        work = dist.all_reduce(x, async_op=True, group=g.pg)
        work.wait()
        y = x * 2  # a kernel after wait()
        expected = 2 * (n * (n - 1) / 2 + n * i)
        problems.expect(bool(torch.all(y == expected)), f"iteration {i}: {y[:4].tolist()} != {expected}")
    problems.verdict()


def test_broadcast_reduce(transport, groups):
    problems = Problems()
    for g in groups:
        if not g.member:
            continue
        root = g.size - 1
        gpu, cpu = _both(lambda: torch.full((33,), float(g.rank * 10)))
        dist.broadcast(gpu, group_src=root, group=g.pg)
        dist.broadcast(cpu, group_src=root, group=g.pg)
        _check(problems, f"{g.name} broadcast", gpu, cpu)
        gpu, cpu = _both(lambda: torch.arange(17.0) + g.rank)
        dist.reduce(gpu, group_dst=0, group=g.pg)
        dist.reduce(cpu, group_dst=0, group=g.pg)
        _check(problems, f"{g.name} reduce", gpu, cpu)
    torch.cuda.synchronize()
    problems.verdict()


def test_gathers_and_scatters(transport, groups):
    problems = Problems()
    for g in groups:
        if not g.member:
            continue
        n, me = g.size, g.rank
        inp_gpu, inp_cpu = _both(lambda: torch.arange(6.0) + 100 * me)
        out_gpu, out_cpu = torch.zeros(6 * n, device=_device()), torch.zeros(6 * n)
        dist.all_gather_into_tensor(out_gpu, inp_gpu, group=g.pg)
        dist.all_gather_into_tensor(out_cpu, inp_cpu, group=g.pg)
        _check(problems, f"{g.name} all_gather_into_tensor", out_gpu, out_cpu)
        lst_gpu = [torch.zeros(6, device=_device()) for _ in range(n)]
        lst_cpu = [torch.zeros(6) for _ in range(n)]
        dist.all_gather(lst_gpu, inp_gpu, group=g.pg)
        dist.all_gather(lst_cpu, inp_cpu, group=g.pg)
        for i in range(n):
            _check(problems, f"{g.name} all_gather[{i}]", lst_gpu[i], lst_cpu[i])
        big_gpu, big_cpu = _both(lambda: torch.arange(4.0 * n) * (me + 1))
        rs_gpu, rs_cpu = torch.zeros(4, device=_device()), torch.zeros(4)
        dist.reduce_scatter_tensor(rs_gpu, big_gpu, group=g.pg)
        dist.reduce_scatter_tensor(rs_cpu, big_cpu, group=g.pg)
        _check(problems, f"{g.name} reduce_scatter_tensor", rs_gpu, rs_cpu, n_terms=n)
        parts_gpu = list(big_gpu.chunk(n))
        parts_cpu = list(big_cpu.chunk(n))
        dist.reduce_scatter(rs_gpu, parts_gpu, group=g.pg)
        dist.reduce_scatter(rs_cpu, parts_cpu, group=g.pg)
        _check(problems, f"{g.name} reduce_scatter", rs_gpu, rs_cpu, n_terms=n)
        gl_gpu = [torch.zeros(6, device=_device()) for _ in range(n)] if me == 0 else None
        gl_cpu = [torch.zeros(6) for _ in range(n)] if me == 0 else None
        dist.gather(inp_gpu, gl_gpu, group_dst=0, group=g.pg)
        dist.gather(inp_cpu, gl_cpu, group_dst=0, group=g.pg)
        if me == 0:
            for i in range(n):
                _check(problems, f"{g.name} gather[{i}]", gl_gpu[i], gl_cpu[i])
        sc_gpu, sc_cpu = torch.zeros(6, device=_device()), torch.zeros(6)
        src_gpu = [torch.full((6,), float(i), device=_device()) for i in range(n)] if me == 0 else None
        src_cpu = [torch.full((6,), float(i)) for i in range(n)] if me == 0 else None
        dist.scatter(sc_gpu, src_gpu, group_src=0, group=g.pg)
        dist.scatter(sc_cpu, src_cpu, group_src=0, group=g.pg)
        _check(problems, f"{g.name} scatter", sc_gpu, sc_cpu)
    torch.cuda.synchronize()
    problems.verdict()


def test_all_to_all(transport, groups):
    problems = Problems()
    for g in groups:
        if not g.member:
            continue
        n, me = g.size, g.rank
        a_gpu, a_cpu = _both(lambda: torch.arange(3.0 * n) + 1000 * me)
        o_gpu, o_cpu = torch.zeros(3 * n, device=_device()), torch.zeros(3 * n)
        dist.all_to_all_single(o_gpu, a_gpu, group=g.pg)
        dist.all_to_all_single(o_cpu, a_cpu, group=g.pg)
        _check(problems, f"{g.name} all_to_all_single", o_gpu, o_cpu)
        ins = [torch.full((r + 1,), float(me), device=_device()) for r in range(n)]
        outs = [torch.zeros(me + 1, device=_device()) for _ in range(n)]
        dist.all_to_all(outs, ins, group=g.pg)
        for r in range(n):
            _check(problems, f"{g.name} all_to_all[{r}]", outs[r], torch.full((me + 1,), float(r)))
    torch.cuda.synchronize()
    problems.verdict()


@pytest.mark.mpi(min_size=2)  # a ring of one rank: nothing to send
def test_send_recv_ring(transport, world):
    rank, n = world
    problems = Problems()
    send = torch.full((1000,), float(rank), device=_device())
    recv = torch.zeros(1000, device=_device())
    ops = [dist.P2POp(dist.isend, send, (rank + 1) % n), dist.P2POp(dist.irecv, recv, (rank - 1) % n)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    torch.cuda.synchronize()
    problems.expect(bool(torch.all(recv == float((rank - 1) % n))), f"ring: {recv[:3].tolist()}")
    problems.verdict()


def test_random_sequence_against_the_cpu_path(transport, world):
    """tests/gpu_sequence.py on real CUDA tensors: every op family, dtype,
    ReduceOp and layout, each result equal to the CPU path's, inputs untouched."""
    import gpu_sequence

    rank, n = world
    device = gpu_sequence.Device(to_device=lambda t: t.to(_device()), to_host=lambda t: t.cpu())
    steps = gpu_sequence.battery(n, transport != "nccl") + gpu_sequence.draw(11 + n, 80, n,
                                                                              any_source=transport != "nccl")
    report = gpu_sequence.run(0, 0, device, steps=steps)
    everyone = verdict_comm().allgather(report.problems)
    problems = [f"rank {r}: {p}" for r, ps in enumerate(everyone) for p in ps]
    assert not problems, "\n".join(problems[:30])
