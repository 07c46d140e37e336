"""Choosing GPU routes: pure logic over the members' findings.

Which route carries a CUDA op depends on the op's family (:data:`OP_FAMILIES`,
:func:`family_of`: reductions, the reduce_scatter ops, data movement,
point-to-point), on what every member of the group
has (a CUDA-aware MPI, and how fast it reduces and moves device memory, as
measured: :mod:`hpccomm._gpu.probe`; NCCL through torch or CuPy) and on whether
two members share a GPU (NCCL refuses that).  One table decides,
:func:`route_table`, from every member's :class:`Facts`, so every member
computes the same :class:`Routes`; docs/gpu.md prints the table with the
figures it rests on.  The routes: ``mpi`` (the MPI library's own op on device
memory), ``composed`` (hpccomm's reductions composed of the library's
point-to-point messages and torch's kernels: hpccomm._ops.composed), ``nccl``
or ``nccl-cupy``, ``staged``.  ``auto`` can always serve: where neither
CUDA-aware MPI nor NCCL can, it stages through host memory (and says so).

``HPCCOMM_GPU_TRANSPORT`` (or a ``cuda:<backend>`` entry of torch's backend
string) forces one transport for every family; ``HPCCOMM_GPU_ROUTES`` (or
hpccomm.gpu.set_routes) forces the route of single families on top of either.
A forced route that cannot serve raises :class:`NoTransport` with a message
that names the fix.

Point-to-point ops involve two members, so their route is chosen by each rank
alone (:func:`p2p_route`) from what is the same on every rank (the setting,
the MPI library's answer): CUDA-aware MPI where it is, else staged; NCCL only
when forced.  Two reasons: a receive from any source cannot be matched with
NCCL's sends, and an op issued before the group's first collective could not
learn whether NCCL can serve the pair (the members' findings are exchanged at
a collective).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from .. import config
from .probe import Finding

VARIABLE = "HPCCOMM_GPU_TRANSPORT"
ROUTES_VARIABLE = "HPCCOMM_GPU_ROUTES"
#: Route names: the strategy modules of this package (``composed``: the CUDA-aware MPI transport running
#: hpccomm's composed reductions).
MPI, COMPOSED, NCCL_TORCH, NCCL_CUPY, STAGED = "mpi", "composed", "nccl", "nccl-cupy", "staged"
NCCLS = (NCCL_TORCH, NCCL_CUPY)
#: The op families a route is chosen for (an op's family: its declaration's ``reducing``, ``scatters`` and
#: ``p2p``, hpccomm._ops.op; :func:`family_of`).
OP_FAMILIES = config.GPU_FAMILIES
REDUCTION, REDUCE_SCATTER, MOVEMENT, P2P = OP_FAMILIES
#: The families that reduce (hpccomm composes these).
REDUCING = config.GPU_REDUCING


def family_of(op) -> str:
    """The family of a declared op (hpccomm._ops.op.Op): its route is its group's route of that family."""
    if op.p2p:
        return P2P
    if op.reducing:
        return REDUCE_SCATTER if op.scatters else REDUCTION
    return MOVEMENT


@dataclass(frozen=True)
class Capabilities:
    """The probes' findings on this rank."""

    mpi_cuda: Finding
    nccl_torch: Finding
    nccl_cupy: Finding
    #: whether the CUDA-aware MPI reduces on the device (hpccomm._gpu.probe.device_reductions)
    mpi_device_reductions: Finding = field(default=Finding(None, "not asked"))
    #: whether it moves device memory fast (hpccomm._gpu.probe.device_movement)
    mpi_device_movement: Finding = field(default=Finding(None, "not asked"))
    #: whether its reduce_scatter is as fast as its all_reduce (hpccomm._gpu.probe.device_reduce_scatter)
    mpi_device_reduce_scatter: Finding = field(default=Finding(None, "not asked"))


