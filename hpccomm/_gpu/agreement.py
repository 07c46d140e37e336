"""Choosing a group's routes for a device: every member's facts, one table.

A collective's routes are chosen once per group and device, at the group's
first collective on that device (:func:`collective_routes`): every member
brings its :class:`~hpccomm._gpu.select.Facts` (what it was told,
hpccomm._gpu.overrides; what it found, hpccomm._gpu.findings; the GPU its
tensors are on), the members exchange them over the group's communicator
(:func:`exchange`), and each computes the same table from all of them
(:func:`hpccomm._gpu.select.route_table`): so two ranks on one GPU, which
NCCL refuses, are seen by both.  The table and its reason are logged at INFO;
staging is said once per process at WARNING.  A member whose probes failed,
members told different things, or a forced route that cannot serve: the
same OpTypeError on every member, before any data moves.

A point-to-point op's route is chosen by the rank alone (:func:`p2p_route`,
:func:`hpccomm._gpu.select.p2p_route`): its peer may be anywhere in its
program, and an exchange would need every member.

What is chosen is kept on the group (hpccomm._gpu.group_routes).
"""
from __future__ import annotations

import logging

from .._core import comm_thread
from ..errors import OpTypeError
from . import binding, findings, group_routes, once, overrides, select

log = logging.getLogger("hpccomm")


def facts(group, device) -> select.Facts:
    """What this rank brings to the choice of ``group``'s routes for ``device``."""
    where, _ = findings.identify(device)
    return select.Facts.of(overrides.requested(group), overrides.mapped(group), findings.capabilities(), where,
                           overrides.forced_routes(group))


def exchange(group, mine) -> list:
    """Every member's ``mine`` (picklable), over ``group``'s communicator, in group-rank order."""
    if not comm_thread.on_it():  # (on it, nothing else uses the communicator now)
        comm_thread.flush(group)  # the comm thread must not be in MPI on this communicator meanwhile
    return group.comm.allgather(mine)


def collective_routes(group, op: str, device) -> select.Routes:
    """``group``'s routes for ``device``, chosen at its first collective
    there (``op``, which every member calls: the exchange is collective) from
    every member's facts, then kept on the group.

    :raises OpTypeError: on every member, with the same message, when no
        route can serve (nothing is kept: the next collective asks again).
    """
    state = group_routes.of(group)
    found = state.collective.get(device)
    if found is not None:
        return found
    try:
        mine = (facts(group, device), None)
    except Exception as exc:  # noqa: BLE001 - a broken probe: every member must hear why
        mine = (None, f"{type(exc).__name__}: {exc}")
    everyone = exchange(group, mine)
    failed = [(r, err) for r, (_, err) in enumerate(everyone) if err]
    try:
        if failed:
            raise select.NoTransport("; ".join(f"rank {r}: {err}" for r, err in failed))
        routes = select.route_table([f for f, _ in everyone])
    except select.NoTransport as exc:
        raise OpTypeError(op, group.where(), f"CUDA tensors cannot be sent: {exc}") from None
    with state.lock:
        state.collective[device] = routes
    log.info("hpccomm: group '%s', %s: GPU routes %s (%s)", group.name, device, routes.summary(), routes.reason)
    if select.STAGED in (routes.reduction, routes.movement) and once.first("staged"):
        log.warning("hpccomm: CUDA collectives are staged through pinned host memory (%s): every op copies its "
                    "tensors to the host and back; hpccomm info, [gpu], says what would make them faster",
                    routes.reason)
    return routes


def p2p_route(group, op: str, device) -> tuple:
    """``(route, fallback)`` of this rank's point-to-point ops on ``device``
    in ``group``, chosen alone at the first of them, then kept on the group.

    :raises OpTypeError: no route can serve (said by this rank alone).
    """
    state = group_routes.of(group)
    found = state.p2p.get(device)
    if found is not None:
        return found
    mine = facts(group, device)
    _, gpus = findings.identify(device)
    try:
        found = (select.p2p_route(mine, binding.local_size(), gpus), select.route_table([mine]).fallback)
    except select.NoTransport as exc:
        raise OpTypeError(op, group.where_p2p(), f"CUDA tensors cannot be sent: {exc}") from None
    with state.lock:
        state.p2p[device] = found
    return found


def job_routes(everyone) -> str:
    """What ``hpccomm info`` says of the routes a group of the ranks whose
    facts are ``everyone`` (one :class:`~hpccomm._gpu.select.Facts` per rank,
    in rank order) would take: ``"<summary>: <reason>"``, or ``"none: <why>"``."""
    try:
        routes = select.route_table(everyone)
    except select.NoTransport as exc:
        return f"none: {exc}"
    return f"{routes.summary()}: {routes.reason}"
