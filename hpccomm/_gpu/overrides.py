"""What a group is told about its CUDA routes, besides every member's findings.

Three things, each with a default read at init (hpccomm.config) and a
per-group setting held on the group (hpccomm._gpu.group_routes): the
transport (``HPCCOMM_GPU_TRANSPORT``, or :func:`set_transport`), the routes
of single op families forced on top (``HPCCOMM_GPU_ROUTES``, or
:func:`set_routes`), and the backend torch's backend string names for cuda
when the group was made (``"cpu:hpccomm,cuda:nccl"``: :func:`note_backend_map`).
Every member brings them to the agreement on the group's routes
(hpccomm._gpu.agreement), which refuses on every member when they differ.
A setting changed makes the routes anew, from the group's next op.
"""
from __future__ import annotations

from .. import config
from . import group_routes


def requested(group) -> str:
    """The transport asked for ``group``: hpccomm.gpu.set_transport's, else HPCCOMM_GPU_TRANSPORT."""
    state = group.gpu
    return (state is not None and state.transport) or config.get("HPCCOMM_GPU_TRANSPORT")


def forced_routes(group) -> tuple:
    """The per-family routes forced for ``group`` (sorted ``(family, route)``
    pairs): hpccomm.gpu.set_routes's, else HPCCOMM_GPU_ROUTES."""
    state = group.gpu
    found = None if state is None else state.forced
    return found if found is not None else config.get("HPCCOMM_GPU_ROUTES")


def mapped(group):
    """The backend torch's backend string named for cuda when ``group`` was
    made (``"nccl"``), or None (it named none, or hpccomm)."""
    state = group.gpu
    return None if state is None else state.mapped


def note_backend_map(group, device_backends) -> None:
    """Remember the backend torch's backend string names for cuda when
    ``group`` is made (``{"cpu": "hpccomm", "cuda": "nccl"}``: ``"nccl"``)."""
    cuda = (device_backends or {}).get("cuda")
    if cuda is not None and cuda.lower() != "hpccomm":
        group_routes.of(group).mapped = cuda.lower()


def set_transport(group, name) -> None:
    """Force transport ``name`` (auto, mpi, composed, nccl, staged) for
    ``group``'s CUDA ops from its next op on, or (None) go back to
    HPCCOMM_GPU_TRANSPORT; the routes are made anew (hpccomm.gpu.set_transport).

    :raises ValueError: ``name`` is none of those.
    """
    choices = config.OPTIONS["HPCCOMM_GPU_TRANSPORT"].choices
    if name is not None and name not in choices:
        raise ValueError(f"hpccomm.gpu.set_transport: {name!r} is not one of {', '.join(choices)}")
    group_routes.release(group)
    group_routes.of(group).transport = name


def set_routes(group, routes: dict) -> None:
    """Force the route of single op families (``{"reduction": "composed"}``)
    for ``group`` from its next op on, on top of its transport; ``{}``: back
    to HPCCOMM_GPU_ROUTES (hpccomm.gpu.set_routes).

    :raises ValueError: an unknown family or route, or a route the family cannot take.
    """
    try:
        forced = config.OPTIONS["HPCCOMM_GPU_ROUTES"].parse(",".join(f"{k}={v}" for k, v in routes.items()))
    except ValueError as exc:
        raise ValueError(f"hpccomm.gpu.set_routes: {exc}") from None
    group_routes.release(group)
    group_routes.of(group).forced = forced or None