@dataclass(frozen=True)
class Facts:
    """What one member brings to the choice: its setting, its findings, and
    the GPU its tensors of this device are on (``gpu``: the node's name and
    the GPU's UUID, so that two ranks on one GPU are seen whatever their
    CUDA_VISIBLE_DEVICES)."""

    requested: str
    mapped: Optional[str]
    mpi_cuda: Optional[bool]
    mpi_device_reductions: Optional[bool]
    nccl_torch: bool
    nccl_cupy: bool
    gpu: tuple = ()
    mpi_device_movement: Optional[bool] = None
    #: per-family routes forced on top (HPCCOMM_GPU_ROUTES): sorted ``(family, route)`` pairs
    forced: tuple = ()
    #: whether its reduce_scatter keeps up with its all_reduce (False: the reduce_scatter ops are composed)
    mpi_device_reduce_scatter: Optional[bool] = None

    @classmethod
    def of(cls, requested: str, mapped: Optional[str], caps: Capabilities, gpu: tuple = (),
           forced: tuple = ()) -> "Facts":
        return cls(requested, mapped, caps.mpi_cuda.value, caps.mpi_device_reductions.value,
                   bool(caps.nccl_torch.value), bool(caps.nccl_cupy.value), tuple(gpu),
                   caps.mpi_device_movement.value, tuple(sorted(forced)), caps.mpi_device_reduce_scatter.value)


@dataclass(frozen=True)
class Routes:
    """The transport of each op family for a group's tensors on one device,
    and ``fallback``: where a call an NCCL route cannot take goes (a dtype or
    ReduceOp NCCL lacks with no exact rewrite: hpccomm._gpu.nccl_wire).
    ``reduce_scatter``: the route of the reductions that scatter (an op
    declared ``scatters``; left out: ``reduction``'s).
    ``reason`` says why, for the log and ``hpccomm info``."""

    reduction: str
    movement: str
    p2p: str
    fallback: str
    reason: str
    reduce_scatter: str = ""

    def __post_init__(self) -> None:
        if not self.reduce_scatter:
            object.__setattr__(self, "reduce_scatter", self.reduction)

    def of(self, family: str) -> str:
        return getattr(self, family)

    def fallback_for(self, family: str) -> str:
        """Where a call of ``family`` an NCCL route cannot take goes: reductions
        to hpccomm's composition rather than a library that reduces on the host."""
        if family in REDUCING and self.fallback == MPI and self.of(family) != MPI:
            return COMPOSED
        return self.fallback

    def names(self) -> tuple:
        """Every transport these routes use (each made once per group and device)."""
        return tuple(dict.fromkeys((self.reduction, self.movement, self.p2p, self.fallback, self.reduce_scatter)))

    def summary(self) -> str:
        """``reduction: nccl, movement: mpi, p2p: mpi (fallback mpi)``; ``reduction: mpi (reduce_scatter:
        composed), ...`` where the reduce_scatter ops take another route."""
        scatter = f" (reduce_scatter: {self.reduce_scatter})" if self.reduce_scatter != self.reduction else ""
        return (f"reduction: {self.reduction}{scatter}, movement: {self.movement}, p2p: {self.p2p} "
                f"(fallback {self.fallback})")


class NoTransport(Exception):
    """No GPU transport can serve the request; the message says why and what to set."""


def _word(value) -> str:
    return "unknown" if value is None else ("yes" if value else "no")


def shared_gpus(facts: Sequence[Facts]) -> list:
    """Groups of member indexes whose tensors are on one GPU (same node, same
    GPU), each of two or more: ``[[0, 1], [2, 3]]``.  Members that did not
    say (``gpu`` empty) are not counted."""
    by_gpu: dict = {}
    for i, f in enumerate(facts):
        if f.gpu:
            by_gpu.setdefault(f.gpu, []).append(i)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def _nccl_name(facts: Sequence[Facts]) -> Optional[str]:
    if all(f.nccl_torch for f in facts):
        return NCCL_TORCH
    if all(f.nccl_cupy for f in facts):
        return NCCL_CUPY
    return None


def _sharing(shared: list) -> str:
    return "; ".join(f"ranks {', '.join(map(str, ranks))} share one GPU" for ranks in shared)


