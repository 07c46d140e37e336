"""The op path: how every torch call becomes MPI calls, whichever adapter
(torch 2.13's ProcessGroup or torch >= 2.14's Backend) torch called.

:func:`run` takes an op's declaration (hpccomm._ops.op.Op), its arguments and
torch's options, and returns the op's Work (hpccomm._core.work):

1. the call's shape (the op's ``key``) finds the checked :class:`~hpccomm._ops.op.Call`
   this group made of an earlier call of the same shape, one dict lookup,
   and its plan bound to that shape (``fill``, the op's ``bind``) makes this
   call's plan from its tensors' addresses; else the op's ``check`` runs (a
   refusal raises :class:`hpccomm.errors.OpError` before any communication,
   and the other ranks, which may be waiting in the op, learn of it:
   :func:`refused`), and a CPU call's :class:`Call` is kept for the next one
   (at most :data:`MAX_CHECKED` per group) with its bound plan.  **The fast
   path**: a cached call with a bound plan, blocking, on a group with nothing
   queued and nothing instrumented, its signature agreed or checked on every
   call, runs at once (hpccomm._core.execute.execute_bound: step 3's
   ``HERE``, with the steps that case takes);
2. a checked call with CUDA tensors goes to the route its group takes for
   that device and op family (hpccomm._gpu.dispatch.find: a lookup on the
   group, chosen once from every rank's findings, hpccomm._gpu.agreement):
   NCCL takes the call rewritten, or a transport makes the plan (CUDA-aware
   MPI, composed, staged); a CPU call's plan is the op's;
3. :func:`form` decides, in one place, where the plan runs: blocking in the
   calling thread (hpccomm._core.execute), queued on the comm thread, or
   posted as a nonblocking MPI call (the last two through the op's record,
   hpccomm._core.record, which the Work waits on).
"""
from __future__ import annotations

from .._core import comm_thread, debug_mode, failures, flight, signatures, state
from .._core.execute import execute, execute_bound
from .._core.plan import ICALL, NBYTES, OUTPUTS, waited
from .._core.record import OpRecord
from .._core import work
from .._gpu import delegation, detect, dispatch
from ..errors import HpccommError, OpError
from .checks import check_root

#: The largest ``async_op=True`` collective (bytes of this rank's input) that is
#: posted in its nonblocking form (with ``HPCCOMM_ASYNC_NONBLOCKING=1``).  Larger
#: ones keep the blocking form on the comm thread: with Open MPI nothing progresses
#: a posted collective until someone tests or waits, and even with the comm thread
#: waiting on it, a posted 64 MiB all_reduce overlapped compute far worse (280 ms
#: for 100 ms of communication and 60 ms of compute) than the blocking call on the
#: comm thread (110 ms): docs/benchmarks.md.  The size is equal on every rank, so
#: the form is too.
NONBLOCKING_MAX_BYTES = 64 << 10
#: Checked calls a group keeps (by shape); past it the group forgets them all and
#: starts again (a program with ever new shapes pays the checks, nothing more).
MAX_CHECKED = 4096

#: Where a call runs (:func:`form`).
HERE, POSTED, QUEUED = "here", "posted", "queued"
_BLOCKING_HERE, _POSTED = (HERE, False), (POSTED, True)


