"""Routing CUDA tensors to a GPU transport, per group and device.

The op path (hpccomm._ops.op_path) asks :func:`cuda_device` for every op that
meets a device tensor: None (no CUDA tensor: hpccomm's CPU path), the one CUDA device
of the call, or an :class:`~hpccomm.errors.OpValueError` for a call that
mixes devices, raised before any communication.  :func:`transport` then
gives the group's transport for that device, chosen once (see
:mod:`hpccomm._gpu.select`): the members agree on it over the group's
communicator (so no rank sends over MPI while another uses NCCL), the reason
is logged at INFO, and the staged transport says so once at WARNING.
"""
from __future__ import annotations

import logging
import threading
import weakref

import torch

from .. import config
from .._core import work
from .. import _compat as compat
from ..errors import OpTypeError, OpValueError
from . import probe, select
from .cuda_mpi import CudaAwareMPI, DeviceView, tensors_in
from .nccl_cupy import CupyNCCL
from .nccl_torch import TorchNCCL
from .staged import Staged

log = logging.getLogger("hpccomm")
_Tensor = torch.Tensor

_lock = threading.Lock()
_transports: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> {device: transport}
_local: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> {device: transport} (p2p, unconfirmed)
_maps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Group -> backend torch's string names for cuda
_caps = [None]
_said_staged = [False]
_binding: dict = {"device": None, "how": "not bound yet (no world group made)"}


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


def cuda_device(group, op: str, args):
    """The CUDA device of the call's tensors, or None if it has none.

    Raises OpValueError when the call mixes devices (a CPU input and a CUDA
    output, or two GPUs): checked before any communication.  Asked for every
    op, so the CPU case is one attribute test per tensor.
    """
    if not _any_cuda(args):
        return None  # no CUDA tensor: the CPU path (whose checks refuse other devices)
    devices = {t.device for t in tensors_in(args)}
    if len(devices) == 1:
        (device,) = devices
        return device
    listed = ", ".join(sorted(str(d) for d in devices))
    raise OpValueError(op, group.where(), f"the call mixes devices ({listed})",
                       "Put every input and output of one call on the same device, with .to(device)")


# --------------------------------------------------------------------------
# choosing and building a transport
# --------------------------------------------------------------------------

def capabilities() -> select.Capabilities:
    """This process's probe findings, asked once (MPI must be up)."""
    if _caps[0] is None:
        from .. import _mpi

        _caps[0] = select.Capabilities(probe.probe_mpi_cuda(_mpi.mpi()),
                                       probe.probe_nccl_torch(compat.torch_nccl_available),
                                       probe.probe_nccl_cupy())
    return _caps[0]


def note_backend_map(group, device_backends) -> None:
    """Remember the backend torch's backend string names for cuda when
    ``group`` was made (``"cpu:hpccomm,cuda:nccl"``: ``"nccl"``)."""
    cuda = (device_backends or {}).get("cuda")
    if cuda is not None and cuda.lower() != "hpccomm":
        _maps[group] = cuda.lower()


def _agree(group, mine):
    """Every member's ``(transport or None, error or None)``, over the group's communicator."""
    from .._core import comm_thread

    if not comm_thread.on_it():  # (on it, nothing else uses the communicator now)
        comm_thread.flush(group)  # the comm thread must not be in MPI on this communicator meanwhile
    return group.comm.allgather(mine)


#: Replaceable for tests without MPI.
agree = _agree

BUILDERS = {
    select.MPI: lambda device, reason: CudaAwareMPI(device, reason),
    select.STAGED: lambda device, reason: Staged(device, reason),
    select.NCCL_TORCH: lambda device, reason: TorchNCCL(device, reason),
    select.NCCL_CUPY: lambda device, reason: CupyNCCL(device, reason),
}


def decide(group, op: str, caps: select.Capabilities, requested: str, mapped=None) -> select.Choice:
    """The members' common choice, or OpTypeError on every member (same message)."""
    try:
        choice = select.choose(requested, caps, mapped)
        mine = (choice.transport, None)
    except select.NoTransport as exc:
        choice, mine = None, (None, str(exc))
    everyone = agree(group, mine)
    failed = [(r, err) for r, (_, err) in enumerate(everyone) if err]
    if failed:
        rank, err = next(((r, e) for r, e in failed if r == group.rank), failed[0])  # this rank's own, if any
        where = "" if rank == group.rank else f" (as rank {rank} reports)"
        ranks = "" if len(failed) == len(everyone) else f" on rank(s) {[r for r, _ in failed]}"
        raise OpTypeError(op, group.where(), f"CUDA tensors cannot be sent{ranks}{where}: {err}")
    names = [t for t, _ in everyone]
    if len(set(names)) > 1:
        raise OpTypeError(op, group.where(), f"the ranks of this group chose different GPU transports "
                          f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(names))})",
                          f"Give every rank the same {select.VARIABLE} and the same MPI and NCCL")
    return choice


