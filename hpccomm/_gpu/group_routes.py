"""A group's CUDA routes, held on the group (its attribute ``gpu``).

Everything hpccomm knows about how a group's CUDA tensors travel is one
:class:`GroupRoutes`, made at the group's first CUDA op or setting
(:func:`of`) and kept on the group (hpccomm._core.group.Group.gpu), so that
it goes with the group: what the group was told (hpccomm._gpu.overrides),
the routes it chose per device (hpccomm._gpu.agreement), the transports it
made (hpccomm._gpu.transports) and what each op ran last
(hpccomm._gpu.dispatch).  :func:`release` forgets what was chosen and closes
what was made (the group is destroyed, or told anew).

Threads: a group's CUDA ops are issued by the user's threads; what is made
once (a device's routes, a transport) is stored under the group's lock, and
read without it (a dict lookup).
"""
from __future__ import annotations

import logging
import threading

log = logging.getLogger("hpccomm")

_making = threading.Lock()  # (held only while a group's GroupRoutes is made)


class GroupRoutes:
    """One group's CUDA routes.

    What it was told (hpccomm._gpu.overrides): ``transport``
    (hpccomm.gpu.set_transport's, or None: HPCCOMM_GPU_TRANSPORT), ``forced``
    (hpccomm.gpu.set_routes's per-family routes, or None:
    HPCCOMM_GPU_ROUTES), ``mapped`` (the backend torch's backend string
    names for cuda, ``"nccl"``, or None).  What it chose and made:
    ``collective`` (``{device: select.Routes}``, agreed by every member at its
    first collective there), ``p2p`` (``{device: (route, fallback)}``, this
    rank's choice), ``made`` (``{(device, route): transport}``), ``ran``
    (``{op name: what its last CUDA call ran}``).  ``builders``: transports
    made otherwise (``{route: (device, reason) -> transport}``, a supported
    test hook: hpccomm._gpu.transports.build_with).
    """

    __slots__ = ("transport", "forced", "mapped", "collective", "p2p", "made", "ran", "builders", "lock")

    def __init__(self) -> None:
        self.transport = self.forced = self.mapped = None
        self.collective, self.p2p, self.made, self.ran, self.builders = {}, {}, {}, {}, {}
        self.lock = threading.Lock()


def of(group) -> GroupRoutes:
    """``group``'s :class:`GroupRoutes`, made on first use."""
    found = group.gpu
    if found is None:
        with _making:
            found = group.gpu
            if found is None:
                found = group.gpu = GroupRoutes()
    return found


def release(group) -> None:
    """Forget the routes ``group`` chose and what its ops ran, and close the
    transports it made (its NCCL communicators): when it is destroyed, or
    told another transport or route; what it was told stays."""
    state = group.gpu
    if state is None:
        return
    with state.lock:
        made = list(state.made.values())
        state.made, state.collective, state.p2p, state.ran = {}, {}, {}, {}
    for transport in made:
        close = getattr(transport, "close", None)
        if close is None:
            continue
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - destroying: report, keep going
            log.warning("hpccomm: closing the %s transport of group '%s' failed: %s", transport.name, group.name,
                        exc)


def routes_of(group) -> dict:
    """``{device: select.Routes}`` chosen so far by ``group``'s collectives,
    and ``{"p2p:<device>": route}`` of its point-to-point ops."""
    state = group.gpu
    if state is None:
        return {}
    out = {str(d): r for d, r in state.collective.items()}
    out.update({f"p2p:{d}": name for d, (name, _) in state.p2p.items()})
    return out


def taken(group) -> dict:
    """``{op name: route}``: the route the last CUDA call of each op took on ``group``."""
    state = group.gpu
    return {} if state is None else dict(state.ran)
