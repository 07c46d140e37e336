"""Routing CUDA tensors to GPU transports, per group, device and op family.

The op path (hpccomm._ops.op_path) asks :func:`cuda_device` for every op that
meets a device tensor: None (no CUDA tensor: hpccomm's CPU path), the one CUDA
device of the call, or an :class:`~hpccomm.errors.OpValueError` for a call that
mixes devices, raised before any communication.  :func:`route` then gives the
transport that carries the call and, for NCCL, the call rewritten into what
NCCL takes (:mod:`hpccomm._gpu.nccl_wire`):

- a collective's route comes from the group's route table for that device
  (:func:`hpccomm._gpu.select.route_table`), made at the group's first
  collective on the device from every member's findings, exchanged over the
  group's communicator, so every member computes the same table; its reason is
  logged at INFO and staging is said once at WARNING;
- a point-to-point op's route is chosen by the rank alone
  (:func:`hpccomm._gpu.select.p2p_route`);
- a call NCCL cannot take exactly goes to the group's fallback route (the
  same decision on every rank: it depends on the op, dtype and ReduceOp).

Each route and rewrite is logged once per kind; :func:`routes_of` and
:func:`taken` say what was chosen and what ran (``hpccomm.gpu``).

Binding ranks to GPUs (:func:`bind_later`) touches nothing of CUDA: it asks
torch to run the binding when the process first initialises CUDA, so a CPU job
never makes a CUDA context.
"""
from __future__ import annotations

import logging
import socket
import threading
import weakref

import torch

from .. import config
from .. import _compat as compat
from .._core import comm_thread, work
from ..errors import OpTypeError, OpValueError
from . import nccl_wire, probe, select
from .cuda_mpi import CudaAwareMPI
from .tensors import tensors_in
from .nccl_cupy import CupyNCCL
from .nccl_torch import TorchNCCL
from .staged import Staged

log = logging.getLogger("hpccomm")
_Tensor = torch.Tensor

_lock = threading.Lock()
_tables: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> {device: Routes}
_p2p: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> {device: transport name}
_made: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> {(device, name): transport}
_forced: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> transport set by set_transport
_forced_routes: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> routes set by set_routes
_maps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> backend torch's string names for cuda
_ran: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> {op name: route that ran last}
_said: set = set()  # route kinds already logged
_caps = [None]
_node: dict = {"local_rank": 0, "local_size": 1}
_binding: dict = {"device": None, "how": "not bound: no world group made"}


# --------------------------------------------------------------------------
# the devices of a call
# --------------------------------------------------------------------------

def _any_cuda(items) -> bool:
    """Whether any tensor among ``items`` (nested lists and tuples) is on a GPU."""
    for a in items:
        if isinstance(a, _Tensor):
            if a.is_cuda:
                return True
        elif isinstance(a, (list, tuple)) and _any_cuda(a):
            return True
    return False


def cuda_device(group, op, args):
    """The CUDA device of the call's tensors (a call of ``op``, a declaration
    of hpccomm._ops.op), or None if it has none.

    Raises OpValueError when the call mixes devices (a CPU input and a CUDA
    output, or two GPUs): checked before any communication.
    """
    if not _any_cuda(args):
        return None  # no CUDA tensor: the CPU path (whose checks refuse other devices)
    devices = {t.device for t in tensors_in(args)}
    if len(devices) == 1:
        (device,) = devices
        return device
    listed = ", ".join(sorted(str(d) for d in devices))
    raise OpValueError(op.name, group.where_p2p() if op.p2p else group.where(), f"the call mixes devices ({listed})",
                       "Put every input and output of one call on the same device, with .to(device)")


# --------------------------------------------------------------------------
# findings
# --------------------------------------------------------------------------

def capabilities() -> select.Capabilities:
    """This process's probe findings, asked once (MPI must be up)."""
    if _caps[0] is None:
        from .. import _mpi

        MPI = _mpi.mpi()
        cuda_aware = probe.probe_mpi_cuda(MPI)
        _caps[0] = select.Capabilities(cuda_aware, probe.probe_nccl_torch(compat.torch_nccl_available),
                                       probe.probe_nccl_cupy(), *probe.probe_device_speed(MPI, cuda_aware))
    return _caps[0]


def _identify(device) -> tuple:
    """``((node, GPU), GPUs on the node)`` of ``device``: the GPU's UUID (so
    ranks on one GPU are seen whatever their CUDA_VISIBLE_DEVICES); ``((), 0)``
    where CUDA is not up (no GPU to tell apart)."""
    if not torch.cuda.is_available():
        return (), 0
    props = torch.cuda.get_device_properties(device)
    gpu = str(getattr(props, "uuid", "") or getattr(props, "pci_bus_id", "") or device.index)
    return (socket.gethostname(), gpu), torch.cuda.device_count()