def transport(group, op, device):
    """The group's transport for ``device``, chosen on first use by ``op`` (an
    entry of hpccomm._ops.table); raises OpTypeError.

    A collective chooses with the members' agreement and the choice stays.
    A point-to-point op involves only two members, so it cannot ask the
    group: it chooses locally (from the same settings and findings) and its
    transport is kept apart until the group's first collective on that device
    confirms it (and then reuses it: an NCCL communicator is made once).

    The module lock guards the tables only, never the agreement (a
    collective): the comm thread may need the lock meanwhile (a DDP hook
    issuing an op), and ops on one group never choose at once (a caller
    drains the group's queued ops before agreeing, hpccomm._core.comm_thread).
    """
    per_group = _transports.get(group)
    found = per_group.get(device) if per_group else None
    if found is not None:
        return found
    requested, mapped = config.get("HPCCOMM_GPU_TRANSPORT"), _maps.get(group)
    if op.p2p:  # only some members of a group call it: no agreement (that is collective)
        with _lock:
            local = _local.setdefault(group, {})
            if device in local:
                return local[device]
        try:
            choice = select.choose(requested, capabilities(), mapped)
        except select.NoTransport as exc:
            raise OpTypeError(op.name, group.where(), f"CUDA tensors cannot be sent: {exc}") from None
        with _lock:
            made = _local.setdefault(group, {}).setdefault(device, BUILDERS[choice.transport](device, choice.reason))
    else:
        choice = decide(group, op.name, capabilities(), requested, mapped)  # collective: no lock held
        with _lock:
            per_group = _transports.setdefault(group, {})
            if device in per_group:
                return per_group[device]
            earlier = _local.setdefault(group, {}).pop(device, None)
            made = earlier if earlier is not None and earlier.name == choice.transport else \
                BUILDERS[choice.transport](device, choice.reason)
            per_group[device] = made
        if earlier is not None and earlier is not made:
            _close(group, earlier)
    log.info("hpccomm: group '%s', %s: GPU transport %s (%s)", group.name, device, made.name, choice.reason)
    if made.name == select.STAGED and not _said_staged[0]:
        _said_staged[0] = True
        log.warning("hpccomm: CUDA tensors are staged through pinned host memory (%s=staged): every op copies "
                    "its tensors to the host and back", select.VARIABLE)
    return made


def future_devices(device, cuda=None):
    """The devices a Work's future holding tensors of ``device`` must name
    (torch requires them for CUDA tensors); None where CUDA is not up (fake
    device tensors in tests hold host memory)."""
    cuda = torch.cuda if cuda is None else cuda
    return [device] if cuda.is_available() else None


def check_only(group, op, args) -> None:
    """The checks of ``op`` (an entry of hpccomm._ops.table) for a call a
    delegating transport (NCCL) will run: its plan function, over the
    group's device view, raises OpError before any communication (a plan
    function never communicates; the plan is dropped)."""
    op.plan(DeviceView(group, "cuda"), *args)


def delegated(made, group, op: str, args, opts):
    """The Work of a transport that takes the whole op (NCCL)."""
    out = made.delegate(group, op, args, opts)
    if isinstance(out, compat.WorkBase):
        return out
    # enqueued on the caller's stream: done from the host's view, as NCCL's own
    return work.finished(out, future_devices(made.device))


def _close(group, made) -> None:
    close = getattr(made, "close", None)
    if close is not None:
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - destroying: report, keep going
            log.warning("hpccomm: closing the %s transport of group '%s' failed: %s", made.name, group.name, exc)


def release(group) -> None:
    """Close the group's transports (its NCCL communicators) when it is destroyed."""
    for table in (_transports, _local):
        for made in (table.pop(group, None) or {}).values():
            _close(group, made)


def transports_of(group, p2p: bool = False) -> dict:
    """``{device: (transport, reason)}`` chosen so far for ``group`` by a
    collective (``p2p``: also those chosen by point-to-point ops alone, not
    yet confirmed by a collective)."""
    tables = [_transports] + ([_local] if p2p else [])
    return {str(d): (t.name, t.reason) for table in tables for d, t in (table.get(group) or {}).items()}


# --------------------------------------------------------------------------
# binding ranks to GPUs
# --------------------------------------------------------------------------

def bind(local_rank: int, local_size: int, cuda=None) -> dict:
    """Make GPU ``local_rank % count`` this rank's current device
    (HPCCOMM_GPU_BIND=local_rank, the default), or leave it (``none``).
    Returns and remembers ``{"device": index or None, "how": sentence}``."""
    cuda = torch.cuda if cuda is None else cuda
    mode = config.get("HPCCOMM_GPU_BIND")
    if mode == "none":
        found = {"device": None, "how": "HPCCOMM_GPU_BIND=none: left to the user"}
    elif not cuda.is_available():
        found = {"device": None, "how": "no GPU visible (torch.cuda.is_available() is False)"}
    else:
        count = cuda.device_count()
        index = local_rank % count
        cuda.set_device(index)
        found = {"device": index, "how": f"local rank {local_rank} of {local_size} on this node, {count} GPU(s): "
                                         f"torch.cuda.set_device({index})"}
        if local_size > count:
            log.warning("hpccomm: %d ranks share %d GPU(s) on this node: rank with local rank %d uses GPU %d "
                        "(NCCL refuses two ranks on one GPU)", local_size, count, local_rank, index)
    _binding.clear()
    _binding.update(found)
    return dict(found)


def binding() -> dict:
    return dict(_binding)