def run(g, op, args, opts=None, call=None, plan=None, devices=None):
    """Check and run ``op`` (a declaration, hpccomm._ops.op.Op) on group ``g``,
    called with ``args`` (the op's arguments: torch's, with its options'
    ReduceOp and root) and torch's options ``opts`` (``asyncOp``); returns
    its Work (see the module docstring).  ``call``, ``plan``: a checked call
    and the plan a GPU transport made of it, with ``devices`` the CUDA
    devices its Work's future names; else the op's plan of the call."""
    asynchronous = opts is not None and getattr(opts, "asyncOp", False)  # (a ReduceOp may stand for the options)
    if plan is None:
        key = op.key(args)
        call = g.checked.get(key)  # (a key of None is never stored)
        if call is None:
            call = check(g, op, args)
            routed = _routed(g, op, call, args)
            if routed is not None:  # CUDA tensors: the route of the group for their device
                return _on_device(g, op, call, args, opts, *routed)
            if key is not None and call.cacheable:
                remember(g, op, key, call, args)
        else:
            fill = call.fill
            if fill is not None:
                plan = fill(args)  # the plan bound to the call's shape (None: these tensors need op.plan's)
                if plan is not None and not (asynchronous or g.queued or g.instrumented) and \
                        (call.agreed or g.checks.agreed is None):
                    return work.finished(execute_bound(g, op, call, plan))  # the fast path
        if plan is None:
            plan = op.plan(g, call, args)
    io = None
    if g.flight is not None:  # what the flight recorder keeps: made once per cached call
        io = call.io
        if io is None:
            io = call.io = flight.tensors_io(op, args)
    where, nonblocking = form(g, op, plan, asynchronous)
    if nonblocking:
        if where is POSTED:
            record = OpRecord(g, op, plan, "p2p" if op.p2p else "collective", args[1] if op.p2p else None, devices,
                              io=io)
            record.post()
            return work.pending(record, plan[OUTPUTS])
        plan = waited(plan)  # posted and waited for where it runs
    if where is HERE:  # the latency-bound case: blocking, here
        return work.finished(execute(g, op, call, plan, None, asynchronous, io), devices)
    record = OpRecord(g, op, plan, "collective", None, devices, io=io)
    queued = work.pending(record, plan[OUTPUTS])  # (made first: its waiter more often finds the op not taken yet)
    record.queue(call, asynchronous)
    if not asynchronous:  # queued only to keep this group's issue order
        queued.wait()
    return queued


def check(g, op, args):
    """The op's checks of a call on ``g``: its :class:`~hpccomm._ops.op.Call`;
    a refusal is announced to the other ranks (:func:`refused`) and raised."""
    if g.comm is None:
        raise HpccommError(f"hpccomm {op.name} (group '{g.name}'): the process group was destroyed")
    try:
        return op.check(g, *args)  # raises OpError before any communication
    except OpError as exc:
        raise refused(g, op, exc, args[1] if op.p2p else None) from None  # the other ranks must not wait for it


def remember(g, op, key, call, args) -> None:
    """Keep checked ``call`` of ``op`` (called with ``args``) for the next
    call of its shape ``key`` on ``g``, with its plan bound to that shape (the
    op's ``bind``) and its tensors' sizes as the flight recorder keeps them
    (the key fixes them)."""
    checked = g.checked
    if len(checked) >= MAX_CHECKED:
        checked.clear()
    if op.bind is not None:
        call.fill = op.bind(g, call)
    call.io = flight.tensors_io(op, args)
    checked[key] = call


def _routed(g, op, call, args):
    """``(transport, wire, device)`` of a checked call with CUDA tensors (the
    route its group takes for that device and op family, chosen once:
    hpccomm._gpu.dispatch), None for a CPU call; a refusal (a call mixing
    devices, a route that cannot take it) is announced and raised."""
    try:
        return dispatch.find(g, op, call, args)
    except OpError as exc:
        raise refused(g, op, exc, args[1] if op.p2p else None) from None


def _on_device(g, op, call, args, opts, transport, wire, device):
    """:func:`run` for a checked call with CUDA tensors: NCCL takes the call
    rewritten into what NCCL takes (``wire``), or ``transport`` makes the plan
    of the checked call (CUDA-aware MPI, composed, staged), which runs as any."""
    if wire is not None:
        return delegation.delegated(transport, g, op, wire, opts)
    try:
        plan = transport.plan(op, g, call, args)
    except OpError as exc:
        raise refused(g, op, exc, args[1] if op.p2p else None) from None
    return run(g, op, args, opts, call, plan, detect.future_devices(device))


