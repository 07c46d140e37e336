"""The GPU routes against fakes that hold NCCL's and CUDA's contracts, at 1-4 ranks.

tests/fake_gpu.py: a fake CUDA device whose host-visible memory goes stale
under pending kernels (MPI reads that memory: a missing synchronisation sends
stale data) and a fake NCCL that refuses what torch's NCCL group refuses
(strided tensors, its missing dtypes and ReduceOps, any-source receives, two
ranks on one GPU).  Every route runs for real over MPI through
torch.distributed calls: a random sequence of ops (tests/gpu_sequence.py:
every op family, dtype, ReduceOp and layout) on fake device tensors, each
checked against the same op on CPU tensors, identical on every rank, inputs
untouched.  The tests of the harness itself show that it catches what it is
for: a transport without its synchronisation, and a call NCCL would refuse.
"""
from __future__ import annotations

import contextlib
import traceback

import pytest
import torch
import torch.distributed as dist

import fake_gpu
import gpu_sequence
import hpccomm
from fake_gpu import DEVICE, FakeNCCL, FakeStreams, NcclRefused, fake_nccl_maker, fake_pinned
from helpers import hgroup
from hpccomm._gpu import findings, select, transports
from hpccomm._gpu.cuda_mpi import CudaAwareMPI
from hpccomm._gpu.nccl_torch import TorchNCCL
from hpccomm._gpu.probe import Finding
from hpccomm._gpu.staged import Staged

R = dist.ReduceOp
FAKE = gpu_sequence.Device(to_device=DEVICE.tensor, to_host=lambda t: DEVICE.value(t).contiguous())


@contextlib.contextmanager
def fake_gpus(shared=False, mpi_cuda=True, nccl=True, reductions=None, streams=FakeStreams, movement=None,
              scatter=None):
    """The world group's CUDA routes over the fakes: each rank on a GPU of its
    own (or all on one), with the findings given; NCCL's own channel a
    duplicate of the group's communicator.  Every rank enters it together."""
    g = hgroup(dist.group.WORLD)
    rank, size = dist.get_rank(), dist.get_world_size()
    gpu = ("node", "GPU-0" if shared else f"GPU-{rank}")
    channel = g.comm.Dup()
    caps = select.Capabilities(Finding(mpi_cuda, f"injected {mpi_cuda}"), Finding(nccl, "injected"),
                               Finding(False, "injected"), Finding(reductions, "injected"), Finding(movement, "injected"),
                               Finding(scatter, "injected"))
    made = {}

    def nccl_transport(device, reason):
        made["nccl"] = TorchNCCL(device, reason, make_backend=fake_nccl_maker(channel, gpu))
        return made["nccl"]

    def staged(device, reason):
        # (pipelined from 24 bytes, in chunks of 8: the battery's tensors go through the pipeline too)
        return Staged(device, reason, streams=streams(), alloc=fake_pinned, pipeline_bytes=24, chunk_bytes=8)

    # the world group's transports over the fakes (and its routes made anew: hpccomm._gpu.transports.build_with)
    transports.build_with(g, {
        select.MPI: lambda device, reason: CudaAwareMPI(device, reason, streams=streams()),
        select.COMPOSED: lambda device, reason: CudaAwareMPI(device, reason, streams=streams(), composed=True),
        select.STAGED: staged,
        select.NCCL_TORCH: nccl_transport,
    })
    try:
        with findings.assumed(caps, identify=lambda device: (gpu, 1 if shared else size)):
            yield made
    finally:
        hpccomm.gpu.set_transport(None)
        hpccomm.gpu.set_routes()
        transports.build_with(g, None)
        DEVICE.flush()
        channel.Free()


def verdict(report: gpu_sequence.Report) -> None:
    """Every rank's problems, asserted on every rank."""
    everyone = fake_gpu_comm().allgather((report.ops, report.problems))
    problems = [f"rank {r}: {p}" for r, (_, ps) in enumerate(everyone) for p in ps]
    assert all(ops > 0 for ops, _ in everyone)
    assert not problems, "\n".join(problems[:30])


def fake_gpu_comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