def route_table(facts: Sequence[Facts]) -> Routes:
    """The group's routes from every member's facts (the same on every member).

    Raises :class:`NoTransport` when the members' settings differ or a forced
    route cannot serve.  ``auto``:

    ===============================  ==========  =============  =========
    what every member has            reductions  data movement  p2p
    ===============================  ==========  =============  =========
    CUDA-aware MPI reducing on the   mpi         mpi            mpi
    device (Intel MPI, offload on)   (nccl if NCCL can serve and the
                                     library moves data slowly: movement;
                                     reduce_scatter composed where the
                                     library's own is slow: Intel MPI)
    CUDA-aware MPI, NCCL can serve   nccl        mpi            mpi
    CUDA-aware MPI, NCCL cannot      composed    mpi            mpi
    NCCL can serve, MPI not aware    nccl        nccl           staged
    neither                          staged      staged         staged
    ===============================  ==========  =============  =========

    Example::

        >>> f = Facts("auto", None, True, False, True, False, ("node0", "GPU-a"))
        >>> g = Facts("auto", None, True, False, True, False, ("node0", "GPU-b"))
        >>> route_table([f, g]).summary()
        'reduction: nccl, movement: mpi, p2p: mpi (fallback mpi)'
    """
    settings = {(f.requested, f.mapped, f.forced) for f in facts}
    if len(settings) > 1:
        listed = ", ".join(f"rank {r}: {f.requested}" + (f" (backend string cuda:{f.mapped})" if f.mapped else "")
                           + (f" ({ROUTES_VARIABLE} {_forced_text(f.forced)})" if f.forced else "")
                           for r, f in enumerate(facts))
        raise NoTransport(f"the ranks of this group asked for different GPU transports ({listed}). "
                          f"Give every rank the same {VARIABLE}, {ROUTES_VARIABLE} and backend string")
    answers = {f.mpi_cuda for f in facts}
    if len(answers) > 1:
        listed = ", ".join(f"rank {r}: {_word(f.mpi_cuda)}" for r, f in enumerate(facts))
        raise NoTransport(f"the ranks of this group disagree on whether the MPI library is CUDA-aware ({listed}): "
                          "their point-to-point ops would not match. Run every rank with the same MPI library "
                          "and settings")
    routes = _table(facts)
    forced = facts[0].forced
    if not forced:
        return routes
    chosen = {family: routes.of(family) for family in OP_FAMILIES}
    named = dict(forced)
    if REDUCTION in named and REDUCE_SCATTER not in named:
        chosen[REDUCE_SCATTER] = ""  # (a forced reduction route rules the reduce_scatter ops too)
    for family, name in forced:
        _can_serve(facts, name, f"{ROUTES_VARIABLE} {family}={name}", family)
        chosen[family] = _nccl_name(facts) if name in NCCLS else name
    return Routes(chosen[REDUCTION], chosen[MOVEMENT], chosen[P2P], routes.fallback,
                  f"{routes.reason}; {ROUTES_VARIABLE} forces {_forced_text(forced)}", chosen[REDUCE_SCATTER])


def _forced_text(forced) -> str:
    return ",".join(f"{family}={name}" for family, name in forced)


def _can_serve(facts: Sequence[Facts], name: str, why: str, family: str = "") -> None:
    """Raise :class:`NoTransport` when route ``name`` cannot serve these members."""
    if name in (MPI, COMPOSED):
        if facts[0].mpi_cuda is False:
            raise NoTransport(f"{why} but the MPI library is not CUDA-aware. Use a CUDA-aware MPI build (see "
                              f"hpccomm info, [gpu]), or set {VARIABLE}=auto")
        if name == COMPOSED and family not in ("", *REDUCING):
            raise NoTransport(f"{why}: hpccomm composes reductions only; choose mpi, nccl or staged for {family}")
    elif name in NCCLS or name == "nccl":
        if _nccl_name(facts) is None:
            raise NoTransport(f"{why} but NCCL is not available on every rank (torch's NCCL: "
                              f"{_listed(facts, 'nccl_torch')}; CuPy's: {_listed(facts, 'nccl_cupy')}). Install a "
                              f"torch built with CUDA, or cupy (the 'cuda' extra), or set {VARIABLE}=auto")
        shared = shared_gpus(facts)
        if shared:
            raise NoTransport(f"{why} but {_sharing(shared)}, and NCCL refuses two ranks on one GPU. Set "
                              f"{VARIABLE}=auto (CUDA-aware MPI or staging serve shared GPUs), or run at most one "
                              "rank per GPU")
    elif name != STAGED:
        raise NoTransport(f"{why}: {name!r} is not one of mpi, composed, nccl, staged")