#: Replaceable for tests without a GPU: ``device -> ((node, gpu), GPUs on the node)``.
identify = _identify


def requested(group) -> str:
    """The transport asked for ``group``: hpccomm.gpu.set_transport's, else HPCCOMM_GPU_TRANSPORT."""
    return _forced.get(group) or config.get("HPCCOMM_GPU_TRANSPORT")


def note_backend_map(group, device_backends) -> None:
    """Remember the backend torch's backend string names for cuda when
    ``group`` was made (``"cpu:hpccomm,cuda:nccl"``: ``"nccl"``)."""
    cuda = (device_backends or {}).get("cuda")
    if cuda is not None and cuda.lower() != "hpccomm":
        _maps[group] = cuda.lower()


def forced_routes(group) -> tuple:
    """The per-family routes forced for ``group``: hpccomm.gpu.set_routes's, else HPCCOMM_GPU_ROUTES."""
    found = _forced_routes.get(group)
    return found if found is not None else config.get("HPCCOMM_GPU_ROUTES")


def _facts(group, device) -> select.Facts:
    where, _ = identify(device)
    return select.Facts.of(requested(group), _maps.get(group), capabilities(), where, forced_routes(group))


def _agree(group, mine):
    """Every member's ``mine`` (picklable), over the group's communicator."""
    if not comm_thread.on_it():  # (on it, nothing else uses the communicator now)
        comm_thread.flush(group)  # the comm thread must not be in MPI on this communicator meanwhile
    return group.comm.allgather(mine)


#: Replaceable for tests without MPI.
agree = _agree


# --------------------------------------------------------------------------
# the route table and the transports
# --------------------------------------------------------------------------

BUILDERS = {
    select.MPI: lambda device, reason: CudaAwareMPI(device, reason),
    select.COMPOSED: lambda device, reason: CudaAwareMPI(device, reason, composed=True),
    select.STAGED: lambda device, reason: Staged(device, reason),
    select.NCCL_TORCH: lambda device, reason: TorchNCCL(device, reason),
    select.NCCL_CUPY: lambda device, reason: CupyNCCL(device, reason),
}


def table(group, op: str, device) -> select.Routes:
    """The group's routes for ``device``, made at its first collective there
    (every member calls it in the same op: a collective); OpTypeError on every
    member, with the same message, when no route can serve."""
    found = (_tables.get(group) or {}).get(device)
    if found is not None:
        return found
    try:
        mine = (_facts(group, device), None)
    except Exception as exc:  # noqa: BLE001 - a broken probe: every member must hear why
        mine = (None, f"{type(exc).__name__}: {exc}")
    everyone = agree(group, mine)
    failed = [(r, err) for r, (_, err) in enumerate(everyone) if err]
    try:
        if failed:
            raise select.NoTransport("; ".join(f"rank {r}: {err}" for r, err in failed))
        routes = select.route_table([f for f, _ in everyone])
    except select.NoTransport as exc:
        raise OpTypeError(op, group.where(), f"CUDA tensors cannot be sent: {exc}") from None
    with _lock:
        _tables.setdefault(group, {})[device] = routes
    log.info("hpccomm: group '%s', %s: GPU routes %s (%s)", group.name, device, routes.summary(), routes.reason)
    if select.STAGED in (routes.reduction, routes.movement) and "staged" not in _said:
        _said.add("staged")
        log.warning("hpccomm: CUDA collectives are staged through pinned host memory (%s): every op copies its "
                    "tensors to the host and back; hpccomm info, [gpu], says what would make them faster",
                    routes.reason)
    return routes


def _p2p_route(group, op: str, device) -> tuple:
    """``(route, fallback)`` of this rank's point-to-point ops on ``device``, chosen alone."""
    found = (_p2p.get(group) or {}).get(device)
    if found is not None:
        return found
    mine = _facts(group, device)
    _, gpus = identify(device)
    try:
        found = (select.p2p_route(mine, _node["local_size"], gpus), select.route_table([mine]).fallback)
    except select.NoTransport as exc:
        raise OpTypeError(op, group.where_p2p(), f"CUDA tensors cannot be sent: {exc}") from None
    with _lock:
        _p2p.setdefault(group, {})[device] = found
    return found


def transport_named(group, device, name: str):
    """The group's transport ``name`` for ``device``, made once."""
    key = (device, name)
    made = (_made.get(group) or {}).get(key)
    if made is None:
        with _lock:
            per = _made.setdefault(group, {})
            made = per.get(key)
            if made is None:
                made = per[key] = BUILDERS[name](device, f"route of group '{group.name}'")
    return made


