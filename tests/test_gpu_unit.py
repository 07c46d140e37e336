"""GPU transports without a GPU: probes, selection, routing, stream ordering,
staging, NCCL delegation and binding, with injected probes and fake devices.

Nothing here fakes a result of communication: the probes' inputs are
injected (and the real probes are asked about this machine's real MPI), the
stream and NCCL objects are recorders that check which calls are made in
which order, and every op that communicates runs for real over MPI on host
memory: ``FakeCudaTensor`` is a CPU tensor that says it lives on cuda:0 (as
mpi4py's own tests use a fake GPU array), so the device code paths run with
memory MPI can read.

Plain pytest tests run without a launcher (MPI starts as a singleton where
needed); ``@pytest.mark.mpi`` tests run under ``mpirun`` (tests/run.sh) and
compare the staged transport with hpccomm's plain CPU ops and with closed
forms.
"""
from __future__ import annotations

import logging
import re
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import hpccomm
import helpers
from hpccomm import _mpi, config
from hpccomm import _compat as compat
from hpccomm._core import group as _group
from hpccomm._ops import op_path
from hpccomm._gpu import cuda_mpi, dispatch, nccl_cupy, nccl_torch, probe, select, staged
from hpccomm._gpu.probe import Finding
from hpccomm._gpu.select import Capabilities, NoTransport
from hpccomm._ops import reduce, table
from hpccomm._core.plan import ARGS, OUTPUTS, run
from helpers import hgroup, FakeCudaTensor, Problems, raised_by

R = dist.ReduceOp


# --------------------------------------------------------------------------
# fakes
# --------------------------------------------------------------------------

class FakeCuda1Tensor(FakeCudaTensor):
    @property
    def device(self):
        return torch.device("cuda", 1)


def fake_cuda(t: torch.Tensor) -> torch.Tensor:
    return t.as_subclass(FakeCudaTensor)


CUDA0 = torch.device("cuda", 0)


def run_plan(plan):
    """Run a plan blocking, as the op path does (hpccomm._core.plan.run: its steps around ``call(*args)``); its
    outputs."""
    run(plan)
    return plan[OUTPUTS]


def mpi_types(plan) -> set:
    """The names of the MPI datatypes of the buffers a plan hands MPI."""
    return {a[2].Get_name() for a in plan[ARGS] if isinstance(a, list) and len(a) == 3}


class Recorder:
    """Stream operations and copies, recorded in order in one shared log."""

    def __init__(self, log=None) -> None:
        self.log = log if log is not None else []
        self.events = 0

    def record(self, device):
        self.events += 1
        event = f"event{self.events}"
        self.log.append(("record", str(device), event))
        return event

    def wait(self, event) -> None:
        self.log.append(("wait", event))

    def synchronize(self, device) -> None:
        self.log.append(("synchronize", str(device)))

    def copy(self, dst, src) -> None:
        self.log.append(("copy", "to-device" if getattr(dst, "is_cuda", False) else "to-host", tuple(src.shape)))
        dst.copy_(src)

    def names(self):
        return [e[0] for e in self.log]


class CountingAlloc:
    """Host buffers from plain (unpinned: no GPU here) memory, counted."""

    def __init__(self) -> None:
        self.sizes = []

    def __call__(self, nbytes: int) -> torch.Tensor:
        self.sizes.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def caps(mpi=False, torch_nccl=False, cupy=False) -> Capabilities:
    return Capabilities(Finding(mpi, f"injected mpi={mpi}"), Finding(torch_nccl, f"injected torch={torch_nccl}"),
                        Finding(cupy, f"injected cupy={cupy}"))



def fake_group(rank: int = 1, size: int = 4, store=None):
    return helpers.fake_group(rank, size, store, timedelta(seconds=42), done=2)


@pytest.fixture(scope="module")
def MPI():
    return _mpi.mpi()


@pytest.fixture
def self_group(MPI):
    """A real hpccomm group of one rank (MPI_COMM_SELF), communicating for real."""
    g = _group.world(MPI.COMM_SELF, name="self")
    yield g
    dispatch.release(g)
    g.free()


def _well_formed(msg: str) -> None:
    assert "  " not in msg and ".." not in msg and not msg.endswith((".", " ")), msg
    assert "{" not in msg and "}" not in msg, msg


# --------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------

@pytest.mark.parametrize("raw,value", [("", "auto"), ("auto", "auto"), (" NCCL ", "nccl"), ("mpi", "mpi"),
                                       ("Staged", "staged")])
def test_gpu_transport_option(monkeypatch, raw, value):
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", raw)
    assert config.get("HPCCOMM_GPU_TRANSPORT") == value


def test_bad_gpu_options_name_the_variable(monkeypatch):
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "ucx")
    with pytest.raises(hpccomm.ConfigError, match=r"^HPCCOMM_GPU_TRANSPORT='ucx' is not one of auto, mpi, nccl, "
                       r"staged$"):
        config.get("HPCCOMM_GPU_TRANSPORT")
    monkeypatch.setenv("HPCCOMM_GPU_BIND", "round_robin")
    with pytest.raises(hpccomm.ConfigError, match=r"^HPCCOMM_GPU_BIND='round_robin' is not one of local_rank, "
                       r"none$"):
        config.get("HPCCOMM_GPU_BIND")


# --------------------------------------------------------------------------
# probe: is the MPI library CUDA-aware?
# --------------------------------------------------------------------------

OMPI = "Open MPI v5.0.3, package: Open MPI ..., ident: 5.0.3"
MPICH = "MPICH Version:      4.2.1\nMPICH Release date: ..."
INTEL = "Intel(R) MPI Library 2021.12 for Linux* OS"
MVAPICH = "MVAPICH2 Version      :\t2.3.7"
CRAY = "MPI VERSION    : CRAY MPICH version 8.1.28.29 (ANL base 3.4a2)"
OTHER = "Spectrum-ish MPI 10.4"


def symbols(**answers):
    """``symbol(name)`` answering the given functions' return values; others absent."""
    calls = []

    def symbol(name):
        if name not in answers:
            return None

        def fn(*args):
            calls.append((name, args))
            return answers[name]

        return fn

    symbol.calls = calls
    return symbol


