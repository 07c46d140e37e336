"""The route of a CUDA call: a lookup on its group.

The op path (hpccomm._ops.op_path) has checked a call (once) and asks
:func:`find` where it goes: None for a call with no CUDA tensor (its device,
hpccomm._gpu.detect), else the transport that carries it (:func:`route`) and,
for NCCL, the call rewritten into what NCCL takes
(:mod:`hpccomm._gpu.nccl_wire`):

- a collective takes its group's route for that device and the op's family
  (reductions, the reduce_scatter ops, data movement:
  hpccomm._gpu.select.family_of), chosen once from every member's findings
  (hpccomm._gpu.agreement) and kept on the group
  (hpccomm._gpu.group_routes);
- a point-to-point op takes the route its rank chose alone;
- a call NCCL cannot take exactly goes to the group's fallback route (the
  same decision on every rank: it depends on the op, dtype and ReduceOp).

No route is found by trying another: the route is read, the transport made
once (hpccomm._gpu.transports), and no check runs again.  Each rewrite and
fallback is logged once per kind of call (its signature's op, first dtype
and ReduceOp; hpccomm._gpu.once); what each op ran last
is kept on the group (``hpccomm.gpu.taken``).
"""
from __future__ import annotations

import logging

from ..errors import OpValueError
from . import agreement, detect, group_routes, nccl_wire, once, select, transports

log = logging.getLogger("hpccomm")


def find(group, op, call, args):
    """Where checked ``call`` (hpccomm._ops.op.Call) of ``op`` (a declaration
    of hpccomm._ops.op) with ``args`` goes: None for a call with no CUDA
    tensor (the CPU path), else ``(transport, wire, device)`` (:func:`route`).

    :raises OpError: the call mixes devices (hpccomm._gpu.detect.cuda_device),
        or its route cannot take it (:func:`route`); before any communication.

    Example::

        found = find(group, op, call, args)
        if found is not None:
            transport, wire, device = found
    """
    device = detect.cuda_device(group, op, args)
    if device is None:
        return None
    transport, wire = route(group, op, device, args, call.signature)
    return transport, wire, device


def route(group, op, device, args, signature=None):
    """``(transport, wire)`` for a checked call of ``op`` (a declaration of
    hpccomm._ops.op) with ``args`` on ``device`` in ``group``: ``wire`` (the
    call as NCCL takes it, hpccomm._gpu.nccl_wire) when an NCCL transport
    takes it, else None and the transport makes the op's plan.
    ``signature``: the checked call's (hpccomm._ops.op.Signature), which the
    once-per-kind log line names (None: nothing is logged).

    :raises OpError: no route can serve, or NCCL is asked for what it cannot
        do (a receive from any source); before any communication.

    Example::

        transport, wire = route(group, registry.BY_NAME["all_reduce"], device, ([t], ReduceOp.SUM))
    """
    state = group_routes.of(group)
    if op.p2p:
        name, fallback = state.p2p.get(device) or agreement.p2p_route(group, op.name, device)
    else:
        routes = state.collective.get(device) or agreement.collective_routes(group, op.name, device)
        family = select.family_of(op)
        name, fallback = routes.of(family), routes.fallback_for(family)
    made = transports.made(group, device, name)
    if not made.delegates:
        state.ran[op.name] = name
        return made, None
    if op.any_source and args[1] is None:
        raise OpValueError(op.name, group.where_p2p(), "NCCL cannot receive from any source",
                           f"Name the source rank, or leave {select.VARIABLE} at auto (point-to-point ops then go "
                           "over MPI)")
    wire = nccl_wire.rewrite(made.ability, op, args, group.rank, group.size)
    if wire is None:  # nothing NCCL takes exactly: this call only, through the fallback
        state.ran[op.name] = f"{fallback} ({name} cannot take it exactly)"
        _say_once(group, device, signature, f"{fallback} (this call: {name} has no exact form for it)")
        return transports.made(group, device, fallback), None
    rewrites = "; ".join(wire.rewrites)
    state.ran[op.name] = f"{name} ({rewrites})" if rewrites else name
    if rewrites:
        _say_once(group, device, signature, f"{name}, {rewrites}")
    return made, wire


def _say_once(group, device, signature, how: str) -> None:
    """Log at INFO, once per kind of call in the process (its op, first dtype
    and ReduceOp: its ``signature``'s), that it goes through ``how``."""
    if signature is None:
        return
    dtype = signature.tensors[0][0] if signature.tensors else None
    redop = "".join(f" {v}" for label, v in signature.fields if label == "op")
    if once.first((signature.op, dtype, redop, how)):
        log.info("hpccomm: group '%s', %s: %s of %s%s goes through %s", group.name, device, signature.op,
                 str(dtype).replace("torch.", ""), redop, how)