def find(group, op, call, args):
    """Where checked ``call`` of ``op`` (a declaration of hpccomm._ops.op) with
    ``args`` goes: None for a call with no CUDA tensor (the CPU path), else
    ``(transport, wire, device)`` (:func:`route`).  Raises OpError before any
    communication (a call mixing devices, a route that cannot take it)."""
    device = cuda_device(group, op, args)
    if device is None:
        return None
    transport, wire = route(group, op, device, args, call.signature)
    return transport, wire, device


def route(group, op, device, args, signature=None):
    """``(transport, wire)`` for a checked call of ``op`` (a declaration of
    hpccomm._ops.op) with ``args`` on ``device``: ``wire`` (the call as NCCL
    takes it, hpccomm._gpu.nccl_wire) when an NCCL transport takes it, else None
    and the transport makes the op's plan.  The route is a lookup on the
    group's table (made once per device from every rank's findings), never
    a failed attempt at another route; ``signature``: the checked call's
    (hpccomm._ops.op.Signature), which the once-per-kind log names.  Raises
    OpError before any communication."""
    if op.p2p:
        name, fallback = _p2p_route(group, op.name, device)
    else:
        routes = table(group, op.name, device)
        family = select.REDUCTION if op.reducing else select.MOVEMENT
        name, fallback = routes.of(family), routes.fallback_for(family)
    made = transport_named(group, device, name)
    if not made.delegates:
        _record(group, op.name, name, "")
        return made, None
    if op.any_source and args[1] is None:
        raise OpValueError(op.name, group.where_p2p(), "NCCL cannot receive from any source",
                           f"Name the source rank, or leave {select.VARIABLE} at auto (point-to-point ops then go "
                           "over MPI)")
    wire = nccl_wire.rewrite(made.ability, op, args, group.rank, group.size)
    if wire is None:  # nothing NCCL takes exactly: this call only, through the fallback
        _record(group, op.name, fallback, f"{name} cannot take it exactly")
        _say_once(group, device, signature, f"{fallback} (this call: {name} has no exact form for it)")
        return transport_named(group, device, fallback), None
    _record(group, op.name, name, "; ".join(wire.forms))
    if wire.forms:
        _say_once(group, device, signature, f"{name}, {'; '.join(wire.forms)}")
    return made, wire


def _record(group, op: str, name: str, how: str) -> None:
    _ran.setdefault(group, {})[op] = f"{name} ({how})" if how else name


def _say_once(group, device, signature, how: str) -> None:
    """Log once per kind of call (its op, first dtype and ReduceOp: its signature's) the route it took."""
    if signature is None:
        return
    dtype = signature.tensors[0][0] if signature.tensors else None
    redop = "".join(f" {v}" for label, v in signature.fields if label == "op")
    key = (signature.op, dtype, redop, how)
    if key not in _said:
        _said.add(key)
        log.info("hpccomm: group '%s', %s: %s of %s%s goes through %s", group.name, device, signature.op,
                 str(dtype).replace("torch.", ""), redop, how)


def future_devices(device, cuda=None):
    """The devices a Work's future holding tensors of ``device`` must name
    (torch requires them for CUDA tensors); None where CUDA is not up (fake
    device tensors in tests hold host memory)."""
    cuda = torch.cuda if cuda is None else cuda
    return [device] if cuda.is_available() else None


def delegated(made, group, op, wire, opts):
    """The Work of a call an NCCL transport takes, ``wire`` its rewritten form.

    A call taken as it is returns NCCL's own Work.  A rewritten one runs its
    copies in on the current stream, hands NCCL the wire tensors, makes the
    current stream wait for NCCL's Work (a stream wait, not a host block) and
    runs the steps after it there; its Work is complete from the host's view
    (as NCCL's own), its future holds the user's tensors."""
    for step in wire.before:
        step()
    out = made.delegate(group, op, wire.args, opts)
    if wire.direct and isinstance(out, compat.WorkBase):
        return out
    if isinstance(out, compat.WorkBase):
        out.wait()  # the current stream waits for NCCL: the steps after it see its result
    for step in wire.after:
        step()
    return work.finished(wire.outputs, future_devices(made.device))


def _close(group, made) -> None:
    close = getattr(made, "close", None)
    if close is not None:
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - destroying: report, keep going
            log.warning("hpccomm: closing the %s transport of group '%s' failed: %s", made.name, group.name, exc)


def release(group) -> None:
    """Close the group's transports (its NCCL communicators) and forget its
    routes (when it is destroyed, or its transport is set anew)."""
    with _lock:
        made = list((_made.pop(group, None) or {}).values())
        _tables.pop(group, None)
        _p2p.pop(group, None)
        _ran.pop(group, None)
    for m in made:
        _close(group, m)