# name -> (setting, ranks share one GPU, CUDA-aware MPI, MPI reduces on the device, MPI moves device memory fast,
# routes (reduction, movement, p2p, fallback), the same at one rank (who shares a GPU with nobody), receives from
# any source work, per-family routes forced; optionally, whether the MPI's own reduce_scatter is fast, and then
# the reduce_scatter ops' route)
SCENARIOS = {
    "auto-nccl-no-cuda-mpi": ("auto", False, False, None, None, ("nccl", "nccl", "staged", "staged"), None, True, {}),
    "auto-nccl-reductions-mpi-movement": ("auto", False, True, False, True, ("nccl", "mpi", "mpi", "mpi"), None,
                                          True, {}),
    "auto-mpi-reduces-on-device": ("auto", False, True, True, None, ("mpi",) * 4, None, True, {}),
    "auto-mpi-reduces-moves-slowly": ("auto", False, True, True, False, ("mpi", "nccl", "mpi", "mpi"), None, True,
                                      {}),
    "auto-shared-gpu-cuda-mpi": ("auto", True, True, False, True, ("composed", "mpi", "mpi", "mpi"),
                                 ("nccl", "mpi", "mpi", "mpi"), True, {}),
    "auto-shared-gpu-nothing": ("auto", True, False, None, None, ("staged",) * 4,
                                ("nccl", "nccl", "staged", "staged"), True, {}),
    "forced-nccl-fallback-staged": ("nccl", False, False, None, None, ("nccl", "nccl", "nccl", "staged"), None,
                                    False, {}),
    "forced-nccl-fallback-composed": ("nccl", False, True, False, True, ("nccl", "nccl", "nccl", "mpi"), None,
                                      False, {}),
    "forced-mpi": ("mpi", False, True, None, None, ("mpi",) * 4, None, True, {}),
    "forced-composed": ("composed", True, True, None, None, ("composed", "mpi", "mpi", "mpi"), None, True, {}),
    "forced-staged": ("staged", True, False, None, None, ("staged",) * 4, None, True, {}),
    "auto-intel-mpi-shared-gpu": ("auto", True, True, True, False, ("mpi",) * 4, ("mpi", "nccl", "mpi", "mpi"), True,
                                  {}, False, "composed"),
    "routes-reduction-composed-movement-staged": ("auto", False, True, True, True, ("composed", "staged", "mpi", "mpi"),
                                                  None, True, {"reduction": "composed", "movement": "staged"}),
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_routes_match_the_cpu_path(world, name):
    """Each scenario's routes are the ones the table names, and run a random
    sequence of ops on fake device tensors with the CPU path's results."""
    setting, shared, mpi_cuda, reductions, movement, expected, alone, any_source, forced, *scatter = SCENARIOS[name]
    fast_scatter, scatter_route = scatter or (None, None)
    rank, size = world
    with fake_gpus(shared=shared, mpi_cuda=mpi_cuda, reductions=reductions, movement=movement,
                   scatter=fast_scatter) as made:
        hpccomm.gpu.set_transport(setting)
        hpccomm.gpu.set_routes(**forced)
        dist.all_reduce(DEVICE.tensor(torch.ones(2)))  # the group's first collective on the device: its routes
        routes = hpccomm.gpu.routes()["cuda:0"]
        got = (routes["reduction"], routes["movement"], routes["p2p"], routes["fallback"])
        want = alone if size == 1 and alone else expected
        assert got == want, (got, want, routes["reason"])
        steps = gpu_sequence.battery(size, any_source) + gpu_sequence.draw(7 + size, 60, size, any_source=any_source)
        report = gpu_sequence.run(0, 0, FAKE, steps=steps)
        ran = hpccomm.gpu.taken()
        nccl_calls = len(made["nccl"]._make.made[0].calls) if "nccl" in made and made["nccl"].backend else 0
        verdict(report)
    assert (nccl_calls > 0) == ("nccl" in want[:3]), (nccl_calls, want)  # NCCL ran exactly where it is a route
    assert routes["reduce_scatter"] == (scatter_route or want[0]), routes
    if scatter_route:  # (reductions on MPI routes: none falls back, so what ran last is the route)
        assert ran["reduce_scatter_tensor"] == ran["reduce_scatter"] == scatter_route, ran
        assert ran["all_reduce"] == ran["reduce"] == want[0], ran


@pytest.mark.mpi
def test_forced_nccl_on_a_shared_gpu_is_refused_on_every_rank(world):
    rank, size = world
    if size == 1:
        with fake_gpus(shared=True):
            hpccomm.gpu.set_transport("nccl")
            t = DEVICE.tensor(torch.ones(2))
            dist.all_reduce(t)  # one rank on its GPU: NCCL serves
            assert DEVICE.value(t).tolist() == [1.0, 1.0]
            assert hpccomm.gpu.routes()["cuda:0"]["reduction"] == "nccl"
        return
    with fake_gpus(shared=True):
        hpccomm.gpu.set_transport("nccl")
        with pytest.raises(hpccomm.OpTypeError) as info:
            dist.all_reduce(DEVICE.tensor(torch.ones(2)))
    msg = str(info.value)
    assert f"rank {rank}/{size}" in msg and "HPCCOMM_GPU_TRANSPORT=nccl but ranks " in msg, msg
    assert "share one GPU, and NCCL refuses two ranks on one GPU. Set HPCCOMM_GPU_TRANSPORT=auto" in msg, msg
    shown = "".join(traceback.format_exception(info.value))
    assert "During handling" not in shown and "NotOnCPU" not in shown, shown  # no unrelated exception shown


@pytest.mark.mpi(min_size=2)
def test_forced_nccl_refuses_a_receive_from_any_source(world):
    rank, size = world
    with fake_gpus():
        hpccomm.gpu.set_transport("nccl")
        dist.all_reduce(DEVICE.tensor(torch.ones(1)))
        if rank == 0:
            with pytest.raises(hpccomm.OpValueError, match="NCCL cannot receive from any source. Name the source "
                                                           "rank, or leave HPCCOMM_GPU_TRANSPORT at auto"):
                dist.recv(DEVICE.tensor(torch.zeros(2)))
        dist.barrier()


@pytest.mark.mpi
def test_rewritten_calls_are_logged_once_and_taken_says_what_ran(world, caplog):
    rank, size = world
    with fake_gpus(mpi_cuda=True, reductions=False):
        hpccomm.gpu.set_transport("nccl")
        with caplog.at_level("INFO", logger="hpccomm"):
            for _ in range(2):
                t = DEVICE.tensor(torch.arange(6, dtype=torch.int16).reshape(2, 3).t())
                dist.all_reduce(t)
                b = DEVICE.tensor(torch.tensor([1, 2, 3], dtype=torch.int32))
                dist.all_reduce(b, op=R.BAND)
        taken = hpccomm.gpu.taken()
    said = [r.getMessage() for r in caplog.records if "all_reduce of int16 SUM goes through nccl" in r.getMessage()]
    assert len(said) == 1, said
    assert "strided tensor through a contiguous copy" in said[0] and "int16 SUM widened to int32" in said[0]
    assert taken["all_reduce"] == "composed (nccl cannot take it exactly)", taken  # the last call: BAND of int32
    assert DEVICE.value(b).tolist() == [1, 2, 3]
    expected = torch.arange(6, dtype=torch.int16).reshape(2, 3).t() * size
    assert torch.equal(DEVICE.value(t), expected)


class NoSync(FakeStreams):
    """A transport's streams with the synchronisation forgotten."""

    def wait(self, event) -> None:
        self.log.append("wait")

    def synchronize(self, device) -> None:
        self.log.append("synchronize")


class OutOfOrder(FakeStreams):
    """The staged pipeline's streams with each chunk waited for one chunk late
    (its MPI call reads a chunk whose copy to the host has not landed)."""

    def __init__(self) -> None:
        super().__init__()
        self.previous = None

    def wait(self, event) -> None:
        self.log.append("wait")
        if self.previous is not None:
            self.device.flush(self.previous)
        self.previous = event


@pytest.mark.mpi
def test_the_harness_catches_a_missing_synchronisation(world):
    """Without its synchronisations, the CUDA-aware MPI route hands MPI memory
    that the op's own copy kernel has not reached yet: the harness sees the
    wrong result (so a pass elsewhere means the synchronisations are there)."""
    rank, size = world
    with fake_gpus(mpi_cuda=True, streams=NoSync):
        hpccomm.gpu.set_transport("mpi")
        base = DEVICE.tensor(torch.arange(8.0) + rank)
        view = base[::2]  # strided: the route copies it to a contiguous buffer (a kernel) before MPI reads
        out = DEVICE.tensor(torch.zeros(4 * size))
        dist.all_gather_into_tensor(out, view)
        got = DEVICE.value(out)
    want = torch.cat([torch.arange(0.0, 8.0, 2.0) + r for r in range(size)])
    everyone = fake_gpu_comm().allgather(torch.equal(got, want))
    assert not any(everyone), "a missing synchronisation went unseen"


@pytest.mark.mpi
def test_the_staged_pipeline_overlaps_in_order(world):
    """The pipelined staging: every chunk's MPI call after that chunk's copy
    to the host landed (a pipeline waiting one chunk late is caught: stale
    memory), copies back after each call, the op complete when the last one
    landed."""
    rank, size = world
    n = 10
    want = (torch.arange(float(n)) * size + size * (size - 1) / 2).tolist()
    for streams, right in ((FakeStreams, True), (OutOfOrder, False)):
        made = {}

        def record(device, reason, streams=streams):
            made["staged"] = Staged(device, reason, streams=streams(), alloc=fake_pinned, pipeline_bytes=24,
                                    chunk_bytes=8)
            return made["staged"]

        with fake_gpus(mpi_cuda=False, nccl=False):
            transports.build_with(hgroup(dist.group.WORLD), {select.STAGED: record})
            t = DEVICE.tensor(torch.arange(float(n)) + rank)
            dist.all_reduce(t)
            got = DEVICE.value(t).tolist()
        everyone = fake_gpu_comm().allgather(got == want)
        if right:
            assert all(everyone), (got, want)
            log = made["staged"].streams.log
            chunks = 5  # 40 bytes in chunks of 8
            assert log[:chunks + 3] == ["record"] + ["copy-in"] * chunks + ["wait", "copy-back"], log
            assert log.count("copy-in") == log.count("copy-back") == chunks and log[-1] == "wait", log
        else:
            assert not all(everyone), "a pipeline waiting one chunk late went unseen"


def test_fake_nccl_refuses_what_nccl_refuses():
    from mpi4py import MPI

    backend = FakeNCCL(MPI.COMM_SELF, 0, 1, ("node", "GPU-0"))
    opts = hpccomm._compat.OPTION_CLASSES["allreduce"]()
    strided = DEVICE.tensor(torch.zeros(4, 2))[:, 0]
    cases = [
        ([strided], "Tensors must be contiguous"),
        ([DEVICE.tensor(torch.zeros(2, dtype=torch.int16))], "Unconvertible NCCL type Short"),
        ([DEVICE.tensor(torch.zeros(2, dtype=torch.uint32))], "Unconvertible NCCL type"),
        ([DEVICE.tensor(torch.zeros(2, dtype=torch.complex64))], "Unconvertible NCCL type ComplexFloat"),
        ([torch.zeros(2)], "Tensors must be CUDA and dense"),
    ]
    for tensors, message in cases:
        with pytest.raises(NcclRefused, match=message):
            backend.allreduce(tensors, opts)
    for kind in (R.BAND, R.BOR, R.BXOR):
        opts.reduceOp = kind
        with pytest.raises(NcclRefused, match=f"Cannot use ReduceOp.{str(kind).split('.')[-1]} with NCCL"):
            backend.allreduce([DEVICE.tensor(torch.ones(2, dtype=torch.int32))], opts)
    opts.reduceOp = R.AVG
    with pytest.raises(NcclRefused, match="Cannot use ReduceOp.AVG with boolean inputs"):
        backend.allreduce([DEVICE.tensor(torch.ones(2, dtype=torch.bool))], opts)
    with pytest.raises(NcclRefused, match="recvAnysource is not supported by NCCL"):
        backend.recv([DEVICE.tensor(torch.zeros(2))], None, 0)
    opts.reduceOp = R.SUM
    t = DEVICE.tensor(torch.ones(3))
    backend.allreduce([t], opts)  # what NCCL takes, it runs: a kernel, not yet in host memory
    assert DEVICE.value(t).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.mpi(min_size=2)
def test_fake_nccl_refuses_two_ranks_on_one_gpu(world):
    rank, size = world
    channel = hgroup(dist.group.WORLD).comm.Dup()
    try:
        backend = FakeNCCL(channel, rank, size, ("node", "GPU-0"))
        opts = hpccomm._compat.OPTION_CLASSES["allreduce"]()
        with pytest.raises(NcclRefused, match="Duplicate GPU detected : rank"):
            backend.allreduce([DEVICE.tensor(torch.ones(2))], opts)
    finally:
        channel.Free()


def test_the_fake_device_serves_stale_memory_until_synchronised():
    t = DEVICE.tensor(torch.arange(4.0))
    t.mul_(2)
    assert DEVICE.memory(t).tolist() == [0.0, 1.0, 2.0, 3.0] and DEVICE.value(t).tolist() == [0.0, 2.0, 4.0, 6.0]
    made = torch.cat([t, t])
    assert not torch.equal(DEVICE.memory(made), DEVICE.value(made))  # a new tensor: garbage until synchronised
    host = torch.empty(4)
    host.copy_(t, non_blocking=True)
    assert host.tolist() != [0.0, 2.0, 4.0, 6.0]  # a non-blocking copy lands at the next synchronisation
    DEVICE.flush()
    assert DEVICE.memory(t).tolist() == [0.0, 2.0, 4.0, 6.0] and host.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert torch.equal(DEVICE.memory(made), DEVICE.value(made)) and DEVICE.dirty() == 0


@pytest.mark.mpi
def test_bench_gpu_rows_run_the_transport_they_name(world):
    """bench_gpu sets each row's transport on every rank and labels the row
    with the route hpccomm says ran (the labels were once the init-time choice
    whatever the row said)."""
    from hpccomm.tools import bench_gpu

    rank, size = world
    with fake_gpus(mpi_cuda=True, reductions=False, movement=True):
        rows = bench_gpu.measure(["staged", "mpi", "nccl", "auto"], list(bench_gpu.OPS), [64],
                                 lambda count, value: DEVICE.tensor(torch.full((count,), value)), DEVICE.flush, 2, 1)
    assert len(rows) == 4 * len(bench_gpu.OPS) and all(r["correct"] for r in rows), rows
    for r in rows:
        ran = r["ran"].split(" ")[0]
        if r["transport"] == "auto":  # the table's choice: NCCL reduces, CUDA-aware MPI moves data
            assert ran == ("nccl" if r["op"] in ("all_reduce", "reduce_scatter") else "mpi"), r
        else:
            assert ran == r["transport"], r
    table = bench_gpu.render(rows)
    assert table.splitlines()[0].split()[:3] == ["asked", "ran", "op"] and "WRONG" not in table
    with fake_gpus(mpi_cuda=True, reductions=False, movement=True):
        rows = bench_gpu.measure(["composed"], list(bench_gpu.OPS), [64],
                                 lambda count, value: DEVICE.tensor(torch.full((count,), value)), DEVICE.flush, 2, 1)
    assert {r["op"] for r in rows} == {"all_reduce", "reduce_scatter"} and all(r["correct"] for r in rows), rows
    assert {r["ran"] for r in rows} == {"composed"}, rows


def test_bench_gpu_compare_table():
    rows = [{"transport": t, "ran": t, "op": "all_reduce", "bytes": 1024, "time_us": us, "algbw_GBps": 1.0,
             "busbw_GBps": 2.0, "correct": True} for t, us in (("nccl", 10.0), ("staged", 40.0), ("gloo", 20.0))]
    lines = __import__("hpccomm.tools.bench_gpu").tools.bench_gpu.compare_table(rows).splitlines()
    assert lines[0].split()[:4] == ["op", "bytes", "nccl", "us"], lines
    assert lines[1].endswith("nccl 0.50, staged 2.00"), lines


def test_an_event_brings_exactly_the_kernels_before_it_to_memory():
    a, b = DEVICE.tensor(torch.zeros(2)), DEVICE.tensor(torch.zeros(2))
    a.fill_(1.0)
    event = DEVICE.record()
    b.fill_(2.0)
    a.add_(1.0)
    DEVICE.flush(event)
    assert DEVICE.memory(a).tolist() == [1.0, 1.0] and DEVICE.memory(b).tolist() == [0.0, 0.0]
    assert DEVICE.value(a).tolist() == [2.0, 2.0] and DEVICE.dirty() == 2
    DEVICE.flush()
    assert DEVICE.memory(a).tolist() == [2.0, 2.0] and DEVICE.memory(b).tolist() == [2.0, 2.0]
    assert DEVICE.dirty() == 0
