"""The transports a group makes: one per route and device, made once.

A route's name (hpccomm._gpu.select) names the strategy module that carries
it: ``mpi`` and ``composed`` (:mod:`~hpccomm._gpu.cuda_mpi`), ``staged``
(:mod:`~hpccomm._gpu.staged`), ``nccl`` (:mod:`~hpccomm._gpu.nccl_torch`),
``nccl-cupy`` (:mod:`~hpccomm._gpu.nccl_cupy`).  :func:`made` makes the
group's transport of a route for a device at its first op there and keeps
it on the group (hpccomm._gpu.group_routes: closed by its ``release``).
Tests make them over fakes of CUDA streams and NCCL (:func:`build_with`, a
supported hook).
"""
from __future__ import annotations

from . import group_routes, select
from .cuda_mpi import CudaAwareMPI
from .nccl_cupy import CupyNCCL
from .nccl_torch import TorchNCCL
from .staged import Staged

#: How each route's transport is made: ``(device, reason) -> transport``.
BUILDERS = {
    select.MPI: lambda device, reason: CudaAwareMPI(device, reason),
    select.COMPOSED: lambda device, reason: CudaAwareMPI(device, reason, composed=True),
    select.STAGED: lambda device, reason: Staged(device, reason),
    select.NCCL_TORCH: lambda device, reason: TorchNCCL(device, reason),
    select.NCCL_CUPY: lambda device, reason: CupyNCCL(device, reason),
}


def made(group, device, name: str):
    """``group``'s transport of route ``name`` for ``device``, made once."""
    state = group_routes.of(group)
    key = (device, name)
    found = state.made.get(key)
    if found is None:
        with state.lock:
            found = state.made.get(key)
            if found is None:
                build = state.builders.get(name) or BUILDERS[name]
                found = state.made[key] = build(device, f"route of group '{group.name}'")
    return found


def build_with(group, builders) -> None:
    """Make ``group``'s transports of the routes in ``builders``
    (``{route: (device, reason) -> transport}``) with those from its next op
    on; None: as always again.  Its transports made so far are closed and
    its routes made anew (hpccomm._gpu.group_routes.release).  A supported
    test hook: the routes run over fakes of CUDA streams and NCCL.

    Example::

        transports.build_with(group, {"staged": lambda device, reason: Staged(device, reason, streams=recorder)})
    """
    group_routes.release(group)
    group_routes.of(group).builders = dict(builders or {})