def form(g, op, plan, asynchronous: bool):
    """How a call of ``op`` with ``plan`` runs: ``(where, nonblocking)``.

    ``where`` is :data:`HERE` (in the calling thread, now), :data:`POSTED`
    (posted here as a nonblocking MPI call, completed through its record) or
    :data:`QUEUED` (on the comm thread, in issue order; a blocking call waits
    for it); ``nonblocking``: the op takes its nonblocking MPI form (posted,
    or posted and waited for where it runs).  Point-to-point ops are always
    posted (a peer may be anywhere in its program).  A collective takes the
    nonblocking form only for ``async_op=True`` with HPCCOMM_ASYNC_NONBLOCKING
    on, a plan that has one, at most NONBLOCKING_MAX_BYTES, outside debug
    mode and fault tolerance: all equal on every rank, since MPI never
    matches a nonblocking collective with a blocking one.  It is posted from
    the calling thread only where the every-call check is off
    (HPCCOMM_MISMATCH_CHECK first or off): that check must end before the op
    moves data, and it waits for the peers, which an ``async_op=True`` call
    must not do in the caller's thread (a rank may post an op and then serve
    a peer before that peer calls it); with the check on, the nonblocking
    form runs on the comm thread, its check there.  It is queued when
    it is async or its group has queued ops (so ops on one communicator run
    in issue order on every rank, MPI's rule), except on the comm thread (a
    callback of a completed op, such as a DDP hook: queuing behind the
    thread's own work would deadlock, it runs at once) and below
    MPI_THREAD_MULTIPLE (only the calling thread calls MPI)."""
    if op.p2p:
        return _POSTED
    if not (asynchronous or g.queued) or not comm_thread.usable():
        return _BLOCKING_HERE
    nonblocking = (asynchronous and op.nonblocking and g.nonblocking and plan[ICALL] is not None
                   and plan[NBYTES] <= NONBLOCKING_MAX_BYTES and not (g.debug or state.failures.tolerant))
    if comm_thread.on_it():
        return HERE, nonblocking
    if nonblocking and not g.queued and not g.checks.every:
        return _POSTED
    return QUEUED, nonblocking


def refused(g, op, exc: OpError, peer=None) -> OpError:
    """This rank's checks refused ``op`` (``exc``; a point-to-point op's
    ``peer``: the rank it names, which may wait); the other ranks may call it
    correctly and wait.  Returns the refusal to raise, named after the
    refused call: a collective's number on the group comes after the ops this
    rank still has queued, so they run first (a refusal found while they wait
    would otherwise name the first of them).  The other ranks learn of it:
    a collective's refusal joins their comparison of the call (the every-call
    check, hpccomm._core.signatures.refuse, or debug mode's), so every rank
    raises at once (this one its own refusal); with the comparison off, and
    for a point-to-point op, it is announced in the group's store, where a
    waiting rank's watchdog finds it within a second or two and the job ends
    with this message (the failure policy: hpccomm._core.failures.peer_refused)
    instead of waiting for the timeout."""
    if not op.p2p and g.queued and not comm_thread.on_it():
        comm_thread.flush(g)  # the ops queued before this one are numbered first, as they run
        exc = type(exc)(exc.op, g.where(), exc.what, exc.fix)
    if g.size == 1 or g.comm is None:
        return exc
    if not op.p2p and (g.debug or g.checks.every):
        seq = state.start(g, op.name + " (refused: the other ranks are told)")
        try:
            if g.debug:
                debug_mode.compare(g, None, seq, refused=exc, op=op.name)
            else:
                signatures.refuse(g, op.name, seq, exc)  # raises exc, every other rank theirs
        finally:
            state.finished(g)
    elif g.store is not None:
        announce_refusal(g, op, exc, peer)
    return exc


def announce_refusal(g, op, exc: OpError, peer=None) -> None:
    """Announce in the group's store that this rank refused ``op`` (see
    :func:`refused`), as the failure policy says
    (hpccomm._core.failures.announce_refusal): a collective to every member,
    a point-to-point op to ``peer`` when it is a rank of the group (else no
    one waits for it)."""
    if not op.p2p:
        failures.announce_refusal(g, exc)
        return
    try:
        check_root(g, op.name, peer)
    except OpError:
        return
    failures.announce_refusal(g, exc, peer)


def start_coalescing(g) -> None:
    """torch's coalescing window opens (``batch_isend_irecv``): collect the
    point-to-point ops posted until :func:`end_coalescing`."""
    g.coalescing = []


def end_coalescing(g):
    """The Work completing when every op posted since :func:`start_coalescing` has."""
    records, g.coalescing = g.coalescing or [], None
    return work.pending(OpRecord.batch(g, records, f"batch of {len(records)} point-to-point op(s) ({g.where_p2p()})"))