# (library, alloc_kinds, symbol answers, env, expected value, fragment of how)
PROBE_CASES = [
    ("ompi-yes", OMPI, None, {"MPIX_Query_cuda_support": 1}, {}, True,
     "MPIX_Query_cuda_support() returned 1 (Open MPI extension)"),
    ("ompi-no", OMPI, None, {"MPIX_Query_cuda_support": 0}, {}, False,
     "MPIX_Query_cuda_support() returned 0 (Open MPI extension)"),
    ("ompi-no-symbol", OMPI, None, {}, {}, None, "offers no CUDA-awareness query"),
    ("alloc-kinds-yes", OMPI, "system,mpi,cuda:device,cuda:managed", {"MPIX_Query_cuda_support": 0}, {}, True,
     "mpi_memory_alloc_kinds='system,mpi,cuda:device,cuda:managed' lists cuda:device (MPI 4.1)"),
    ("alloc-kinds-no", MPICH, "system,mpi", {"MPIX_GPU_query_support": 1}, {}, False,
     "does not list cuda:device"),
    ("mpich-yes", MPICH, None, {"MPIX_GPU_query_support": 1}, {}, True,
     "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) set the flag to 1 (MPICH extension)"),
    ("mpich-no", MPICH, None, {"MPIX_GPU_query_support": 0}, {}, False, "set the flag to 0"),
    ("mpich-cvar-off", MPICH, None, {"MPIX_GPU_query_support": 1}, {"MPIR_CVAR_ENABLE_GPU": "0"}, False,
     "MPIR_CVAR_ENABLE_GPU=0 turns GPU support off"),
    ("mpich-old", MPICH, None, {}, {}, None, "offers no CUDA-awareness query"),
    ("intel-offload", INTEL, None, {}, {"I_MPI_OFFLOAD": "1"}, True, "Intel MPI with I_MPI_OFFLOAD=1"),
    ("intel-unset", INTEL, None, {"MPIX_GPU_query_support": 1}, {}, False, "only with I_MPI_OFFLOAD=1 (it is unset)"),
    ("intel-zero", INTEL, None, {}, {"I_MPI_OFFLOAD": "0"}, False, "(it is 0)"),
    ("mvapich-yes", MVAPICH, None, {"MPIX_Query_cuda_support": 1}, {"MV2_USE_CUDA": "1"}, True,
     "returned 1 (MVAPICH2 extension)"),
    ("mvapich-not-enabled", MVAPICH, None, {"MPIX_Query_cuda_support": 1}, {}, False,
     "only with MV2_USE_CUDA=1"),
    ("mvapich-old-on", MVAPICH, None, {}, {"MV2_USE_CUDA": "1"}, True, "MV2_USE_CUDA is 1"),
    ("mvapich-old-off", MVAPICH, None, {}, {}, False, "MV2_USE_CUDA is unset"),
    ("cray-on", CRAY, None, {"MPIX_GPU_query_support": 1}, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, True,
     "set the flag to 1"),
    ("cray-off", CRAY, None, {"MPIX_GPU_query_support": 1}, {}, False, "MPICH_GPU_SUPPORT_ENABLED=1"),
    ("other", OTHER, None, {}, {}, None, "Spectrum-ish MPI 10.4 offers no CUDA-awareness query"),
]


@pytest.mark.parametrize("case", PROBE_CASES, ids=[c[0] for c in PROBE_CASES])
def test_mpi_cuda_support(case):
    _, library, kinds, answers, env, value, how = case
    found = probe.mpi_cuda_support(library, kinds, symbols(**answers), env)
    assert found.value is value, found
    assert how in found.how, found.how
    assert found.word() == {True: "yes", False: "no", None: "unknown"}[value]


def test_mpich_query_asks_for_cuda():
    sym = symbols(MPIX_GPU_query_support=1)
    probe.mpi_cuda_support(MPICH, None, sym, {})
    assert sym.calls == [("MPIX_GPU_query_support", (probe.MPIX_GPU_SUPPORT_CUDA,))]


@pytest.mark.parametrize("text,family", [(OMPI, "openmpi"), (MPICH, "mpich"), (INTEL, "intel"),
                                         (MVAPICH, "mvapich"), (CRAY, "cray"), (OTHER, "other")])
def test_library_family(text, family):
    assert probe.library_family(text) == family


def test_real_probe_on_this_machine(MPI):
    """The real probe asks this process's MPI library (no injection).  What it
    answers is a fact about the installed library, reported as found."""
    found = probe.probe_mpi_cuda(MPI)
    assert found.value in (True, False, None)
    library = MPI.Get_library_version()
    if probe.library_family(library) == "openmpi":
        path = probe.loaded_libmpi()
        assert path and "libmpi" in path, path
        assert probe.ctypes_symbol(path)("MPIX_Query_cuda_support") is not None
        assert found.how.startswith("MPIX_Query_cuda_support() returned "), found.how
        print(f"this machine: CUDA-aware MPI = {found.word()} ({found.how})")


def test_ctypes_symbol_absent():
    assert probe.ctypes_symbol(None)("MPIX_Query_cuda_support") is None


def test_nccl_probes():
    assert probe.probe_nccl_torch(lambda: False) == Finding(
        False, "torch.distributed.is_nccl_available() is False (this torch has no NCCL)")
    assert probe.probe_nccl_torch(lambda: True).value is True

    def broken(name):
        raise ImportError("libnccl.so.2: cannot open shared object file")

    found = probe.probe_nccl_cupy(broken)
    assert found == Finding(False, "importing cupy.cuda.nccl failed: ImportError: libnccl.so.2: cannot open shared "
                                   "object file")

    class Nccl:
        available = True

        @staticmethod
        def get_version():
            return 22105

    assert probe.probe_nccl_cupy(lambda name: Nccl) == Finding(True, "cupy.cuda.nccl imported (NCCL 22105)")


# --------------------------------------------------------------------------
# selection: every combination of findings, variable and backend map
# --------------------------------------------------------------------------

def expected_choice(requested, mpi, torch_nccl, cupy, mapped):
    """The rule, written independently of select.choose: a transport name or
    ("error", fragments the message must hold)."""
    nccl = "nccl" if torch_nccl else "nccl-cupy" if cupy else None
    if mapped == "gloo":
        return ("error", ["maps cuda to 'gloo'"])
    if mapped == "nccl":
        return nccl or ("error", ["maps cuda to nccl but no NCCL is available"])
    if requested == "staged":
        return "staged"
    if requested == "mpi":
        return ("error", ["HPCCOMM_GPU_TRANSPORT=mpi but the MPI library is not CUDA-aware"]) if mpi is False \
            else "mpi"
    if requested == "nccl":
        return nccl or ("error", ["HPCCOMM_GPU_TRANSPORT=nccl but no NCCL is available"])
    if mpi is True:
        return "mpi"
    return nccl or ("error", ["no GPU transport", "Set HPCCOMM_GPU_TRANSPORT=staged",
                              "HPCCOMM_GPU_TRANSPORT=mpi if you know"])


COMBOS = [(req, m, t, c, mp) for req in ("auto", "mpi", "nccl", "staged") for m in (True, False, None)
          for t in (True, False) for c in (True, False) for mp in (None, "nccl", "gloo")]


@pytest.mark.parametrize("requested,mpi,torch_nccl,cupy,mapped", COMBOS)
def test_choose(requested, mpi, torch_nccl, cupy, mapped):
    want = expected_choice(requested, mpi, torch_nccl, cupy, mapped)
    found = caps(mpi, torch_nccl, cupy)
    if isinstance(want, str):
        choice = select.choose(requested, found, mapped)
        assert choice.transport == want, choice
        _well_formed(choice.reason)
        if want == "mpi":
            assert f"injected mpi={mpi}" in choice.reason  # says how CUDA-awareness was determined
    else:
        with pytest.raises(NoTransport) as info:
            select.choose(requested, found, mapped)
        msg = str(info.value)
        for fragment in want[1]:
            assert fragment in msg, msg
        _well_formed(msg)