def set_transport(group, name) -> None:
    """Force transport ``name`` (auto, mpi, composed, nccl, staged) for
    ``group``'s CUDA ops from its next op on, or (None) go back to
    HPCCOMM_GPU_TRANSPORT; the routes are made anew (hpccomm.gpu.set_transport)."""
    choices = config.OPTIONS["HPCCOMM_GPU_TRANSPORT"].choices
    if name is not None and name not in choices:
        raise ValueError(f"hpccomm.gpu.set_transport: {name!r} is not one of {', '.join(choices)}")
    release(group)
    if name is None:
        _forced.pop(group, None)
    else:
        _forced[group] = name


def set_routes(group, routes: dict) -> None:
    """Force the route of single op families (``{"reduction": "composed"}``)
    for ``group`` from its next op on, on top of its transport; ``{}``: back
    to HPCCOMM_GPU_ROUTES (hpccomm.gpu.set_routes)."""
    try:
        forced = config.OPTIONS["HPCCOMM_GPU_ROUTES"].parse(",".join(f"{k}={v}" for k, v in routes.items()))
    except ValueError as exc:
        raise ValueError(f"hpccomm.gpu.set_routes: {exc}") from None
    release(group)
    if forced:
        _forced_routes[group] = forced
    else:
        _forced_routes.pop(group, None)


def routes_of(group) -> dict:
    """``{device: Routes}`` made so far for ``group`` by its collectives, and
    ``{device: name}`` of its point-to-point ops under ``"p2p:<device>"``."""
    out = {str(d): r for d, r in (_tables.get(group) or {}).items()}
    out.update({f"p2p:{d}": n for d, (n, _) in (_p2p.get(group) or {}).items()})
    return out


def taken(group) -> dict:
    """``{op name: route}``: the route the last CUDA call of each op took on ``group``."""
    return dict(_ran.get(group) or {})


# --------------------------------------------------------------------------
# binding ranks to GPUs
# --------------------------------------------------------------------------

def bind_later(local_rank: int, local_size: int, cuda=None) -> dict:
    """Arrange this rank's GPU binding (HPCCOMM_GPU_BIND=local_rank, the
    default: GPU ``local_rank % count``) for when the process first
    initialises CUDA, touching nothing of CUDA now; or leave it (``none``, or
    CUDA already initialised: the device the user set stands).  Returns and
    remembers ``{"device": index or None, "how": sentence}``."""
    cuda = torch.cuda if cuda is None else cuda
    _node.update(local_rank=local_rank, local_size=local_size)
    mode = config.get("HPCCOMM_GPU_BIND")
    if mode == "none":
        found = {"device": None, "how": "HPCCOMM_GPU_BIND=none: left to the user"}
    elif torch.version.cuda is None and cuda is torch.cuda:
        found = {"device": None, "how": "a CPU-only torch: no GPU to bind"}
    elif cuda.is_initialized():
        index = cuda.current_device()
        found = {"device": index, "how": f"CUDA was initialised before hpccomm's init: the current device "
                                         f"(cuda:{index}) stands"}
    else:
        found = {"device": None, "how": f"not bound yet: local rank {local_rank} of {local_size} binds to GPU "
                                        f"{local_rank} modulo the GPU count when this process first uses CUDA"}
        compat.on_cuda_init(lambda: _bind_now(local_rank, local_size, cuda))
    _binding.clear()
    _binding.update(found)
    return dict(found)


def _bind_now(local_rank: int, local_size: int, cuda) -> None:
    """Run by torch as CUDA starts in this process (never raises: torch would wrap it)."""
    try:
        count = cuda.device_count()
        index = local_rank % count
        cuda.set_device(index)
        how = (f"local rank {local_rank} of {local_size} on this node, {count} GPU(s): torch.cuda.set_device({index}) "
               "when the process first used CUDA")
        _binding.update(device=index, how=how)
        if local_size > count:
            log.warning("hpccomm: %d ranks share %d GPU(s) on this node: local rank %d uses GPU %d (NCCL cannot "
                        "serve shared GPUs: collectives go over CUDA-aware MPI or staged)", local_size, count,
                        local_rank, index)
    except Exception as exc:  # noqa: BLE001
        _binding.update(device=None, how=f"binding failed: {type(exc).__name__}: {exc}")


def bind(cuda=None) -> dict:
    """Bind now (``hpccomm.gpu.bind()``): initialises CUDA, which runs the
    arranged binding; returns the binding."""
    cuda = torch.cuda if cuda is None else cuda
    if cuda.is_available():
        cuda.init()
    return binding()


def binding() -> dict:
    return dict(_binding)