def _table(facts: Sequence[Facts]) -> Routes:
    """The routes of the setting (:func:`route_table` before per-family routes are forced)."""
    requested, mapped = facts[0].requested, facts[0].mapped
    mpi_cuda = facts[0].mpi_cuda
    shared = shared_gpus(facts)
    nccl = _nccl_name(facts)
    fallback = MPI if mpi_cuda else STAGED
    if mapped is not None or requested == NCCL_TORCH:
        why = "the backend string maps cuda to nccl" if mapped is not None else f"{VARIABLE}=nccl"
        if mapped not in (None, "nccl"):
            raise NoTransport(f"the backend string maps cuda to '{mapped}', which hpccomm cannot hand CUDA "
                              f"tensors to (torch builds only the first backend when one is a Python process "
                              f"group). Use 'cuda:nccl', or 'hpccomm' alone with {VARIABLE}")
        _can_serve(facts, NCCL_TORCH, why)
        return Routes(nccl, nccl, nccl, fallback, f"{why}: {nccl} for every op; what NCCL lacks goes to {fallback}")
    if requested == STAGED:
        return Routes(STAGED, STAGED, STAGED, STAGED, f"{VARIABLE}=staged: copies through pinned host memory")
    if requested in (MPI, COMPOSED):
        _can_serve(facts, requested, f"{VARIABLE}={requested}")
        how = "trusted: the library could not be asked" if mpi_cuda is None else "CUDA-aware MPI"
        reduction = "its own reductions" if requested == MPI else "hpccomm's composed reductions"
        return Routes(requested, MPI, MPI, MPI, f"{VARIABLE}={requested} ({how}; {reduction})")
    if requested != "auto":
        raise NoTransport(f"{VARIABLE}={requested!r} is not one of auto, mpi, composed, nccl, staged")
    can_nccl = nccl is not None and not shared
    why_not_nccl = ("no NCCL on every rank" if nccl is None else _sharing(shared)) if not can_nccl else ""
    if mpi_cuda:
        on_device = all(f.mpi_device_reductions for f in facts)
        slow_movement = any(f.mpi_device_movement is False for f in facts)
        movement = nccl if can_nccl and slow_movement else MPI
        moving = (f"data movement through {nccl} (the MPI library moves device memory slowly)"
                  if movement != MPI else "data movement and point-to-point through CUDA-aware MPI")
        if on_device:
            slow_scatter = any(f.mpi_device_reduce_scatter is False for f in facts)
            scatter = ("; reduce_scatter composed of its point-to-point messages and torch's kernels (the "
                       "library's own reduce_scatter of device memory is slow)") if slow_scatter else ""
            return Routes(MPI, movement, MPI, MPI, f"{VARIABLE}=auto: reductions through CUDA-aware MPI (it reduces "
                                                   f"on the device){scatter}; {moving}",
                          COMPOSED if slow_scatter else "")
        known = "reduces on the host" if any(f.mpi_device_reductions is False for f in facts) else \
            "is not known to reduce on the device"
        if can_nccl:
            return Routes(nccl, movement, MPI, MPI, f"{VARIABLE}=auto: reductions through {nccl} (the MPI library "
                                                    f"{known}); {moving}")
        return Routes(COMPOSED, MPI, MPI, MPI, f"{VARIABLE}=auto: reductions composed of CUDA-aware MPI's "
                                               f"point-to-point messages and torch's kernels (the MPI library "
                                               f"{known}; NCCL cannot serve: {why_not_nccl}); {moving}")
    if can_nccl:
        return Routes(nccl, nccl, STAGED, STAGED,
                      f"{VARIABLE}=auto: MPI is not CUDA-aware, so collectives through {nccl}; point-to-point "
                      "ops staged (a receive from any source cannot match NCCL's sends; "
                      f"{VARIABLE}=nccl sends them through NCCL)")
    return Routes(STAGED, STAGED, STAGED, STAGED,
                  f"{VARIABLE}=auto: MPI is not CUDA-aware and NCCL cannot serve ({why_not_nccl}): every op "
                  "staged through host memory (slow)")


def _listed(facts: Sequence[Facts], name: str) -> str:
    values = {getattr(f, name) for f in facts}
    if len(values) == 1:
        return "every rank " + ("has it" if values.pop() else "lacks it")
    return ", ".join(f"rank {r}: {_word(getattr(f, name))}" for r, f in enumerate(facts))


def p2p_route(mine: Facts, local_size: int = 1, gpus: int = 0) -> str:
    """The point-to-point route this rank takes alone (see the module
    docstring): what :func:`route_table` gives for p2p, from this rank's facts.
    ``local_size``/``gpus``: ranks and GPUs on this node, so that a forced
    NCCL on shared GPUs is refused here as it would be at a collective.
    Raises :class:`NoTransport`."""
    routes = route_table([mine])
    if routes.p2p in NCCLS and gpus and local_size > gpus:
        raise NoTransport(f"{'the backend string maps cuda to nccl' if mine.mapped else VARIABLE + '=nccl'} but "
                          f"{local_size} ranks share {gpus} GPU(s) on this node, and NCCL refuses two ranks on one "
                          f"GPU. Set {VARIABLE}=auto (CUDA-aware MPI or staging serve shared GPUs), or run at most "
                          "one rank per GPU")
    return routes.p2p