def test_no_transport_message_lists_every_finding():
    with pytest.raises(NoTransport) as info:
        select.choose("auto", caps(None, False, False))
    assert str(info.value) == (
        "no GPU transport: CUDA-aware MPI: unknown (injected mpi=None); NCCL through torch: no (injected "
        "torch=False); NCCL through CuPy: no (injected cupy=False). Set HPCCOMM_GPU_TRANSPORT=staged to copy "
        "through host memory (slow), or HPCCOMM_GPU_TRANSPORT=mpi if you know the MPI library is CUDA-aware, or "
        "install NCCL (a CUDA build of torch, or cupy)")


# --------------------------------------------------------------------------
# agreement across ranks, caching, logging
# --------------------------------------------------------------------------

@pytest.fixture
def injected(monkeypatch):
    """Findings and agreement injected into dispatch (restored after)."""
    monkeypatch.setattr(dispatch, "_caps", [caps()])
    monkeypatch.setattr(dispatch, "_said_staged", [False])
    seen = []

    def agree(group, mine):
        seen.append(mine)
        return [mine] * group.size

    monkeypatch.setattr(dispatch, "agree", agree)
    return seen


def test_decide_everyone_agrees(injected):
    choice = dispatch.decide(fake_group(), "all_reduce", caps(mpi=True), "auto")
    assert choice.transport == "mpi" and injected == [("mpi", None)]


def test_decide_ranks_disagree(monkeypatch):
    monkeypatch.setattr(dispatch, "agree", lambda g, mine: [mine, ("nccl", None), mine, mine])
    with pytest.raises(hpccomm.OpTypeError) as info:
        dispatch.decide(fake_group(), "all_reduce", caps(mpi=True), "auto")
    assert str(info.value) == (
        "hpccomm all_reduce (op #3 on group 'fake', rank 1/4): the ranks of this group chose different GPU "
        "transports (rank 0: mpi, rank 1: nccl, rank 2: mpi, rank 3: mpi). Give every rank the same "
        "HPCCOMM_GPU_TRANSPORT and the same MPI and NCCL")


def test_decide_another_rank_has_no_transport(monkeypatch):
    monkeypatch.setattr(dispatch, "agree", lambda g, mine: [mine, mine, (None, "no GPU transport: X"), mine])
    with pytest.raises(hpccomm.OpTypeError) as info:
        dispatch.decide(fake_group(), "broadcast", caps(mpi=True), "auto")
    assert str(info.value) == ("hpccomm broadcast (op #3 on group 'fake', rank 1/4): CUDA tensors cannot be sent "
                               "on rank(s) [2] (as rank 2 reports): no GPU transport: X")


def test_transport_chosen_once_per_group_and_device(injected, monkeypatch, caplog):
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "staged")
    g, h = fake_group(), fake_group()
    with caplog.at_level(logging.INFO, logger="hpccomm"):
        first = dispatch.transport(g, table.ALL_REDUCE, CUDA0)
        assert dispatch.transport(g, table.BROADCAST, CUDA0) is first
        other_device = dispatch.transport(g, table.ALL_REDUCE, torch.device("cuda", 1))
        other_group = dispatch.transport(h, table.ALL_REDUCE, CUDA0)
    assert isinstance(first, staged.Staged) and first.device == CUDA0
    assert other_device is not first and other_group is not first
    assert len(injected) == 3  # one agreement per (group, device)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "hpccomm: group 'fake', cuda:0: GPU transport staged (HPCCOMM_GPU_TRANSPORT=staged: copies through " \
           "pinned host memory and the CPU path)" in infos
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "staged through pinned host memory" in warnings[0], warnings
    assert dispatch.transports_of(g) == {"cuda:0": ("staged", first.reason), "cuda:1": ("staged", first.reason)}
    dispatch.release(g)
    assert dispatch.transports_of(g) == {}


def test_p2p_chooses_locally_then_a_collective_confirms(injected, monkeypatch):
    """send/recv involve two members: no agreement (a collective would hang
    the others); the group's first collective agrees and keeps that instance."""
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "staged")
    g = fake_group()
    first = dispatch.transport(g, table.SEND, CUDA0)
    assert dispatch.transport(g, table.RECV, CUDA0) is first
    assert injected == [] and dispatch.transports_of(g) == {}
    assert dispatch.transport(g, table.ALL_REDUCE, CUDA0) is first
    assert injected == [("staged", None)] and dispatch.transports_of(g)["cuda:0"][0] == "staged"
    assert dispatch.transport(g, table.SEND, CUDA0) is first
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "mpi")  # not CUDA-aware (injected): refused, locally
    h = fake_group()
    with pytest.raises(hpccomm.OpTypeError, match=r"^hpccomm recv \(op #3 on group 'fake', rank 1/4\): CUDA "
                       r"tensors cannot be sent: HPCCOMM_GPU_TRANSPORT=mpi but the MPI library is not CUDA-aware"):
        dispatch.transport(h, table.RECV, CUDA0)
    dispatch.release(g)


def test_transport_failure_is_not_cached(injected, monkeypatch):
    monkeypatch.delenv("HPCCOMM_GPU_TRANSPORT", raising=False)
    g = fake_group()
    for _ in range(2):
        with pytest.raises(hpccomm.OpTypeError, match=r"CUDA tensors cannot be sent: no GPU transport"):
            dispatch.transport(g, table.ALL_REDUCE, CUDA0)
    assert dispatch.transports_of(g) == {}


def test_backend_map_wins(injected, monkeypatch):
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "staged")
    monkeypatch.setattr(dispatch, "_caps", [caps(torch_nccl=True)])
    monkeypatch.setitem(dispatch.BUILDERS, "nccl", lambda device, reason: SimpleNamespace(name="nccl-made",
                                                                                          reason=reason))
    g = fake_group()
    dispatch.note_backend_map(g, {"cpu": "hpccomm", "cuda": "nccl"})
    made = dispatch.transport(g, table.ALL_REDUCE, CUDA0)
    assert made.name == "nccl-made" and made.reason.startswith("the backend string maps cuda to nccl")
    h = fake_group()
    dispatch.note_backend_map(h, {"cpu": "hpccomm", "cuda": "hpccomm"})
    assert dispatch._maps.get(h) is None


# --------------------------------------------------------------------------
# the devices of a call
# --------------------------------------------------------------------------

def test_cuda_device():
    g = fake_group()
    cpu, dev = torch.ones(2), fake_cuda(torch.ones(2))
    assert dispatch.cuda_device(g, "all_reduce", ([cpu], R.SUM)) is None
    assert dispatch.cuda_device(g, "barrier", ()) is None
    assert dispatch.cuda_device(g, "all_reduce", ([dev], R.SUM)) == CUDA0
    assert dispatch.cuda_device(g, "all_gather", ([[dev, fake_cuda(torch.ones(2))]], [dev])) == CUDA0
    assert dispatch.cuda_device(g, "gather", ([], [dev], 0)) == CUDA0


@pytest.mark.parametrize("args,devices", [
    (lambda: (torch.zeros(8), fake_cuda(torch.ones(2))), "cpu, cuda:0"),
    (lambda: ([[torch.zeros(2), fake_cuda(torch.ones(2))]], [fake_cuda(torch.ones(2))]), "cpu, cuda:0"),
    (lambda: (fake_cuda(torch.zeros(8)), torch.ones(2).as_subclass(FakeCuda1Tensor)), "cuda:0, cuda:1"),
])
def test_mixed_devices_refused(args, devices):
    with pytest.raises(hpccomm.OpValueError) as info:
        dispatch.cuda_device(fake_group(), "all_gather_into_tensor", args())
    assert str(info.value) == (f"hpccomm all_gather_into_tensor (op #3 on group 'fake', rank 1/4): the call mixes "
                               f"devices ({devices}). Put every input and output of one call on the same device, "
                               "with .to(device)")


def test_host_path_still_refuses_device_tensors():
    """Called directly (not through the process group), the CPU path refuses
    a CUDA tensor and says where CUDA tensors go."""
    with pytest.raises(hpccomm.OpTypeError, match=r"tensor is on device cuda:0; this path moves CPU tensors only\. "
                       r"CUDA tensors go through torch\.distributed calls, which route them to a GPU transport "
                       r"\(docs/gpu\.md\)\. Move it to the CPU with \.cpu\(\)$"):
        reduce.all_reduce(fake_group(), [fake_cuda(torch.ones(2))], R.SUM)
    view = cuda_mpi.DeviceView(fake_group(), "cuda")
    reduce.all_reduce(view, [fake_cuda(torch.ones(2))], R.SUM)  # accepted: a plan, nothing runs


# --------------------------------------------------------------------------
# CUDA-aware MPI transport: stream ordering
# --------------------------------------------------------------------------

def test_cuda_mpi_stream_order_with_a_fake_op():
    """Event recorded at issue, waited for before the op runs, stream
    synchronised after, whether the op succeeds or fails."""
    rec = Recorder()
    made = cuda_mpi.CudaAwareMPI(CUDA0, "test", streams=rec)
    seen = {}

    def fake_plan(group, tensors, redop):
        seen["group"] = group
        rec.log.append(("plan",))
        return (lambda: rec.log.append(("mpi",)), (), None, tensors, tensors, None, None, 0)

    t = fake_cuda(torch.ones(3))
    plan = made.plan(table.OpSpec("all_reduce", fake_plan, reducing=True, first="inout"), fake_group(), ([t], R.SUM))
    assert rec.names() == ["plan", "record"]  # nothing waits at issue: async ops return at once
    assert run_plan(plan) == [t]
    # the caller's event waited for, the op's own kernels done before MPI reads, the stream idle after
    assert rec.names() == ["plan", "record", "wait", "synchronize", "mpi", "synchronize"]
    assert rec.log[2] == ("wait", "event1") and rec.log[1] == ("record", "cuda:0", "event1")
    assert seen["group"].device_type == "cuda" and seen["group"].where() == fake_group().where()

    def failing(group, tensors, redop):
        def run():
            raise RuntimeError("MPI failed")
        return (run, (), None, tensors, tensors, None, None, 0)

    rec.log.clear()
    with pytest.raises(RuntimeError):
        run_plan(made.plan(table.OpSpec("all_reduce", failing, reducing=True, first="inout"), fake_group(), ([t], R.SUM)))
    assert rec.names() == ["record", "wait", "synchronize", "synchronize"]  # the stream idle after a failure too


OPS_ON_SELF = [
    ("all_reduce", table.ALL_REDUCE, lambda t: ([t], R.SUM), lambda t: t),
    ("all_reduce-avg", table.ALL_REDUCE, lambda t: ([t], R.AVG), lambda t: t),
    ("broadcast", table.BROADCAST, lambda t: ([t], 0), lambda t: t),
    ("all_gather_into_tensor", table.ALL_GATHER_INTO_TENSOR, lambda t: (fake_cuda(torch.zeros(4)), t), None),
    ("all_to_all_single", table.ALL_TO_ALL_SINGLE, lambda t: (fake_cuda(torch.zeros(4)), t, None, None), None),
]


@pytest.mark.parametrize("name,op,args,_", OPS_ON_SELF, ids=[o[0] for o in OPS_ON_SELF])
def test_cuda_mpi_real_ops_on_self(self_group, name, op, args, _):
    """The op modules' plans run for real over MPI (one rank, MPI_COMM_SELF)
    on a fake device tensor: the buffers are handed to MPI after the running
    thread's stream is waited for (the op's own kernels), between the
    caller's event and the final synchronize."""
    rec = Recorder()
    made = cuda_mpi.CudaAwareMPI(CUDA0, "test", streams=rec)
    t = fake_cuda(torch.arange(4.0))
    out = run_plan(made.plan(op, self_group, args(t)))
    names = rec.names()
    assert names[0] == "record" and names[1] == "wait" and names[-1] == "synchronize", names
    assert "synchronize" in names[2:-1], names
    result = out[0] if isinstance(out, list) else out
    result = result[0] if isinstance(result, list) else result
    assert torch.equal(result.as_subclass(torch.Tensor), torch.arange(4.0)), result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_mpi_half_reductions_are_widened(self_group, caplog, monkeypatch, dtype):
    """16-bit reductions on the CUDA-aware MPI transport: MPI gets float32
    device buffers (hpccomm's 16-bit op computes on host memory), no host
    staging, the result rounded back into the user's tensor; said once."""
    rec = Recorder()
    made = cuda_mpi.CudaAwareMPI(CUDA0, "test", streams=rec)
    MPI = _mpi.mpi()
    t = fake_cuda(torch.tensor([1.5, 2.25, -3.0], dtype=dtype))
    with caplog.at_level(logging.INFO, logger="hpccomm"):
        avg = made.plan(table.ALL_REDUCE, self_group, ([t], R.AVG))
        out = run_plan(avg)
        premul = made.plan(table.ALL_REDUCE, self_group, ([t], dist._make_nccl_premul_sum(2.0)))
        run_plan(premul)
    assert out[0] is t
    assert torch.equal(t.as_subclass(torch.Tensor), torch.tensor([3.0, 4.5, -6.0], dtype=dtype))
    assert mpi_types(avg) == mpi_types(premul) == {MPI.FLOAT.Get_name()}  # MPI reduces float32 device buffers
    assert rec.names().count("record") == 2 and rec.names()[-1] == "synchronize"
    said = [r.getMessage() for r in caplog.records if "float16/bfloat16" in r.getMessage()]
    assert len(said) == 1 and "computed in float32 on the device" in said[0], said
    # reduce_scatter_tensor: the output is not read, the input is; the result lands in the 16-bit output
    rec.log.clear()
    o = fake_cuda(torch.zeros(3, dtype=dtype))
    i = fake_cuda(torch.tensor([0.5, 1.0, 1.5], dtype=dtype))
    run_plan(made.plan(table.REDUCE_SCATTER_TENSOR, self_group, (o, i, R.SUM)))
    assert torch.equal(o.as_subclass(torch.Tensor), torch.tensor([0.5, 1.0, 1.5], dtype=dtype))
    # a 16-bit broadcast moves bytes only: not widened
    rec.log.clear()
    bcast = made.plan(table.BROADCAST, self_group, ([fake_cuda(torch.ones(2, dtype=dtype))], 0))
    run_plan(bcast)
    assert mpi_types(bcast) == {_mpi.mpi_type(dtype).Get_name()}


# --------------------------------------------------------------------------
# staged transport: buffer reuse, copies, checks before copies
# --------------------------------------------------------------------------

def test_host_buffers_reuse():
    alloc = CountingAlloc()
    bufs = staged.HostBuffers(alloc)
    a = bufs.view(0, torch.empty(10, dtype=torch.float32))
    b = bufs.view(0, torch.empty(2, 5, dtype=torch.float32))
    assert a.data_ptr() == b.data_ptr() and b.shape == (2, 5) and b.is_contiguous()
    assert len(alloc.sizes) == 1
    bufs.view(0, torch.empty(3, dtype=torch.float64))  # 24 bytes <= 64: same slot
    assert len(alloc.sizes) == 1
    big = bufs.view(0, torch.empty(100, dtype=torch.float64))
    assert alloc.sizes == [64, 800] and big.numel() == 100
    assert bufs.view(1, torch.empty(0, dtype=torch.int8)).numel() == 0
    assert bufs.view(2, torch.empty((), dtype=torch.complex128)).shape == ()
    assert bufs.allocations == len(alloc.sizes) == 4


def test_staged_copies_and_reuse_on_self(self_group):
    rec = Recorder()
    alloc = CountingAlloc()
    made = staged.Staged(CUDA0, "test", streams=rec, alloc=alloc, copy=rec.copy)
    t = fake_cuda(torch.arange(6.0).reshape(2, 3))
    for _ in range(3):
        out = run_plan(made.plan(table.ALL_REDUCE, self_group, ([t], R.SUM)))
        assert out[0] is t  # the Work's future holds the user's tensor, not the host stand-in
    assert len(alloc.sizes) == 1, alloc.sizes  # reused, not reallocated per call
    assert rec.names() == ["record", "wait", "copy", "copy", "synchronize"] * 3
    assert torch.equal(t.as_subclass(torch.Tensor), torch.arange(6.0).reshape(2, 3))
    # an output-only argument is not copied in; a non-contiguous device output is written through its view
    rec.log.clear()
    base = fake_cuda(torch.zeros(4, 2))
    out = base[:, 0]
    src = fake_cuda(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    run_plan(made.plan(table.ALL_GATHER_INTO_TENSOR, self_group, (out, src)))
    copies = [e for e in rec.log if e[0] == "copy"]
    assert copies == [("copy", "to-host", (4,)), ("copy", "to-device", (4,))], copies
    assert torch.equal(base.as_subclass(torch.Tensor)[:, 0], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(base.as_subclass(torch.Tensor)[:, 1], torch.zeros(4))


def test_staged_refuses_before_copying():
    rec = Recorder()
    made = staged.Staged(CUDA0, "test", streams=rec, alloc=CountingAlloc(), copy=rec.copy)
    with pytest.raises(hpccomm.OpValueError, match=r"input has 5 elements, expected output's 3 × group size 4"):
        made.plan(table.REDUCE_SCATTER_TENSOR, fake_group(), (fake_cuda(torch.zeros(3)), fake_cuda(torch.zeros(5)), R.SUM))
    assert rec.log == []


def test_staged_p2p_on_self(self_group):
    """send and recv to self: own buffers (pending after return), the receive copied back on completion."""
    rec = Recorder()
    alloc = CountingAlloc()
    made = staged.Staged(CUDA0, "test", streams=rec, alloc=alloc, copy=rec.copy)
    src = fake_cuda(torch.arange(5.0))
    dst = fake_cuda(torch.zeros(5))
    r = op_path.run(self_group, table.RECV, ([dst], 0, 7), None, made.plan(table.RECV, self_group, ([dst], 0, 7)))
    s = op_path.run(self_group, table.SEND, ([src], 0, 7), None, made.plan(table.SEND, self_group, ([src], 0, 7)))
    assert s.wait() and r.wait()
    assert s._source_rank() == -1 and r._source_rank() == 0
    assert torch.equal(dst.as_subclass(torch.Tensor), torch.arange(5.0))
    assert [e[1] for e in rec.log if e[0] == "copy"] == ["to-host", "to-device"]  # the receive is not copied in


# --------------------------------------------------------------------------
# NCCL through torch: delegation
# --------------------------------------------------------------------------

class FakeNcclBackend:
    """Records the calls the NCCL transport makes (a recorder: it communicates nothing)."""

    def __init__(self, *made_with) -> None:
        self.made_with = made_with
        self.calls = []

    def __getattr__(self, name):
        if name.startswith("__") or name in ("allgather_into_tensor_coalesced",):
            raise AttributeError(name)

        def method(*args):
            self.calls.append((name, args))
            return f"work:{name}"

        return method


def _fields(opts):
    out = {}
    for name in ("rootRank", "reduceOp"):
        if hasattr(opts, name):
            value = getattr(opts, name)
            out[name] = compat.reduce_op_type(value) if name == "reduceOp" else value
    return out


T = R.RedOpType
x, y = torch.ones(2), torch.ones(4)
NCCL_CASES = [
    ("all_reduce", ([x], R.MAX), "allreduce", {"reduceOp": T.MAX}),
    ("all_reduce_coalesced", ([x, x], R.SUM), "allreduce_coalesced", {"reduceOp": T.SUM}),
    ("reduce", ([x], 2, R.MIN), "reduce", {"rootRank": 2, "reduceOp": T.MIN}),
    ("reduce_scatter", ([x], [[x, x, x, x]], R.SUM), "reduce_scatter", {"reduceOp": T.SUM}),
    ("reduce_scatter_tensor", (x, y, R.AVG), "_reduce_scatter_base", {"reduceOp": T.AVG}),
    ("broadcast", ([x], 3), "broadcast", {"rootRank": 3}),
    ("scatter", ([x], [[x, x, x, x]], 1), "scatter", {"rootRank": 1}),
    ("all_gather", ([[x, x, x, x]], [x]), "allgather", {}),
    ("all_gather_into_tensor", (y, x), "_allgather_base", {}),
    ("all_gather_coalesced", ([[x, x, x, x]], [x]), "allgather_coalesced", {}),
    ("gather", ([[x, x, x, x]], [x], 0), "gather", {"rootRank": 0}),
    ("gather_single", (torch.zeros(8), x, 0), "gather_single", {"rootRank": 0}),
    ("all_to_all", ([x] * 4, [x] * 4), "alltoall", {}),
    ("all_to_all_single", (y, y, None, [1, 1, 1, 1]), "alltoall_base", {}),
    ("send", ([x], 2, 5), "send", None),
    ("recv", ([x], 2, 5), "recv", None),
]


def test_nccl_calls_cover_every_op_with_tensors():
    from hpccomm import _methods as methods

    src = open(methods.__file__).read()
    used = set(re.findall(r'op_path\.run\(self\._g, table\.([A-Z_]+)\b', src))  # the table entries the adapter runs
    ops = {getattr(table, name).name for name in used} - {"barrier"}
    assert ops == set(table.OPS) - {"barrier"}, ops  # (every op of the table is reachable from torch)
    assert ops == set(nccl_torch.CALLS), ops ^ set(nccl_torch.CALLS)
    assert ops - {"all_reduce_coalesced", "reduce_scatter_tensor_coalesced", "all_gather_into_tensor_coalesced",
                  "reduce_scatter", "scatter", "all_gather", "all_gather_coalesced", "gather", "all_to_all",
                  "all_to_all_single"} >= set(nccl_cupy.COVERED)


@pytest.mark.parametrize("op,args,method,fields", NCCL_CASES, ids=[c[0] for c in NCCL_CASES])
def test_nccl_torch_delegation(op, args, method, fields):
    store = dist.HashStore()
    made = nccl_torch.TorchNCCL(CUDA0, "test", make_backend=FakeNcclBackend)
    g = fake_group(store=store)
    opts = compat.OPTION_CLASSES["allreduce"]()
    opts.asyncOp = True
    work = made.delegate(g, op, args, opts)
    backend = made.backend
    assert work == f"work:{method}"
    prefix, rank, size, timeout, name, ranks = backend.made_with
    assert isinstance(prefix, dist.PrefixStore) and (rank, size, timeout) == (1, 4, timedelta(seconds=42))
    assert (name, ranks) == ("hpccomm-nccl:fake", [0, 1, 2, 3])
    name, call = backend.calls[0]
    assert name == method
    if fields is None:  # send/recv: (tensors, peer, tag)
        assert call == args
        return
    given = call[-1]
    assert _fields(given) == fields, (_fields(given), fields)
    assert given.asyncOp is True  # torch's async flag is passed on
    if op == "all_to_all_single":
        assert call[2:4] == ([], [1, 1, 1, 1])


def test_nccl_torch_one_backend_per_group_and_coalesced_fallback():
    made = nccl_torch.TorchNCCL(CUDA0, "test", make_backend=FakeNcclBackend)
    g = fake_group(store=dist.HashStore())
    made.delegate(g, "all_reduce", ([x], R.SUM), None)
    first = made.backend
    work = made.delegate(g, "all_gather_into_tensor_coalesced", ([y, y], [x, x]), None)
    assert made.backend is first
    assert [c[0] for c in first.calls] == ["allreduce", "_allgather_base", "_allgather_base"]
    assert work == "work:_allgather_base"


def test_nccl_torch_refusals():
    made = nccl_torch.TorchNCCL(CUDA0, "test", make_backend=FakeNcclBackend)
    with pytest.raises(hpccomm.OpValueError, match=r"^hpccomm recv \(op #3 on group 'fake', rank 1/4\): NCCL cannot "
                       r"receive from any source\. Name the source rank"):
        made.delegate(fake_group(store=dist.HashStore()), "recv", ([x], None, 0), None)
    with pytest.raises(hpccomm.OpValueError, match="no key-value store to build NCCL on"):
        made.delegate(fake_group(), "all_reduce", ([x], R.SUM), None)
    assert made.backend is None


def test_make_nccl_backend_without_nccl():
    if compat.torch_nccl_available():
        pytest.skip("this torch has NCCL: the refusal cannot be seen here")
    with pytest.raises(RuntimeError, match="this torch has no NCCL"):
        compat.make_nccl_backend(dist.HashStore(), 0, 1)


# --------------------------------------------------------------------------
# NCCL through CuPy
# --------------------------------------------------------------------------

class FakeCupyNccl:
    """Stands in for cupy.cuda.nccl: constants, a unique id, a communicator
    recording its calls (it communicates nothing)."""

    NCCL_FLOAT32, NCCL_FLOAT64, NCCL_INT64 = 7, 8, 4
    NCCL_SUM, NCCL_MAX, NCCL_AVG = 0, 2, 4

    def __init__(self) -> None:
        self.made = []
        self.uids = 0

    def get_unique_id(self):
        self.uids += 1
        return (1, 2, 3)

    def NcclCommunicator(self, size, uid, rank):
        fake = self

        class Comm:
            def __init__(self):
                self.calls = []
                fake.made.append((size, uid, rank, self))

            def __getattr__(self, name):
                return lambda *a: self.calls.append((name, a))

        return Comm()


@pytest.mark.parametrize("rank", [0, 1])
def test_cupy_unique_id_from_rank_0(rank):
    nccl = FakeCupyNccl()
    sent = []

    def bcast(group, obj):
        sent.append(obj)
        return (1, 2, 3)

    made = nccl_cupy.CupyNCCL(CUDA0, "test", nccl=nccl, bcast=bcast, stream=lambda d: 99)
    t = torch.ones(3)
    made.delegate(fake_group(rank=rank), "all_reduce", ([t], R.MAX), None)
    made.delegate(fake_group(rank=rank), "broadcast", ([t], 1), None)
    assert nccl.uids == (1 if rank == 0 else 0) and sent == [(1, 2, 3) if rank == 0 else None]
    (size, uid, r, comm), = nccl.made
    assert (size, uid, r) == (4, (1, 2, 3), rank)
    p = t.data_ptr()
    assert comm.calls == [("allReduce", (p, p, 3, 7, 2, 99)), ("bcast", (p, 3, 7, 1, 99))]


def test_cupy_calls_and_refusals():
    nccl = FakeCupyNccl()
    made = nccl_cupy.CupyNCCL(CUDA0, "test", nccl=nccl, bcast=lambda g, o: (0,), stream=lambda d: 5)
    g = fake_group()
    out, inp = torch.zeros(8, dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    made.delegate(g, "all_gather_into_tensor", (out, inp), None)
    made.delegate(g, "reduce_scatter_tensor", (inp, out, R.AVG), None)
    made.delegate(g, "send", ([inp], 3, 0), None)
    comm = nccl.made[0][3]
    assert comm.calls == [("allGather", (inp.data_ptr(), out.data_ptr(), 2, 8, 5)),
                          ("reduceScatter", (out.data_ptr(), inp.data_ptr(), 2, 8, 4, 5)),
                          ("send", (inp.data_ptr(), 2, 8, 3, 5))]
    problems = Problems()
    for op, args, msg in [
        ("gather", ([], [inp], 0), r"gather is not available through CuPy's NCCL \(covered: all_reduce, "),
        ("all_reduce", ([torch.ones(2, dtype=torch.int8)], R.SUM), r"CuPy's NCCL has no type for torch\.int8"),
        ("all_reduce", ([inp], R.BAND), r"CuPy's NCCL has no BAND reduction"),
        ("all_reduce", ([torch.ones(4, 2)[:, 0]], R.SUM), r"needs contiguous tensors"),
        ("recv", ([inp], None, 0), r"NCCL cannot receive from any source"),
    ]:
        exc = raised_by(lambda: made.delegate(g, op, args, None))
        problems.expect(isinstance(exc, hpccomm.OpError) and re.search(msg, str(exc)), (op, msg, exc))
    fresh = nccl_cupy.CupyNCCL(CUDA0, "test", nccl=FakeCupyNccl(), bcast=lambda g, o: (0,), stream=lambda d: 5)
    for op, args, msg in [
        ("send", ([inp], 3, 0), r"CuPy's NCCL communicator is made by all members of the group together, which a "
                                r"send or receive cannot do\. Run one collective with CUDA tensors on this group"),
    ]:
        exc = raised_by(lambda: fresh.delegate(g, op, args, None))
        problems.expect(isinstance(exc, hpccomm.OpError) and re.search(msg, str(exc)), (op, msg, exc))
    problems.verdict()
    assert len(comm.calls) == 3  # refused before any call


# --------------------------------------------------------------------------
# binding ranks to GPUs
# --------------------------------------------------------------------------

class FakeCudaModule:
    def __init__(self, count: int) -> None:
        self.count = count
        self.set = []

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def set_device(self, index):
        self.set.append(index)


def test_bind_by_local_rank(monkeypatch, caplog):
    monkeypatch.delenv("HPCCOMM_GPU_BIND", raising=False)
    cuda = FakeCudaModule(4)
    assert dispatch.bind(2, 4, cuda) == {"device": 2, "how": "local rank 2 of 4 on this node, 4 GPU(s): "
                                                            "torch.cuda.set_device(2)"}
    assert cuda.set == [2] and dispatch.binding()["device"] == 2
    cuda = FakeCudaModule(2)
    with caplog.at_level(logging.WARNING, logger="hpccomm"):
        assert dispatch.bind(3, 4, cuda)["device"] == 1
    assert cuda.set == [1] and "4 ranks share 2 GPU(s)" in caplog.text


def test_future_devices():
    """A Work's future holding CUDA tensors names their device (torch requires
    it, and then orders the waiter's stream after the completing thread's)."""
    assert dispatch.future_devices(CUDA0, FakeCudaModule(2)) == [CUDA0]
    assert dispatch.future_devices(CUDA0, FakeCudaModule(0)) is None
    from hpccomm._core import work

    w = work.finished([torch.ones(1)], None)
    assert w.get_future().done() and torch.equal(w.get_future().value()[0], torch.ones(1))


def test_bind_none_and_no_gpu(monkeypatch):
    monkeypatch.setenv("HPCCOMM_GPU_BIND", "none")
    cuda = FakeCudaModule(4)
    assert dispatch.bind(1, 2, cuda) == {"device": None, "how": "HPCCOMM_GPU_BIND=none: left to the user"}
    assert cuda.set == []
    monkeypatch.delenv("HPCCOMM_GPU_BIND")
    assert dispatch.bind(1, 2, FakeCudaModule(0))["how"] == "no GPU visible (torch.cuda.is_available() is False)"


# --------------------------------------------------------------------------
# hpccomm info, backend registration, torch's backend string
# --------------------------------------------------------------------------

def test_info_dict(MPI):
    from hpccomm import gpu

    report = gpu.info()
    assert set(report) == {"mpi_cuda_aware", "mpi_cuda_aware_how", "nccl_torch", "nccl_cupy", "gpu_count",
                           "gpu_transport", "cpu_transport", "cuda_transport", "gpu_binding"}
    assert report["mpi_cuda_aware"] in ("yes", "no", "unknown")
    assert report["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not torch.cuda.is_available() and not compat.torch_nccl_available() and report["mpi_cuda_aware"] == "no":
        assert report["cuda_transport"].startswith("none: no GPU transport:"), report
    print(report)


def test_backend_registered_for_cpu_and_cuda():
    assert dist.Backend.backend_capability["hpccomm"] == ["cpu", "cuda"]


def test_requested_device_backends_reads_torchs_frame():
    class Config:
        def get_device_backend_map(self):
            return {"cpu": "hpccomm", "cuda": "nccl"}

    def _new_process_group_helper():
        backend_config = Config()  # noqa: F841 - read from the frame
        return creator()

    def creator():
        return compat.requested_device_backends()

    assert _new_process_group_helper() == {"cpu": "hpccomm", "cuda": "nccl"}
    assert creator() is None


BACKEND_MAP = '''
import torch, torch.distributed as dist
import hpccomm
from hpccomm._gpu import dispatch, probe, select
dist.init_process_group(backend=sys.argv[1], init_method="mpi://")
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
pg = dist.group.WORLD
group_of = hpccomm._compat.group_of
report(result=t.tolist(), backend=str(dist.get_backend()), is_hpccomm="hpccomm" in str(dist.get_backend(pg)),
       mapped=dispatch._maps.get(group_of(pg)))
sub = dist.new_group([0])
if rank == 0:
    report(sub_mapped=dispatch._maps.get(group_of(sub)))
class FakeCudaTensor(torch.Tensor):
    @property
    def device(self):
        return torch.device("cuda", 0)
    @property
    def is_cuda(self):
        return True
    @property
    def is_cpu(self):
        return False
dispatch._caps[0] = select.Capabilities(probe.Finding(False, "no"), probe.Finding(False, "no"),
                                        probe.Finding(False, "no"))
try:
    dist.all_reduce(torch.ones(2).as_subclass(FakeCudaTensor))
    report(cuda="no error")
except hpccomm.OpError as exc:
    report(cuda=str(exc))
dist.destroy_process_group()
'''


@pytest.mark.parametrize("backend", ["cpu:hpccomm,cuda:nccl", "hpccomm"])
def test_backend_string_with_cuda_nccl(tmp_path, backend):
    """``backend="cpu:hpccomm,cuda:nccl"``: torch 2.13 builds only hpccomm's
    group (its first backend is a whole ProcessGroup) and never NCCL, so
    hpccomm serves CPU tensors itself and sends CUDA tensors to NCCL on its
    own (refused here, where there is no NCCL, with the reason).  torch 2.15
    builds NCCL's backend at init and refuses to without a GPU (torch's
    check, gloo's group too): the job ends at once on every rank with it."""
    from test_init import mpirun, worker
    from torch.distributed import distributed_c10d

    script = worker(tmp_path, "backend_map", "import sys\n" + BACKEND_MAP)
    if backend.endswith("nccl") and hasattr(distributed_c10d, "_nccl2_device") and torch.cuda.device_count() == 0:
        # torch >= 2.15 makes the cuda:nccl backend at init and refuses without a GPU, whatever
        # the CPU backend (gloo too): the job must end at once on every rank with torch's reason.
        job = mpirun(2, script, backend)
        assert job.rc != 0 and not job.reports, job.describe()
        assert job.stderr.count("nccl2 requires at least one CUDA device") >= 2, job.describe()
        return
    job = mpirun(2, script, backend).ok(2)
    for rank in (0, 1):
        rep = job.reports[rank]
        assert rep["result"] == [3.0] * 4 and rep["is_hpccomm"], rep
        assert rep["mapped"] == ("nccl" if backend.endswith("nccl") else None), rep
        if backend.endswith("nccl"):
            assert "the backend string maps cuda to nccl but no NCCL is available" in rep["cuda"], rep
        else:
            assert "no GPU transport" in rep["cuda"], rep
    assert job.reports[0]["sub_mapped"] == job.reports[0]["mapped"]


# --------------------------------------------------------------------------
# under mpirun: the staged transport against hpccomm's CPU ops and closed forms
# --------------------------------------------------------------------------

def _world_group():
    return hgroup(dist.group.WORLD)


def _staged(made=None):
    rec = Recorder()
    alloc = CountingAlloc()
    return staged.Staged(CUDA0, "test", streams=rec, alloc=alloc, copy=rec.copy), alloc


def _plain(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, torch.Tensor) else [_plain(u) for u in t]


@pytest.mark.mpi
def test_staged_matches_cpu_ops(world):
    """Every op family through the staged transport (host copies of fake
    device tensors) gives what hpccomm's CPU op gives, and the closed form."""
    rank, n = world
    g = _world_group()
    made, alloc = _staged()
    problems = Problems()
    ranks_sum = n * (n - 1) / 2

    def via_staged(op, *args):
        return run_plan(made.plan(op, g, args))

    # all_reduce SUM, twice (buffers reused), and AVG in bfloat16
    for _ in range(2):
        t = fake_cuda(torch.arange(6.0) + rank)
        ref = torch.arange(6.0) + rank
        via_staged(table.ALL_REDUCE, [t], R.SUM)
        dist.all_reduce(ref)
        problems.expect(torch.equal(_plain(t), ref), ("all_reduce", t, ref))
        problems.expect(torch.equal(ref, torch.arange(6.0) * n + ranks_sum), ("all_reduce closed form", ref))
    allocations = len(alloc.sizes)
    h = fake_cuda(torch.full((3,), float(rank), dtype=torch.bfloat16))
    via_staged(table.ALL_REDUCE, [h], R.AVG)
    problems.expect(torch.equal(_plain(h), torch.full((3,), ranks_sum / n, dtype=torch.bfloat16)), ("avg", h))
    # broadcast from the last rank
    b = fake_cuda(torch.full((5,), float(rank)))
    via_staged(table.BROADCAST, [b], n - 1)
    problems.expect(torch.equal(_plain(b), torch.full((5,), float(n - 1))), ("broadcast", b))
    # all_gather_into_tensor and all_gather (lists)
    out = fake_cuda(torch.zeros(2 * n))
    via_staged(table.ALL_GATHER_INTO_TENSOR, out, fake_cuda(torch.full((2,), float(rank))))
    problems.expect(torch.equal(_plain(out), torch.arange(n).float().repeat_interleave(2)), ("all_gather", out))
    outs = [fake_cuda(torch.zeros(2)) for _ in range(n)]
    via_staged(table.ALL_GATHER, [outs], [fake_cuda(torch.full((2,), rank + 1.0))])
    problems.expect(all(torch.equal(_plain(o), torch.full((2,), r + 1.0)) for r, o in enumerate(outs)),
                    ("all_gather list", outs))
    # reduce_scatter_tensor, against the CPU op
    inp = torch.arange(3.0 * n) * (rank + 1)
    out, ref = fake_cuda(torch.zeros(3)), torch.zeros(3)
    via_staged(table.REDUCE_SCATTER_TENSOR, out, fake_cuda(inp.clone()), R.SUM)
    dist.reduce_scatter_tensor(ref, inp.clone())
    problems.expect(torch.equal(_plain(out), ref), ("reduce_scatter_tensor", out, ref))
    problems.expect(torch.equal(ref, torch.arange(3.0 * rank, 3.0 * rank + 3) * (n * (n + 1) / 2)),
                    ("reduce_scatter closed form", ref))
    # reduce to rank 0 (the others' tensors stay as they were)
    r = fake_cuda(torch.full((2,), rank + 1.0))
    via_staged(table.REDUCE, [r], 0, R.MAX)
    problems.expect(torch.equal(_plain(r), torch.full((2,), float(n) if rank == 0 else rank + 1.0)), ("reduce", r))
    # all_to_all_single, even split, against the CPU op
    a_in = torch.arange(2.0 * n) + 100 * rank
    a_out, a_ref = fake_cuda(torch.zeros(2 * n)), torch.zeros(2 * n)
    via_staged(table.ALL_TO_ALL_SINGLE, a_out, fake_cuda(a_in.clone()), None, None)
    dist.all_to_all_single(a_ref, a_in.clone())
    problems.expect(torch.equal(_plain(a_out), a_ref), ("all_to_all_single", a_out, a_ref))
    # gather and scatter rooted at rank 0
    gl = [fake_cuda(torch.zeros(2)) for _ in range(n)] if rank == 0 else []
    via_staged(table.GATHER, [gl] if rank == 0 else [], [fake_cuda(torch.full((2,), float(rank)))], 0)
    if rank == 0:
        problems.expect(all(torch.equal(_plain(o), torch.full((2,), float(r))) for r, o in enumerate(gl)),
                        ("gather", gl))
    so = fake_cuda(torch.zeros(2))
    sl = [[fake_cuda(torch.full((2,), r * 10.0)) for r in range(n)]] if rank == 0 else []
    via_staged(table.SCATTER, [so], sl, 0)
    problems.expect(torch.equal(_plain(so), torch.full((2,), rank * 10.0)), ("scatter", so))
    # buffers: the second all_reduce reused the first one's; later ops grew or added slots only as needed
    problems.expect(allocations == 1, ("allocations after two all_reduces", alloc.sizes))
    problems.verdict()


@pytest.mark.mpi(min_size=2)  # a ring of one: test_staged_p2p_on_self covers send to self
def test_staged_p2p_ring(world):
    rank, n = world
    g = _world_group()
    made, _ = _staged()
    src = fake_cuda(torch.full((4,), float(rank)))
    dst = fake_cuda(torch.zeros(4))
    recv_args, send_args = ([dst], (rank - 1) % n, 3), ([src], (rank + 1) % n, 3)
    r = op_path.run(g, table.RECV, recv_args, None, made.plan(table.RECV, g, recv_args))
    s = op_path.run(g, table.SEND, send_args, None, made.plan(table.SEND, g, send_args))
    s.wait(), r.wait()
    assert r._source_rank() == (rank - 1) % n
    assert torch.equal(_plain(dst), torch.full((4,), float((rank - 1) % n)))


@pytest.mark.mpi
def test_routing_through_torch_with_staged(world, monkeypatch):
    """The whole route: dist.all_reduce / dist.all_gather_into_tensor on fake
    CUDA tensors with HPCCOMM_GPU_TRANSPORT=staged: the process group sends
    them to the staged transport (agreed over MPI by the ranks), async too."""
    rank, n = world
    alloc = CountingAlloc()
    rec = Recorder()
    monkeypatch.setitem(dispatch.BUILDERS, "staged", lambda device, reason: staged.Staged(
        device, reason, streams=rec, alloc=alloc, copy=rec.copy))
    g = _world_group()
    dispatch.release(g)
    try:
        with helpers.setting("HPCCOMM_GPU_TRANSPORT", "staged"):
            t = fake_cuda(torch.full((3,), rank + 1.0))
            dist.all_reduce(t)
            work = dist.all_reduce(t, async_op=True)
            work.wait()
            out = fake_cuda(torch.zeros(n))
            dist.all_gather_into_tensor(out, fake_cuda(torch.full((1,), float(rank))))
            total = n * (n + 1) / 2
            ok = (torch.equal(_plain(t), torch.full((3,), total * n)) and
                  torch.equal(_plain(out), torch.arange(float(n))) and
                  dispatch.transports_of(g)["cuda:0"][0] == "staged" and rec.names().count("copy") == 6)
            assert ok, (t, out, rec.log, dispatch.transports_of(g))
    finally:
        dispatch.release(g)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
